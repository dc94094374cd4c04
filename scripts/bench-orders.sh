#!/usr/bin/env bash
# make bench-orders: POST /orders alone (no broker), swept upwards until it
# finds the knee, for unique keys and with 15% same-key retries; then two
# ceilings of the same transaction by pgbench on the same PostgreSQL, in the
# same run: one transaction per request (bench/new-order.pgbench.sql) and
# the service's coalesced transaction of 64 requests
# (bench/new-order-batch64.pgbench.sql).
#
# A point passes when ≥ 95% of the offered sends were achieved, p99 < 25 ms,
# no errors and none dropped. Each mode starts at BENCH_START intents/s and
# steps by BENCH_STEP until a point fails twice in a row (a single 15 s point
# on a shared machine can fail on one slow commit), then bisects between the
# last pass and that failure BENCH_REFINE times. The knee is the highest
# passing rate, in sends/s. Each point also records the CPU each process
# group used (orders, loadgen, postgres; cores, from /proc) and what the
# service's database sessions wait on (pg_stat_activity, 5 times a second).
#
# Prints a table and, last, `ratio: N.NN` (the unique knee over the
# one-transaction-per-request TPS) and `batched ratio: 0.NN` (over the
# batched ceiling's orders/s).
#
# Settings (env): BENCH_START (2000), BENCH_STEP (2000), BENCH_MAX (40000),
# BENCH_REFINE (2), BENCH_SECONDS (15 per point), BENCH_PGBENCH_CLIENTS (16),
# BENCH_BATCH_CLIENTS (4); BENCH_RATES ("4000 8000 ...") runs those points
# instead of a sweep; BENCH_PERF=RATE also records `perf record` system-wide
# at that rate (both modes; the per-process and per-symbol tables land in
# the results as perf-RATE-MODE.txt); BENCH_ORDERS_BIN runs another orders
# binary (an A/B of two builds on the same database and ceilings).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
START=${BENCH_START:-2000}
STEP=${BENCH_STEP:-2000}
MAX=${BENCH_MAX:-40000}
REFINE=${BENCH_REFINE:-2}
SECS=${BENCH_SECONDS:-15}
CLIENTS=${BENCH_PGBENCH_CLIENTS:-16}
BATCH_CLIENTS=${BENCH_BATCH_CLIENTS:-4}
PERF_AT=${BENCH_PERF:-}
RUN=$(date +%Y%m%d-%H%M%S)
OUT=$ROOT/bench/results/orders-$RUN
mkdir -p "$OUT"
BIN=$ROOT/target/release
log() { printf 'bench: %s\n' "$*" >&2; }

STACK_KAFKA=0 scripts/stack.sh up >/dev/null
. .stack/env
log "building (release)"
cargo build -q --release -p orders -p loadgen
# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"
pipeline_db bench_orders # no broker needed: orders alone
URL=$DB_URL

DATABASE_URL=$ORDERS_DATABASE_URL RUST_LOG=warn ORDERS_HTTP_ADDR=127.0.0.1:18280 ORDERS_GRPC_ADDR=127.0.0.1:15251 \
  "${BENCH_ORDERS_BIN:-$BIN/orders}" >"$OUT/orders.log" 2>&1 &
ORDERS=$!
trap 'kill $ORDERS 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do curl -fs http://127.0.0.1:18280/metrics >/dev/null 2>&1 && break; sleep 0.1; done

# The orders role's sessions that are not idle, by what they wait on (CPU:running when on the CPU;
# Client:ClientRead while a transaction waits for the service's next statement).
WAITS_SQL="SELECT COALESCE(wait_event_type, 'CPU') || ':' || COALESCE(wait_event, 'running'), count(*) \
FROM pg_stat_activity WHERE usename = 'effectively_orders' AND state <> 'idle' GROUP BY 1;"
CPU_PY='import json, sys; sys.path.insert(0, "experiments/lib"); import sampler; print(json.dumps(sampler.cpu_ticks()))'

