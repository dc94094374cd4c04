-- The library's tables, in the schema the store names (@schema@ below is
-- replaced by its quoted name). Version 1: the outbox, the inbox and the
-- idempotency keys.

-- The transactional outbox: a row per event, written in the caller's
-- transaction beside its business row; a relay publishes the pending rows
-- and marks them. `id` is the publish order; `shard` (0..15, a hash of
-- `key`) is the unit a relay leases, so one key's events are published by
-- one relay at a time, in order.
CREATE TABLE @schema@.outbox (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    msg_id       uuid        NOT NULL UNIQUE,
    destination  text        NOT NULL CHECK (destination <> ''),
    key          text        NOT NULL,
    event_type   text        NOT NULL CHECK (event_type <> ''),
    payload      bytea       NOT NULL,
    content_type text        NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '[]',
    shard        smallint    NOT NULL CHECK (shard BETWEEN 0 AND 15),
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    failed_at    timestamptz,
    error        text
);
-- A relay's claim: a shard's pending rows in id order.
CREATE INDEX outbox_pending ON @schema@.outbox (shard, id)
    WHERE published_at IS NULL AND failed_at IS NULL;
-- A failed row holds its key's later events back: found by key.
CREATE INDEX outbox_failed_by_key ON @schema@.outbox (key)
    WHERE published_at IS NULL AND failed_at IS NOT NULL;

-- Wakes a relay on commit (NOTIFY is delivered at commit, once per
-- transaction and payload): the channel is the schema's own.
CREATE FUNCTION @schema@.outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.outbox', '');
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_notify AFTER INSERT ON @schema@.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION @schema@.outbox_notify();

-- The inbox: a row per message a consumer applied, claimed in the
-- transaction of its effect. The primary key is the proof: a message
-- delivered again finds its row and changes nothing.
CREATE TABLE @schema@.inbox (
    consumer     text        NOT NULL CHECK (consumer <> ''),
    msg_id       text        NOT NULL CHECK (msg_id <> ''),
    payload_hash bytea       NOT NULL,
    sent_at      timestamptz NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, msg_id)
);
-- The expiry deletes a consumer's rows by the time their message was sent.
CREATE INDEX inbox_by_sent_at ON @schema@.inbox (consumer, sent_at);

-- Idempotency keys: a row per (scope, key), claimed in the transaction of
-- the request's work; the response is stored in it before the commit and
-- replayed byte for byte to every retry.
CREATE TABLE @schema@.idempotency_keys (
    scope            text        NOT NULL,
    key              text        NOT NULL CHECK (key <> ''),
    request_hash     bytea       NOT NULL,
    response_status  smallint,
    response_headers jsonb,
    response_body    bytea,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, key)
);
CREATE INDEX idempotency_keys_by_created_at ON @schema@.idempotency_keys (created_at);
