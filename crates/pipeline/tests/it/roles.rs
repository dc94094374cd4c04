//! Least privilege (migrations/20261123000001_roles.sql), against the real
//! PostgreSQL: each service's role runs the kinds of statement its service
//! runs, and is refused (SQLSTATE 42501, insufficient_privilege) everything
//! outside its rights; the grant matrix is pinned as a whole, so a grant added
//! or lost shows here.

use std::collections::BTreeSet;

use pipeline::db::{MIGRATOR, ServiceRole};
use pipeline::testing::TestDb;
use sqlx::{Connection, PgConnection};

const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// Rows every statement below can find: one order with its key and outbox
/// row, its inbox row, charge, ledger entry and a dead letter.
const SEED: &str = "
INSERT INTO orders.orders (order_id, account_id, amount_cents, status)
  VALUES ('00000000-0000-0000-0000-000000000001', 1, 100, 'created');
INSERT INTO fx.idempotency_keys
    (scope, key, request_hash, reference, response_status, response_headers, response_body)
  VALUES ('', 'seed', '\\x00', '00000000-0000-0000-0000-000000000001', 201, '[]', '\\x00');
INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload)
  VALUES ('00000000-0000-0000-0000-000000000001', '00000000-0000-0000-0000-0000000000a1',
          'order.created', '{}');
INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash)
  VALUES ('payments', '00000000-0000-0000-0000-0000000000a1', int8send(7));
INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents)
  VALUES (gen_random_uuid(), '00000000-0000-0000-0000-000000000001',
          '00000000-0000-0000-0000-0000000000a1', 1, 100);
INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents)
  VALUES (1, '00000000-0000-0000-0000-000000000001', '00000000-0000-0000-0000-0000000000a1', 100);
INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason) VALUES ('t', 0, 0, 'seed');
";

async fn connect(db: &TestDb, role: ServiceRole) -> PgConnection {
    let url = db.url_as(role);
    let mut conn = PgConnection::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("connect as {}: {e}", role.name()));
    let user: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&mut conn)
        .await
        .expect("current_user");
    assert_eq!(user, role.name());
    conn
}

/// Runs each statement in a transaction of its own that is rolled back (the
/// grants are what is tested, not the data); each must succeed.
async fn allowed(conn: &mut PgConnection, role: ServiceRole, statements: &[&str]) {
    for sql in statements {
        let mut tx = conn.begin().await.expect("begin");
        if let Err(e) = sqlx::raw_sql(sql).execute(&mut *tx).await {
            panic!("{} must be allowed {sql:?}: {e}", role.name());
        }
        tx.rollback().await.expect("rollback");
    }
}

/// Each statement must be refused for want of a privilege.
async fn refused(conn: &mut PgConnection, role: ServiceRole, statements: &[&str]) {
    for sql in statements {
        let mut tx = conn.begin().await.expect("begin");
        match sqlx::raw_sql(sql).execute(&mut *tx).await {
            Ok(_) => panic!("{} must be refused {sql:?}, it was allowed", role.name()),
            Err(sqlx::Error::Database(e)) => assert_eq!(
                e.code().as_deref(),
                Some(INSUFFICIENT_PRIVILEGE),
                "{} running {sql:?}: {e}",
                role.name()
            ),
            Err(e) => panic!("{} running {sql:?}: {e}", role.name()),
        }
        tx.rollback().await.expect("rollback");
    }
}

/// Statements no service may run: schema changes, and anything in the
/// schema nobody granted (public, where the migrator keeps its table).
const NOBODY: &[&str] = &[
    "CREATE TABLE orders.x (a int)",
    "CREATE TABLE payments.x (a int)",
    "CREATE TABLE public.x (a int)",
    "ALTER TABLE orders.outbox ADD COLUMN x int",
    "CREATE TABLE fx.x (a int)",
    "DROP TABLE payments.charges",
    "DROP TABLE fx.partitioned_inbox",
    "TRUNCATE orders.outbox",
    "TRUNCATE payments.ledger",
    "TRUNCATE fx.partitioned_inbox",
    "SELECT count(*) FROM public._sqlx_migrations",
    "DELETE FROM public._sqlx_migrations",
];

