-- Orders' NOTIFY names the relay shards of the rows it wrote (the write
-- statement's RETURNING shard), so the relay wakes only those shards' loops.
-- RETURNING needs SELECT on the columns it returns: orders reads that one
-- column of the outbox besides id, and still nothing else of it.
GRANT SELECT (shard) ON orders.outbox TO effectively_orders;
