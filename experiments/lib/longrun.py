"""Experiment 10's long run, judged: chaos's summary (RES/long.json) and
every order's timeline from the database (RES/timeline.csv: shard, order id,
committed, published, applied, in Unix ms), set side by side.

A stall is a relay shard or a Kafka partition that sat idle with work
waiting for longer than the faults covering that time plus a stated bound.
For each lane (a shard: committed -> published; a partition: published ->
applied) the events are taken in the order they were done; between two
consecutive done times the lane was idle with work waiting from the later of
the previous done time and the oldest ready time of what was still to do.
The part of that gap no infrastructure fault covered ([injected, injected +
outage] of each record in chaos's fault log) is its excess; the run stalled
if an excess passed the bound. Kills are not windows: the bound covers a
killed instance's restart and a killed consumer's session timeout.

Usage: python3 experiments/lib/longrun.py RES MODE MIN_KILLS BOUND_MS PARTITIONS
(long.sh passes them; run it alone to judge results again), or
python3 experiments/lib/longrun.py --chains RES SESSION_MS... for the kill
chains of RES's payments crash-point kills (kill_chains) per session.
"""
import csv
import os
import sys
import zlib

from common import chaos_report, deaths, exit_code, load_json, print_checks, verdict, write_json
from exp10 import SERVICES, correct, instances_used, moved_on_after_each

RUN = "long"
# Every fault long.sh injects (it reads this list), in its order: a quick run
# (180 s) makes the first 7 or 8, so the failover comes early.
FAULTS = ["pg-crash", "pg-failover", "broker-kill", "broker-partition", "payments-scale", "net-lag",
          "broker-pause", "relay-cut", "broker-quorum-loss", "payments-db-cut", "relay-pause",
          "pg-switchover", "pg-standby-loss", "pg-partition"]
# Distinct fault kinds a quick run (180 s) must have made; a full run, all.
QUICK_KINDS = 3
# Gaps listed in summary.json, the longest excesses first.
TOP = 12


def partition_of(key, partitions):
    """The partition librdkafka's default partitioner (consistent_random)
    puts a keyed message in: CRC-32 of the key, modulo the partitions."""
    return zlib.crc32(key.encode()) % partitions


def read_timeline(path, partitions):
    """The timeline CSV at PATH as ({lane: [(ready, done)]}, orders,
    unpublished, unapplied); lanes are ("shard", n) and ("partition", n).
    What was never done has done None (an outbox row never published waits
    in its shard; a message never applied, in its partition)."""
    lanes, orders, unpublished, unapplied = {}, 0, 0, 0
    with open(path, newline="") as f:
        for shard, key, committed, published, applied in csv.reader(f):
            orders += 1
            shard_lane = lanes.setdefault(("shard", int(shard)), [])
            if not published:
                unpublished += 1
                shard_lane.append((int(committed), None))
                continue
            shard_lane.append((int(committed), int(published)))
            if not applied:
                unapplied += 1
            lanes.setdefault(("partition", partition_of(key, partitions)), []).append(
                (int(published), int(applied) if applied else None))
    return lanes, orders, unpublished, unapplied


def idle_gaps(events, end=None):
    """The spans (start, end) over which a lane with EVENTS (ready, done) was
    idle with work waiting: from the later of the previous done time and the
    oldest ready time of what was not done yet, to the next done time. What
    was never done (done None) is done at END, the run's end: a lane that
    stopped for good is idle with its work waiting until then."""
    last = end if end is not None else max((d for _, d in events if d is not None), default=0)
    ev = sorted(((r, last if d is None else d) for r, d in events), key=lambda e: e[1])
    oldest = [0] * len(ev)
    m = float("inf")
    for i in range(len(ev) - 1, -1, -1):
        m = min(m, ev[i][0])
        oldest[i] = m
    gaps, prev = [], None
    for i, (_, done) in enumerate(ev):
        if prev is not None and done == prev:
            continue
        start = oldest[i] if prev is None else max(prev, oldest[i])
        if done > start:
            gaps.append((start, done))
        prev = done
    return gaps


def merge(windows):
    """WINDOWS (start, end) merged into disjoint spans, in order."""
    out = []
    for s, e in sorted(windows):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def covered(span, merged):
    """How much of SPAN (start, end) the disjoint MERGED spans cover."""
    s, e = span
    return sum(max(0, min(e, me) - max(s, ms)) for ms, me in merged if ms < e and me > s)


