"""Tests of the acceptance run's verdict on hand-made inputs."""
import unittest

import accept
from fixtures import chaos, loadgen, recon


def minute_rows(n, p99="12.0"):
    load = [{"minute": str(m), "sent": "300000", "ok": "300000", "errors": "0", "sent_per_s": "5000.0",
             "p50_ms": "3.0", "p99_ms": p99, "p999_ms": "30.0", "max_ms": "80.0"} for m in range(n)]
    pipe = [{"minute": str(m), "pending_rows_max": "40", "oldest_pending_s_max": "0.2",
             "publish_p50_ms": "5.0", "publish_p99_ms": "20.0", "effect_p50_ms": "8.0",
             "effect_p99_ms": "30.0"} for m in range(n)]
    return accept.minutes(load, pipe)


def summary(recon_exit=0, orders=1000, keys=None, p99=12.0, offered=5005.0, achieved=5004.0):
    load = loadgen(keys_succeeded=orders if keys is None else keys, p99=p99)
    load["rates"].update({"offered_sends": offered, "achieved": achieved})
    return chaos(recon_exit=recon_exit, rec=recon(orders=orders, clean=recon_exit == 0), load=load)


class AcceptTest(unittest.TestCase):
    def failed(self, c, rows, mode="full", duration=1200):
        s = accept.judge(c, rows, mode, duration)
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def test_pass_and_the_line(self):
        self.assertEqual(self.failed(summary(), minute_rows(20)), ("PASS", []))
        s = accept.judge(summary(), minute_rows(20), "full", 1200)
        line = accept.verdict_line(s, "res")
        self.assertIn("1000 orders == 1000 keys, recon CLEAN", line)
        self.assertIn("p99 12.0 ms (under the 25 ms SLO), 0 of 20 minutes over it", line)
        self.assertEqual(s["minutes"][0]["effect_p99_ms"], "30.0")

    def test_the_slo_and_the_rate_are_judged_in_full_mode_only(self):
        slow = summary(p99=51.5, achieved=4000.0)
        self.assertEqual(self.failed(slow, minute_rows(20, p99="60.0"))[1], [
            "offered 5,000 sends/s and achieved them (within 2%)",
            "synchronous p99 < 25 ms over the run"])
        self.assertEqual(self.failed(slow, minute_rows(1, p99="60.0"), mode="quick", duration=60), ("PASS", []))

    def test_committed_ambiguous_keys_count_as_keys(self):
        c = summary(keys=990)
        c["recon"]["intents"].update({"client_succeeded": 990, "matched": 990, "client_ambiguous": 10,
                                      "ambiguous_committed": 10})
        self.assertEqual(self.failed(c, minute_rows(20)), ("PASS", []))

    def test_keys_answered_408_or_5xx_that_committed_count_as_keys(self):
        # loadgen files a key answered 408 or 503 as ambiguous; recon finds
        # which of them committed and reports none of the refused keys did.
        c = summary(keys=995)
        c["load"]["keys"].update({"ambiguous": 7, "failed": 3})
        c["recon"]["intents"].update({"client_succeeded": 995, "matched": 995, "client_ambiguous": 7,
                                      "ambiguous_committed": 5, "client_failed": 3, "failed_committed": 0})
        s = accept.judge(c, minute_rows(20), "full", 1200)
        self.assertEqual((s["verdict"], s["facts"]["client_refused"], s["facts"]["client_refused_committed"]),
                         ("PASS", 3, 0))

    def test_a_refused_key_with_an_order_fails(self):
        # A key the client was refused (a definite 4xx) that has an order:
        # recon says DRIFT, and the verdict names it.
        c = summary(recon_exit=1, keys=999)
        c["load"]["keys"]["failed"] = 1
        c["recon"]["intents"].update({"client_succeeded": 999, "matched": 999, "client_failed": 1,
                                      "failed_committed": 1})
        self.assertEqual(self.failed(c, minute_rows(20))[1], [
            "recon CLEAN (distinct effects == distinct intents, the SQL diff in recon.sql)",
            "distinct orders == distinct keys, exactly (client successes + committed ambiguous keys)",
            "no key the client was refused has an order"])

    def test_a_missing_order_or_drift_fails(self):
        self.assertEqual(self.failed(summary(recon_exit=1, keys=1001), minute_rows(20))[1], [
            "recon CLEAN (distinct effects == distinct intents, the SQL diff in recon.sql)",
            "distinct orders == distinct keys, exactly (client successes + committed ambiguous keys)"])
        self.assertEqual(self.failed(summary(), minute_rows(3))[1], ["a row per minute of the run"])


if __name__ == "__main__":
    unittest.main()
