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


def matrix_run(tag, applied=None):
    """A matrix run TAG (matrix-RxP) with its commit->effect; APPLIED of
    its 1,000 orders applied (all by default)."""
    r, p = tag.removeprefix("matrix-").split("x")
    c = run(orders=1, relays=int(r), payments=int(p), steps=0, deaths={})
    c["params"]["rate"] = 300
    c["commit_to_effect"] = {"orders": 1000, "applied": 1000 if applied is None else applied, "p50_ms": 40.5,
                             "p99_ms": 180.0, "max_ms": 400.0, "publish_p50_ms": 10.0, "publish_p99_ms": 50.0,
                             "applied_per_s": 299.0}
    return c


class Exp10Test(unittest.TestCase):
    def failed(self, runs, mode="quick", min_kills=20, min_steps=4):
        s = exp10.judge(runs, mode, min_kills, min_steps)
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def runs(self, mode="quick", **kill):
        runs = {"scale-dynamic": run(), "instances": run(relays=3, payments=3, steps=0, **kill)}
        for tag in exp10.matrix_tags(mode):
            runs[tag] = matrix_run(tag)
        return runs

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
        runs = self.runs(mode="full")
        self.assertRaises(KeyError, exp10.judge, runs, "full", 20, 4)
        runs["scale-static"] = copy.deepcopy(runs["scale-dynamic"])
        self.assertEqual(self.failed(runs, mode="full")[0], "PASS")

    def network(self, n=4):
        """A network run: N faults, the four kinds in turn."""
        c = run(orders=1, relays=2, payments=3, steps=0)
        kinds = exp10.NETWORK_FAULTS
        notes = {"net-lag": "round trip +120 ms, loss 3% each way: 5000 packets held and passed, 150 dropped, "
                            "at most 90 held at once",
                 "relay-cut": "relay-2 cut off from brokers", "payments-db-cut": "payments-1 cut off from postgres"}
        c["fault_log"] = [{"fault": kinds[i % 4], "note": notes.get(kinds[i % 4]), "outage_ms": 10000,
                           "recovery_ms": 12000, "inbox_hits": 5, "error": None} for i in range(n)]
        return c

    def test_the_network_run_needs_every_fault_made_and_recovered(self):
        runs = self.runs()
        runs["network"] = self.network()
        s = exp10.judge(runs, "quick", 20, 4, net_faults=4)
        self.assertEqual((s["verdict"], [k for k, v in s["checks"].items() if not v]), ("PASS", []))
        line = exp10.run_line("network", s["runs"]["network"])
        self.assertIn("relay-cut (relay-2 cut off from brokers): 10000 ms, moving 2000 ms after it ended", line)

        def failed(c):
            r = dict(runs, network=c)
            return [k for k, v in exp10.judge(r, "quick", 20, 4, net_faults=4)["checks"].items() if not v]
        c = self.network(n=3)
        self.assertEqual(failed(c), ["network: at least 4 network faults, each kind"])
        c = self.network()
        c["fault_log"][0]["error"] = "net partition needs the cluster in its own network namespaces"
        self.assertIn("network: every network fault was made (no error)", failed(c))
        c = self.network()
        c["fault_log"][1]["note"] = c["fault_log"][1]["note"].replace("150 dropped", "0 dropped")
        self.assertEqual(failed(c), ["network: the delay line dropped packets in every net-lag"])
        c = self.network()
        c["fault_log"][-1]["recovery_ms"] = None  # the last, cut short by the end of the load
        self.assertEqual(failed(c), [])
        c["fault_log"][0]["recovery_ms"] = None
        self.assertEqual(failed(c), ["network: the pipeline moved on after every network fault"])
        # Without NET_FAULTS no network run is judged (or needed).
        self.assertNotIn("network", exp10.judge(self.runs(), "quick", 20, 4)["runs"])

    def test_the_matrix_runs_each_measured_with_every_order_applied(self):
        s = exp10.judge(self.runs(), "quick", 20, 4)
        self.assertEqual([(m["relays"], m["payments"]) for m in s["matrix"]], [(1, 1), (2, 3)])
        self.assertEqual(exp10.matrix_line(s["matrix"][1]),
                         "exp-10 matrix: 2 relays, 3 payments at 300/s: 1000 orders, 299.0 applied/s, "
                         "commit->effect p50 40.5 ms p99 180.0 ms, client p99 5.0 ms")
        runs = self.runs()
        runs["matrix-2x3"] = matrix_run("matrix-2x3", applied=999)
        self.assertEqual(self.failed(runs)[1], ["matrix-2x3: commit->effect measured, every order applied"])
        runs["matrix-2x3"]["commit_to_effect"] = None
        self.assertEqual(self.failed(runs)[1], ["matrix-2x3: commit->effect measured, every order applied"])
        runs["matrix-2x3"] = matrix_run("matrix-2x3")
        runs["matrix-2x3"]["services"]["payments"]["instances"].pop()
        self.assertEqual(self.failed(runs)[1], ["matrix-2x3: payments ran as 3 instances"])

    def test_parts_judge_only_their_runs(self):
        runs = {"network": self.network()}
        s = exp10.judge(runs, "full", 400, 16, net_faults=4, parts=("network",))
        self.assertEqual((s["verdict"], list(s["runs"])), ("PASS", ["network"]))
        self.assertEqual(exp10.tags("full", 12, ("scale", "network")), ["scale-dynamic", "scale-static", "network"])
        self.assertEqual(exp10.tags("quick", 0, ("network",)), [])


if __name__ == "__main__":
    unittest.main()
