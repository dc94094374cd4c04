-- Version 3: the outbox's published rows expire. An index on when each
-- published row was written lets the expiry find the oldest ones without
-- reading the rows still to keep; pending and failed rows are not in it, so
-- they are never expired.
CREATE INDEX outbox_published_by_created_at ON @schema@.outbox (created_at)
    WHERE published_at IS NOT NULL;
