-- Version 4: idempotency keys claimed a batch at a time, in one round trip,
-- by a function a caller may also compose into its own statement.
--
-- `reference` names what the request created (an order id, a charge id):
-- stored with the key when the caller knows it at the claim, so that a key
-- can be found from its effect and an effect from its key (an audit, a
-- reconciliation). Nullable: the keys of version 1 have none. Compared byte
-- by byte (COLLATE "C"): a reference is an identifier, not a word, so a
-- range of ids (UUIDs as text) sorts as their bytes whatever the database's
-- locale.
ALTER TABLE @schema@.idempotency_keys ADD COLUMN reference text COLLATE "C";
CREATE INDEX idempotency_keys_by_reference ON @schema@.idempotency_keys (reference)
    WHERE reference IS NOT NULL;

-- claim_keys: claims the keys of one scope for a batch of requests, in the
-- caller's transaction. Arguments, one array element per request (the
-- arrays of equal length): the key, the request's fingerprint, and the
-- response to store with the key (status, headers as a JSON array of
-- [name, value] pairs, body) and its reference, each NULL when not known at
-- the claim (the response is then stored by a later UPDATE in the same
-- transaction, as Keys::complete does).
--
-- One row per request, in the order given (`n`, from 1):
--   claimed           true: the key was free and is now this transaction's;
--                     do the work and commit (a rollback frees the key).
--   request_hash ...  when not claimed: the key's row (its fingerprint, its
--                     stored response or NULLs, its reference). A request
--                     hash that differs from the caller's is a reused key.
--                     All NULL: the row was there for the insert and gone
--                     for the read (deleted by an expiry in between): claim
--                     that key again.
--
-- The free keys are inserted in key order, so two batches that share keys
-- wait for each other's rows in one order and never deadlock. A key taken
-- by a transaction still in flight makes the insert wait for its commit. The
-- read is a statement of its own (VOLATILE: a fresh snapshot), so it sees a
-- row committed while the insert waited. A key given twice in one batch is
-- claimed by its first copy; the later copies read the row the first wrote
-- (the same request: replayed, or reused with another). The read is a
-- LATERAL ... LIMIT 1 per key, which PostgreSQL cannot flatten into a join:
-- an index lookup per key, whatever plan it caches for the function.
CREATE FUNCTION @schema@.claim_keys(
    p_scope text, p_keys text[], p_hashes bytea[], p_statuses smallint[],
    p_headers jsonb[], p_bodies bytea[], p_references text[])
RETURNS TABLE (n bigint, claimed boolean, request_hash bytea, response_status smallint,
               response_headers jsonb, response_body bytea, reference text)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    taken text[];
BEGIN
    IF cardinality(p_hashes) <> cardinality(p_keys)
       OR cardinality(p_statuses) <> cardinality(p_keys)
       OR cardinality(p_headers) <> cardinality(p_keys)
       OR cardinality(p_bodies) <> cardinality(p_keys)
       OR cardinality(p_references) <> cardinality(p_keys) THEN
        RAISE EXCEPTION 'claim_keys: the arrays differ in length' USING ERRCODE = '22023';
    END IF;
    WITH inserted AS (
        INSERT INTO @schema@.idempotency_keys AS k
            (scope, key, request_hash, response_status, response_headers, response_body,
             reference)
        SELECT p_scope, u.key, u.hash, u.status, u.headers, u.body, u.ref
        FROM unnest(p_keys, p_hashes, p_statuses, p_headers, p_bodies, p_references)
             AS u(key, hash, status, headers, body, ref)
        ORDER BY u.key
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING k.key
    )
    SELECT coalesce(array_agg(inserted.key), '{}') INTO taken FROM inserted;
    RETURN QUERY
        SELECT u.n,
               u.first AND u.key = ANY (taken),
               s.request_hash, s.response_status, s.response_headers, s.response_body,
               s.reference
        FROM (SELECT g.key, g.n, g.n = min(g.n) OVER (PARTITION BY g.key) AS first
              FROM unnest(p_keys) WITH ORDINALITY AS g(key, n)) AS u
        LEFT JOIN LATERAL (
            SELECT t.request_hash, t.response_status, t.response_headers, t.response_body,
                   t.reference
            FROM @schema@.idempotency_keys AS t
            WHERE NOT (u.first AND u.key = ANY (taken)) AND t.scope = p_scope AND t.key = u.key
            LIMIT 1
        ) AS s ON true
        ORDER BY u.n;
END
$$;
