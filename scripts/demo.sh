#!/usr/bin/env bash
# make demo: the whole pipeline on the embedded stack, then recon's proof.
#
#   orders (HTTP+gRPC) → outbox → relay → Kafka → payments (inbox) → recon
#
# DEMO_TRANSPORT=http (`make demo-webhooks`) crosses the last hop as signed
# webhooks instead: relay --sink http → POST /webhooks/orders → payments
# --source http; no topic is made and no broker is used.
#
# DEMO_RELAY=debezium (`make demo-debezium`) puts Debezium's PostgreSQL
# connector with its Outbox Event Router in the relay's place
# (scripts/debezium.sh: a Kafka Connect worker), payments reading its records
# with --input-format outbox-router, and kills the worker -9 halfway through
# the load, then starts it again: what it sent after its last offset flush
# comes again, and the inbox counts those duplicates. Recon runs with
# --unmarked-outbox (the connector never marks a row published).
#
# A fresh database and a fresh topic per run, so recon's diff covers exactly
# this run. Settings (env): DEMO_RATE (orders/s, 400), DEMO_SECONDS (10),
# DEMO_RETRY_RATE (0.15), DEMO_PROTOCOL (mixed), DEMO_DRAIN_TIMEOUT (60),
# DEMO_PROFILE (release; `debug` reuses the test build, as `make test` does),
# STACK_ENV_FILE (unset: the embedded stack; a file like compose.env: use the
# PostgreSQL and Kafka it names instead, e.g. the compose stack's).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
RATE=${DEMO_RATE:-400}
SECONDS_=${DEMO_SECONDS:-10}
RETRY=${DEMO_RETRY_RATE:-0.15}
PROTOCOL=${DEMO_PROTOCOL:-mixed}
DRAIN=${DEMO_DRAIN_TIMEOUT:-60}
RUN=demo-$(date +%Y%m%d-%H%M%S)
OUT=${STACK_DIR:-$ROOT/.stack}/$RUN
PROFILE=${DEMO_PROFILE:-release}
TRANSPORT=${DEMO_TRANSPORT:-kafka}
case $TRANSPORT in kafka|http) ;; *) echo "DEMO_TRANSPORT must be kafka or http, not $TRANSPORT" >&2; exit 2 ;; esac
RELAY=${DEMO_RELAY:-relay}
case $RELAY in relay|debezium) ;; *) echo "DEMO_RELAY must be relay or debezium, not $RELAY" >&2; exit 2 ;; esac
[ "$RELAY" = debezium ] && [ "$TRANSPORT" = http ] && { echo "DEMO_RELAY=debezium publishes to Kafka; it does not run with DEMO_TRANSPORT=http" >&2; exit 2; }
[ "$RELAY" = debezium ] && [ -n "${STACK_ENV_FILE:-}" ] && { echo "DEMO_RELAY=debezium runs on the embedded stack only (scripts/debezium.sh)" >&2; exit 2; }
# shellcheck source=scripts/lib/pipeline.sh
. "$ROOT/scripts/lib/pipeline.sh"

say() { printf '\n== %s\n' "$*"; }

# On a fresh machine the stack's downloads (PostgreSQL and Java from apt,
# Kafka's jars from Maven Central) run beside the build, and the stack
# creates its topic with the build's kafka-tool instead of building one of
# its own in the debug profile (a second rdkafka build).
if [ -z "${STACK_ENV_FILE:-}" ]; then
  FETCH_LOG=$(mktemp)
  "$ROOT/scripts/stack.sh" fetch >"$FETCH_LOG" 2>&1 &
  FETCH_PID=$!
fi

say "build ($PROFILE)"
pipeline_build "$PROFILE"
if [ -n "${FETCH_PID:-}" ]; then
  wait "$FETCH_PID" || { cat "$FETCH_LOG" >&2; echo "demo: scripts/stack.sh fetch failed" >&2; exit 1; }
  rm -f "$FETCH_LOG"
fi
export STACK_KAFKA_TOOL=$BIN/kafka-tool
pipeline_stack
mkdir -p "$OUT"
if [ "$TRANSPORT" = http ]; then
  pipeline_db demo
  export DATABASE_URL=$DB_URL
else
  pipeline_fresh demo "$RUN"
fi
trap pipeline_stop EXIT
RECON_ARGS=()

if [ "$RELAY" = debezium ]; then
  say "start orders, Debezium (scripts/debezium.sh), payments --input-format outbox-router (logs in $OUT)"
  export DEBEZIUM_DATABASE=demo DEBEZIUM_TOPIC=$KAFKA_TOPIC
  trap '"$ROOT/scripts/debezium.sh" reset || true; pipeline_stop' EXIT
  # A slot and offsets an interrupted demo left go (the slot went with its database).
  "$ROOT/scripts/debezium.sh" reset
  pipeline_orders "$OUT" 127.0.0.1:18080 127.0.0.1:15051
  "$ROOT/scripts/debezium.sh" up
  PAYMENTS_INPUT_FORMAT=outbox-router pipeline_payments "$OUT" 127.0.0.1:19102 "payments-$RUN"
  RECON_ARGS=(--unmarked-outbox)
elif [ "$TRANSPORT" = http ]; then
  say "start orders, payments --source http, relay --sink http (logs in $OUT)"
  pipeline_start_webhooks "$OUT" 127.0.0.1:18080 127.0.0.1:15051 127.0.0.1:19101 127.0.0.1:19102 127.0.0.1:19103
else
  say "start orders, relay, payments (logs in $OUT)"
  pipeline_start "$OUT" 127.0.0.1:18080 127.0.0.1:15051 127.0.0.1:19101 127.0.0.1:19102 "payments-$RUN"
fi

say "load: $RATE orders/s for $SECONDS_ s, ${RETRY} retried 1-3x, protocol $PROTOCOL"
"$BIN/loadgen" --http-url http://127.0.0.1:18080 --grpc-url http://127.0.0.1:15051 \
  --rate "$RATE" --duration "$SECONDS_" --retry-rate "$RETRY" --zipf-s 0 --protocol "$PROTOCOL" \
  --json "$OUT/loadgen.json" --intents "$OUT/intents.txt" &
LOAD_PID=$!
if [ "$RELAY" = debezium ]; then
  sleep "$(awk -v s="$SECONDS_" 'BEGIN { print s / 2 }')"
  say "kill -9 the Kafka Connect worker mid-load, then start it again"
  "$ROOT/scripts/debezium.sh" kill
  "$ROOT/scripts/debezium.sh" up
fi
wait "$LOAD_PID"

say "recon (waits up to $DRAIN s for the pipeline to drain)"
set +e
DATABASE_URL=$RECON_DATABASE_URL "$BIN/recon" --wait-drained "$DRAIN" --intents "$OUT/intents.txt" "${RECON_ARGS[@]}"
status=$?
set -e
echo
echo "inbox hits (duplicates absorbed): $(curl -fs http://127.0.0.1:19102/metrics | awk '/^payments_dedup_hits_total /{print $2}')"
if [ "$TRANSPORT" = http ]; then
  echo "webhook attempts: $(curl -fs http://127.0.0.1:19101/metrics | awk '/^relay_webhook_attempts_total/{printf "%s=%s ", $1, $2}')"
fi
echo "artifacts: $OUT"
exit $status
