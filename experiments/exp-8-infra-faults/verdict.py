"""Experiment 8's verdict from chaos's summaries in RES: the checks, a digest
per run (kills, faults, what the client saw) in RES/summary.json, one line
per run; exit 0 on PASS.

Usage: verdict.py RES MODE MIN_KILLS MIN_PER_FAULT (run.sh passes them; run
it alone to judge results again).
"""
import json, sys
res, mode, min_kills, min_per_fault = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
faults = ["pg-crash", "broker-kill", "relay-pause", "offset-reset"]
points = ["commit", "publish", "claim", "effect"]

def run_checks(c, tag, min_per_fault, need_kills):
    r = (c.get("recon") or {}).get("report") or {}
    intents = (c.get("recon") or {}).get("intents") or {}
    load = c.get("load") or {}
    f = c.get("faults") or {}
    checks = {
        f"{tag}: recon CLEAN (0 lost, 0 doubled, every check)": c["recon_exit"] == 0,
        f"{tag}: no double charge": r.get("double_charges", -1) == 0,
        f"{tag}: no order without its charge": r.get("orders_without_charge", -1) == 0,
        f"{tag}: every key the client saw succeed has exactly its order, 0 ambiguous": (
            intents.get("client_ambiguous", -1) == 0
            and intents.get("matched") == intents.get("client_succeeded")),
    }
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
    if need_kills:
        deaths = {}
        for s in c["services"].values():
            for k, v in s["deaths"].items():
                deaths[k] = deaths.get(k, 0) + v
        checks[f"{tag}: at least {min_kills} kill -9 (crash points and random kills)"] = c["kills_total"] >= min_kills
        for p in points:
            checks[f"{tag}: crash point {p} fired"] = deaths.get(f"crash_point:{p}", 0) > 0
        checks[f"{tag}: injected duplicates absorbed (inbox hits > 0)"] = c["totals"].get("inbox_hits", 0) > 0
    return checks

def client_view(c):
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
    deaths = {}
    for s in c["services"].values():
        for k, v in s["deaths"].items():
            deaths[k] = deaths.get(k, 0) + v
    return {
        "params": c["params"],
        "elapsed_s": c["elapsed_s"],
        "kills_total": c["kills_total"],
        "deaths": deaths,
        "faults": c.get("faults"),
        "client": client_view(c),
        "injected_duplicates": c.get("injected_duplicates"),
        "inbox_hits": c["totals"].get("inbox_hits"),
        "distinct_orders": ((c.get("recon") or {}).get("report") or {}).get("distinct_orders"),
        "recon_exit": c["recon_exit"],
    }

checks, runs = {}, {}
if mode == "full":
    e = json.load(open(f"{res}/each-fault.json"))
    checks.update(run_checks(e, "each-fault", 8, False))
    runs["each_fault"] = digest(e)
m = json.load(open(f"{res}/mixed.json"))
checks.update(run_checks(m, "mixed", min_per_fault, True))
runs["mixed"] = digest(m)
summary = {
    "experiment": "exp-8-infra-faults",
    "mode": mode,
    "runs": runs,
    "checks": checks,
    "verdict": "PASS" if all(checks.values()) else "FAIL",
}
json.dump(summary, open(f"{res}/summary.json", "w"), indent=2)
for k, v in checks.items():
    print(f"  [{'ok' if v else 'FAILED'}] {k}")
for tag, run in runs.items():
    parts = []
    for name in faults:
        f = (run["faults"] or {}).get(name) or {}
        rec = f.get("recovery_ms") or {}
        parts.append(f"{name} {f.get('recovered', 0)}/{f.get('injected', 0)} recovered, p50 {rec.get('p50')} ms max {rec.get('max')} ms")
    cl = run["client"]
    print(f"exp-8 {tag}: {run['kills_total']} kill -9, " + "; ".join(parts)
          + f"; client saw HTTP {cl['http_status']} gRPC {cl['grpc_codes']}, {cl['timeouts']} timeouts, "
          f"{cl['error_retries_sent']} error retries; {run['distinct_orders']} orders, recon exit {run['recon_exit']}")
print(f"exp-8: {summary['verdict']} ({mode}; {res}/summary.json)")
sys.exit(0 if summary["verdict"] == "PASS" else 1)
