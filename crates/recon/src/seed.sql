-- A consistent pipeline of :n orders, as if the whole pipeline had run once
-- for each: order, published outbox event, inbox msg_id, charge, ledger
-- entry (and key + stored response: see below). For recon's tests and its scale benchmark
-- (`make bench-recon`); ids are ordered (right-edge index inserts) and
-- derived from the order number, so every table agrees by construction.
-- msg_ids are 00000001-…-<n>: above every order id, and inside the inbox's
-- oldest partition (as UUIDv7 mint times they fall in 1970, before any
-- migration ran; the inbox has no partition for ids beyond its window).
-- Replace :n before running (psql: -v n=1000000). The idempotency keys are
-- not here: recon::seed (recon's tests, and `make bench-recon` through
-- crates/recon/examples/seed.rs) runs this, then writes each order's key
-- with the response orders stores for it (pipeline::contract::
-- created_response), whose ETag is a BLAKE3 hash PostgreSQL cannot compute.
INSERT INTO orders.orders (order_id, account_id, amount_cents, status)
SELECT lpad(to_hex(i), 32, '0')::uuid, 1 + i % 1000, 100 + i % 10000, 'created'
FROM generate_series(1, :n) AS i;

INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, published_at)
SELECT lpad(to_hex(i), 32, '0')::uuid, ('00000001' || lpad(to_hex(i), 24, '0'))::uuid, 'order.created',
       convert_to(format('{"order_id":"%s","account_id":%s,"amount_cents":%s,"status":"created"}',
                         lpad(to_hex(i), 32, '0')::uuid, 1 + i % 1000, 100 + i % 10000), 'UTF8'),
       now()
FROM generate_series(1, :n) AS i;

INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash)
SELECT 'payments', ('00000001' || lpad(to_hex(i), 24, '0'))::uuid, ''::bytea
FROM generate_series(1, :n) AS i;

INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents)
SELECT ('2' || lpad(to_hex(i), 31, '0'))::uuid, lpad(to_hex(i), 32, '0')::uuid,
       ('00000001' || lpad(to_hex(i), 24, '0'))::uuid, 1 + i % 1000, 100 + i % 10000
FROM generate_series(1, :n) AS i;

INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents)
SELECT 1 + i % 1000, lpad(to_hex(i), 32, '0')::uuid, ('00000001' || lpad(to_hex(i), 24, '0'))::uuid,
       100 + i % 10000
FROM generate_series(1, :n) AS i;

ANALYZE;
