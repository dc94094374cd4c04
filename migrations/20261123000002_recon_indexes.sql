-- Recon matches every table by order id in one sorted pass: merge joins over
-- index scans, in order-id ranges that run side by side on connections that
-- share one snapshot (crates/recon). Orders, charges and the ledger already
-- had an index on their order id; the outbox and the idempotency keys get
-- one. On the write path this is one more btree insert per order in each
-- table, at the right edge of the index (order ids are UUIDv7).
CREATE INDEX outbox_by_aggregate ON orders.outbox (aggregate_id);
CREATE INDEX idempotency_keys_by_order ON orders.idempotency_keys (order_id);
