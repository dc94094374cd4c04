-- An idempotency key lives its full retention by ONE clock, the database's.
--
-- keys_expire cut by the key's order id, a UUIDv7 minted by the orders
-- host's clock, against the database's now(): an orders clock 11 minutes
-- slow made a key 11 minutes "older" than it was, so with a 10-minute
-- retention it expired at once and a retry 80 s later became a second order
-- (recon stayed CLEAN: the first order lay below the key floor).
--
-- The cut by order id stays (it walks the order-id index oldest first and
-- moves the floor recon reads), and a key now also needs its own created_at,
-- stamped by the database at the insert, to be older than the retention. A
-- slow orders clock can no longer shorten a key's life; a fast one delays
-- its expiry by the skew (orders refuses to start past
-- --max-clock-skew-secs, and warns past 1 s).
CREATE OR REPLACE FUNCTION orders.keys_expire(batch integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    retention interval := (SELECT p.retention FROM orders.key_policy p);
    cut uuid := effectively.v7_floor(now() - retention);
    n integer;
BEGIN
    DELETE FROM orders.idempotency_keys k
    WHERE k.idem_key IN (SELECT i.idem_key FROM orders.idempotency_keys i
                         WHERE i.order_id < cut AND i.created_at < now() - retention
                         ORDER BY i.order_id LIMIT batch);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n < batch THEN
        UPDATE orders.key_policy SET floor = greatest(floor, cut);
    END IF;
    RETURN n;
END
$$;
