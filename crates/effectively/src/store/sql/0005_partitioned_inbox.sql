-- Version 5: an inbox partitioned by mint time, for consumers whose message
-- ids are UUIDv7 (every event of this library's outbox). Its rows expire by
-- dropping whole partitions: no delete, no vacuum behind it, no bloat, at
-- any volume. A message older than the oldest partition kept is refused
-- (whether it was applied can no longer be told), one minted beyond the
-- newest waits until a partition is made for it.
--
-- A UUIDv7's first 48 bits are its mint time in Unix milliseconds, and
-- PostgreSQL orders uuids by their bytes, so a range of ids is a range of
-- mint times. The partitions tile one interval [floor, ceiling) without
-- gaps, listed in partitioned_inbox_parts; there is no DEFAULT partition, so
-- the database itself refuses a row outside them. None is made here: a
-- consumer's first upkeep (Inbox::maintain) makes them with its own span,
-- the first one from the nil uuid to that upkeep's time (every id minted
-- before it), the next from there to the end of its span; the first
-- expires like the others, once that time is past the retention.
--
-- Advisory locks (transaction level, keyed by the schema's name):
--   '<schema>.partitioned_inbox'          the window: shared by each claim,
--                                         exclusive while partitions drop;
--   '<schema>.partitioned_inbox:maintain' one maker or dropper at a time.

-- The smallest UUIDv7 minted at or after `t` (millisecond precision).
CREATE FUNCTION @schema@.v7_floor(t timestamptz) RETURNS uuid
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT (lpad(to_hex(greatest(0, floor(extract(epoch FROM t) * 1000))::bigint), 12, '0')
            || '00000000000000000000')::uuid
$$;

-- The mint time a UUIDv7 carries (its first 48 bits, Unix milliseconds).
CREATE FUNCTION @schema@.v7_time(u uuid) RETURNS timestamptz
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT to_timestamp(('x' || lpad(left(replace(u::text, '-', ''), 12), 16, '0'))::bit(64)::bigint
                        / 1000.0)
$$;

-- The key leads with the id, so that an insert's comparisons are of uuids
-- (bytes) and the consumer, compared byte by byte (COLLATE "C"), only breaks
-- the tie of two consumers' copies of one message.
CREATE TABLE @schema@.partitioned_inbox (
    consumer     text COLLATE "C" NOT NULL,
    msg_id       uuid        NOT NULL,
    payload_hash bytea       NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (msg_id, consumer)
) PARTITION BY RANGE (msg_id);

CREATE TABLE @schema@.partitioned_inbox_parts (
    name       text        PRIMARY KEY,
    lo         uuid        NOT NULL UNIQUE,
    hi         uuid        NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    CHECK (lo < hi)
);

-- The retention each consumer asked for at its last expiry: partitions are
-- shared by every consumer of the schema, so one is dropped only once it is
-- older than the longest of them.
CREATE TABLE @schema@.partitioned_inbox_consumers (
    consumer   text        PRIMARY KEY,
    retention  interval    NOT NULL CHECK (retention >= interval '0'),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The ids a claim may write, [floor, ceiling), and the database's clock,
-- read under the shared window lock: no partition of the window is dropped
-- before the claim's transaction ends. Each statement of a VOLATILE plpgsql
-- function takes a new snapshot, so the bounds are read after the lock is
-- held. (uuid has no min/max aggregate: the unique indexes answer these.)
CREATE FUNCTION @schema@.partitioned_inbox_window(OUT floor uuid, OUT ceiling uuid, OUT clock timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended('@schema@.partitioned_inbox', 0));
    SELECT p.lo INTO floor FROM @schema@.partitioned_inbox_parts p ORDER BY p.lo LIMIT 1;
    SELECT p.hi INTO ceiling FROM @schema@.partitioned_inbox_parts p ORDER BY p.hi DESC LIMIT 1;
    clock := clock_timestamp();
END
$$;

-- Makes partitions from the ceiling until it reaches `upto`, each ending on
-- a multiple of `granule` since the Unix epoch (a second at least; an hour,
-- a day: aligned to UTC). When there is none, the first is from `origin`
-- (the nil uuid: every id before it; a user who brings the rows of an inbox
-- of their own gives where its expiry had reached, so that no message older
-- than that is claimed anew) to now, and the next from now. Returns how many
-- it made. Runs as the schema's owner, so a consumer
-- needs only the right to call it. lock_timeout bounds how long it queues
-- for a lock (and so holds up whoever queues behind it).
CREATE FUNCTION @schema@.partitioned_inbox_extend(
    upto timestamptz, granule interval,
    origin uuid DEFAULT '00000000-0000-0000-0000-000000000000') RETURNS integer
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
    first boolean := false;
    now_id uuid := @schema@.v7_floor(clock_timestamp());
BEGIN
    IF step < 1 THEN
        RAISE EXCEPTION 'inbox partition granule % is under a second', granule;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('@schema@.partitioned_inbox:maintain', 0));
    SELECT p.hi INTO lo FROM @schema@.partitioned_inbox_parts p ORDER BY p.hi DESC LIMIT 1;
    IF lo IS NULL THEN
        lo := COALESCE(origin, '00000000-0000-0000-0000-000000000000');
        first := true;
    END IF;
    LOOP
        t := @schema@.v7_time(lo);
        EXIT WHEN NOT first AND t >= upto;
        IF first AND lo < now_id THEN
            -- Everything before now, in one partition.
            hi := now_id;
        ELSE
            hi := @schema@.v7_floor(to_timestamp((floor(extract(epoch FROM t) / step) + 1) * step));
            first := false;
        END IF;
        name := 'pinbox_' || to_char(@schema@.v7_time(lo) AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISSMS');
        -- Made on its own, then attached: ATTACH PARTITION takes only a
        -- SHARE UPDATE EXCLUSIVE lock on the inbox, which the claims'
        -- inserts do not conflict with (CREATE TABLE … PARTITION OF would
        -- take ACCESS EXCLUSIVE and wait for them, and they for it).
        EXECUTE format('CREATE TABLE @schema@.%I (LIKE @schema@.partitioned_inbox INCLUDING DEFAULTS)', name);
        EXECUTE format('ALTER TABLE @schema@.partitioned_inbox ATTACH PARTITION @schema@.%I '
                       'FOR VALUES FROM (%L) TO (%L)', name, lo, hi);
        INSERT INTO @schema@.partitioned_inbox_parts (name, lo, hi) VALUES (name, lo, hi);
        lo := hi;
        made := made + 1;
    END LOOP;
    RETURN made;
END
$$;

-- Records that `consumer` keeps its messages for `retention`, then drops
-- every partition whose ids were all minted longer ago than the longest
-- retention any consumer recorded, oldest first, under the exclusive window
-- lock (it waits for the claims in flight; new ones wait for it). Never
-- drops the newest partition, nor one that holds now. Returns the names
-- dropped.
CREATE FUNCTION @schema@.partitioned_inbox_expire(consumer text, retention interval) RETURNS SETOF text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    longest interval;
    cut uuid;
    p record;
BEGIN
    IF consumer IS NULL OR consumer = '' THEN
        RAISE EXCEPTION 'an inbox consumer is named';
    END IF;
    IF retention IS NULL OR retention < interval '0' THEN
        RAISE EXCEPTION 'inbox retention % is negative', retention;
    END IF;
    INSERT INTO @schema@.partitioned_inbox_consumers AS c (consumer, retention)
        VALUES (partitioned_inbox_expire.consumer, partitioned_inbox_expire.retention)
        ON CONFLICT ON CONSTRAINT partitioned_inbox_consumers_pkey
        DO UPDATE SET retention = excluded.retention, updated_at = now();
    PERFORM pg_advisory_xact_lock(hashtextextended('@schema@.partitioned_inbox:maintain', 0));
    SELECT max(c.retention) INTO longest FROM @schema@.partitioned_inbox_consumers c;
    cut := least(@schema@.v7_floor(now() - longest), @schema@.v7_floor(now()));
    PERFORM pg_advisory_xact_lock(hashtextextended('@schema@.partitioned_inbox', 0));
    FOR p IN SELECT ip.name FROM @schema@.partitioned_inbox_parts ip
             WHERE ip.hi <= cut
               AND ip.hi < (SELECT x.hi FROM @schema@.partitioned_inbox_parts x ORDER BY x.hi DESC LIMIT 1)
             ORDER BY ip.lo LOOP
        EXECUTE format('DROP TABLE @schema@.%I', p.name);
        DELETE FROM @schema@.partitioned_inbox_parts ip WHERE ip.name = p.name;
        RETURN NEXT p.name;
    END LOOP;
END
$$;

-- Only the roles granted it may make or drop partitions (a function is
-- everyone's to call by default): Effectively::grants gives it to the
-- consumer's role.
REVOKE EXECUTE ON FUNCTION @schema@.partitioned_inbox_extend(timestamptz, interval, uuid),
                           @schema@.partitioned_inbox_expire(text, interval) FROM PUBLIC;

