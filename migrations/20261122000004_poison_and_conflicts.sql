-- Hostile input (issue: no message stops a partition).
--
-- Relay: an outbox row that can never be published (its payload is not
-- JSON, it is over the broker's size limit) is retried a bounded number of
-- times and then marked failed with its error. A failed row keeps
-- published_at NULL on purpose: it still blocks the later events of its own
-- aggregate (per-key order), and only those; recon reports it.
ALTER TABLE orders.outbox
    ADD COLUMN attempts   integer     NOT NULL DEFAULT 0,
    ADD COLUMN last_error text,
    ADD COLUMN failed_at  timestamptz;

-- The claim takes only the first pending row of each aggregate; this index
-- answers "has this aggregate an earlier pending (or failed) row?" with one
-- probe, so a key's backlog or its failed row never starves its shard.
CREATE INDEX outbox_pending_by_aggregate ON orders.outbox (aggregate_id, id)
    WHERE published_at IS NULL;

-- Payments: the first delivery of a msg_id records a fingerprint of its
-- payload (the first 8 bytes of its BLAKE3 hash), so that a redelivery that
-- carries another payload under the same msg_id is told from a true
-- duplicate. NULL for rows claimed before this migration.
ALTER TABLE payments.inbox ADD COLUMN payload_hash bigint;

-- Why a message is a dead letter: `undecodable` (not an order.created event
-- we can read), `rejected` (the database refused to apply it; it was
-- isolated from its batch), `msg_id_conflict` (a msg_id already applied with
-- another payload), `order_conflict` (a new msg_id for an order already
-- charged). The first effect always stands.
-- msg_id is the event's when it could be read (every kind but most
-- undecodable ones), so a published event that became a dead letter is
-- accounted for, not waited for.
ALTER TABLE payments.dead_letters
    ADD COLUMN kind text NOT NULL DEFAULT 'undecodable'
        CHECK (kind IN ('undecodable', 'rejected', 'msg_id_conflict', 'order_conflict')),
    ADD COLUMN msg_id uuid;
