-- Least privilege: one login role per service, each granted exactly what its
-- statements need on this database. The migrations themselves run as the
-- owner (the role that creates, and so owns, both schemas); no service runs
-- them.
--
--   effectively_orders    writes the orders schema: keys, orders, outbox rows
--   effectively_relay     reads the outbox and marks rows published / failed
--   effectively_payments  writes the payments schema: inbox, charges, ledger,
--                         dead letters
--   effectively_recon     reads both schemas, writes nothing
--
-- Roles are cluster-wide, grants are per database. So the roles are created
-- here when missing (every database migrated on a server, such as one per
-- test, finds them or makes them), without a password: the embedded stack
-- trusts 127.0.0.1; where passwords are checked (compose) they are set by
-- whoever sets up the server, before this runs (compose/postgres-init.sql).
-- Two databases migrated at once may both try to create a role: the loser's
-- duplicate is ignored. The owner needs CREATEROLE (or the roles made
-- beforehand).
--
-- A table added by a later migration is granted there, to the roles whose
-- statements use it; crates/effectively/tests/roles.rs pins the whole matrix.
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['effectively_orders', 'effectively_relay',
                             'effectively_payments', 'effectively_recon'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I LOGIN', r);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL; -- created meanwhile by a concurrent migration
            END;
        END IF;
    END LOOP;
END
$$;

-- Orders: the idempotency key, the order and its outbox row, in one
-- transaction; reads an order back (GET) and a stored response (replay).
-- The outbox is insert-only for it (RETURNING id needs that one column).
GRANT USAGE ON SCHEMA orders TO effectively_orders;
GRANT SELECT, INSERT ON orders.orders, orders.idempotency_keys TO effectively_orders;
GRANT INSERT (aggregate_id, msg_id, event_type, payload), SELECT (id)
    ON orders.outbox TO effectively_orders;

-- Relay: claims pending rows (SELECT … FOR UPDATE needs an UPDATE grant),
-- marks them published, counts failed attempts. Nothing of the orders and
-- keys, no insert, no delete.
GRANT USAGE ON SCHEMA orders TO effectively_relay;
GRANT SELECT ON orders.outbox TO effectively_relay;
GRANT UPDATE (published_at, attempts, last_error, failed_at)
    ON orders.outbox TO effectively_relay;

-- Payments: claims msg_ids in the inbox, writes charge and ledger entry,
-- dead-letters what it cannot apply. Reads the inbox (payload fingerprints)
-- and the charges (which msg_id charged an order); of the dead letters only
-- the columns of its ON CONFLICT target, which the server requires.
GRANT USAGE ON SCHEMA payments TO effectively_payments;
GRANT SELECT, INSERT ON payments.inbox, payments.charges TO effectively_payments;
GRANT INSERT ON payments.ledger, payments.dead_letters TO effectively_payments;
GRANT SELECT (topic, partition, "offset") ON payments.dead_letters TO effectively_payments;

-- Recon: the read-only diff of both schemas.
GRANT USAGE ON SCHEMA orders, payments TO effectively_recon;
GRANT SELECT ON ALL TABLES IN SCHEMA orders TO effectively_recon;
GRANT SELECT ON ALL TABLES IN SCHEMA payments TO effectively_recon;
