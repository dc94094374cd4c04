-- Relay sharding (crates/relay). Every outbox row belongs to one of 16 shards,
-- a pure function of its aggregate id. A relay worker publishes a shard's rows
-- only while holding that shard's transaction-level advisory lock, and commits
-- (marks the batch published) before the lock is released. So one aggregate's
-- events are never in flight from two workers at once, and batches of a shard
-- follow each other in id order: per-key order holds across any number of
-- relay processes, and a dead relay's lock dies with its transaction.
ALTER TABLE orders.outbox
    ADD COLUMN shard smallint NOT NULL
    GENERATED ALWAYS AS ((abs(uuid_hash(aggregate_id)::bigint) % 16)::smallint) STORED;

CREATE INDEX outbox_pending_by_shard ON orders.outbox (shard, id) WHERE published_at IS NULL;
