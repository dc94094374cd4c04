"""Experiment 10's verdict from chaos's summaries in RES: every service as
several instances, the payments group scaled up and down under load, kill -9
of any instance, faults on the network; the checks, a digest per run in
RES/summary.json, one line per run; exit 0 on PASS.

Usage: python3 experiments/lib/exp10.py RES MODE MIN_KILLS MIN_STEPS [NET_FAULTS [PARTS]]
(run.sh passes them; run it alone to judge results again). NET_FAULTS 0, or
none given, judges no network run. PARTS (comma list of scale, instances,
matrix, network; default all) judges only those runs (EXP10_PARTS in run.sh).
"""
import os
import re
import sys

from common import (chaos_intents, chaos_report, exit_code, load_json, print_checks, verdict,
                    write_json)

# The runs run.sh makes, in order: the scale runs (dynamic, and in full mode
# static group membership) and the run with every service killed.
SCALE_RUNS = {"quick": ["scale-dynamic"], "full": ["scale-dynamic", "scale-static"]}
KILL_RUN = "instances"
NETWORK_RUN = "network"
# The side-by-side runs without faults, relays x payments (run.sh's MATRIX):
# each has its commit->effect in RES/matrix-RxP-latency.json.
MATRIX = {"quick": ["1x1", "2x3"], "full": ["1x1", "1x2", "1x3", "1x6", "2x6", "3x6", "3x1"]}
NETWORK_FAULTS = ["broker-partition", "net-lag", "relay-cut", "payments-db-cut"]
SERVICES = ["orders", "relay", "payments"]


def correct(c, tag):
    """The checks every run must pass: nothing lost, nothing doubled, every
    client success backed, no replay mismatch."""
    r = chaos_report(c)
    intents = chaos_intents(c)
    load = c.get("load") or {}
    return {
        f"{tag}: recon CLEAN (0 lost, 0 doubled, every check)": c["recon_exit"] == 0,
        f"{tag}: no double charge": r.get("double_charges", -1) == 0,
        f"{tag}: no order without its charge": r.get("orders_without_charge", -1) == 0,
        f"{tag}: every key the client saw succeed has exactly its order": (
            intents.get("matched") is not None and intents.get("matched") == intents.get("client_succeeded")),
        f"{tag}: 0 replay mismatches across the orders instances": (
            (load.get("replay") or {}).get("mismatches", -1) == 0),
    }


def instances_used(c, tag):
    """Each service ran as its instances, and loadgen sent to every orders
    instance."""
    checks = {}
    params = c.get("params") or {}
    for service, key in (("orders", "orders"), ("relay", "relays"), ("payments", "payments")):
        want = params.get(key, 1)
        got = len(((c.get("services") or {}).get(service) or {}).get("instances") or [])
        checks[f"{tag}: {service} ran as {want} instances"] = got == want
    targets = (c.get("load") or {}).get("targets") or []
    checks[f"{tag}: loadgen sent to every orders instance"] = (
        len({t.get("url") for t in targets if t.get("sent", 0) > 0}) >= params.get("orders", 1))
    return checks


def scale_steps(c):
    """Each payments-scale step: (note, outage ms, recovery ms, inbox hits)."""
    return [(r.get("note"), r.get("outage_ms"), r.get("recovery_ms"), r.get("inbox_hits"))
            for r in c.get("fault_log") or [] if r.get("fault") == "payments-scale"]


def moved_on_after_each(c, kinds):
    """Whether the pipeline moved on after every fault of KINDS in run C: each
    has its recovery, except that the run's last fault, made without error,
    may have had its recovery cut short by the end of the load."""
    records = c.get("fault_log") or []
    last = records[-1] if records else None
    return all(r.get("recovery_ms") is not None or (r is last and r.get("error") is None)
               for r in records if r.get("fault") in kinds)


def scale_checks(c, tag, min_steps):
    """The payments group was scaled MIN_STEPS times, every step settled
    (the running members owned every partition again) and the pipeline moved
    on after it; the run's last step may have its recovery cut short by the
    end of the load."""
    log = [r for r in c.get("fault_log") or [] if r.get("fault") == "payments-scale"]
    return {
        f"{tag}: the payments group scaled at least {min_steps}x, down and up": (
            len(log) >= min_steps and any("-> 1" in (r.get("note") or "") for r in log)),
        f"{tag}: every step settled (every partition owned again), none failed": (
            all(r.get("error") is None and r.get("outage_ms") is not None for r in log)),
        f"{tag}: the pipeline moved on after every step": moved_on_after_each(c, ["payments-scale"]),
    }


