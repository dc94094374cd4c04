#!/usr/bin/env bash
# Experiment 6: outbox lag under steady load and bursts. For each relay
# configuration (poll or WAL, workers × batch size): the drain rate from a backlog (the
# relay's capacity), then a schedule of writes straight into the outbox by
# pgbench: a steady rate S the whole time, a burst to 2×S, a recovery at S, a
# burst to 3×S, a recovery at S. S is EXP_STEADY_SHARE of the first
# configuration's measured capacity, so the same bursts hit every
# configuration. Sampled every second: unpublished rows, the oldest one's age,
# each process's CPU; per row, in SQL: commit→publish. See README.md beside
# this file.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/experiments/exp-6-outbox-lag
# shellcheck source=scripts/lib/experiment.sh
. "$ROOT/scripts/lib/experiment.sh"
exp_init "$HERE"

# A configuration is [MODE:]WORKERS:BATCH: MODE poll (the default) or wal
# (relay --mode wal, whose WORKERS × BATCH is the most rows in flight).
if [ "$MODE" = quick ]; then
  CONFIGS=${EXP_CONFIGS:-wal:8:1000 8:1000} DRAIN_ROWS=${EXP_DRAIN_ROWS:-30000}
  # A recovery three times its burst: on 2 cores the relay publishes far
  # below its drain rate during a 3×S burst (the writers take the CPU), and
  # 10 s after a 6 s burst was not always enough to drain it (CI, FINDINGS §8).
  STEADY_S=${EXP_STEADY_S:-6} BURST_S=${EXP_BURST_S:-5} RECOVER_S=${EXP_RECOVER_S:-15}
  # The WAL relay first, and S 0.3 of its drain: on the 3-node cluster a
  # debug build's WAL relay drains less than half of the poll relay's rate
  # (2,427-3,383 against 5,397-7,792 rows/s) and publishes below that while
  # the writers take the CPU; S taken from the poll relay left it no room
  # for the bursts (FINDINGS §8).
  SHARE=${EXP_STEADY_SHARE:-0.3}
else
  SHARE=${EXP_STEADY_SHARE:-0.4}
  CONFIGS=${EXP_CONFIGS:-8:1000 2:500 4:1000 16:1000 8:250 wal:8:1000 wal:2:500} DRAIN_ROWS=${EXP_DRAIN_ROWS:-300000}
  STEADY_S=${EXP_STEADY_S:-30} BURST_S=${EXP_BURST_S:-30} RECOVER_S=${EXP_RECOVER_S:-60}
fi
RATE=${EXP_RATE:-} # rows/s; empty: SHARE × the first configuration's drain rate
ROWS_PER_TX=10     # pgbench inserts this many outbox rows per transaction
RELAY_METRICS=127.0.0.1:19161
export RUST_LOG=${RUST_LOG:-warn}

q() { psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 "$@"; }
now() { date +%s.%N; }
# pgbench's transaction: the insert, without the trigger's NOTIFY, then a
# NOTIFY of its own, as orders does (a NOTIFY holds a database-wide lock
# through its transaction's commit and WAL flush: inserts that notify commit
# one at a time, about 300/s here; migrations/*_outbox_notify_when_rows.sql).
{ pipeline_outbox_rows_sql :rows; echo "SELECT pg_notify('orders_outbox', '');"; } >"$RES/logs/insert.pgbench.sql"
pending() { q -c "SELECT count(*) FROM orders.outbox WHERE published_at IS NULL AND failed_at IS NULL"; }

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

# write RATE SECONDS LOG: pgbench writes RATE outbox rows/s (ROWS_PER_TX per
# transaction, Poisson arrivals) for SECONDS, in the background; sets WRITER.
# 8 clients, so a slow commit does not hold the schedule back.
write() {
  local tps
  tps=$(python3 -c "print(max(1, round($1 / $ROWS_PER_TX)))")
  PGOPTIONS="-c effectively.outbox_notify=off" pgbench -n -c 8 -j 2 -R "$tps" -T "$2" -D rows=$ROWS_PER_TX -f "$RES/logs/insert.pgbench.sql" \
    "$DATABASE_URL" >"$3" 2>&1 &
  WRITER=$!
  PIDS+=("$WRITER")
}

phase() { # CONFIG_DIR NAME MULTIPLE SECONDS: one line of phases.csv (its start and end unix seconds)
  printf '%s,%s,%s,%s\n' "$2" "$3" "$(now)" "$4" >>"$1/phases.csv"
}

