#!/usr/bin/env bash
# Experiment 5: the inbox at scale, one plain table vs range partitions of
# msg_id: the consume transaction's latency, throughput, WAL and size as the
# inbox grows, and a day's keys expired by DELETE + VACUUM vs DROP PARTITION
# (alone, then while consumption goes on). See README.md beside this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-5-dedup-store
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

if [ "$MODE" = quick ]; then
  CHECKPOINTS=${EXP_CHECKPOINTS:-0,1000000} TRANSACTIONS=${EXP_TRANSACTIONS:-200}
else
  CHECKPOINTS=${EXP_CHECKPOINTS:-0,10000000,50000000,100000000} TRANSACTIONS=${EXP_TRANSACTIONS:-1000}
fi
PROFILE=${EXP_PROFILE:-release}
flags=()
[ "$PROFILE" = release ] && flags=(--release)
say "build the bench ($PROFILE)"
cargo build -q --manifest-path "$ROOT/Cargo.toml" "${flags[@]}" -p payments --example inbox_bench
BENCH=${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE/examples/inbox_bench

# One database per layout, dropped after its run (at 100M keys each holds
# about 10 GB).
for layout in partitioned single; do
  db=exp5_$layout
  pipeline_db "$db"
  say "$layout: grow to $CHECKPOINTS keys, $TRANSACTIONS consume transactions at each, then expire"
  DATABASE_URL=$DB_URL "$BENCH" --layout "$layout" --checkpoints "$CHECKPOINTS" \
    --transactions "$TRANSACTIONS" --out "$RES/$layout.json" 2> >(tee "$RES/logs/$layout.log" >&2)
  pipeline_drop_db "$db"
done

python3 "$ROOT/experiments/lib/exp5.py" "$RES" "$MODE" "$CHECKPOINTS" && status=0 || status=$?

if [ -x "$ROOT/.tools/venv/bin/python" ] || "$ROOT/scripts/tools.sh" venv >/dev/null 2>&1; then
  PY=$ROOT/.tools/venv/bin/python
  "$PY" "$ROOT/scripts/plot.py" curve "$RES/growth.csv" -o "$RES/p99.png" --x keys --y txn_p99_ms \
    --group layout --title "consume transaction p99 by inbox size (exp-5, $MODE)" \
    --xlabel "keys in the inbox" --ylabel "p99 ms" || echo "exp-5: plot failed (see growth.csv)" >&2
  "$PY" "$ROOT/scripts/plot.py" curve "$RES/growth.csv" -o "$RES/size.png" --x keys --y table_mb,index_mb \
    --group layout --title "inbox size by keys (exp-5, $MODE)" \
    --xlabel "keys in the inbox" --ylabel "MB" || echo "exp-5: plot failed (see growth.csv)" >&2
fi
exit "$status"
