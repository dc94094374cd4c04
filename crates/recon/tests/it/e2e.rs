//! End to end: the real orders, relay and payments binaries as processes on
//! the stack of `make up` (a fresh database and topic), load with retries,
//! then recon's diff. The binaries are the workspace's own, built by the same
//! `cargo nextest run --workspace` / `cargo build` as this test.

use std::process::Stdio;
use std::time::Duration;

use pipeline::db::ServiceRole;
use pipeline::testing::{
    TestDb, TestTopic, eventually, free_port, series_value, workspace_bin as bin,
};
use recon::{ClientKey, Policy};
use sqlx::PgPool;
use tokio::process::{Child, Command};

struct Stack {
    db: TestDb,
    topic: TestTopic,
    http: String,
    payments_metrics: String,
    children: Vec<Child>,
}

impl Stack {
    async fn start() -> Self {
        let db = TestDb::create().await;
        let topic = TestTopic::create(6).await;
        let (http, grpc, relay_m, pay_m) = (free_port(), free_port(), free_port(), free_port());
        let orders_m = free_port();
        // Each service as its own role.
        let env = |cmd: &mut Command, role: ServiceRole| {
            cmd.env("DATABASE_URL", db.url_as(role))
                .env("KAFKA_BOOTSTRAP_SERVERS", &topic.bootstrap_servers)
                .env("KAFKA_TOPIC", &topic.name)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .kill_on_drop(true);
        };
        let mut orders = Command::new(bin("orders"));
        env(&mut orders, ServiceRole::Orders);
        orders
            .env("ORDERS_HTTP_ADDR", format!("127.0.0.1:{http}"))
            .env("ORDERS_GRPC_ADDR", format!("127.0.0.1:{grpc}"))
            .env("ORDERS_METRICS_ADDR", format!("127.0.0.1:{orders_m}"));
        let mut relay = Command::new(bin("relay"));
        env(&mut relay, ServiceRole::Relay);
        relay.env("RELAY_METRICS_ADDR", format!("127.0.0.1:{relay_m}"));
        let mut payments = Command::new(bin("payments"));
        env(&mut payments, ServiceRole::Payments);
        payments
            .env("PAYMENTS_METRICS_ADDR", format!("127.0.0.1:{pay_m}"))
            .env("PAYMENTS_GROUP_ID", format!("e2e-{}", db.name));
        let children = [orders, relay, payments]
            .iter_mut()
            .map(|c| c.spawn().expect("spawn"))
            .collect();
        let http = format!("http://127.0.0.1:{http}");
        let up = eventually(Duration::from_secs(20), || async {
            reqwest::get(format!("http://127.0.0.1:{orders_m}/metrics"))
                .await
                .is_ok()
        })
        .await;
        assert!(up, "orders came up");
        Self {
            db,
            topic,
            http,
            payments_metrics: format!("http://127.0.0.1:{pay_m}/metrics"),
            children,
        }
    }

    async fn pool(&self) -> PgPool {
        PgPool::connect(&self.db.url).await.expect("connect")
    }

    async fn payments_metric(&self, name: &str) -> f64 {
        let Ok(resp) = reqwest::get(&self.payments_metrics).await else {
            return 0.0;
        };
        let text = resp.text().await.unwrap_or_default();
        series_value(&text, name).unwrap_or(0.0)
    }
}

/// Sends `n` orders, each key retried `retries` times (some concurrently);
/// returns what the client saw: (key, order id) per key.
async fn send_orders(http: &str, n: usize, retries: usize) -> Vec<(String, uuid::Uuid)> {
    use futures::StreamExt;
    let client = reqwest::Client::new();
    let sends = (0..n).flat_map(|i| (0..=retries).map(move |r| (i, r)));
    let futures = sends.map(|(i, r)| {
        let client = client.clone();
        async move {
            let body = format!(
                r#"{{"account_id": {}, "amount_cents": {}}}"#,
                i % 50 + 1,
                100 + i
            );
            let resp = client
                .post(format!("{http}/orders"))
                .header("Idempotency-Key", format!("e2e-{i}"))
                .header("Content-Type", "application/json")
                .body(body)
                .send()
                .await
                .expect("send");
            assert_eq!(resp.status(), 201);
            let json: serde_json::Value = resp.json().await.expect("json");
            let id = json["order_id"]
                .as_str()
                .expect("order_id")
                .parse()
                .expect("uuid");
            (r, format!("e2e-{i}"), id)
        }
    });
    // Bounded concurrency: 32 in flight.
    let seen: Vec<(usize, String, uuid::Uuid)> = futures::stream::iter(futures)
        .buffer_unordered(32)
        .collect()
        .await;
    let mut firsts: Vec<(String, uuid::Uuid)> = seen
        .into_iter()
        .filter(|(r, _, _)| *r == 0)
        .map(|(_, k, id)| (k, id))
        .collect();
    firsts.sort();
    firsts
}