schedule_s=$((STEADY_S + BURST_S + RECOVER_S + BURST_S + RECOVER_S))
for config in $CONFIGS; do
  case $config in wal:*) mode=wal rest=${config#wal:} ;; poll:*) mode=poll rest=${config#poll:} ;; *) mode=poll rest=$config ;; esac
  workers=${rest%%:*} batch=${rest##*:}
  tag=$(python3 "$ROOT/experiments/lib/exp6.py" --config-name "$config")
  dir=$RES/$tag
  db=exp_6_${mode}_${workers}_${batch}
  mkdir -p "$dir"
  pipeline_fresh "$db" "exp-6-$tag-$(date +%H%M%S)" 2>/dev/null

  say "$tag: capacity: the relay drains $DRAIN_ROWS rows"
  start_relay() {
    # A loop per shard (--shard-groups 16), the layout these configurations
    # were chosen for: with fewer groups, workers beyond the groups are idle.
    DATABASE_URL=$RELAY_DATABASE_URL RELAY_METRICS_ADDR=$RELAY_METRICS RELAY_WORKERS=$workers \
      RELAY_SHARD_GROUPS=16 RELAY_BATCH_SIZE=$batch RELAY_MODE=$mode RELAY_WAL_HEARTBEAT_MS=1000 "$BIN/relay" >"$dir/relay.log" 2>&1 &
    relay=$!
    PIDS+=("$relay")
  }
  if [ "$mode" = poll ]; then
    # The backlog first, then the relay claims it.
    q -c "$(pipeline_outbox_rows_sql "$DRAIN_ROWS")" -c "VACUUM ANALYZE orders.outbox" >/dev/null
    cpu0=$(python3 "$ROOT/experiments/lib/exp6.py" --cpu-ticks)
    t0=$(now)
    start_relay
  else
    # The relay streams first; the backlog then comes from the WAL (rows
    # pending before its slot would be drained by the poll path).
    start_relay
    for _ in $(seq 1 300); do
      [ "$(q -c "SELECT active FROM pg_replication_slots WHERE slot_name = 'effectively_outbox_$db'")" = t ] && break
      kill -0 "$relay" 2>/dev/null || { echo "exp-6: the relay exited; see $dir/relay.log" >&2; exit 1; }
      sleep 0.1
    done
    cpu0=$(python3 "$ROOT/experiments/lib/exp6.py" --cpu-ticks)
    t0=$(now)
    q -c "$(pipeline_outbox_rows_sql "$DRAIN_ROWS")" >/dev/null
  fi
  deadline=$(($(date +%s) + 600))
  while [ "$(pending)" != 0 ]; do
    kill -0 "$relay" 2>/dev/null || { echo "exp-6: the relay exited; see $dir/relay.log" >&2; exit 1; }
    [ "$(date +%s)" -lt "$deadline" ] || { echo "exp-6: $tag did not drain $DRAIN_ROWS rows in 600 s" >&2; exit 1; }
    sleep 0.2
  done
  drain_s=$(python3 -c "print(round($(now) - $t0, 3))")
  printf '{"rows": %s, "seconds": %s, "cpu_before": %s, "cpu_after": %s}\n' "$DRAIN_ROWS" "$drain_s" \
    "$cpu0" "$(python3 "$ROOT/experiments/lib/exp6.py" --cpu-ticks)" >"$dir/drain.json"
  if [ -z "$RATE" ]; then
    RATE=$(python3 -c "print(max($ROWS_PER_TX, round($SHARE * $DRAIN_ROWS / $drain_s)))")
  fi
  say "$tag: drained at $(python3 -c "print(round($DRAIN_ROWS / $drain_s))") rows/s; steady rate S = $RATE rows/s"

  # The schedule. The backlog and CPU are sampled every second throughout and
  # until the relay has caught up.
  python3 "$ROOT/experiments/lib/sampler.py" --database-url "$DATABASE_URL" --relay "$RELAY_METRICS" \
    --interval 1 --duration $((schedule_s + 300)) --out "$dir/samples.csv" --minutes "$dir/minutes.csv" &
  sampler=$!
  PIDS+=("$sampler")
  sleep 1
  echo "phase,multiple,start_unix,seconds" >"$dir/phases.csv"
  write "$RATE" "$schedule_s" "$dir/pgbench-steady.log"
  steady=$WRITER
  phase "$dir" steady 1 "$STEADY_S"
  sleep "$STEADY_S"
  n=0
  for multiple in 2 3; do
    n=$((n + 1))
    say "$tag: burst to ${multiple}×S for $BURST_S s"
    phase "$dir" "burst-${multiple}x" "$multiple" "$BURST_S"
    write "$(((multiple - 1) * RATE))" "$BURST_S" "$dir/pgbench-burst-${multiple}x.log"
    wait "$WRITER"
    phase "$dir" "recover-$n" 1 "$RECOVER_S"
    sleep "$RECOVER_S"
  done
  wait "$steady" || { echo "exp-6: pgbench failed; see $dir/pgbench-steady.log" >&2; exit 1; }
  end=$(now)
  deadline=$(($(date +%s) + 300))
  while [ "$(pending)" != 0 ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.5; done
  caught_up_s=$(python3 -c "print(round($(now) - $end, 3))")
  sleep 1
  kill "$sampler" 2>/dev/null || true
  wait "$sampler" 2>/dev/null || true
  kill "$relay" 2>/dev/null || true
  wait "$relay" 2>/dev/null || true

  # Per second of the schedule: rows written (by commit second) with their
  # commit→publish p50/p99/max, and rows published (by publish second).
  start=$(sed -n 2p "$dir/phases.csv" | cut -d, -f3)
  q -c "COPY (
    WITH rows AS (SELECT created_at, published_at, EXTRACT(EPOCH FROM published_at - created_at) * 1000 AS ms
                  FROM orders.outbox WHERE created_at >= to_timestamp($start) - interval '1 second'),
         w AS (SELECT floor(EXTRACT(EPOCH FROM created_at))::int8 AS second, count(*) AS written,
                      percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) AS p50_ms,
                      percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) AS p99_ms, max(ms) AS max_ms
               FROM rows GROUP BY 1),
         p AS (SELECT floor(EXTRACT(EPOCH FROM published_at))::int8 AS second, count(*) AS published
               FROM rows WHERE published_at IS NOT NULL GROUP BY 1)
    SELECT second, COALESCE(written, 0) AS written, COALESCE(published, 0) AS published,
           round(p50_ms::numeric, 1) AS p50_ms, round(p99_ms::numeric, 1) AS p99_ms, round(max_ms::numeric, 1) AS max_ms
    FROM w FULL JOIN p USING (second) ORDER BY second) TO STDOUT WITH CSV HEADER" >"$dir/seconds.csv"
  q -c "$(python3 "$ROOT/experiments/lib/exp6.py" --phase-sql "$dir/phases.csv")" >"$dir/latency.csv"
  q -c "SELECT json_build_object('mode', '$mode', 'workers', $workers, 'batch', $batch, 'steady_rate', $RATE,
      'written', count(*) FILTER (WHERE created_at >= to_timestamp($start) - interval '1 second'),
      'published', count(*) FILTER (WHERE created_at >= to_timestamp($start) - interval '1 second' AND published_at IS NOT NULL),
      'pending', count(*) FILTER (WHERE published_at IS NULL AND failed_at IS NULL),
      'failed', count(*) FILTER (WHERE failed_at IS NOT NULL),
      'caught_up_s', $caught_up_s) FROM orders.outbox" >"$dir/totals.json"
  pipeline_drop_db "$db"
