#!/usr/bin/env bash
# make bench-inbox: payments' consume transaction (experiment 5's inbox_bench:
# window, inbox claim, charge, ledger entry, one commit, batches of 100 new
# msg_ids) at 0 and 1,000,000 keys in the partitioned inbox, on a fresh
# database per run. With BENCH_BASE_BIN (a directory holding another build's
# release `orders` and `inbox_bench`), that build runs beside this one,
# alternating, BENCH_INBOX_ROUNDS times each (default 3), each run on a
# database migrated by its own build; the medians and their ratio are
# printed, every run's JSON kept in bench/results/inbox-<time>/.
#
#   make bench-inbox BENCH_BASE_BIN=/tmp/before
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/scripts/lib/pipeline.sh"
"$ROOT/scripts/stack.sh" up >/dev/null
. "$ROOT/.stack/env"

ROUNDS=${BENCH_INBOX_ROUNDS:-3}
CHECKPOINTS=${BENCH_INBOX_CHECKPOINTS:-0,1000000}
TRANSACTIONS=${BENCH_INBOX_TRANSACTIONS:-300}
cargo build -q --release --manifest-path "$ROOT/Cargo.toml" -p payments --example inbox_bench -p orders --bin orders
HERE=${CARGO_TARGET_DIR:-$ROOT/target}/release
OUT=$ROOT/bench/results/inbox-$(date -u +%Y%m%d-%H%M%S)
mkdir -p "$OUT"

builds=(this)
if [ -n "${BENCH_BASE_BIN:-}" ]; then
  for bin in orders inbox_bench; do
    [ -x "$BENCH_BASE_BIN/$bin" ] || { echo "bench-inbox: no $BENCH_BASE_BIN/$bin" >&2; exit 2; }
  done
  builds=(base this)
fi

for round in $(seq 1 "$ROUNDS"); do
  for build in "${builds[@]}"; do
    if [ "$build" = base ]; then orders=$BENCH_BASE_BIN/orders bench=$BENCH_BASE_BIN/inbox_bench
    else orders=$HERE/orders bench=$HERE/examples/inbox_bench; fi
    db=bench_inbox
    pipeline_drop_db "$db"
    PGOPTIONS=--client-min-messages=warning psql "$STACK_ADMIN_DATABASE_URL" -qAt -v ON_ERROR_STOP=1 \
      -c "CREATE DATABASE $db" >/dev/null
    url=${STACK_ADMIN_DATABASE_URL%/*}/$db
    DATABASE_URL=$url "$orders" --migrate-only 2>/dev/null
    echo "bench-inbox: round $round, $build build" >&2
    DATABASE_URL=$url "$bench" --layout partitioned --checkpoints "$CHECKPOINTS" \
      --transactions "$TRANSACTIONS" --out "$OUT/$build-$round.json" 2>"$OUT/$build-$round.log"
    pipeline_drop_db "$db"
  done
done

python3 - "$OUT" "${builds[@]}" <<'EOF'
import json, statistics, sys, glob, os
out, builds = sys.argv[1], sys.argv[2:]
rows = {}
for b in builds:
    for f in sorted(glob.glob(os.path.join(out, f"{b}-*.json"))):
        for p in json.load(open(f))["points"]:
            rows.setdefault((p["keys"], b), []).append(p)
keys = sorted({k for k, _ in rows})
summary = []
print(f"{'keys':>9} {'build':>5} {'msgs/s (runs)':>30} {'median':>8} {'p99 ms median':>14}")
for k in keys:
    med = {}
    for b in builds:
        pts = rows.get((k, b), [])
        rates = [p["msgs_per_s"] for p in pts]
        p99 = statistics.median(p["txn_p99_ms"] for p in pts)
        med[b] = statistics.median(rates)
        print(f"{k:>9} {b:>5} {', '.join(f'{r:,.0f}' for r in rates):>30} {med[b]:>8,.0f} {p99:>14.2f}")
        summary.append({"keys": k, "build": b, "msgs_per_s": rates, "median": med[b], "p99_ms_median": p99})
    if "base" in med:
        print(f"{k:>9} ratio this/base of the medians: {med['this'] / med['base']:.2f}")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(f"results: {out}")
EOF
