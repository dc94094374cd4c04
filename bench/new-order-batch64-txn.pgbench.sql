-- The Orders write of 64 coalesced requests as the service ran it before it
-- became one statement: one BEGIN, the 64 key claims in one statement, the 64
-- orders in one, the 64 outbox rows in one (its statement trigger NOTIFYs
-- once), one COMMIT: five round trips. scripts/bench-orders.sh runs it beside
-- new-order-batch64.pgbench.sql (the same rows in one statement) to measure
-- what the round trips cost the database.
\set r1 random(0, 9223372036854775806)
\set aid random(1, 100000)
BEGIN;
INSERT INTO fx.idempotency_keys (scope, key, request_hash, reference, response_status, response_headers, response_body)
  SELECT '', 'pgb-' || :r1 || '-' || g, decode(md5(:r1 || '-' || g) || md5(g || '-' || :r1), 'hex'),
         md5('o' || :r1 || '-' || g)::uuid::text, 201,
         '[["content-type","application/json"],["location","/orders/x"],["etag","\"x\""]]',
         '\x7b226f726465725f6964223a2230313233343536372d383961622d636465662d303132332d343536373839616263646566222c22737461747573223a2263726561746564227d'
  FROM generate_series(1, 64) AS g ORDER BY 2
  ON CONFLICT (scope, key) DO NOTHING RETURNING key;
INSERT INTO orders.orders (order_id, account_id, amount_cents, status)
  SELECT md5('o' || :r1 || '-' || g)::uuid, :aid + g, 1999, 'created' FROM generate_series(1, 64) AS g;
INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload)
  SELECT md5('o' || :r1 || '-' || g)::uuid, md5('m' || :r1 || '-' || g)::uuid, 'order.created',
         '\x7b226f726465725f6964223a2230313233343536372d383961622d636465662d303132332d343536373839616263646566222c226163636f756e745f6964223a34322c22616d6f756e745f63656e7473223a313939392c22737461747573223a2263726561746564227d'
  FROM generate_series(1, 64) AS g
  RETURNING id;
COMMIT;
