-- count(*) is never NULL; "!" tells sqlx's compile-time check so (PostgreSQL
-- reports no nullability for computed columns).
SELECT count(*) AS "dead_letters!" FROM payments.dead_letters
