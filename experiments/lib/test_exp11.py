"""Tests of experiment 11's verdict: each of the cluster's faults injected and
recovered under load, nothing lost or doubled, the client's keys all matched."""
import unittest

import exp11
from fixtures import chaos, lives, recon


def faults(n=1, recovered=None):
    return {name: {"injected": n, "recovered": n if recovered is None else recovered, "failed_to_inject": 0,
                   "recovery_ms": {"p50": 21000, "max": 23000}} for name in exp11.FAULTS}


LOG = [{"fault": "pg-failover", "note": "pg1 -> pg2", "outage_ms": 21500, "recovery_ms": 23000, "error": None},
       {"fault": "pg-switchover", "note": "pg2 -> pg1", "outage_ms": 4100, "recovery_ms": 5200, "error": None}]


def sync_run(f=None, rec=None, recon_exit=0, kills=6, fault_log=None):
    return chaos(recon_exit, rec or recon(), kills_total=kills,
                 orders=lives({"crash_point:commit": 1}), relay=lives({"crash_point:publish": 1}),
                 payments=lives({"crash_point:claim": 1, "crash_point:effect": 1}),
                 totals={"inbox_hits": 4}, faults=f or faults(), fault_log=LOG if fault_log is None else fault_log,
                 injected_duplicates=4)


class Exp11Test(unittest.TestCase):
    def failed(self, run, min_kills=4):
        s = exp11.judge(run, "quick", min_kills, 1)
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def test_pass_and_the_fault_log(self):
        self.assertEqual(self.failed(sync_run()), ("PASS", []))
        s = exp11.judge(sync_run(), "quick", 4, 1)
        self.assertEqual([f["note"] for f in s["runs"]["sync"]["fault_log"]], ["pg1 -> pg2", "pg2 -> pg1"])
        self.assertIn("pg-failover 1/1 recovered", exp11.run_line("sync", s["runs"]["sync"], exp11.FAULTS, "exp-11"))

    def test_a_lost_or_doubled_order_fails(self):
        verdict, failed = self.failed(sync_run(rec=recon(lost=1), recon_exit=1))
        self.assertEqual(verdict, "FAIL")
        self.assertIn("sync: no order without its charge", failed)
        self.assertIn("sync: no double charge", self.failed(sync_run(rec=recon(doubled=1), recon_exit=1))[1])

    def test_each_cluster_fault_must_be_injected_and_recovered(self):
        f = faults()
        f["pg-standby-loss"]["recovered"] = 0
        self.assertEqual(self.failed(sync_run(f=f, fault_log=[]))[1],
                         ["sync: pg-standby-loss injected at least 1x, every one recovered"])
        f = faults()
        del f["pg-failover"]
        self.assertEqual(self.failed(sync_run(f=f))[1], ["sync: pg-failover injected at least 1x, every one recovered"])


if __name__ == "__main__":
    unittest.main()
