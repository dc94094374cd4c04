#!/usr/bin/env bash
# The embedded stack: a throwaway PostgreSQL and a Kafka-protocol broker
# (nisshi, see ../shared/KAFKA.md) on 127.0.0.1, no Docker needed.
#
#   scripts/stack.sh up      start (idempotent), write .stack/env, print it
#   scripts/stack.sh down    stop (idempotent)
#   scripts/stack.sh status  say what runs
#   scripts/stack.sh crash postgres|broker [DOWN_MS]
#                            crash one the hard way (pg_ctl -m immediate,
#                            kill -9), keep it down DOWN_MS (2000), start it
#                            again: chaos --fault pg-crash|broker-kill
#
# Data lives in .stack/ (git-ignored). Settings, all optional:
#   STACK_DIR      where data, logs and the env file go   (default: <repo>/.stack)
#   STACK_PG_PORT  PostgreSQL port on 127.0.0.1           (default: 25432)
#   STACK_DB       the database `make up` creates         (default: effectively)
#   STACK_KAFKA_PORT  broker port on 127.0.0.1            (default: 29092)
#   STACK_KAFKA    0 to run without the broker            (default: 1)
#   KAFKA_TOPIC, KAFKA_TOPIC_PARTITIONS  the topic `up` creates (order.events, 6)
#   TOOLS_CACHE    machine-wide cache of built tools      (default: ~/.cache/effectively)
# The default ports lie below Linux's ephemeral range (32768-60999): under
# load, a client's own connection could otherwise hold the port in TIME-WAIT
# and keep the broker from binding it again after a restart.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STACK_DIR=${STACK_DIR:-$ROOT/.stack}
PG_PORT=${STACK_PG_PORT:-25432}
DB=${STACK_DB:-effectively}
PGDATA=$STACK_DIR/pg
SOCK=$STACK_DIR/sock
LOGS=$STACK_DIR/log
ENV_FILE=$STACK_DIR/env
KAFKA_PORT=${STACK_KAFKA_PORT:-29092}
WITH_KAFKA=${STACK_KAFKA:-1}
TOPIC=${KAFKA_TOPIC:-order.events}
PARTITIONS=${KAFKA_TOPIC_PARTITIONS:-6}
NISSHI_VERSION=0.8.1
TOOLS_DIR=$ROOT/.tools
TOOLS_CACHE=${TOOLS_CACHE:-$HOME/.cache/effectively}
NISSHI_FEATURES=libsql
NISSHI=$TOOLS_DIR/nisshi-$NISSHI_VERSION-$NISSHI_FEATURES/bin/nisshi
KAFKA_DIR=$STACK_DIR/kafka

