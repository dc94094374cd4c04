"""Tests of experiment 1's summary: the "sustainable" rule at its boundaries
and the invariant's problems (each one fails the experiment)."""
import contextlib
import os
import tempfile
import unittest

import exp1
from common import write_json
from fixtures import chaos, loadgen, recon

KEYS = 800


def orders_alone(mode, keys_in_db=None, orders=None, **load):
    """(point, problems) of an orders-alone run: the check keeps one order per
    key; without it the retries made 200 more orders and no key row."""
    if mode == "check":
        rec = recon(KEYS if orders is None else orders, keys=KEYS if keys_in_db is None else keys_in_db, intents=False)
    else:
        rec = recon(KEYS + 200 if orders is None else orders, keys=0 if keys_in_db is None else keys_in_db,
                    intents=False)
    load = {"sent": 10000, "keys_succeeded": KEYS, **load}
    return exp1.point(mode, 500, loadgen(**load), rec, None, 0)


def pipeline(recon_exit=0, rec=None, **load):
    load = {"sent": 10000, "keys_succeeded": KEYS, **load}
    return exp1.point("pipeline", 500, loadgen(**load),
                      rec or recon(KEYS), recon_exit, 0)


class SustainableTest(unittest.TestCase):
    def sustainable(self, mode="check", **load):
        p, _ = pipeline(**load) if mode == "pipeline" else orders_alone(mode, **load)
        return p["sustainable"]

    def test_achieved_share_boundary(self):
        self.assertTrue(self.sustainable(responses=9900))      # 99.00 %
        self.assertFalse(self.sustainable(responses=9899))     # 98.99 %

    def test_error_share_boundary(self):
        self.assertTrue(self.sustainable(ok=9990))             # 0.100 %
        self.assertFalse(self.sustainable(ok=9989))            # 0.110 %
        # Dropped and unfinished sends are errors too.
        self.assertFalse(self.sustainable(sent=9989, dropped=11))
        self.assertFalse(self.sustainable(unfinished=11))

    def test_p99_boundary(self):
        self.assertTrue(self.sustainable(p99=24.99))
        self.assertFalse(self.sustainable(p99=25.0))

    def test_replay_mismatches_count_only_with_the_check(self):
        self.assertFalse(self.sustainable("check", mismatches=1))
        self.assertFalse(self.sustainable("pipeline", mismatches=1))
        self.assertTrue(self.sustainable("nocheck", mismatches=1))

    def test_pipeline_needs_recon_clean(self):
        self.assertTrue(self.sustainable("pipeline"))
        p, _ = pipeline(recon_exit=1, rec=recon(KEYS, lost=1))
        self.assertFalse(p["sustainable"])


class ProblemsTest(unittest.TestCase):
    def test_a_clean_storm_has_no_problem(self):
        for mode in ("check", "nocheck"):
            self.assertEqual(orders_alone(mode)[1], [])
        p, problems = pipeline()
        self.assertEqual(problems, [])
        self.assertTrue(p["recon_clean"] and p["recon_drained"] and p["orders_equal_keys"])
        self.assertEqual(orders_alone("nocheck")[0]["duplicate_orders"], 200)

    def test_overload_is_a_measurement_not_a_failure(self):
        p, problems = orders_alone("check", p99=400.0, ok=9000)
        self.assertFalse(p["sustainable"])
        self.assertEqual(problems, [])

    def test_pipeline_drift_fails(self):
        _, problems = pipeline(recon_exit=1, rec=recon(KEYS, doubled=1))
        self.assertEqual(len(problems), 1)
        self.assertIn("500 pipeline: recon not CLEAN (exit 1", problems[0])

    def test_pipeline_orders_not_equal_to_keys_fails(self):
        _, problems = pipeline(rec=recon(KEYS + 1))
        self.assertEqual(problems, [f"500 pipeline: distinct orders {KEYS + 1} != keys that succeeded {KEYS} "
                                    "+ ambiguous committed 0"])

    def test_ambiguous_keys_that_committed_are_keys_and_refused_ones_are_not(self):
        # 795 keys succeeded, 5 were answered 408/503 (ambiguous), 3 of
        # which committed: 798 orders is right.
        rec = recon(KEYS - 2)
        rec["intents"].update({"client_succeeded": KEYS - 5, "matched": KEYS - 5, "client_ambiguous": 5,
                               "ambiguous_committed": 3, "client_failed": 0, "failed_committed": 0})
        p, problems = pipeline(rec=rec, keys_succeeded=KEYS - 5, ambiguous=5)
        self.assertEqual(problems, [])
        self.assertTrue(p["orders_equal_keys"])
        # A refused key with an order is a problem of its own.
        rec["intents"].update({"client_failed": 1, "failed_committed": 1})
        _, problems = pipeline(rec=rec, keys_succeeded=KEYS - 5, ambiguous=5)
        self.assertEqual(problems, ["500 pipeline: 1 keys the client was refused have an order"])

    def test_replay_mismatch_with_the_check_fails(self):
        self.assertEqual(orders_alone("check", mismatches=2)[1],
                         ["500 check: 2 replay mismatches with the check on"])
        self.assertEqual(orders_alone("nocheck", mismatches=2)[1], [])

    def test_check_with_more_orders_than_keys_fails(self):
        self.assertEqual(orders_alone("check", orders=KEYS + 1)[1],
                         [f"500 check: {KEYS + 1} orders != {KEYS} idempotency keys"])

    def test_a_baseline_that_kept_the_check_fails(self):
        self.assertIn("the check was not off", orders_alone("nocheck", orders=KEYS)[1][0])
        self.assertIn("the check was not off", orders_alone("nocheck", keys_in_db=5)[1][0])