async fn recon(pool: &PgPool) -> recon::Report {
    assert!(
        recon::wait_drained(pool, Duration::from_secs(90), Policy::default())
            .await
            .expect("drain query"),
        "pipeline drained"
    );
    let mut conn = pool.acquire().await.expect("connect");
    recon::reconcile(&mut conn).await.expect("recon")
}

/// The client's successes, each key in the shared scope (no caller).
fn shared(seen: &[(String, uuid::Uuid)]) -> Vec<(ClientKey, uuid::Uuid)> {
    seen.iter()
        .map(|(key, id)| (ClientKey::shared(key), *id))
        .collect()
}

#[tokio::test]
async fn orders_with_retries_flow_to_exactly_one_charge_each() {
    let stack = Stack::start().await;
    let seen = send_orders(&stack.http, 300, 2).await;
    let pool = stack.pool().await;
    let report = recon(&pool).await;
    assert!(
        report.is_clean(Policy::default()),
        "recon drift:\n{}",
        report.table(Policy::default())
    );
    assert_eq!(report.intents, 300);
    assert_eq!(report.distinct_charges, 300);

    // The client's ground truth agrees with the database ...
    let client = recon::ClientIntents {
        succeeded: shared(&seen),
        ambiguous: vec![ClientKey::shared("e2e-1"), ClientKey::shared("never-sent")],
        failed: vec![],
    };
    let intents = recon::check_intents(&pool, &client).await.expect("intents");
    assert!(intents.is_clean(), "{}", intents.table());
    assert_eq!((intents.matched, intents.ambiguous_committed), (300, 1));
    // ... and a success the database does not back is caught.
    let mut tampered = seen.clone();
    tampered[0].1 = uuid::Uuid::now_v7();
    tampered.push(("e2e-never-written".into(), uuid::Uuid::now_v7()));
    let bad = recon::check_intents(
        &pool,
        &recon::ClientIntents {
            succeeded: shared(&tampered),
            ambiguous: vec![],
            failed: vec![],
        },
    )
    .await
    .expect("intents");
    assert!(!bad.is_clean());
    assert_eq!((bad.wrong_order, bad.missing_in_db), (1, 1));

    // A relay crash after publishing and before marking, simulated: reset
    // published_at so the relay publishes those rows again (same msg_ids).
    let reset = sqlx::query("UPDATE orders.outbox SET published_at = NULL WHERE id % 3 = 0")
        .execute(&pool)
        .await
        .expect("reset")
        .rows_affected();
    assert!(reset > 0);
    let hits = eventually(Duration::from_secs(60), || async {
        stack.payments_metric("payments_dedup_hits_total").await >= reset as f64
    })
    .await;
    assert!(
        hits,
        "the {reset} re-published events were absorbed as inbox hits"
    );
    let report = recon(&pool).await;
    assert!(
        report.is_clean(Policy::default()),
        "recon drift after re-publish:\n{}",
        report.table(Policy::default())
    );
    assert_eq!(report.charge_effects, 300, "still one charge each");
    assert_eq!(report.published_rows, 300);
    drop(stack.children);
    let _ = stack.topic;
}

/// A database holding a consistent pipeline of `n` orders (the seed recon's
/// scale benchmark uses).
async fn seeded(n: u64) -> (TestDb, PgPool) {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    recon::seed::seed(&pool, n).await.expect("seed");
    (db, pool)
}

/// Drained waits for the sender too: a delivery the receiver has applied
/// (its inbox has the event) but the sender has not marked delivered (the
/// answer was lost; its retry is still due) is not drained yet.
#[tokio::test]
async fn drained_waits_for_an_open_webhook_delivery() {
    let (_db, pool) = seeded(5).await;
    let wait = || recon::wait_drained(&pool, Duration::from_millis(300), Policy::default());
    assert!(wait().await.expect("drain query"), "the seed is drained");
    let open = "INSERT INTO orders.webhook_deliveries (destination, outbox_id, aggregate_id, msg_id, body) \
                SELECT 'd', id, aggregate_id, msg_id, payload FROM orders.outbox ORDER BY id LIMIT 1";
    sqlx::query(open).execute(&pool).await.expect(open);
    assert!(
        !wait().await.expect("drain query"),
        "an open delivery is not drained, though its event is in the inbox"
    );
    sqlx::query("UPDATE orders.webhook_deliveries SET delivered_at = now()")
        .execute(&pool)
        .await
        .expect("mark delivered");
    assert!(wait().await.expect("drain query"), "delivered: drained");
}

