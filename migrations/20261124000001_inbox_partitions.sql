-- Bounded dedup: the inbox is range-partitioned by msg_id, so expiry drops
-- whole partitions (no delete storm, no bloat) and a message whose dedup
-- record may have expired is refused instead of applied twice.
--
-- A msg_id is a UUIDv7 minted when the outbox row is written: its first 48
-- bits are the Unix time in milliseconds, and PostgreSQL orders uuids by
-- their bytes, so a range of msg_ids is a range of mint times. The
-- partition key is the primary key itself, so msg_id stays unique across the
-- whole table (PostgreSQL requires a unique key of a partitioned table to
-- include the partition key; here it is the key).
--
-- The partitions tile one interval [floor, ceiling) without gaps, listed in
-- payments.inbox_partitions. There is no DEFAULT partition on purpose: a row
-- below the floor (expired) or at/above the ceiling (not created yet) has no
-- partition, so the database itself refuses to record it. The consumer
-- checks the window first (payments.inbox_window) and dead-letters such a
-- message with its reason: kind 'after_horizon' (older than every retained
-- partition: it may be a duplicate whose record expired, so it is never
-- applied) or 'future_msg_id' (minted ahead of the partitions created so far:
-- a producer clock far ahead, or not a UUIDv7).
--
-- Partitions are created ahead (payments.inbox_extend) and dropped
-- (payments.inbox_expire) by the payments service; both run as the owner
-- (SECURITY DEFINER), so the payments role keeps DML only.

-- UUIDv7 helpers every schema's lifecycle uses (the outbox's and the keys'
-- too), in a schema of their own that every role may use.
CREATE SCHEMA IF NOT EXISTS effectively;
GRANT USAGE ON SCHEMA effectively
    TO effectively_orders, effectively_relay, effectively_payments, effectively_recon;

-- The smallest UUIDv7 minted at or after `t` (millisecond precision).
CREATE FUNCTION effectively.v7_floor(t timestamptz) RETURNS uuid
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT (lpad(to_hex(greatest(0, floor(extract(epoch FROM t) * 1000))::bigint), 12, '0')
            || '00000000000000000000')::uuid
$$;

-- The mint time a UUIDv7 carries (its first 48 bits, Unix milliseconds).
CREATE FUNCTION effectively.v7_time(u uuid) RETURNS timestamptz
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT to_timestamp(('x' || lpad(left(replace(u::text, '-', ''), 12), 16, '0'))::bit(64)::bigint
                        / 1000.0)
$$;

CREATE TABLE payments.inbox_partitions (
    name       text        PRIMARY KEY,
    lo         uuid        NOT NULL UNIQUE,
    hi         uuid        NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    CHECK (lo < hi)
);

-- The existing inbox becomes the first partition: every msg_id minted before
-- now (including rows older than any UUIDv7, e.g. the nil-based ids some
-- tests use). It expires like the others, when its upper bound passes the
-- retention.
DO $$
DECLARE
    bound uuid := effectively.v7_floor(now());
    beyond bigint;
BEGIN
    SELECT count(*) INTO beyond FROM payments.inbox WHERE msg_id >= bound;
    IF beyond > 0 THEN
        RAISE EXCEPTION 'payments.inbox holds % msg_ids at or above %, minted in the future or not UUIDv7; '
                        'the inbox cannot be partitioned by mint time until they are moved out', beyond, bound;
    END IF;
    ALTER TABLE payments.inbox RENAME TO inbox_legacy;
    ALTER TABLE payments.inbox_legacy RENAME CONSTRAINT inbox_pkey TO inbox_legacy_pkey;
    CREATE TABLE payments.inbox (
        msg_id       uuid        NOT NULL,
        processed_at timestamptz NOT NULL DEFAULT now(),
        payload_hash bigint,
        PRIMARY KEY (msg_id)
    ) PARTITION BY RANGE (msg_id);
    EXECUTE format('ALTER TABLE payments.inbox ATTACH PARTITION payments.inbox_legacy '
                   'FOR VALUES FROM (%L) TO (%L)', '00000000-0000-0000-0000-000000000000', bound);
    INSERT INTO payments.inbox_partitions (name, lo, hi)
        VALUES ('inbox_legacy', '00000000-0000-0000-0000-000000000000', bound);
END
$$;

-- Advisory-lock ids (bigint form), clear of the relay's (0x0e117e1a0000 + shard):
--   0x0e117e1a1000  the window: shared by every claim transaction, exclusive
--                   while partitions are dropped
--   0x0e117e1a1001  maintenance: one creator or dropper at a time

-- The window a claim transaction may write, read under the shared window
-- lock: a partition cannot be dropped until this transaction ends. Each
-- statement of a VOLATILE plpgsql function takes a new snapshot, so the
-- bounds are read after the lock is held.
CREATE FUNCTION payments.inbox_window(OUT floor uuid, OUT ceiling uuid)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(x'0e117e1a1000'::bigint);
    -- (uuid has no min/max aggregate: the unique indexes answer these.)
    SELECT p.lo INTO floor FROM payments.inbox_partitions p ORDER BY p.lo LIMIT 1;
    SELECT p.hi INTO ceiling FROM payments.inbox_partitions p ORDER BY p.hi DESC LIMIT 1;
END
$$;

