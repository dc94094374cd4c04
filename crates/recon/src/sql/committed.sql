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
FROM t
