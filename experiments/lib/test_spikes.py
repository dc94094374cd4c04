"""Tests of the spike analysis (no services needed)."""
import unittest

import spikes


def sample(unix_s, vacuum="", busy=0.5, ckpt=0):
    return {"unix_s": unix_s, "vacuum": [t for t in vacuum.split("+") if t], "analyze": [],
            "machine_busy": busy, "ckpt_buffers": ckpt, "cpu_orders": 0.4, "cpu_postgres": 0.6}


class SpikesTest(unittest.TestCase):
    def test_seconds_under_a_condition_are_told_from_the_others(self):
        start = 1000.0
        # Samples every 10 s; an autovacuum of orders.outbox is seen at 1030
        # and 1040 (so it covers the intervals (1020, 1030], (1030, 1040],
        # (1040, 1050]); a checkpoint writes in (1060, 1070].
        samples = [sample(start + t) for t in range(0, 100, 10)]
        samples[3] = sample(start + 30, vacuum="orders.outbox")
        samples[4] = sample(start + 40, vacuum="orders.outbox")
        samples[7] = sample(start + 70, ckpt=120)
        seconds = [{"second": str(i), "p99_ms": "40" if 22 <= i < 48 else "10"} for i in range(90)]
        a = spikes.analyse(seconds, start, samples, 25.0, from_s=10)
        self.assertEqual(a["seconds"], 80)
        self.assertEqual(a["seconds_over_slo"], 26)
        by = {c["condition"]: c for c in a["conditions"]}
        vac = by["vacuum orders.outbox"]
        self.assertEqual(vac["seconds"], 30)
        self.assertAlmostEqual(vac["over_slo_share"], 26 / 30, places=3)
        self.assertEqual(vac["over_slo_share_without"], 0.0)
        self.assertEqual(by["checkpoint writing"]["seconds"], 10)
        self.assertEqual(by["checkpoint writing"]["over_slo_share"], 0.0)
        self.assertNotIn("machine CPU >= 95% busy", by)
        # The most suspicious condition first.
        self.assertIn(a["conditions"][0]["condition"], ("vacuum orders.outbox", "autovacuum (any table)"))

    def test_a_writeback_burst_is_a_condition_of_its_interval(self):
        start = 1000.0
        samples = [sample(start + t) for t in range(0, 40, 2)]
        samples[6]["dirty_fall_mb"] = 250  # a burst in (1010, 1012]
        samples[7]["dirty_fall_mb"] = 30  # a fall too small to count
        seconds = [{"second": str(i), "p99_ms": "90" if i == 10 else "10"} for i in range(38)]
        a = spikes.analyse(seconds, start, samples, 25.0, from_s=0)
        by = {c["condition"]: c for c in a["conditions"]}
        burst = by["writeback burst (dirty data -64 MB within 1 s)"]
        self.assertEqual(burst["seconds"], 2)
        self.assertEqual(burst["over_slo_share"], 0.5)
        self.assertEqual(burst["over_slo_share_without"], 0.0)
        self.assertEqual(a["conditions"][0]["condition"], "writeback burst (dirty data -64 MB within 1 s)")

    def test_cpu_means_from_the_steady_part(self):
        start = 0.0
        samples = [sample(t) for t in range(0, 120, 10)]
        samples[0]["cpu_orders"] = 9.0  # start-up, before from_s
        c = spikes.cpu(samples, start, from_s=60)
        self.assertEqual(c["cpu_orders"], 0.4)
        self.assertEqual(c["machine_busy"], 0.5)
        self.assertIn("cpu_other", c)

    def test_cpu_per_order_is_cores_over_the_applied_rate(self):
        start = 0.0
        samples = [sample(t) for t in range(0, 120, 10)]
        for s in samples:
            s["effects"] = 500 * s["unix_s"]  # 500 applied a second
        c = spikes.cpu(samples, start, from_s=60)
        per = spikes.cpu_per_order(samples, start, c, from_s=60)
        self.assertEqual(per["applied_per_s"], 500.0)
        self.assertEqual(per["orders"], 800)  # 0.4 cores / 500 a second
        self.assertIn("other", per)
        # Nothing applied: no figure rather than a division by zero.
        for s in samples:
            s["effects"] = 7
        self.assertEqual(spikes.cpu_per_order(samples, start, c, from_s=60), {})

    def test_missing_files_give_none(self):
        self.assertIsNone(spikes.from_files("/nonexistent/a.csv", "/nonexistent/b.csv", 0.0, 25.0))


if __name__ == "__main__":
    unittest.main()
