"""Tests of the writeback burst detection (no services needed)."""
import os
import tempfile
import time
import unittest

import writeback

MB = 1024


class WritebackTest(unittest.TestCase):
    def test_a_fall_within_a_second_is_a_burst_and_a_slow_drift_is_not(self):
        # 500 MB dirty falling to 10 MB between 1.2 and 1.6 s; later a fall
        # of 40 MB a second for 4 s is no burst.
        readings = [(t / 10, 500 * MB) for t in range(13)] + [(1.3, 300 * MB), (1.6, 10 * MB)]
        readings += [(4.0 + i, (500 - 40 * i) * MB) for i in range(5)]
        readings.sort()
        found = writeback.bursts(readings)
        self.assertEqual(len(found), 1)
        t, top, after = found[0]
        self.assertAlmostEqual(t, 1.3)
        self.assertEqual((top, after), (500 * MB, 300 * MB))

    def test_falls_close_together_are_one_burst(self):
        readings = [(0.0, 400 * MB), (0.5, 300 * MB), (1.0, 200 * MB), (1.5, 100 * MB), (4.0, 400 * MB),
                    (4.5, 300 * MB)]
        self.assertEqual([round(t, 1) for t, _, _ in writeback.bursts(readings)], [0.5, 4.5])

    def test_the_watch_tells_each_interval_its_largest_fall_and_most_dirty(self):
        w = writeback.Watch()
        self.assertIsNone(w.take())
        for t, mb in ((0.0, 100), (0.1, 120), (0.2, 130)):
            w.add(t, mb * MB)
        self.assertEqual(w.take(), {"dirty_max_mb": 130, "dirty_fall_mb": 0})
        # A burst that starts in the interval before: the window spans the take.
        for t, mb in ((0.5, 40), (0.9, 35), (2.5, 60)):
            w.add(t, mb * MB)
        self.assertEqual(w.take(), {"dirty_max_mb": 60, "dirty_fall_mb": 95})
        w.add(3.0, 60 * MB)
        self.assertEqual(w.take(), {"dirty_max_mb": 60, "dirty_fall_mb": 0})

    def test_the_watch_reads_meminfo_in_its_thread(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "meminfo")
            with open(path, "w") as f:
                f.write("MemTotal: 100 kB\nDirty:    204800 kB\nWriteback:  16 kB\n")
            self.assertEqual(writeback.read_meminfo(path), (204800, 16))
            w = writeback.Watch(interval=0.01, meminfo=path).start()
            deadline = time.time() + 5
            got = None
            while got is None and time.time() < deadline:
                time.sleep(0.02)
                got = w.take()
            w.stop()
            self.assertEqual(got, {"dirty_max_mb": 200, "dirty_fall_mb": 0})

    def test_a_meminfo_without_the_lines_reads_zero(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "meminfo")
            with open(path, "w") as f:
                f.write("MemTotal: 100 kB\nDirty: lots\n")
            self.assertEqual(writeback.read_meminfo(path), (0, 0))


if __name__ == "__main__":
    unittest.main()
