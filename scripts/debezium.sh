#!/usr/bin/env bash
# Debezium beside the embedded stack: one Kafka Connect worker on 127.0.0.1
# running Debezium's PostgreSQL connector with its Outbox Event Router on
# orders.outbox, the relay users would otherwise pick. It publishes what the
# project's relays publish (each outbox row once or more, keyed by its
# aggregate), in the router's record shape, which payments reads with
# --input-format outbox-router (docs/book/src/debezium.md).
#
#   scripts/debezium.sh up       resolve it once per machine, write the
#                                configs, start the worker, wait until the
#                                connector's task runs (make debezium)
#   scripts/debezium.sh run      the worker in the foreground (what a
#                                supervisor runs, and kills -9)
#   scripts/debezium.sh status   the connector's state, its slot's lag
#   scripts/debezium.sh kill     kill -9 the worker (its replays follow)
#   scripts/debezium.sh down     stop the worker (SIGTERM; the slot stays)
#   scripts/debezium.sh reset    stop it, drop its slot and its offsets: the
#                                next start streams from that moment
#
# The mode: a standalone worker, its source offsets in a local file flushed
# every DEBEZIUM_OFFSET_FLUSH_MS. That is delivery at least once: a worker
# killed -9 starts again from its last flushed offset (the slot is confirmed
# no further than that), so what it had sent since is sent again, and the
# consumer's inbox makes those duplicates no-ops, as it does for the
# project's own relays. A distributed worker with exactly-once source support
# (KIP-618) would need topics for its configs, offsets and status, a group
# and transactional ids, none of which the relay's principal may touch
# (scripts/lib/kafka-security.sh), to prevent duplicates the inbox absorbs
# anyway; and a consumer would still have to read only committed records.
#
# The connector: pgoutput, its own slot, the stack's publication of the
# outbox's inserts only (effectively_outbox, which the WAL relay reads too;
# the poll relay's marks and the expiry's deletes are not in it), no
# snapshot (rows committed before its slot exists are not published), as the
# relay's PostgreSQL role (REPLICATION) and Kafka principal, over TLS. The
# router: key = aggregate_id, header `id` = msg_id, headers `event_type` and
# `created_at` from their columns, value = the payload column's bytes (the
# event's JSON, as orders wrote it), every event to one topic.
#
# Settings, all optional:
#   DEBEZIUM_DATABASE   the database to stream     (default: the stack's, STACK_DB)
#   DEBEZIUM_TOPIC      the topic it publishes to  (default: order.events.debezium;
#                       created with order.events' partitions and configs)
#   DEBEZIUM_SLOT       its replication slot       (default: debezium_<database>:
#                       a slot's name is the server's, not the database's)
#   DEBEZIUM_PORT       the worker's REST port      (default: 28083)
#   DEBEZIUM_CONNECTOR  the connector's name        (default: effectively-outbox)
#   DEBEZIUM_HEAP       the worker's JVM heap       (default: 512m)
#   DEBEZIUM_POLL_INTERVAL_MS how long the connector waits for more changes
#                       before it hands a batch on when its queue is empty
#                       (poll.interval.ms; default: Debezium's own, 500)
#   DEBEZIUM_OFFSET_FLUSH_MS  how often offsets are flushed and the slot
#                       confirmed (default: 1000; Connect's own is 60000)
#   STACK_DIR, TOOLS_CACHE as for scripts/stack.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STACK_DIR=${STACK_DIR:-$ROOT/.stack}
TOOLS_CACHE=${TOOLS_CACHE:-$HOME/.cache/effectively}
POM=$ROOT/scripts/debezium/pom.xml
VERSION=$(sed -n 's:.*<debezium.version>\(.*\)</debezium.version>.*:\1:p' "$POM")
CACHE=$TOOLS_CACHE/debezium-$VERSION-$(sha256sum "$POM" | cut -c1-12)
DIR=$STACK_DIR/debezium
LOG=$STACK_DIR/log/debezium.log
PORT=${DEBEZIUM_PORT:-28083}
HEAP=${DEBEZIUM_HEAP:-512m}
TOPIC=${DEBEZIUM_TOPIC:-order.events.debezium}
FLUSH_MS=${DEBEZIUM_OFFSET_FLUSH_MS:-1000}
POLL_MS=${DEBEZIUM_POLL_INTERVAL_MS:-500}
CONNECTOR=${DEBEZIUM_CONNECTOR:-effectively-outbox}

