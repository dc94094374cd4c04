#!/bin/bash
# What a WAL relay's mark costs PostgreSQL per row, and what it would cost
# done otherwise, on a scratch database migrated as the relay's is
# (orders --migrate-only): 600,000 outbox rows, then batches of 300 rows
# (about one 50 ms mark at 6,000 rows/s), one client, pgbench's average
# latency per batch over 150 batches, each variant twice, interleaved:
#   count+update: the mark as the relay makes it (the visibility count, then
#                 the UPDATE of published_at), in one transaction;
#   update:       the UPDATE alone;
#   delete:       the rows deleted instead (what a relay that did not keep
#                 published rows would pay).
# Then the WAL relay's start-up read of the lowest pending id, the plain
# min(id) it used before against the shard-by-shard read it uses now
# (crates/relay/src/wal/drained.rs), with all but 1,000 rows published.
# Run from the repository's root with the stack up and a release build:
#   bash bench/results/marks-20261207/marks.sh
set -euo pipefail
set -a; . .stack/env; set +a
DB=bench_marks
U=${DATABASE_URL%/*}/$DB
psql "$STACK_ADMIN_DATABASE_URL" -qc "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
DATABASE_URL=$U target/release/orders --migrate-only >/dev/null 2>&1
psql "$U" -q <<'SQL'
INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload)
SELECT gen_random_uuid(), gen_random_uuid(), 'order.created', convert_to(repeat('x', 120), 'UTF8')
FROM generate_series(1, 600000);
VACUUM ANALYZE orders.outbox;
CREATE SEQUENCE public.batch START 0 MINVALUE 0;
SQL
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
next='SELECT nextval('"'"'public.batch'"'"') * 300 + 1 AS lo \gset'
ids='ARRAY(SELECT generate_series(:lo, :lo + 299))::int8[]'
count="SELECT count(*) FROM unnest($ids) r(id) WHERE EXISTS (SELECT 1 FROM orders.outbox o WHERE o.id = r.id);"
update="UPDATE orders.outbox SET published_at = now() WHERE id = ANY($ids) AND coalesce(published_at, 'infinity') = 'infinity';"
printf '%s\nBEGIN;\n%s\n%s\nCOMMIT;\n' "$next" "$count" "$update" >"$dir/count+update.sql"
printf '%s\nBEGIN;\n%s\nCOMMIT;\n' "$next" "$update" >"$dir/update.sql"
printf '%s\nBEGIN;\nDELETE FROM orders.outbox WHERE id = ANY(%s);\nCOMMIT;\n' "$next" "$ids" >"$dir/delete.sql"
for round in 1 2; do
  for variant in count+update update delete; do
    ms=$(pgbench -n -f "$dir/$variant.sql" -t 150 "$U" 2>&1 | sed -n 's/^latency average = \([0-9.]*\) ms$/\1/p')
    python3 -c "import sys; ms=float(sys.argv[2]); print(f'{sys.argv[1]:>12} round {sys.argv[3]}: {ms:.3f} ms per 300 rows, {ms * 1000 / 300:.1f} us per row')" "$variant" "$ms" "$round"
  done
done
psql "$U" -qAt -c "SELECT 'HOT updates: ' || n_tup_hot_upd || ' of ' || n_tup_upd FROM pg_stat_user_tables WHERE relid = 'orders.outbox'::regclass"
psql "$U" -q -c "UPDATE orders.outbox SET published_at = now() WHERE id < (SELECT max(id) - 1000 FROM orders.outbox) AND published_at IS NULL" -c "VACUUM ANALYZE orders.outbox"
old="SELECT min(id) FROM orders.outbox WHERE published_at IS NULL AND failed_at IS NULL"
new="SELECT (SELECT min(p.id) FROM generate_series(0, 15) AS s(shard), LATERAL (SELECT o.id FROM orders.outbox o WHERE o.shard = s.shard AND o.published_at IS NULL AND o.failed_at IS NULL AND NOT EXISTS (SELECT 1 FROM orders.outbox f WHERE f.aggregate_id = o.aggregate_id AND f.id < o.id AND f.published_at IS NULL AND f.failed_at IS NOT NULL) ORDER BY o.id LIMIT 1) p)"
for which in old new; do
  sql=${!which}
  psql "$U" -qAt -c "EXPLAIN (ANALYZE, FORMAT JSON) $sql" |
    python3 -c "import json, sys; p = json.load(sys.stdin)[0]; print(f'lowest pending id, {sys.argv[1]} query: {p[\"Execution Time\"]:.3f} ms')" "$which"
done
psql "$STACK_ADMIN_DATABASE_URL" -qc "DROP DATABASE $DB"