async fn seeded() -> TestDb {
    let db = TestDb::create().await;
    let mut owner = PgConnection::connect(&db.url).await.expect("connect owner");
    sqlx::raw_sql(SEED).execute(&mut owner).await.expect("seed");
    db
}

#[tokio::test]
async fn orders_writes_only_the_orders_schema() {
    let db = seeded().await;
    let role = ServiceRole::Orders;
    let mut conn = connect(&db, role).await;
    allowed(
        &mut conn,
        role,
        &[
            // the write path (store.rs, idempotency.rs, outbox.rs)
            "INSERT INTO fx.idempotency_keys AS t (scope, key, request_hash, response_status, \
               response_headers, response_body, reference) \
             VALUES ('', 'k1', '\\x01', 201, '[]', '\\x00', gen_random_uuid()::text) \
             ON CONFLICT (scope, key) DO NOTHING RETURNING t.key",
            "SELECT * FROM fx.idempotency_keys WHERE scope = '' AND key = 'seed' LIMIT 1",
            // the library's batch claim, for callers that call it
            "SELECT * FROM fx.claim_keys('', ARRAY['k2', 'seed'], ARRAY['\\x01'::bytea, '\\x00'], \
               ARRAY[201, 201]::int2[], ARRAY['[]'::jsonb, '[]'], ARRAY['\\x00'::bytea, '\\x00'], \
               ARRAY[gen_random_uuid()::text, 'x'])",
            "INSERT INTO orders.orders (order_id, account_id, amount_cents, status) \
             VALUES (gen_random_uuid(), 1, 1, 'created')",
            "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
             VALUES (gen_random_uuid(), gen_random_uuid(), 'order.created', '{}') RETURNING id",
            // the relay shard of what it wrote, for its NOTIFY's payload
            "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
             VALUES (gen_random_uuid(), gen_random_uuid(), 'order.created', '{}') RETURNING shard",
            // GET /orders/{id}
            "SELECT order_id, account_id, amount_cents, status, created_at FROM orders.orders",
            // expiry of the keys (as the owner, through the function), its retention
            "SELECT orders.keys_expire(10)",
            "SELECT extract(epoch FROM retention)::float8 FROM orders.key_policy",
        ],
    )
    .await;
    refused(
        &mut conn,
        role,
        &[
            // the relay's part of the outbox: reading events, marking them
            "UPDATE orders.outbox SET published_at = now()",
            "UPDATE orders.outbox SET attempts = 9, failed_at = now()",
            "SELECT payload FROM orders.outbox",
            "DELETE FROM orders.outbox",
            // an order and its key, once written, stay as written
            "UPDATE orders.orders SET amount_cents = 1",
            "DELETE FROM orders.orders",
            "UPDATE fx.idempotency_keys SET response_status = 500",
            "DELETE FROM fx.idempotency_keys",
            // the rest of the library's schema is not orders' yet
            "SELECT count(*) FROM fx.outbox",
            "SELECT count(*) FROM fx.inbox",
            "SELECT count(*) FROM fx.partitioned_inbox",
            // the retention is the owner's to set; the outbox's expiry the relay's
            "UPDATE orders.key_policy SET retention = interval '1 second'",
            "SELECT orders.outbox_expire(10)",
            // the payments schema
            "INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents) \
             VALUES (gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), 1, 1)",
            "INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) \
             VALUES ('payments', gen_random_uuid(), '')",
            "SELECT count(*) FROM payments.charges",
        ],
    )
    .await;
    refused(&mut conn, role, NOBODY).await;
}

