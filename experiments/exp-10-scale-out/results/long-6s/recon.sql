-- the floors of the stores that expire ($3, $4 and the greater of outbox and inbox: $5)
-- The floors of the stores that expire, read in the diff's snapshot: keys
-- of orders minted below the keys' floor, published outbox rows minted below
-- the outbox's floor and inbox rows below the inbox's oldest partition may be
-- gone by design (payments' inbox is the library's partitioned inbox,
-- fx.partitioned_inbox; migrations/20261124000002_outbox_and_keys_expiry.sql).
-- The library's partitions are shared by its consumers; payments is the
-- pipeline's only one. "!": each is a value, never NULL.
SELECT (SELECT floor FROM orders.key_policy) AS "keys!",
       (SELECT floor FROM orders.outbox_policy) AS "outbox!",
       COALESCE((SELECT lo FROM fx.partitioned_inbox_parts ORDER BY lo LIMIT 1),
                '00000000-0000-0000-0000-000000000000'::uuid) AS "inbox!";

-- the diff of the ids $1 to $2 (the whole: $1 = '00000000-0000-0000-0000-000000000000', $2 = 'ffffffff-ffff-ffff-ffff-ffffffffffff')
-- $1, $2: the range of ids (order ids; msg ids for the inbox's checks).
-- $3, $4: the floors of the idempotency keys and of the outbox (rows of an
-- order below a floor may have expired: orders, charges and the ledger never
-- do). $5: the msg_id floor of the outbox <-> inbox match (the higher of the
-- outbox's and the inbox's floors). Over the whole history all three are
-- '00000000-0000-0000-0000-000000000000'.
WITH
k AS (SELECT effectively.uuid_of(reference) AS order_id, count(*) AS n FROM fx.idempotency_keys
      WHERE reference BETWEEN $1::uuid::text AND $2::uuid::text
      GROUP BY effectively.uuid_of(reference)),
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
              -- The intents the orders since the keys' floor are counted
              -- against: a key below the floor may outlive the floor's move
              -- (keys_expire) or not, by design, and its order is not counted.
              count(*) FILTER (WHERE reference >= $3::uuid::text) AS since_floor,
              count(*) FILTER (WHERE position(convert_to('"order_id":"' || reference || '"', 'UTF8')
                                              IN response_body) = 0) AS foreign_responses
       FROM fx.idempotency_keys WHERE reference BETWEEN $1::uuid::text AND $2::uuid::text),
xs AS (SELECT count(*) AS n, count(*) FILTER (WHERE published_at IS NULL) AS unpublished,
              count(*) FILTER (WHERE aggregate_id >= $4) AS since_floor,
              count(*) FILTER (WHERE failed_at IS NOT NULL) AS failed
       FROM orders.outbox WHERE aggregate_id BETWEEN $1 AND $2),
cs AS (SELECT count(*) AS n, COALESCE(sum(amount_cents), 0)::int8 AS amount
       FROM payments.charges WHERE order_id BETWEEN $1 AND $2),
ls AS (SELECT count(*) AS n, COALESCE(sum(amount_cents), 0)::int8 AS amount
       FROM payments.ledger WHERE order_id BETWEEN $1 AND $2),
ins AS (SELECT count(*) AS n FROM fx.partitioned_inbox
        WHERE consumer = 'payments' AND msg_id BETWEEN $1 AND $2 AND msg_id >= $5),
