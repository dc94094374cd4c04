#!/usr/bin/env bash
# make bench-orders: POST /orders alone (no broker), swept upwards until it
# finds the knee, for unique keys and with 15% same-key retries; then the
# ceilings of the same write by pgbench on the same PostgreSQL, in the same
# run: one transaction per request (bench/new-order.pgbench.sql), the
# service's one statement of 64 coalesced requests
# (bench/new-order-batch64.pgbench.sql), and the same 64 in a transaction of
# three statements, as the service wrote them before
# (bench/new-order-batch64-txn.pgbench.sql).
#
# A point passes when ≥ 95% of the offered sends were achieved, p99 < 25 ms,
# no errors and none dropped. Each mode starts at BENCH_START intents/s and
# steps by BENCH_STEP until a point fails twice in a row (a single 15 s point
# on a shared machine can fail on one slow commit), then bisects between the
# last pass and that failure BENCH_REFINE times. The knee is the highest
# passing rate, in sends/s. Each point also records the CPU each process
# group used (orders, loadgen, postgres; cores, from /proc) and what the
# service's database sessions wait on (pg_stat_activity, 5 times a second),
# the writers' batches (a second, and requests per batch, from orders'
# orders_write_batch_size histogram), and its stalls: loadgen's p99 second by
# second beside the page cache's dirty data (10 times a second), so a second
# over 25 ms shows whether the kernel was writing a burst back then.
#
# Prints a table and, last, `ratio: N.NN` (the unique knee over the
# one-transaction-per-request TPS) and `batched ratio: 0.NN` (over the
# batched ceiling's orders/s).
#
# The verdicts and the table are scripts/lib/bench_orders.py. Each point's
# raw files end in the run's raw.tar.gz.
#
# Settings (env): BENCH_START (2000), BENCH_STEP (2000), BENCH_MAX (40000),
# BENCH_REFINE (2), BENCH_SECONDS (15 per point), BENCH_WARMUP_SECONDS (3: a
# load at the first point's rate before the first point, not recorded; 0 for
# none), BENCH_PG_SETTINGS (PostgreSQL settings for the run's database, e.g.
# "backend_flush_after=512kB": NAME=VALUE items, for settings a session may
# change), BENCH_PGBENCH_CLIENTS (16),
# BENCH_BATCH_CLIENTS (4); BENCH_CEILINGS (1; 0 skips the pgbench ceilings,
# whose SQL is this tree's schema, for an A/B with an older build's);
# BENCH_RATES ("4000 8000 ...") runs those points
# instead of a sweep; BENCH_PERF=RATE also records `perf record` system-wide
# at that rate (both modes; the per-process and per-symbol tables land in
# the results as perf-RATE-MODE.txt); BENCH_ORDERS_BIN runs another orders
# binary, BENCH_LOADGEN_BIN another loadgen (an A/B of two builds on the
# same database and ceilings).
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
WARMUP_SECS=${BENCH_WARMUP_SECONDS:-3}
PG_SETTINGS=${BENCH_PG_SETTINGS:-}
for setting in $PG_SETTINGS; do
  [[ $setting =~ ^[a-z_]+=[A-Za-z0-9_.]+$ ]] ||
    { echo "bench: BENCH_PG_SETTINGS takes NAME=VALUE items, e.g. backend_flush_after=512kB (got '$setting')" >&2; exit 2; }
done
[[ $WARMUP_SECS =~ ^[0-9]+$ ]] || { echo "bench: BENCH_WARMUP_SECONDS must be a whole number of seconds" >&2; exit 2; }
RUN=$(date +%Y%m%d-%H%M%S)
OUT=$ROOT/bench/results/orders-$RUN
mkdir -p "$OUT"
BIN=$ROOT/target/release
LOADGEN=${BENCH_LOADGEN_BIN:-$BIN/loadgen}
log() { printf 'bench: %s\n' "$*" >&2; }