def network_log(c):
    """The network faults of run C: (fault, note, outage ms, recovery ms,
    inbox hits, error)."""
    return [(r.get("fault"), r.get("note"), r.get("outage_ms"), r.get("recovery_ms"),
             r.get("inbox_hits"), r.get("error"))
            for r in c.get("fault_log") or [] if r.get("fault") in NETWORK_FAULTS]


def network_checks(c, tag, min_faults):
    """At least MIN_FAULTS network faults, every kind among them, none that
    could not be made; the pipeline moved on after each (the run's last may
    have its recovery cut short by the end of the load); the delay line held
    packets back and dropped some."""
    log = network_log(c)
    dropped = [int(m.group(1)) for f, note, *_ in log if f == "net-lag"
               for m in [re.search(r"(\d+) dropped", note or "")] if m]
    return {
        f"{tag}: at least {min_faults} network faults, each kind": (
            len(log) >= min_faults and {f for f, *_ in log} >= set(NETWORK_FAULTS)),
        f"{tag}: every network fault was made (no error)": all(e is None for *_, e in log),
        f"{tag}: the pipeline moved on after every network fault": moved_on_after_each(c, NETWORK_FAULTS),
        f"{tag}: the delay line dropped packets in every net-lag": (
            bool(dropped) and all(d > 0 for d in dropped)),
    }


def kill_checks(c, tag, min_kills):
    """Every service's instances were killed, MIN_KILLS in all."""
    checks = {f"{tag}: at least {min_kills} kill -9 over all instances": c.get("kills_total", 0) >= min_kills}
    for service in SERVICES:
        s = (c.get("services") or {}).get(service) or {}
        killed = sum(1 for i in s.get("instances") or [] if sum((i.get("deaths") or {}).values()) > 0)
        checks[f"{tag}: {service}: more than one instance killed"] = killed >= 2
    return checks


def digest(c):
    """Run C's numbers for summary.json."""
    load = c.get("load") or {}
    services = c.get("services") or {}
    return {
        "params": c.get("params"),
        "elapsed_s": c.get("elapsed_s"),
        "kills_total": c.get("kills_total"),
        "deaths": {s: (services.get(s) or {}).get("deaths") for s in SERVICES},
        "instances": {s: [(i.get("label"), i.get("lives")) for i in (services.get(s) or {}).get("instances") or []]
                      for s in SERVICES},
        "scale_steps": scale_steps(c),
        "network_faults": network_log(c),
        "targets": load.get("targets"),
        "latency_ms": (load.get("latency_ms") or {}).get("all"),
        "inbox_hits": (c.get("totals") or {}).get("inbox_hits"),
        "distinct_orders": chaos_report(c).get("distinct_orders"),
        "recon_exit": c.get("recon_exit"),
    }


def matrix_tags(mode):
    """The matrix runs' tags in MODE."""
    return [f"matrix-{rp}" for rp in MATRIX[mode]]


def matrix_checks(c, tag):
    """A matrix run: its commit->effect was measured and every order it
    wrote was applied."""
    lat = c.get("commit_to_effect") or {}
    return {f"{tag}: commit->effect measured, every order applied": (
        bool(lat.get("orders")) and lat.get("applied") == lat.get("orders"))}


def matrix_row(c):
    """A matrix run's line of the table: instances, what was applied, how
    fast, commit->effect, the client's p99."""
    params, lat = c.get("params") or {}, c.get("commit_to_effect") or {}
    client = ((c.get("load") or {}).get("latency_ms") or {}).get("all") or {}
    return {"relays": params.get("relays"), "payments": params.get("payments"), "rate": params.get("rate"),
            "orders": lat.get("orders"), "applied_per_s": lat.get("applied_per_s"),
            "commit_to_effect_p50_ms": lat.get("p50_ms"), "commit_to_effect_p99_ms": lat.get("p99_ms"),
            "commit_to_effect_max_ms": lat.get("max_ms"), "publish_p50_ms": lat.get("publish_p50_ms"),
            "publish_p99_ms": lat.get("publish_p99_ms"), "client_p99_ms": client.get("p99_ms")}


PARTS = ("scale", "instances", "matrix", "network")


def tags(mode, net_faults, parts=PARTS):
    """The runs PARTS of MODE make (the network run only with NET_FAULTS)."""
    return ((SCALE_RUNS[mode] if "scale" in parts else []) + ([KILL_RUN] if "instances" in parts else [])
            + (matrix_tags(mode) if "matrix" in parts else [])
            + ([NETWORK_RUN] if net_faults and "network" in parts else []))


