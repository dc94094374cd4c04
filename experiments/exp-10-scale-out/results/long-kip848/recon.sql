-- the floors of the stores that expire ($3, $4 and the greater of outbox and inbox: $5)
-- The floors of the stores that expire, read in the diff's snapshot: keys
-- of orders minted below the keys' floor, published outbox rows minted below
-- the outbox's floor and inbox rows below the inbox's oldest partition may be
-- gone by design (migrations/20261124000001_inbox_partitions.sql,
-- 20261124000002_outbox_and_keys_expiry.sql). "!": each is a value, never NULL.
SELECT (SELECT floor FROM orders.key_policy) AS "keys!",
       (SELECT floor FROM orders.outbox_policy) AS "outbox!",
       COALESCE((SELECT lo FROM payments.inbox_partitions ORDER BY lo LIMIT 1),
                '00000000-0000-0000-0000-000000000000'::uuid) AS "inbox!";

-- the diff of the ids $1 to $2 (the whole: $1 = '00000000-0000-0000-0000-000000000000', $2 = 'ffffffff-ffff-ffff-ffff-ffffffffffff')
-- $1, $2: the range of ids (order ids; msg ids for the inbox's checks).
-- $3, $4: the floors of the idempotency keys and of the outbox (rows of an
-- order below a floor may have expired: orders, charges and the ledger never
-- do). $5: the msg_id floor of the outbox <-> inbox match (the higher of the
-- outbox's and the inbox's floors). Over the whole history all three are
-- '00000000-0000-0000-0000-000000000000'.
WITH
k AS (SELECT order_id, count(*) AS n FROM orders.idempotency_keys
      WHERE order_id BETWEEN $1 AND $2 GROUP BY order_id),
x AS (SELECT e.aggregate_id AS order_id, count(*) AS n,
             count(*) FILTER (WHERE c.msg_id = e.msg_id) AS charging,
             count(*) FILTER (WHERE NOT (
                 position(convert_to('"order_id":"' || o.order_id || '"', 'UTF8') IN e.payload) > 0
                 AND (position(convert_to('"account_id":' || o.account_id || ',', 'UTF8') IN e.payload) > 0
                      OR position(convert_to('"account_id":' || o.account_id || '}', 'UTF8') IN e.payload) > 0)
                 AND (position(convert_to('"amount_cents":' || o.amount_cents || ',', 'UTF8') IN e.payload) > 0
                      OR position(convert_to('"amount_cents":' || o.amount_cents || '}', 'UTF8') IN e.payload) > 0))
             ) AS foreign_payloads
      FROM orders.outbox e
      JOIN orders.orders o ON o.order_id = e.aggregate_id
      LEFT JOIN payments.charges c ON c.order_id = e.aggregate_id
      WHERE e.aggregate_id BETWEEN $1 AND $2
      GROUP BY e.aggregate_id),
l AS (SELECT l.order_id, count(*) AS n,
             count(*) FILTER (WHERE c.order_id IS NULL OR c.msg_id <> l.msg_id
                              OR c.account_id <> l.account_id OR c.amount_cents <> l.amount_cents) AS foreign_entries
      FROM payments.ledger l LEFT JOIN payments.charges c ON c.order_id = l.order_id
      WHERE l.order_id BETWEEN $1 AND $2
      GROUP BY l.order_id),
j AS (SELECT count(*) AS orders,
             COALESCE(sum(o.amount_cents), 0)::int8 AS order_amount,
             COALESCE(sum(k.n), 0)::int8 AS keys_matched,
             count(*) FILTER (WHERE o.order_id >= $3) AS orders_since_key_floor,
             count(*) FILTER (WHERE o.order_id >= $4) AS orders_since_outbox_floor,
             count(*) FILTER (WHERE k.n IS NULL AND o.order_id >= $3) AS orders_without_key,
             count(*) FILTER (WHERE k.n > 1) AS orders_with_many_keys,
             COALESCE(sum(x.n), 0)::int8 AS events_matched,
             count(*) FILTER (WHERE x.n IS NULL AND o.order_id >= $4) AS orders_without_event,
             count(*) FILTER (WHERE x.n > 1) AS orders_with_many_events,
             count(*) FILTER (WHERE x.foreign_payloads > 0) AS event_payload_mismatches,
             count(c.order_id) AS charges_matched,
             count(*) FILTER (WHERE c.order_id IS NULL) AS orders_without_charge,
             count(*) FILTER (WHERE c.account_id <> o.account_id OR c.amount_cents <> o.amount_cents) AS charge_mismatches,
             count(*) FILTER (WHERE c.order_id IS NOT NULL AND COALESCE(x.charging, 0) = 0
                              AND (x.n IS NOT NULL OR o.order_id >= $4)) AS charges_by_another_event,
             COALESCE(sum(l.n), 0)::int8 AS effects_matched,
             count(*) FILTER (WHERE l.n > 1) AS double_charges,
             count(*) FILTER (WHERE c.order_id IS NOT NULL AND l.n IS NULL) AS charges_without_effect,
             count(*) FILTER (WHERE l.foreign_entries > 0) AS effect_mismatches
      FROM orders.orders o
      LEFT JOIN k ON k.order_id = o.order_id
      LEFT JOIN x ON x.order_id = o.order_id
      LEFT JOIN payments.charges c ON c.order_id = o.order_id
      LEFT JOIN l ON l.order_id = o.order_id
      WHERE o.order_id BETWEEN $1 AND $2),
ks AS (SELECT count(*) AS n,
              count(*) FILTER (WHERE position(convert_to('"order_id":"' || order_id || '"', 'UTF8')
                                              IN response_body) = 0) AS foreign_responses
       FROM orders.idempotency_keys WHERE order_id BETWEEN $1 AND $2),
xs AS (SELECT count(*) AS n, count(*) FILTER (WHERE published_at IS NULL) AS unpublished,
              count(*) FILTER (WHERE aggregate_id >= $4) AS since_floor,
              count(*) FILTER (WHERE failed_at IS NOT NULL) AS failed
       FROM orders.outbox WHERE aggregate_id BETWEEN $1 AND $2),
cs AS (SELECT count(*) AS n, COALESCE(sum(amount_cents), 0)::int8 AS amount
       FROM payments.charges WHERE order_id BETWEEN $1 AND $2),
ls AS (SELECT count(*) AS n, COALESCE(sum(amount_cents), 0)::int8 AS amount
       FROM payments.ledger WHERE order_id BETWEEN $1 AND $2),
ins AS (SELECT count(*) AS n FROM payments.inbox WHERE msg_id BETWEEN $1 AND $2 AND msg_id >= $5),
xm AS (SELECT count(*) AS n FROM orders.outbox WHERE msg_id BETWEEN $1 AND $2 AND msg_id >= $5),
io AS (SELECT count(*) AS n FROM orders.outbox e JOIN payments.inbox i ON i.msg_id = e.msg_id
       WHERE e.msg_id BETWEEN $1 AND $2 AND e.msg_id >= $5)
-- Every column is a count or a COALESCEd sum: never NULL. PostgreSQL reports
-- no nullability for computed columns, so the "!" in each name tells sqlx's
-- compile-time check (crates/recon/src/lib.rs) not to expect NULL.
SELECT j.orders AS "orders!",
       j.order_amount AS "order_amount!",
       j.keys_matched AS "keys_matched!",
       j.orders_since_key_floor AS "orders_since_key_floor!",
       j.orders_since_outbox_floor AS "orders_since_outbox_floor!",
       j.orders_without_key AS "orders_without_key!",
       j.orders_with_many_keys AS "orders_with_many_keys!",
       j.events_matched AS "events_matched!",
       j.orders_without_event AS "orders_without_event!",
       j.orders_with_many_events AS "orders_with_many_events!",
       j.event_payload_mismatches AS "event_payload_mismatches!",
       j.charges_matched AS "charges_matched!",
       j.orders_without_charge AS "orders_without_charge!",
       j.charge_mismatches AS "charge_mismatches!",
       j.charges_by_another_event AS "charges_by_another_event!",
       j.effects_matched AS "effects_matched!",
       j.double_charges AS "double_charges!",
       j.charges_without_effect AS "charges_without_effect!",
       j.effect_mismatches AS "effect_mismatches!",
       ks.n AS "keys!",
       ks.foreign_responses AS "foreign_responses!",
       xs.n AS "events!",
       xs.unpublished AS "unpublished!",
       xs.failed AS "failed!",
       xs.since_floor AS "events_since_outbox_floor!",
       xm.n AS "events_since_msg_floor!",
       cs.n AS "charges!",
       cs.amount AS "charge_amount!",
       ls.n AS "effects!",
       ls.amount AS "effect_amount!",
       ins.n AS "inbox!",
       io.n AS "consumed!"
FROM j, ks, xs, cs, ls, ins, xm, io;

-- the stored responses of the same ids, compared by recon row by row
-- The stored responses of the idempotency keys of the order ids $1 to $2:
-- per key, its order id, its status, and its Location and ETag (each NULL
-- unless the headers hold exactly one). Recon compares each key's with the
-- response orders stores for that order (effectively::contract::
-- created_response: 201, `/orders/{order_id}`, and the ETag, a BLAKE3 hash
-- of the body that PostgreSQL cannot compute), so this statement only
-- reads and the comparison is recon's own, row by row. Orders stores its
-- headers in one layout (content-type, location, etag), read by position;
-- any other is searched by name (case-insensitive); headers that are not
-- an array hold neither.
SELECT k.order_id, k.response_code,
       CASE WHEN k.usual THEN k.headers->1->>1
            ELSE (SELECT min(e.pair->>1)
                  FROM jsonb_array_elements(CASE WHEN jsonb_typeof(k.headers) = 'array'
                                                 THEN k.headers ELSE '[]' END) AS e(pair)
                  WHERE lower(e.pair->>0) = 'location' HAVING count(*) = 1) END AS location,
       CASE WHEN k.usual THEN k.headers->2->>1
            ELSE (SELECT min(e.pair->>1)
                  FROM jsonb_array_elements(CASE WHEN jsonb_typeof(k.headers) = 'array'
                                                 THEN k.headers ELSE '[]' END) AS e(pair)
                  WHERE lower(e.pair->>0) = 'etag' HAVING count(*) = 1) END AS etag
FROM (SELECT order_id, response_code, response_headers AS headers,
             COALESCE(jsonb_typeof(response_headers) = 'array'
                      AND jsonb_array_length(response_headers) = 3
                      AND response_headers->0->>0 = 'content-type'
                      AND response_headers->1->>0 = 'location'
                      AND response_headers->2->>0 = 'etag', false) AS usual
      FROM orders.idempotency_keys
      WHERE order_id BETWEEN $1 AND $2) AS k;

-- dead letters
-- The dead letters, and of them the late duplicates: refused as arriving
-- after the dedup horizon (kind after_horizon), yet their msg_id is the one
-- that charged the order they name. Those are provably redeliveries of an
-- applied effect: nothing lost, nothing for an operator to do. Every other
-- dead letter needs a look (README, "Bad input, dead letters and failed rows").
-- count(*) is never NULL; "!" tells sqlx's compile-time check so (PostgreSQL
-- reports no nullability for computed columns).
--
-- With it, the state of the webhook hop (relay --sink http, payments
-- --source http), all 0 over Kafka: deliveries the sender gave up (failed:
-- an intent that did not reach its effect, like a failed outbox row),
-- deliveries still open, and webhooks claimed but not yet applied.
SELECT count(*) AS "dead_letters!",
       count(*) FILTER (WHERE d.kind = 'after_horizon' AND c.order_id IS NOT NULL) AS "late_duplicates!",
       (SELECT count(*) FROM orders.webhook_deliveries w WHERE w.failed_at IS NOT NULL) AS "failed_deliveries!",
       (SELECT count(*) FROM orders.webhook_deliveries w
        WHERE w.delivered_at IS NULL AND w.failed_at IS NULL) AS "open_deliveries!",
       (SELECT count(*) FROM payments.webhook_inbox i WHERE i.processed_at IS NULL) AS "unprocessed_webhooks!"
