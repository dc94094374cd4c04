-- The shop's and billing's own tables, in their own schemas, migrated by
-- sqlx's own ledger (_sqlx_migrations): the effectively library keeps its
-- tables and its ledger in shop_fx and billing_fx, apart from these.
CREATE SCHEMA IF NOT EXISTS shop;
CREATE TABLE shop.checkouts (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    cart       integer     NOT NULL,
    total      integer     NOT NULL CHECK (total >= 0),
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE SCHEMA IF NOT EXISTS billing;
-- No unique checkout_id on purpose: the inbox is what keeps an event from
-- being invoiced twice, and a second invoice would show here.
CREATE TABLE billing.invoices (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    checkout_id bigint      NOT NULL,
    total       integer     NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