#[tokio::test]
async fn relay_reads_and_marks_only_the_outbox() {
    let db = seeded().await;
    let role = ServiceRole::Relay;
    let mut conn = connect(&db, role).await;
    allowed(
        &mut conn,
        role,
        &[
            // crates/relay/src/outbox.rs: lease, claim, mark, failures, lag
            "SELECT pg_try_advisory_xact_lock(1)",
            "SELECT o.shard, o.id, o.aggregate_id, o.msg_id, o.event_type, o.payload, o.created_at, o.attempts \
             FROM orders.outbox o \
             WHERE o.shard = 0 AND o.published_at IS NULL AND o.failed_at IS NULL \
               AND NOT EXISTS (SELECT 1 FROM orders.outbox e WHERE e.aggregate_id = o.aggregate_id \
                               AND e.published_at IS NULL AND e.id < o.id OFFSET 0) \
             ORDER BY o.id LIMIT 10 FOR UPDATE OF o SKIP LOCKED",
            "UPDATE orders.outbox SET published_at = now() WHERE id = ANY('{1}')",
            // the claim that marks, and the put-back of what the broker did not ack
            "WITH c AS (SELECT o.id FROM orders.outbox o WHERE o.shard = 0 AND o.published_at IS NULL \
                        ORDER BY o.id LIMIT 10 FOR UPDATE OF o SKIP LOCKED) \
             UPDATE orders.outbox x SET published_at = now() FROM c WHERE x.id = c.id \
             RETURNING x.id, x.payload",
            "UPDATE orders.outbox SET published_at = NULL WHERE id = ANY('{1}')",
            "UPDATE orders.outbox o SET attempts = o.attempts + 1, last_error = f.error, \
                    failed_at = CASE WHEN o.attempts + 1 >= 3 THEN now() END \
             FROM unnest('{1}'::int8[], '{boom}'::text[]) AS f(id, error) \
             WHERE o.id = f.id RETURNING o.failed_at",
            "SELECT count(*) FILTER (WHERE failed_at IS NULL), min(created_at) \
             FROM orders.outbox WHERE published_at IS NULL",
            "LISTEN orders_outbox",
            // expiry of published rows (as the owner, through the function), its retention
            "SELECT orders.outbox_expire(10)",
            "SELECT extract(epoch FROM retention)::float8 FROM orders.outbox_policy",
        ],
    )
    .await;
    refused(
        &mut conn,
        role,
        &[
            // an event is the orders service's to write, and stays as written
            "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
             VALUES (gen_random_uuid(), gen_random_uuid(), 'order.created', '{}')",
            "UPDATE orders.outbox SET payload = '{}'",
            "UPDATE orders.outbox SET msg_id = gen_random_uuid()",
            "DELETE FROM orders.outbox",
            // orders and keys: none of its business
            "INSERT INTO orders.orders (order_id, account_id, amount_cents, status) \
             VALUES (gen_random_uuid(), 1, 1, 'created')",
            "SELECT count(*) FROM orders.orders",
            "SELECT count(*) FROM fx.idempotency_keys",
            "SELECT orders.keys_expire(10)",
            "UPDATE orders.outbox_policy SET retention = interval '1 second'",
            // nor the payments schema
            "INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents) \
             VALUES (gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), 1, 1)",
            "SELECT count(*) FROM fx.partitioned_inbox",
        ],
    )
    .await;
    refused(&mut conn, role, NOBODY).await;
}