FROM payments.dead_letters d
LEFT JOIN payments.charges c ON c.order_id = d.order_id AND c.msg_id = d.msg_id;

-- drained?
-- NOT EXISTS is never NULL; "!" tells sqlx's compile-time check so
-- (PostgreSQL reports no nullability for computed columns).
SELECT
  NOT EXISTS (SELECT 1 FROM orders.outbox o
              WHERE o.published_at IS NULL AND o.failed_at IS NULL
                AND NOT EXISTS (SELECT 1 FROM orders.outbox f
                                WHERE f.aggregate_id = o.aggregate_id
                                  AND f.published_at IS NULL AND f.failed_at IS NOT NULL
                                  AND f.id < o.id))
  AND NOT EXISTS (SELECT 1 FROM orders.outbox x
                  WHERE x.published_at IS NOT NULL
                    -- an event older than the inbox's oldest partition has no
                    -- record there to find (expired)
                    AND x.msg_id >= COALESCE((SELECT p.lo FROM payments.inbox_partitions p
                                              ORDER BY p.lo LIMIT 1),
                                             '00000000-0000-0000-0000-000000000000')
                    AND NOT EXISTS (SELECT 1 FROM payments.inbox i WHERE i.msg_id = x.msg_id)
                    AND NOT EXISTS (SELECT 1 FROM payments.dead_letters d WHERE d.msg_id = x.msg_id)
                    -- over HTTP: a delivery the sender gave up never arrives
                    AND NOT EXISTS (SELECT 1 FROM orders.webhook_deliveries w
                                    WHERE w.msg_id = x.msg_id AND w.failed_at IS NOT NULL))
  -- over HTTP: nothing claimed by the receiver and not yet applied
  AND NOT EXISTS (SELECT 1 FROM payments.webhook_inbox i WHERE i.processed_at IS NULL)
  -- over HTTP: no delivery the sender still has open. The receiver may have
  -- applied it already (its answer lost to a timeout or a kill), so the
  -- inbox alone says drained while the sender's retry is still due, and
  -- recon's open_deliveries would be a race, not drift.
  AND NOT EXISTS (SELECT 1 FROM orders.webhook_deliveries w
                  WHERE w.delivered_at IS NULL AND w.failed_at IS NULL)
  AS "drained!";

