#!/usr/bin/env bash
# make bench-cdc: the three relays on the same work, one after another in one
# run: the poll relay (relay --mode poll), the WAL relay (relay --mode wal)
# and Debezium's PostgreSQL connector with its Outbox Event Router on a Kafka
# Connect worker (scripts/debezium.sh), each publishing orders.outbox into a
# topic of its own on the stack's cluster. Results: bench/results/cdc-RUN.json
# (every figure), cdc-RUN.md (the table) and cdc-RUN-*.png (the plots); the
# last lines printed are the WAL relay's ratios to Debezium.
#
# For each relay, in a fresh database:
# 1. Its backlog: BENCH_CDC_ROWS orders and their outbox rows committed while
#    it is down, as the load commits them (below: BENCH_CDC_BATCH a
#    transaction) (its slot made first: Debezium streams nothing committed
#    before its slot exists), then it starts and drains them. The rate is
#    rows over the time from the first row received to the last.
# 2. Steady rates: pgbench commits BENCH_CDC_BATCH orders and their outbox
#    rows a transaction (bench/cdc-orders.pgbench.sql) at each of
#    BENCH_CDC_RATES rows/s for BENCH_CDC_SECONDS, the rates ascending; after
#    each, up to BENCH_CDC_DRAIN_WAIT s for the relay to publish the rest. A
#    rate is sustained when pgbench committed at least 95% of it, every row
#    was received within the wait, and the backlog stayed flat: the median
#    commit→consume latency of the rows committed in the point's last 10 s is
#    within 1 s of the median of those of its first 10 s after 5 s (a backlog
#    growing by a twentieth of the rate adds 2 s over 40 s). A relay's
#    ladder stops at its first rate not sustained.
#
# What each point measures:
# - commit→consume per event: from its transaction's commit time in
#   PostgreSQL (pg_xact_commit_timestamp of the order row, which nothing
#   updates; the stack runs with track_commit_timestamp) to the moment a
#   consumer here was handed the record (payments/examples/receipts.rs: a
#   fresh group, payments' fetch wait, no other work), the first receipt of
#   each order; p50, p99, max. One clock: everything runs on this machine.
# - CPU per 1,000 events, over the point's middle (5 s in to 5 s before the
#   end; scripts/lib/cpu.py, this database's sessions only): the relay's
#   process (`relay`, or the Connect worker's JVM, `kafka-connect`), its
#   PostgreSQL sessions (role effectively_relay: the poll relay's claims and
#   marks, the WAL relay's marks) and its walsender (the slot's decoding,
#   `walsender:effectively_relay`), and the brokers beside (`kafka`: the
#   relays send different bytes: lz4 or none).
# - The relay's resident memory (largest sample) and its slot's confirmed
#   lag (pg_current_wal_lsn() - confirmed_flush_lsn: the WAL the server keeps
#   for it; p50 and max), sampled each second (scripts/lib/bench_cdc.py).
#
# Settings (env): BENCH_CDC_RELAYS ("poll wal debezium"), BENCH_CDC_ROWS
# (200000), BENCH_CDC_RATES ("2000 4000 6000 8000 10000 12000 15000"),
# BENCH_CDC_SECONDS (40), BENCH_CDC_BATCH (10), BENCH_CDC_CLIENTS (4: pgbench's
# connections), BENCH_CDC_DRAIN_WAIT (60), BENCH_CDC_WARMUP (1: the poll relay
# drains a backlog to a topic of its own first, not recorded, so the brokers'
# JIT has compiled their hot paths before the first relay is measured; 0 for
# none), BENCH_PROFILE (release; debug for a check that the benchmark runs,
# as CI does: a debug build's figures are not the relays'). QUICK=1: 20,000
# rows, rates "2000 5000", 20 s each. The relays' own settings pass through
# (RELAY_LINGER_MS, DEBEZIUM_POLL_INTERVAL_MS, ...): the summary names them.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [ "${QUICK:-0}" = 1 ]; then
  ROWS=${BENCH_CDC_ROWS:-20000} RATES=${BENCH_CDC_RATES:-2000 5000} SECONDS_=${BENCH_CDC_SECONDS:-20}
