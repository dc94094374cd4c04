-- The relay's mark becomes a HOT update: the outbox's pending state moves out
-- of its indexed columns into a narrow table the outbox's triggers keep.
--
-- Both partial indexes over pending rows named published_at in their
-- predicates, and PostgreSQL counts a predicate's columns as indexed: every
-- `UPDATE … SET published_at` wrote a new row version and an entry in each of
-- the outbox's three full indexes (4.2 WAL records, 490 bytes and 20 buffers
-- a row; 82% of the relay's statement time at 1,000 orders/s, FINDINGS.md
-- §15). With no index of the outbox naming published_at or failed_at, a mark
-- that finds room on its page writes one heap record and no index entry.
--
-- orders.outbox_pending holds one row per outbox row not yet published
-- (pending or failed): its id, shard and aggregate, and whether it failed.
-- * The outbox stays the one source of truth. Statement-level triggers with
--   transition tables keep the pending table in the same transaction as the
--   statement that changed the outbox, whoever ran it: orders' insert, the
--   relay's mark and failures, the WAL relay, a bench's or an operator's
--   `UPDATE … SET published_at = NULL`. A row is in the pending table
--   exactly when its published_at is NULL, and flagged exactly when its
--   failed_at is set.
-- * The claim, the "earlier pending row of this aggregate" check, the
--   backlog's count and age and recon's drained check read it. Its indexes
--   keep the shapes of the dropped ones: (shard, id) over rows not failed for
--   the claim's scan, (aggregate_id, id) over every row for the check. The
--   claim's plan fix stands (migrations/20261127000001_outbox_claim_plan.sql):
--   the only index the check can use leads with the aggregate.
-- * The functions run as their owner: no service writes the pending table
--   but through the outbox.
-- * The outbox keeps 15% of each page free for the marks' new versions.
--   (Pages written before this migration fill up as before.)
LOCK TABLE orders.outbox IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE orders.outbox_pending (
    id           bigint   PRIMARY KEY,
    shard        smallint NOT NULL,
    aggregate_id uuid     NOT NULL,
    failed       boolean  NOT NULL DEFAULT false
);
CREATE INDEX outbox_pending_claim ON orders.outbox_pending (shard, id) WHERE NOT failed;
CREATE INDEX outbox_pending_key ON orders.outbox_pending (aggregate_id, id);

-- Inserted rows: the unpublished ones become pending (a row can be inserted
-- published or failed: recon's seed, the tests).
CREATE FUNCTION orders.outbox_pending_on_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO orders.outbox_pending (id, shard, aggregate_id, failed)
    SELECT n.id, n.shard, n.aggregate_id, n.failed_at IS NOT NULL
    FROM new_rows n WHERE n.published_at IS NULL;
    RETURN NULL;
END
$$;

-- Updated rows: published ones leave; unpublished ones are there with their
-- failed flag (a row whose published_at was set back to NULL comes back).
-- The relay's mark does the first half only: its upsert reads no row.
CREATE FUNCTION orders.outbox_pending_on_update() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM orders.outbox_pending p
    USING new_rows n WHERE p.id = n.id AND n.published_at IS NOT NULL;
    INSERT INTO orders.outbox_pending AS p (id, shard, aggregate_id, failed)
    SELECT n.id, n.shard, n.aggregate_id, n.failed_at IS NOT NULL
    FROM new_rows n WHERE n.published_at IS NULL
    ON CONFLICT (id) DO UPDATE SET failed = excluded.failed
        WHERE p.failed IS DISTINCT FROM excluded.failed;
    RETURN NULL;
END
$$;

-- Deleted rows: the expiry deletes only published rows, so this reads
-- nothing then; an unpublished row deleted by hand must not block its key.
CREATE FUNCTION orders.outbox_pending_on_delete() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM orders.outbox_pending p
    USING old_rows o WHERE p.id = o.id AND o.published_at IS NULL;
    RETURN NULL;
END
$$;

-- A truncated outbox (the benches' and the experiments' reset) has nothing
-- pending.
CREATE FUNCTION orders.outbox_pending_on_truncate() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    TRUNCATE orders.outbox_pending;
    RETURN NULL;
END
$$;

REVOKE EXECUTE ON FUNCTION orders.outbox_pending_on_insert(), orders.outbox_pending_on_update(),
    orders.outbox_pending_on_delete(), orders.outbox_pending_on_truncate() FROM PUBLIC;

CREATE TRIGGER outbox_pending_insert AFTER INSERT ON orders.outbox
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION orders.outbox_pending_on_insert();
CREATE TRIGGER outbox_pending_update AFTER UPDATE ON orders.outbox
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION orders.outbox_pending_on_update();
CREATE TRIGGER outbox_pending_delete AFTER DELETE ON orders.outbox
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION orders.outbox_pending_on_delete();
CREATE TRIGGER outbox_pending_truncate AFTER TRUNCATE ON orders.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION orders.outbox_pending_on_truncate();

-- The rows unpublished now: the lock, taken first, holds every writer of the
-- outbox until the triggers and the copy commit.
INSERT INTO orders.outbox_pending (id, shard, aggregate_id, failed)
SELECT id, shard, aggregate_id, failed_at IS NOT NULL
FROM orders.outbox WHERE published_at IS NULL;

DROP INDEX orders.outbox_pending_by_shard;
DROP INDEX orders.outbox_pending_by_aggregate;
ALTER TABLE orders.outbox SET (fillfactor = 85);

-- The relay claims (SELECT … FOR UPDATE needs UPDATE) and counts the
-- backlog; recon reads it.
GRANT SELECT, UPDATE (failed) ON orders.outbox_pending TO effectively_relay;
GRANT SELECT ON orders.outbox_pending TO effectively_recon;