#[tokio::test]
async fn payments_writes_only_the_payments_schema() {
    let db = seeded().await;
    let role = ServiceRole::Payments;
    let mut conn = connect(&db, role).await;
    allowed(
        &mut conn,
        role,
        &[
            // crates/payments/src/inbox.rs: the claim, in the library's
            // partitioned inbox (its statements, consumer 'payments')
            "SELECT floor, ceiling, clock FROM fx.partitioned_inbox_window()",
            "INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) \
             SELECT 'payments', m.id, m.hash \
             FROM unnest(ARRAY[effectively.v7_floor(now())], ARRAY['\\x01'::bytea]) AS m(id, hash) \
             ORDER BY m.id ON CONFLICT (msg_id, consumer) DO NOTHING RETURNING msg_id",
            "SELECT msg_id, payload_hash FROM fx.partitioned_inbox \
             WHERE consumer = 'payments' AND msg_id = ANY(ARRAY[gen_random_uuid()])",
            // crates/payments/src/expiry.rs: the partitions' lifecycle (as
            // the owner, through the library's SECURITY DEFINER functions),
            // the outbox's retention (a term of the horizon)
            "SELECT fx.partitioned_inbox_extend(now() + interval '1 hour', interval '1 hour')",
            "SELECT fx.partitioned_inbox_expire('payments', interval '30 days')",
            "SELECT count(*), (SELECT lo FROM fx.partitioned_inbox_parts ORDER BY lo LIMIT 1) \
             FROM fx.partitioned_inbox_parts",
            "SELECT extract(epoch FROM retention)::float8 FROM orders.outbox_policy",
            "SELECT order_id, msg_id FROM payments.charges",
            "WITH c AS ( \
               INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents) \
               VALUES (gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), 1, 1) \
               ON CONFLICT (order_id) DO NOTHING \
               RETURNING account_id, order_id, msg_id, amount_cents), \
             l AS ( \
               INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
               SELECT account_id, order_id, msg_id, amount_cents FROM c) \
             SELECT msg_id FROM c",
            "INSERT INTO payments.dead_letters \
               (topic, partition, \"offset\", msg_key, payload, reason, kind, msg_id) \
             VALUES ('t', 0, 1, NULL, NULL, 'r', 'rejected', gen_random_uuid()) \
             ON CONFLICT (topic, partition, \"offset\") DO NOTHING",
            // crates/payments/src/park.rs: parked, checked, applied
            "INSERT INTO payments.parked (msg_id, order_id, account_id, amount_cents, payload_hash, \
               topic, partition, \"offset\", msg_key, payload, reason) \
             VALUES (gen_random_uuid(), gen_random_uuid(), 1, 1, 0, 't', 0, 2, NULL, NULL, 'r') \
             ON CONFLICT (msg_id) DO NOTHING RETURNING payload_hash",
            "SELECT DISTINCT order_id FROM payments.parked WHERE order_id = ANY(ARRAY[gen_random_uuid()])",
            "SELECT p.msg_id FROM payments.parked p WHERE NOT EXISTS \
               (SELECT 1 FROM payments.parked q WHERE q.order_id = p.order_id AND q.seq < p.seq) \
             ORDER BY p.seq LIMIT 10 FOR UPDATE OF p SKIP LOCKED",
            "DELETE FROM payments.parked WHERE msg_id = ANY(ARRAY[gen_random_uuid()])",
        ],
    )
    .await;
    refused(
        &mut conn,
        role,
        &[
            // the orders schema, written or read
            "INSERT INTO orders.orders (order_id, account_id, amount_cents, status) \
             VALUES (gen_random_uuid(), 1, 1, 'created')",
            "UPDATE orders.orders SET status = 'paid'",
            "UPDATE orders.outbox SET published_at = now()",
            "SELECT count(*) FROM orders.outbox",
            // an applied effect is never rewritten or taken back
            "UPDATE payments.charges SET amount_cents = 1",
            "DELETE FROM payments.charges",
            "DELETE FROM fx.partitioned_inbox",
            "UPDATE fx.partitioned_inbox SET payload_hash = ''",
            "UPDATE payments.ledger SET amount_cents = 1",
            "DELETE FROM payments.ledger",
            "SELECT count(*) FROM payments.ledger",
            "SELECT reason FROM payments.dead_letters",
            "DELETE FROM payments.dead_letters",
            // partitions only through the functions; the policy is the owner's
            "DROP TABLE fx.pinbox_19700101t000000000",
            "SELECT count(*) FROM fx.pinbox_19700101t000000000",
            "DELETE FROM fx.partitioned_inbox_parts",
            "DELETE FROM fx.partitioned_inbox_consumers",
            // the library's other parts are not payments'
            "SELECT count(*) FROM fx.inbox",
            "SELECT count(*) FROM fx.idempotency_keys",
            // a parked event is applied or stays as it came
            "UPDATE payments.parked SET amount_cents = 1",
            "UPDATE orders.outbox_policy SET retention = interval '1 day'",
        ],
    )
    .await;
    refused(&mut conn, role, NOBODY).await;
}

