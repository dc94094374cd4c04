# shellcheck shell=bash
# Run one pipeline on a stack: build the binaries, make a fresh database and
# topic, start orders, relay and payments, stop them. Sourced by demo.sh and
# check-dashboards.sh (and meant for the experiments); expects ROOT to be the
# repository root and the stack's env (STACK_ADMIN_DATABASE_URL, ...) loaded.
#
# Least privilege: the migrations run as the owner (DB_URL, DATABASE_URL);
# each service runs as its own role, its DATABASE_URL taken from
# ORDERS_DATABASE_URL, RELAY_DATABASE_URL, PAYMENTS_DATABASE_URL and
# RECON_DATABASE_URL, which pipeline_db points at the same database.

PIPELINE_PIDS=()

# pipeline_build PROFILE: builds every binary in PROFILE (release|debug), from
# any working directory; sets BIN (under CARGO_TARGET_DIR when set).
pipeline_build() {
  local flags=()
  [ "$1" = release ] && flags=(--release)
  cargo build -q --manifest-path "$ROOT/Cargo.toml" "${flags[@]}" \
    -p orders -p relay -p payments -p recon -p loadgen -p chaos -p pipeline
  BIN=${CARGO_TARGET_DIR:-$ROOT/target}/$1
}

# pipeline_stack: loads the settings of the stack to run on: the file
# STACK_ENV_FILE names (e.g. compose.env; a relative path is relative to the
# repository root), else the embedded stack's .stack/env, started if needed.
# Uses the caller's `say`.
pipeline_stack() {
  if [ -n "${STACK_ENV_FILE:-}" ]; then
    say "stack: $STACK_ENV_FILE"
    # shellcheck disable=SC1090
    case $STACK_ENV_FILE in /*) . "$STACK_ENV_FILE" ;; *) . "$ROOT/$STACK_ENV_FILE" ;; esac
  else
    say "stack up"
    "$ROOT/scripts/stack.sh" up >/dev/null
    . "${STACK_DIR:-$ROOT/.stack}/env"
  fi
}

# pipeline_db DB [BIN_DIR]: (re)creates database DB and migrates it as the
# owner, with BIN_DIR's orders (default $BIN: another build's, for its own
# schema); sets DB_URL to it as the owner (the caller decides whether that
# becomes DATABASE_URL) and exports the four services' URLs (pipeline_roles)
# for it.
pipeline_db() {
  pipeline_drop_db "$1"
  PGOPTIONS=--client-min-messages=warning psql "$STACK_ADMIN_DATABASE_URL" -qAt -v ON_ERROR_STOP=1 \
    -c "CREATE DATABASE $1" >/dev/null
  DB_URL=${STACK_ADMIN_DATABASE_URL%/*}/$1
  DATABASE_URL=$DB_URL "${2:-$BIN}/orders" --migrate-only 2>/dev/null
  pipeline_roles "$1"
}

# pipeline_drop_db DB: drops database DB (a run's, once its numbers are read),
# and first the replication slots in it: a WAL relay's (relay --mode wal)
# would keep the database from being dropped.
pipeline_drop_db() {
  PGOPTIONS=--client-min-messages=warning psql "$STACK_ADMIN_DATABASE_URL" -qAt \
    -c "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots WHERE database = '$1'" \
    -c "DROP DATABASE IF EXISTS $1 WITH (FORCE)" >/dev/null
}

# pipeline_roles DB: points ORDERS_, RELAY_, PAYMENTS_ and RECON_DATABASE_URL
# (each service's role, from the stack's env) at database DB and exports them.
pipeline_roles() {
  local var url
  for var in ORDERS_DATABASE_URL RELAY_DATABASE_URL PAYMENTS_DATABASE_URL RECON_DATABASE_URL; do
    url=${!var:-}
    if [ -z "$url" ]; then
      echo "$var is not set: the stack's env predates the service roles (scripts/stack.sh up rewrites it)" >&2
      return 1
    fi
    export "$var=${url%/*}/$1"
  done
}

# pipeline_drop_topics: deletes the topics earlier runs left on the stack
# (order.events.RUN, bench.raw.RUN; not order.events itself, nor the tests'
# test-<uuid>), as pipeline_db drops an earlier run's database. Left there,
# every run's 6 partitions stay on every node, and a node killed -9 loads them
# all before it serves again: 245 partition logs took 36 s to load
# (`Loaded 245 logs in 36150ms` in its log) and made experiment 8's broker
# faults take 90 s each instead of 30. So one run at a time per stack: a run
# started beside another deletes the other's topic.
pipeline_drop_topics() {
  "$ROOT/scripts/kafka.sh" topics --delete --if-exists --topic '(order\.events|bench\.raw)\..+' >/dev/null ||
    echo "pipeline: deleting earlier runs' topics failed; they stay (a broker killed -9 recovers them all)" >&2
}

# pipeline_fresh DB RUN [BIN_DIR]: a fresh database DB (pipeline_db, migrated
# by BIN_DIR's orders) and topic order.events.RUN; exports DATABASE_URL (the
# owner's, for a script's own queries), the services' URLs and KAFKA_TOPIC
# for what follows. So a recon of this run covers exactly this run.
pipeline_fresh() {
  pipeline_db "$1" "${3:-$BIN}"
  export DATABASE_URL=$DB_URL
  pipeline_drop_topics
  export KAFKA_TOPIC=order.events.$2
  "$BIN/kafka-tool" create --topic "$KAFKA_TOPIC" --partitions "${PIPELINE_PARTITIONS:-6}"
}

# pipeline_outbox_rows_sql N: an INSERT of N outbox rows (N an SQL
# expression: 1000, or pgbench's :rows) as orders writes them, on one line: a
# fresh aggregate per row, a JSON order.created, and a msg_id that is a
# UUIDv7 minted now (48 bits of Unix milliseconds, the version, random bits,
# the variant, random bits), as orders mints them: payments' inbox takes only
# msg_ids inside its partitions' window, and the outbox's expiry reads a
# msg_id's mint time (a random v4 would look years old or ahead).
pipeline_outbox_rows_sql() {
  local v7="(lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::int8), 12, '0') || '7'
     || substr(md5(random()::text), 1, 3) || '8' || substr(md5(random()::text), 1, 15))::uuid"
  printf '%s\n' "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload)
  SELECT id, $v7, 'order.created',
         convert_to(json_build_object('order_id', id, 'account_id', i % 100000 + 1,
                    'amount_cents', i % 100000 + 1, 'status', 'created')::text, 'UTF8')
  FROM (SELECT gen_random_uuid() AS id, i FROM generate_series(1, $1) i) s;" | tr '\n' ' '
  echo
}

# pipeline_wait_sql SECONDS SQL: until SQL, run on $DATABASE_URL, prints t
# (polled every 0.1 s); fails with the query after SECONDS.
pipeline_wait_sql() {
  for _ in $(seq 1 $(($1 * 10))); do
    [ "$(psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "$2")" = t ] && return 0
    sleep 0.1
  done
  echo "timed out waiting for: $2" >&2
  return 1
}

# pipeline_metric PORT NAME: the value of the unlabelled series NAME at
# 127.0.0.1:PORT/metrics as an integer (0 when absent or not served yet).
pipeline_metric() {
  # 0 while the service does not answer yet (a caller polling right after
  # the start, under pipefail, would otherwise stop on curl's exit status).
  { curl -fs "http://127.0.0.1:$1/metrics" 2>/dev/null || true; } | awk -v m="$2" '$1==m{v=int($2)} END{print v+0}'
}

# wait_http URLS NAME PID LOGDIR: up to 30 s for a 200 from one of URLS
# (space-separated), failing at once if PID died.
wait_http() {
  local url
  for _ in $(seq 1 300); do
    for url in $1; do curl -fs -o /dev/null "$url" && return 0; done
    kill -0 "$3" 2>/dev/null || { echo "$2 exited at start; see $4/$2.log" >&2; return 1; }
    sleep 0.1
  done
  echo "$2 did not answer $1 within 30 s; see $4/$2.log" >&2
  return 1
}

# orders_metrics_addr HTTP: where pipeline_orders serves orders' metrics for
# the HTTP address HTTP (127.0.0.1:PORT): ORDERS_METRICS_ADDR when set, else
# the next port (PORT+1). The metrics are off the public port.
orders_metrics_addr() {
  local port=${1##*:}
  echo "${ORDERS_METRICS_ADDR:-127.0.0.1:$((port + 1))}"
}

# pipeline_orders LOGDIR HTTP GRPC [ARGS...]: starts orders alone, as its own
# role, on those 127.0.0.1 addresses (with ARGS, e.g. --no-idempotency), its
# metrics on orders_metrics_addr HTTP, and waits until it serves /metrics.
# pipeline_stop stops it.
pipeline_orders() {
  local logs=$1 http=$2 grpc=$3 metrics
  metrics=$(orders_metrics_addr "$2")
  shift 3
  export RUST_LOG=${RUST_LOG:-warn}
  DATABASE_URL=$ORDERS_DATABASE_URL ORDERS_HTTP_ADDR=$http ORDERS_GRPC_ADDR=$grpc \
    ORDERS_METRICS_ADDR=$metrics "$BIN/orders" "$@" >"$logs/orders.log" 2>&1 &
  PIPELINE_PIDS+=($!)
  # An older build (BENCH_BASE_BIN) serves its metrics on the HTTP port.
  wait_http "http://$metrics/metrics http://$http/metrics" orders $! "$logs"
}

# pipeline_start LOGDIR HTTP GRPC RELAY_METRICS PAYMENTS_METRICS GROUP: starts the
# three services, each as its own role, on those 127.0.0.1 addresses
# (consumer group GROUP) and waits until each serves /metrics. pipeline_stop
# stops them.
pipeline_start() {
  local logs=$1
  pipeline_orders "$logs" "$2" "$3"
  DATABASE_URL=$RELAY_DATABASE_URL KAFKA_CLIENT_CONFIG=${RELAY_KAFKA_CLIENT_CONFIG:-} RELAY_METRICS_ADDR=$4 "$BIN/relay" >"$logs/relay.log" 2>&1 &
  PIPELINE_PIDS+=($!)
  wait_http "http://$4/metrics" relay $! "$logs"
  pipeline_payments "$logs" "$5" "$6"
}

# pipeline_start_webhooks LOGDIR HTTP GRPC RELAY_METRICS PAYMENTS_METRICS
# WEBHOOK_ADDR: the pipeline over HTTP instead of Kafka: orders, and
# pipeline_webhooks with one fresh secret. pipeline_stop stops them.
pipeline_start_webhooks() {
  pipeline_orders "$1" "$2" "$3"
  pipeline_webhooks "$1" "$4" "$5" "$6" "whsec_$(head -c 32 /dev/urandom | base64)"
}

# pipeline_webhooks LOGDIR RELAY_METRICS PAYMENTS_METRICS WEBHOOK_ADDR SECRET:
# payments receiving signed webhooks on WEBHOOK_ADDR (`--source http`) and the
# relay delivering the outbox to it (`--sink http`, destination `payments`),
# both with SECRET, each as its own role; waits until each serves /metrics.
# RELAY_WEBHOOK_SCHEDULE_SCALE and the services' other variables pass
# through. pipeline_stop stops them.
pipeline_webhooks() {
  local logs=$1
  export RUST_LOG=${RUST_LOG:-warn}
  DATABASE_URL=$PAYMENTS_DATABASE_URL PAYMENTS_METRICS_ADDR=$3 PAYMENTS_SOURCE=http \
    PAYMENTS_WEBHOOK_ADDR=$4 PAYMENTS_WEBHOOK_SECRET=$5 \
    "$BIN/payments" >"$logs/payments.log" 2>&1 &
  PIPELINE_PIDS+=($!)
  wait_http "http://$3/metrics" payments $! "$logs"
  DATABASE_URL=$RELAY_DATABASE_URL RELAY_METRICS_ADDR=$2 RELAY_SINK=http \
    RELAY_WEBHOOK_DESTINATIONS="payments=http://$4/webhooks/orders,secret=$5,allow-http" \
    RELAY_WEBHOOK_ALLOW_ADDRESSES=${4%:*} \
    "$BIN/relay" >"$logs/relay.log" 2>&1 &
  PIPELINE_PIDS+=($!)
  wait_http "http://$2/metrics" relay $! "$logs"
}

# pipeline_payments LOGDIR METRICS GROUP: starts payments alone, as its own
# role, in consumer group GROUP of KAFKA_TOPIC, metrics on 127.0.0.1 address
# METRICS, and waits until it serves /metrics. pipeline_stop stops it.
pipeline_payments() {
  export RUST_LOG=${RUST_LOG:-warn}
  DATABASE_URL=$PAYMENTS_DATABASE_URL KAFKA_CLIENT_CONFIG=${PAYMENTS_KAFKA_CLIENT_CONFIG:-} \
    PAYMENTS_METRICS_ADDR=$2 PAYMENTS_GROUP_ID=$3 \
    "$BIN/payments" >"$1/payments.log" 2>&1 &
  PIPELINE_PIDS+=($!)
  wait_http "http://$2/metrics" payments $! "$1"
}

# pipeline_track PID: stop PID with the services (e.g. a Prometheus).
pipeline_track() { PIPELINE_PIDS+=("$1"); }

pipeline_stop() {
  local pid
  for pid in "${PIPELINE_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PIPELINE_PIDS=()
}
