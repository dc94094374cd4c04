#!/usr/bin/env bash
# make bench-pipeline: relay drain rate and consumer throughput, each next to
# a raw rdkafka producer/consumer on the same broker in the same run, plus
# commit→effect latency at a steady offered rate. Results: bench/results/.
#
# Settings (env): BENCH_ROWS (outbox backlog, 1000000), BENCH_STEADY_RATE
# (orders/s for the latency run, 1000), BENCH_STEADY_SECONDS (30).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ROWS=${BENCH_ROWS:-1000000}
STEADY_RATE=${BENCH_STEADY_RATE:-1000}
STEADY_SECONDS=${BENCH_STEADY_SECONDS:-30}
RUN=$(date +%Y%m%d-%H%M%S)
OUT=$ROOT/bench/results
mkdir -p "$OUT" "$ROOT/.stack/bench-$RUN"
LOGS=$ROOT/.stack/bench-$RUN
BIN=$ROOT/target/release

log() { printf 'bench: %s\n' "$*" >&2; }
now() { date +%s.%N; }

scripts/stack.sh up >/dev/null
. .stack/env
# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"
log "building (release)"
pipeline_build release
cargo build -q --release -p relay --example raw_producer
cargo build -q --release -p payments --example raw_consumer

q() { psql "$1" -qAt -v ON_ERROR_STOP=1 -c "$2"; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; pipeline_stop; }
trap cleanup EXIT
export RUST_LOG=warn

# --- 1. relay drain from a backlog --------------------------------------------
pipeline_fresh bench_pipeline "relay.$RUN" 2>/dev/null
URL=$DATABASE_URL TOPIC=$KAFKA_TOPIC
log "filling the outbox with $ROWS rows"
q "$URL" "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload)
  SELECT id, gen_random_uuid(), 'order.created',
         convert_to(json_build_object('order_id', id, 'account_id', i % 100000 + 1,
                    'amount_cents', i % 100000 + 1, 'status', 'created')::text, 'UTF8')
  FROM (SELECT gen_random_uuid() AS id, i FROM generate_series(1, $ROWS) i) s"
q "$URL" "VACUUM ANALYZE orders.outbox"
log "relay draining $ROWS rows"
t0=$(now)
DATABASE_URL=$RELAY_DATABASE_URL KAFKA_TOPIC=$TOPIC RELAY_METRICS_ADDR=127.0.0.1:0 "$BIN/relay" >"$LOGS/relay.log" 2>&1 & PIDS+=($!)
RELAY_PID=$!
while [ "$(q "$URL" "SELECT count(*) FROM orders.outbox WHERE published_at IS NULL")" != 0 ]; do sleep 0.5; done
t1=$(now)
kill "$RELAY_PID"; wait "$RELAY_PID" 2>/dev/null || true
RELAY_RATE=$(python3 -c "print(round($ROWS/($t1-$t0)))")
log "relay: $RELAY_RATE rows/s"

log "raw producer: $ROWS messages of 330 bytes"
RAW_P=$(KAFKA_BOOTSTRAP_SERVERS=$KAFKA_BOOTSTRAP_SERVERS "$ROOT/target/release/examples/raw_producer" "bench.raw.$RUN" "$ROWS" 330)
log "raw producer: $RAW_P"

