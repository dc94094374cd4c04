-- The floors of the keys and of the outbox move up to the cut BEFORE the
-- rows below it are deleted, in the same transaction.
--
-- Recon checks each order against a store only from the store's floor up:
-- at and above the floor every row must be there, below it rows may be gone
-- (crates/recon/src/sql/part.sql). keys_expire and outbox_expire deleted in
-- batches of 5,000, one transaction each (effectively::lifecycle drains them
-- once a minute), and moved the floor only in the call that found fewer than
-- a batch left. Between those calls the rows of orders above the old floor
-- were already gone: a recon that ran then reported every one of them as
-- drift (orders_without_key; orders_without_event for the outbox). At 1,000
-- orders/s with a 1-minute key retention that was 49,973 "orders without
-- their key" on a correct system (experiments/key-expiry).
--
-- Now each call first moves its floor to the cut (never down), then deletes
-- up to a batch of what lies below it, in one transaction: at every commit,
-- what is at and above the floor is all there. What lies below the floor and
-- is not deleted yet (the rest of a drain, a key not yet old enough by its
-- own created_at, an outbox row not yet published) stays, and recon does
-- not count it against the orders below the floor either.
CREATE OR REPLACE FUNCTION orders.keys_expire(batch integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    retention interval := (SELECT p.retention FROM orders.key_policy p);
    cut uuid := effectively.v7_floor(now() - retention);
    n integer;
BEGIN
    UPDATE orders.key_policy SET floor = cut WHERE floor < cut;
    DELETE FROM orders.idempotency_keys k
    WHERE k.idem_key IN (SELECT i.idem_key FROM orders.idempotency_keys i
                         WHERE i.order_id < cut AND i.created_at < now() - retention
                         ORDER BY i.order_id LIMIT batch);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

CREATE OR REPLACE FUNCTION orders.outbox_expire(batch integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cut uuid := effectively.v7_floor(now() - (SELECT p.retention FROM orders.outbox_policy p));
    n integer;
BEGIN
    UPDATE orders.outbox_policy SET floor = cut WHERE floor < cut;
    DELETE FROM orders.outbox e
    WHERE e.id IN (SELECT o.id FROM orders.outbox o
                   WHERE o.msg_id < cut AND o.published_at IS NOT NULL
                   ORDER BY o.msg_id LIMIT batch);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;