else
  ROWS=${BENCH_CDC_ROWS:-200000} RATES=${BENCH_CDC_RATES:-2000 4000 6000 8000 10000 12000 15000}
  SECONDS_=${BENCH_CDC_SECONDS:-40}
fi
RELAYS=${BENCH_CDC_RELAYS:-poll wal debezium}
BATCH=${BENCH_CDC_BATCH:-10}
CLIENTS=${BENCH_CDC_CLIENTS:-4}
DRAIN_WAIT=${BENCH_CDC_DRAIN_WAIT:-60}
WARMUP=${BENCH_CDC_WARMUP:-1}

log() { printf 'bench-cdc: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }
whole() { [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 must be a whole number above 0, not '$2'"; }
whole BENCH_CDC_ROWS "$ROWS"
whole BENCH_CDC_SECONDS "$SECONDS_"
whole BENCH_CDC_BATCH "$BATCH"
whole BENCH_CDC_CLIENTS "$CLIENTS"
whole BENCH_CDC_DRAIN_WAIT "$DRAIN_WAIT"
[ "$SECONDS_" -ge 20 ] || die "BENCH_CDC_SECONDS must be at least 20 (its first and last 10 s judge the backlog)"
prev=0
for rate in $RATES; do
  whole "a rate of BENCH_CDC_RATES" "$rate"
  [ "$rate" -gt "$prev" ] || die "BENCH_CDC_RATES must ascend: $RATES"
  [ $((rate % BATCH)) = 0 ] || die "each rate must be a multiple of BENCH_CDC_BATCH ($BATCH): $rate"
  prev=$rate
done
for relay in $RELAYS; do
  case $relay in poll | wal | debezium) ;; *) die "BENCH_CDC_RELAYS: '$relay' is none of poll, wal, debezium" ;; esac
done
[ "${STACK_PG:-single}" != ha ] || die "the Patroni cluster (STACK_PG=ha) is not for this: Debezium's slot does not follow a failover"

RUN=$(date +%Y%m%d-%H%M%S)
OUT=$ROOT/bench/results
STACK_DIR=${STACK_DIR:-$ROOT/.stack}
mkdir -p "$OUT"
scripts/stack.sh up >/dev/null
scripts/stack.sh clean
. "$STACK_DIR/env"
LOGS=$STACK_DIR/bench-cdc-$RUN
mkdir -p "$LOGS"
RAW=$LOGS/raw.jsonl
# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"
q() { psql "$1" -qAt -v ON_ERROR_STOP=1 -c "$2"; }
[ "$(q "$STACK_ADMIN_DATABASE_URL" 'SHOW track_commit_timestamp')" = on ] ||
  die "PostgreSQL runs without track_commit_timestamp (started by an older scripts/stack.sh): scripts/stack.sh down; scripts/stack.sh up"
command -v pgbench >/dev/null || die "pgbench not found (it comes with PostgreSQL's server packages: scripts/stack.sh installs them)"
PROFILE=${BENCH_PROFILE:-release}
case $PROFILE in release) flags=(--release) ;; debug) flags=() ;; *) die "BENCH_PROFILE must be release or debug, not '$PROFILE'" ;; esac
log "building ($PROFILE)"
pipeline_build "$PROFILE"
cargo build -q "${flags[@]}" -p payments --example receipts
RECEIPTS=${CARGO_TARGET_DIR:-$ROOT/target}/$PROFILE/examples/receipts
export STACK_KAFKA_TOOL=$BIN/kafka-tool RUST_LOG=warn
DB=bench_cdc
RELAY_PORT=19301
now() { date +%s.%N; }
record() { printf '%s\n' "$1" >>"$RAW"; }