def judge(runs, mode, min_kills, min_steps, net_faults=0, parts=PARTS):
    """The summary of the RUNS (tag -> chaos summary) of MODE's PARTS; with
    NET_FAULTS, the network run's too."""
    checks, digests = {}, {}
    for tag in SCALE_RUNS[mode] if "scale" in parts else []:
        c = runs[tag]
        checks.update(correct(c, tag))
        checks.update(instances_used(c, tag))
        checks.update(scale_checks(c, tag, min_steps))
        digests[tag] = digest(c)
    if "instances" in parts:
        c = runs[KILL_RUN]
        checks.update(correct(c, KILL_RUN))
        checks.update(instances_used(c, KILL_RUN))
        checks.update(kill_checks(c, KILL_RUN, min_kills))
        digests[KILL_RUN] = digest(c)
    matrix = []
    for tag in matrix_tags(mode) if "matrix" in parts else []:
        c = runs[tag]
        checks.update(correct(c, tag))
        checks.update(instances_used(c, tag))
        checks.update(matrix_checks(c, tag))
        matrix.append(matrix_row(c))
    if net_faults and "network" in parts:
        c = runs[NETWORK_RUN]
        checks.update(correct(c, NETWORK_RUN))
        checks.update(instances_used(c, NETWORK_RUN))
        checks.update(network_checks(c, NETWORK_RUN, net_faults))
        digests[NETWORK_RUN] = digest(c)
    return {"experiment": "exp-10-scale-out", "mode": mode, "runs": digests, "matrix": matrix,
            "checks": checks, "verdict": verdict(checks)}


def matrix_line(row):
    """One line per matrix run."""
    return (f"exp-10 matrix: {row['relays']} relays, {row['payments']} payments at {row['rate']}/s: "
            f"{row['orders']} orders, {row['applied_per_s']} applied/s, commit->effect p50 "
            f"{row['commit_to_effect_p50_ms']} ms p99 {row['commit_to_effect_p99_ms']} ms, "
            f"client p99 {row['client_p99_ms']} ms")


def run_line(tag, run):
    """One line per run: instances, kills, scale steps, orders, recon."""
    inst = ", ".join(f"{s} x{len(run['instances'][s])}" for s in SERVICES)
    steps = "; ".join(f"{n}: settled in {o} ms, moving in {r} ms, {h} inbox hits"
                      for n, o, r, h in run["scale_steps"])
    net = "; ".join(f"{f}" + (f" ({n})" if n else "") + f": {o} ms"
                    + (f", moving {r - o} ms after it ended" if r is not None and o is not None else "")
                    + f", {h} inbox hits" + (f", ERROR {e}" if e else "")
                    for f, n, o, r, h, e in run.get("network_faults") or [])
    return (f"exp-10 {tag}: {inst}; {run['kills_total']} kill -9"
            + (f"; {steps}" if steps else "")
            + (f"; {net}" if net else "")
            + f"; {run['distinct_orders']} orders, recon exit {run['recon_exit']}")


def main(argv):
    """Judge RES (argv: RES MODE MIN_KILLS MIN_STEPS [NET_FAULTS]); the exit status."""
    res, mode, min_kills, min_steps = argv[0], argv[1], int(argv[2]), int(argv[3])
    net_faults = int(argv[4]) if len(argv) > 4 else 0
    parts = tuple(argv[5].split(",")) if len(argv) > 5 and argv[5] else PARTS
    unknown = set(parts) - set(PARTS)
    if unknown:
        print(f"exp-10: unknown parts {sorted(unknown)}: choose among {', '.join(PARTS)}")
        return 2
    if not tags(mode, net_faults, parts):
        print(f"exp-10: FAIL nothing to judge (parts {','.join(parts)}, {net_faults} network faults)")
        return 1
    runs = {tag: load_json(os.path.join(res, f"{tag}.json")) for tag in tags(mode, net_faults, parts)}
    for tag, c in runs.items():
        if c is not None and tag.startswith("matrix-"):
            c["commit_to_effect"] = load_json(os.path.join(res, f"{tag}-latency.json"))
    missing = [tag for tag, c in runs.items() if c is None]
    if missing:
        print(f"exp-10: FAIL chaos summaries missing in {res}: {missing} (see its logs/)")
        return 1
    s = judge(runs, mode, min_kills, min_steps, net_faults, parts)
    write_json(os.path.join(res, "summary.json"), s)
    print_checks(s["checks"])
    for tag, run in s["runs"].items():
        print(run_line(tag, run))
    for row in s["matrix"]:
        print(matrix_line(row))
    print(f"exp-10: {s['verdict']} ({mode}; {res}/summary.json)")
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
