-- Experiment 5 works in seconds: its resurrection runs expire partitions a
-- few seconds old, so a partition may now span as little as one second (the
-- payments service's --inbox-partition; production keeps a day or an hour).
-- Same function as before otherwise. A partition's name keeps milliseconds,
-- so names stay unique at any granule of a second or more.
CREATE OR REPLACE FUNCTION payments.inbox_extend(upto timestamptz, granule interval) RETURNS integer
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
    IF step < 1 THEN
        RAISE EXCEPTION 'inbox partition granule % is under a second', granule;
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

-- The order a dead letter's event names, when it could be read: an operator
-- (README, "After the dedup horizon") and recon look up the order's charge
-- directly. An after_horizon dead letter whose msg_id is the one that charged
-- its order is a late duplicate: provably nothing lost, nothing to do.
ALTER TABLE payments.dead_letters ADD COLUMN order_id uuid;
