#!/usr/bin/env bash
# Experiment 5: the inbox at scale, one plain table vs range partitions of
# msg_id: the consume transaction's latency, throughput, WAL and size as the
# inbox grows, and a day's keys expired by DELETE + VACUUM vs DROP PARTITION
# (alone, then while consumption goes on), what a Bloom filter in front of
# the inbox would cost; then the resurrection a too-short
# retention allows, through the whole pipeline. See README.md beside this file.
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
  bloom=()
  [ "$layout" = partitioned ] && bloom=(--bloom)
  DATABASE_URL=$DB_URL "$BENCH" --layout "$layout" --checkpoints "$CHECKPOINTS" \
    --transactions "$TRANSACTIONS" "${bloom[@]}" --out "$RES/$layout.json" 2> >(tee "$RES/logs/$layout.log" >&2)
  pipeline_drop_db "$db"
done

# Resurrection through the whole pipeline (chaos: orders, relay, payments,
# loadgen, recon), three runs on fresh databases and topics. Payments keeps
# inbox partitions of PART seconds, and the group's offsets are reset to the
# earliest once during the load (chaos --fault offset-reset): every event is
# delivered again, the oldest after their partitions could have expired.
#   unsafe   retention RETAIN (--unsafe-inbox-retention), the late-arrival
#            refusal off (--unsafe-apply-after-horizon): the redelivered
#            duplicates whose partitions were dropped are applied again
#   refused  the same retention, the refusal on: they are dead-lettered
#            (after_horizon), and recon proves each a late duplicate
#   tied     the retention at its default, tied to the horizon: nothing
#            expires, the inbox catches every redelivery
if [ "$MODE" = quick ]; then
  R_RATE=${EXP_RATE:-150} R_DURATION=${EXP_DURATION:-24} R_RESET_MS=${EXP_RESET_MS:-18000}
  PART=${EXP_PARTITION:-3s} RETAIN=${EXP_RETENTION:-8s}
else
  R_RATE=${EXP_RATE:-500} R_DURATION=${EXP_DURATION:-60} R_RESET_MS=${EXP_RESET_MS:-45000}
  PART=${EXP_PARTITION:-5s} RETAIN=${EXP_RETENTION:-15s}
fi
# RETAIN must outlast the reset's outage (payments stopped, the offsets
# reset, payments started again: about 2 s with dynamic membership, over 10 s
# with static membership, which waits out the session) and the consumer's
# lag, or first deliveries come after their partition was dropped: the
# refused run then loses effects (dead letters that are no duplicates).
# The migration made a day's partitions ahead (of payments' inbox, the
# library's fx.partitioned_inbox); this experiment works in
# seconds, so they go (empty) and payments makes PART-sized ones from the
# migration's moment on.
drop_day_partitions() {
  psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "DO \$\$ DECLARE p record; BEGIN
    FOR p IN SELECT name FROM fx.partitioned_inbox_parts
             WHERE lo <> '00000000-0000-0000-0000-000000000000' LOOP
      EXECUTE format('DROP TABLE fx.%I', p.name);
      DELETE FROM fx.partitioned_inbox_parts WHERE name = p.name;
    END LOOP; END \$\$"
}
export EXP_PREPARE=drop_day_partitions
export PAYMENTS_INBOX_PARTITION=$PART PAYMENTS_CLOCK_SKEW=2s
resurrect=(--rate "$R_RATE" --duration "$R_DURATION" --retry-rate 0.15 --protocol mixed --seed 5
  --static-membership "${EXP_STATIC_MEMBERSHIP:-false}" --fault offset-reset --fault-interval-ms "$R_RESET_MS..$R_RESET_MS" --fault-count 1)
for run in unsafe refused tied; do
  case $run in
    unsafe) export PAYMENTS_INBOX_RETENTION=$RETAIN PAYMENTS_UNSAFE_INBOX_RETENTION=true PAYMENTS_UNSAFE_APPLY_AFTER_HORIZON=true ;;
    refused) export PAYMENTS_INBOX_RETENTION=$RETAIN PAYMENTS_UNSAFE_INBOX_RETENTION=true PAYMENTS_UNSAFE_APPLY_AFTER_HORIZON=false ;;
    tied) unset PAYMENTS_INBOX_RETENTION PAYMENTS_UNSAFE_INBOX_RETENTION PAYMENTS_UNSAFE_APPLY_AFTER_HORIZON ;;
  esac
  # The unsafe run's verdict is DRIFT on purpose: read from its summary.
  exp_chaos "resurrect-$run" "${resurrect[@]}" || true
done
unset EXP_PREPARE PAYMENTS_INBOX_PARTITION PAYMENTS_CLOCK_SKEW PAYMENTS_INBOX_RETENTION \
  PAYMENTS_UNSAFE_INBOX_RETENTION PAYMENTS_UNSAFE_APPLY_AFTER_HORIZON

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
