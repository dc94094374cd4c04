"""Tests of experiment 6's verdict: outbox lag under steady load and bursts."""
import contextlib
import io
import os
import tempfile
import unittest

import exp6
from common import write_csv, write_json

S = 1000
# steady S 10 s, burst 2×S 10 s, recovery 10 s, burst 3×S 10 s, recovery 10 s
PHASES = [("steady", 1), ("burst-2x", 2), ("recover-1", 1), ("burst-3x", 3), ("recover-2", 1)]
T0 = 1_700_000_000


def phases_csv():
    return [{"phase": n, "multiple": m, "start_unix": T0 + 10 * i, "seconds": 10} for i, (n, m) in enumerate(PHASES)]


def run(capacity=2500, steady_oldest=0.4, lost=0, writer_share=1.0):
    """The per-second samples of a relay that publishes up to CAPACITY rows/s
    under the schedule, the per-second counts and the totals."""
    samples, seconds, backlog = [], [], 0.0
    for i, (_, m) in enumerate(PHASES):
        for k in range(10):
            t = T0 + 10 * i + k
            written = m * S * writer_share
            published = min(capacity, backlog + written)
            backlog += written - published
            oldest = steady_oldest + backlog / capacity
            samples.append({"unix_s": t + 0.5, "pending_rows": round(backlog), "oldest_pending_s": round(oldest, 3),
                            "cpu_relay": 0.3, "cpu_postgres": 0.5, "cpu_kafka": 0.8, "cpu_pgbench": 0.1})
            seconds.append({"second": t, "written": round(written), "published": round(published)})
    total = sum(r["written"] for r in seconds)
    totals = {"workers": 8, "batch": 1000, "written": total, "published": total - lost, "pending": lost,
              "failed": 0, "caught_up_s": 1.0}
    latency = [{"phase": n, "rows": 1, "p50_ms": 40, "p99_ms": 300, "max_ms": 900} for n, _ in PHASES]
    return samples, seconds, totals, latency


def write_run(res, name, capacity=2500, **kw):
    d = os.path.join(res, name)
    os.makedirs(d)
    samples, seconds, totals, latency = run(capacity, **kw)
    write_csv(os.path.join(d, "phases.csv"), phases_csv())
    write_csv(os.path.join(d, "samples.csv"), samples)
    write_csv(os.path.join(d, "seconds.csv"), seconds)
    write_csv(os.path.join(d, "latency.csv"), latency)
    write_json(os.path.join(d, "totals.json"), totals)
    # Over the 10 s drain: the relay 3 s of CPU, postgres 6 s, the broker 9 s.
    write_json(os.path.join(d, "drain.json"), {
        "rows": capacity * 10, "seconds": 10,
        "cpu_before": {"hz": 100, "ticks": {"relay": 0, "postgres": 1000, "kafka": 50}},
        "cpu_after": {"hz": 100, "ticks": {"relay": 300, "postgres": 1600, "kafka": 950}}})


def tag_of(name):
    """run.sh's configuration for a directory name: w8-b1000 → 8:1000, wal-w8-b1000 → wal:8:1000."""
    mode, _, rest = name.rpartition("-w")
    if not mode:
        rest = name[1:]
    tag = rest.replace("-b", ":")
    return f"{mode}:{tag}" if mode else tag


