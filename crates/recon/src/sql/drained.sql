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
  AS "drained!"
