-- The relay runs on the library's engine (`effectively::store::Relay`):
-- a pass reads each shard's oldest pending rows, every row of a key among
-- them, leaving out the rows of a key whose earlier row failed for good
-- (relay/src/outbox.rs, `read_shards`). That probe, one per candidate row,
-- walked every earlier pending row of the key in `outbox_pending_by_aggregate`
-- to find a failed one: a key with 2,000 pending rows cost 2,000 probes of
-- up to 2,000 entries each, and a 10-key backlog drained at 329 rows/s.
-- Failed rows are few (a row refused --max-attempts times): indexed alone,
-- the probe reads none of a healthy key's rows (the library's outbox has
-- the same index, `outbox_failed_by_key`). Rows that never fail are never
-- in it, so an insert costs nothing more.
CREATE INDEX outbox_failed_by_aggregate ON orders.outbox (aggregate_id)
    WHERE published_at IS NULL AND failed_at IS NOT NULL;
