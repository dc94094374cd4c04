-- The Orders write statement as the service runs it when it coalesces 64
-- requests (crates/orders/src/store.rs, write_statement): in one statement,
-- and so one transaction and one round trip, the 64 key claims in the
-- library's table, the orders and outbox rows of the keys claimed (the
-- outbox's statement trigger NOTIFYs once), and the read of the keys not
-- claimed. Used by scripts/bench-orders.sh as the batched ceiling: pgbench's
-- TPS x 64 is the most orders a second this database commits in the
-- service's batches.
\set r1 random(0, 9223372036854775806)
\set aid random(1, 100000)
WITH input AS (
    SELECT 'pgb-' || :r1 || '-' || g AS k,
           decode(md5(:r1 || '-' || g) || md5(g || '-' || :r1), 'hex') AS h,
           md5('o' || :r1 || '-' || g)::uuid AS o, g AS n
    FROM generate_series(1, 64) AS g
), taken AS (
    INSERT INTO fx.idempotency_keys AS t
        (scope, key, request_hash, response_status, response_headers, response_body, reference)
    SELECT '', k, h, 201,
           '[["content-type","application/json"],["location","/orders/x"],["etag","\"x\""]]',
           '\x7b226f726465725f6964223a2230313233343536372d383961622d636465662d303132332d343536373839616263646566222c22737461747573223a2263726561746564227d',
           o::text
    FROM input ORDER BY k
    ON CONFLICT (scope, key) DO NOTHING RETURNING t.key
), fresh AS (
    SELECT * FROM input WHERE k IN (SELECT key FROM taken)
), placed AS (
    INSERT INTO orders.orders (order_id, account_id, amount_cents, status)
    SELECT o, :aid + n, 1999, 'created' FROM fresh
), queued AS (
    INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload)
    SELECT o, md5('m' || :r1 || '-' || n)::uuid, 'order.created',
           '\x7b226f726465725f6964223a2230313233343536372d383961622d636465662d303132332d343536373839616263646566222c226163636f756e745f6964223a34322c22616d6f756e745f63656e7473223a313939392c22737461747573223a2263726561746564227d'
    FROM fresh ORDER BY n
)
SELECT i.n, i.n IN (SELECT n FROM fresh), s.request_hash, s.response_status,
       s.response_headers, s.response_body
FROM input AS i LEFT JOIN LATERAL (
    SELECT * FROM fx.idempotency_keys AS t
    WHERE i.k NOT IN (SELECT key FROM taken) AND t.scope = '' AND t.key = i.k
    LIMIT 1
) AS s ON true
ORDER BY i.n;
