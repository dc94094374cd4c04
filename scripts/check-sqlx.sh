#!/usr/bin/env bash
# The SQL of the `sqlx::query!` macros is checked at compile time against the
# offline data in .sqlx/ (committed; .cargo/config.toml sets SQLX_OFFLINE).
# This keeps that data true to the migrations and the code: it creates a
# scratch database on the running stack, migrates it, and runs
# `cargo sqlx prepare --workspace` against it.
#
#   scripts/check-sqlx.sh          fail if .sqlx/ is stale (`make test`)
#   scripts/check-sqlx.sh write    rewrite .sqlx/ (`make sqlx-prepare`)
#
# Needs the stack up (`make up`) and sqlx-cli (`cargo install sqlx-cli
# --version 0.8.6 --locked --no-default-features --features rustls,postgres`).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
STACK_DIR=${STACK_DIR:-$ROOT/.stack}
log() { printf 'check-sqlx: %s\n' "$*" >&2; }

case "${1:-check}" in
  check) mode=(--check) ;;
  write) mode=() ;;
  *) log "usage: $0 [check|write]"; exit 2 ;;
esac
[ -f "$STACK_DIR/env" ] || { log "no $STACK_DIR/env: is the stack up? (make up)"; exit 1; }
cargo sqlx --version >/dev/null 2>&1 || { log "sqlx-cli missing: cargo install sqlx-cli --version 0.8.6 --locked --no-default-features --features rustls,postgres"; exit 1; }
# shellcheck source=/dev/null
. "$STACK_DIR/env"

# One name per run: two checks on one stack must not share a database.
DB=sqlx_check_$$
URL=${STACK_ADMIN_DATABASE_URL%/*}/$DB
admin() { psql "$STACK_ADMIN_DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "$1" >/dev/null; }
admin "CREATE DATABASE $DB"
trap 'admin "DROP DATABASE IF EXISTS $DB WITH (FORCE)"' EXIT
# As the owner, like `make migrate` (pipeline::db::migrate): the library's
# schema first (fx, pipeline::db::LIBRARY_SCHEMA; its own ledger), then the
# pipeline's migrations, which use its tables.
DATABASE_URL=$URL cargo run -q -p effectively --example migrate -- fx >/dev/null
DATABASE_URL=$URL cargo sqlx migrate run --source migrations >/dev/null
DATABASE_URL=$URL cargo sqlx prepare --workspace "${mode[@]}"
