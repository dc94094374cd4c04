"""Tests of experiment 4's verdict: safe kills clean, the unsafe split drifts."""
import unittest

import exp4
from fixtures import chaos, lives, recon


def run(point, kills, recon_exit=0, rec=None):
    return exp4.row(chaos(recon_exit, rec or recon(), payments=lives({f"crash_point:{point}": kills})), point)


def rows(**override):
    r = {
        "payments-effect": run("effect", 5),
        "payments-claim": run("claim", 5),
        # The counter-example as it must come out: inbox-first loses, effect-first doubles.
        "split-inbox-first": run("split", 2, 1, recon(lost=4)),
        "split-effect-first": run("split", 2, 1, recon(doubled=3)),
    }
    r.update(override)
    return r


class Exp4Test(unittest.TestCase):
    def failed(self, r, mode="quick", min_kills=3):
        s = exp4.judge(r, mode, min_kills)
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def test_pass_with_the_drift_expected_and_found(self):
        self.assertEqual(self.failed(rows()), ("PASS", []))
        r = rows()
        self.assertEqual((r["split-inbox-first"]["lost_effects"], r["split-effect-first"]["double_charged_orders"]),
                         (4, 3))
        self.assertEqual(r["split-effect-first"]["extra_effects"], 3)
        self.assertEqual(r["split-effect-first"]["extra_cents"], 300)
        s = exp4.judge(r, "quick", 3)
        self.assertIn("inbox-first lost 4 of 100, effect-first doubled 3 of 100", exp4.verdict_line(s, "res"))
        self.assertIn("DRIFT", exp4.table(r))

    def test_a_clean_split_run_fails(self):
        # The counter-example must show its drift: clean means it proved nothing.
        _, failed = self.failed(rows(**{"split-inbox-first": run("split", 2)}))
        self.assertEqual(failed, ["split inbox-first: recon DRIFT with lost effects and no double"])
        _, failed = self.failed(rows(**{"split-effect-first": run("split", 2)}))
        self.assertEqual(failed, ["split effect-first: recon DRIFT with doubled effects, still one charge row per order"])

    def test_the_split_drifting_the_wrong_way_fails(self):
        _, failed = self.failed(rows(**{"split-inbox-first": run("split", 2, 1, recon(lost=1, doubled=1))}))
        self.assertEqual(failed, ["split inbox-first: recon DRIFT with lost effects and no double"])
        _, failed = self.failed(rows(**{"split-effect-first": run("split", 2, 1, recon(doubled=2, lost=1))}))
        self.assertEqual(failed, ["split effect-first: recon DRIFT with doubled effects, still one charge row per order"])

    def test_split_not_killed_fails(self):
        _, failed = self.failed(rows(**{"split-inbox-first": run("split", 0, 1, recon(lost=4))}))
        self.assertEqual(failed, ["split inbox-first: killed between its transactions"])

    def test_safe_runs_lost_doubled_or_too_few_kills_fail(self):
        _, failed = self.failed(rows(**{"payments-effect": run("effect", 5, 1, recon(lost=1))}))
        self.assertEqual(failed, ["payments-effect: recon CLEAN (zero lost, zero double)"])
        _, failed = self.failed(rows(**{"payments-claim": run("claim", 5, 1, recon(doubled=1))}))
        self.assertEqual(failed, ["payments-claim: recon CLEAN (zero lost, zero double)"])
        self.assertEqual(self.failed(rows(**{"payments-claim": run("claim", 3)}))[0], "PASS")
        _, failed = self.failed(rows(**{"payments-claim": run("claim", 2)}))
        self.assertEqual(failed, ["payments-claim: killed at least 3 times"])

    def test_full_mode_judges_the_dynamic_membership_run(self):
        self.assertEqual(self.failed(rows(**{"payments-effect-dynamic": run("effect", 5)}), "full"), ("PASS", []))
        _, failed = self.failed(rows(**{"payments-effect-dynamic": run("effect", 5, 1)}), "full")
        self.assertEqual(failed, ["payments-effect-dynamic (no static membership): recon CLEAN"])


if __name__ == "__main__":
    unittest.main()
