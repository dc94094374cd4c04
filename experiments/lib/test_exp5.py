"""Tests of experiment 5's verdict on hand-made bench documents."""
import unittest

import exp5
from fixtures import chaos, lives, recon


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


def bloom(keys=1100, false_positives=9_900):
    return {"keys": keys, "build_seconds": 0.01, "bits": 9_600 * keys // 1000, "bytes": 1_200 * keys // 1000,
            "hashes": 7, "target_false_positive_rate": 0.01, "probes": 1_000_000,
            "false_positives": false_positives, "lookup_ns": 30.0, "transactions": 200,
            "new_txn_p50_ms": 3.0, "new_txn_p99_ms": 6.0, "duplicate_txn_p50_ms": 1.0, "duplicate_txn_p99_ms": 2.0}


def docs(**override):
    d = {
        "partitioned": {"points": [point(0), point(1000)], "bloom": bloom(),
                        "expiry": [expiry("partitioned", False, table_after=9_000_000),
                                   expiry("partitioned", True, table_after=9_500_000)]},
        "single": {"points": [point(0), point(1000, 7.0)],
                   "expiry": [expiry("single", False, wal=1_300_000), expiry("single", True, wal=1_300_000)]},
    }
    d.update(override)
    return d


def resurrect(run, recon_exit=0, doubled=0, dead=0, late=0, hits=50, after=0, applied=0, resets=1):
    """A resurrection run's row, from a hand-made chaos summary."""
    rec = recon(orders=100, doubled=doubled, clean=recon_exit == 0)
    rec["report"].update({"dead_letters": dead, "late_duplicates": late})
    c = chaos(recon_exit=recon_exit, rec=rec,
              payments=lives(counters={"inbox_hits": hits, "after_horizon": after,
                                       "applied_after_horizon": applied}),
              faults={"offset-reset": {"injected": resets}})
    return exp5.resurrection_row(run, c)


def resurrection(**override):
    runs = {"unsafe": resurrect("unsafe", recon_exit=1, doubled=40, hits=60, applied=40),
            "refused": resurrect("refused", dead=40, late=40, hits=60, after=40),
            "tied": resurrect("tied", hits=100)}
    runs.update(override)
    return [r for r in runs.values() if r is not None]


class Exp5Test(unittest.TestCase):
    def failed(self, d, checkpoints=(0, 1000), runs=None):
        s = exp5.judge(d, "quick", list(checkpoints), resurrection() if runs is None else runs)
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def test_pass_and_the_numbers_in_the_line(self):
        self.assertEqual(self.failed(docs()), ("PASS", []))
        s = exp5.judge(docs(), "quick", [0, 1000], resurrection())
        line = exp5.verdict_line(s, "res")
        self.assertIn("resurrection: 40 double charges with the refusal off (recon DRIFT), "
                      "40 late duplicates refused with it on (recon CLEAN)", line)
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

    def test_an_unsafe_run_without_a_double_charge_fails(self):
        # The reset came before anything expired: nothing to resurrect.
        runs = resurrection(unsafe=resurrect("unsafe", hits=100))
        self.assertEqual(self.failed(docs(), runs=runs)[1], [
            "unsafe (short retention, refusal off): late duplicates applied, recon DRIFT with double charges",
            "unsafe: the charge rows' own guard held (one per order); the ledger doubled"])

    def test_a_refused_run_with_a_late_first_delivery_fails(self):
        # One dead letter is no duplicate: an effect lost to a too-short retention.
        runs = resurrection(refused=resurrect("refused", recon_exit=1, dead=41, late=40, after=41))
        self.assertEqual(self.failed(docs(), runs=runs)[1], [
            "refused (short retention, refusal on): recon CLEAN, no double charge",
            "refused: every dead letter a proven late duplicate"])

    def test_a_tied_run_that_refused_or_never_reset_fails(self):
        runs = resurrection(tied=resurrect("tied", after=1, dead=1, late=1, resets=0))
        self.assertEqual(self.failed(docs(), runs=runs)[1], [
            "resurrect-tied: the group's offsets were reset once",
            "tied (retention = horizon): recon CLEAN, the inbox caught the redelivery, nothing refused"])

    def test_a_missing_or_leaky_bloom_filter_fails(self):
        name = "bloom: a filter built from every key, its false positives near the 1% asked"
        d = docs()
        d["partitioned"]["bloom"] = None
        self.assertEqual(self.failed(d)[1], [name])
        d["partitioned"]["bloom"] = bloom(false_positives=50_000)
        self.assertEqual(self.failed(d)[1], [name])
        s = exp5.judge(docs(), "quick", [0, 1000], resurrection())
        self.assertIn("a redelivered batch 1.0 ms vs new 3.0 ms (p50)", exp5.verdict_line(s, "res"))

    def test_missing_runs_fail(self):
        failed = self.failed(docs(), runs=resurrection(tied=None))[1]
        self.assertIn("resurrect-tied: the group's offsets were reset once", failed)


if __name__ == "__main__":
    unittest.main()
