-- The outbox and the idempotency keys expire too, in small batches (neither
-- can be partitioned by time without giving up a uniqueness it needs: the
-- key's text, the outbox's publish order by id).
--
-- Each store expires by the UUIDv7 time of an id it holds (the outbox by
-- msg_id, a key by its order_id, both minted when the request was first
-- written) and records its floor: every row it may delete below the floor is
-- gone. Recon reads the floors and checks each order against the stores that
-- still cover it (crates/recon).
--
-- The retentions are rows of the database, the owner's to change; the
-- services read them (the relay and orders delete by them, payments adds the
-- outbox's to its redelivery horizon).

ALTER TABLE orders.outbox_policy
    ADD COLUMN floor uuid NOT NULL DEFAULT '00000000-0000-0000-0000-000000000000';

CREATE TABLE orders.key_policy (
    only_row  boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    retention interval    NOT NULL CHECK (retention > interval '0'),
    floor     uuid        NOT NULL DEFAULT '00000000-0000-0000-0000-000000000000',
    set_at    timestamptz NOT NULL DEFAULT now()
);
INSERT INTO orders.key_policy (retention) VALUES (interval '24 hours');

-- Deletes up to `batch` published outbox rows minted before the retention,
-- oldest first; when fewer were left, the floor moves up to the cut. A row
-- not published (pending, or failed) is never deleted: it is an intent still
-- on its way. Returns how many it deleted.
CREATE FUNCTION orders.outbox_expire(batch integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cut uuid := effectively.v7_floor(now() - (SELECT p.retention FROM orders.outbox_policy p));
    n integer;
BEGIN
    DELETE FROM orders.outbox e
    WHERE e.id IN (SELECT o.id FROM orders.outbox o
                   WHERE o.msg_id < cut AND o.published_at IS NOT NULL
                   ORDER BY o.msg_id LIMIT batch);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n < batch THEN
        UPDATE orders.outbox_policy SET floor = greatest(floor, cut);
    END IF;
    RETURN n;
END
$$;

-- Deletes up to `batch` idempotency keys first used before the key
-- retention, oldest first; when fewer were left, the floor moves up to the
-- cut. A retry of an expired key is a new request. Returns how many.
CREATE FUNCTION orders.keys_expire(batch integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    cut uuid := effectively.v7_floor(now() - (SELECT p.retention FROM orders.key_policy p));
    n integer;
BEGIN
    DELETE FROM orders.idempotency_keys k
    WHERE k.idem_key IN (SELECT i.idem_key FROM orders.idempotency_keys i
                         WHERE i.order_id < cut ORDER BY i.order_id LIMIT batch);
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n < batch THEN
        UPDATE orders.key_policy SET floor = greatest(floor, cut);
    END IF;
    RETURN n;
END
$$;

REVOKE EXECUTE ON FUNCTION orders.outbox_expire(integer), orders.keys_expire(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION orders.outbox_expire(integer) TO effectively_relay;
GRANT EXECUTE ON FUNCTION orders.keys_expire(integer) TO effectively_orders;
GRANT SELECT ON orders.key_policy TO effectively_orders, effectively_recon;