# The relays' own settings this run was given (RELAY_LINGER_MS=50,
# DEBEZIUM_POLL_INTERVAL_MS=10, ...; no address, file or password), for the summary.
record "$(python3 -c 'import json, os, re; print(json.dumps({"what": "settings", "env": {k: v for k, v in sorted(os.environ.items()) if re.match(r"(RELAY|DEBEZIUM)_", k) and not re.search(r"URL|CONFIG|PASSWORD|SECRET|ADDR|DIR|FILE", k)}}))')"
RELAY_PID="" CONSUMER_PID="" SAMPLER_PID=""
stop_pid() { [ -z "$1" ] || { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }; }
cleanup() {
  stop_pid "$SAMPLER_PID"; stop_pid "$CONSUMER_PID"
  if [ -n "$RELAY_PID" ]; then stop_pid "$RELAY_PID"; fi
  scripts/debezium.sh down >/dev/null 2>&1 || true
}
trap cleanup EXIT

# relay_start KIND LOGDIR: starts the relay KIND on $KAFKA_TOPIC; sets RELAY_PID.
relay_start() {
  case $1 in
    poll | wal)
      DATABASE_URL=$RELAY_DATABASE_URL KAFKA_CLIENT_CONFIG=${RELAY_KAFKA_CLIENT_CONFIG:-} RELAY_MODE=$1 \
        RELAY_METRICS_ADDR=127.0.0.1:$RELAY_PORT "$BIN/relay" >>"$2/relay.log" 2>&1 &
      RELAY_PID=$!
      wait_http "http://127.0.0.1:$RELAY_PORT/metrics" relay "$RELAY_PID" "$2" ;;
    debezium)
      DEBEZIUM_DATABASE=$DB DEBEZIUM_TOPIC=$KAFKA_TOPIC scripts/debezium.sh up >>"$2/relay.log" 2>&1 ||
        { log "Debezium did not start; see $2/relay.log and $STACK_DIR/debezium/"; exit 1; }
      RELAY_PID=$(cat "$STACK_DIR/debezium/pid") ;;
  esac
}
relay_stop() {
  case $1 in
    poll | wal) stop_pid "$RELAY_PID" ;;
    debezium) scripts/debezium.sh down >>"$2/relay.log" 2>&1 ;;
  esac
  RELAY_PID=""
}
slot_of() {
  case $1 in poll) echo "" ;; wal) echo "effectively_outbox_$DB" ;; debezium) echo "debezium_$DB" ;; esac
}

# backlog N: N orders and their outbox rows committed as the load commits
# them ($BATCH a transaction, $CLIENTS connections), as fast as pgbench can.
backlog() {
  local per=$(($1 / BATCH / CLIENTS))
  [ "$((per * BATCH * CLIENTS))" = "$1" ] || die "BENCH_CDC_ROWS ($1) must be a multiple of BENCH_CDC_BATCH × BENCH_CDC_CLIENTS ($((BATCH * CLIENTS)))"
  pgbench -n -f bench/cdc-orders.pgbench.sql -D batch="$BATCH" -t "$per" -c "$CLIENTS" -j 2 "$DATABASE_URL" >>"$LOGS/backlog-pgbench.txt" 2>&1 ||
    die "pgbench failed filling the backlog; see $LOGS/backlog-pgbench.txt"
}
received() { [ -f "$1" ] && wc -l <"$1" || echo 0; }
# wait_received FILE N SECONDS: until FILE has N lines, at most SECONDS; prints the wait's seconds.
wait_received() {
  local t0 deadline
  t0=$(now) deadline=$(python3 -c "print($(now) + $3)")
  while [ "$(received "$1")" -lt "$2" ]; do
    kill -0 "$CONSUMER_PID" 2>/dev/null || { log "the receipts consumer exited, see $LOGS"; return 1; }
    python3 -c "import sys; sys.exit(0 if $(now) < $deadline else 1)" || return 1
    sleep 0.2
  done
  python3 -c "print(round($(now) - $t0, 2))"
}