class SummaryTest(unittest.TestCase):
    def points(self, sustain):
        """Points at 500 and 1500; SUSTAIN: the (rate, mode) pairs that sustain."""
        out = []
        for rate in (500, 1500):
            for mode in exp1.MODES:
                p, _ = pipeline() if mode == "pipeline" else orders_alone(mode)
                p = dict(p, offered=rate, sustainable=(rate, mode) in sustain)
                out.append(p)
        return out

    def test_highest_sustainable_and_headline(self):
        sustain = {(500, "pipeline"), (500, "check"), (500, "nocheck"), (1500, "nocheck"), (1500, "check")}
        s = exp1.summarize(self.points(sustain), [], "quick", {}, 1)
        self.assertEqual(s["highest_sustainable_intents_per_s"], {"pipeline": 500, "check": 1500, "nocheck": 1500})
        self.assertEqual(s["headline_comparison"]["offered"], 1500)
        self.assertEqual(s["verdict"], "PASS")
        self.assertTrue(exp1.lines(s)[-1].startswith("exp-1: PASS highest sustainable: 500/s full pipeline"))
        # Nothing sustained: the headline is the first rate, nothing is highest.
        s = exp1.summarize(self.points(set()), ["x"], "quick", {}, 1)
        self.assertEqual((s["headline_comparison"]["offered"], s["verdict"]), (500, "FAIL"))
        self.assertEqual(set(s["highest_sustainable_intents_per_s"].values()), {0})

    def test_noise_gauges(self):
        self.assertEqual(exp1.machine_busy("100 1000 250 1200"), 75.0)
        self.assertIsNone(exp1.machine_busy(""))
        self.assertIsNone(exp1.machine_busy("1 1 1 1"))
        head = "    PID USER      PR  NI    VIRT    RES    SHR S  %CPU  %MEM     TIME+ COMMAND\n"
        top = ("top - first sample\n" + head + "  1 u 20 0 1 1 1 R 99.0 0.1 0:01.00 ignored\n"
               "top - second sample\n" + head
               + "  2 u 20 0 1 1 1 R 40.0 0.1 0:01.00 /work/t/debug/orders\n"
               + "  3 u 20 0 1 1 1 R 30.0 0.1 0:01.00 postgres: writer\n"
               + "  4 u 20 0 1 1 1 R 25.5 0.1 0:01.00 rustc --crate-name x\n"
               + "  5 u 20 0 1 1 1 R 10.0 0.1 0:01.00 java -cp libs/* kafka.Kafka node-1/server.properties\n")
        self.assertEqual(exp1.others_cpu(top, "/work/t/debug"), 25.5)
        self.assertIsNone(exp1.others_cpu(None, "/x"))

    def test_main_reads_a_run_and_writes_the_tables(self):
        with tempfile.TemporaryDirectory() as res:
            logs = os.path.join(res, "logs")
            write_json(os.path.join(res, "500-pipeline.json"),
                       chaos(0, recon(KEYS), load=loadgen(sent=10000, keys_succeeded=KEYS)))
            for mode in ("check", "nocheck"):
                d = os.path.join(logs, f"500-{mode}")
                os.makedirs(d)
                orders = KEYS if mode == "check" else KEYS + 200
                write_json(os.path.join(d, "loadgen.json"), loadgen(sent=10000, keys_succeeded=KEYS))
                write_json(os.path.join(d, "recon.json"), recon(orders, keys=KEYS if mode == "check" else 0))
                with open(os.path.join(d, "loadgen.rc"), "w", encoding="utf-8") as f:
                    f.write("0\n")
            with open(os.devnull, "w", encoding="utf-8") as null, contextlib.redirect_stdout(null):
                code = exp1.main([res, "quick", "5", "0.15", "1.1", "500", "60", "9", "/bin"])
            self.assertEqual(code, 0)
            for name in ("summary.json", "points.csv", "comparison.csv"):
                self.assertTrue(os.path.exists(os.path.join(res, name)), name)
            # A missing run is a problem, so a FAIL.
            os.remove(os.path.join(logs, "500-nocheck", "loadgen.json"))
            with open(os.devnull, "w", encoding="utf-8") as null, contextlib.redirect_stdout(null):
                self.assertEqual(exp1.main([res, "quick", "5", "0.15", "1.1", "500", "60", "9", "/bin"]), 1)


if __name__ == "__main__":
    unittest.main()
