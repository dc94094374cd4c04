"""Tests of experiment 10's verdict: several instances of every service, the
payments group scaled, nothing lost or doubled."""
import copy
import unittest

import exp10
from fixtures import chaos, lives, loadgen, recon


def service(n, deaths_each=None):
    """A service's summary with N instances, each with DEATHS_EACH."""
    s = lives()
    s["instances"] = [{"label": f"x-{i + 1}", "lives": 2, "deaths": dict(deaths_each or {})} for i in range(n)]
    return s


def run(orders=2, relays=2, payments=6, steps=4, kills=30, recon_exit=0, rec=None, mismatches=0, deaths=None):
    load = loadgen(mismatches=mismatches)
    load["targets"] = [{"protocol": "http", "url": f"http://o{i}", "sent": 10, "ok": 10} for i in range(orders)]
    notes = ["payments 6 -> 1", "payments 1 -> 6", "payments 6 -> 2", "payments 2 -> 6"]
    log = [{"fault": "payments-scale", "note": notes[i % 4], "outage_ms": 500, "recovery_ms": 900,
            "inbox_hits": 3, "error": None} for i in range(steps)]
    d = {"random_kill": 2} if deaths is None else deaths
    return chaos(recon_exit, rec or recon(), kills_total=kills, params={"orders": orders, "relays": relays,
                                                                         "payments": payments},
                 orders=service(orders, d), relay=service(relays, d), payments=service(payments, d),
                 load=load, fault_log=log)


class Exp10Test(unittest.TestCase):
    def failed(self, runs, mode="quick", min_kills=20, min_steps=4):
        s = exp10.judge(runs, mode, min_kills, min_steps)
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def runs(self, **kill):
        return {"scale-dynamic": run(), "instances": run(relays=3, payments=3, steps=0, **kill)}

    def test_pass(self):
        self.assertEqual(self.failed(self.runs()), ("PASS", []))
        s = exp10.judge(self.runs(), "quick", 20, 4)
        line = exp10.run_line("scale-dynamic", s["runs"]["scale-dynamic"])
        self.assertIn("payments 6 -> 1: settled in 500 ms", line)
        self.assertIn("payments x6", line)

    def test_lost_doubled_or_a_replay_mismatch_fail(self):
        runs = self.runs()
        runs["instances"] = run(relays=3, payments=3, steps=0, rec=recon(doubled=1), recon_exit=1)
        _, failed = self.failed(runs)
        self.assertIn("instances: no double charge", failed)
        runs = self.runs()
        runs["scale-dynamic"] = run(mismatches=1)
        self.assertEqual(self.failed(runs)[1], ["scale-dynamic: 0 replay mismatches across the orders instances"])

    def test_a_step_that_never_settled_or_too_few_steps_fail(self):
        runs = self.runs()
        runs["scale-dynamic"]["fault_log"][1]["error"] = "the running members own 4 of the 6 partitions"
        runs["scale-dynamic"]["fault_log"][1]["outage_ms"] = None
        self.assertIn("scale-dynamic: every step settled (every partition owned again), none failed",
                      self.failed(runs)[1])
        runs = self.runs()
        runs["scale-dynamic"] = run(steps=3)
        self.assertEqual(self.failed(runs)[1], ["scale-dynamic: the payments group scaled at least 4x, down and up"])
        # The run's last step, its recovery cut short by the end of the load.
        runs = self.runs()
        runs["scale-dynamic"]["fault_log"][-1]["recovery_ms"] = None
        self.assertEqual(self.failed(runs)[0], "PASS")
        runs["scale-dynamic"]["fault_log"][0]["recovery_ms"] = None
        self.assertEqual(self.failed(runs)[1], ["scale-dynamic: the pipeline moved on after every step"])

    def test_instances_must_all_run_and_be_killed(self):
        runs = self.runs()
        runs["instances"]["services"]["relay"]["instances"].pop()
        self.assertEqual(self.failed(runs)[1], ["instances: relay ran as 3 instances"])
        runs = self.runs()
        runs["instances"]["load"]["targets"][1]["sent"] = 0
        self.assertEqual(self.failed(runs)[1], ["instances: loadgen sent to every orders instance"])
        runs = self.runs()
        for i in runs["instances"]["services"]["orders"]["instances"][1:]:
            i["deaths"] = {}
        self.assertEqual(self.failed(runs)[1], ["instances: orders: more than one instance killed"])
        self.assertEqual(self.failed(self.runs(kills=19))[1], ["instances: at least 20 kill -9 over all instances"])

    def test_full_mode_needs_the_static_run_too(self):
        runs = self.runs()
        self.assertRaises(KeyError, exp10.judge, runs, "full", 20, 4)
        runs["scale-static"] = copy.deepcopy(runs["scale-dynamic"])
        self.assertEqual(self.failed(runs, mode="full")[0], "PASS")


if __name__ == "__main__":
    unittest.main()
