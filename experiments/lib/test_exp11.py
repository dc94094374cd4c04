"""Tests of experiment 11's verdict: each of the cluster's faults injected and
recovered under load, nothing lost or doubled, the client's keys all matched."""
import unittest

import exp11
from fixtures import chaos, lives, recon


def faults(n=1, recovered=None):
    return {name: {"injected": n, "recovered": n if recovered is None else recovered, "failed_to_inject": 0,
                   "recovery_ms": {"p50": 21000, "max": 23000}} for name in exp11.FAULTS}


LOG = [{"fault": "pg-failover", "note": "pg1 -> pg2", "outage_ms": 21500, "recovery_ms": 23000, "error": None},
       {"fault": "pg-switchover", "note": "pg2 -> pg1", "outage_ms": 4100, "recovery_ms": 5200, "error": None},
       {"fault": "pg-partition", "outage_ms": 24000, "recovery_ms": 26000, "error": None,
        "note": "pg1 -> pg3, cut off 30.000 s: pg1 no longer a primary after 6.7 s, pg3 the primary after 22.2 s, "
                "two primaries in 0 of 72 looks, 0 bytes of pg1's WAL not on pg3"}]


def committed(messages=100, lost=0):
    return {"messages": messages, "recorded": messages - lost, "inbox_expired": 0, "lost_effects": lost,
            "events_without_outbox_row": 0}


def sync_run(f=None, rec=None, recon_exit=0, kills=6, fault_log=None):
    rec = rec or recon()
    rec.setdefault("committed", committed())
    return chaos(recon_exit, rec, kills_total=kills,
                 orders=lives({"crash_point:commit": 1}), relay=lives({"crash_point:publish": 1}),
                 payments=lives({"crash_point:claim": 1, "crash_point:effect": 1}),
                 totals={"inbox_hits": 4}, faults=f or faults(), fault_log=LOG if fault_log is None else fault_log,
                 injected_duplicates=4)


ASYNC_LOG = [{"fault": "pg-lagged-failover", "outage_ms": 22000, "recovery_ms": 24000, "error": None,
              "note": "pg1 -> pg2, replication stalled 2.000 s first: 180224 bytes of pg1's WAL not on pg2"},
             {"fault": "pg-lagged-failover", "outage_ms": 21000, "recovery_ms": 23500, "error": None,
              "note": "pg2 -> pg3, replication stalled 2.000 s first: 90112 bytes of pg2's WAL not on pg3"}]


def async_run(missing=250, wrong=3, phantoms=4, recon_exit=1, fault_log=None, injected=2):
    """The counter-example as it should come out: acknowledged keys gone,
    some remade as another order by the client's retry, phantom charges."""
    rec = recon(orders=9000)
    rec["committed"] = committed(messages=9000, lost=2)
    rec["intents"].update({"client_succeeded": 9000 + missing + wrong, "missing_in_db": missing,
                           "wrong_order": wrong})
    rec["report"].update({"charges_without_order": phantoms, "inbox_without_event": phantoms})
    f = {"pg-lagged-failover": {"injected": injected, "recovered": injected, "failed_to_inject": 0,
                                "recovery_ms": {"p50": 23500, "max": 24000}}}
    return chaos(recon_exit, rec, faults=f, fault_log=ASYNC_LOG if fault_log is None else fault_log)


def wal_run(recon_exit=0, rec=None):
    """The WAL relay's run: each switch once, recovered."""
    rec = rec or recon()
    rec.setdefault("committed", committed())
    f = {name: {"injected": 1, "recovered": 1, "failed_to_inject": 0, "recovery_ms": {"p50": 9000, "max": 24000}}
         for name in exp11.WAL_FAULTS}
    return chaos(recon_exit, rec, faults=f, fault_log=LOG)


