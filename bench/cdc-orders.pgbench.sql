-- make bench-cdc's load (scripts/bench-cdc.sh): :batch orders and their
-- outbox rows per transaction, in one statement, as orders writes them (an
-- order row and its order.created event committed together; a msg_id that
-- is a UUIDv7 minted now, as orders mints them). The order rows are what the
-- benchmark measures from: nothing updates them, so each one's xmin keeps its
-- transaction's commit time (pg_xact_commit_timestamp), whichever relay marks
-- or does not mark the outbox rows.
WITH o AS (
  INSERT INTO orders.orders (order_id, account_id, amount_cents, status)
  SELECT gen_random_uuid(), (random() * 99999)::int + 1, 1999, 'created' FROM generate_series(1, :batch)
  RETURNING order_id, account_id, amount_cents)
INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload)
SELECT order_id,
       (lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::int8), 12, '0') || '7'
        || substr(md5(random()::text), 1, 3) || '8' || substr(md5(random()::text), 1, 15))::uuid,
       'order.created',
       convert_to(json_build_object('order_id', order_id, 'account_id', account_id,
                  'amount_cents', amount_cents, 'status', 'created')::text, 'UTF8')
FROM o;
