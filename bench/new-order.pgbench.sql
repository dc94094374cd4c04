-- The Orders write transaction as the service runs it (crates/orders/src/store.rs),
-- five round trips: BEGIN, key claim, order, outbox (its trigger NOTIFYs), COMMIT.
-- Used by scripts/bench-orders.sh as the ceiling the service is compared with.
\set r1 random(0, 9223372036854775806)
\set r2 random(0, 9223372036854775806)
\set r3 random(0, 9223372036854775806)
\set aid random(1, 100000)
\set amt random(1, 100000)
BEGIN;
INSERT INTO fx.idempotency_keys (scope, key, request_hash, reference, response_status, response_headers, response_body)
  VALUES ('', 'pgb-' || :r1 || '-' || :r2, decode(lpad(to_hex(:r1::bigint), 64, '0'), 'hex'),
          (lpad(to_hex(:r1::bigint), 16, '0') || lpad(to_hex(:r2::bigint), 16, '0'))::uuid::text, 201,
          '[["content-type","application/json"],["location","/orders/x"],["etag","\"x\""]]',
          '\x7b226f726465725f6964223a2230313233343536372d383961622d636465662d303132332d343536373839616263646566222c22737461747573223a2263726561746564227d')
  ON CONFLICT (scope, key) DO NOTHING;
INSERT INTO orders.orders (order_id, account_id, amount_cents, status)
  VALUES ((lpad(to_hex(:r1::bigint), 16, '0') || lpad(to_hex(:r2::bigint), 16, '0'))::uuid, :aid, :amt, 'created');
INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload)
  VALUES ((lpad(to_hex(:r1::bigint), 16, '0') || lpad(to_hex(:r2::bigint), 16, '0'))::uuid,
          (lpad(to_hex(:r3::bigint), 16, '0') || lpad(to_hex(:r2::bigint), 16, '0'))::uuid, 'order.created',
          '\x7b226f726465725f6964223a2230313233343536372d383961622d636465662d303132332d343536373839616263646566222c226163636f756e745f6964223a34322c22616d6f756e745f63656e7473223a313939392c22737461747573223a2263726561746564227d')
  RETURNING id;
COMMIT;