xm AS (SELECT count(*) AS n FROM orders.outbox WHERE msg_id BETWEEN $1 AND $2 AND msg_id >= $5),
io AS (SELECT count(*) AS n FROM orders.outbox e
       JOIN fx.partitioned_inbox i ON i.consumer = 'payments' AND i.msg_id = e.msg_id
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
       ks.since_floor AS "keys_since_floor!",
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
-- per key, its order id (its reference), its status, and its Location and ETag (each NULL
-- unless the headers hold exactly one). Recon compares each key's with the
-- response orders stores for that order (pipeline::contract::
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
FROM (SELECT effectively.uuid_of(reference) AS order_id, response_status::int4 AS response_code,
             response_headers AS headers,
             COALESCE(jsonb_typeof(response_headers) = 'array'
                      AND jsonb_array_length(response_headers) = 3
                      AND response_headers->0->>0 = 'content-type'
                      AND response_headers->1->>0 = 'location'
                      AND response_headers->2->>0 = 'etag', false) AS usual
      FROM fx.idempotency_keys
      WHERE reference BETWEEN $1::uuid::text AND $2::uuid::text
        AND effectively.uuid_of(reference) IS NOT NULL) AS k;

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
-- deliveries still open, and webhooks claimed but not yet applied. And over
-- Kafka the events payments parked (the inbox could not record them yet, or
-- an earlier event of their order waits): intents not yet applied.
SELECT count(*) AS "dead_letters!",
       count(*) FILTER (WHERE d.kind = 'after_horizon' AND c.order_id IS NOT NULL) AS "late_duplicates!",
       (SELECT count(*) FROM orders.webhook_deliveries w WHERE w.failed_at IS NOT NULL) AS "failed_deliveries!",
       (SELECT count(*) FROM orders.webhook_deliveries w
        WHERE w.delivered_at IS NULL AND w.failed_at IS NULL) AS "open_deliveries!",
       (SELECT count(*) FROM payments.webhook_inbox i WHERE i.processed_at IS NULL) AS "unprocessed_webhooks!",
       (SELECT count(*) FROM payments.parked p) AS "parked_events!"
FROM payments.dead_letters d
LEFT JOIN payments.charges c ON c.order_id = d.order_id AND c.msg_id = d.msg_id;

-- drained?
-- NOT EXISTS is never NULL; "!" tells sqlx's compile-time check so
-- (PostgreSQL reports no nullability for computed columns).
-- $1: the relay leaves the outbox unmarked (Debezium: it streams the rows
-- and writes nothing back), so published_at says nothing; then every row not
-- failed must have reached the inbox (or a dead letter) instead.
SELECT
  NOT EXISTS (SELECT 1 FROM orders.outbox o
              WHERE NOT $1::bool AND o.published_at IS NULL AND o.failed_at IS NULL
                AND NOT EXISTS (SELECT 1 FROM orders.outbox f
                                WHERE f.aggregate_id = o.aggregate_id
                                  AND f.published_at IS NULL AND f.failed_at IS NOT NULL
                                  AND f.id < o.id))
  AND NOT EXISTS (SELECT 1 FROM orders.outbox x
                  WHERE (x.published_at IS NOT NULL OR ($1::bool AND x.failed_at IS NULL))
                    -- an event older than the inbox's oldest partition has no
                    -- record there to find (expired)
                    AND x.msg_id >= COALESCE((SELECT p.lo FROM fx.partitioned_inbox_parts p
                                              ORDER BY p.lo LIMIT 1),
                                             '00000000-0000-0000-0000-000000000000')
                    AND NOT EXISTS (SELECT 1 FROM fx.partitioned_inbox i
                                    WHERE i.consumer = 'payments' AND i.msg_id = x.msg_id)
                    AND NOT EXISTS (SELECT 1 FROM payments.dead_letters d WHERE d.msg_id = x.msg_id)
                    -- over HTTP: a delivery the sender gave up never arrives
                    AND NOT EXISTS (SELECT 1 FROM orders.webhook_deliveries w
                                    WHERE w.msg_id = x.msg_id AND w.failed_at IS NOT NULL))
  -- over Kafka: nothing parked by payments and not yet applied (an event
  -- sent by no outbox, or older than the outbox's floor, is parked too)
  AND NOT EXISTS (SELECT 1 FROM payments.parked)
  -- over HTTP: nothing claimed by the receiver and not yet applied
  AND NOT EXISTS (SELECT 1 FROM payments.webhook_inbox i WHERE i.processed_at IS NULL)
  -- over HTTP: no delivery the sender still has open. The receiver may have
  -- applied it already (its answer lost to a timeout or a kill), so the
  -- inbox alone says drained while the sender's retry is still due, and
  -- recon's open_deliveries would be a race, not drift.
  AND NOT EXISTS (SELECT 1 FROM orders.webhook_deliveries w
                  WHERE w.delivered_at IS NULL AND w.failed_at IS NULL)
  AS "drained!";

-- what the consumer group committed past (--committed-past)
-- The messages payments' consumer group has committed past (`kafka-tool
-- offsets committed-past`): $1 topics, $2 partitions, $3 offsets, $4 their
-- events' msg_ids and $5 their aggregate (order) ids, NULL for a message that
-- is not an event envelope; $6 the inbox's floor, $7 the outbox's floor
-- (floors.sql). The group will never be given these messages again, and
-- payments commits an offset only after the transaction that recorded its
-- message, so each must have left its trace: its msg_id in the inbox, a dead
-- letter at its position, or its event parked. One without is an effect
-- that is gone after its offset was committed (a database that lost
-- committed transactions: an asynchronous failover), unless its msg_id is
-- below the inbox's floor (its inbox row may have expired by design).
-- And an event whose outbox row is gone (its order above the outbox's floor,
-- so not expired) was published from a row the database no longer holds.
-- count(*) is never NULL; "!" tells sqlx's compile-time check so.
WITH c AS (
  SELECT * FROM unnest($1::text[], $2::int4[], $3::int8[], $4::uuid[], $5::uuid[])
           AS c(topic, part, off, msg_id, aggregate_id)),
t AS (
  SELECT c.msg_id, c.aggregate_id,
         (EXISTS (SELECT 1 FROM fx.partitioned_inbox i
                  WHERE i.consumer = 'payments' AND i.msg_id = c.msg_id)
          OR EXISTS (SELECT 1 FROM payments.dead_letters d
                     WHERE d.topic = c.topic AND d.partition = c.part AND d."offset" = c.off)
          OR EXISTS (SELECT 1 FROM payments.parked p WHERE p.msg_id = c.msg_id)) AS recorded
  FROM c)
SELECT count(*) AS "messages!",
       count(*) FILTER (WHERE recorded) AS "recorded!",
       count(*) FILTER (WHERE NOT recorded AND msg_id < $6) AS "expired!",
       count(*) FILTER (WHERE NOT recorded AND (msg_id IS NULL OR msg_id >= $6)) AS "lost!",
       count(*) FILTER (WHERE aggregate_id >= $7
                          AND NOT EXISTS (SELECT 1 FROM orders.outbox o WHERE o.msg_id = t.msg_id))
         AS "without_outbox_row!"
FROM t;

recon: effects vs intents, order by order
  covers: orders, charges, ledger: all; keys: since 2026-12-03T20:46:58.831+00:00; events: since 2026-11-27T20:46:58.392+00:00; events <-> inbox: since 2026-11-27T20:46:58.392+00:00
  intents (idempotency keys)                  1042299
  distinct orders                             1042299
  intents without order                             0
  orders without key                                0
  orders with many keys                             0
  responses naming another order                    0
  responses with wrong status                       0
  responses with wrong Location                     0
  responses with wrong ETag                         0
  outbox rows                                 1042299
  published rows                              1042299
  pending rows                                      0
  failed outbox rows                                0
  orders without event                              0
  events without order                              0
  orders with many events                           0
  event payload mismatches                          0
  inbox msg_ids                               1042299
  events not consumed                               0
  inbox msg_ids without event                       0
  distinct charges                            1042299
  orders without charge                             0
  charges without order                             0
  charge mismatches                                 0
  charges by another event                          0
  charge effects (ledger)                     1042299
  double charges                                    0
  charges without effect                            0
  effects without order                             0
  effect mismatches                                 0
  dead letters                                      0
  late duplicates (dead letters)                    0
  failed webhook deliveries                         0
  open webhook deliveries                           0
  webhooks claimed, not applied                     0
  events parked, not applied                        0
  order amount (cents)                    52111651371
  charge amount (cents)                   52111651371
  effect amount (cents)                   52111651371
deltas (all must be 0):
  distinct_orders - intents                         0  ok
  intents_without_order                             0  ok
  orders_without_key                                0  ok
  orders_with_many_keys                             0  ok
  responses_naming_another_order                    0  ok
  responses_with_wrong_status                       0  ok
  responses_with_wrong_location                     0  ok
  responses_with_wrong_etag                         0  ok
  outbox_rows - distinct_orders                     0  ok
  orders_without_event                              0  ok
  events_without_order                              0  ok
  orders_with_many_events                           0  ok
  event_payload_mismatches                          0  ok
  pending_rows                                      0  ok
  open_deliveries                                   0  ok
  unprocessed_webhooks                              0  ok
  parked_events                                     0  ok
  events_not_consumed                               0  ok
  inbox_without_event                               0  ok
  inbox_msg_ids - outbox_rows                       0  ok
  distinct_charges - distinct_orders                0  ok
  orders_without_charge                             0  ok
  charges_without_order                             0  ok
  charge_mismatches                                 0  ok
  charges_by_another_event                          0  ok
  charge_effects - distinct_charges                 0  ok
  double_charges                                    0  ok
  charges_without_effect                            0  ok
  effects_without_order                             0  ok
  effect_mismatches                                 0  ok
  charge_amount - order_amount                      0  ok
  effect_amount - order_amount                      0  ok
  failed_rows                                       0  ok
  failed_deliveries                                 0  ok
  dead_letters - late_duplicates                    0  ok
result: CLEAN — distinct effects == distinct intents
(the diff took 9.83 s; --jobs 2)
