"""Tests of experiment 7's verdict on hand-made chaos summaries."""
import unittest

import exp7
from fixtures import chaos, lives, loadgen, recon


def run(recon_exit=0, hot_keys=10, mismatches=0, deadlocks=0, write_deadlocks=0, hot_p99=8.0):
    load = loadgen(mismatches=mismatches)
    load["key_classes"] = {
        "hot": {"sends": 500, "ok": 500, "errors": 0, "keys_succeeded": hot_keys, "retries_per_success": 0.0,
                "latency_ms": {"count": 500, "p50_ms": 2.0, "p99_ms": hot_p99, "p999_ms": 12.0, "max_ms": 20.0}},
        "cold": {"sends": 500, "ok": 500, "errors": 0, "keys_succeeded": 450, "retries_per_success": 0.0,
                 "latency_ms": {"count": 500, "p50_ms": 1.5, "p99_ms": 4.0, "p999_ms": 9.0, "max_ms": 11.0}},
    }
    c = chaos(recon_exit=recon_exit, rec=recon(orders=460, clean=recon_exit == 0), load=load,
              orders=lives(counters={"write_deadlocks": write_deadlocks}))
    return c, {"deadlocks": deadlocks, "xact_rollback": 3, "xact_commit": 900}


def rows(**override):
    out = {}
    for strategy, coalescing in exp7.CONFIGS:
        t = exp7.tag(strategy, coalescing)
        c, pg = override.get(t) or run()
        out[t] = exp7.row(strategy, coalescing, c, pg)
    return out


class Exp7Test(unittest.TestCase):
    def failed(self, r):
        s = exp7.judge(r, "quick", 10)
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def test_pass_and_the_line(self):
        self.assertEqual(self.failed(rows()), ("PASS", []))
        s = exp7.judge(rows(**{"advisory-lock-single": run(hot_p99=30.0)}), "quick", 10)
        line = exp7.verdict_line(s, "res")
        self.assertIn("advisory-lock-single 30.0/4.0 ms", line)
        self.assertIn("on-conflict-coalesced 8.0/4.0 ms", line)

    def test_drift_mismatches_and_deadlocks_fail(self):
        r = rows(**{"on-conflict-single": run(recon_exit=1, mismatches=2),
                    "advisory-lock-coalesced": run(deadlocks=1)})
        self.assertEqual(self.failed(r)[1], [
            "on-conflict-single: recon CLEAN",
            "on-conflict-single: zero replay mismatches, every key the client saw succeed has its order",
            "advisory-lock-coalesced: no deadlock"])

    def test_a_hot_class_over_its_keys_or_a_missing_run_fails(self):
        r = rows(**{"on-conflict-coalesced": run(hot_keys=11)})
        del r["advisory-lock-single"]
        self.assertEqual(self.failed(r)[1], [
            "on-conflict-coalesced: the hot class took sends on at most 10 keys",
            "advisory-lock-single: ran (a chaos summary)"])


if __name__ == "__main__":
    unittest.main()