# point RATE MODE: one loadgen run; exit status 0 when it passed.
point() {
  local rate=$1 mode=$2 retry=0 tag perf_pid=""
  [ "$mode" = retry15 ] && retry=0.15
  tag=$rate-$mode
  [ -f "$OUT/$tag.json" ] && tag=$rate-$mode-again
  log "POST /orders: $rate intents/s, $mode, $SECS s"
  # CPU snapshots inside the load (loadgen's ticks vanish with it): 2 s in, 1 s before the end.
  (sleep 2; python3 -c "$CPU_PY" >"$OUT/$tag.cpu0"; sleep $((SECS - 3)); python3 -c "$CPU_PY" >"$OUT/$tag.cpu1") &
  local cpu_pid=$!
  # What the service's backends wait on, five times a second, from one psql.
  printf '%s\n\\watch 0.2\n' "$WAITS_SQL" | psql "$URL" -qAt -F '|' >"$OUT/$tag.waits" 2>/dev/null &
  local waits_pid=$!
  if [ -n "$PERF_AT" ] && [ "$rate" = "$PERF_AT" ] && command -v perf >/dev/null; then
    (sleep 3; exec perf record -q -F 499 -a -o "$OUT/perf-$tag.data" -- sleep $((SECS - 5))) \
      >/dev/null 2>&1 &
    perf_pid=$!
  fi
  "$BIN/loadgen" --http-url http://127.0.0.1:18280 --grpc-url http://127.0.0.1:15251 --progress off \
    --rate "$rate" --duration "$SECS" --zipf-s 0 --retry-rate "$retry" --seed "$rate" \
    --json "$OUT/$tag.json" >/dev/null || log "loadgen exited $? at $rate $mode"
  wait "$cpu_pid" || true
  kill "$waits_pid" 2>/dev/null || true
  if [ -n "$perf_pid" ]; then
    wait "$perf_pid" || true
    # Per thread name (orders' threads are tokio-rt-worker), per binary or
    # library within it (the kernel's share is [kernel.kallsyms]), then the
    # symbols over 0.3%.
    { for sort in comm comm,dso comm,dso,symbol; do
        perf report -i "$OUT/perf-$tag.data" --no-children --sort "$sort" --percent-limit 0.3 --stdio 2>/dev/null \
          | grep -v '^#' | grep -v '^$' | sed 's/  */ /g' | cut -c1-160
        echo
      done; } >"$OUT/perf-$tag.txt"
    rm -f "$OUT/perf-$tag.data"
  fi
  sleep 2
  python3 - "$OUT/$tag.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
o = r["outcomes"]
errors = o["server_errors"] + o["client_errors"] + o["connect_errors"] + o["other_status"] + r.get("unfinished", 0)
ok = (r["rates"]["achieved"] >= 0.95 * r["rates"]["offered_sends"] and r["latency_ms"]["all"]["p99_ms"] < 25
      and errors == 0 and r["sends"]["dropped"] == 0)
sys.exit(0 if ok else 1)
PY
}

# sweep MODE: up by STEP until two failures in a row, then bisect.
sweep() {
  local mode=$1 rate=$START pass=0 fail=0 mid
  while [ "$rate" -le "$MAX" ]; do
    if point "$rate" "$mode" || point "$rate" "$mode"; then
      pass=$rate
      rate=$((rate + STEP))
    else
      fail=$rate
      break
    fi
  done
  [ "$fail" -gt 0 ] || return 0
  for _ in $(seq 1 "$REFINE"); do
    mid=$(((pass + fail) / 2 / 250 * 250))
    { [ "$mid" -le "$pass" ] || [ "$mid" -ge "$fail" ]; } && break
    if point "$mid" "$mode" || point "$mid" "$mode"; then pass=$mid; else fail=$mid; fi
  done
}

if [ -n "${BENCH_RATES:-}" ]; then
  for rate in $BENCH_RATES; do
    point "$rate" unique || true
    point "$rate" retry15 || true
  done
else
  sweep unique
  sweep retry15
fi
kill $ORDERS; wait $ORDERS 2>/dev/null || true

psql "$URL" -qAt -c "VACUUM ANALYZE" >/dev/null
log "pgbench ceiling, one transaction per request: $CLIENTS clients, $SECS s"
pgbench -n -M prepared -f bench/new-order.pgbench.sql -c "$CLIENTS" -j 2 -T "$SECS" "$URL" >"$OUT/pgbench.txt" 2>&1
log "pgbench ceiling, 64 requests per transaction: $BATCH_CLIENTS clients, $SECS s"
pgbench -n -M prepared -f bench/new-order-batch64.pgbench.sql -c "$BATCH_CLIENTS" -j 2 -T "$SECS" "$URL" \
  >"$OUT/pgbench-batch64.txt" 2>&1
grep -h "tps =" "$OUT/pgbench.txt" "$OUT/pgbench-batch64.txt" >&2 || true

python3 - "$OUT" <<'PY'
import glob, json, os, re, sys
out = sys.argv[1]
def tps(name):
    return float(re.search(r"tps = ([0-9.]+)", open(os.path.join(out, name)).read()).group(1))