/// Under a relay that leaves the outbox unmarked (Debezium), published_at
/// stays NULL on every row: recon --unmarked-outbox calls that drained and
/// clean once each event is in the inbox, and still catches one that is not.
#[tokio::test]
async fn an_unmarked_outbox_is_drained_once_every_event_is_consumed() {
    let (_db, pool) = seeded(5).await;
    let unmarked = Policy {
        unmarked_outbox: true,
        ..Policy::default()
    };
    sqlx::query("UPDATE orders.outbox SET published_at = NULL")
        .execute(&pool)
        .await
        .expect("unmark");
    let wait = |policy| recon::wait_drained(&pool, Duration::from_millis(300), policy);
    assert!(
        !wait(Policy::default()).await.expect("drain query"),
        "rows never marked: not drained for a marking relay"
    );
    assert!(
        wait(unmarked).await.expect("drain query"),
        "every event in the inbox: drained"
    );
    let mut conn = pool.acquire().await.expect("connect");
    let report = recon::reconcile(&mut conn).await.expect("recon");
    assert_eq!(report.pending_rows, 5);
    assert!(
        report.drift(Policy::default()).contains(&"pending_rows"),
        "{}",
        report.table(Policy::default())
    );
    assert!(report.is_clean(unmarked), "{}", report.table(unmarked));
    drop(conn);

    let lose = "DELETE FROM fx.partitioned_inbox WHERE msg_id = (SELECT msg_id FROM orders.outbox ORDER BY id LIMIT 1)";
    sqlx::query(lose).execute(&pool).await.expect(lose);
    assert!(
        !wait(unmarked).await.expect("drain query"),
        "an event not in the inbox: not drained"
    );
    let mut conn = pool.acquire().await.expect("connect");
    let report = recon::reconcile(&mut conn).await.expect("recon");
    assert!(
        report.drift(unmarked).contains(&"events_not_consumed"),
        "{}",
        report.table(unmarked)
    );
}

/// Drained waits for payments' parked events too (an event the inbox could
/// not record yet, applied later): even one that no outbox row accounts
/// for. While one waits, recon reports it and calls it drift.
#[tokio::test]
async fn drained_waits_for_a_parked_event_and_recon_reports_it() {
    let (_db, pool) = seeded(5).await;
    let wait = || recon::wait_drained(&pool, Duration::from_millis(300), Policy::default());
    assert!(wait().await.expect("drain query"), "the seed is drained");
    let park = "INSERT INTO payments.parked (msg_id, order_id, account_id, amount_cents, payload_hash, \
                topic, partition, \"offset\", reason) \
                VALUES (gen_random_uuid(), gen_random_uuid(), 1, 1, 0, 't', 0, 0, 'parked')";
    sqlx::query(park).execute(&pool).await.expect(park);
    assert!(
        !wait().await.expect("drain query"),
        "a parked event is not drained"
    );
    let mut tx = pool.begin().await.expect("begin");
    let report = recon::reconcile(&mut tx).await.expect("recon");
    assert_eq!(report.parked_events, 1);
    assert!(
        report.drift(Policy::default()).contains(&"parked_events"),
        "{}",
        report.table(Policy::default())
    );
    assert!(
        report
            .table(Policy::default())
            .contains("events parked, not applied"),
        "the table names it"
    );
    tx.rollback().await.expect("rollback");
    sqlx::query("DELETE FROM payments.parked")
        .execute(&pool)
        .await
        .expect("apply it");
    assert!(wait().await.expect("drain query"), "applied: drained");
}

