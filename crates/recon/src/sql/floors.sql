-- The floors of the stores that expire, read in the diff's snapshot: keys
-- of orders minted below the keys' floor, published outbox rows minted below
-- the outbox's floor and inbox rows below the inbox's oldest partition may be
-- gone by design (migrations/20261124000001_inbox_partitions.sql,
-- 20261124000002_outbox_and_keys_expiry.sql). "!": each is a value, never NULL.
SELECT (SELECT floor FROM orders.key_policy) AS "keys!",
       (SELECT floor FROM orders.outbox_policy) AS "outbox!",
       COALESCE((SELECT lo FROM payments.inbox_partitions ORDER BY lo LIMIT 1),
                '00000000-0000-0000-0000-000000000000'::uuid) AS "inbox!"