log() { printf 'stack: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# PostgreSQL refuses to run as root; run its binaries as the `postgres` user then.
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

find_pg_bin() {
  if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
    PG_BIN=$(dirname "$(command -v pg_ctl)")
    return
  fi
  for d in /usr/lib/postgresql/15/bin /usr/lib/postgresql/*/bin; do
    if [ -x "$d/pg_ctl" ]; then PG_BIN=$d; return; fi
  done
  return 1
}

ensure_postgres_installed() {
  if find_pg_bin; then return; fi
  [ "$(id -u)" = 0 ] || die "PostgreSQL server binaries not found; install postgresql-15"
  log "installing postgresql-15 from apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq postgresql-15 postgresql-client-15 >/dev/null
  find_pg_bin || die "postgresql-15 installed but pg_ctl not found"
}

ensure_pg_user() {
  [ "$(id -u)" = 0 ] || return 0
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin postgres
}

pg_running() {
  [ -f "$PGDATA/postmaster.pid" ] && as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" status >/dev/null 2>&1
}

pg_up() {
  ensure_postgres_installed
  ensure_pg_user
  mkdir -p "$STACK_DIR" "$SOCK" "$LOGS"
  if [ ! -f "$PGDATA/PG_VERSION" ]; then
    log "initdb $PGDATA"
    mkdir -p "$PGDATA"
    if [ "$(id -u)" = 0 ]; then chown postgres "$PGDATA"; fi
    as_pg "$PG_BIN/initdb" -D "$PGDATA" -U postgres --auth=trust --encoding=UTF8 --locale=C.UTF-8 >"$LOGS/initdb.log" 2>&1 \
      || die "initdb failed, see $LOGS/initdb.log"
  fi
  if [ "$(id -u)" = 0 ]; then chown postgres "$SOCK" "$LOGS"; fi
  # In postgresql.conf, not on the command line, so that ALTER SYSTEM can
  # override it for a while (scripts/wal-slot-lost.sh) and RESET restores it.
  grep -q '^max_slot_wal_keep_size' "$PGDATA/postgresql.conf" \
    || echo "max_slot_wal_keep_size = 2GB  # scripts/stack.sh: the WAL a relay's slot may hold" >>"$PGDATA/postgresql.conf"
  if pg_running; then
    log "postgres already running on 127.0.0.1:$PG_PORT"
    if [ "$(psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -qAt -c 'SHOW wal_level' 2>/dev/null)" != logical ]; then
      log "postgres runs with wal_level other than logical (started by an older stack.sh): relay --mode wal needs it; restart the stack (scripts/stack.sh down; scripts/stack.sh up)"
    fi
  else
    # A kill -9 leaves postmaster.pid behind; pg_ctl said nothing runs, so it is stale.
    rm -f "$PGDATA/postmaster.pid"
    log "starting postgres on 127.0.0.1:$PG_PORT"
    # recovery_init_sync_method=syncfs: after a crash (exp-8's pg-crash) the
    # server syncs its data directory before redo; one fsync per file took
    # 73 s for the ~46,000 files of a CI run's test databases while the disk
    # was busy, past pg_ctl's 60 s; one syncfs() per file system does not
    # grow with the file count.
    # wal_level=logical: the WAL relay (relay --mode wal) streams the outbox
    # from a logical replication slot; max_slot_wal_keep_size bounds the WAL
    # a slot whose relay is down can hold (past it the server invalidates
    # the slot and the relay says what to do: ARCHITECTURE.md §6).
    as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$LOGS/postgres.log" -w -t 60 -o \
      "-c port=$PG_PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$SOCK \
       -c max_connections=400 -c shared_buffers=512MB -c max_wal_size=4GB \
       -c wal_level=logical -c max_replication_slots=64 -c max_wal_senders=64 \
       -c checkpoint_timeout=15min -c recovery_init_sync_method=syncfs -c log_min_messages=warning" start >/dev/null \
      || die "postgres did not start, see $LOGS/postgres.log"
  fi
  local psql=(psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 -qAt)
  if [ "$("${psql[@]}" -d postgres -c "SELECT 1 FROM pg_database WHERE datname = '$DB'")" != 1 ]; then
    "${psql[@]}" -d postgres -c "CREATE DATABASE \"$DB\"" >/dev/null
    log "created database $DB"
  fi
}

pg_down() {
  find_pg_bin || return 0
  if pg_running; then
    as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -m fast -w -t 60 stop >/dev/null
    log "postgres stopped"
  else
    rm -f "$PGDATA/postmaster.pid" 2>/dev/null || true
    log "postgres not running"
  fi
}


# --- the broker ------------------------------------------------------------

# nisshi is built from crates.io once per machine, with only the storage
# engine the stack uses (sqlite, nisshi's `libsql` feature; the default
# features add PostgreSQL, S3 and Iceberg storage the stack never starts):
# into the machine-wide cache, then linked into the git-ignored .tools/ of
# each checkout. A cached binary of the pinned version is never rebuilt.
ensure_nisshi() {
  [ -x "$NISSHI" ] && return
  local cached=$TOOLS_CACHE/nisshi-$NISSHI_VERSION-$NISSHI_FEATURES/bin/nisshi
  if [ ! -x "$cached" ]; then
    log "building nisshi $NISSHI_VERSION ($NISSHI_FEATURES storage only) from crates.io once for this machine (one time; ~13 min on 2 cores)"
    mkdir -p "$TOOLS_CACHE"
    cargo install nisshi --version "$NISSHI_VERSION" --locked --ignore-rust-version \
      --no-default-features --features "$NISSHI_FEATURES" \
      --root "$TOOLS_CACHE/nisshi-$NISSHI_VERSION-$NISSHI_FEATURES" >"$TOOLS_CACHE/nisshi-build.log" 2>&1 \
      || die "cargo install nisshi failed, see $TOOLS_CACHE/nisshi-build.log"
  fi
  mkdir -p "$(dirname "$NISSHI")"
  ln -sf "$cached" "$NISSHI"
}

kafka_pid() {
  local pid
  pid=$(cat "$KAFKA_DIR/nisshi.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q nisshi "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

kafka_up() {
  ensure_nisshi
  mkdir -p "$KAFKA_DIR" "$LOGS"
  if kafka_pid >/dev/null; then
    log "broker already running on 127.0.0.1:$KAFKA_PORT"
  else
    rm -f "$KAFKA_DIR/nisshi.pid" # stale after a kill -9
    port_open "$KAFKA_PORT" && die "port $KAFKA_PORT is taken by another process; set STACK_KAFKA_PORT"
    log "starting nisshi $NISSHI_VERSION on 127.0.0.1:$KAFKA_PORT (sqlite storage)"
    # sqlite:// paths are relative to the working directory (absolute ones fail).
    (cd "$KAFKA_DIR" && exec nohup "$NISSHI" broker \
        --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
        --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
        --group-initial-rebalance-delay 500ms \
        --storage-engine "sqlite://nisshi.db" >>"$LOGS/nisshi.log" 2>&1 </dev/null) &
    local pid=$!
    echo "$pid" >"$KAFKA_DIR/nisshi.pid"
    for _ in $(seq 1 100); do
      port_open "$KAFKA_PORT" && break
      # Liveness only: until the subshell has exec'd, its command line is
      # still bash's, so kafka_pid's name check would misfire here.
      kill -0 "$pid" 2>/dev/null || die "nisshi exited at start, see $LOGS/nisshi.log"
      sleep 0.1
    done
    port_open "$KAFKA_PORT" || die "nisshi did not listen within 10 s, see $LOGS/nisshi.log"
  fi
  # Its own line: a build failure inside $(…) exits only the subshell.
  local tool
  tool=$(kafka_tool_bin) || exit 1
  # A broker restarted on a big store listens before it serves (seen after a
  # kill -9 with a 5.8 GB store: "Unknown broker error"): try for 20 s.
  local tries=0
  until KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:$KAFKA_PORT "$tool" create --topic "$TOPIC" --partitions "$PARTITIONS"; do
    tries=$((tries + 1))
    [ "$tries" -lt 40 ] || die "could not create topic $TOPIC within 20 s"
    sleep 0.5
  done
}

# The project's own Kafka tool (rdkafka), built on first use (debug profile:
# the test build shares it), where cargo puts it (CARGO_TARGET_DIR).
kafka_tool_bin() {
  local dir=${CARGO_TARGET_DIR:-target}
  case $dir in /*) ;; *) dir=$ROOT/$dir ;; esac # cargo runs in ROOT below
  local bin=$dir/debug/kafka-tool
  if [ ! -x "$bin" ] || [ -n "$(find "$ROOT/crates/effectively/src" -newer "$bin" -print -quit)" ]; then
    (cd "$ROOT" && cargo build -q -p effectively --features kafka --bin kafka-tool) >&2 || die "building kafka-tool failed"
  fi
  echo "$bin"
}

kafka_down() {
  local pid
  if pid=$(kafka_pid); then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    log "broker stopped"
  else
    log "broker not running"
  fi
  rm -f "$KAFKA_DIR/nisshi.pid"
}

# DATABASE_URL is the owner's (the superuser's): migrations and the scripts'
# own queries. Each service runs as its own role with the URL of its
# *_DATABASE_URL (migrations/*_roles.sql creates the roles and grants them
# their tables; no password: the server trusts 127.0.0.1).
write_env() {
  local base=127.0.0.1:$PG_PORT/$DB
  cat >"$ENV_FILE" <<ENV
# Written by scripts/stack.sh; source it (. $ENV_FILE) or let the Makefile include it.
# DATABASE_URL: the owner's, for migrations; each service runs with its own *_DATABASE_URL.
export DATABASE_URL=postgres://postgres@$base
export STACK_ADMIN_DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres
export ORDERS_DATABASE_URL=postgres://effectively_orders@$base
export RELAY_DATABASE_URL=postgres://effectively_relay@$base
export PAYMENTS_DATABASE_URL=postgres://effectively_payments@$base
export RECON_DATABASE_URL=postgres://effectively_recon@$base
ENV
  if [ "$WITH_KAFKA" = 1 ] || kafka_pid >/dev/null; then
    cat >>"$ENV_FILE" <<ENV
export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:$KAFKA_PORT
export KAFKA_TOPIC=$TOPIC
ENV
  fi
  cat "$ENV_FILE"
}

# An infrastructure fault for chaos: crash one component the hard way, keep it
# down, start it again the way `up` does. Returns once it serves again.
crash() {
  local what=${1:-} down_ms=${2:-2000}
  [[ $down_ms =~ ^[0-9]+$ ]] || die "DOWN_MS must be a number of milliseconds, got '$down_ms'"
  local down_s
  down_s=$(awk -v ms="$down_ms" 'BEGIN { printf "%.3f", ms / 1000 }')
  case "$what" in
    postgres)
      find_pg_bin && pg_running || die "postgres is not running"
      as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -m immediate -w -t 60 stop >/dev/null
      log "postgres crashed (pg_ctl stop -m immediate); down for ${down_ms} ms"
      sleep "$down_s"
      pg_up ;;
    broker)
      local pid
      pid=$(kafka_pid) || die "the broker is not running"
      kill -9 "$pid"
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
      log "broker killed (kill -9 $pid); down for ${down_ms} ms"
      sleep "$down_s"
      kafka_up ;;
    *) die "crash what? postgres or broker, got '$what'" ;;
  esac
}

case "${1:-}" in
  up) pg_up; if [ "$WITH_KAFKA" = 1 ]; then kafka_up; fi; write_env ;;
  down) kafka_down; pg_down ;;
  status)
    if find_pg_bin && pg_running; then echo "postgres: running on 127.0.0.1:$PG_PORT"; else echo "postgres: stopped"; fi
    if kafka_pid >/dev/null; then echo "broker: running on 127.0.0.1:$KAFKA_PORT"; else echo "broker: stopped"; fi ;;
  crash) shift; crash "$@" ;;
  *) echo "usage: $0 up|down|status|crash postgres|broker [DOWN_MS]" >&2; exit 2 ;;
esac
