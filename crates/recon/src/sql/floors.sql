-- The floors of the stores that expire, read in the diff's snapshot: keys
-- of orders minted below the keys' floor, published outbox rows minted below
-- the outbox's floor and inbox rows below the inbox's oldest partition may be
-- gone by design (payments' inbox is the library's partitioned inbox,
-- fx.partitioned_inbox; migrations/20261124000002_outbox_and_keys_expiry.sql).
-- The library's partitions are shared by its consumers; payments is the
-- pipeline's only one. "!": each is a value, never NULL.
SELECT (SELECT floor FROM orders.key_policy) AS "keys!",
       (SELECT floor FROM orders.outbox_policy) AS "outbox!",
       COALESCE((SELECT lo FROM fx.partitioned_inbox_parts ORDER BY lo LIMIT 1),
                '00000000-0000-0000-0000-000000000000'::uuid) AS "inbox!"
