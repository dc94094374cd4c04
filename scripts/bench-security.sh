#!/usr/bin/env bash
# make bench-security: what TLS and SASL cost, measured side by side in one
# run. The same benchmark (scripts/bench-pipeline.sh: the relay's drain and
# a raw producer, payments' passes and a raw consumer, one steady point of
# the whole pipeline with its CPU per order by process) runs on the stack
# secured (STACK_SECURITY=tls: PostgreSQL over TLS with SCRAM, Kafka
# SASL_SSL with SCRAM-SHA-512 and ACLs) and on the same stack in plaintext
# (PostgreSQL's passwords over TCP without TLS, Kafka PLAINTEXT without an
# authorizer), the modes alternating round by round (tls then plaintext,
# plaintext then tls, ...). Each mode switch formats the Kafka cluster again
# (its SCRAM credentials live in its metadata log) and so restarts its JVMs:
# the second run of a round starts on brokers whose JIT compiler has not
# warmed up, the first of the next on brokers the run before warmed. With
# an even number of rounds each mode gets as many runs of each kind; the
# table gives every run, in order, next to the medians, and the warmth
# matters more than the mode for the brokers' throughput (FINDINGS §27):
# compare the runs pair by pair.
#
# Results: bench/results/security-RUN.json (each run's summary and, per
# mode, the median of its rounds) and the table printed at the end
# (tls / plaintext ratios). The stack is left in the mode it was in.
#
# Settings (env): BENCH_SECURITY_ROUNDS (2), BENCH_ROWS (200000),
# BENCH_STEADY_RATES (1000), BENCH_STEADY_SECONDS (30),
# BENCH_WARMUP_SECONDS (60); the rest of scripts/bench-pipeline.sh's pass
# through.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ROUNDS=${BENCH_SECURITY_ROUNDS:-2}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "bench-security: BENCH_SECURITY_ROUNDS must be a whole number, at least 1" >&2; exit 2; }
export BENCH_ROWS=${BENCH_ROWS:-200000}
export BENCH_STEADY_RATES=${BENCH_STEADY_RATES:-1000}
export BENCH_STEADY_SECONDS=${BENCH_STEADY_SECONDS:-30}
export BENCH_WARMUP_SECONDS=${BENCH_WARMUP_SECONDS:-60}
RUN=$(date +%Y%m%d-%H%M%S)
OUT=$ROOT/bench/results
mkdir -p "$OUT"
RUNS=$(mktemp)
log() { printf 'bench-security: %s\n' "$*" >&2; }
was=$(cat "$ROOT/.stack/security" 2>/dev/null || echo tls)
restore() { rm -f "$RUNS"; STACK_SECURITY=$was scripts/stack.sh up >/dev/null 2>&1 || log "could not put the stack back in $was mode"; }
trap restore EXIT

for round in $(seq 1 "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then modes="tls plaintext"; else modes="plaintext tls"; fi
  for mode in $modes; do
    log "round $round of $ROUNDS: $mode"
    before=$(ls "$OUT"/pipeline-*.json 2>/dev/null | sort | tail -1 || true)
    STACK_SECURITY=$mode scripts/bench-pipeline.sh >&2
    after=$(ls "$OUT"/pipeline-*.json | sort | tail -1)
    [ "$after" != "$before" ] || { log "bench-pipeline wrote no result"; exit 1; }
    printf '%s %s %s\n' "$round" "$mode" "$after" >>"$RUNS"
  done
done

python3 - "$RUNS" "$OUT/security-$RUN.json" <<'PY'
import json, statistics, sys

runs_file, out = sys.argv[1], sys.argv[2]
runs = []
for line in open(runs_file):
    rnd, mode, path = line.split()
    runs.append({"round": int(rnd), "mode": mode, "file": path.rsplit("/", 1)[-1], "result": json.load(open(path))})

def steady(r, *keys):
    v = r["steady"][0]
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    return v

# name, how to read it from one run's summary, whether higher is better
metrics = [
    ("relay drain, rows/s", lambda r: r.get("relay_rows_per_sec")),
    ("raw producer, msgs/s", lambda r: r.get("raw_producer_msgs_per_sec")),
    ("raw producer, CPU-us/msg", lambda r: (r.get("raw_producer") or {}).get("cpu_us_per_msg")),
    ("payments new pass, msgs/s", lambda r: r.get("consumer_new_msgs_per_sec")),
    ("raw consumer, msgs/s", lambda r: r.get("raw_consumer_msgs_per_sec")),
    ("steady commit->effect p50, ms", lambda r: steady(r, "p50_ms")),
    ("steady commit->effect p99, ms", lambda r: steady(r, "p99_ms")),
    ("steady CPU-us/order, kafka", lambda r: steady(r, "cpu_us_per_order", "processes", "kafka")),
    ("steady CPU-us/order, postgres", lambda r: steady(r, "cpu_us_per_order", "processes", "postgres")),
    ("steady CPU-us/order, orders", lambda r: steady(r, "cpu_us_per_order", "processes", "orders")),
    ("steady CPU-us/order, relay", lambda r: steady(r, "cpu_us_per_order", "processes", "relay")),
    ("steady CPU-us/order, payments", lambda r: steady(r, "cpu_us_per_order", "processes", "payments")),
    ("steady recon CLEAN", lambda r: steady(r, "recon_clean")),
]
table = []
for name, read in metrics:
    row = {"metric": name}
    for mode in ("tls", "plaintext"):
        values = [read(r["result"]) for r in runs if r["mode"] == mode]
        row[mode + "_runs"] = values
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        row[mode] = statistics.median(numbers) if numbers else (all(values) if values else None)
    if isinstance(row["tls"], (int, float)) and not isinstance(row["tls"], bool) and row["plaintext"]:
        row["tls_vs_plaintext"] = round(row["tls"] / row["plaintext"], 2)
    table.append(row)
json.dump({"command": "make bench-security", "runs": [{k: v for k, v in r.items() if k != "result"} for r in runs],
           "table": table}, open(out, "w"), indent=1)
def fmt(v):
    if isinstance(v, bool):
        return "CLEAN" if v else "DRIFT"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)

print(f"{'metric':34} {'tls':>10} {'plaintext':>10} {'tls/plain':>9}   runs (tls | plaintext, in run order)")
for row in table:
    runs = " ".join(fmt(v) for v in row["tls_runs"]) + " | " + " ".join(fmt(v) for v in row["plaintext_runs"])
    print(f"{row['metric']:34} {fmt(row['tls']):>10} {fmt(row['plaintext']):>10} {row.get('tls_vs_plaintext', ''):>9}   {runs}")
print(f"results: {out}")
PY