single, batched = tps("pgbench.txt"), tps("pgbench-batch64.txt") * 64
def cores(tag):
    try:
        (g0, m0), (g1, m1) = (json.load(open(os.path.join(out, f"{tag}.cpu{i}"))) for i in (0, 1))
    except (OSError, ValueError):
        return {}
    # Ticks of 1/100 s (USER_HZ) over the point's wall time.
    wall = (m1["total"] - m0["total"]) / (os.cpu_count() or 1)
    if wall <= 0:
        return {}
    c = {k: round((g1[k] - g0[k]) / wall, 2) for k in ("orders", "loadgen", "postgres")}
    c["machine_busy"] = round((m1["busy"] - m0["busy"]) / (m1["total"] - m0["total"]), 2)
    return c
def waits(tag):
    """The share of the orders backends' non-idle samples per wait event."""
    counts = {}
    try:
        for line in open(os.path.join(out, f"{tag}.waits")):
            parts = line.strip().split("|")
            if len(parts) == 2 and parts[1].isdigit():
                counts[parts[0]] = counts.get(parts[0], 0) + int(parts[1])
    except OSError:
        return {}
    total = sum(counts.values())
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:6]
    return {k: round(v / total, 3) for k, v in top} if total else {}
rows = []
for path in glob.glob(os.path.join(out, "*-*.json")):
    tag = os.path.basename(path)[:-5]
    if tag == "summary":
        continue
    r = json.load(open(path))
    o = r["outcomes"]
    errors = o["server_errors"] + o["client_errors"] + o["connect_errors"] + o["other_status"] + r.get("unfinished", 0)
    row = {
        "intents": round(r["rates"]["offered"]), "mode": tag.split("-")[1], "again": tag.endswith("-again"),
        "offered_sends": round(r["rates"]["offered_sends"]), "achieved": round(r["rates"]["achieved"]),
        "p50_ms": r["latency_ms"]["all"]["p50_ms"], "p99_ms": r["latency_ms"]["all"]["p99_ms"],
        "errors": errors, "dropped": r["sends"]["dropped"], "replay_mismatches": r["replay"]["mismatches"],
        "cores": cores(tag), "waits": waits(tag),
    }
    row["passed"] = (row["achieved"] >= 0.95 * row["offered_sends"] and row["p99_ms"] < 25 and errors == 0
                     and row["dropped"] == 0)
    rows.append(row)
rows.sort(key=lambda x: (x["mode"] != "unique", x["intents"], x["again"]))
print(f"{'intents':>8} {'mode':>8} {'sends':>7} {'achieved':>9} {'p50 ms':>8} {'p99 ms':>8} {'err':>5} {'drop':>6} "
      f"{'pass':>5} {'orders':>7} {'loadgen':>8} {'postgres':>9} {'busy':>5}")
for x in rows:
    c = x["cores"]
    print(f"{x['intents']:>8} {x['mode']:>8} {x['offered_sends']:>7} {x['achieved']:>9} {x['p50_ms']:>8.2f} "
          f"{x['p99_ms']:>8.2f} {x['errors']:>5} {x['dropped']:>6} {'yes' if x['passed'] else 'no':>5} "
          f"{c.get('orders', ''):>7} {c.get('loadgen', ''):>8} {c.get('postgres', ''):>9} {c.get('machine_busy', ''):>5}")
print("what the orders backends wait on (share of non-idle samples, 5 a second):")
for x in rows:
    print(f"{x['intents']:>8} {x['mode']:>8}  " + ", ".join(f"{k} {v}" for k, v in x["waits"].items()))
def knee(mode):
    return max((x["achieved"] for x in rows if x["mode"] == mode and x["passed"]), default=0)
unique, retry = knee("unique"), knee("retry15")
summary = {"command": "make bench-orders", "pgbench_tps": round(single), "pgbench_batch64_orders_per_sec": round(batched),
           "best_sustained_req_per_sec": unique, "best_sustained_retry15_sends_per_sec": retry,
           "ratio": round(unique / single, 2) if single else 0,
           "batched_ratio": round(unique / batched, 2) if batched else 0, "points": rows}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(f"pgbench ceiling, one transaction per request: {single:.0f} tps")
print(f"pgbench ceiling, 64 requests per transaction: {batched:.0f} orders/s")
print(f"knee, unique keys (p99 < 25 ms, >= 95% achieved, 0 errors): {unique} req/s")
print(f"knee, 15% retries: {retry} sends/s")
print(f"results: {out}/summary.json")
print(f"ratio: {unique / single:.2f}" if single else "ratio: 0.00")
print(f"batched ratio: {unique / batched:.2f}" if batched else "batched ratio: 0.00")
PY
