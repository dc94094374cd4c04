//! End to end: the real orders, relay and payments binaries as processes on
//! the stack of `make up` (a fresh database and topic), load with retries,
//! then recon's diff. The binaries are the workspace's own, built by the same
//! `cargo nextest run --workspace` / `cargo build` as this test.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use effectively::testing::{TestDb, TestTopic, eventually};
use sqlx::PgPool;
use tokio::process::{Child, Command};

fn bin(name: &str) -> PathBuf {
    // target/<profile>/deps/e2e-<hash> → target/<profile>/<name>
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} missing: build the workspace first (`cargo build --workspace`)",
        path.display()
    );
    path
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

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
        let env = |cmd: &mut Command| {
            cmd.env("DATABASE_URL", &db.url)
                .env("DB_MIGRATE", "false")
                .env("KAFKA_BOOTSTRAP_SERVERS", &topic.bootstrap_servers)
                .env("KAFKA_TOPIC", &topic.name)
                .env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .kill_on_drop(true);
        };
        let mut orders = Command::new(bin("orders"));
        env(&mut orders);
        orders
            .env("ORDERS_HTTP_ADDR", format!("127.0.0.1:{http}"))
            .env("ORDERS_GRPC_ADDR", format!("127.0.0.1:{grpc}"));
        let mut relay = Command::new(bin("relay"));
        env(&mut relay);
        relay.env("RELAY_METRICS_ADDR", format!("127.0.0.1:{relay_m}"));
        let mut payments = Command::new(bin("payments"));
        env(&mut payments);
        payments
            .env("PAYMENTS_METRICS_ADDR", format!("127.0.0.1:{pay_m}"))
            .env("PAYMENTS_GROUP_ID", format!("e2e-{}", db.name));
        let children = [orders, relay, payments]
            .iter_mut()
            .map(|c| c.spawn().expect("spawn"))
            .collect();
        let http = format!("http://127.0.0.1:{http}");
        let up = eventually(Duration::from_secs(20), || async {
            reqwest::get(format!("{http}/metrics")).await.is_ok()
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
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
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
        recon::wait_drained(pool, Duration::from_secs(90))
            .await
            .expect("drain query"),
        "pipeline drained"
    );
    recon::reconcile(pool).await.expect("recon")
}

#[tokio::test]
async fn orders_with_retries_flow_to_exactly_one_charge_each() {
    let stack = Stack::start().await;
    let seen = send_orders(&stack.http, 300, 2).await;
    let pool = stack.pool().await;
    let report = recon(&pool).await;
    assert!(report.is_clean(), "recon drift:\n{}", report.table());
    assert_eq!(report.intents, 300);
    assert_eq!(report.distinct_charges, 300);

    // The client's ground truth agrees with the database ...
    let client = recon::ClientIntents {
        succeeded: seen.clone(),
        ambiguous: vec!["e2e-1".into(), "never-sent".into()],
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
            succeeded: tampered,
            ambiguous: vec![],
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
        report.is_clean(),
        "recon drift after re-publish:\n{}",
        report.table()
    );
    assert_eq!(report.charge_effects, 300, "still one charge each");
    assert_eq!(report.published_rows, 300);
    drop(stack.children);
    let _ = stack.topic;
}
