"""Tests of the key-expiry run's verdict."""
import unittest

import keyexpiry
from fixtures import chaos

FLOOR_A = "0190aaaa-0000-7000-8000-000000000000"
FLOOR_B = "0190bbbb-0000-7000-8000-000000000000"


def snap(at, floor, delta=0, below=0, orders=1000, intents=None):
    deltas = [{"name": n, "value": 0} for n in keyexpiry.KEY_DELTAS]
    deltas[0]["value"] = delta
    return {"at": at, "keys_below_floor": below,
            "report": {"distinct_orders": orders, "orders_since_key_floor": intents or orders,
                       "intents": orders if intents is None else intents, "floors": {"keys": floor}},
            "deltas": deltas}


def run(**kw):
    snaps = kw.pop("snaps", None) or [
        snap(0, keyexpiry.NIL), snap(15, keyexpiry.NIL), snap(30, FLOOR_A, below=3, intents=600),
        snap(45, FLOOR_A, intents=700), snap(60, FLOOR_B, below=2, intents=650)]
    return keyexpiry.judge(chaos(kw.pop("recon_exit", 0), elapsed_s=60.0), snaps, kw.pop("mode", "full"), 60, 60)


class KeyExpiryTest(unittest.TestCase):
    def test_pass(self):
        s = run()
        self.assertEqual(s["verdict"], "PASS", s["checks"])
        self.assertEqual((s["key_floor_moves"], s["max_keys_below_floor"], s["worst_before_the_fix"]), (2, 3, -3))
        self.assertIn("key-expiry: PASS — 5 snapshots", keyexpiry.verdict_line(s, "res"))

    def test_a_key_delta_in_any_snapshot_fails(self):
        snaps = [snap(0, keyexpiry.NIL), snap(15, FLOOR_A, delta=-3, below=3, intents=600),
                 snap(30, FLOOR_B, intents=600), snap(45, FLOOR_B, intents=600)]
        s = run(snaps=snaps)
        self.assertEqual(s["verdict"], "FAIL")
        self.assertEqual([k for k, v in s["checks"].items() if not v],
                         ["every snapshot: the key counts are 0 (" + ", ".join(keyexpiry.KEY_DELTAS) + ")"])

    def test_no_expiry_proves_nothing(self):
        snaps = [snap(t, keyexpiry.NIL) for t in (0, 15, 30, 45)]
        failed = [k for k, v in run(snaps=snaps)["checks"].items() if not v]
        self.assertEqual(len(failed), 2, failed)

    def test_drift_at_the_end_fails(self):
        self.assertEqual(run(recon_exit=1)["verdict"], "FAIL")

    def test_snapshots_cut_off_mid_line_are_skipped(self):
        import os
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "s.jsonl")
            with open(p, "w", encoding="utf-8") as f:
                f.write('{"at": 1}\n{"at": 2, "rep')
            self.assertEqual(keyexpiry.read_snapshots(p), [{"at": 1}])
            self.assertEqual(keyexpiry.read_snapshots(os.path.join(d, "absent")), [])


if __name__ == "__main__":
    unittest.main()
