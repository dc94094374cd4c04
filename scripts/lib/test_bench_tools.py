"""The benchmarks' accounting helpers: cpu.py's diff, histo_delta.py and bench_orders.py's
CPU per send.

    python3 -m unittest discover -s scripts/lib
"""

import os
import tempfile
import unittest

import bench_orders
import bench_pipeline
import cpu
import histo_delta


def proc(name, seconds, role=None):
    p = {"name": name, "seconds": seconds}
    if role:
        p["role"] = role
    return p


class CpuDiff(unittest.TestCase):
    def test_cores_per_name_and_role_over_the_span(self):
        a = {
            "processes": {
                "1": proc("kafka", 100.0),
                "2": proc("postgres", 10.0, "effectively_relay"),
                "3": proc("postgres", 5.0, "effectively_orders"),
                "9": proc("gone", 50.0),
            },
            "machine": {"total": 1000.0, "busy": 500.0},
        }
        b = {
            "processes": {
                "1": proc("kafka", 108.0),
                "2": proc("postgres", 12.0, "effectively_relay"),
                "3": proc("postgres", 9.0, "effectively_orders"),
                # Started after A: all of its seconds are in the span.
                "4": proc("postgres", 2.0, "effectively_relay"),
            },
            "machine": {"total": 1020.0, "busy": 515.0},
        }
        d = cpu.diff(a, b, 10.0)
        self.assertEqual(d["cores"], {"kafka": 0.8, "postgres": 0.8})
        self.assertEqual(
            d["postgres_cores_by_role"], {"effectively_orders": 0.4, "effectively_relay": 0.4}
        )
        self.assertEqual(d["machine_busy"], 0.75)
        self.assertEqual(list(d["cores"]), sorted(d["cores"], key=lambda k: -d["cores"][k]))

    def test_kernel_workers_count_as_one_name(self):
        self.assertEqual(cpu.name("kworker/u8:3-events_unbound"), "kworker")
        self.assertEqual(cpu.name("relay"), "relay")

    def test_a_snapshot_of_this_machine_reads(self):
        s = cpu.snap()
        self.assertTrue(s["processes"])
        self.assertNotIn(str(os.getpid()), s["processes"])
        self.assertGreater(s["machine"]["total"], 0)


class HistoDelta(unittest.TestCase):
    def write(self, text):
        f = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
        f.write(text)
        f.close()
        self.addCleanup(os.unlink, f.name)
        return f.name

    def test_count_and_mean_between_two_scrapes_summed_over_labels(self):
        a = self.write(
            "# HELP x_seconds a histogram\n"
            'x_seconds_bucket{le="1"} 3\n'
            'x_seconds_sum{stage="a"} 1.5\nx_seconds_count{stage="a"} 3\n'
            'x_seconds_sum{stage="b"} 0\nx_seconds_count{stage="b"} 0\n'
        )
        b = self.write(
            'x_seconds_sum{stage="a"} 3.5\nx_seconds_count{stage="a"} 5\n'
            'x_seconds_sum{stage="b"} 2\nx_seconds_count{stage="b"} 2\n'
            "x_seconds_total_sum 100\n"
        )
        d = histo_delta.delta(histo_delta.parse(a), histo_delta.parse(b), "x_seconds")
        self.assertEqual(d, {"count": 4, "mean": 1.0})

    def test_nothing_observed_is_a_null_mean(self):
        a = self.write("y_sum 2\ny_count 1\n")
        d = histo_delta.delta(histo_delta.parse(a), histo_delta.parse(a), "y")
        self.assertEqual(d, {"count": 0, "mean": None})


class CpuPerSend(unittest.TestCase):
    def test_cores_over_sends_a_second_in_microseconds_per_group(self):
        used = {"orders": 0.5, "postgres": 0.9, "loadgen": 0.2, "machine_busy": 0.8}
        self.assertEqual(
            bench_orders.cpu_us(used, 10_000), {"orders": 50, "postgres": 90, "loadgen": 20}
        )

    def test_no_sends_or_no_snapshot_is_no_figure(self):
        self.assertEqual(bench_orders.cpu_us({"orders": 0.5}, 0), {})
        self.assertEqual(bench_orders.cpu_us({}, 1_000), {})


class PipelineCpuPerOrder(unittest.TestCase):
    def test_cores_per_process_and_role_over_the_new_orders_a_second(self):
        point = {"rate": 1000, "cpu": {"cores": {"postgres": 0.86, "kafka": 0.58, "orders": 0.18,
                                                 "relay": 0.12, "payments": 0.04, "loadgen": 0.08},
                                       "postgres_cores_by_role": {"effectively_orders": 0.55},
                                       "machine_busy": 0.94}}
        self.assertEqual(bench_pipeline.cpu_us_per_order(point), {
            "processes": {"postgres": 860, "kafka": 580, "orders": 180, "relay": 120,
                          "payments": 40, "loadgen": 80},
            "postgres_by_role": {"effectively_orders": 550},
            # the broker and loadgen are not the pipeline's
            "pipeline": 1200,
            "machine_busy": 0.94})
        self.assertEqual(bench_pipeline.cpu_us_per_order({"rate": 0, "cpu": point["cpu"]}), {})


if __name__ == "__main__":
    unittest.main()