/// Each corruption, applied alone to a clean database, is drift and is named.
#[tokio::test]
async fn every_per_order_check_catches_its_corruption() {
    let (_db, pool) = seeded(50).await;
    let mut conn = pool.acquire().await.expect("connect");
    let clean = recon::reconcile(&mut conn).await.expect("recon");
    assert!(
        clean.is_clean(Policy::default()),
        "the seed is clean:\n{}",
        clean.table(Policy::default())
    );
    assert_eq!(clean.distinct_orders, 50);

    let o = |i: u32| format!("'{:032x}'::uuid", i);
    let cases: Vec<(String, &str)> = vec![
        // Sums stay equal: only a per-order comparison sees these.
        (
            format!(
                "UPDATE payments.charges SET amount_cents = CASE WHEN order_id = {a} THEN (SELECT amount_cents FROM payments.charges WHERE order_id = {b}) ELSE (SELECT amount_cents FROM payments.charges WHERE order_id = {a}) END WHERE order_id IN ({a}, {b})",
                a = o(1),
                b = o(2)
            ),
            "charge_mismatches",
        ),
        (
            format!(
                "UPDATE payments.ledger SET amount_cents = CASE WHEN order_id = {a} THEN (SELECT amount_cents FROM payments.ledger WHERE order_id = {b}) ELSE (SELECT amount_cents FROM payments.ledger WHERE order_id = {a}) END WHERE order_id IN ({a}, {b})",
                a = o(3),
                b = o(4)
            ),
            "effect_mismatches",
        ),
        (
            format!(
                "UPDATE payments.charges SET account_id = account_id + 1 WHERE order_id = {}",
                o(5)
            ),
            "charge_mismatches",
        ),
        (
            format!(
                "UPDATE payments.ledger SET account_id = account_id + 1 WHERE order_id = {}",
                o(6)
            ),
            "effect_mismatches",
        ),
        (
            format!(
                "UPDATE payments.charges SET msg_id = (SELECT msg_id FROM orders.outbox WHERE aggregate_id = {}) WHERE order_id = {}",
                o(8),
                o(7)
            ),
            "charges_by_another_event",
        ),
        (
            format!(
                "UPDATE orders.outbox SET payload = convert_to(replace(convert_from(payload, 'UTF8'), '\"amount_cents\":', '\"amount_cents\":9'), 'UTF8') WHERE aggregate_id = {}",
                o(9)
            ),
            "event_payload_mismatches",
        ),
        (
            format!("DELETE FROM fx.idempotency_keys WHERE effectively.uuid_of(reference) = {}", o(10)),
            "orders_without_key",
        ),
        (
            format!(
                "INSERT INTO fx.idempotency_keys (scope, key, request_hash, reference, response_status, response_headers, response_body) SELECT scope, 'another-key', request_hash, reference, response_status, response_headers, response_body FROM fx.idempotency_keys WHERE effectively.uuid_of(reference) = {}",
                o(11)
            ),
            "orders_with_many_keys",
        ),
        (
            format!(
                "UPDATE fx.idempotency_keys SET response_body = (SELECT response_body FROM fx.idempotency_keys WHERE effectively.uuid_of(reference) = {}) WHERE effectively.uuid_of(reference) = {}",
                o(13),
                o(12)
            ),
            "responses_naming_another_order",
        ),
        (
            format!(
                "UPDATE fx.idempotency_keys SET reference = ({})::text WHERE effectively.uuid_of(reference) = {}",
                o(999),
                o(14)
            ),
            "intents_without_order",
        ),
        (
            format!(
                "INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) SELECT account_id, order_id, msg_id, amount_cents FROM payments.ledger WHERE order_id = {}",
                o(15)
            ),
            "double_charges",
        ),
        (
            format!("DELETE FROM payments.ledger WHERE order_id = {}", o(16)),
            "charges_without_effect",
        ),
        (
            format!("DELETE FROM payments.charges WHERE order_id = {}", o(17)),
            "orders_without_charge",
        ),
        (
            format!("DELETE FROM orders.outbox WHERE aggregate_id = {}", o(18)),
            "orders_without_event",
        ),
        (
            format!(
                "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, published_at) VALUES ({}, gen_random_uuid(), 'order.created', '{{}}', now())",
                o(19)
            ),
            "orders_with_many_events",
        ),
        (
            format!(
                "DELETE FROM fx.partitioned_inbox WHERE consumer = 'payments' AND msg_id = (SELECT msg_id FROM orders.outbox WHERE aggregate_id = {})",
                o(20)
            ),
            "events_not_consumed",
        ),
        (
            "INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) VALUES ('payments', effectively.v7_floor(now()), '')".to_owned(),
            "inbox_without_event",
        ),
        (
            format!(
                "UPDATE orders.outbox SET published_at = NULL, failed_at = now(), attempts = 5, last_error = 'too large' WHERE aggregate_id = {}",
                o(21)
            ),
            "failed_rows",
        ),
        (
            "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason, kind) VALUES ('t', 0, 1, 'bad', 'undecodable')".to_owned(),
            "dead_letters - late_duplicates",
        ),
        // Refused after the horizon, and its order has no charge by it: a
        // first delivery that came too late, an effect lost until applied
        // by hand.
        (
            format!(
                "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason, kind, msg_id, order_id) \
                 VALUES ('t', 0, 2, 'late', 'after_horizon', gen_random_uuid(), {})",
                o(22)
            ),
            "dead_letters - late_duplicates",
        ),
        // Over HTTP: a delivery the sender gave up, one still open, and a
        // webhook claimed but not applied.
        (
            format!(
                "INSERT INTO orders.webhook_deliveries (destination, outbox_id, aggregate_id, msg_id, body, failed_at) \
                 SELECT 'd', id, aggregate_id, msg_id, payload, now() FROM orders.outbox WHERE aggregate_id = {}",
                o(23)
            ),
            "failed_deliveries",
        ),
        (
            format!(
                "INSERT INTO orders.webhook_deliveries (destination, outbox_id, aggregate_id, msg_id, body) \
                 SELECT 'd', id, aggregate_id, msg_id, payload FROM orders.outbox WHERE aggregate_id = {}",
                o(24)
            ),
            "open_deliveries",
        ),
        (
            "INSERT INTO payments.webhook_inbox (msg_id, payload, payload_hash) \
             VALUES (effectively.v7_floor(now()), '\\x00', 0)"
                .to_owned(),
            "unprocessed_webhooks",
        ),
    ];
    for (sql, check) in cases {
        let mut tx = pool.begin().await.expect("begin");
        sqlx::query(&sql).execute(&mut *tx).await.expect(&sql);
        let report = recon::reconcile(&mut tx).await.expect("recon");
        let drift = report.drift(Policy::default());
        assert!(
            drift.contains(&check),
            "{check} not named after `{sql}`; drift: {drift:?}\n{}",
            report.table(Policy::default())
        );
        if matches!(
            check,
            "failed_rows" | "dead_letters - late_duplicates" | "failed_deliveries"
        ) {
            let allowed = Policy {
                allow_dead_letters: true,
                ..Policy::default()
            };
            assert!(
                !report.drift(allowed).contains(&check),
                "--allow-dead-letters reports {check} without calling it drift"
            );
        }
        tx.rollback().await.expect("rollback");
    }
}

