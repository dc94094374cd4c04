"""Tests of the pipeline sampler's arithmetic (no services needed)."""
import math
import time
import unittest

import sampler


class SamplerTest(unittest.TestCase):
    def test_quantile_of_bucket_deltas(self):
        before = {0.01: 10, 0.1: 10, math.inf: 10}
        # 100 new observations: 50 under 10 ms, 49 in 10..100 ms, 1 above.
        after = {0.01: 60, 0.1: 109, math.inf: 110}
        self.assertAlmostEqual(sampler.quantile(0.5, before, after), 0.01)
        self.assertAlmostEqual(sampler.quantile(0.99, before, after), 0.1)
        self.assertAlmostEqual(sampler.quantile(0.25, before, after), 0.005)
        self.assertIsNone(sampler.quantile(0.5, after, after), "nothing observed")
        # A restart (counters went down) counts from zero.
        self.assertAlmostEqual(sampler.quantile(0.5, after, {0.01: 4, 0.1: 4, math.inf: 4}), 0.005)

    def test_per_minute_rows(self):
        h = lambda n: {0.01: n, math.inf: n}  # noqa: E731
        samples = [{"t": 0, "pending": 5, "oldest_s": 0.2, "publish": h(0), "effect": h(0)},
                   {"t": 30, "pending": 50, "oldest_s": 1.5, "publish": h(100), "effect": h(90)},
                   {"t": 60, "pending": 1, "oldest_s": 0.1, "publish": h(200), "effect": h(200)},
                   {"t": 90, "pending": 2, "oldest_s": 0.3, "publish": h(300), "effect": h(300)}]
        rows = sampler.per_minute(samples)
        self.assertEqual([r["minute"] for r in rows], [0, 1])
        self.assertEqual((rows[0]["pending_rows_max"], rows[0]["oldest_pending_s_max"]), (50, 1.5))
        self.assertEqual(rows[0]["publish_p50_ms"], 5.0)
        self.assertEqual((rows[1]["pending_rows_max"], rows[1]["oldest_pending_s_max"]), (2, 0.3))
        # Minute 0 runs to the sample at 60 s (200 published), minute 1 from it.
        self.assertEqual(rows[0]["effect_p99_ms"], 9.9)
        self.assertEqual(rows[1]["effect_p50_ms"], 5.0)

    def test_cpu_columns_from_two_readings(self):
        before = ({n: 0 for n in sampler.PROCESSES}, {"total": 0, "busy": 0, "iowait": 0, "steal": 0})
        groups = {n: 0 for n in sampler.PROCESSES}
        groups["orders"], groups["postgres"] = 150, 50
        after = (groups, {"total": 400, "busy": 300, "iowait": 20, "steal": 40})
        row = sampler.cpu_columns(before, after, 2.0, 100)
        self.assertEqual(row["cpu_orders"], 0.75)  # 150 ticks of 1/100 s in 2 s
        self.assertEqual(row["cpu_postgres"], 0.25)
        self.assertEqual((row["machine_busy"], row["machine_iowait"], row["machine_steal"]), (0.75, 0.05, 0.1))
        self.assertEqual(sampler.cpu_columns(None, after, 2.0, 100), {})

    def test_cpu_ticks_reads_this_machine(self):
        deadline = time.process_time() + 0.05
        while time.process_time() < deadline:  # at least 5 clock ticks of CPU
            pass
        groups, machine = sampler.cpu_ticks()
        self.assertGreater(groups["python3"], 0, "this test runs in python3")
        self.assertGreater(machine["total"], machine["busy"])


if __name__ == "__main__":
    unittest.main()
