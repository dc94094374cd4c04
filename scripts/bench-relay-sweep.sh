#!/usr/bin/env bash
# make bench-relay-sweep: relay drain rate by workers and batch size, same
# backlog, same run. Needs the database left by `make bench-pipeline`
# (bench_pipeline, 1M published outbox rows): each point marks the first
# SWEEP_ROWS rows pending again (as a relay crash would) and times the drain
# to a fresh topic. Settings: SWEEP_ROWS (200000), SWEEP_POINTS
# ("2:500 8:500 8:1000 16:1000": workers:batch[:shard depth[:shard groups]],
# the relay's defaults where left out or empty: 8:1000::2 is 2 groups at
# the default depth), SWEEP_RELAY_BIN (the relay binary,
# target/release/relay; another build's for an A/B on the same backlog).
# Each line also gives where the CPU went during the drain, in cores per
# process name and per PostgreSQL role (scripts/lib/cpu.py).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ROWS=${SWEEP_ROWS:-200000}
POINTS=${SWEEP_POINTS:-2:500 8:500 8:1000 16:1000}
RELAY_BIN=${SWEEP_RELAY_BIN:-target/release/relay}
scripts/stack.sh up >/dev/null
. .stack/env
# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"
cargo build -q --release -p relay
URL=${STACK_ADMIN_DATABASE_URL%/*}/bench_pipeline # the owner's: it resets the backlog
RELAY_URL=${RELAY_DATABASE_URL:?"not in .stack/env: scripts/stack.sh up rewrites it"}
RELAY_URL=${RELAY_URL%/*}/bench_pipeline
q() { psql "$URL" -qAt -v ON_ERROR_STOP=1 -c "$1"; }
[ "$(q "SELECT count(*) >= $ROWS FROM orders.outbox")" = t ] || { echo "run make bench-pipeline first" >&2; exit 1; }
CPU_A=$(mktemp) CPU_B=$(mktemp)
trap 'rm -f "$CPU_A" "$CPU_B"' EXIT
for point in $POINTS; do
  IFS=: read -r workers batch depth groups <<<"$point"
  point_env=() # the point's depth and groups, where it gives them
  [ -n "$depth" ] && point_env=(RELAY_SHARD_DEPTH="$depth")
  [ -n "$groups" ] && point_env+=(RELAY_SHARD_GROUPS="$groups")
  q "UPDATE orders.outbox SET published_at = NULL WHERE id <= $ROWS" >/dev/null
  q "VACUUM orders.outbox" >/dev/null
  topic=bench.sweep.$workers.$batch.$(date +%s)
  target/debug/kafka-tool create --topic "$topic" --partitions 6 2>/dev/null
  python3 scripts/lib/cpu.py snap "$STACK_ADMIN_DATABASE_URL" bench_pipeline >"$CPU_A"
  t0=$(date +%s.%N)
  env "${point_env[@]}" DATABASE_URL=$RELAY_URL KAFKA_TOPIC=$topic RELAY_WORKERS=$workers RELAY_BATCH_SIZE=$batch \
    RELAY_METRICS_ADDR=127.0.0.1:19206 RUST_LOG=warn "$RELAY_BIN" &
  pid=$!
  # Watched on the relay's counter: counting the pending rows would load the
  # database it measures (FINDINGS §15).
  while [ "$(pipeline_metric 19206 relay_published_total)" -lt "$ROWS" ]; do
    kill -0 "$pid" 2>/dev/null || { echo "the relay exited" >&2; exit 1; }
    sleep 0.1
  done
  t1=$(date +%s.%N)
  # Before the kill: the relay and its sessions' backends are still alive.
  python3 scripts/lib/cpu.py snap "$STACK_ADMIN_DATABASE_URL" bench_pipeline >"$CPU_B"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  [ "$(q "SELECT count(*) FROM orders.outbox WHERE published_at IS NULL")" = 0 ] || { echo "rows left pending" >&2; exit 1; }
  echo "relay=$RELAY_BIN workers=$workers batch=$batch depth=${depth:-default} groups=${groups:-default} rows=$ROWS" \
    "rows_per_sec=$(python3 -c "print(round($ROWS/($t1-$t0)))")" \
    "cpu=$(python3 scripts/lib/cpu.py diff "$CPU_A" "$CPU_B" "$(python3 -c "print($t1-$t0)")")"
done
