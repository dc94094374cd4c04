-- The Orders write statement as the service runs it when it coalesces 64
-- requests (crates/orders/src/store.rs, write_statement): in one statement,
-- and so one transaction and one round trip, the 64 key claims, the orders
-- and outbox rows of the keys claimed (the outbox's statement trigger NOTIFYs
-- once), and the read of the keys not claimed (the library's fx.claim_keys). Used by scripts/bench-orders.sh
-- as the batched ceiling: pgbench's TPS x 64 is the most orders a second this
-- database commits in the service's batches.
\set r1 random(0, 9223372036854775806)
\set aid random(1, 100000)
WITH input AS (
    SELECT 'pgb-' || :r1 || '-' || g AS k,
           decode(md5(:r1 || '-' || g) || md5(g || '-' || :r1), 'hex') AS h,
           md5('o' || :r1 || '-' || g)::uuid AS o, g AS n
    FROM generate_series(1, 64) AS g
), claims AS (
    SELECT * FROM fx.claim_keys('', (SELECT array_agg(k ORDER BY n) FROM input),
        (SELECT array_agg(h ORDER BY n) FROM input),
        array_fill(201::int2, ARRAY[64]),
        array_fill('[["content-type","application/json"],["location","/orders/x"],["etag","\"x\""]]'::jsonb, ARRAY[64]),
        array_fill('\x7b226f726465725f6964223a2230313233343536372d383961622d636465662d303132332d343536373839616263646566222c22737461747573223a2263726561746564227d'::bytea, ARRAY[64]),
        (SELECT array_agg(o::text ORDER BY n) FROM input))
), fresh AS (
    SELECT * FROM input WHERE n IN (SELECT n FROM claims WHERE claimed)
), placed AS (
    INSERT INTO orders.orders (order_id, account_id, amount_cents, status)
    SELECT o, :aid + n, 1999, 'created' FROM fresh
), queued AS (
    INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload)
    SELECT o, md5('m' || :r1 || '-' || n)::uuid, 'order.created',
           '\x7b226f726465725f6964223a2230313233343536372d383961622d636465662d303132332d343536373839616263646566222c226163636f756e745f6964223a34322c22616d6f756e745f63656e7473223a313939392c22737461747573223a2263726561746564227d'
    FROM fresh ORDER BY n
)
SELECT i.n, i.n IN (SELECT n FROM fresh), c.request_hash, c.response_status,
       c.response_headers, c.response_body
FROM input AS i LEFT JOIN claims AS c ON c.n = i.n
ORDER BY i.n;
