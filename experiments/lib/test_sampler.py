"""Tests of the pipeline sampler's arithmetic (no services needed)."""
import math
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


if __name__ == "__main__":
    unittest.main()
