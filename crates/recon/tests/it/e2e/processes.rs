//! The whole pipeline as processes: orders with retries flow to exactly one
//! charge each, and a re-publish is absorbed.

use std::process::Stdio;
use std::time::Duration;

use pipeline::db::ServiceRole;
use pipeline::testing::{
    TestDb, TestTopic, eventually, free_port, series_value, workspace_bin as bin,
};
use recon::{ClientKey, Policy};
use sqlx::PgPool;
use tokio::process::{Child, Command};

use super::shared;

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