STACK_KAFKA=0 scripts/stack.sh up >/dev/null
. .stack/env
# Kafka nodes left running by an earlier `make up` use no CPU to speak of,
# but their threads wake on every core: beside them this latency-bound
# benchmark found about 40% less (FINDINGS §14).
if scripts/stack.sh status 2>/dev/null | grep -q 'kafka node .*: running'; then
  log "warning: Kafka nodes are running beside the benchmark; for orders alone, make down first"
fi
log "building (release)"
cargo build -q --release -p orders -p loadgen
# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"
# No broker needed: orders alone. Migrated by the build measured, so that
# an A/B against an older build runs each on its own schema.
ORDERS_BIN=${BENCH_ORDERS_BIN:-$BIN/orders}
pipeline_db bench_orders "$(dirname "$ORDERS_BIN")"
URL=$DB_URL
# PostgreSQL settings for this run's database only (sessions opened from here
# on take them; the database is made anew by each run).
for setting in $PG_SETTINGS; do
  psql "$STACK_ADMIN_DATABASE_URL" -qAt -v ON_ERROR_STOP=1 \
    -c "ALTER DATABASE bench_orders SET ${setting%%=*} = '${setting#*=}'" >/dev/null
  log "database setting: $setting"
done
[ -z "$PG_SETTINGS" ] || echo "$PG_SETTINGS" >"$OUT/pg-settings.txt" # summary.json records them

DATABASE_URL=$ORDERS_DATABASE_URL RUST_LOG=warn ORDERS_HTTP_ADDR=127.0.0.1:18280 ORDERS_GRPC_ADDR=127.0.0.1:15251 \
  ORDERS_METRICS_ADDR=127.0.0.1:18281 "$ORDERS_BIN" >"$OUT/orders.log" 2>&1 &
