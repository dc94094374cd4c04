-- Orders' idempotency keys move into the library's table: orders becomes a
-- user of the library (`effectively::store`), installed before these
-- migrations in schema fx (pipeline::db::migrate; version 4 of the library
-- has the batch claim `fx.claim_keys` and the `reference` column).
--
-- orders.idempotency_keys (idem_key, request_hash, order_id, response_code,
-- response_headers, response_body, created_at) maps onto
-- fx.idempotency_keys (scope, key, request_hash, reference, response_status,
-- response_headers, response_body, created_at): the order id is the key's
-- reference (its text, which sorts as the uuid does: COLLATE "C"), the scope
-- is orders' one scope, '' (every caller shares it until callers have an
-- identity). Every row is copied, with its created_at, so a retry of a key
-- claimed before the move still replays its first response, and each key
-- lives its full retention.
INSERT INTO fx.idempotency_keys
    (scope, key, request_hash, response_status, response_headers, response_body, reference,
     created_at)
SELECT '', k.idem_key, k.request_hash, k.response_code::smallint, k.response_headers,
       k.response_body, k.order_id::text, k.created_at
FROM orders.idempotency_keys k;
DROP TABLE orders.idempotency_keys;

-- The expiry as before (the floor first, then a batch below it; a key also
-- older than the retention by its own created_at, the database's clock),
-- over the library's table: orders' keys are those with an order id as
-- their reference, walked oldest first by the reference index.
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
    DELETE FROM fx.idempotency_keys k
    WHERE (k.scope, k.key) IN (SELECT i.scope, i.key FROM fx.idempotency_keys i
                               WHERE i.reference < cut::text
                                 AND i.created_at < now() - retention
                               ORDER BY i.reference LIMIT batch);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- A key's reference as the order id it names, or NULL when it names none
-- (the library's table may hold keys of other users, with references of
-- their own): recon joins keys to orders through it, and a cast that fails
-- would stop recon. The canonical text only: that is what orders writes,
-- and what sorts as the uuid does.
CREATE FUNCTION effectively.uuid_of(reference text) RETURNS uuid
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN CASE WHEN reference ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
            THEN reference::uuid END;

-- Orders claims keys (inserts and reads them, in its write statement);
-- recon reads them. Nothing else of the library's schema is granted yet.
GRANT USAGE ON SCHEMA fx TO effectively_orders, effectively_recon;
GRANT SELECT, INSERT ON fx.idempotency_keys TO effectively_orders;
GRANT SELECT ON fx.idempotency_keys TO effectively_recon;
