"""Experiment 8's verdict from chaos's summaries in RES: the checks, a digest
per run (kills, faults, what the client saw) in RES/summary.json, one line
per run; exit 0 on PASS.

Usage: python3 experiments/lib/exp8.py RES MODE MIN_KILLS MIN_PER_FAULT
(run.sh passes them; run it alone to judge results again).
"""
import os
import sys

from common import (chaos_intents, chaos_report, deaths, exit_code, load_json, print_checks,
                    verdict, write_json)

FAULTS = ["pg-crash", "broker-kill", "broker-quorum-loss", "broker-pause", "relay-pause", "offset-reset"]
POINTS = ["commit", "publish", "claim", "effect"]
# The each-fault run (full mode): at least 6 rounds of the six faults (its
# load lasts until chaos has injected 36 and seen each recover).
EACH_FAULT_MIN = 6


def run_checks(c, tag, min_per_fault, min_kills=None, faults=None, points=None):
    """The checks of one chaos run C; MIN_KILLS None: the run had no kills
    (the each-fault run), so no kill checks. FAULTS and POINTS: the fault
    kinds and crash points the run armed (this experiment's by default;
    experiment 11 judges its own with them)."""
    faults = FAULTS if faults is None else faults
    points = POINTS if points is None else points
    r = chaos_report(c)
    intents = chaos_intents(c)
    checks = {
        f"{tag}: recon CLEAN (0 lost, 0 doubled, every check)": c["recon_exit"] == 0,
        f"{tag}: no double charge": r.get("double_charges", -1) == 0,
        f"{tag}: no order without its charge": r.get("orders_without_charge", -1) == 0,
        f"{tag}: every key the client saw succeed has exactly its order, 0 ambiguous": (
            intents.get("client_ambiguous", -1) == 0
            and intents.get("matched") == intents.get("client_succeeded")),
    }
    checks.update(fault_checks(c, tag, min_per_fault, faults))
    if min_kills is not None:
        d = deaths(c)
        checks[f"{tag}: at least {min_kills} kill -9 (crash points and random kills)"] = c["kills_total"] >= min_kills
        for p in points:
            checks[f"{tag}: crash point {p} fired"] = d.get(f"crash_point:{p}", 0) > 0
        checks[f"{tag}: injected duplicates absorbed (inbox hits > 0)"] = c["totals"].get("inbox_hits", 0) > 0
    return checks


def fault_checks(c, tag, min_per_fault, faults):
    """Each of FAULTS injected at least MIN_PER_FAULT times in chaos run C,
    and every one recovered."""
    f = c.get("faults") or {}
    checks = {}
    # Faults come one at a time and each waits for its recovery, so only the
    # run's last fault can have its wait cut short by the end of the load:
    # that one is "unobserved", not unrecovered.
    log = c.get("fault_log") or []
    last = log[-1] if log else None
    for name in faults:
        got = f.get(name) or {}
        unobserved = int(bool(last and last["fault"] == name and last.get("recovery_ms") is None
                              and last.get("error") is None))
        checks[f"{tag}: {name} injected at least {min_per_fault}x, every one recovered"
               + (" (the run's last one unobserved: the load ended first)" if unobserved else "")] = (
            got.get("injected", 0) >= min_per_fault and got.get("failed_to_inject", 1) == 0
            and got.get("recovered", 0) + unobserved == got.get("injected"))
    return checks


def client_view(c):
    """What the client (loadgen) saw in run C."""
    load = c.get("load") or {}
    return {
        "http_status": load.get("http_status"),
        "grpc_codes": load.get("grpc_codes"),
        "timeouts": (load.get("outcomes") or {}).get("timeouts"),
        "error_retries_sent": (load.get("sends") or {}).get("error_retries_sent"),
        "keys": load.get("keys"),
        "latency_ms": (load.get("latency_ms") or {}).get("all"),
    }


def digest(c):
    """Run C's numbers for summary.json."""
    return {
        "params": c["params"],
        "elapsed_s": c["elapsed_s"],
        "kills_total": c["kills_total"],
        "deaths": deaths(c),
        "faults": c.get("faults"),
        "client": client_view(c),
        "injected_duplicates": c.get("injected_duplicates"),
        "inbox_hits": c["totals"].get("inbox_hits"),
        "distinct_orders": chaos_report(c).get("distinct_orders"),
        "recon_exit": c["recon_exit"],
    }


def judge(mixed, each_fault, mode, min_kills, min_per_fault):
    """The summary: the mixed run, and in full mode the each-fault run too."""
    checks, runs = {}, {}
    if mode == "full":
        checks.update(run_checks(each_fault, "each-fault", EACH_FAULT_MIN))
        runs["each_fault"] = digest(each_fault)
    checks.update(run_checks(mixed, "mixed", min_per_fault, min_kills))
    runs["mixed"] = digest(mixed)
    return {"experiment": "exp-8-infra-faults", "mode": mode, "runs": runs, "checks": checks,
            "verdict": verdict(checks)}


def run_line(tag, run, faults=None, experiment="exp-8"):
    """One line per run: kills, each fault's recoveries, what the client saw."""
    parts = []
    for name in FAULTS if faults is None else faults:
        f = (run["faults"] or {}).get(name) or {}
        rec = f.get("recovery_ms") or {}
        parts.append(f"{name} {f.get('recovered', 0)}/{f.get('injected', 0)} recovered, "
                     f"p50 {rec.get('p50')} ms max {rec.get('max')} ms")
    cl = run["client"]
    return (f"{experiment} {tag}: {run['kills_total']} kill -9, " + "; ".join(parts)
            + f"; client saw HTTP {cl['http_status']} gRPC {cl['grpc_codes']}, {cl['timeouts']} timeouts, "
            f"{cl['error_retries_sent']} error retries; {run['distinct_orders']} orders, recon exit {run['recon_exit']}")


def main(argv):
    """Judge RES (argv: RES MODE MIN_KILLS MIN_PER_FAULT); the exit status."""
    res, mode, min_kills, min_per_fault = argv[0], argv[1], int(argv[2]), int(argv[3])
    mixed = load_json(os.path.join(res, "mixed.json"))
    each = load_json(os.path.join(res, "each-fault.json")) if mode == "full" else None
    if mixed is None or (mode == "full" and each is None):
        print(f"exp-8: FAIL a chaos summary is missing in {res} (see its logs/)")
        return 1
    s = judge(mixed, each, mode, min_kills, min_per_fault)
    write_json(os.path.join(res, "summary.json"), s)
    print_checks(s["checks"])
    for tag, run in s["runs"].items():
        print(run_line(tag, run))
    print(f"exp-8: {s['verdict']} ({mode}; {res}/summary.json)")
    return exit_code(s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
