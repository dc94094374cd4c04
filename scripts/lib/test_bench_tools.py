"""The benchmarks' accounting helpers: cpu.py's diff, histo_delta.py and bench_orders.py's
CPU per send and stalls.

    python3 -m unittest discover -s scripts/lib
"""

import io
import os
import shutil
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

    def test_the_brokers_jit_cores_are_their_compiler_threads_over_the_span(self):
        a = {"processes": {"1": dict(proc("kafka", 100.0), jit_seconds=20.0),
                           "2": dict(proc("kafka", 90.0), jit_seconds=30.0)},
             "machine": {"total": 1000.0, "busy": 500.0}}
        b = {"processes": {"1": dict(proc("kafka", 110.0), jit_seconds=26.0),
                           "2": dict(proc("kafka", 94.0), jit_seconds=31.0)},
             "machine": {"total": 1020.0, "busy": 515.0}}
        d = cpu.diff(a, b, 10.0)
        self.assertEqual(d["cores"]["kafka"], 1.4)
        self.assertEqual(d["kafka_jit_cores"], 0.7)
        # No JVM in the snapshots: no figure, rather than a zero.
        self.assertNotIn("kafka_jit_cores", cpu.diff({"processes": {}, "machine": a["machine"]},
                                                     {"processes": {}, "machine": b["machine"]}, 10.0))

    def test_a_database_name_is_quoted_as_an_sql_literal(self):
        self.assertEqual(cpu.literal("bench_steady"), "'bench_steady'")
        self.assertEqual(cpu.literal("it's"), "'it''s'")

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


class OrdersStalls(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.dir)

    def write(self, name, text):
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(text)

    def test_a_burst_is_placed_in_the_second_of_the_load_it_fell_in(self):
        self.write("p.seconds.csv", "second,sent,ok,errors,p99_ms\n0,10,10,0,12.5\n1,10,10,0,317.4\n"
                   "2,10,10,0,30.0\n3,10,10,0,\n4,10,10,0,9.1\n")
        # 500 MB dirty, falling to 10 MB between 1.2 and 1.6 s; a slow drift later is no burst.
        t = [(1000.0 + i / 10, 500 * 1024 if i < 12 else 10 * 1024, 0) for i in range(16)]
        t += [(1001.6 + i / 10, (10 - i) * 1024, 0) for i in range(10)]
        self.write("p.dirty", "".join(f"{a:.2f} {b} {c}\n" for a, b, c in t))
        st = bench_orders.stalls(self.dir, "p")
        self.assertEqual(st["seconds_over_slo"], 2)
        self.assertEqual(st["worst_seconds"], [[1, 317.4], [2, 30.0], [0, 12.5]])
        self.assertEqual(st["dirty_max_mb"], 500)
        self.assertEqual(st["writeback_bursts"], [[1, 500, 10]])
        self.assertIn("writeback bursts: s1 500->10 MB", bench_orders.stall_line(st))
        # With the load's start on record, the burst is placed from it.
        self.write("p.start", "1000.9\n")
        self.assertEqual(bench_orders.stalls(self.dir, "p")["writeback_bursts"], [[0, 500, 10]])

    def test_without_the_dirty_samples_only_the_seconds(self):
        self.write("q.seconds.csv", "second,sent,ok,errors,p99_ms\n0,10,10,0,40\n")
        self.assertEqual(bench_orders.stalls(self.dir, "q"),
                         {"seconds_over_slo": 1, "worst_seconds": [[0, 40.0]]})
        self.assertEqual(bench_orders.stalls(self.dir, "none"), {})

    def test_the_sampler_reads_dirty_and_writeback(self):
        self.write("meminfo", "MemTotal: 100 kB\nDirty:    2048 kB\nWriteback:  16 kB\n")
        out = io.StringIO()
        bench_orders.dirty_sampler(0.05, interval=0.01, meminfo=os.path.join(self.dir, "meminfo"), out=out)
        lines = out.getvalue().split("\n")
        self.assertGreaterEqual(len(lines), 2)
        self.assertEqual(lines[0].split()[1:], ["2048", "16"])


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
        # The brokers' JIT, when the point has it, stays in cores (a point still warming up).
        point["cpu"]["kafka_jit_cores"] = 0.31
        self.assertEqual(bench_pipeline.cpu_us_per_order(point)["kafka_jit_cores"], 0.31)


