-- The webhook sender (`relay --sink http`): each outbox row is fanned out,
-- in the relay's claim transaction, into one delivery per destination, and
-- the outbox row is marked published by that same commit (the hop from the
-- outbox to this table is one transaction: nothing to lose, nothing to
-- double). The deliveries are then sent at least once each, per destination.
--
-- A delivery carries the exact bytes it sends (the encoded envelope), so it
-- does not depend on its outbox row, which expires on its own schedule.
--
-- State: pending (delivered_at and failed_at NULL; due at next_attempt_at),
-- delivered, or failed (given up: after the last attempt, or refused for
-- good by the receiver). A claimed attempt moves next_attempt_at past the
-- attempt's timeout: that is its lease; a sender that dies mid-attempt
-- leaves the row due again when the lease runs out.
CREATE TABLE orders.webhook_deliveries (
    destination     text        NOT NULL,
    outbox_id       bigint      NOT NULL,
    aggregate_id    uuid        NOT NULL,   -- the key whose order is kept per destination
    msg_id          uuid        NOT NULL,   -- webhook-id and Idempotency-Key
    body            bytea       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_attempt_at timestamptz,
    last_status     integer,                -- the last attempt's HTTP status (NULL: no answer)
    last_error      text,
    delivered_at    timestamptz,
    failed_at       timestamptz,
    replays         integer     NOT NULL DEFAULT 0,
    PRIMARY KEY (destination, outbox_id),
    CHECK (delivered_at IS NULL OR failed_at IS NULL)
);
-- The claim: a destination's due rows.
CREATE INDEX webhook_deliveries_due ON orders.webhook_deliveries (destination, next_attempt_at, outbox_id)
    WHERE delivered_at IS NULL AND failed_at IS NULL;
-- Per-key order: "has this key an earlier open delivery to this destination?"
CREATE INDEX webhook_deliveries_open_by_key ON orders.webhook_deliveries (destination, aggregate_id, outbox_id)
    WHERE delivered_at IS NULL AND failed_at IS NULL;
-- Replay and recon: the failed ones.
CREATE INDEX webhook_deliveries_failed ON orders.webhook_deliveries (destination, failed_at)
    WHERE failed_at IS NOT NULL;

-- Every attempt, for the operator and for experiment 9's plot of the
-- schedule: when, how it ended, how long it took.
CREATE TABLE orders.webhook_attempts (
    destination text        NOT NULL,
    outbox_id   bigint      NOT NULL,
    attempt     integer     NOT NULL,
    started_at  timestamptz NOT NULL,
    duration_ms integer     NOT NULL,
    status      integer,                    -- NULL: no answer (timeout, refused connection)
    outcome     text        NOT NULL CHECK (outcome IN ('delivered', 'retry', 'failed', 'gone')),
    error       text,
    PRIMARY KEY (destination, outbox_id, attempt)
);

-- A destination that answered 410 Gone is disabled until an operator enables
-- it again (`relay webhooks enable`); its deliveries wait, pending.
CREATE TABLE orders.webhook_destinations (
    destination text        PRIMARY KEY,
    disabled_at timestamptz,
    reason      text
);

GRANT SELECT, INSERT, DELETE ON orders.webhook_deliveries TO effectively_relay;
GRANT UPDATE (attempts, next_attempt_at, last_attempt_at, last_status, last_error,
              delivered_at, failed_at, replays)
    ON orders.webhook_deliveries TO effectively_relay;
GRANT SELECT, INSERT, DELETE ON orders.webhook_attempts TO effectively_relay;
GRANT SELECT, INSERT, UPDATE ON orders.webhook_destinations TO effectively_relay;
GRANT SELECT ON orders.webhook_deliveries, orders.webhook_attempts, orders.webhook_destinations
    TO effectively_recon;
