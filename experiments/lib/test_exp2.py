"""Tests of experiment 2's tables and verdict: duplicates absorbed, each event charged once."""
import unittest

import exp2
from fixtures import chaos, recon


def dup_run(rep=10, red=10, hits=20, rec=None, recon_exit=0):
    return exp2.under_load(chaos(recon_exit, rec or recon(), totals={
        "injected_reprocess": rep, "injected_redeliver": red, "inbox_hits": hits, "inbox_misses": 100,
        "consumed": 100 + hits}))


def drain_rows(misses=(100, 100), doubles=(0, 0)):
    return [{"dup_rate": "0.30", "kind": "both", "rep": str(i + 1), "events": "100", "span_s": "1.0",
             "effects_per_s": str(100 + 10 * i), "consumed": "130", "consumed_per_s": "130",
             "inbox_hits": "30", "inbox_misses": str(m), "injected": "30", "doubles": str(d)}
            for i, (m, d) in enumerate(zip(misses, doubles))]


class Exp2Test(unittest.TestCase):
    def failed(self, runs, drain):
        s = exp2.judge(runs, exp2.drain_table(drain), drain, "quick")
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def test_pass(self):
        runs = {"0.05": dup_run(), "0.30": dup_run(30, 30, 60)}
        self.assertEqual(self.failed(runs, drain_rows()), ("PASS", []))
        self.assertAlmostEqual(runs["0.05"]["hit_ratio"], 20 / 120)

    def test_drain_row_and_medians(self):
        self.assertEqual(exp2.drain_row("0.30", "both", "1", "60000", "2.5", "78000", "18000", "60000", "18000", "0"),
                         "0.30,both,1,60000,2.500,24000,78000,31200,18000,60000,18000,0")
        # A scrape that missed a metric reads 0; a zero span gives 0 per second.
        self.assertEqual(exp2.drain_row("0", "both", "1", "10", "", "", "", "", "", "0"), "0,both,1,10,0.000,0,0,0,0,0,0,0")
        self.assertEqual(exp2.DRAIN_RUNS_HEADER.split(","), list(drain_rows()[0]))
        (t,) = exp2.drain_table(drain_rows(misses=(100, 99), doubles=(0, 2)))
        self.assertEqual((t["reps"], t["effects_per_s"], t["effects_per_s_min"], t["effects_per_s_max"]), (2, 105, 100, 110))
        self.assertEqual((t["inbox_misses_min"], t["doubles_max"]), (99, 2))

    def test_a_double_under_load_fails(self):
        _, failed = self.failed({"0.05": dup_run(rec=recon(doubled=1), recon_exit=1)}, drain_rows())
        self.assertEqual(failed, ["dup 0.05: recon CLEAN, distinct_charges == distinct_orders, zero doubles"])

    def test_duplicates_not_absorbed_or_of_one_kind_fail(self):
        check = "dup 0.05: duplicates of both kinds injected and every one absorbed (inbox hits >= injected)"
        self.assertEqual(self.failed({"0.05": dup_run(hits=19)}, drain_rows())[1], [check])
        self.assertEqual(self.failed({"0.05": dup_run(red=0, hits=10)}, drain_rows())[1], [check])

    def test_a_drain_with_a_missed_or_doubled_event_fails(self):
        check = "drain at dup 0.30 (both): every event charged once in every repetition"
        self.assertEqual(self.failed({"0.05": dup_run()}, drain_rows(misses=(100, 99)))[1], [check])
        self.assertEqual(self.failed({"0.05": dup_run()}, drain_rows(doubles=(0, 1)))[1], [check])


if __name__ == "__main__":
    unittest.main()
