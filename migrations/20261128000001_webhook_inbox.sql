-- Payments over HTTP (`payments --source http`, POST /webhooks/orders).
--
-- The receiver acknowledges fast: a verified request is claimed here by ONE
-- statement (INSERT ... ON CONFLICT (msg_id) DO NOTHING) that stores its raw
-- body, and answered; the charge is applied later by the inbox processor,
-- which locks unprocessed rows (FOR UPDATE SKIP LOCKED) and writes the
-- payments.inbox claim, the charge, the ledger entry and processed_at in one
-- transaction. So a request either left its row (the sender may retry: the
-- retry finds it, a duplicate) or nothing (the retry claims it).
--
-- This table is the receipt of each webhook, kept a while after processing
-- (payments --webhook-receipts-kept) so that a retry is answered "duplicate"
-- at once. The dedup record that must outlast the sender's whole retry
-- horizon is payments.inbox, written when the row is processed, with its
-- partitions and their expiry: a retry after its receipt is gone is claimed
-- again here and found applied by the processor (a no-op).
CREATE TABLE payments.webhook_inbox (
    msg_id       uuid        PRIMARY KEY,   -- webhook-id: the event's msg_id
    payload      bytea       NOT NULL,      -- the body as signed
    payload_hash bigint      NOT NULL,      -- decode::payload_hash of the body's event
    received_at  timestamptz NOT NULL DEFAULT now(),
    processed_at timestamptz
);
-- The processor's scan: unprocessed rows in msg_id (mint time) order.
CREATE INDEX webhook_inbox_unprocessed ON payments.webhook_inbox (msg_id)
    WHERE processed_at IS NULL;
-- The pruning of old receipts.
CREATE INDEX webhook_inbox_processed ON payments.webhook_inbox (processed_at)
    WHERE processed_at IS NOT NULL;

-- A webhook that becomes a dead letter has no topic, partition or offset:
-- it is known by its msg_id. One dead letter per msg_id and kind (a retry of
-- a conflicting request is not recorded twice).
ALTER TABLE payments.dead_letters
    ALTER COLUMN topic DROP NOT NULL,
    ALTER COLUMN partition DROP NOT NULL,
    ALTER COLUMN "offset" DROP NOT NULL,
    ADD COLUMN transport text NOT NULL DEFAULT 'kafka' CHECK (transport IN ('kafka', 'http')),
    ADD CONSTRAINT dead_letters_origin CHECK (
        CASE transport
            WHEN 'kafka' THEN topic IS NOT NULL AND partition IS NOT NULL AND "offset" IS NOT NULL
            ELSE topic IS NULL AND partition IS NULL AND "offset" IS NULL AND msg_id IS NOT NULL
        END);
CREATE UNIQUE INDEX dead_letters_http ON payments.dead_letters (msg_id, kind)
    WHERE transport = 'http';

GRANT SELECT, INSERT, DELETE ON payments.webhook_inbox TO effectively_payments;
GRANT UPDATE (processed_at) ON payments.webhook_inbox TO effectively_payments;
-- ON CONFLICT reads the arbiter index's columns.
GRANT SELECT (msg_id, kind, transport) ON payments.dead_letters TO effectively_payments;
GRANT SELECT ON payments.webhook_inbox TO effectively_recon;