log() { printf 'debezium: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
for setting in DEBEZIUM_OFFSET_FLUSH_MS:"$FLUSH_MS" DEBEZIUM_POLL_INTERVAL_MS:"$POLL_MS"; do
  [[ ${setting#*:} =~ ^[1-9][0-9]*$ ]] || die "${setting%%:*} must be a whole number of milliseconds above 0, not '${setting#*:}'"
done
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

stack_env() {
  [ -f "$STACK_DIR/env" ] || die "no stack at $STACK_DIR; run make up first"
  # shellcheck disable=SC1091
  . "$STACK_DIR/env"
  [ -n "${KAFKA_BOOTSTRAP_SERVERS:-}" ] || die "the stack runs without Kafka (STACK_KAFKA=0)"
  [ -f "$STACK_DIR/pg-mode" ] && [ "$(cat "$STACK_DIR/pg-mode")" = ha ] &&
    die "the stack's PostgreSQL is the Patroni cluster (STACK_PG=ha): a logical slot does not follow a failover there, so Debezium runs on the single node only"
  # postgres://role@host:port/db
  local rest=${RELAY_DATABASE_URL#*@}
  PG_HOST=${rest%%:*}
  rest=${rest#*:}
  PG_PORT=${rest%%/*}
  DATABASE=${DEBEZIUM_DATABASE:-${rest#*/}}
  SLOT=${DEBEZIUM_SLOT:-debezium_$(tr -c 'a-z0-9_\n' _ <<<"${DATABASE,,}")}
}

pid_of() {
  local pid
  pid=$(cat "$DIR/pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q ConnectStandalone "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}

# migrated: the outbox, its publication and the relay role's REPLICATION are
# there (the migrations make them: orders --migrate-only, as the owner).
migrated() {
  local got
  got=$(psql "${STACK_ADMIN_DATABASE_URL%/*}/$DATABASE" -qAt -c "SELECT to_regclass('orders.outbox') IS NOT NULL,
      EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'effectively_outbox'),
      (SELECT rolreplication FROM pg_roles WHERE rolname = 'effectively_relay')" 2>&1) ||
    die "cannot read database $DATABASE: $got"
  case $got in
    't|t|t') ;;
    f*) die "database $DATABASE has no orders.outbox: migrate it first (DATABASE_URL=… orders --migrate-only; make demo does)" ;;
    't|f|'*) die "database $DATABASE has no publication effectively_outbox: its migrations are older than the WAL relay's" ;;
    *) die "the role effectively_relay lacks REPLICATION: migrate as a superuser, or ALTER ROLE effectively_relay REPLICATION" ;;
  esac
}

# slot_kept: the slot is there, or no offsets of a stream from it are. A
# slot gone with offsets left (its database dropped and made again, or the
# slot dropped by hand) means the events since its last confirmed position
# are in no slot: the connector would fail on the offsets, and starting
# afresh would skip them, so that is the user's call (`reset`).
slot_kept() {
  local there
  there=$(psql "$STACK_ADMIN_DATABASE_URL" -qAt -c "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '$SLOT'") ||
    die "cannot read pg_replication_slots"
  [ "$there" = 1 ] || [ ! -s "$DIR/offsets-$SLOT" ] ||
    die "slot $SLOT is gone but the offsets of its stream are left: what was committed since its last confirmed position is in no slot. scripts/debezium.sh reset starts a new stream from now (publish what it skips another way, e.g. relay --mode poll)"
}

# resolve: Kafka Connect's jars into CACHE/libs, the connector's plugin
# archive unpacked into CACHE/plugins, once per machine (and again when the
# pom changes: its hash is in the path).
resolve() {
  [ -d "$CACHE/plugins/debezium-connector-postgres" ] && [ -d "$CACHE/libs" ] && return
  command -v java >/dev/null && command -v mvn >/dev/null || die "java and mvn are needed (scripts/stack.sh up installs them)"
  local tmp=$CACHE.tmp.$$
  log "resolving Kafka Connect and Debezium $VERSION from Maven Central once for this machine (~60 MB)"
  rm -rf "$tmp" && mkdir -p "$tmp/libs" "$tmp/plugins"
  mkdir -p "$TOOLS_CACHE"
  mvn -B -q -f "$POM" org.apache.maven.plugins:maven-dependency-plugin:3.8.1:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$tmp/libs" >"$TOOLS_CACHE/debezium-resolve.log" 2>&1 ||
    { rm -rf "$tmp"; die "mvn could not resolve it, see $TOOLS_CACHE/debezium-resolve.log"; }
  local archive
  archive=$(ls "$tmp"/libs/debezium-connector-postgres-*-plugin.tar.gz) || { rm -rf "$tmp"; die "no plugin archive among what mvn resolved"; }
  tar -xzf "$archive" -C "$tmp/plugins" || { rm -rf "$tmp"; die "could not unpack $archive"; }
  rm -f "$archive"
  [ -d "$tmp/plugins/debezium-connector-postgres" ] || { rm -rf "$tmp"; die "the plugin archive holds no debezium-connector-postgres/"; }
  rm -rf "$CACHE" && mv "$tmp" "$CACHE"
}

write_private() { (umask 077; cat >"$1.tmp") && mv "$1.tmp" "$1"; }

# configs: the worker's and the connector's properties, and the secrets
# they name (FileConfigProvider: the passwords are not in either file).
configs() {
  (umask 077; mkdir -p "$DIR")
  chmod 0700 "$DIR"
  local secrets=$STACK_DIR/secrets security=${STACK_SECURITY:-tls}
  [ -r "$secrets/effectively_relay.password" ] || die "no password for effectively_relay in $secrets (scripts/stack.sh up makes it)"
  {
    echo "pg.password=$(cat "$secrets/effectively_relay.password")"
    [ "$security" = plaintext ] || echo "kafka.jaas=org.apache.kafka.common.security.scram.ScramLoginModule required username=\"relay\" password=\"$(cat "$secrets/kafka-relay.password")\";"
  } | write_private "$DIR/secrets.properties"

  local kafka_client
  if [ "$security" = plaintext ]; then
    kafka_client="security.protocol=PLAINTEXT"
  else
    kafka_client="security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=\${file:$DIR/secrets.properties:kafka.jaas}
ssl.truststore.type=PEM
ssl.truststore.location=$PGSSLROOTCERT"
  fi
  {
    cat <<EOF
# Written by scripts/debezium.sh: the standalone Kafka Connect worker.
bootstrap.servers=$KAFKA_BOOTSTRAP_SERVERS
listeners=http://127.0.0.1:$PORT
plugin.path=$CACHE/plugins
offset.storage.file.filename=$DIR/offsets-$SLOT
offset.flush.interval.ms=$FLUSH_MS
key.converter=org.apache.kafka.connect.storage.StringConverter
value.converter=org.apache.kafka.connect.converters.ByteArrayConverter
header.converter=org.apache.kafka.connect.storage.SimpleHeaderConverter
plugin.discovery=service_load
config.providers=file
config.providers.file.class=org.apache.kafka.common.config.provider.FileConfigProvider
# The topic exists (this script makes it as order.events is made).
topic.creation.enable=false
# The worker's own clients, and its source tasks' producer: the relay's principal.
$kafka_client
EOF
    printf '%s\n' "$kafka_client" | sed 's/^/producer./'
    cat <<EOF
# What the project's relays require of a send: every in-sync replica, no
# duplicate from the producer's own retries.
producer.acks=all
producer.enable.idempotence=true
EOF
  } | write_private "$DIR/worker.properties"

  local ssl="database.sslmode=verify-full
database.sslrootcert=$PGSSLROOTCERT"
  [ "$security" = plaintext ] && ssl="database.sslmode=disable"
  cat <<EOF | write_private "$DIR/connector.properties"
# Written by scripts/debezium.sh: Debezium's PostgreSQL connector, the outbox's inserts only.
name=$CONNECTOR
connector.class=io.debezium.connector.postgresql.PostgresConnector
tasks.max=1
database.hostname=$PG_HOST
database.port=$PG_PORT
database.user=effectively_relay
database.password=\${file:$DIR/secrets.properties:pg.password}
database.dbname=$DATABASE
$ssl
topic.prefix=effectively
plugin.name=pgoutput
slot.name=$SLOT
publication.name=effectively_outbox
publication.autocreate.mode=disabled
snapshot.mode=no_data
poll.interval.ms=$POLL_MS
table.include.list=orders.outbox
tombstones.on.delete=false
# No __debezium.context.* headers on each record: the router's own are what a consumer reads.
extended.headers.enabled=false
# The Outbox Event Router: one record per inserted row.
transforms=outbox
transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
transforms.outbox.table.field.event.id=msg_id
transforms.outbox.table.field.event.key=aggregate_id
transforms.outbox.table.field.event.payload=payload
transforms.outbox.table.fields.additional.placement=event_type:header:event_type,created_at:header:created_at
transforms.outbox.route.by.field=event_type
transforms.outbox.route.topic.replacement=$TOPIC
EOF
}

# topic: TOPIC with order.events' partitions and configs (kafka-tool's
# defaults: every node a replica, min.insync.replicas the brokers').
topic() {
  local tool dir=${CARGO_TARGET_DIR:-$ROOT/target}
  case $dir in /*) ;; *) dir=$ROOT/$dir ;; esac
  tool=${STACK_KAFKA_TOOL:-$dir/debug/kafka-tool}
  if [ ! -x "$tool" ]; then
    (cd "$ROOT" && cargo build -q -p pipeline --features kafka --bin kafka-tool) >&2 || die "building kafka-tool failed"
  fi
  local partitions
  partitions=$("$ROOT/scripts/kafka.sh" topics --describe --topic "${KAFKA_TOPIC:-order.events}" 2>/dev/null |
    sed -n 's/.*PartitionCount: *\([0-9]*\).*/\1/p' | head -1)
  "$tool" create --topic "$TOPIC" --partitions "${partitions:-6}" >&2 || die "could not create topic $TOPIC"
}

# JAVA_CMD: the worker's command line.
java_cmd() {
  JAVA_CMD=(java -Xms"$HEAP" -Xmx"$HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20
    -Dlog4j2.configurationFile="$ROOT/scripts/debezium/log4j2.properties" -Djava.awt.headless=true
    -cp "$CACHE/libs/*" org.apache.kafka.connect.cli.ConnectStandalone "$DIR/worker.properties" "$DIR/connector.properties")
}

# prepare: what a start needs, checked and made (both `up` and `run`).
prepare() {
  migrated
  slot_kept
  resolve
  configs
  topic
  java_cmd
}

# started PID: the worker's pid, and what it streams where.
started() {
  echo "$1" >"$DIR/pid"
  echo "$DATABASE -> $TOPIC" >"$DIR/streams"
}

state() { curl -fs "http://127.0.0.1:$PORT/connectors/$CONNECTOR/status" 2>/dev/null; }

# wait_running PID: until the connector and its task report RUNNING (90 s).
wait_running() {
  local s
  for _ in $(seq 1 900); do
    kill -0 "$1" 2>/dev/null || die "the worker exited at start; see $LOG"
    s=$(state || true)
    if [ -n "$s" ] && python3 -c 'import json,sys; s=json.load(sys.stdin); ok=s["connector"]["state"]=="RUNNING" and s["tasks"] and all(t["state"]=="RUNNING" for t in s["tasks"]); sys.exit(0 if ok else 1)' <<<"$s" 2>/dev/null; then
      return 0
    fi
    if [ -n "$s" ] && grep -q '"FAILED"' <<<"$s"; then
      die "the connector failed: $(python3 -c 'import json,sys; s=json.load(sys.stdin); print(next((t.get("trace","") for t in s["tasks"] if t["state"]=="FAILED"), s["connector"].get("trace","")).splitlines()[0])' <<<"$s" 2>/dev/null); see $LOG"
    fi
    sleep 0.1
  done
  die "the connector was not running within 90 s; see $LOG"
}

up() {
  local pid
  stack_env
  if pid=$(pid_of); then
    local was
    was=$(cat "$DIR/streams" 2>/dev/null || true)
    [ "$was" = "$DATABASE -> $TOPIC" ] || die "a worker already runs (pid $pid) for ${was:-another database}; scripts/debezium.sh down first"
    log "already running (pid $pid) on 127.0.0.1:$PORT, $was"
    return
  fi
  prepare
  mkdir -p "$(dirname "$LOG")"
  nohup "${JAVA_CMD[@]}" >>"$LOG" 2>&1 </dev/null &
  pid=$!
  started "$pid"
  log "started the worker (pid $pid), REST on 127.0.0.1:$PORT, streaming $DATABASE to $TOPIC"
  # A worker whose connector does not come up is not left running.
  trap 'kill "$pid" 2>/dev/null || true; rm -f "$DIR/pid"' EXIT
  wait_running "$pid"
  trap - EXIT
  log "the connector runs (slot $SLOT)"
}

run() {
  stack_env
  pid_of >/dev/null && die "a worker already runs (pid $(pid_of)); scripts/debezium.sh down first"
  prepare
  started $$
  exec "${JAVA_CMD[@]}"
}

down() {
  local pid
  pid=$(pid_of) || { rm -f "$DIR/pid"; log "not running"; return 0; }
  kill "$pid"
  for _ in $(seq 1 200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then log "still running after 20 s: kill -9"; kill -9 "$pid"; fi
  rm -f "$DIR/pid"
  log "stopped (pid $pid)"
}

case ${1:-} in
  up) up ;;
  run) run ;;
  down) down ;;
  kill)
    pid=$(pid_of) || die "not running"
    kill -9 "$pid"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
    log "killed -9 (pid $pid)" ;;
  status)
    stack_env
    if pid=$(pid_of); then echo "worker: pid $pid, 127.0.0.1:$PORT"; state && echo || echo "connector: no answer"
    else echo "worker: not running"; fi
    psql "$STACK_ADMIN_DATABASE_URL" -qAt -c "SELECT 'slot ' || slot_name || ': ' || CASE WHEN active THEN 'active' ELSE 'inactive' END
        || ', ' || pg_size_pretty(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)) || ' behind'
      FROM pg_replication_slots WHERE slot_name = '$SLOT' AND database = '$DATABASE'" ;;
  reset)
    stack_env
    down
    psql "$STACK_ADMIN_DATABASE_URL" -qAt -c "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots WHERE slot_name = '$SLOT' AND database = '$DATABASE'" >/dev/null
    rm -f "$DIR/offsets-$SLOT"
    log "slot $SLOT and the offsets dropped" ;;
  -h|--help|help) usage ;;
  *) usage >&2; exit 2 ;;
esac
