-- Parked events: a valid Kafka event whose msg_id lies beyond the inbox's
-- partitions (their maintenance behind), but within the clock skew payments
-- accepts, cannot be recorded yet. It used to hold its whole Kafka partition
-- (sought back and paused, its offset never committed past it), so one such
-- event stalled every key of the partition. Now it is parked here, in the
-- transaction whose commit lets the consumer commit the offset past it, and
-- only its own key waits: a later event of an order (the Kafka key) that has
-- parked events is parked behind them, in the same transaction as the check.
-- The parked events are applied in per-key order (`seq`) once the inbox can
-- record them: inbox claim, charge and the delete from here in one
-- transaction (crates/payments/src/park.rs).
--
-- A msg_id further ahead of the database's clock than the skew bound is never
-- parked: it is a dead letter of the new kind 'ahead_of_clock' at once.
--
-- Parking is idempotent (msg_id is the key): a redelivery of a parked event
-- (a crash between the park and the offset commit) parks nothing new.
CREATE TABLE payments.parked (
    msg_id       uuid        PRIMARY KEY,
    -- the order of parking, so the order of the events of one key
    seq          bigint      GENERATED ALWAYS AS IDENTITY UNIQUE,
    order_id     uuid        NOT NULL,
    account_id   bigint      NOT NULL,
    amount_cents bigint      NOT NULL,
    payload_hash bigint      NOT NULL,
    topic        text        NOT NULL,
    partition    integer     NOT NULL,
    "offset"     bigint      NOT NULL,
    msg_key      bytea,
    payload      bytea,
    reason       text        NOT NULL,
    parked_at    timestamptz NOT NULL DEFAULT now()
);
-- A key's parked events, first first: the check a new event of the key
-- makes, and the drain's "is it its key's first".
CREATE INDEX parked_order ON payments.parked (order_id, seq);

ALTER TABLE payments.dead_letters DROP CONSTRAINT dead_letters_kind_check;
ALTER TABLE payments.dead_letters ADD CONSTRAINT dead_letters_kind_check
    CHECK (kind IN ('undecodable', 'rejected', 'msg_id_conflict', 'order_conflict',
                    'after_horizon', 'future_msg_id', 'ahead_of_clock'));

-- Payments parks, reads and applies (deletes) them; recon counts them. The
-- drain locks the rows it applies (FOR UPDATE SKIP LOCKED), which needs an
-- UPDATE grant: of parked_at only, which nothing rewrites.
GRANT SELECT, INSERT, DELETE ON payments.parked TO effectively_payments;
GRANT UPDATE (parked_at) ON payments.parked TO effectively_payments;
GRANT SELECT ON payments.parked TO effectively_recon;