# --- the brokers warmed, not recorded -------------------------------------------
if [ "$WARMUP" = 1 ]; then
  log "warm-up (not recorded): the poll relay drains $ROWS rows"
  pipeline_fresh $DB "cdc-warmup.$RUN" 2>/dev/null
  mkdir -p "$LOGS/warmup"
  backlog "$ROWS"
  CONSUMER_PID=""
  relay_start poll "$LOGS/warmup"
  "$RECEIPTS" "$KAFKA_TOPIC" "$LOGS/warmup/receipts.tsv" >"$LOGS/warmup/receipts.json" 2>"$LOGS/warmup/receipts.log" &
  CONSUMER_PID=$!
  wait_received "$LOGS/warmup/receipts.tsv" "$ROWS" 300 >/dev/null || log "warm-up: not every row received in 300 s (going on)"
  stop_pid "$CONSUMER_PID"; CONSUMER_PID=""
  relay_stop poll "$LOGS/warmup"
fi

# --- each relay -------------------------------------------------------------------
for relay in $RELAYS; do
  dir=$LOGS/$relay
  mkdir -p "$dir"
  log "$relay: a fresh database and topic"
  pipeline_fresh $DB "cdc-$relay.$RUN" 2>/dev/null
  slot=$(slot_of "$relay")
  # Its slot first (made at its first start), so the backlog is in it.
  case $relay in
    wal) relay_start wal "$dir"; relay_stop wal "$dir" ;;
    debezium)
      DEBEZIUM_DATABASE=$DB DEBEZIUM_TOPIC=$KAFKA_TOPIC scripts/debezium.sh reset >>"$dir/relay.log" 2>&1
      relay_start debezium "$dir"; relay_stop debezium "$dir" ;;
  esac
  log "$relay: a backlog of $ROWS rows committed while it is down"
  backlog "$ROWS"
  q "$DATABASE_URL" "VACUUM ANALYZE orders.outbox, orders.orders"
  "$RECEIPTS" "$KAFKA_TOPIC" "$dir/receipts.tsv" >"$dir/receipts.json" 2>"$dir/receipts.log" &
  CONSUMER_PID=$!
  python3 scripts/lib/cpu.py snap "$STACK_ADMIN_DATABASE_URL" $DB >"$dir/drain-cpu-a.json"
  t0=$(now)
  relay_start "$relay" "$dir"
  python3 scripts/lib/bench_cdc.py sample "$RELAY_PID" "$STACK_ADMIN_DATABASE_URL" "$slot" >"$dir/samples.jsonl" &
  SAMPLER_PID=$!
  if ! wait_received "$dir/receipts.tsv" "$ROWS" 600 >/dev/null; then
    log "$relay: the backlog was not drained in 600 s ($(received "$dir/receipts.tsv") of $ROWS received); see $dir"
    exit 1
  fi
  t1=$(now)
  python3 scripts/lib/cpu.py snap "$STACK_ADMIN_DATABASE_URL" $DB >"$dir/drain-cpu-b.json"
  cpu=$(python3 scripts/lib/cpu.py diff "$dir/drain-cpu-a.json" "$dir/drain-cpu-b.json" "$(python3 -c "print($t1 - $t0)")")
  figures=$(python3 scripts/lib/bench_cdc.py drain "$DATABASE_URL" "$dir/receipts.tsv" "$t0")
  record "{\"what\": \"drain\", \"relay\": \"$relay\", \"rows\": $ROWS, \"started\": $t0, \"done\": $t1, \"drain\": $figures, \"cpu\": $cpu}"
  log "$relay: backlog received after $(python3 -c "print(round($t1 - $t0, 1))") s from its start"

  for rate in $RATES; do
    log "$relay: $rate rows/s for $SECONDS_ s ($((rate / BATCH)) transactions/s of $BATCH)"
    ( sleep 5; python3 scripts/lib/cpu.py snap "$STACK_ADMIN_DATABASE_URL" $DB >"$dir/$rate-cpu-a.json"
      sleep $((SECONDS_ - 10)); python3 scripts/lib/cpu.py snap "$STACK_ADMIN_DATABASE_URL" $DB >"$dir/$rate-cpu-b.json" ) &
    cpu_pid=$!
    p0=$(now)
    pgbench -n -f bench/cdc-orders.pgbench.sql -D batch="$BATCH" -R $((rate / BATCH)) -T "$SECONDS_" \
      -c "$CLIENTS" -j 2 "$DATABASE_URL" >"$dir/$rate-pgbench.txt" 2>&1 ||
      { log "$relay: pgbench failed at $rate rows/s; see $dir/$rate-pgbench.txt"; exit 1; }
    p1=$(now)
    wait "$cpu_pid"
    cpu=$(python3 scripts/lib/cpu.py diff "$dir/$rate-cpu-a.json" "$dir/$rate-cpu-b.json" $((SECONDS_ - 10)))
    total=$(q "$DATABASE_URL" "SELECT count(*) FROM orders.orders")
    if wait=$(wait_received "$dir/receipts.tsv" "$total" "$DRAIN_WAIT"); then drained=true
    else drained=false wait=null; fi
    kill -0 "$RELAY_PID" 2>/dev/null || { log "$relay exited during the load; see $dir/relay.log"; exit 1; }
    latency=null verdict="not drained in $DRAIN_WAIT s"
    if $drained; then
      latency=$(python3 scripts/lib/bench_cdc.py judge "$DATABASE_URL" "$dir/receipts.tsv" "$p0" "$p1" "$rate" "$SECONDS_")
      verdict=$(printf '%s' "$latency" | python3 -c 'import json, sys; print(json.load(sys.stdin)["why"])')
    fi
    record "{\"what\": \"point\", \"relay\": \"$relay\", \"rate\": $rate, \"seconds\": $SECONDS_, \"started\": $p0, \"ended\": $p1, \"drained\": $drained, \"drain_wait_s\": $wait, \"latency\": $latency, \"cpu\": $cpu}"
    log "$relay: $rate rows/s: $verdict"
    # The ladder stops at the first rate not sustained.
    [ "$verdict" = sustained ] || break
  done
  stop_pid "$SAMPLER_PID"; SAMPLER_PID=""
  relay_stop "$relay" "$dir"
  stop_pid "$CONSUMER_PID"; CONSUMER_PID=""
done

RESULT=$OUT/cdc-$RUN
python3 scripts/lib/bench_cdc.py summary "$LOGS" "$RESULT"
if py=$(scripts/tools.sh venv 2>/dev/null); then
  "$py" scripts/lib/bench_cdc.py plot "$RESULT" || log "the plots failed (the results stand)"
else
  log "no plotting venv (scripts/tools.sh venv failed): no plots"
fi
# The run's own files beside its summary, packed: the raw measurements, each
# relay's samples, pgbench's reports and CPU snapshots' differences (the
# receipts and the logs stay in $LOGS).
cp "$RAW" "$RESULT/raw.jsonl"
for relay in $RELAYS; do
  mkdir -p "$RESULT/$relay"
  cp "$LOGS/$relay/samples.jsonl" "$LOGS/$relay/"*-pgbench.txt "$RESULT/$relay/" 2>/dev/null || true
done
(cd "$RESULT" && "$ROOT/scripts/lib/pack-raw.sh" . raw.jsonl ./*/samples.jsonl ./*/*-pgbench.txt)
find "$RESULT" -mindepth 1 -type d -empty -delete
log "results: $RESULT (logs and receipts: $LOGS)"
