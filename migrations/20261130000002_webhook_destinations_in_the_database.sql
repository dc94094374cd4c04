-- Webhook destinations live here, one source of truth for every relay
-- (`relay --sink http`). Before, each relay fanned out to the destinations of
-- its own --webhook-destination flags: rows fanned out by a relay that did not
-- know a destination never got a delivery for it, and a destination dropped
-- from the flags kept its pending deliveries open forever.
--
-- * spec: the destination as `relay webhooks add` and --webhook-destination
--   take it (NAME=URL,secret=whsec_...,...): its URL, signing secrets,
--   timeout, concurrency and attempts. NULL for a row an older relay
--   registered by name only: such a destination is not fanned out to.
-- * removed_at: set by `relay webhooks remove`, which in the same
--   transaction marks the destination's pending deliveries failed ("the
--   destination was removed"): nothing stays open, and `relay webhooks
--   replay --failed --destination NAME` sends them if it is added again.
--
-- The fan-out reads the destinations in its claim transaction (FOR KEY
-- SHARE) and a removal locks the row (FOR UPDATE) first, so a row is fanned
-- out to exactly the destinations present when its fan-out commits, and no
-- delivery is written for a destination after its removal failed the
-- pending ones. A destination receives the events fanned out from the
-- moment it is added.
ALTER TABLE orders.webhook_destinations
    ADD COLUMN spec       text,
    ADD COLUMN added_at   timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN removed_at timestamptz;

-- The spec holds signing secrets: recon reads every column but that one.
REVOKE SELECT ON orders.webhook_destinations FROM effectively_recon;
GRANT SELECT (destination, disabled_at, reason, added_at, removed_at)
    ON orders.webhook_destinations TO effectively_recon;