class Exp11Test(unittest.TestCase):
    def failed(self, run, min_kills=4, unsync=None, wal=None):
        s = exp11.judge(run, "quick", min_kills, 1, async_run() if unsync is None else unsync,
                        wal_run() if wal is None else wal)
        return s["verdict"], [k for k, v in s["checks"].items() if not v]

    def test_pass_and_the_fault_log(self):
        self.assertEqual(self.failed(sync_run()), ("PASS", []))
        s = exp11.judge(sync_run(), "quick", 4, 1)
        self.assertEqual([f["note"] for f in s["runs"]["sync"]["fault_log"]][:2], ["pg1 -> pg2", "pg2 -> pg1"])
        self.assertEqual(s["runs"]["sync"]["partitions"], [{"cut_off": 1, "promoted": 3, "fenced_s": 6.7,
                                                            "promoted_s": 22.2, "two_primaries": 0, "looks": 72}])
        self.assertIn("pg-failover 1/1 recovered", exp11.run_line("sync", s["runs"]["sync"], exp11.FAULTS, "exp-11"))

    def test_a_lost_or_doubled_order_fails(self):
        verdict, failed = self.failed(sync_run(rec=recon(lost=1), recon_exit=1))
        self.assertEqual(verdict, "FAIL")
        self.assertIn("sync: no order without its charge", failed)
        self.assertIn("sync: no double charge", self.failed(sync_run(rec=recon(doubled=1), recon_exit=1))[1])

    def test_a_committed_offset_past_a_lost_effect_fails_and_the_check_must_run(self):
        lost = recon(lost=1)
        lost["committed"] = committed(lost=1)
        self.assertIn("sync: every message the consumer group committed past left its trace "
                      "(recon --committed-past)", self.failed(sync_run(rec=lost, recon_exit=1))[1])
        unchecked = recon()
        unchecked["committed"] = None
        self.assertEqual(self.failed(sync_run(rec=unchecked))[1],
                         ["sync: every message the consumer group committed past left its trace "
                          "(recon --committed-past)"])

    def test_quick_mode_leaves_the_lagged_failover_to_the_asynchronous_run(self):
        f = faults()
        del f["pg-lagged-failover"]
        self.assertEqual(self.failed(sync_run(f=f)), ("PASS", []))
        s = exp11.judge(sync_run(f=f), "full", 4, 1, async_run(), wal_run())
        self.assertIn("sync: pg-lagged-failover injected at least 1x, every one recovered",
                      [k for k, v in s["checks"].items() if not v])

    def test_each_cluster_fault_must_be_injected_and_recovered(self):
        f = faults()
        f["pg-standby-loss"]["recovered"] = 0
        self.assertEqual(self.failed(sync_run(f=f, fault_log=LOG[2:]))[1],
                         ["sync: pg-standby-loss injected at least 1x, every one recovered"])
        f = faults()
        del f["pg-failover"]
        self.assertEqual(self.failed(sync_run(f=f))[1], ["sync: pg-failover injected at least 1x, every one recovered"])

    def test_a_partition_must_fence_the_old_primary_and_promote_one_other(self):
        check = ("sync: each pg-partition fenced the cut-off primary and promoted another, "
                 "never two primaries at once")

        def with_note(note):
            return sync_run(fault_log=LOG[:2] + [dict(LOG[2], note=note)])

        split = "pg1 -> pg3, cut off 30.000 s: pg1 no longer a primary after 6.7 s, pg3 the primary after 22.2 s, " \
                "two primaries in 2 of 72 looks"
        self.assertEqual(self.failed(with_note(split))[1], [check])
        never = "pg1 -> pg1, cut off 15.000 s: pg1 no longer a primary after 6.7 s, no other node promoted, " \
                "two primaries in 0 of 36 looks"
        self.assertEqual(self.failed(with_note(never))[1], [check])
        unfenced = "pg1 -> pg3, cut off 30.000 s: pg1 a primary throughout, pg3 the primary after 22.2 s, " \
                   "two primaries in 0 of 72 looks"
        self.assertEqual(self.failed(with_note(unfenced))[1], [check])
        self.assertEqual(self.failed(with_note("garbled"))[1], [check])
        self.assertEqual(self.failed(sync_run(fault_log=LOG[:2]))[1], [check])

    def test_the_wal_relay_must_come_through_clean(self):
        self.assertEqual(self.failed(sync_run()), ("PASS", []))
        failed = self.failed(sync_run(), wal=wal_run(recon_exit=1, rec=recon(lost=1)))[1]
        self.assertIn("wal: recon CLEAN (0 lost, 0 doubled, every check)", failed)
        self.assertIn("wal: no order without its charge", failed)
        s = exp11.judge(sync_run(), "quick", 4, 1, async_run(), None)
        self.assertEqual([k for k, v in s["checks"].items() if not v], ["wal: the WAL relay's run's summary is there"])
        exited = wal_run()
        exited["services"]["relay"] = lives({"crash_point:publish": 2, "exit:1": 1})
        self.assertEqual(self.failed(sync_run(), wal=exited)[1],
                         ["wal: the relay died only at its crash point (never exited through a switch)"])

    def test_the_asynchronous_run_counts_what_it_lost(self):
        s = exp11.judge(sync_run(), "quick", 4, 1, async_run(), wal_run())
        self.assertEqual(s["verdict"], "PASS", [k for k, v in s["checks"].items() if not v])
        lost = s["runs"]["async"]["losses"]
        self.assertEqual(lost["lost_wal_bytes"], 180224 + 90112)
        self.assertEqual((lost["missing_in_db"], lost["wrong_order"], lost["charges_without_order"]), (250, 3, 4))
        self.assertEqual(lost["lost_effects"], 2)

    def test_an_asynchronous_run_that_shows_no_loss_fails(self):
        # Recon CLEAN: the counter-example showed nothing, so it proves nothing.
        clean = async_run(missing=0, wrong=0, phantoms=0, recon_exit=0)
        failed = self.failed(sync_run(), unsync=clean)[1]
        self.assertIn("async: acknowledged orders lost (keys the client saw succeed, gone or remade)", failed)
        self.assertIn("async: recon and the intents check report DRIFT", failed)
        # No note with the WAL the new primary lacked: the lag was not made.
        no_lag = [dict(f, note="pg1 -> pg2") for f in ASYNC_LOG]
        self.assertEqual(self.failed(sync_run(), unsync=async_run(fault_log=no_lag))[1],
                         ["async: the promoted standbys lacked WAL the old primary had"])
        self.assertEqual(self.failed(sync_run(), unsync=async_run(injected=0, fault_log=[]))[1],
                         ["async: pg-lagged-failover injected at least 1x, every one recovered",
                          "async: the promoted standbys lacked WAL the old primary had"])

    def test_a_missing_asynchronous_run_fails(self):
        s = exp11.judge(sync_run(), "quick", 4, 1, None, wal_run())
        self.assertEqual(s["verdict"], "FAIL")
        self.assertEqual([k for k, v in s["checks"].items() if not v],
                         ["async: the asynchronous run's summary is there"])


if __name__ == "__main__":
    unittest.main()
