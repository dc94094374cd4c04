-- The WAL relay (`relay --mode wal`, crates/relay/src/wal.rs) reads the
-- outbox from logical replication instead of polling it.
--
-- The publication: inserts into the outbox only. The relay's own marks
-- (UPDATE published_at) and the expiry's DELETEs are not published, so the
-- stream carries each row once, at its commit. Creating it needs no
-- wal_level = logical; streaming from it does.
CREATE PUBLICATION effectively_outbox FOR TABLE orders.outbox WITH (publish = 'insert');

-- The relay's role opens the replication connection and makes its slot, so
-- it needs REPLICATION. (Its heartbeat, pg_logical_emit_message, is open to
-- every role.) Only a superuser can give REPLICATION. An owner that is not
-- one says so and goes on: whoever set the server up gives it
-- (ALTER ROLE effectively_relay REPLICATION), or the relay runs in poll mode.
-- Roles are cluster-wide: databases migrated at once (one per test) would
-- update the same role row ("tuple concurrently updated"), so the change
-- waits for a lock of its own and is made once.
DO $$
BEGIN
    IF (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN
        PERFORM pg_advisory_xact_lock(hashtext('effectively.relay.replication'));
        IF NOT (SELECT rolreplication FROM pg_roles WHERE rolname = 'effectively_relay') THEN
            ALTER ROLE effectively_relay REPLICATION;
        END IF;
    ELSE
        RAISE NOTICE 'not a superuser: effectively_relay not given REPLICATION; --mode wal needs it';
    END IF;
END
$$;
