"""Tests of experiment 10's long run verdict: the stall measure (lanes idle
with work waiting, less what faults covered) and the checks."""
import csv
import os
import tempfile
import unittest

import longrun
from fixtures import chaos, lives, loadgen, recon

T0 = 1_800_000_000_000


def service(n, deaths=None):
    """A service's summary with N instances, each killed as DEATHS says."""
    s = lives(deaths={"random_kill": n} if deaths is None else deaths)
    s["instances"] = [{"label": f"x-{i + 1}", "lives": 2, "deaths": {"random_kill": 1}} for i in range(n)]
    return s


def summary(orders=100, kills=6000, faults=None):
    """A long run's chaos summary: every fault kind made once, 5 s each,
    starting 10 s into the run, 20 s apart."""
    log = faults if faults is not None else [
        {"fault": f, "injected_ms": 10_000 + 20_000 * i, "outage_ms": 5_000, "recovery_ms": 6_000,
         "inbox_hits": 1, "error": None, "note": None} for i, f in enumerate(longrun.FAULTS)]
    load = loadgen()
    load["targets"] = [{"protocol": "http", "url": f"http://o{i}", "sent": 10, "ok": 10} for i in range(2)]
    return chaos(0, recon(orders=orders), kills_total=kills, started_at_unix_ms=T0,
                 params={"orders": 2, "relays": 3, "payments": 6}, orders=service(2), relay=service(3),
                 payments=service(6), load=load, fault_log=log)


def steady(lanes, start, end, every=100, lag=20):
    """LANES each with an event every EVERY ms from START to END (Unix ms
    after T0), done LAG ms after it was ready."""
    return {lane: [(T0 + t, T0 + t + lag) for t in range(start, end, every)] for lane in lanes}


ALL_LANES = [("shard", n) for n in range(16)] + [("partition", n) for n in range(6)]


class IdleGapsTest(unittest.TestCase):
    def test_steady_work_has_only_its_latency(self):
        gaps = longrun.idle_gaps([(0, 20), (100, 120), (200, 220)])
        self.assertEqual(gaps, [(0, 20), (100, 120), (200, 220)])

    def test_a_lane_stopped_with_work_waiting(self):
        # Work ready at 100, 200, 300; nothing done from 20 until 5,000.
        gaps = longrun.idle_gaps([(0, 20), (100, 5000), (200, 5000), (300, 5010)])
        self.assertEqual(gaps, [(0, 20), (100, 5000), (5000, 5010)])

    def test_a_lane_with_nothing_to_do_is_not_idle(self):
        # Nothing ready between 20 and 9,000: no gap there.
        self.assertEqual(longrun.idle_gaps([(0, 20), (9000, 9030)]), [(0, 20), (9000, 9030)])

    def test_work_never_done_waits_until_the_end(self):
        # The lane stops for good at 20 with work ready at 100: idle until the end.
        self.assertEqual(longrun.idle_gaps([(0, 20), (100, None), (200, None)], end=9000), [(0, 20), (100, 9000)])

    def test_covered_by_merged_windows(self):
        merged = longrun.merge([(10, 20), (15, 30), (50, 60)])
        self.assertEqual(merged, [(10, 30), (50, 60)])
        self.assertEqual(longrun.covered((0, 100), merged), 30)
        self.assertEqual(longrun.covered((25, 55), merged), 10)

    def test_partition_of_a_key_as_the_cluster_placed_it(self):
        # Keys and the partitions a 6-partition topic on the stack gave them
        # (read back with Kafka's console consumer, print.partition=true).
        for key, partition in KNOWN_PLACEMENTS:
            self.assertEqual(longrun.partition_of(key, 6), partition, key)


# (order id, partition) seen on the stack's cluster with the relay's producer.
KNOWN_PLACEMENTS = [
    ("01a218b4-506f-71bf-8bdf-fd96f0e80291", 0), ("01a218b4-4fa8-76fd-8751-ad94a82c6b6f", 1),
    ("01a218b4-4fd4-748c-b0fa-447d202aedf0", 2), ("01a218b4-4d04-7169-9349-94ea3bfbacb9", 3),
    ("01a218b4-54cc-7689-94ef-2405ae0b8769", 4), ("01a218b4-5673-746b-b77a-292fa1e707a1", 5),
]


