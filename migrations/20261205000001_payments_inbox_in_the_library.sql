-- Payments' inbox moves into the library's partitioned inbox: payments
-- becomes a user of the library (`effectively::store`, installed before
-- these migrations in schema fx by pipeline::db::migrate; version 5 of the
-- library has fx.partitioned_inbox, range-partitioned by msg_id as
-- payments.inbox was, kept by the same make-ahead and drop-whole upkeep).
--
-- payments.inbox (msg_id, processed_at, payload_hash bigint) maps onto
-- fx.partitioned_inbox (consumer, msg_id, payload_hash bytea, received_at):
-- the consumer is 'payments', the fingerprint its 8 bytes big-endian (what
-- payments now hands the library), a row from before fingerprints ('' in
-- the library) takes every copy as a duplicate, as it did. Every row is
-- copied, so a redelivery of an event applied before the move is still a
-- duplicate.
--
-- The library's partitions start where payments' expiry had reached (its
-- oldest partition's lower bound): an event older than that was refused as
-- after the dedup horizon before the move and still is; none is claimed
-- anew. They reach as far ahead as payments' did, in spans of a day
-- (payments' upkeep goes on in its own spans from there).
SELECT fx.partitioned_inbox_extend(
    COALESCE((SELECT effectively.v7_time(p.hi) FROM payments.inbox_partitions p
              ORDER BY p.hi DESC LIMIT 1), now()),
    interval '1 day',
    COALESCE((SELECT p.lo FROM payments.inbox_partitions p ORDER BY p.lo LIMIT 1),
             '00000000-0000-0000-0000-000000000000'));

INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash, received_at)
SELECT 'payments', i.msg_id, COALESCE(int8send(i.payload_hash), ''::bytea), i.processed_at
FROM payments.inbox i;

DROP FUNCTION payments.inbox_window();
DROP FUNCTION payments.inbox_extend(timestamptz, interval);
DROP FUNCTION payments.inbox_expire(interval);
DROP TABLE payments.inbox;
DROP TABLE payments.inbox_partitions;

-- Payments claims in the library's inbox and keeps its partitions (the
-- functions run as their owner); recon reads it.
GRANT USAGE ON SCHEMA fx TO effectively_payments;
GRANT SELECT, INSERT ON fx.partitioned_inbox TO effectively_payments;
GRANT SELECT ON fx.partitioned_inbox_parts TO effectively_payments;
GRANT EXECUTE ON FUNCTION fx.partitioned_inbox_extend(timestamptz, interval, uuid),
                          fx.partitioned_inbox_expire(text, interval) TO effectively_payments;
GRANT SELECT ON fx.partitioned_inbox, fx.partitioned_inbox_parts TO effectively_recon;
