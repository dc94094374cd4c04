#!/usr/bin/env bash
# make bench-pipeline: relay drain rate and consumer throughput, each next to
# a raw rdkafka producer/consumer on the same broker in the same run, plus
# commit→effect latency at steady offered rates. Results: bench/results/
# pipeline-RUN.json; the last three lines printed are the ratios
# (`relay ratio: …`, `consumer ratio: …`, `consumer vs minimal writes: …`).
#
# 1. The relay drains a backlog of BENCH_ROWS outbox rows (timed from its
#    start to the last row marked); the raw producer (relay/examples/
#    raw_producer.rs) sends as many of the relay's messages (an order.created
#    envelope with its two headers) with the same producer settings
#    (idempotent, acks=all, lz4, linger), to a topic with as many partitions
#    as the relay's, and no database. Before FINDINGS §15 it sent filler
#    bytes (lz4 shrinks them to almost nothing) to a topic the broker made
#    with its default 4 partitions; RAW_PAYLOAD=filler sends filler again.
# 2. Payments reads that topic twice in fresh groups: first every msg_id new,
#    then every msg_id a duplicate; the raw consumer (payments/examples/
#    raw_consumer.rs) reads it once more, doing nothing. Each is timed the
#    same way: from its first message handled to its last (payments by
#    polling payments_consumed_total; the new pass also from the first to the
#    last charge transaction in SQL, exp-2's clock, and per segment of the
#    inbox's growth, to see whether a bigger inbox is slower). Then the
#    yardstick of its work: a minimal consumer (payments/examples/
#    minimal_consumer.rs) writes the same rows per message (inbox claim,
#    charge, ledger entry) in batched transactions with the same commit rule
#    and does nothing else; `consumer vs minimal writes:` is payments' rate
#    over its.
# 3. Commit→effect at each of BENCH_STEADY_RATES new orders/s (15% retried,
#    unique keys), the whole pipeline co-located: per order in SQL from the
#    outbox row's created_at to the charge's, and its first part, to the
#    row's published_at (`publish_*_ms`). Both are now() in their
#    transactions, i.e. each transaction's start: published_at is when the
#    relay's shard transaction began, before its claim, not the broker's ack.
#    Each point also records where the CPU went (`cpu`: cores per process
#    and per PostgreSQL role, and the brokers' JIT's share, scripts/lib/
#    cpu.py; only this benchmark's database counts) in the load's middle, what
#    the services' statements did then (`statements_per_order`, per role:
#    statements, rows, wall time and WAL per new order, from
#    pg_stat_statements, which the stack's PostgreSQL loads; and the
#    statements that took the most time, `cpu.statements_top`), and
#    the relay's batches then (`relay`: count and mean of its histograms
#    relay_batch_size, relay_publish_duration_seconds, i.e. a batch's
#    produce to last ack, and relay_commit_to_publish_seconds, i.e. the
#    outbox row's created_at to its ack).
#
# Settings (env): BENCH_ROWS (1000000), BENCH_STEADY_RATES ("1000 3850"),
# BENCH_STEADY_SECONDS (30), BENCH_WARMUP_SECONDS (300: at most this long a
# warm-up at the first rate before the first point, not recorded, until the
# brokers' JIT compiler threads take less than BENCH_WARMUP_JIT (0.05) cores
# over 30 s; 0 for none),
# BENCH_STEADY_FETCH_WAITS (payments'
# --fetch-wait-max-ms for the steady runs, one run per value and rate, e.g.
# "25 500" for the default next to librdkafka's; default: payments' own),
# BENCH_SHARD_DEPTHS (the relay's --shard-depth for the steady runs, one run
# per value, rate and wait, e.g. "1 2"; a list like "1 2 1 2" repeats
# the runs interleaved; default: the relay's own),
# BENCH_STEADY_ENVS (settings of the services for the steady runs, one run
# per item and rate: items separated by spaces, each a comma-separated list
# of VAR=VALUE, "-" for none; e.g. "RELAY_LINGER_MS=5 RELAY_LINGER_MS=20"),
# BENCH_BASE_BIN (a directory with another build's relay and payments: each
# drain and the new pass run again with them, side by side, e.g. the build
# before a change; when it holds that build's orders too, every steady point
# runs with each build in turn, this one first: the CPU per order of both in
# one run; each steady point's database is migrated by the build that runs
# it, the drains share this build's schema), BENCH_STEADY_BUILDS (which
# builds the steady points run, in order: "new", "base", e.g. "base new";
# default "new base" when BENCH_BASE_BIN has orders, else "new"),
# BENCH_DRAIN_ROUNDS (1: with BENCH_BASE_BIN, the drain of each build this
# many times, the order alternating: new then base, base then new, ...; the
# summary takes each build's median; the first drain warms the brokers'
# JIT, which favours whichever build drains second),
# BENCH_EXTRA_PARTITIONS (0: N partitions more on the cluster during steps
# 1 and 2, in topics of 6 nobody uses, as runs before `scripts/stack.sh
# clean` left them: what they cost the drain and the raw producer; the
# next run's clean deletes them),
# BENCH_SKIP_STEADY=1,
# BENCH_SKIP_THROUGHPUT=1 (steps 3 only).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ROWS=${BENCH_ROWS:-1000000}
STEADY_RATES=${BENCH_STEADY_RATES:-1000 3850}
STEADY_SECONDS=${BENCH_STEADY_SECONDS:-30}
DRAIN_ROUNDS=${BENCH_DRAIN_ROUNDS:-1}
[[ $DRAIN_ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "bench: BENCH_DRAIN_ROUNDS must be a whole number of rounds, at least 1" >&2; exit 2; }
EXTRA_PARTITIONS=${BENCH_EXTRA_PARTITIONS:-0}
[[ $EXTRA_PARTITIONS =~ ^[0-9]+$ ]] || { echo "bench: BENCH_EXTRA_PARTITIONS must be a whole number of partitions" >&2; exit 2; }
WARMUP_SECONDS=${BENCH_WARMUP_SECONDS:-300}
WARMUP_JIT=${BENCH_WARMUP_JIT:-0.05}
[[ $WARMUP_SECONDS =~ ^[0-9]+$ ]] || { echo "bench: BENCH_WARMUP_SECONDS must be a whole number of seconds" >&2; exit 2; }
[[ $WARMUP_JIT =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "bench: BENCH_WARMUP_JIT must be a number of cores, e.g. 0.05" >&2; exit 2; }
STEADY_FETCH_WAITS=${BENCH_STEADY_FETCH_WAITS:-${PAYMENTS_FETCH_WAIT_MAX_MS:-default}}
SHARD_DEPTHS=${BENCH_SHARD_DEPTHS:-${RELAY_SHARD_DEPTH:-default}}
STEADY_ENVS=${BENCH_STEADY_ENVS:--}
for item in $STEADY_ENVS; do
  [ "$item" = - ] && continue
  IFS=, read -ra sets <<<"$item"
  for set in "${sets[@]}"; do
    [[ $set =~ ^[A-Z][A-Z0-9_]*=[^=]*$ ]] || { echo "bench: BENCH_STEADY_ENVS: '$set' is not VAR=VALUE" >&2; exit 2; }
  done
done
BASE_BIN=${BENCH_BASE_BIN:-}
if [ -n "$BASE_BIN" ] && [ -x "$BASE_BIN/orders" ]; then STEADY_BUILDS=${BENCH_STEADY_BUILDS:-new base}
else STEADY_BUILDS=${BENCH_STEADY_BUILDS:-new}; fi
RUN=$(date +%Y%m%d-%H%M%S)
OUT=$ROOT/bench/results
mkdir -p "$OUT" "$ROOT/.stack/bench-$RUN"
LOGS=$ROOT/.stack/bench-$RUN
RAW=$LOGS/raw.jsonl # one JSON object per measurement; the summary reads it

log() { printf 'bench: %s\n' "$*" >&2; }
[ "$STEADY_SECONDS" -ge 15 ] || { log "BENCH_STEADY_SECONDS must be at least 15"; exit 2; }
now() { date +%s.%N; }
record() { printf '%s\n' "$1" >>"$RAW"; }

scripts/stack.sh up >/dev/null
# What tests and earlier runs left: hundreds of topics made the brokers 2.6x
# as expensive per message (FINDINGS §15).
scripts/stack.sh clean
. .stack/env
# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"
log "building (release)"
pipeline_build release
cargo build -q --release -p relay --example raw_producer
cargo build -q --release -p payments --example raw_consumer --example minimal_consumer
if [ -n "$BASE_BIN" ]; then
  for b in relay payments; do [ -x "$BASE_BIN/$b" ] || { log "BENCH_BASE_BIN=$BASE_BIN has no $b"; exit 2; }; done
fi

q() { psql "$1" -qAt -v ON_ERROR_STOP=1 -c "$2"; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; pipeline_stop; }
trap cleanup EXIT
export RUST_LOG=warn

if [ "${BENCH_SKIP_THROUGHPUT:-0}" != 1 ]; then
# --- 1. relay drain from a backlog --------------------------------------------
pipeline_fresh bench_pipeline "relay.$RUN" 2>/dev/null
URL=$DATABASE_URL TOPIC=$KAFKA_TOPIC
if [ "$EXTRA_PARTITIONS" -gt 0 ]; then
  log "$EXTRA_PARTITIONS partitions more on the cluster (BENCH_EXTRA_PARTITIONS), in topics bench.leftover.$RUN.*"
  for i in $(seq 1 $(((EXTRA_PARTITIONS + 5) / 6))); do
    "$BIN/kafka-tool" create --topic "bench.leftover.$RUN.$i" --partitions 6 2>/dev/null
  done
  record "{\"what\": \"extra_partitions\", \"partitions\": $(((EXTRA_PARTITIONS + 5) / 6 * 6))}"
fi
log "filling the outbox with $ROWS rows"
q "$URL" "$(pipeline_outbox_rows_sql "$ROWS")"
q "$URL" "VACUUM ANALYZE orders.outbox"
BYTES=$(q "$URL" "SELECT round(avg(length(payload)))::int + 160 FROM orders.outbox") # + the envelope

# The drain is watched on the relay's relay_published_total, not by counting
# the pending rows: over a 1M-row backlog that count costs PostgreSQL about a
# second, and taken 4 times a second it took a fifth of the drain's rate
# (FINDINGS §15). One count at the end checks that nothing is left.
drain() { # NAME BIN TOPIC ROUND → records relay_drain
  local name=$1 bin=$2 topic=$3 round=$4 t0 t1 pid port=19201 left
  log "relay ($name) draining $ROWS rows to $topic"
  t0=$(now)
  DATABASE_URL=$RELAY_DATABASE_URL KAFKA_CLIENT_CONFIG=${RELAY_KAFKA_CLIENT_CONFIG:-} KAFKA_TOPIC=$topic RELAY_METRICS_ADDR=127.0.0.1:$port "$bin/relay" >"$LOGS/relay-$name.log" 2>&1 &
  pid=$!
  PIDS+=("$pid")
  while [ "$(pipeline_metric "$port" relay_published_total)" -lt "$ROWS" ]; do
    kill -0 "$pid" 2>/dev/null || { log "relay ($name) exited, see $LOGS/relay-$name.log"; exit 1; }
    sleep 0.1
  done
  t1=$(now)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  left=$(q "$URL" "SELECT count(*) FROM orders.outbox WHERE published_at IS NULL")
  [ "$left" = 0 ] || { log "relay ($name) counted $ROWS published but $left rows are pending"; exit 1; }
  record "{\"what\": \"relay_drain\", \"build\": \"$name\", \"round\": $round, \"rows\": $ROWS, \"seconds\": $(python3 -c "print(round($t1-$t0, 3))")}"
  log "relay ($name): $(python3 -c "print(round($ROWS/($t1-$t0)))") rows/s"
}
# The first drain goes to $TOPIC, which the consumer passes read; every
# later one to a topic of its own, after the rows are made pending again.
# Round r drains new then base when r is odd, base then new when even.
drains=new
if [ -n "$BASE_BIN" ]; then
  drains=
  for round in $(seq 1 "$DRAIN_ROUNDS"); do
    if [ $((round % 2)) = 1 ]; then drains+=" new base"; else drains+=" base new"; fi
  done
fi
n=0
for build in $drains; do
  n=$((n + 1))
  if [ "$n" = 1 ]; then drain new "$BIN" "$TOPIC" 1; continue; fi
  q "$URL" "UPDATE orders.outbox SET published_at = NULL" >/dev/null
  q "$URL" "VACUUM ANALYZE orders.outbox" >/dev/null
  "$BIN/kafka-tool" create --topic "$TOPIC.$build.$n" --partitions 6 2>/dev/null
  bin=$BIN; [ "$build" = base ] && bin=$BASE_BIN
  drain "$build" "$bin" "$TOPIC.$build.$n" "$(( (n + 1) / 2 ))"
done

log "raw producer: $ROWS messages (${RAW_PAYLOAD:-envelope}; filler: $BYTES bytes)"
"$BIN/kafka-tool" create --topic "bench.raw.$RUN" --partitions "${PIPELINE_PARTITIONS:-6}" 2>/dev/null
RAW_P=$(KAFKA_BOOTSTRAP_SERVERS=$KAFKA_BOOTSTRAP_SERVERS "$ROOT/target/release/examples/raw_producer" "bench.raw.$RUN" "$ROWS" "$BYTES")
record "{\"what\": \"raw_producer\", \"result\": $RAW_P}"
log "raw producer: $RAW_P"

# --- 2. consumer throughput ------------------------------------------------------
consume_pass() { # NAME BIN GROUP PORT DB → records consume
  local name=$1 bin=$2 group=$3 port=$4 db=$5 pid start="" n0=0 n=0 t
  DATABASE_URL=${PAYMENTS_DATABASE_URL%/*}/$db KAFKA_CLIENT_CONFIG=${PAYMENTS_KAFKA_CLIENT_CONFIG:-} KAFKA_TOPIC=$TOPIC PAYMENTS_GROUP_ID=$group PAYMENTS_METRICS_ADDR=127.0.0.1:$port \
    "$bin/payments" >"$LOGS/payments-$name.log" 2>&1 &
  pid=$!
  PIDS+=("$pid")
  while :; do
    n=$(pipeline_metric "$port" payments_consumed_total)
    t=$(now)
    if [ -z "$start" ] && [ "$n" -gt 0 ]; then start=$t; n0=$n; fi
    [ "$n" -ge "$ROWS" ] && break
    kill -0 "$pid" 2>/dev/null || { log "payments ($name) exited, see $LOGS/payments-$name.log"; exit 1; }
    sleep 0.1
  done
  # Consumed is not yet applied: wait for the last transaction.
  local m=payments_dedup_misses_total
  [ "$name" = dup ] && m=payments_dedup_hits_total
  while [ "$(pipeline_metric "$port" $m)" -lt "$ROWS" ]; do sleep 0.05; done
  t=$(now)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  record "{\"what\": \"consume\", \"pass\": \"$name\", \"messages\": $((ROWS - n0)), \"seconds\": $(python3 -c "print(round($t-$start, 3))")}"
  log "payments ($name): $(python3 -c "print(round(($ROWS-$n0)/($t-$start)))") msgs/s"
}
# The new pass's clock in SQL: first to last charge transaction, and per
# tenth of the charges (is the 10th tenth, with the inbox 9x bigger, slower?).
charge_clock() { # NAME DB
  local db_url=${STACK_ADMIN_DATABASE_URL%/*}/$2
  record "$(q "$db_url" "WITH c AS (SELECT created_at, ntile(10) OVER (ORDER BY created_at) AS tenth FROM payments.charges),
      t AS (SELECT tenth, count(*) AS n, min(created_at) AS t0, max(created_at) AS t1 FROM c GROUP BY tenth)
    SELECT json_build_object('what', 'charge_clock', 'pass', '$1', 'charges', (SELECT count(*) FROM c),
      'seconds', EXTRACT(EPOCH FROM (SELECT max(created_at) - min(created_at) FROM c)),
      'tenths', (SELECT json_agg(json_build_object('tenth', tenth, 'n', n,
                   'seconds', EXTRACT(EPOCH FROM t1 - t0)) ORDER BY tenth) FROM t))")"
}
log "payments: first pass (every msg_id new)"
consume_pass new "$BIN" "payments-bench-new-$RUN" 19202 bench_pipeline
charge_clock new bench_pipeline
log "payments: second pass, fresh group (every msg_id a duplicate)"
consume_pass dup "$BIN" "payments-bench-dup-$RUN" 19203 bench_pipeline
if [ -n "$BASE_BIN" ]; then
  log "payments (base build): first pass into a fresh database"
  # Migrated by the base build when it has its orders: its payments writes
  # its own schema (the inbox moved between builds, FINDINGS §26).
  if [ -x "$BASE_BIN/orders" ]; then pipeline_db bench_pipeline_base "$BASE_BIN" >/dev/null
  else pipeline_db bench_pipeline_base >/dev/null; fi
  consume_pass base "$BASE_BIN" "payments-bench-base-$RUN" 19204 bench_pipeline_base
  charge_clock base bench_pipeline_base
  pipeline_drop_db bench_pipeline_base
  pipeline_roles bench_pipeline
fi
log "raw consumer on the same topic"
RAW_C=$(KAFKA_BOOTSTRAP_SERVERS=$KAFKA_BOOTSTRAP_SERVERS "$ROOT/target/release/examples/raw_consumer" "$TOPIC" "$ROWS")
record "{\"what\": \"raw_consumer\", \"result\": $RAW_C}"
log "raw consumer: $RAW_C"

# The yardstick of payments' work: the same rows per message (inbox claim,
# charge, ledger entry) in batched transactions, offsets committed after
# them, and nothing else (payments/examples/minimal_consumer.rs). It starts
# as payments' new pass did: the inbox, charges and ledger empty (its
# partitions, which payments made, kept).
log "minimal consumer (payments' writes and nothing else) on the same topic"
q "${STACK_ADMIN_DATABASE_URL%/*}/bench_pipeline" "TRUNCATE payments.charges, payments.ledger, fx.partitioned_inbox" >/dev/null
MIN_C=$(DATABASE_URL=${PAYMENTS_DATABASE_URL%/*}/bench_pipeline KAFKA_CLIENT_CONFIG=${PAYMENTS_KAFKA_CLIENT_CONFIG:-} \
  "${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/minimal_consumer" "$TOPIC" "$ROWS")
record "{\"what\": \"minimal_consumer\", \"result\": $MIN_C}"
log "minimal consumer: $MIN_C"

fi

# --- 3. commit→effect at steady offered rates -------------------------------------
if [ "${BENCH_SKIP_STEADY:-0}" != 1 ]; then
  # A warm-up first, not recorded: the brokers' JIT compiles their hot paths
  # under the first load after they start. On freshly started nodes the
  # kafka cores of the first two points at 1,000 orders/s were 1.33 and 1.30,
  # of the next two 0.70 and 0.65, and a fixed 90 s warm-up still left the
  # JIT 0.31 cores in the first point (FINDINGS §15). So the pipeline runs at
  # the first rate, 30 s at a time, until the JIT takes less than
  # BENCH_WARMUP_JIT cores over a span, at most BENCH_WARMUP_SECONDS. Each
  # point's new topic, group and services still make the JIT compile some
  # more (0.22 cores in the first point after such a warm-up): its
  # `kafka_jit_cores` says how much.
  if [ "$WARMUP_SECONDS" -gt 0 ]; then
    warm_rate=${STEADY_RATES%% *} warmed=0
    log "warm-up (not recorded): $warm_rate new orders/s, 30 s at a time, until the brokers' JIT takes < $WARMUP_JIT cores (at most $WARMUP_SECONDS s)"
    pipeline_fresh bench_steady "steady.warmup.$RUN" 2>/dev/null
    mkdir -p "$LOGS/steady-warmup"
    pipeline_start "$LOGS/steady-warmup" 127.0.0.1:18180 127.0.0.1:15151 127.0.0.1:19181 127.0.0.1:19182 "payments-steady-warmup-$RUN"
    while [ "$warmed" -lt "$WARMUP_SECONDS" ]; do
      python3 scripts/lib/cpu.py snap >"$LOGS/steady-warmup-cpu-a.json"
      "$BIN/loadgen" --http-url http://127.0.0.1:18180 --grpc-url http://127.0.0.1:15151 --rate "$warm_rate" \
        --duration 30 --retry-rate 0.15 --zipf-s 0 --progress off >/dev/null ||
        log "warm-up: loadgen exited $? (the warm-up goes on)"
      python3 scripts/lib/cpu.py snap >"$LOGS/steady-warmup-cpu-b.json"
      warmed=$((warmed + 30))
      jit=$(python3 scripts/lib/cpu.py diff "$LOGS/steady-warmup-cpu-a.json" "$LOGS/steady-warmup-cpu-b.json" 30 |
        python3 -c 'import json, sys; print(json.load(sys.stdin).get("kafka_jit_cores", 0))')
      log "warm-up: ${warmed} s; the brokers' JIT took $jit cores over the last 30 s"
      python3 -c "import sys; sys.exit(0 if $jit < $WARMUP_JIT else 1)" && break
    done
    pipeline_stop
  fi
  for depth in $SHARD_DEPTHS; do
  for wait_ms in $STEADY_FETCH_WAITS; do
    for rate in $STEADY_RATES; do
    for envs in $STEADY_ENVS; do
    for build in $STEADY_BUILDS; do
      case $build in
        new) steady_bin=$BIN ;;
        base) [ -n "$BASE_BIN" ] && [ -x "$BASE_BIN/orders" ] \
                || { log "BENCH_STEADY_BUILDS names base: BENCH_BASE_BIN must hold orders, relay and payments"; exit 2; }
              steady_bin=$BASE_BIN ;;
        *) log "BENCH_STEADY_BUILDS: '$build' is neither new nor base"; exit 2 ;;
      esac
      name=$rate
      [ "$build" = new ] || name=$rate-$build
      [ "$envs" = - ] || name=$name-$(printf '%s' "$envs" | tr -c 'A-Za-z0-9_.\n-' '_')
      if [ "$wait_ms" = default ]; then unset PAYMENTS_FETCH_WAIT_MAX_MS
      else export PAYMENTS_FETCH_WAIT_MAX_MS=$wait_ms; name=$rate-wait$wait_ms; fi
      if [ "$depth" = default ]; then unset RELAY_SHARD_DEPTH
      else export RELAY_SHARD_DEPTH=$depth; name=$name-depth$depth; fi
      point=$((${point:-0} + 1)) # a value repeated in a list is a run of its own
      name=$name-$point
      # The build measured migrates the point's database itself: its
      # statements were written for its own schema (an index moved is a
      # change of the build too).
      pipeline_fresh bench_steady "steady.$name.$RUN" "$steady_bin" 2>/dev/null
      URL=$DATABASE_URL
      mkdir -p "$LOGS/steady-$name"
      # The services of the build measured, with the point's settings;
      # loadgen stays this build's, recon is the measured build's (it reads
      # that build's schema: the inbox moved between builds).
      new_bin=$BIN BIN=$steady_bin
      saved=() unsets=() sets=()
      [ "$envs" = - ] || IFS=, read -ra sets <<<"$envs"
      for set in "${sets[@]}"; do
        var=${set%%=*}
        if [ -n "${!var+x}" ]; then saved+=("$var=${!var}"); else unsets+=("$var"); fi
        export "${set?}"
      done
      pipeline_start "$LOGS/steady-$name" 127.0.0.1:18180 127.0.0.1:15151 127.0.0.1:19181 127.0.0.1:19182 "payments-steady-$name-$RUN"
      [ ${#unsets[@]} -eq 0 ] || unset "${unsets[@]}"
      [ ${#saved[@]} -eq 0 ] || export "${saved[@]}"
      BIN=$new_bin
      sleep 5 # the consumer group's first assignment, so it is not in the latency
      log "steady load ($build build, settings: $envs): $rate new orders/s (15% retried, unique keys) for $STEADY_SECONDS s, payments' fetch wait: $wait_ms, relay's shard depth: $depth"
      # Where the CPU goes under the load: its middle, 5 s in to 5 s before the end.
      # And the relay's batches over the same span: how many, their rows and
      # their produce-to-last-ack time (its histograms, scripts/lib/histo_delta.py).
      ( sleep 5; python3 scripts/lib/cpu.py snap "$STACK_ADMIN_DATABASE_URL" bench_steady >"$LOGS/steady-$name-cpu-a.json"
        curl -fs http://127.0.0.1:19181/metrics >"$LOGS/steady-$name-relay-a.txt" || true
        sleep $((STEADY_SECONDS - 10)); python3 scripts/lib/cpu.py snap "$STACK_ADMIN_DATABASE_URL" bench_steady >"$LOGS/steady-$name-cpu-b.json"
        curl -fs http://127.0.0.1:19181/metrics >"$LOGS/steady-$name-relay-b.txt" || true ) &
      cpu_pid=$!
      "$BIN/loadgen" --http-url http://127.0.0.1:18180 --grpc-url http://127.0.0.1:15151 --rate "$rate" \
        --duration "$STEADY_SECONDS" --retry-rate 0.15 --zipf-s 0 --json "$LOGS/steady-$name-loadgen.json" >/dev/null
      wait "$cpu_pid"
      cpu=$(python3 scripts/lib/cpu.py diff "$LOGS/steady-$name-cpu-a.json" "$LOGS/steady-$name-cpu-b.json" $((STEADY_SECONDS - 10)))
      batches=$(python3 scripts/lib/histo_delta.py "$LOGS/steady-$name-relay-a.txt" "$LOGS/steady-$name-relay-b.txt" \
        relay_batch_size relay_publish_duration_seconds relay_commit_to_publish_seconds)
      DATABASE_URL=$RECON_DATABASE_URL "$steady_bin/recon" --wait-drained 180 >"$LOGS/steady-$name-recon.txt" \
        && clean=true || clean=false
      pipeline_stop
      record "$(q "$URL" "SELECT json_build_object('what', 'steady', 'rate', $rate, 'seconds', $STEADY_SECONDS,
          'build', '$build', 'env', '$envs', 'fetch_wait_ms', '$wait_ms', 'shard_depth', '$depth', 'recon_clean', $clean, 'cpu', '${cpu//\'/\'\'}'::json, 'relay', '$batches'::json, 'effects', count(*),
          'p50_ms', round((percentile_cont(0.50) WITHIN GROUP (ORDER BY ms))::numeric, 1),
          'p99_ms', round((percentile_cont(0.99) WITHIN GROUP (ORDER BY ms))::numeric, 1),
          'max_ms', round(max(ms)::numeric, 1),
          'publish_p50_ms', round((percentile_cont(0.50) WITHIN GROUP (ORDER BY pub_ms))::numeric, 1),
          'publish_p99_ms', round((percentile_cont(0.99) WITHIN GROUP (ORDER BY pub_ms))::numeric, 1))
        FROM (SELECT EXTRACT(EPOCH FROM c.created_at - x.created_at) * 1000 AS ms,
                     EXTRACT(EPOCH FROM x.published_at - x.created_at) * 1000 AS pub_ms
              FROM payments.charges c JOIN orders.outbox x ON x.msg_id = c.msg_id) l")"
      log "commit→effect at $rate/s: $(tail -1 "$RAW")"
    done
    done
    done
  done
  done
fi

RESULT=$OUT/pipeline-$RUN.json
python3 "$ROOT/scripts/lib/bench_pipeline.py" "$RAW" "$RESULT"
