"""make bench-cdc's judgement and summary (scripts/lib/bench_cdc.py).

    python3 -m unittest discover -s scripts/lib
"""

import os
import tempfile
import unittest

import bench_cdc


def events_at(rate, seconds, t0=1000.0):
    """(order id, commit time): RATE a second for SECONDS from T0."""
    return [(f"o{i}", t0 + i / rate) for i in range(rate * seconds)]


class Point(unittest.TestCase):
    def test_a_steady_relay_is_sustained_and_its_quantiles_are_its_latencies(self):
        events = events_at(100, 40)
        first = {k: int((c + 0.050) * 1e6) for k, c in events}  # 50 ms each
        out = bench_cdc.point(events, first, 1000.0, 1040.0, 100, 40)
        self.assertTrue(out["sustained"], out["why"])
        self.assertEqual(out["events"], 4000)
        self.assertEqual(out["achieved_per_s"], 100)
        self.assertAlmostEqual(out["p50_ms"], 50.0, delta=0.5)
        self.assertAlmostEqual(out["max_ms"], 50.0, delta=0.5)

    def test_a_growing_backlog_is_not_sustained(self):
        events = events_at(100, 40)
        # Each second 10% more than it can: latency grows by 0.1 s a second.
        first = {k: int((c + 0.05 + 0.1 * (c - 1000.0)) * 1e6) for k, c in events}
        out = bench_cdc.point(events, first, 1000.0, 1040.0, 100, 40)
        self.assertFalse(out["sustained"])
        self.assertIn("the backlog grew", out["why"])

    def test_rows_not_received_and_a_rate_not_reached_are_named(self):
        events = events_at(100, 40)[:3000]  # 75 rows/s of 100
        first = {k: int((c + 0.05) * 1e6) for k, c in events[:-10]}
        out = bench_cdc.point(events, first, 1000.0, 1040.0, 100, 40)
        self.assertFalse(out["sustained"])
        self.assertIn("10 rows not received", out["why"])
        self.assertIn("pgbench committed 75 rows/s of 100", out["why"])

    def test_only_the_points_own_window_counts(self):
        events = events_at(100, 40) + [("before", 990.0), ("after", 1050.0)]
        first = {k: int((c + 0.05) * 1e6) for k, c in events}
        self.assertEqual(bench_cdc.point(events, first, 1000.0, 1040.0, 100, 40)["events"], 4000)


class Receipts(unittest.TestCase):
    def test_the_first_receipt_of_each_key_at_or_after_the_start(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.tsv")
            with open(path, "w") as f:
                f.write("a\tm1\t500\nb\tm2\t2000\na\tm1\t1500\nbroken line\nb\tm2\t1800\n")
            self.assertEqual(bench_cdc.first_receipts(path, 1000), {"a": 1500, "b": 1800})


class Summary(unittest.TestCase):
    def relay(self, name, rates, p99, total):
        return {"relay": name, "highest_sustained_rate": max(rates),
                "points": [{"rate": r, "sustained": True, "p99_ms": p99, "cpu_ms_per_1000": {"relay_total": total}}
                           for r in rates]}

    def test_ratios_to_debezium_at_the_highest_rate_both_sustained(self):
        relays = {"wal": self.relay("wal", [2000, 4000, 8000], 40.0, 30.0),
                  "debezium": self.relay("debezium", [2000, 4000], 800.0, 120.0)}
        vs = bench_cdc.ratios(relays)
        self.assertEqual(vs["wal"], {"highest_sustained_rate": 2.0, "at_least": False, "at_rate": 4000, "cpu_per_event": 0.25, "p99": 0.05})
        self.assertEqual(bench_cdc.headline(vs),
                         ["wal relay vs debezium: highest sustained rate 2.0x; at 4000 rows/s: CPU per event 0.25x, p99 0.05x"])

    def test_cpu_per_event_is_the_relays_process_sessions_and_walsender(self):
        cpu = {"cores": {"kafka-connect": 0.3, "kafka": 0.5, "relay": 9.0},
               "postgres_cores_by_role": {"effectively_relay": 0.01, "walsender:effectively_relay": 0.09}}
        out = bench_cdc.cpu_ms_per_1000(cpu, "debezium", 1000)
        self.assertEqual(out, {"relay_process": 300.0, "postgres_sessions": 10.0, "walsender": 90.0,
                               "kafka": 500.0, "relay_total": 400.0})


if __name__ == "__main__":
    unittest.main()
