#!/usr/bin/env bash
# make bench-orders: POST /orders at fixed offered rates (unique keys, and with
# 15% retries) against the pgbench ceiling of the same transaction, in one run
# on the same PostgreSQL. Prints a table and, last, `ratio: 0.NN` = the highest
# rate the service sustains (≥ 95% of offered achieved, p99 < 25 ms, no
# errors; unique keys) over the pgbench TPS of its transaction.
#
# Settings (env): BENCH_RATES ("1000 2000 3000 4000 5000 6000"),
# BENCH_SECONDS (15 per point), BENCH_PGBENCH_CLIENTS (16).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
RATES=${BENCH_RATES:-1000 2000 3000 4000 5000 6000}
SECS=${BENCH_SECONDS:-15}
CLIENTS=${BENCH_PGBENCH_CLIENTS:-16}
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
  "$BIN/orders" >"$OUT/orders.log" 2>&1 &
ORDERS=$!
trap 'kill $ORDERS 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do curl -fs http://127.0.0.1:18280/metrics >/dev/null 2>&1 && break; sleep 0.1; done

for rate in $RATES; do
  for mode in unique retry15; do
    retry=0; [ "$mode" = retry15 ] && retry=0.15
    log "POST /orders: $rate req/s, $mode, $SECS s"
    "$BIN/loadgen" --http-url http://127.0.0.1:18280 --grpc-url http://127.0.0.1:15251 --progress off \
      --rate "$rate" --duration "$SECS" --zipf-s 0 --retry-rate "$retry" --seed "$rate" \
      --json "$OUT/$rate-$mode.json" >/dev/null || log "loadgen exited $? at $rate $mode"
    sleep 2
  done
done
kill $ORDERS; wait $ORDERS 2>/dev/null || true

log "pgbench ceiling of the same transaction: $CLIENTS clients, $SECS s"
psql "$URL" -qAt -c "VACUUM ANALYZE" >/dev/null
pgbench -n -M prepared -f bench/new-order.pgbench.sql -c "$CLIENTS" -j 2 -T "$SECS" "$URL" >"$OUT/pgbench.txt" 2>&1
cat "$OUT/pgbench.txt" >&2

python3 - "$OUT" <<'PY'
import glob, json, os, re, sys
out = sys.argv[1]
tps = float(re.search(r"tps = ([0-9.]+)", open(os.path.join(out, "pgbench.txt")).read()).group(1))
rows = []
for path in sorted(glob.glob(os.path.join(out, "*-*.json")), key=lambda p: (int(os.path.basename(p).split("-")[0]), p)):
    r = json.load(open(path))
    o = r["outcomes"]
    rows.append({
        "offered": r["rates"]["offered"], "mode": os.path.basename(path).split("-", 1)[1][:-5],
        "achieved": round(r["rates"]["achieved"]), "ok_per_sec": round(r["rates"]["ok"]),
        "p50_ms": r["latency_ms"]["all"]["p50_ms"], "p99_ms": r["latency_ms"]["all"]["p99_ms"],
        "errors": o["server_errors"] + o["client_errors"] + o["connect_errors"] + o["other_status"] + r.get("unfinished", 0),
        "dropped": r["sends"]["dropped"], "replay_mismatches": r["replay"]["mismatches"],
    })
print(f"{'offered':>8} {'mode':>8} {'achieved':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} {'dropped':>8} {'mismatch':>9}")
for x in rows:
    print(f"{x['offered']:>8.0f} {x['mode']:>8} {x['achieved']:>9} {x['p50_ms']:>8.2f} {x['p99_ms']:>8.2f} {x['errors']:>7} {x['dropped']:>8} {x['replay_mismatches']:>9}")
ok = [x for x in rows if x["mode"] == "unique" and x["achieved"] >= 0.95 * x["offered"] and x["p99_ms"] < 25 and x["errors"] == 0 and x["dropped"] == 0]
best = max((x["achieved"] for x in ok), default=0)
summary = {"command": "make bench-orders", "pgbench_tps": round(tps), "best_sustained_req_per_sec": best,
           "ratio": round(best / tps, 2) if tps else 0, "points": rows}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(f"pgbench ceiling (same transaction): {tps:.0f} tps")
print(f"highest sustained POST /orders (unique keys, p99 < 25 ms, >= 95% achieved, 0 errors): {best} req/s")
print(f"results: {out}/summary.json")
print(f"ratio: {best / tps:.2f}" if tps else "ratio: 0.00")
PY
