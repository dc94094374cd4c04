#!/usr/bin/env bash
# Experiment 8: infrastructure faults under load — PostgreSQL crashed, the
# broker killed, the relay hung past its session limit, the consumer group's
# offsets reset — mixed with kill -9 at every crash point and duplicate
# delivery. See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-8-infra-faults
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

# pg-crash and broker-kill crash the stack itself: the embedded one through
# scripts/stack.sh; another stack needs CHAOS_STACK_SCRIPT (see README.md).
ALL_FAULTS=pg-crash,broker-kill,relay-pause,offset-reset
ALL_POINTS=commit,publish,claim,effect
if [ "$MODE" = quick ]; then
  RATE=${EXP_RATE:-200} MIXED_DURATION=${EXP_DURATION:-70}
  MIXED=(--fault "$ALL_FAULTS" --fault-count 4 --fault-interval-ms 2000..3000
         --relay-pause-ms 4000 --fault-down-ms 1000
         --crash-point "$ALL_POINTS" --crash-probability 0.007)
  MIN_KILLS=4 MIN_PER_FAULT=1
else
  RATE=${EXP_RATE:-300} MIXED_DURATION=${EXP_DURATION:-1200}
  # Part 1: each fault again and again, nothing else, for clean recovery times.
  exp_chaos each-fault --rate "$RATE" --duration "${EXP_EACH_DURATION:-600}" --retry-rate 0.15 \
    --protocol mixed --seed 8 --fault "$ALL_FAULTS" --fault-count 40 --fault-interval-ms 2000..4000 \
    --relay-pause-ms 8000 --fault-down-ms 2000 \
    --loadgen-arg=--retry-on-error --loadgen-arg=20 --loadgen-arg=--retry-on-error-delay-ms --loadgen-arg=1000 || true
  # Part 2: the long run — every crash point, random kills of every service,
  # every infrastructure fault and duplicates, all at once.
  MIXED=(--fault "$ALL_FAULTS" --fault-interval-ms 15000..30000 --relay-pause-ms 8000 --fault-down-ms 2000
         --crash-point "$ALL_POINTS" --crash-probability 0.01
         --random-kill orders,relay,payments --kill-interval-ms 1500..4000)
  MIN_KILLS=1000 MIN_PER_FAULT=5
fi

exp_chaos mixed --rate "$RATE" --duration "$MIXED_DURATION" --retry-rate 0.15 --protocol mixed --seed 8 \
  --dup-rate 0.05 "${MIXED[@]}" --loadgen-arg=--retry-on-error --loadgen-arg=20 --loadgen-arg=--retry-on-error-delay-ms --loadgen-arg=1000 || true

python3 - "$RES" "$MODE" "$MIN_KILLS" "$MIN_PER_FAULT" <<'PY'
import json, os, sys
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
    for name in faults:
        got = f.get(name) or {}
        checks[f"{tag}: {name} injected at least {min_per_fault}x, every one recovered"] = (
            got.get("injected", 0) >= min_per_fault and got.get("failed_to_inject", 1) == 0
            and got.get("recovered") == got.get("injected"))
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
PY