/// Each key's stored response, replayed verbatim to a retry, must be the
/// one orders stores for the key's own order: status 201, a `Location`
/// naming that order, and the `ETag` orders computes for it. Each
/// corruption alone, committed, is drift named alone, and the binary exits
/// 1 naming it.
#[tokio::test]
async fn a_stored_response_with_another_status_location_or_etag_is_drift() {
    // The header `name` of order `from`'s stored response set to `value`,
    // in place (the other headers and their order kept).
    let set_header = |name: &str, from: u32, value: &str| {
        format!(
            "UPDATE fx.idempotency_keys SET response_headers = \
               (SELECT jsonb_agg(CASE WHEN h->>0 = '{name}' THEN jsonb_build_array('{name}', {value}) ELSE h END ORDER BY n) \
                FROM jsonb_array_elements(response_headers) WITH ORDINALITY AS x(h, n)) \
             WHERE effectively.uuid_of(reference) = '{from:032x}'::uuid"
        )
    };
    let cases = [
        (
            "UPDATE fx.idempotency_keys SET response_status = 500 \
             WHERE effectively.uuid_of(reference) = '00000000000000000000000000000003'::uuid"
                .to_owned(),
            "responses_with_wrong_status",
        ),
        (
            // Another order's Location.
            set_header(
                "location",
                4,
                "'/orders/' || '00000000000000000000000000000005'::uuid",
            ),
            "responses_with_wrong_location",
        ),
        (
            // Another order's ETag: well formed, not this order's.
            set_header(
                "etag",
                6,
                "(SELECT e.pair->>1 FROM fx.idempotency_keys k, jsonb_array_elements(k.response_headers) AS e(pair) \
                  WHERE effectively.uuid_of(k.reference) = '00000000000000000000000000000007'::uuid AND e.pair->>0 = 'etag')",
            ),
            "responses_with_wrong_etag",
        ),
    ];
    // Every case runs; the failures are reported together.
    let mut wrong = Vec::new();
    for (sql, check) in cases {
        let (db, pool) = seeded(10).await;
        let changed = sqlx::query(&sql)
            .execute(&pool)
            .await
            .expect(&sql)
            .rows_affected();
        assert_eq!(changed, 1, "{sql}");
        let mut conn = pool.acquire().await.expect("connect");
        let report = recon::reconcile(&mut conn).await.expect("recon");
        let drift = report.drift(Policy::default());
        if drift != [check] {
            wrong.push(format!("{check}: drift {drift:?} after `{sql}`"));
        }
        let out = std::process::Command::new(bin("recon"))
            .env("DATABASE_URL", db.url_as(ServiceRole::Recon))
            .env("RUST_LOG", "error")
            .output()
            .expect("run recon");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let named = format!("DRIFT — effects != intents ({check})");
        if out.status.code() != Some(1) || !stdout.contains(&named) {
            wrong.push(format!(
                "{check}: the binary exited {:?} without `{named}`",
                out.status.code()
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The binary: exit 0 on the clean seed; exit 1 naming the check once two
/// orders' charged amounts are swapped (the sums still agree).
#[tokio::test]
async fn the_recon_binary_exits_one_and_names_the_check() {
    let (db, pool) = seeded(20).await;
    let run = || {
        std::process::Command::new(bin("recon"))
            .env("DATABASE_URL", db.url_as(ServiceRole::Recon))
            .env("RUST_LOG", "error")
            .output()
            .expect("run recon")
    };
    let out = run();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    sqlx::query(
        "UPDATE payments.charges c SET amount_cents = s.amount_cents \
         FROM (SELECT order_id, CASE WHEN order_id = '00000000000000000000000000000001'::uuid \
                 THEN (SELECT amount_cents FROM payments.charges WHERE order_id = '00000000000000000000000000000002'::uuid) \
                 ELSE (SELECT amount_cents FROM payments.charges WHERE order_id = '00000000000000000000000000000001'::uuid) END AS amount_cents \
               FROM payments.charges WHERE order_id IN ('00000000000000000000000000000001'::uuid, '00000000000000000000000000000002'::uuid)) s \
         WHERE c.order_id = s.order_id",
    )
    .execute(&pool)
    .await
    .expect("swap");
    let out = run();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("DRIFT — effects != intents (charge_mismatches"),
        "{stdout}"
    );
}

/// The diff in order-id ranges side by side (one shared snapshot) adds up
/// to the diff as one statement, whatever the number of ranges, with drift
/// in the middle of the ids and orphans beyond both ends of the orders'
/// ids (which only the first and last range reach).
#[tokio::test]
async fn the_ranges_add_up_to_the_whole() {
    let (_db, pool) = seeded(300).await;
    for sql in [
        // An orphan charge, ledger entry and key above the largest order id.
        "INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents) \
         VALUES (gen_random_uuid(), 'ffffffff-0000-0000-0000-000000000000', gen_random_uuid(), 1, 5)",
        "INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
         VALUES (1, 'ffffffff-0000-0000-0000-000000000000', gen_random_uuid(), 5)",
        "UPDATE fx.idempotency_keys SET reference = 'fffffffe-0000-0000-0000-000000000000' \
         WHERE effectively.uuid_of(reference) = '00000000000000000000000000000007'::uuid",
        // An orphan event below the smallest.
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, published_at) \
         VALUES ('00000000-0000-0000-0000-000000000000', gen_random_uuid(), 'order.created', '{}', now())",
        // Drift in the middle.
        "INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
         SELECT account_id, order_id, msg_id, amount_cents FROM payments.ledger \
         WHERE order_id = '00000000000000000000000000000096'::uuid",
        "UPDATE payments.charges SET account_id = account_id + 1 \
         WHERE order_id = '000000000000000000000000000000c8'::uuid",
        "UPDATE fx.idempotency_keys SET response_status = 500 \
         WHERE effectively.uuid_of(reference) = '000000000000000000000000000000c9'::uuid",
        "DELETE FROM fx.partitioned_inbox WHERE consumer = 'payments' AND msg_id = \
         (SELECT msg_id FROM orders.outbox WHERE aggregate_id = '00000000000000000000000000000064'::uuid)",
        // (above every msg_id, inside the inbox's oldest partition: 2004)
        "INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) \
         VALUES ('payments', '00ffffff-ffff-ffff-ffff-ffffffffffff', '')",
        "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason, kind) \
         VALUES ('t', 0, 1, 'bad', 'undecodable')",
    ] {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    let mut conn = pool.acquire().await.expect("connect");
    let whole = recon::reconcile(&mut conn).await.expect("recon");
    drop(conn);
    assert_eq!(whole.charges_without_order, 1);
    assert_eq!(whole.effects_without_order, 1);
    assert_eq!(whole.intents_without_order, 1);
    assert_eq!(whole.events_without_order, 1);
    assert_eq!(whole.double_charges, 1);
    assert_eq!(whole.charge_mismatches, 1);
    assert_eq!(
        whole.events_not_consumed, 2,
        "the deleted one and the orphan"
    );
    assert_eq!(whole.inbox_without_event, 1);
    assert_eq!(whole.dead_letters, 1);
    assert_eq!(whole.responses_with_wrong_status, 1);
    assert_eq!(
        (
            whole.responses_with_wrong_location,
            whole.responses_with_wrong_etag
        ),
        (1, 1),
        "the key moved to another order id kept the first order's response"
    );
    for jobs in 1..=7 {
        let parts = recon::reconcile_in_parts(&pool, jobs).await.expect("recon");
        assert_eq!(parts, whole, "--jobs {jobs}");
    }
}

/// After the keys, the published outbox rows and the inbox's oldest
/// partition expired, recon checks each order against what still covers it
/// (orders, charges and the ledger never expire), stays CLEAN, says where
/// each store starts, and still catches drift in what is covered.
#[tokio::test]
async fn recon_checks_what_the_stores_kept_after_expiry() {
    let (_db, pool) = seeded(40).await;
    let mut conn = pool.acquire().await.expect("connect");
    let before = recon::reconcile(&mut conn).await.expect("recon");
    assert_eq!(before.floors, recon::Floors::NONE);
    assert!(
        before
            .table(Policy::default())
            .contains("keys: all; events: all")
    );
    drop(conn);

    // Expire everything the seed made (its ids are minted in 1970).
    for sql in [
        "UPDATE orders.key_policy SET retention = interval '1 millisecond'",
        "UPDATE orders.outbox_policy SET retention = interval '1 millisecond'",
        "SELECT orders.keys_expire(1000)",
        "SELECT orders.outbox_expire(1000)",
        "SELECT fx.partitioned_inbox_expire('payments', interval '0')",
    ] {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    let mut conn = pool.acquire().await.expect("connect");
    let after = recon::reconcile_in_parts(&pool, 3).await.expect("recon");
    let table = after.table(Policy::default());
    assert!(after.is_clean(Policy::default()), "{table}");
    assert_eq!(
        (after.intents, after.outbox_rows, after.inbox_msg_ids),
        (0, 0, 0)
    );
    assert_eq!((after.distinct_orders, after.distinct_charges), (40, 40));
    assert!(after.floors.keys > uuid::Uuid::nil() && after.floors.outbox > uuid::Uuid::nil());
    assert!(table.contains("keys: since 20"), "{table}");
    assert_eq!(
        after,
        recon::reconcile(&mut conn).await.expect("recon"),
        "in parts or whole"
    );

    // Charges and the ledger are still checked for every order...
    sqlx::query(
        "INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
         SELECT account_id, order_id, msg_id, amount_cents FROM payments.ledger \
         WHERE order_id = '00000000000000000000000000000007'::uuid",
    )
    .execute(&mut *conn)
    .await
    .expect("double");
    // ... and an order minted after the floors still needs its key and event.
    sqlx::query(
        "INSERT INTO orders.orders (order_id, account_id, amount_cents, status) \
         VALUES (effectively.v7_floor(now() + interval '1 second'), 1, 100, 'created')",
    )
    .execute(&mut *conn)
    .await
    .expect("new order");
    let drift = recon::reconcile(&mut conn).await.expect("recon");
    let names = drift.drift(Policy::default());
    for name in [
        "double_charges",
        "orders_without_key",
        "orders_without_event",
        "orders_without_charge",
    ] {
        assert!(names.contains(&name), "{name} in {names:?}");
    }
}

/// A key is deleted when its order id is below the cut and its own
/// `created_at` (the database's clock at the insert) is older than the
/// retention. A key's `created_at` lags its order id's mint time (the
/// request's queue and the writers' linger, more with a slow orders clock),
/// so keys below the cut survive a pass while the key floor moves to the
/// cut. Recon counts intents from the floor up, as it counts the orders
/// that need one: CLEAN on such a database, and still CLEAN once those keys
/// expire too. (Before, recon counted every key as an intent and only the
/// orders from the floor up: "distinct_orders - intents" was -5.)
#[tokio::test]
async fn keys_that_outlive_the_key_floor_are_not_drift() {
    let (_db, pool) = seeded(40).await;
    // The seed's order ids are minted in 1970; its keys were written two
    // hours ago, but five of them only now.
    let written = "UPDATE fx.idempotency_keys SET created_at = now() - interval '2 hours'";
    let lagging = "UPDATE fx.idempotency_keys SET created_at = now() \
                   WHERE reference IN (SELECT reference FROM fx.idempotency_keys \
                                       ORDER BY reference OFFSET 20 LIMIT 5)";
    for sql in [
        written,
        lagging,
        "UPDATE orders.key_policy SET retention = interval '1 hour'",
    ] {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    let expired: i32 = sqlx::query_scalar("SELECT orders.keys_expire(1000)")
        .fetch_one(&pool)
        .await
        .expect("expire");
    assert_eq!(expired, 35, "the keys younger than the retention survive");
    let below: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fx.idempotency_keys \
         WHERE effectively.uuid_of(reference) < (SELECT floor FROM orders.key_policy)",
    )
    .fetch_one(&pool)
    .await
    .expect("below the floor");
    assert_eq!(below, 5, "the floor moved past the surviving keys");

    let mut conn = pool.acquire().await.expect("connect");
    let whole = recon::reconcile(&mut conn).await.expect("recon");
    let table = whole.table(Policy::default());
    assert!(whole.is_clean(Policy::default()), "{table}");
    assert_eq!(
        (
            whole.intents,
            whole.orders_since_key_floor,
            whole.distinct_orders
        ),
        (0, 0, 40)
    );
    for jobs in [1, 3, 7] {
        let parts = recon::reconcile_in_parts(&pool, jobs).await.expect("recon");
        assert_eq!(parts, whole, "--jobs {jobs}");
    }

    // The client's successes: an expired key is matched by the order it was
    // given (orders never expire); a success whose order is not there is
    // missing, expired key or not.
    let mut succeeded: Vec<(String, uuid::Uuid)> = (1..=40_u128)
        .map(|i| (format!("seed-{i}"), uuid::Uuid::from_u128(i)))
        .collect();
    let client = recon::ClientIntents {
        succeeded: shared(&succeeded),
        ambiguous: vec![],
        failed: vec![],
    };
    let intents = recon::check_intents(&pool, &client).await.expect("intents");
    assert!(intents.is_clean(), "{}", intents.table());
    assert_eq!((intents.matched, intents.key_expired), (40, 35));
    succeeded.push(("seed-lost".into(), uuid::Uuid::from_u128(1000)));
    let lost = recon::check_intents(
        &pool,
        &recon::ClientIntents {
            succeeded: shared(&succeeded),
            ambiguous: vec![],
            failed: vec![],
        },
    )
    .await
    .expect("intents");
    assert_eq!((lost.matched, lost.missing_in_db), (40, 1));
    assert!(!lost.is_clean());

    // A key below the floor is still checked for pointing at an order.
    sqlx::query(
        "UPDATE fx.idempotency_keys SET reference = '00000000-0000-0000-0000-0000000000ff' \
         WHERE reference = (SELECT reference FROM fx.idempotency_keys ORDER BY reference LIMIT 1)",
    )
    .execute(&mut *conn)
    .await
    .expect("orphan key");
    let drift = recon::reconcile(&mut conn).await.expect("recon");
    let names = drift.drift(Policy::default());
    assert!(names.contains(&"intents_without_order"), "{names:?}");
}

/// Expiry drains in batches, one transaction each (`pipeline::lifecycle`),
/// and a recon may run between two of them: each batch's transaction moves
/// its store's floor up to the cut before it deletes below it, so what recon
/// checks (everything at and above the floors) is all there after any batch.
/// (Before, the floor moved only when a call found fewer than a batch left:
/// between two batches the deleted keys' and events' orders lay above the
/// old floor, and recon called them drift.)
#[tokio::test]
async fn a_recon_between_two_expiry_batches_is_clean() {
    let (_db, pool) = seeded(40).await;
    for sql in [
        "UPDATE fx.idempotency_keys SET created_at = now() - interval '2 hours'",
        "UPDATE orders.key_policy SET retention = interval '1 hour'",
        "UPDATE orders.outbox_policy SET retention = interval '1 hour'",
    ] {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    for (store, expire) in [
        ("keys", "SELECT orders.keys_expire(10)"),
        ("outbox", "SELECT orders.outbox_expire(10)"),
    ] {
        for batch in 1..=4 {
            let n: i32 = sqlx::query_scalar(expire)
                .fetch_one(&pool)
                .await
                .expect(expire);
            assert_eq!(n, 10, "{store}: batch {batch} deletes a whole batch");
            let report = recon::reconcile_in_parts(&pool, 2).await.expect("recon");
            assert!(
                report.is_clean(Policy::default()),
                "{store}, after batch {batch}:\n{}",
                report.table(Policy::default())
            );
        }
    }
    let mut conn = pool.acquire().await.expect("connect");
    let after = recon::reconcile(&mut conn).await.expect("recon");
    assert_eq!((after.intents, after.outbox_rows), (0, 0));
    assert_eq!(after.distinct_charges, 40);
}

/// A dead letter refused after the dedup horizon whose msg_id is the one
/// that charged the order it names is a late duplicate: reported, not drift.
#[tokio::test]
async fn a_late_duplicate_dead_letter_is_reported_not_drift() {
    let (_db, pool) = seeded(10).await;
    sqlx::query(
        "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason, kind, msg_id, order_id) \
         SELECT 't', 0, row_number() OVER (ORDER BY order_id), 'late', 'after_horizon', msg_id, order_id \
         FROM payments.charges ORDER BY order_id LIMIT 3",
    )
    .execute(&pool)
    .await
    .expect("late duplicates");
    let mut conn = pool.acquire().await.expect("connect");
    let report = recon::reconcile(&mut conn).await.expect("recon");
    assert_eq!((report.dead_letters, report.late_duplicates), (3, 3));
    assert!(
        report.is_clean(Policy::default()),
        "{}",
        report.table(Policy::default())
    );
    assert!(report.table(Policy::default()).contains("late duplicates"));
    // The same kind naming another msg_id than the charge's is drift.
    sqlx::query(
        "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason, kind, msg_id, order_id) \
         SELECT 't', 0, 4, 'late', 'after_horizon', gen_random_uuid(), order_id FROM payments.charges \
         ORDER BY order_id LIMIT 1",
    )
    .execute(&pool)
    .await
    .expect("late first delivery");
    let report = recon::reconcile(&mut conn).await.expect("recon");
    assert_eq!((report.dead_letters, report.late_duplicates), (4, 3));
    assert_eq!(
        report.drift(Policy::default()),
        ["dead_letters - late_duplicates"]
    );
}
