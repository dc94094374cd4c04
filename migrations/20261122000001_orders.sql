-- Publish side of the pipeline: the Orders service owns this schema.
--
-- Invariant: an idempotency_keys row, its orders row and its outbox row are
-- written in ONE transaction (crates/orders/src/store.rs). Either all three
-- exist or none does, so a committed order is always eventually published and
-- a rolled-back request leaves no key behind to block its retry.
CREATE SCHEMA IF NOT EXISTS orders;

CREATE TABLE orders.orders (
    order_id     uuid        PRIMARY KEY,
    account_id   bigint      NOT NULL CHECK (account_id > 0),
    amount_cents bigint      NOT NULL CHECK (amount_cents > 0),
    status       text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- Synchronous-edge dedup. The stored response is replayed byte for byte, so it
-- is kept as bytes (jsonb would normalise whitespace and key order).
CREATE TABLE orders.idempotency_keys (
    idem_key         text        PRIMARY KEY CHECK (octet_length(idem_key) BETWEEN 1 AND 255),
    request_hash     bytea       NOT NULL,
    order_id         uuid        NOT NULL,
    response_code    integer     NOT NULL,
    response_headers jsonb       NOT NULL,
    response_body    bytea       NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);

-- Transactional outbox. `id` gives the publish order; `msg_id` is the stable
-- identity the consumer deduplicates on (never a Kafka offset).
CREATE TABLE orders.outbox (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_id uuid        NOT NULL,
    msg_id       uuid        NOT NULL UNIQUE,
    event_type   text        NOT NULL,
    payload      bytea       NOT NULL,
    published_at timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- Only pending rows are indexed: the relay's claim query stays an index scan
-- of the backlog, however many rows have been published.
CREATE INDEX outbox_pending ON orders.outbox (id) WHERE published_at IS NULL;

-- Wake the relay: one NOTIFY per inserting statement, delivered by Postgres
-- only when the transaction commits (and folded into one per transaction).
CREATE FUNCTION orders.notify_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('orders_outbox', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON orders.outbox
    FOR EACH STATEMENT EXECUTE FUNCTION orders.notify_outbox();