#[tokio::test]
async fn recon_only_reads() {
    let db = seeded().await;
    let role = ServiceRole::Recon;
    let mut conn = connect(&db, role).await;
    // every table, with a column of it
    let tables = [
        ("orders.orders", "status"),
        ("fx.idempotency_keys", "response_status"),
        ("orders.outbox", "published_at"),
        ("fx.partitioned_inbox", "payload_hash"),
        ("fx.partitioned_inbox_parts", "name"),
        ("payments.charges", "amount_cents"),
        ("payments.ledger", "amount_cents"),
        ("payments.dead_letters", "reason"),
        ("payments.parked", "reason"),
    ];
    let reads: Vec<String> = tables
        .iter()
        .map(|(t, _)| format!("SELECT * FROM {t}"))
        .collect();
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    allowed(&mut conn, role, &reads).await;
    // recon's own statements, as it runs them
    allowed(&mut conn, role, &[recon_probe()]).await;
    let writes: Vec<String> = tables
        .iter()
        .flat_map(|(t, c)| {
            [
                format!("DELETE FROM {t}"),
                format!("UPDATE {t} SET {c} = {c}"),
                format!("INSERT INTO {t} DEFAULT VALUES"),
            ]
        })
        .collect();
    let writes: Vec<&str> = writes.iter().map(String::as_str).collect();
    refused(&mut conn, role, &writes).await;
    refused(&mut conn, role, NOBODY).await;
}

/// A statement of the shape of recon's diff: both schemas joined.
fn recon_probe() -> &'static str {
    "SELECT (SELECT count(*) FROM orders.outbox e \
             WHERE NOT EXISTS (SELECT 1 FROM fx.partitioned_inbox i \
                               WHERE i.consumer = 'payments' AND i.msg_id = e.msg_id)), \
            (SELECT count(*) FROM payments.ledger l \
             LEFT JOIN payments.charges c ON c.order_id = l.order_id \
             JOIN orders.orders o ON o.order_id = l.order_id)"
}

#[tokio::test]
async fn no_service_role_can_migrate() {
    let db = TestDb::create().await;
    for role in ServiceRole::ALL {
        let pool = sqlx::PgPool::connect(&db.url_as(role))
            .await
            .expect("connect");
        // Every migration is applied already; a role that could not read the
        // migrator's table, let alone write it, cannot run the migrator.
        let error = MIGRATOR
            .run(&pool)
            .await
            .expect_err(&format!("{} must not migrate", role.name()));
        assert!(
            error.to_string().contains("permission denied"),
            "{}: {error}",
            role.name()
        );
        pool.close().await;
    }
}

