-- Consume side of the pipeline: the Payments service owns this schema.
--
-- Invariant: for each consumed message, the inbox row and its charge are
-- written in ONE transaction (crates/payments). A redelivered message finds
-- its msg_id in the inbox and is a no-op; a crash before the commit leaves
-- neither, and the redelivery does both.
CREATE SCHEMA IF NOT EXISTS payments;

-- The dedup ledger, keyed by the msg_id carried in the event (outbox.msg_id),
-- never by a Kafka offset: a relay re-publish lands at a new offset.
CREATE TABLE payments.inbox (
    msg_id       uuid        PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE payments.charges (
    charge_id    uuid        PRIMARY KEY,
    order_id     uuid        NOT NULL UNIQUE,   -- belt-and-braces: one charge per order
    msg_id       uuid        NOT NULL,
    account_id   bigint      NOT NULL,
    amount_cents bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- Messages that could not be processed, with everything needed to replay them.
CREATE TABLE payments.dead_letters (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic       text        NOT NULL,
    partition   integer     NOT NULL,
    "offset"    bigint      NOT NULL,
    msg_key     bytea,
    payload     bytea,
    reason      text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (topic, partition, "offset")
);

-- An append-only ledger: one entry per applied charge. Unlike `charges`, it
-- has no uniqueness guard, so applying an effect twice shows here as two
-- entries for one order. The safe consumer writes it in the same
-- transaction as the inbox row; recon checks one entry per order, which is
-- how the split-transaction counter-example's double effect becomes visible.
CREATE TABLE payments.ledger (
    entry_id     bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account_id   bigint      NOT NULL,
    order_id     uuid        NOT NULL,
    msg_id       uuid        NOT NULL,
    amount_cents bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX ledger_by_order ON payments.ledger (order_id);