# --- 2. consumer throughput: first pass (all new), second pass (all duplicates) --
consume_pass() { # group → rows/s measured from the first inbox/dedup effect
  local group=$1 metric=$2 port=$3
  DATABASE_URL=$PAYMENTS_DATABASE_URL KAFKA_TOPIC=$TOPIC PAYMENTS_GROUP_ID=$group PAYMENTS_METRICS_ADDR=127.0.0.1:$port \
    "$BIN/payments" >"$LOGS/payments-$group.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  local start="" n=0 t
  while :; do
    n=$(curl -fs "http://127.0.0.1:$port/metrics" 2>/dev/null | awk -v m="$metric" '$1==m{print $2}')
    n=${n:-0}
    t=$(now)
    if [ -z "$start" ] && [ "${n%.*}" -gt 0 ]; then start=$t; n0=${n%.*}; fi
    [ "${n%.*}" -ge "$ROWS" ] && break
    sleep 0.2
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true
  python3 -c "print(round(($ROWS-$n0)/($t-$start)))"
}
log "payments: first pass (every msg_id new)"
CONSUME_NEW=$(consume_pass "bench-new-$RUN" payments_dedup_misses_total 19202)
log "payments new: $CONSUME_NEW msgs/s"
log "payments: second pass, fresh group (every msg_id a duplicate)"
CONSUME_DUP=$(consume_pass "bench-dup-$RUN" payments_dedup_hits_total 19203)
log "payments duplicates: $CONSUME_DUP msgs/s"
log "raw consumer on the same topic"
RAW_C=$(KAFKA_BOOTSTRAP_SERVERS=$KAFKA_BOOTSTRAP_SERVERS "$ROOT/target/release/examples/raw_consumer" "$TOPIC" "$ROWS")
log "raw consumer: $RAW_C"

# --- 3. commit→effect at a steady offered rate ----------------------------------
pipeline_fresh bench_steady "steady.$RUN" 2>/dev/null
URL=$DATABASE_URL
mkdir -p "$LOGS/steady"
pipeline_start "$LOGS/steady" 127.0.0.1:18180 127.0.0.1:15151 127.0.0.1:19181 127.0.0.1:19182 "steady-$RUN"
sleep 5 # the consumer group's first assignment, so it is not in the latency
log "steady load: $STEADY_RATE orders/s for $STEADY_SECONDS s"
"$BIN/loadgen" --http-url http://127.0.0.1:18180 --grpc-url http://127.0.0.1:15151 --rate "$STEADY_RATE" \
  --duration "$STEADY_SECONDS" --retry-rate 0.15 --zipf-s 0 --json "$LOGS/steady-loadgen.json" >/dev/null
DATABASE_URL=$RECON_DATABASE_URL "$BIN/recon" --wait-drained 120 >"$LOGS/steady-recon.txt" || true
LAT=$(q "$URL" "SELECT json_build_object(
    'effects', count(*),
    'p50_ms', round((percentile_cont(0.50) WITHIN GROUP (ORDER BY ms))::numeric, 1),
    'p99_ms', round((percentile_cont(0.99) WITHIN GROUP (ORDER BY ms))::numeric, 1),
    'max_ms', round(max(ms)::numeric, 1))
  FROM (SELECT EXTRACT(EPOCH FROM c.created_at - x.created_at) * 1000 AS ms
        FROM payments.charges c JOIN orders.outbox x ON x.msg_id = c.msg_id) l")
log "commit→effect: $LAT"

RESULT=$OUT/pipeline-$RUN.json
python3 - "$RESULT" <<PY
import json, sys
raw_p = json.loads('''$RAW_P''')
raw_c = json.loads('''$RAW_C''')
lat = json.loads('''$LAT''')
r = {
  "command": "make bench-pipeline",
  "rows": $ROWS,
  "relay_rows_per_sec": $RELAY_RATE,
  "raw_producer_msgs_per_sec": raw_p["msgs_per_sec"],
  "relay_vs_raw_producer": round($RELAY_RATE / raw_p["msgs_per_sec"], 2),
  "consumer_new_msgs_per_sec": $CONSUME_NEW,
  "consumer_duplicate_msgs_per_sec": $CONSUME_DUP,
  "raw_consumer_msgs_per_sec": raw_c["msgs_per_sec"],
  "consumer_vs_raw_consumer": round($CONSUME_NEW / raw_c["msgs_per_sec"], 2),
  "steady_rate": $STEADY_RATE, "steady_seconds": $STEADY_SECONDS,
  "commit_to_effect": lat,
}
json.dump(r, open(sys.argv[1], "w"), indent=2)
print(json.dumps(r, indent=2))
PY
log "written $RESULT"
