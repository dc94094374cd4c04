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
FROM j, ks, xs, cs, ls, ins, xm, io