class PipelineDrains(unittest.TestCase):
    def test_each_builds_median_drain_and_their_ratio(self):
        drain = lambda build, seconds: {"what": "relay_drain", "build": build, "rows": 1000, "seconds": seconds}
        out = bench_pipeline.summarize([drain("new", 1.0), drain("base", 2.0), drain("base", 0.5),
                                        drain("new", 4.0), drain("new", 2.0), drain("base", 1.0)])
        self.assertEqual(out["relay_drains_rows_per_sec"], {"new": [1000, 250, 500], "base": [500, 2000, 1000]})
        self.assertEqual((out["relay_rows_per_sec"], out["base_relay_rows_per_sec"]), (500, 1000))
        self.assertEqual(out["relay_vs_base"], 0.5)
        self.assertEqual(out["rows"], 1000)
        alone = bench_pipeline.summarize([drain("new", 2.0)])
        self.assertEqual((alone["relay_rows_per_sec"], "relay_vs_base" in alone), (500, False))


def stmt(role, calls, exec_ms, rows=0, wal_records=0, wal_bytes=0.0, query="SELECT 1"):
    return {"role": role, "calls": calls, "exec_ms": exec_ms, "rows": rows,
            "wal_records": wal_records, "wal_bytes": wal_bytes, "query": query}


class Statements(unittest.TestCase):
    def test_what_the_statements_did_over_the_span_per_role_and_the_slowest(self):
        a = {"r|1|10": stmt("effectively_relay", 100, 50.0, 1000, 4000, 400000.0, "UPDATE mark"),
             "r|1|11": stmt("effectively_relay", 100, 10.0, 1000, 1000, 60000.0, "SELECT claim"),
             "o|1|20": stmt("effectively_orders", 50, 20.0, 200, 2000, 200000.0, "WITH write"),
             # reset between the snapshots: calls went down
             "o|1|21": stmt("effectively_orders", 500, 9.0, 500)}
        b = {"r|1|10": stmt("effectively_relay", 120, 70.0, 1200, 4800, 480000.0, "UPDATE mark"),
             "r|1|11": stmt("effectively_relay", 120, 12.0, 1200, 1200, 72000.0, "SELECT claim"),
             "o|1|20": stmt("effectively_orders", 70, 30.0, 300, 3000, 300000.0, "WITH write"),
             "o|1|21": stmt("effectively_orders", 5, 1.0, 5),
             # first seen in B: all of it in the span
             "p|1|30": stmt("effectively_payments", 4, 2.0, 40)}
        d = cpu.statements_diff(a, b, 2.0, top=2)
        self.assertEqual(d["statements_by_role"], {
            "effectively_relay": {"calls": 20.0, "exec_ms": 11.0, "rows": 200.0, "wal_records": 500.0,
                                  "wal_bytes": 46000.0},
            "effectively_orders": {"calls": 10.0, "exec_ms": 5.0, "rows": 50.0, "wal_records": 500.0,
                                   "wal_bytes": 50000.0},
            "effectively_payments": {"calls": 2.0, "exec_ms": 1.0, "rows": 20.0, "wal_records": 0.0,
                                     "wal_bytes": 0.0}})
        self.assertEqual([(t["role"], t["query"], t["exec_ms"]) for t in d["statements_top"]],
                         [("effectively_relay", "UPDATE mark", 10.0), ("effectively_orders", "WITH write", 5.0)])

    def test_a_diff_without_statistics_has_no_statements(self):
        a = {"processes": {}, "machine": {"total": 10.0, "busy": 5.0}, "statements": None}
        b = {"processes": {}, "machine": {"total": 20.0, "busy": 10.0}, "statements": {}}
        self.assertNotIn("statements_by_role", cpu.diff(a, b, 1.0))

    def test_statements_per_new_order(self):
        point = {"rate": 1000, "cpu": {"statements_by_role": {
            "effectively_relay": {"calls": 100.0, "exec_ms": 70.0, "rows": 1000.0, "wal_records": 4200.0,
                                  "wal_bytes": 490000.0},
            "effectively_orders": {"calls": 300.0, "exec_ms": 90.0, "rows": 1000.0, "wal_records": 10600.0,
                                   "wal_bytes": 1237000.0}}}}
        per = bench_pipeline.statements_per_order(point)
        self.assertEqual(per["by_role"]["effectively_relay"],
                         {"statements": 0.1, "rows": 1.0, "exec_us": 70, "wal_records": 4.2, "wal_bytes": 490})
        self.assertEqual(per["all"],
                         {"statements": 0.4, "rows": 2.0, "exec_us": 160, "wal_records": 14.8, "wal_bytes": 1727})
        self.assertEqual(bench_pipeline.statements_per_order({"rate": 1000, "cpu": {}}), {})


if __name__ == "__main__":
    unittest.main()