-- Creates partitions from the ceiling until it reaches `upto`, each ending on
-- a multiple of `granule` since the Unix epoch (an hour, a day: aligned to
-- UTC). Returns how many it created. lock_timeout bounds how long it may
-- queue for a lock (and so hold up whoever queues behind it).
CREATE FUNCTION payments.inbox_extend(upto timestamptz, granule interval) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    step double precision := extract(epoch FROM granule);
    lo uuid;
    hi uuid;
    t timestamptz;
    name text;
    made integer := 0;
BEGIN
    IF step < 60 THEN
        RAISE EXCEPTION 'inbox partition granule % is under a minute', granule;
    END IF;
    PERFORM pg_advisory_xact_lock(x'0e117e1a1001'::bigint);
    SELECT p.hi INTO lo FROM payments.inbox_partitions p ORDER BY p.hi DESC LIMIT 1;
    LOOP
        t := effectively.v7_time(lo);
        EXIT WHEN t >= upto;
        hi := effectively.v7_floor(to_timestamp((floor(extract(epoch FROM t) / step) + 1) * step));
        name := 'inbox_' || to_char(t AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISSMS');
        -- Made on its own, then attached: ATTACH PARTITION takes only a
        -- SHARE UPDATE EXCLUSIVE lock on the inbox, which the claims'
        -- inserts do not conflict with (CREATE TABLE … PARTITION OF would
        -- take ACCESS EXCLUSIVE and wait for them, and they for it).
        EXECUTE format('CREATE TABLE payments.%I (LIKE payments.inbox INCLUDING DEFAULTS)', name);
        EXECUTE format('ALTER TABLE payments.inbox ATTACH PARTITION payments.%I FOR VALUES FROM (%L) TO (%L)',
                       name, lo, hi);
        INSERT INTO payments.inbox_partitions (name, lo, hi) VALUES (name, lo, hi);
        lo := hi;
        made := made + 1;
    END LOOP;
    RETURN made;
END
$$;

-- Drops every partition whose msg_ids were all minted more than `retention`
-- ago, oldest first, under the exclusive window lock (it waits for the claim
-- transactions in flight; new ones wait for it). DROP TABLE of a partition
-- takes ACCESS EXCLUSIVE on the inbox too; with the window lock held no claim
-- holds one, so it waits only for readers (recon), at most lock_timeout, and
-- then the next round tries again. Returns the names dropped. Never drops
-- the partition that holds now.
CREATE FUNCTION payments.inbox_expire(retention interval) RETURNS SETOF text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    cut uuid := effectively.v7_floor(now() - greatest(retention, interval '0'));
    p record;
BEGIN
    PERFORM pg_advisory_xact_lock(x'0e117e1a1001'::bigint);
    PERFORM pg_advisory_xact_lock(x'0e117e1a1000'::bigint);
    FOR p IN SELECT ip.name FROM payments.inbox_partitions ip WHERE ip.hi <= cut ORDER BY ip.lo LOOP
        EXECUTE format('DROP TABLE payments.%I', p.name);
        DELETE FROM payments.inbox_partitions ip WHERE ip.name = p.name;
        RETURN NEXT p.name;
    END LOOP;
END
$$;

-- Partitions for the day ahead, so the inbox takes rows as soon as it is
-- migrated; the payments service keeps extending them.
SELECT payments.inbox_extend(now() + interval '1 day', interval '1 day');

-- The new kinds of dead letter.
ALTER TABLE payments.dead_letters DROP CONSTRAINT dead_letters_kind_check;
ALTER TABLE payments.dead_letters ADD CONSTRAINT dead_letters_kind_check
    CHECK (kind IN ('undecodable', 'rejected', 'msg_id_conflict', 'order_conflict',
                    'after_horizon', 'future_msg_id'));

-- The outbox's retention: how long a published row stays (and so can be
-- re-marked pending and published again). It bounds the relay's replay
-- window, one term of the redelivery horizon that payments derives at
-- start-up; one row, the owner's to change.
CREATE TABLE orders.outbox_policy (
    only_row  boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    retention interval    NOT NULL CHECK (retention > interval '0'),
    set_at    timestamptz NOT NULL DEFAULT now()
);
INSERT INTO orders.outbox_policy (retention) VALUES (interval '7 days');

-- Grants: the partitioned inbox is a new table. The old grants went with the
-- legacy partition; they are taken back, since partitions are reached through
-- the parent only (its grants are what a query through it checks).
REVOKE ALL ON payments.inbox_legacy FROM effectively_payments, effectively_recon;
GRANT SELECT, INSERT ON payments.inbox TO effectively_payments;
GRANT SELECT ON payments.inbox_partitions TO effectively_payments;
REVOKE EXECUTE ON FUNCTION payments.inbox_extend(timestamptz, interval),
                           payments.inbox_expire(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION payments.inbox_extend(timestamptz, interval),
                          payments.inbox_expire(interval) TO effectively_payments;
GRANT USAGE ON SCHEMA orders TO effectively_payments;
GRANT SELECT ON orders.outbox_policy TO effectively_payments;
GRANT SELECT ON orders.outbox_policy TO effectively_relay;
GRANT SELECT ON payments.inbox, payments.inbox_partitions, orders.outbox_policy TO effectively_recon;
