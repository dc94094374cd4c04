#!/usr/bin/env bash
# make wal-slot-lost: the WAL relay's slot invalidated, and the recovery the
# relay's error prescribes. On a fresh database (wal_slot_lost) and topic:
#  1. the WAL relay starts (its slot made) and stops; 200 outbox rows are
#     written while it is down;
#  2. the server's max_slot_wal_keep_size is lowered to 64 MB (ALTER SYSTEM,
#     restored on exit) and ~150 MB of other WAL is written and checkpointed:
#     PostgreSQL invalidates the slot (wal_status = lost);
#  3. the relay is started again: it must exit non-zero with the error that
#     names the slot and the way out;
#  4. the way out: the slot dropped, the relay started again: it makes a new
#     slot and publishes every pending row (0 left), nothing lost.
# It lowers a server-wide setting for a minute: other slots on the server that
# retain more than 64 MB are invalidated too. Run it on the embedded stack.
# Settings: EXP_PROFILE (release; debug reuses the test build).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib/pipeline.sh"
say() { printf '\n== %s\n' "$*"; }
pipeline_stack
pipeline_build "${EXP_PROFILE:-release}"
LOGS=$ROOT/.stack/wal-slot-lost
rm -rf "$LOGS"; mkdir -p "$LOGS"
pipeline_fresh wal_slot_lost "wal-slot-lost-$(date +%H%M%S)"
admin() { psql "$STACK_ADMIN_DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "$1"; }
q() { psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "$1"; }
[ "$(q 'SHOW wal_level')" = logical ] || { echo "wal_level is not logical: restart the stack (scripts/stack.sh down; up)" >&2; exit 1; }
restore() { admin "ALTER SYSTEM RESET max_slot_wal_keep_size" >/dev/null; admin "SELECT pg_reload_conf()" >/dev/null; }
trap restore EXIT
SLOT=effectively_outbox_wal_slot_lost

relay() { # relay LOG: the WAL relay on this database, in the background; sets PID
  DATABASE_URL=$RELAY_DATABASE_URL KAFKA_CLIENT_CONFIG=${RELAY_KAFKA_CLIENT_CONFIG:-} RELAY_MODE=wal RELAY_METRICS_ADDR=127.0.0.1:0 RUST_LOG=info \
    "$BIN/relay" >"$LOGS/$1" 2>&1 &
  PID=$!
}

say "1. the WAL relay makes its slot, then stops; 200 rows written while it is down"
relay relay-1.log
pipeline_wait_sql 30 "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = '$SLOT' AND active)"
kill "$PID"; wait "$PID" || true
q "$(pipeline_outbox_rows_sql 200)"
echo "pending: $(q 'SELECT count(*) FROM orders.outbox WHERE published_at IS NULL')"

say "2. max_slot_wal_keep_size = 64MB; 150 MB of other WAL, checkpointed"
admin "ALTER SYSTEM SET max_slot_wal_keep_size = '64MB'" >/dev/null
admin "SELECT pg_reload_conf()" >/dev/null
q "CREATE TABLE public.wal_filler AS SELECT i, repeat('x', 100) AS pad FROM generate_series(1, 1000000) i"
for _ in 1 2 3; do q "SELECT pg_switch_wal()" >/dev/null; admin "CHECKPOINT"; done
q "DROP TABLE public.wal_filler"
status=$(q "SELECT wal_status FROM pg_replication_slots WHERE slot_name = '$SLOT'")
echo "slot $SLOT: wal_status = $status"
[ "$status" = lost ] || { echo "FAIL: the slot was not invalidated" >&2; exit 1; }

say "3. the relay started again on the lost slot"
relay relay-2.log
rc=0; wait "$PID" || rc=$?
grep -o "replication slot $SLOT was invalidated.*" "$LOGS/relay-2.log" | head -1
[ "$rc" != 0 ] || { echo "FAIL: the relay did not exit with an error" >&2; exit 1; }
grep -q "Drop it" "$LOGS/relay-2.log" || { echo "FAIL: no way out in the error" >&2; exit 1; }
echo "relay exit status: $rc"
restore

say "4. the way out: drop the slot, start the relay"
q "SELECT pg_drop_replication_slot('$SLOT')" >/dev/null
relay relay-3.log
pipeline_wait_sql 60 "SELECT count(*) = 0 FROM orders.outbox WHERE published_at IS NULL"
echo "pending: 0; published: $(q 'SELECT count(*) FROM orders.outbox WHERE published_at IS NOT NULL')"
kill "$PID"; wait "$PID" || true
q "SELECT pg_drop_replication_slot('$SLOT')" >/dev/null
pipeline_drop_db wal_slot_lost
echo "wal-slot-lost: PASS — the lost slot stopped the relay with its way out; after it, every pending row published"
