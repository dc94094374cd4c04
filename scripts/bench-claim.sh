#!/usr/bin/env bash
# make bench-claim: the relay's claim of 1,000 rows of one shard over a
# backlog, when the statistics were taken while the outbox was empty (every
# row published, ANALYZE, then the burst) and when they are fresh. "before"
# is the claim and indexes up to migration 20261126 (an anti-join, a partial
# index on id alone); "after" is crates/relay/src/outbox.rs::read_shards's
# query on the current migrations (the relay's claim since it runs on the
# library's engine: it reads a shard's oldest rows and marks nothing; FINDINGS
# §16's "after" column was the claim before it, which marked what it took;
# each claim is rolled back). Times are EXPLAIN ANALYZE's execution time, one run
# per cell, on a scratch database (bench_claim). Settings: CLAIM_BACKLOGS
# ("30000 300000": pending rows, as many published rows before them),
# CLAIM_TIMEOUT_S (60: a claim cut off there prints "> 60000").
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BACKLOGS=${CLAIM_BACKLOGS:-30000 300000}
TIMEOUT_S=${CLAIM_TIMEOUT_S:-60}
scripts/stack.sh up >/dev/null
. .stack/env
. scripts/lib/pipeline.sh
cargo build -q --release -p orders
URL=${STACK_ADMIN_DATABASE_URL%/*}/bench_claim
psql "$STACK_ADMIN_DATABASE_URL" -qAt -c "DROP DATABASE IF EXISTS bench_claim" -c "CREATE DATABASE bench_claim"
DATABASE_URL=$URL RUST_LOG=warn target/release/orders --migrate-only
q() { psql "$URL" -qAt -v ON_ERROR_STOP=1 -c "$1" >/dev/null; }
q "ALTER TABLE orders.outbox SET (autovacuum_enabled = off)"

cols="o.id, o.aggregate_id, o.msg_id, o.event_type, o.payload, o.created_at, o.attempts"
before="SELECT $cols FROM orders.outbox o
  WHERE o.shard = 3 AND o.published_at IS NULL AND o.failed_at IS NULL
    AND NOT EXISTS (SELECT 1 FROM orders.outbox e WHERE e.aggregate_id = o.aggregate_id
                    AND e.published_at IS NULL AND e.id < o.id)
  ORDER BY o.id LIMIT 1000 FOR UPDATE OF o SKIP LOCKED"
# The query of crates/relay/src/outbox.rs::read_shards, for shard 3 alone
# and a limit of 1000.
after=$(sed -n '/^pub async fn read_shards(/,/^}/p' crates/relay/src/outbox.rs \
  | sed -n '/r#"SELECT/,/"#,/p' | sed 's/^ *r#"//; s/"#,$//' \
  | sed "s/\$1::int2\[\]/'{3}'::int2[]/; s/\$2/1000/" | tr '\n' ' ')
case $after in *"NOT EXISTS"*"LIMIT 1000"*) ;; *) echo "cannot read the claim's query from outbox.rs" >&2; exit 1 ;; esac

# The indexes before migration 20261127000001, and the current ones.
old_indexes="DROP INDEX orders.outbox_pending_by_shard;
  CREATE INDEX outbox_pending ON orders.outbox (id) WHERE published_at IS NULL;
  CREATE INDEX outbox_pending_by_shard ON orders.outbox (shard, id) WHERE published_at IS NULL"
new_indexes="DROP INDEX orders.outbox_pending; DROP INDEX orders.outbox_pending_by_shard;
  CREATE INDEX outbox_pending_by_shard ON orders.outbox (shard, id)
    WHERE published_at IS NULL AND failed_at IS NULL"

ms() { # ms QUERY: EXPLAIN ANALYZE's execution time in ms, or "> timeout";
  # rolled back (today's claim marks the rows it takes)
  local out
  if out=$(psql "$URL" -qAt -v ON_ERROR_STOP=1 -c "SET statement_timeout = '${TIMEOUT_S}s'" \
             -c "BEGIN" -c "EXPLAIN (ANALYZE, FORMAT JSON) $1" -c "ROLLBACK" 2>&1); then
    python3 -c 'import json,sys; print(round(json.loads(sys.stdin.read())[0]["Execution Time"], 1))' <<<"$out"
  else
    case $out in *"statement timeout"*) echo "> $((TIMEOUT_S * 1000))" ;; *) echo "$out" >&2; exit 1 ;; esac
  fi
}

echo "backlog statistics claim ms"
for n in $BACKLOGS; do
  q "TRUNCATE orders.outbox"
  q "$(pipeline_outbox_rows_sql "$n")"
  q "UPDATE orders.outbox SET published_at = now()"
  q "VACUUM ANALYZE orders.outbox"  # statistics of an empty queue
  q "$(pipeline_outbox_rows_sql "$n")"
  for stats in empty fresh; do
    [ "$stats" = fresh ] && q "ANALYZE orders.outbox"
    q "$old_indexes"; echo "$n $stats before $(ms "$before")"
    q "$new_indexes"; echo "$n $stats after $(ms "$after")"
  done
done