done

printf '{"steady_share": %s, "steady_rate": %s, "rows_per_tx": %s, "configs": "%s"}\n' \
  "$SHARE" "$RATE" "$ROWS_PER_TX" "$CONFIGS" >"$RES/meta.json"
python3 "$ROOT/experiments/lib/exp6.py" "$RES" "$MODE" && status=0 || status=$?
if [ "$status" != 0 ]; then
  # What a failed run needs first, printed where CI shows it: each relay's
  # warnings and errors (a WAL stream's restart names its reason).
  for log in "$RES"/*/relay.log; do
    echo "exp-6: $(basename "$(dirname "$log")")'s relay: $(grep -c -E ' (WARN|ERROR) ' "$log") warnings and errors; the last 20:"
    grep -E ' (WARN|ERROR) ' "$log" | tail -20 | cut -c1-600
  done
fi

if [ -x "$ROOT/.tools/venv/bin/python" ] || "$ROOT/scripts/tools.sh" venv >/dev/null 2>&1; then
  py=$ROOT/.tools/venv/bin/python
  { "$py" "$ROOT/scripts/plot.py" curve "$RES/timeline.csv" -o "$RES/pending.png" --x t_s --y pending_rows \
      --group config --title "exp-6 ($MODE): unpublished outbox rows; S, 2×S, S, 3×S, S (S = $RATE rows/s)" \
      --xlabel "seconds into the schedule" --ylabel "unpublished rows" &&
    "$py" "$ROOT/scripts/plot.py" curve "$RES/timeline.csv" -o "$RES/oldest.png" --x t_s --y oldest_pending_s \
      --group config --hline 2:"2 s SLO" --title "exp-6 ($MODE): age of the oldest unpublished row" \
      --xlabel "seconds into the schedule" --ylabel "seconds" &&
    "$py" "$ROOT/scripts/plot.py" curve "$RES/rates.csv" -o "$RES/rates.png" --x t_s --y written,published \
      --group config --title "exp-6 ($MODE): rows written and published per second" \
      --xlabel "seconds into the schedule" --ylabel "rows/s"; } || echo "exp-6: plot failed (see timeline.csv)" >&2
fi
# A committed run stays lean: what exp6.py reads to judge it again, the tables and the plots
# stay plain; the relay's and pgbench's logs go into RES/raw.tar.gz (`tar xzf raw.tar.gz`).
if [ "$MODE" != quick ]; then
  (cd "$RES" && "$ROOT/scripts/lib/pack-raw.sh" . ./*/relay.log ./*/pgbench-*.log) ||
    echo "exp-6: packing the logs into raw.tar.gz failed (they stay plain)" >&2
fi
exit "$status"
