-- A replay (`relay webhooks replay --failed`, `relay webhooks enable`) starts a
-- delivery's attempts over at 0. Two things keyed on the attempt number alone
-- then broke:
--
-- * the fence of a recorded result (`attempts = the claimed attempt`): a
--   sender paused past its lease before the failure and the replay could
--   record its stale result over the replayed delivery's attempt of the same
--   number;
-- * the attempts log: the replay's attempt 1 collided with the first run's
--   attempt 1 and was dropped (ON CONFLICT DO NOTHING).
--
-- Both now name the replay too: a result is recorded only for the attempt
-- and the replay it was claimed in, and the log keeps every run's attempts.
ALTER TABLE orders.webhook_attempts ADD COLUMN replay integer NOT NULL DEFAULT 0;
ALTER TABLE orders.webhook_attempts DROP CONSTRAINT webhook_attempts_pkey;
ALTER TABLE orders.webhook_attempts ADD PRIMARY KEY (destination, outbox_id, replay, attempt);
