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
LEFT JOIN payments.charges c ON c.order_id = d.order_id AND c.msg_id = d.msg_id
