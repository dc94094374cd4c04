#!/usr/bin/env bash
# The embedded stack: a throwaway PostgreSQL on 127.0.0.1, no Docker needed.
#
#   scripts/stack.sh up      start (idempotent), write .stack/env, print it
#   scripts/stack.sh down    stop (idempotent)
#   scripts/stack.sh status  say what runs
#
# Data lives in .stack/ (git-ignored). Settings, all optional:
#   STACK_DIR      where data, logs and the env file go   (default: <repo>/.stack)
#   STACK_PG_PORT  PostgreSQL port on 127.0.0.1           (default: 55432)
#   STACK_DB       the database `make up` creates         (default: effectively)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STACK_DIR=${STACK_DIR:-$ROOT/.stack}
PG_PORT=${STACK_PG_PORT:-55432}
DB=${STACK_DB:-effectively}
PGDATA=$STACK_DIR/pg
SOCK=$STACK_DIR/sock
LOGS=$STACK_DIR/log
ENV_FILE=$STACK_DIR/env

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
  if pg_running; then
    log "postgres already running on 127.0.0.1:$PG_PORT"
  else
    # A kill -9 leaves postmaster.pid behind; pg_ctl said nothing runs, so it is stale.
    rm -f "$PGDATA/postmaster.pid"
    log "starting postgres on 127.0.0.1:$PG_PORT"
    as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$LOGS/postgres.log" -w -t 60 -o \
      "-c port=$PG_PORT -c listen_addresses=127.0.0.1 -c unix_socket_directories=$SOCK \
       -c max_connections=400 -c shared_buffers=512MB -c max_wal_size=4GB \
       -c checkpoint_timeout=15min -c log_min_messages=warning" start >/dev/null \
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

write_env() {
  cat >"$ENV_FILE" <<ENV
# Written by scripts/stack.sh; source it (. $ENV_FILE) or let the Makefile include it.
export DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/$DB
export STACK_ADMIN_DATABASE_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres
ENV
  cat "$ENV_FILE"
}

case "${1:-}" in
  up) pg_up; write_env ;;
  down) pg_down ;;
  status) if find_pg_bin && pg_running; then echo "postgres: running on 127.0.0.1:$PG_PORT"; else echo "postgres: stopped"; fi ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
