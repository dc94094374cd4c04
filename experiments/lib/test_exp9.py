"""Tests of experiment 9's verdict: the receiver's faults survived with
nothing lost or doubled, the schedule never early, failed deliveries replayed."""
import unittest

import exp9
from fixtures import chaos, lives, recon

TOTALS = {"webhook_retries": 40, "webhook_duplicates": 3, "proxy_errored": 20, "proxy_held": 5}


def faults_run(recon_exit=0, rec=None, totals=None, fault_log=None, kills=4):
    f = {name: {"injected": 1, "recovered": 1, "failed_to_inject": 0} for name in exp9.FAULTS}
    r = rec or recon()
    r["report"]["failed_deliveries"] = r["report"].get("failed_deliveries", 0)
    return chaos(recon_exit, r, kills_total=kills,
                 relay=lives({"crash_point:deliver": 2}), payments=lives({"crash_point:respond": 2, "crash_point:effect": 1}),
                 totals=dict(TOTALS if totals is None else totals), faults=f, fault_log=fault_log or [],
                 params={"crash_point": ["respond", "deliver", "effect"]})


def attempts(*deliveries):
    """attempts.csv rows: each delivery a list of (start s, duration ms,
    outcome) for its attempts 1, 2, ..."""
    rows = []
    for i, tries in enumerate(deliveries):
        for n, (start, ms, outcome) in enumerate(tries, 1):
            rows.append({"outbox_id": str(i), "attempt": str(n), "started_s": str(start),
                         "duration_ms": str(ms), "status": "500", "outcome": outcome})
    return rows


# Scale 1: waits of 5 s, 30 s, 300 s, 1800 s after 1, 2, 3, 4 failures.
ON_TIME = attempts([(0, 100, "retry"), (5.1, 0, "retry"), (35.1, 0, "retry"), (335.1, 0, "retry"),
                    (2135.1, 0, "delivered")])


class Exp9Test(unittest.TestCase):
    def test_the_schedule_table_and_an_early_retry(self):
        table = exp9.schedule_table(ON_TIME, 1.0)
        self.assertEqual([r["failed_attempts"] for r in table], [1, 2, 3, 4])
        self.assertEqual([r["early"] for r in table], [0, 0, 0, 0])
        self.assertEqual(table[0]["scheduled_ms"], 5000)
        self.assertEqual(table[0]["observed_p50_ms"], 5000)
        early = attempts([(0, 0, "retry"), (3.9, 0, "delivered")])
        self.assertEqual(exp9.schedule_table(early, 1.0)[0]["early"], 1, "3.9 s < 5 s x 0.8")
        # Late is allowed: the schedule is a minimum (queueing adds to it).
        late = attempts([(0, 0, "retry"), (60, 0, "delivered")])
        self.assertEqual(exp9.schedule_table(late, 1.0)[0]["early"], 0)

    def test_the_faults_run(self):
        table = exp9.schedule_table(ON_TIME, 1.0)
        checks = exp9.faults_checks(faults_run(), table, 2)
        self.assertEqual([k for k, v in checks.items() if not v], [])
        lost = exp9.faults_checks(faults_run(1, recon(lost=2)), table, 2)
        self.assertIn("faults: no order without its charge", [k for k, v in lost.items() if not v])
        quiet = exp9.faults_checks(faults_run(totals={}), table, 2)
        self.assertEqual(len([k for k, v in quiet.items() if not v]), 3, "no retries, proxy faults, duplicates")
        unfired = faults_run()
        unfired["services"]["payments"]["deaths"].pop("crash_point:effect")
        self.assertEqual([k for k, v in exp9.faults_checks(unfired, table, 2).items() if not v],
                         ["faults: crash point effect fired"], "an armed point that never fired")
        short = exp9.faults_checks(faults_run(), exp9.schedule_table(ON_TIME[:3], 1.0), 2)
        self.assertFalse(short["faults: the retry schedule observed (a wait after at least 4 failed attempts)"])
        three = exp9.faults_checks(faults_run(), exp9.schedule_table(ON_TIME[:4], 1.0), 2, 3)
        self.assertTrue(three["faults: the retry schedule observed (a wait after at least 3 failed attempts)"])
        two = exp9.faults_checks(faults_run(), exp9.schedule_table(ON_TIME[:3], 1.0), 2, 3)
        self.assertFalse(two["faults: the retry schedule observed (a wait after at least 3 failed attempts)"])

    def test_the_drift_is_named_on_the_printed_line(self):
        self.assertEqual(exp9.drift_text(faults_run()), "")
        lost = faults_run(1, recon(lost=2))
        lost["recon"]["drift"] = ["orders_without_charge", "distinct_charges - distinct_orders"]
        lost["recon"]["deltas"] = [{"name": "distinct_charges - distinct_orders", "value": -2}]
        lost["recon"]["drained"] = False
        lost["recon"]["intents"]["matched"] = 99
        self.assertEqual(exp9.drift_text(lost),
                         " (drift: orders_without_charge 2, distinct_charges - distinct_orders -2, "
                         "client keys matched 99 of 100, not drained in time)")

    def test_the_replay(self):
        rec = recon(lost=7, clean=False)
        rec["report"]["failed_deliveries"] = 7
        rec["drift"] = ["orders_without_charge", "failed_deliveries"]
        c = chaos(1, rec)
        ok = exp9.replay_checks(c, "7 failed deliveries queued again\n", {"clean": True}, 0)
        self.assertEqual([k for k, v in ok.items() if not v], [])
        self.assertEqual(exp9.replayed("no"), None)
        partial = exp9.replay_checks(c, "6 failed deliveries queued again\n", {"clean": False}, 0)
        self.assertEqual(len([k for k, v in partial.items() if not v]), 2)

    def test_a_failed_delivery_applied_before_its_sender_gave_up(self):
        rec = recon(lost=5, clean=False)
        rec["report"]["failed_deliveries"] = 7
        rec["drift"] = ["orders_without_charge", "failed_deliveries"]
        c = chaos(1, rec)
        drift = [k for k in exp9.replay_checks(c, "7 failed deliveries queued again\n", {"clean": True}, 0)
                 if k.startswith("replay: recon called them drift")][0]
        ok = exp9.replay_checks(c, "7 failed deliveries queued again\n", {"clean": True}, 2)
        self.assertEqual([k for k, v in ok.items() if not v], [], "5 uncharged + 2 applied = 7 failed")
        for applied in (0, 1, 3, None, 8):
            got = exp9.replay_checks(c, "7 failed deliveries queued again\n", {"clean": True}, applied)
            self.assertFalse(got[drift], f"applied {applied}: 5 uncharged does not add up to 7 failed")
        self.assertEqual(exp9.applied_anyway("2\n"), 2)
        self.assertEqual(exp9.applied_anyway(""), None)
        self.assertEqual(exp9.applied_anyway("ERROR"), None)

if __name__ == "__main__":
    unittest.main()
