#!/usr/bin/env bash
# make wal-witness: does the WAL relay read every committed outbox insert?
# FINDINGS §22 saw its stream skip whole transactions once (23 rows, in a
# full experiment 6); the relay's gap check (relay/src/wal/settle.rs, Probe) repairs
# such a skip, but says nothing of where it happened. Here a second logical
# slot, read with PostgreSQL's own output plugin (test_decoding), witnesses
# the same WAL; the relay logs every transaction it read (RUST_LOG
# relay::wal=debug). On a fresh database (wal_witness) and topic:
#  1. the witness slot is made, then the WAL relay starts and makes its own;
#  2. WITNESS_BACKLOG rows (300,000) in one statement, streamed;
#  3. pgbench writes WITNESS_RATE rows/s (5,800, 10 per transaction) for
#     WITNESS_SECONDS (60), as experiment 6 does at its S;
#  4. once nothing is pending, scripts/lib/wal_witness.py compares: every
#     transaction the witness saw insert outbox rows must be one the relay
#     read, with as many rows.
# The WAL relay runs 2 × 500 (WITNESS_WORKERS, WITNESS_BATCH), the
# configuration of §22's skip.
# Results in .stack/wal-witness/ (WITNESS_OUT): the witness's and the
# relay's transactions, the relay's log, result.json. Exit 1 when a
# transaction was missed or read with other rows, the relay's gap check
# fired, or a row is left pending; the database is then kept.
# Settings: EXP_PROFILE (release; debug reuses the test build).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$ROOT/scripts/lib/pipeline.sh"
say() { printf '\n== %s\n' "$*"; }
BACKLOG=${WITNESS_BACKLOG:-300000}
RATE=${WITNESS_RATE:-5800}
SECONDS_=${WITNESS_SECONDS:-60}
WORKERS=${WITNESS_WORKERS:-2}
BATCH=${WITNESS_BATCH:-500}
OUT=${WITNESS_OUT:-$ROOT/.stack/wal-witness}
DB=wal_witness
WITNESS=wal_witness_test_decoding
SLOT=effectively_outbox_$DB
METRICS=127.0.0.1:19171

pipeline_stack
pipeline_build "${EXP_PROFILE:-release}"
rm -rf "$OUT"; mkdir -p "$OUT"
admin() { psql "$STACK_ADMIN_DATABASE_URL" -qAt -v ON_ERROR_STOP=1 -c "$1"; }
# A slot left by an earlier run would keep the database from being dropped.
admin "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots WHERE database = '$DB'" >/dev/null
pipeline_fresh "$DB" "wal-witness-$(date +%H%M%S)"
q() { psql "$DATABASE_URL" -qAt -v ON_ERROR_STOP=1 "$@"; }
[ "$(q -c 'SHOW wal_level')" = logical ] || { echo "wal_level is not logical: restart the stack (scripts/stack.sh down; up)" >&2; exit 1; }

PID= status=1
# The slots go (a slot left behind keeps WAL forever); the database stays
# after a failure, for a look at its rows (the next run drops it).
cleanup() {
  [ -z "$PID" ] || { kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; }
  admin "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots WHERE database = '$DB'" >/dev/null || true
  [ "$status" != 0 ] || pipeline_drop_db "$DB" || true
}
trap cleanup EXIT

say "1. the witness slot (test_decoding), then the WAL relay ($WORKERS × $BATCH) and its slot"
q -c "SELECT pg_create_logical_replication_slot('$WITNESS', 'test_decoding')" >/dev/null
DATABASE_URL=$RELAY_DATABASE_URL KAFKA_CLIENT_CONFIG=${RELAY_KAFKA_CLIENT_CONFIG:-} RELAY_MODE=wal RELAY_WORKERS=$WORKERS RELAY_BATCH_SIZE=$BATCH \
  RELAY_METRICS_ADDR=$METRICS RELAY_WAL_HEARTBEAT_MS=1000 RUST_LOG=warn,relay::wal=trace \
  "$BIN/relay" >"$OUT/relay.log" 2>&1 &
PID=$!
pipeline_wait_sql 30 "SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = '$SLOT' AND active)"

say "2. $BACKLOG rows in one statement"
q -c "$(pipeline_outbox_rows_sql "$BACKLOG")"
pipeline_wait_sql 300 "SELECT NOT EXISTS (SELECT FROM orders.outbox WHERE published_at IS NULL)"

say "3. pgbench: $RATE rows/s for $SECONDS_ s (10 rows per transaction)"
{ pipeline_outbox_rows_sql :rows; echo "SELECT pg_notify('orders_outbox', '');"; } >"$OUT/insert.pgbench.sql"
PGOPTIONS="-c effectively.outbox_notify=off" pgbench -n -c 8 -j 2 -R $((RATE / 10)) -T "$SECONDS_" -D rows=10 \
  -f "$OUT/insert.pgbench.sql" "$DATABASE_URL" >"$OUT/pgbench.log" 2>&1
left=0
pipeline_wait_sql 120 "SELECT NOT EXISTS (SELECT FROM orders.outbox WHERE published_at IS NULL)" ||
  left=$(q -c "SELECT count(*) FROM orders.outbox WHERE published_at IS NULL")
# Every row is published, maybe by a restart's drain (the poll path) while
# the stream was down: the stream must still read up to the last write.
end=$(q -c "SELECT pg_current_wal_insert_lsn()")
pipeline_wait_sql 300 "SELECT confirmed_flush_lsn >= '$end' FROM pg_replication_slots WHERE slot_name = '$SLOT'" ||
  echo "the relay's slot did not confirm past the last write ($end)" >&2
gaps=$(pipeline_metric "${METRICS##*:}" relay_wal_stream_gaps_total)
unseen=$(pipeline_metric "${METRICS##*:}" relay_wal_unseen_marks_total)
kill "$PID"; wait "$PID" 2>/dev/null || true
PID=

say "4. the witness against the relay"
# The first 60 characters of a change are enough: an insert's first column is its id.
q -F '|' -c "SELECT lsn, xid, left(data, 60) FROM pg_logical_slot_peek_changes('$WITNESS', NULL, NULL, 'include-xids', '1')
             WHERE data NOT LIKE 'message:%'" >"$OUT/witness.txt"
status=0
python3 "$ROOT/scripts/lib/wal_witness.py" "$OUT/witness.txt" "$OUT/relay.log" --json "$OUT/result.json" || status=1
rows=$(q -c "SELECT count(*) FROM orders.outbox")
echo "outbox rows: $rows; left pending: $left; the relay's gap check fired: $gaps times; marks that waited for rows to become visible: $unseen"
[ "$left" = 0 ] && [ "$gaps" = 0 ] || status=1
if [ "$status" = 0 ]; then
  echo "wal-witness: PASS — the relay read every transaction the witness saw, and published every row"
else
  echo "wal-witness: FAIL — see $OUT" >&2
fi
exit "$status"
