"""Tests of experiment 5's verdict on hand-made bench documents."""
import unittest

import exp5


def point(keys, p99=5.0):
    return {"keys": keys, "txn_p50_ms": 3.0, "txn_p99_ms": p99, "txn_max_ms": 9.0, "msgs_per_s": 15000.0,
            "wal_bytes_per_msg": 805.0, "table_bytes": 64 * keys, "index_bytes": 32 * keys, "load_seconds": 1.0}


def expiry(layout, concurrent, rows=1000, wal=3000, table_after=None):
    e = {"layout": layout, "op": "drop partition" if layout == "partitioned" else "delete + vacuum",
         "concurrent": concurrent, "rows_removed": rows, "seconds": 0.01, "wal_bytes": wal,
         "vacuum_seconds": 0.0 if layout == "partitioned" else 0.02,
         "vacuum_wal_bytes": 0 if layout == "partitioned" else 200_000,
         "table_bytes_before": 10_000_000, "table_bytes_after": table_after or 10_000_000,
         "index_bytes_before": 5_000_000, "index_bytes_after": 5_000_000}
    if concurrent:
        e.update({"concurrent_txns": 300, "concurrent_p99_ms": 12.0})
    return e


def docs(**override):
    d = {
        "partitioned": {"points": [point(0), point(1000)],
                        "expiry": [expiry("partitioned", False, table_after=9_000_000),
                                   expiry("partitioned", True, table_after=9_500_000)]},
        "single": {"points": [point(0), point(1000, 7.0)],
                   "expiry": [expiry("single", False, wal=1_300_000), expiry("single", True, wal=1_300_000)]},
    }
    d.update(override)
    return d


class Exp5Test(unittest.TestCase):
    def failed(self, d, checkpoints=(0, 1000)):
        s = exp5.judge(d, "quick", list(checkpoints))
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def test_pass_and_the_numbers_in_the_line(self):
        self.assertEqual(self.failed(docs()), ("PASS", []))
        s = exp5.judge(docs(), "quick", [0, 1000])
        line = exp5.verdict_line(s, "res")
        self.assertIn("consume p99 5.0 ms partitioned vs 7.0 ms single", line)
        self.assertIn("a day's 1,000 keys: drop 0.01 s / 0.0 MB WAL", line)
        self.assertEqual(len(s["growth"]), 4)
        self.assertEqual(len(s["expiry"]), 4)

    def test_a_missing_checkpoint_fails(self):
        d = docs()
        d["single"]["points"] = [point(0)]
        self.assertEqual(self.failed(d)[1], ["single: measured at [0, 1000] keys"])

    def test_a_drop_that_wrote_as_much_as_the_delete_fails(self):
        d = docs()
        d["partitioned"]["expiry"][0] = expiry("partitioned", False, wal=5_000_000, table_after=9_000_000)
        self.assertEqual(self.failed(d)[1], ["drop partition wrote less WAL than delete + vacuum"])

    def test_a_drop_that_kept_its_space_or_removed_other_rows_fails(self):
        d = docs()
        d["partitioned"]["expiry"][0] = expiry("partitioned", False, rows=500)
        self.assertEqual(self.failed(d)[1], ["both layouts expired the same day of keys",
                                             "drop partition gave the space back (the table shrank)"])

    def test_no_consumption_during_expiry_fails(self):
        d = docs()
        d["single"]["expiry"][1]["concurrent_txns"] = 0
        self.assertEqual(self.failed(d)[1], ["consumption went on during each expiry"])


if __name__ == "__main__":
    unittest.main()