/// The grants on the two schemas, as the catalog has them:
/// `role schema.table privilege[(column)]`, and `role schema.function
/// EXECUTE` for functions granted to a role (not to PUBLIC). Table-level grants list no
/// column; a column grant of a table that has the same table-level grant is
/// implied and left out.
async fn grant_matrix(db: &TestDb) -> BTreeSet<String> {
    let mut owner = PgConnection::connect(&db.url).await.expect("connect owner");
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT grantee::text, table_schema || '.' || table_name || ' ' || privilege_type \
         FROM information_schema.role_table_grants \
         WHERE grantee LIKE 'effectively\\_%' AND table_schema IN ('orders', 'payments', 'fx') \
         UNION ALL \
         SELECT c.grantee::text, \
                c.table_schema || '.' || c.table_name || ' ' || c.privilege_type \
                || '(' || c.column_name || ')' \
         FROM information_schema.column_privileges c \
         WHERE c.grantee LIKE 'effectively\\_%' AND c.table_schema IN ('orders', 'payments', 'fx') \
           AND NOT EXISTS (SELECT 1 FROM information_schema.role_table_grants t \
                           WHERE t.grantee = c.grantee AND t.table_schema = c.table_schema \
                             AND t.table_name = c.table_name \
                             AND t.privilege_type = c.privilege_type) \
         UNION ALL \
         SELECT r.rolname::text, n.nspname || ' ' || p.privilege \
         FROM pg_roles r CROSS JOIN pg_namespace n \
         CROSS JOIN (VALUES ('USAGE'), ('CREATE')) AS p(privilege) \
         WHERE r.rolname LIKE 'effectively\\_%' \
           AND n.nspname IN ('orders', 'payments', 'public', 'effectively', 'fx') \
           AND has_schema_privilege(r.oid, n.oid, p.privilege) \
         UNION ALL \
         SELECT grantee::text, routine_schema || '.' || routine_name || ' ' || privilege_type \
         FROM information_schema.role_routine_grants \
         WHERE grantee LIKE 'effectively\\_%'",
    )
    .fetch_all(&mut owner)
    .await
    .expect("read grants");
    rows.into_iter().map(|(r, g)| format!("{r} {g}")).collect()
}