ORDERS=$!
trap 'kill $ORDERS 2>/dev/null || true' EXIT
# orders_metrics: its metrics, on their own address (a build older than that
# serves them on the HTTP port).
orders_metrics() { curl -fs http://127.0.0.1:18281/metrics 2>/dev/null || curl -fs http://127.0.0.1:18280/metrics; }
for _ in $(seq 1 100); do orders_metrics >/dev/null 2>&1 && break; sleep 0.1; done
# A warm-up at the first point's rate, not recorded: the first load after
# orders starts opens its connections, and one slow second is enough to
# fail a 15 s point.
WARMUP_RATE=${BENCH_RATES:-$START}
WARMUP_RATE=${WARMUP_RATE%% *}
if [ "$WARMUP_SECS" -gt 0 ]; then
  log "warm-up: $WARMUP_RATE intents/s for $WARMUP_SECS s, not recorded"
  "$LOADGEN" --http-url http://127.0.0.1:18280 --grpc-url http://127.0.0.1:15251 --progress off \
    --rate "$WARMUP_RATE" --duration "$WARMUP_SECS" --zipf-s 0 --retry-rate 0 --seed 1 >/dev/null 2>&1 ||
    log "warm-up: loadgen exited $?"
  sleep 2
fi

# The orders role's sessions that are not idle, by what they wait on (CPU:running when on the CPU;
# Client:ClientRead while a transaction waits for the service's next statement).
WAITS_SQL="SELECT COALESCE(wait_event_type, 'CPU') || ':' || COALESCE(wait_event, 'running'), count(*) \
FROM pg_stat_activity WHERE usename = 'effectively_orders' AND state <> 'idle' GROUP BY 1;"

# The writers' batches so far: a line "unix-time batches requests" from orders' histogram.
batches() {
  orders_metrics | awk -v t="$(date +%s.%N)" \
    '/^orders_write_batch_size_count /{c=$2} /^orders_write_batch_size_sum /{s=$2} END{print t, c, s}'
}

# point RATE MODE: one loadgen run; exit status 0 when it passed (scripts/lib/bench_orders.py judges).
point() {
  local rate=$1 mode=$2 retry=0 tag perf_pid=""
  [ "$mode" = retry15 ] && retry=0.15
  tag=$rate-$mode
  [ -f "$OUT/$tag.json" ] && tag=$rate-$mode-again
  log "POST /orders: $rate intents/s, $mode, $SECS s"
  # CPU snapshots inside the load (loadgen's ticks vanish with it): 2 s in, 1 s before the end
  # (the load starts a second after this, below).
  (sleep 3; python3 scripts/lib/bench_orders.py cpu >"$OUT/$tag.cpu0"; sleep $((SECS - 3))
    python3 scripts/lib/bench_orders.py cpu >"$OUT/$tag.cpu1") &
  local cpu_pid=$!
  # What the service's backends wait on, five times a second, from one psql.
  printf '%s\n\\watch 0.2\n' "$WAITS_SQL" | psql "$URL" -qAt -F '|' >"$OUT/$tag.waits" 2>/dev/null &
  local waits_pid=$!
  if [ -n "$PERF_AT" ] && [ "$rate" = "$PERF_AT" ] && command -v perf >/dev/null; then
    (sleep 3; exec perf record -q -F 499 -a -o "$OUT/perf-$tag.data" -- sleep $((SECS - 5))) \
      >/dev/null 2>&1 &
    perf_pid=$!
  fi
  # The page cache's dirty and writeback data, ten times a second, beside
  # loadgen's per-second p99: a stall lines up with a writeback burst or not.
  python3 scripts/lib/bench_orders.py dirty $((SECS + 4)) >"$OUT/$tag.dirty" &
  local dirty_pid=$!
  # The samplers' start-up (a psql session, two Python processes) is kept out
  # of the load's first second: beside it that second's p99 was 31-121 ms
  # (FINDINGS §14).
  sleep 1
  batches >"$OUT/$tag.batches"
  date +%s.%N >"$OUT/$tag.start"
  "$LOADGEN" --http-url http://127.0.0.1:18280 --grpc-url http://127.0.0.1:15251 --progress off \
    --rate "$rate" --duration "$SECS" --zipf-s 0 --retry-rate "$retry" --seed "$rate" \
    --json "$OUT/$tag.json" --csv "$OUT/$tag.seconds.csv" >/dev/null || log "loadgen exited $? at $rate $mode"
  batches >>"$OUT/$tag.batches"
  kill "$dirty_pid" 2>/dev/null || true
  wait "$dirty_pid" 2>/dev/null || true
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
  python3 scripts/lib/bench_orders.py passed "$OUT/$tag.json"
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
if [ "${BENCH_CEILINGS:-1}" != 0 ]; then
  log "pgbench ceiling, one transaction per request: $CLIENTS clients, $SECS s"
  pgbench -n -M prepared -f bench/new-order.pgbench.sql -c "$CLIENTS" -j 2 -T "$SECS" "$URL" >"$OUT/pgbench.txt" 2>&1
  log "pgbench ceiling, 64 requests in one statement: $BATCH_CLIENTS clients, $SECS s"
  pgbench -n -M prepared -f bench/new-order-batch64.pgbench.sql -c "$BATCH_CLIENTS" -j 2 -T "$SECS" "$URL" \
    >"$OUT/pgbench-batch64.txt" 2>&1
  log "pgbench, 64 requests per transaction of three statements (the write before it was one): $BATCH_CLIENTS clients, $SECS s"
  pgbench -n -M prepared -f bench/new-order-batch64-txn.pgbench.sql -c "$BATCH_CLIENTS" -j 2 -T "$SECS" "$URL" \
    >"$OUT/pgbench-batch64-txn.txt" 2>&1
  grep -h "tps =" "$OUT/pgbench.txt" "$OUT/pgbench-batch64.txt" "$OUT/pgbench-batch64-txn.txt" >&2 || true
fi

python3 scripts/lib/bench_orders.py summary "$OUT"
# The run stays lean: summary.json and pgbench's and perf's tables stay plain, each point's
# files (loadgen's report, CPU snapshots, waits, batches) go into raw.tar.gz (`tar xzf
# raw.tar.gz` to read them; bench_orders.py summary reads them from it).
(cd "$OUT" && "$ROOT/scripts/lib/pack-raw.sh" . ./*-*.json ./*.cpu0 ./*.cpu1 ./*.waits ./*.batches \
  ./*.seconds.csv ./*.dirty ./*.start) ||
  echo "bench-orders: packing the points' files into raw.tar.gz failed (they stay plain)" >&2