def fault_windows(c):
    """Each infrastructure fault of chaos summary C as (start, end, fault) in
    Unix ms: from its injection until the component was back (outage_ms)."""
    t0 = c.get("started_at_unix_ms") or 0
    return [(t0 + r["injected_ms"], t0 + r["injected_ms"] + r["outage_ms"], r.get("fault"))
            for r in c.get("fault_log") or [] if r.get("outage_ms") is not None]


def stalls(lanes, windows, bound_ms, end=None):
    """Per lane and over all: the longest idle span, the longest excess (the
    part no fault covered), and the TOP gaps by excess, each with the faults
    it overlapped; and the stalls (excess over BOUND_MS). Work never done
    waits until END (the run's end)."""
    merged = merge([(s, e) for s, e, _ in windows])
    per_lane, top, stalled, idle_all = {}, [], [], []
    for lane in sorted(lanes):
        most_idle = most_excess = 0
        for gap in idle_gaps(lanes[lane], end):
            idle = gap[1] - gap[0]
            excess = idle - covered(gap, merged)
            idle_all.append(idle)
            most_idle, most_excess = max(most_idle, idle), max(most_excess, excess)
            if excess > 1000 or idle > 5000:
                faults = sorted({f for s, e, f in windows if s < gap[1] and e > gap[0]})
                entry = {"lane": f"{lane[0]} {lane[1]}", "start_ms": gap[0], "idle_ms": idle,
                         "excess_ms": excess, "faults": faults}
                top.append(entry)
                if excess > bound_ms:
                    stalled.append(entry)
        per_lane[f"{lane[0]} {lane[1]}"] = {"events": len(lanes[lane]), "max_idle_ms": most_idle,
                                            "max_excess_ms": most_excess}
    top.sort(key=lambda g: -g["excess_ms"])
    idle_all.sort()
    q = (lambda p: idle_all[min(len(idle_all) - 1, int(p * len(idle_all)))] if idle_all else None)
    return {
        "bound_ms": bound_ms,
        "lanes": per_lane,
        "gaps": len(idle_all),
        "idle_ms": {"p50": q(0.5), "p99": q(0.99), "p999": q(0.999), "max": idle_all[-1] if idle_all else None},
        "max_excess_ms": max((v["max_excess_ms"] for v in per_lane.values()), default=None),
        "top": top[:TOP],
        "stalls": stalled,
    }


def kill_chains(kill_ms, session_ms, rebalance_ms=1000):
    """The classic group protocol's stalls as a model: every rebalance
    waits for every member, a member killed -9 until its session (SESSION_MS)
    ends, so kills closer together than the session chain into one stall
    of every partition that was to move, from the first kill to the last
    kill's session end plus a rebalance (REBALANCE_MS). KILL_MS: the kill
    times (ms). The chains' lengths, longest first."""
    chains, first, last = [], None, None
    for t in sorted(kill_ms):
        if first is not None and t < last + session_ms:
            last = t
            continue
        if first is not None:
            chains.append(last + session_ms + rebalance_ms - first)
        first = last = t
    if first is not None:
        chains.append(last + session_ms + rebalance_ms - first)
    return sorted(chains, reverse=True)


def payments_kills(c):
    """The times (ms into the run) of chaos summary C's payments lives that
    ended at a crash point."""
    return [life["ended_ms"] for life in ((c.get("services") or {}).get("payments") or {}).get("life_log") or []
            if (life.get("end") or {}).get("kind") == "crash_point" and life.get("ended_ms") is not None]


def chains_main(res, sessions):
    """Prints the kill-chain model of RES's run for each session in SESSIONS."""
    c = load_json(os.path.join(res, f"{RUN}.json"))
    if c is None:
        print(f"exp-10 long: no chaos summary in {res}")
        return 1
    kills = payments_kills(c)
    print(f"{len(kills)} payments crash-point kills in {res}")
    for session in sessions:
        chains = kill_chains(kills, session)
        over = lambda b: sum(1 for x in chains if x > b)  # noqa: E731
        print(f"session {session} ms: {len(chains)} chains, {over(15000)} over 15 s, {over(20000)} over 20 s, "
              f"longest {chains[0] if chains else 0} ms")
    return 0


