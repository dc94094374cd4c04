-- The dead letters, and of them the late duplicates: refused as arriving
-- after the dedup horizon (kind after_horizon), yet their msg_id is the one
-- that charged the order they name. Those are provably redeliveries of an
-- applied effect: nothing lost, nothing for an operator to do. Every other
-- dead letter needs a look (README, "Bad input, dead letters and failed rows").
-- count(*) is never NULL; "!" tells sqlx's compile-time check so (PostgreSQL
-- reports no nullability for computed columns).
SELECT count(*) AS "dead_letters!",
       count(*) FILTER (WHERE d.kind = 'after_horizon' AND c.order_id IS NOT NULL) AS "late_duplicates!"
FROM payments.dead_letters d
LEFT JOIN payments.charges c ON c.order_id = d.order_id AND c.msg_id = d.msg_id
