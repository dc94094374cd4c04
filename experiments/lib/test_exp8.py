"""Tests of experiment 8's verdict: every fault injected and recovered, nothing lost or doubled."""
import unittest

import exp8
from fixtures import chaos, lives, recon


def faults(n=2, recovered=None, failed=0):
    return {name: {"injected": n, "recovered": n if recovered is None else recovered, "failed_to_inject": failed,
                   "recovery_ms": {"p50": 900, "max": 1500}} for name in exp8.FAULTS}


def mixed(kills=10, f=None, fault_log=None, rec=None, recon_exit=0, hits=5):
    return chaos(recon_exit, rec or recon(), kills_total=kills,
                 orders=lives({"crash_point:commit": 1}), relay=lives({"crash_point:publish": 1}),
                 payments=lives({"crash_point:claim": 1, "crash_point:effect": 1, "random_kill": 6}),
                 totals={"inbox_hits": hits}, faults=f or faults(), fault_log=fault_log or [],
                 injected_duplicates=5)


class Exp8Test(unittest.TestCase):
    def failed(self, m, min_kills=4, min_per_fault=1):
        s = exp8.judge(m, None, "quick", min_kills, min_per_fault)
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def test_pass(self):
        self.assertEqual(self.failed(mixed()), ("PASS", []))
        s = exp8.judge(mixed(), None, "quick", 4, 1)
        self.assertEqual(s["runs"]["mixed"]["deaths"]["random_kill"], 6)
        self.assertIn("pg-crash 2/2 recovered", exp8.run_line("mixed", s["runs"]["mixed"]))

    def test_the_last_fault_cut_short_by_the_end_of_the_load_is_unobserved(self):
        f = faults()
        f["offset-reset"]["recovered"] = 1
        last = [{"fault": "offset-reset", "recovery_ms": None, "error": None}]
        verdict, _ = self.failed(mixed(f=f, fault_log=last))
        self.assertEqual(verdict, "PASS")
        # An earlier fault, or one that failed, is unrecovered.
        self.assertEqual(self.failed(mixed(f=f))[1], ["mixed: offset-reset injected at least 1x, every one recovered"])
        errored = [{"fault": "offset-reset", "recovery_ms": None, "error": "timeout"}]
        self.assertEqual(self.failed(mixed(f=f, fault_log=errored))[0], "FAIL")

    def test_too_few_faults_or_a_failed_injection_fail(self):
        self.assertEqual(self.failed(mixed(), min_per_fault=2)[0], "PASS")
        # One failed check per fault kind.
        self.assertEqual(len(self.failed(mixed(), min_per_fault=3)[1]), len(exp8.FAULTS))
        self.assertEqual(len(self.failed(mixed(f=faults(failed=1)))[1]), len(exp8.FAULTS))
        self.assertEqual(len(exp8.FAULTS), 6)

    def test_kills_and_crash_points(self):
        self.assertEqual(self.failed(mixed(kills=4))[0], "PASS")
        self.assertEqual(self.failed(mixed(kills=3))[1], ["mixed: at least 4 kill -9 (crash points and random kills)"])
        m = mixed()
        m["services"]["relay"]["deaths"] = {}
        self.assertEqual(self.failed(m)[1], ["mixed: crash point publish fired"])
        self.assertEqual(self.failed(mixed(hits=0))[1], ["mixed: injected duplicates absorbed (inbox hits > 0)"])

    def test_lost_doubled_or_ambiguous_fail(self):
        _, failed = self.failed(mixed(rec=recon(lost=1), recon_exit=1))
        self.assertEqual(failed, ["mixed: recon CLEAN (0 lost, 0 doubled, every check)", "mixed: no order without its charge"])
        _, failed = self.failed(mixed(rec=recon(doubled=1), recon_exit=1))
        self.assertIn("mixed: no double charge", failed)
        _, failed = self.failed(mixed(rec=recon(ambiguous=1)))
        self.assertEqual(failed, ["mixed: every key the client saw succeed has exactly its order, 0 ambiguous"])

    def test_full_mode_judges_the_each_fault_run_without_kill_checks(self):
        each = chaos(0, recon(), faults=faults(exp8.EACH_FAULT_MIN), fault_log=[])
        s = exp8.judge(mixed(), each, "full", 4, 1)
        self.assertEqual(s["verdict"], "PASS")
        self.assertFalse(any(k.startswith("each-fault") and ("kill -9" in k or "crash point" in k) for k in s["checks"]))
        s = exp8.judge(mixed(), chaos(0, recon(), faults=faults(exp8.EACH_FAULT_MIN - 1), fault_log=[]), "full", 4, 1)
        self.assertEqual(s["verdict"], "FAIL")


if __name__ == "__main__":
    unittest.main()