def judge(c, timeline, mode, min_kills, bound_ms, partitions):
    """The summary of the long run: chaos summary C, TIMELINE (what
    read_timeline returned)."""
    lanes, orders, unpublished, unapplied = timeline
    checks = dict(correct(c, RUN))
    checks.update(instances_used(c, RUN))
    checks[f"{RUN}: at least {min_kills} kill -9 over all instances"] = (c.get("kills_total") or 0) >= min_kills
    services = c.get("services") or {}
    for service in SERVICES:
        died = sum(((services.get(service) or {}).get("deaths") or {}).values())
        checks[f"{RUN}: {service} killed"] = died > 0
    log = c.get("fault_log") or []
    made = {r.get("fault") for r in log if r.get("error") is None}
    kinds = len(FAULTS) if mode == "full" else QUICK_KINDS
    checks[f"{RUN}: at least {kinds} kinds of infrastructure fault made"] = len(made & set(FAULTS)) >= kinds
    checks[f"{RUN}: every infrastructure fault made (no error)"] = bool(log) and all(
        r.get("error") is None for r in log)
    checks[f"{RUN}: the pipeline moved on after every fault"] = moved_on_after_each(c, FAULTS)
    checks[f"{RUN}: the timeline has every order, each published and applied"] = (
        orders > 0 and orders == chaos_report(c).get("distinct_orders") and unpublished == 0 and unapplied == 0)
    want_lanes = {("shard", n) for n in range(16)} | {("partition", n) for n in range(partitions)}
    checks[f"{RUN}: every shard (16) and partition ({partitions}) carried orders"] = set(lanes) >= want_lanes
    end = (c.get("started_at_unix_ms") or 0) + int(1000 * (c.get("elapsed_s") or 0))
    st = stalls(lanes, fault_windows(c), bound_ms, end)
    checks[f"{RUN}: no stall (no shard or partition idle with work waiting longer than the faults "
           f"covering it plus {bound_ms} ms)"] = not st["stalls"] and st["max_excess_ms"] is not None
    services_digest = {s: {"instances": len((services.get(s) or {}).get("instances") or []),
                           "deaths": (services.get(s) or {}).get("deaths")} for s in SERVICES}
    load = c.get("load") or {}
    return {
        "experiment": "exp-10-scale-out", "run": RUN, "mode": mode,
        "params": c.get("params"), "elapsed_s": c.get("elapsed_s"),
        "orders": orders, "kills_total": c.get("kills_total"), "deaths": deaths(c),
        "services": services_digest, "faults": c.get("faults") or {},
        "latency_ms": (load.get("latency_ms") or {}).get("all"),
        "inbox_hits": (c.get("totals") or {}).get("inbox_hits"),
        "injected_duplicates": c.get("injected_duplicates"),
        "recon_exit": c.get("recon_exit"),
        "stalls": st, "checks": checks, "verdict": verdict(checks),
    }


def main(argv):
    """Judge RES (argv: RES MODE MIN_KILLS BOUND_MS PARTITIONS); the exit status."""
    if argv and argv[0] == "--chains":
        return chains_main(argv[1], [int(a) for a in argv[2:]])
    res, mode, min_kills, bound_ms, partitions = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    c = load_json(os.path.join(res, f"{RUN}.json"))
    path = os.path.join(res, "timeline.csv")
    if c is None or not os.path.exists(path):
        print(f"exp-10 long: FAIL chaos summary or timeline missing in {res} (see its logs/)")
        return 1
    s = judge(c, read_timeline(path, partitions), mode, min_kills, bound_ms, partitions)
    write_json(os.path.join(res, "summary.json"), s)
    print_checks(s["checks"])
    st = s["stalls"]
    print(f"exp-10 long: {s['orders']} orders, {s['kills_total']} kill -9, "
          f"{sum(f['injected'] for f in s['faults'].values())} faults; idle with work waiting: "
          f"p50 {st['idle_ms']['p50']} ms, p99 {st['idle_ms']['p99']} ms, max {st['idle_ms']['max']} ms; "
          f"longest not covered by a fault {st['max_excess_ms']} ms (bound {bound_ms} ms)")
    print(f"exp-10 long: {s['verdict']} ({mode}; {res}/summary.json)")
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
