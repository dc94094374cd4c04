-- The outbox trigger's NOTIFY, sent only when it wakes the relay for something.
--
-- 1. Orders writes a batch in one statement (crates/orders/src/store.rs): the
--    key claims, the orders and the outbox rows of the keys it claimed. A
--    batch of replays inserts no outbox row, but a FOR EACH STATEMENT trigger
--    fires anyway. The trigger now sees the inserted rows (a transition
--    table) and notifies only if there are some.
-- 2. A NOTIFY holds a lock per database through the commit, WAL flush
--    included, so commits that notify run one at a time. A session that sets
--    effectively.outbox_notify = off (Orders' sessions) gets no NOTIFY from
--    the trigger: that service wakes the relay itself, one NOTIFY at a time,
--    outside its write transactions (effectively::outbox::Notifier). Any
--    other writer of the outbox still wakes the relay on commit.
CREATE OR REPLACE FUNCTION orders.notify_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('effectively.outbox_notify', true) IS DISTINCT FROM 'off'
       AND EXISTS (SELECT FROM inserted) THEN
        PERFORM pg_notify('orders_outbox', '');
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER outbox_notify ON orders.outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON orders.outbox
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION orders.notify_outbox();