class JudgeTest(unittest.TestCase):
    def judge(self, lanes, c=None, mode="full", min_kills=5000, bound=15_000):
        orders = sum(len(v) for k, v in lanes.items() if k[0] == "shard")
        c = c or summary(orders=orders)
        s = longrun.judge(c, (lanes, orders, 0, 0), mode, min_kills, bound, 6)
        return s, [k for k, v in s["checks"].items() if not v]

    def test_pass(self):
        s, failed = self.judge(steady(ALL_LANES, 0, 120_000))
        self.assertEqual(failed, [])
        self.assertEqual(s["verdict"], "PASS")
        self.assertEqual(s["stalls"]["max_excess_ms"], 20)

    def test_a_stall_no_fault_covers_fails(self):
        lanes = steady(ALL_LANES, 0, 120_000)
        # Partition 3 does nothing from 15 s to 40 s with work waiting; the
        # faults cover 10-15 s and 30-35 s of it: 15 s uncovered, over 12 s.
        lanes[("partition", 3)] = [e for e in lanes[("partition", 3)] if not T0 + 15_000 <= e[1] < T0 + 40_000]
        lanes[("partition", 3)].append((T0 + 15_000, T0 + 40_000))
        s, failed = self.judge(lanes, bound=12_000)
        self.assertEqual(len(failed), 1)
        self.assertTrue(failed[0].startswith("long: no stall"), failed)
        stall = s["stalls"]["stalls"][0]
        self.assertEqual((stall["lane"], stall["idle_ms"], stall["excess_ms"]), ("partition 3", 25_000, 20_000))
        self.assertEqual(stall["faults"], [longrun.FAULTS[1]])
        # The same gap under a bound of 25 s is no stall.
        self.assertEqual(self.judge(lanes, bound=25_000)[1], [])

    def test_a_gap_a_fault_covers_is_no_stall(self):
        lanes = steady(ALL_LANES, 0, 120_000)
        # Shard 0 idle through the whole pg-crash (10-15 s) and 1 s after.
        lanes[("shard", 0)] = [e for e in lanes[("shard", 0)] if not T0 + 10_000 <= e[1] < T0 + 16_000]
        lanes[("shard", 0)].append((T0 + 10_000, T0 + 16_000))
        s, failed = self.judge(lanes, bound=2_000)
        self.assertEqual(failed, [])
        self.assertEqual(s["stalls"]["lanes"]["shard 0"]["max_idle_ms"], 6_000)
        self.assertEqual(s["stalls"]["lanes"]["shard 0"]["max_excess_ms"], 1_000)

    def test_too_few_kills_a_missing_fault_or_lane_fail(self):
        lanes = steady(ALL_LANES, 0, 120_000)
        self.assertIn("long: at least 5000 kill -9 over all instances",
                      self.judge(lanes, summary(orders=16 * 1200, kills=4999))[1])
        c = summary(orders=16 * 1200)
        c["fault_log"] = c["fault_log"][1:]
        self.assertIn(f"long: at least {len(longrun.FAULTS)} kinds of infrastructure fault made", self.judge(lanes, c)[1])
        self.assertEqual(self.judge(lanes, c, mode="quick", min_kills=50)[1], [])
        del lanes[("partition", 5)]
        self.assertIn("long: every shard (16) and partition (6) carried orders", self.judge(lanes)[1])

    def test_an_order_never_applied_fails_and_its_partition_stalled(self):
        lanes = steady(ALL_LANES, 0, 120_000)
        orders = 16 * 1200
        # Partition 2 stops for good at 60 s with its work waiting; the run
        # ends at 150 s (elapsed_s): idle for 90 s, 20 s of it under four faults.
        lanes[("partition", 2)] = [(r, d if r < T0 + 60_000 else None) for r, d in lanes[("partition", 2)]]
        c = summary(orders=orders)
        c["elapsed_s"] = 150.0
        s = longrun.judge(c, (lanes, orders, 0, 600), "full", 5000, 15_000, 6)
        self.assertFalse(s["checks"]["long: the timeline has every order, each published and applied"])
        self.assertEqual(s["stalls"]["lanes"]["partition 2"]["max_idle_ms"], 90_000)
        self.assertEqual([g["lane"] for g in s["stalls"]["stalls"]], ["partition 2"])
        self.assertEqual(s["stalls"]["stalls"][0]["excess_ms"], 70_000)

    def test_read_timeline(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "timeline.csv")
            with open(path, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow([3, "0b0e7d1c-0000-7000-8000-000000000001", 10, 20, 30])
                w.writerow([3, "0b0e7d1c-0000-7000-8000-000000000002", 11, 21, ""])
                w.writerow([4, "0b0e7d1c-0000-7000-8000-000000000003", 12, "", ""])
            lanes, orders, unpublished, unapplied = longrun.read_timeline(path, 6)
        self.assertEqual((orders, unpublished, unapplied), (3, 1, 1))
        self.assertEqual(lanes[("shard", 3)], [(10, 20), (11, 21)])
        self.assertEqual(lanes[("shard", 4)], [(12, None)])
        p = longrun.partition_of("0b0e7d1c-0000-7000-8000-000000000001", 6)
        q = longrun.partition_of("0b0e7d1c-0000-7000-8000-000000000002", 6)
        self.assertIn((20, 30), lanes[("partition", p)])
        self.assertIn((21, None), lanes[("partition", q)])


if __name__ == "__main__":
    unittest.main()


class KillChains(unittest.TestCase):
    def test_kills_closer_than_the_session_chain_into_one_stall(self):
        # 0, 4 s and 8 s chain with a 5 s session: 8 + 5 + 1 (rebalance) = 14 s;
        # 20 s stands alone: 6 s.
        self.assertEqual(longrun.kill_chains([8000, 0, 4000, 20000], 5000), [14000, 6000])

    def test_a_shorter_session_breaks_the_chain(self):
        self.assertEqual(longrun.kill_chains([0, 4000, 8000], 3000), [4000, 4000, 4000])

    def test_no_kills_no_chains(self):
        self.assertEqual(longrun.kill_chains([], 3000), [])

    def test_only_payments_crash_point_deaths_count(self):
        c = {"services": {"payments": {"life_log": [
            {"end": {"kind": "crash_point", "point": "claim"}, "ended_ms": 5},
            {"end": {"kind": "stopped"}, "ended_ms": 9},
            {"end": {"kind": "crash_point", "point": "effect"}, "ended_ms": 7}]}}}
        self.assertEqual(longrun.payments_kills(c), [5, 7])