class Exp6Test(unittest.TestCase):
    def judge(self, configs, **kw):
        with tempfile.TemporaryDirectory() as res:
            for name, capacity in configs:
                write_run(res, name, capacity, **kw)
            tags = " ".join(tag_of(n) for n, _ in configs)
            write_json(os.path.join(res, "meta.json"), {"steady_rate": S, "steady_share": 0.4, "configs": tags})
            with contextlib.redirect_stdout(io.StringIO()):
                code = exp6.main([res, "quick"])
            s = exp6.load_json(os.path.join(res, "summary.json"))
            self.assertTrue(os.path.exists(os.path.join(res, "timeline.csv")))
        return code, s, [k for k, v in s["checks"].items() if not v]

    def test_a_relay_with_headroom_passes_and_the_knee_is_between_2x_and_3x(self):
        code, s, failed = self.judge([("w8-b1000", 2500)])
        self.assertEqual((code, failed), (0, []))
        c = s["configs"][0]
        self.assertEqual((c["drain_rows_per_s"], c["flat_up_to_rows_per_s"], c["grew_at_rows_per_s"]),
                         (2500, 2000, 3000))
        self.assertEqual((c["drain_cpu_relay"], c["drain_cpu_postgres"], c["drain_cpu_kafka"]), (0.3, 0.6, 0.9))
        burst3 = next(p for p in s["phases"] if p["phase"] == "burst-3x")
        self.assertFalse(burst3["flat"])
        self.assertAlmostEqual(burst3["growth_rows_per_s"], 500, delta=1)
        self.assertEqual(burst3["pending_max"], 5000)

    def test_a_relay_slower_than_the_steady_rate_fails(self):
        # 850 rows/s against 1,000 written: the steady phase grows 150 rows/s
        # (over 10% of S) and the backlog never drains.
        code, s, failed = self.judge([("w2-b500", 850)])
        self.assertEqual(code, 1)
        self.assertIn("w2-b500: steady S = 1000 rows/s kept the backlog flat, oldest row under 2 s", failed)
        self.assertIn("w2-b500: bounded burst: by the end of recover-2 the oldest row is under 2 s again", failed)

    def test_only_the_first_configuration_is_held_to_the_slo(self):
        code, s, failed = self.judge([("w8-b1000", 2500), ("w2-b500", 850)])
        self.assertEqual((code, failed), (0, []))
        self.assertEqual(s["configs"][1]["flat_up_to_rows_per_s"], None)

    def test_configuration_names(self):
        self.assertEqual(exp6.config_name("8:1000"), "w8-b1000")
        self.assertEqual(exp6.config_name("poll:2:500"), "w2-b500")
        self.assertEqual(exp6.config_name("wal:8:1000"), "wal-w8-b1000")
        for name in ("w8-b1000", "wal-w2-b500"):
            self.assertEqual(exp6.config_name(tag_of(name)), name)

    def test_the_first_configuration_of_each_relay_mode_is_held_to_the_slo(self):
        code, s, failed = self.judge([("w8-b1000", 2500), ("w2-b500", 850), ("wal-w8-b1000", 2500),
                                      ("wal-w2-b500", 850)])
        self.assertEqual((code, failed), (0, []))
        self.assertEqual([c["mode"] for c in s["configs"]], ["poll", "poll", "wal", "wal"])
        code, _, failed = self.judge([("w8-b1000", 2500), ("wal-w8-b1000", 850)])
        self.assertEqual(code, 1)
        self.assertIn("wal-w8-b1000: steady S = 1000 rows/s kept the backlog flat, oldest row under 2 s", failed)

    def test_a_lost_row_or_a_short_load_fails(self):
        _, _, failed = self.judge([("w8-b1000", 2500)], lost=3)
        self.assertEqual(failed, ["w8-b1000: every row written was published, none failed"])
        # Quick mode (the judge here) asks for 80% of the schedule.
        _, _, failed = self.judge([("w8-b1000", 2500)], writer_share=0.75)
        self.assertEqual(failed, ["w8-b1000: the writers delivered ≥ 80% of the schedule's rows"])
        code, _, failed = self.judge([("w8-b1000", 2500)], writer_share=0.85)
        self.assertEqual((code, failed), (0, []))

    def test_a_slow_steady_phase_fails_the_slo(self):
        _, _, failed = self.judge([("w8-b1000", 2500)], steady_oldest=2.5)
        self.assertIn("w8-b1000: steady S = 1000 rows/s kept the backlog flat, oldest row under 2 s", failed)

    def test_a_missing_configuration_fails(self):
        with tempfile.TemporaryDirectory() as res:
            write_json(os.path.join(res, "meta.json"), {"steady_rate": S, "configs": "8:1000"})
            with contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(exp6.main([res, "quick"]), 1)

    def test_phase_bounds_and_sql(self):
        bounds = exp6.phase_bounds(phases_csv())
        self.assertEqual(bounds[0], ("steady", 1.0, T0, T0 + 10))
        self.assertEqual(bounds[-1], ("recover-2", 1.0, T0 + 40, T0 + 50))
        self.assertIn("('burst-3x', 1700000030.000, 1700000040.000)", exp6.phase_sql(phases_csv()))

    def test_slope(self):
        self.assertAlmostEqual(exp6.slope([(0, 1), (1, 3), (2, 5)]), 2.0)
        self.assertIsNone(exp6.slope([(0, 1)]))


if __name__ == "__main__":
    unittest.main()
