"""Tests of experiment 3's verdict: relay killed at publish, orders at commit."""
import unittest

import exp3
from fixtures import chaos, lives, loadgen, recon


def runs(relay_kills=5, hits=7, relay_rec=None, orders_kills=5, error_retries=9, orders_rec=None,
         relay_exit=0, orders_exit=0):
    c = chaos(relay_exit, relay_rec or recon(),
              relay=lives({"crash_point:publish": relay_kills}, {"published": 100}),
              payments=lives(counters={"inbox_hits": hits, "inbox_misses": 100, "consumed": 100 + hits}))
    o = chaos(orders_exit, orders_rec or recon(60), orders=lives({"crash_point:commit": orders_kills}),
              load=loadgen(error_retries=error_retries))
    return c, o


class Exp3Test(unittest.TestCase):
    def failed(self, c, o, min_kills=3):
        s = exp3.judge(c, o, "quick", min_kills)
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def test_pass(self):
        c, o = runs()
        verdict, failed = self.failed(c, o)
        self.assertEqual((verdict, failed), ("PASS", []))
        s = exp3.judge(c, o, "quick", 3)
        self.assertEqual(s["duplicate_deliveries"], 7)
        self.assertIn("exp-3: PASS — 5 relay kills at publish", exp3.verdict_line(s, "res"))

    def test_kills_at_the_boundary(self):
        self.assertEqual(self.failed(*runs(relay_kills=3, orders_kills=3))[0], "PASS")
        verdict, failed = self.failed(*runs(relay_kills=2))
        self.assertEqual(verdict, "FAIL")
        self.assertEqual(failed, ["relay killed at crash point publish at least 3 times"])
        verdict, failed = self.failed(*runs(orders_kills=2))
        self.assertEqual(failed, ["orders-commit: orders killed after commit at least 3 times"])

    def test_a_lost_or_doubled_effect_fails(self):
        _, failed = self.failed(*runs(relay_exit=1, relay_rec=recon(lost=1)))
        self.assertIn("no lost effect", failed)
        self.assertIn("recon CLEAN (every committed order published and charged once; client intents match)", failed)
        _, failed = self.failed(*runs(relay_exit=1, relay_rec=recon(doubled=1)))
        self.assertIn("no double effect", failed)

    def test_no_redelivery_absorbed_fails(self):
        _, failed = self.failed(*runs(hits=0))
        self.assertEqual(failed, ["re-published events reached payments and were absorbed (inbox hits > 0)"])

    def test_debezium_is_judged_by_its_workers_kills_from_outside(self):
        c, o = runs()
        c["params"]["relay_kind"] = "debezium"
        # Its worker serves no metrics: kills from outside, no crash point.
        c["services"]["relay"] = lives({"random_kill": 4})
        s = exp3.judge(c, o, "quick", 3)
        self.assertEqual((s["verdict"], s["relay_kills"], s["relay_kind"]), ("PASS", 4, "debezium"))
        self.assertIn("exp-3: PASS — 4 Debezium worker kills (-9)", exp3.verdict_line(s, "res"))
        c["services"]["relay"] = lives({"random_kill": 2})
        _, failed = self.failed(c, o)
        self.assertEqual(failed, ["Debezium's Connect worker killed -9 at least 3 times"])

    def test_orders_commit_needs_retries_and_no_ambiguous_key(self):
        key_check = ("orders-commit: the client retried errors, and every key ended with exactly one order "
                     "(0 ambiguous)")
        self.assertEqual(self.failed(*runs(error_retries=0))[1], [key_check])
        self.assertEqual(self.failed(*runs(orders_rec=recon(60, ambiguous=1)))[1], [key_check])
        self.assertEqual(self.failed(*runs(orders_exit=1))[1], ["orders-commit: recon CLEAN"])


if __name__ == "__main__":
    unittest.main()
