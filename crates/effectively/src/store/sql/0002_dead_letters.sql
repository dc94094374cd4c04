-- Version 2: dead letters. A record a consumer will never apply (its
-- handler refused it, its msg_id is missing or reused with another payload,
-- it is older than the inbox keeps rows) is kept here with the reason, and
-- its offset moves on: nothing is lost, and nothing stalls its partition.
CREATE TABLE @schema@.dead_letters (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer    text        NOT NULL,
    msg_id      text,
    source      text        NOT NULL,
    reason      text        NOT NULL,
    payload     bytea       NOT NULL,
    headers     jsonb       NOT NULL DEFAULT '[]',
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dead_letters_by_consumer ON @schema@.dead_letters (consumer, created_at);