#[tokio::test]
async fn the_grant_matrix_is_exactly_this() {
    let db = TestDb::create().await;
    let got = grant_matrix(&db).await;
    let mut want: BTreeSet<String> = [
        "effectively_orders orders USAGE",
        "effectively_orders orders.orders INSERT",
        "effectively_orders orders.orders SELECT",
        // Orders' idempotency keys, in the library's schema.
        "effectively_orders fx USAGE",
        "effectively_orders fx.idempotency_keys INSERT",
        "effectively_orders fx.idempotency_keys SELECT",
        "effectively_orders orders.outbox INSERT(aggregate_id)",
        "effectively_orders orders.outbox INSERT(msg_id)",
        "effectively_orders orders.outbox INSERT(event_type)",
        "effectively_orders orders.outbox INSERT(payload)",
        "effectively_orders orders.outbox SELECT(id)",
        "effectively_orders orders.outbox SELECT(shard)",
        "effectively_relay orders USAGE",
        "effectively_relay orders.outbox SELECT",
        "effectively_relay orders.outbox UPDATE(published_at)",
        "effectively_relay orders.outbox UPDATE(attempts)",
        "effectively_relay orders.outbox UPDATE(last_error)",
        "effectively_relay orders.outbox UPDATE(failed_at)",
        "effectively_relay orders.webhook_deliveries SELECT",
        "effectively_relay orders.webhook_deliveries INSERT",
        "effectively_relay orders.webhook_deliveries DELETE",
        "effectively_relay orders.webhook_deliveries UPDATE(attempts)",
        "effectively_relay orders.webhook_deliveries UPDATE(next_attempt_at)",
        "effectively_relay orders.webhook_deliveries UPDATE(last_attempt_at)",
        "effectively_relay orders.webhook_deliveries UPDATE(last_status)",
        "effectively_relay orders.webhook_deliveries UPDATE(last_error)",
        "effectively_relay orders.webhook_deliveries UPDATE(delivered_at)",
        "effectively_relay orders.webhook_deliveries UPDATE(failed_at)",
        "effectively_relay orders.webhook_deliveries UPDATE(replays)",
        "effectively_relay orders.webhook_attempts SELECT",
        "effectively_relay orders.webhook_attempts INSERT",
        "effectively_relay orders.webhook_attempts DELETE",
        "effectively_relay orders.webhook_destinations SELECT",
        "effectively_relay orders.webhook_destinations INSERT",
        "effectively_relay orders.webhook_destinations UPDATE",
        "effectively_payments payments USAGE",
        // Its inbox, the library's partitioned one.
        "effectively_payments fx USAGE",
        "effectively_payments fx.partitioned_inbox INSERT",
        "effectively_payments fx.partitioned_inbox SELECT",
        "effectively_payments fx.partitioned_inbox_parts SELECT",
        "effectively_payments fx.partitioned_inbox_extend EXECUTE",
        "effectively_payments fx.partitioned_inbox_expire EXECUTE",
        "effectively_payments payments.charges INSERT",
        "effectively_payments payments.charges SELECT",
        "effectively_payments payments.ledger INSERT",
        "effectively_payments payments.dead_letters INSERT",
        "effectively_payments payments.dead_letters SELECT(topic)",
        "effectively_payments payments.dead_letters SELECT(partition)",
        "effectively_payments payments.dead_letters SELECT(offset)",
        "effectively_payments payments.dead_letters SELECT(msg_id)",
        "effectively_payments payments.dead_letters SELECT(kind)",
        "effectively_payments payments.dead_letters SELECT(transport)",
        "effectively_payments payments.webhook_inbox SELECT",
        "effectively_payments payments.webhook_inbox INSERT",
        "effectively_payments payments.webhook_inbox DELETE",
        "effectively_payments payments.webhook_inbox UPDATE(processed_at)",
        // Parked events (ahead of the inbox's partitions): parked, applied
        // and deleted; UPDATE only for FOR UPDATE SKIP LOCKED.
        "effectively_payments payments.parked SELECT",
        "effectively_payments payments.parked INSERT",
        "effectively_payments payments.parked DELETE",
        "effectively_payments payments.parked UPDATE(parked_at)",
        "effectively_payments orders USAGE",
        "effectively_payments orders.outbox_policy SELECT",
        "effectively_relay orders.outbox_policy SELECT",
        "effectively_relay orders.outbox_expire EXECUTE",
        "effectively_orders orders.key_policy SELECT",
        "effectively_orders orders.keys_expire EXECUTE",
        "effectively_recon orders USAGE",
        // Not its spec: the signing secrets.
        "effectively_recon orders.webhook_destinations SELECT(destination)",
        "effectively_recon orders.webhook_destinations SELECT(disabled_at)",
        "effectively_recon orders.webhook_destinations SELECT(reason)",
        "effectively_recon orders.webhook_destinations SELECT(added_at)",
        "effectively_recon orders.webhook_destinations SELECT(removed_at)",
        "effectively_recon payments USAGE",
        "effectively_recon fx USAGE",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    for table in [
        "orders.orders",
        "fx.idempotency_keys",
        "orders.outbox",
        "fx.partitioned_inbox",
        "payments.charges",
        "payments.ledger",
        "payments.dead_letters",
        "fx.partitioned_inbox_parts",
        "payments.webhook_inbox",
        "payments.parked",
        "orders.webhook_deliveries",
        "orders.webhook_attempts",
        "orders.outbox_policy",
        "orders.key_policy",
    ] {
        want.insert(format!("effectively_recon {table} SELECT"));
    }
    // Every role may use the public schema (PostgreSQL's default for
    // PUBLIC) and the schema of the shared UUIDv7 helpers; none may create in
    // them, or in the two schemas.
    for role in ServiceRole::ALL {
        want.insert(format!("{} public USAGE", role.name()));
        want.insert(format!("{} effectively USAGE", role.name()));
    }
    let missing: Vec<_> = want.difference(&got).collect();
    let extra: Vec<_> = got.difference(&want).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "grants missing: {missing:#?}\ngrants not expected: {extra:#?}"
    );
}
