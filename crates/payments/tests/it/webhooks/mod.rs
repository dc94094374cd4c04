//! Payments over HTTP (`--source http`) against the real PostgreSQL of
//! `make up`: signed webhooks claimed by the receiver, applied by its inbox
//! processor. A fresh database per test; no broker is involved (the Kafka
//! settings point at a closed port, and payments must not need them).

// Each event charged once: retries, a pruned receipt, a crash before the answer.
mod exactly_once;
// Slow clients closed after the timeouts; 503 past the handling slots.
mod overload;
// The inbox processor: two on one database, backing off, claims that wait.
mod processor;
// What the receiver refuses: bad signatures, non-events, conflicting ids.
mod refusals;

use std::time::Duration;

use effectively::webhook::{self, Secret};
use payments::dup::DupArgs;
use payments::horizon::Retention;
use payments::receiver::WebhookArgs;
use payments::{Config, GroupProtocol, Transport, run_on};
use pipeline::config::{DbArgs, KafkaArgs};
use pipeline::contract::WEBHOOK_PATH;
use pipeline::crash::CrashArgs;
use pipeline::db::ServiceRole;
use pipeline::envelope::Envelope;
use pipeline::testing::{Service, TestDb};
use reqwest::StatusCode;
use sqlx::PgPool;
use tokio::net::TcpListener;
use uuid::Uuid;

/// An `order.created` envelope: (msg_id, body).
fn event(msg_id: Uuid, order_id: Uuid, amount_cents: i64) -> Vec<u8> {
    let payload = format!(
        r#"{{"order_id":"{order_id}","account_id":7,"amount_cents":{amount_cents},"status":"created"}}"#
    );
    Envelope::new(
        msg_id,
        "order.created".into(),
        order_id,
        chrono::Utc::now(),
        payload.as_bytes(),
    )
    .expect("envelope")
    .encode()
    .expect("encode")
}

fn config(db: &TestDb, secret: &Secret) -> Config {
    Config {
        db: DbArgs::for_url(db.url_as(ServiceRole::Payments)),
        runtime: pipeline::config::RuntimeArgs { worker_threads: 0 },
        // Nothing listens there: over HTTP payments never asks a broker.
        kafka: KafkaArgs {
            kafka_bootstrap_servers: "127.0.0.1:9".into(),
            kafka_client_config: None,
            kafka_topic: "unused".into(),
            allow_under_replicated_topic: false,
        },
        crash: CrashArgs::default(),
        dup: DupArgs::default(),
        source: Transport::Http,
        input_format: payments::InputFormat::Envelope,
        webhook: WebhookArgs {
            webhook_addr: "127.0.0.1:0".parse().expect("addr"),
            webhook_secret: vec![secret.clone()],
            webhook_tolerance: Duration::from_secs(300),
            webhook_receipts_kept: Duration::from_secs(86_400),
            webhook_poll_ms: 100,
            webhook_header_read_timeout: Duration::from_secs(10),
            webhook_request_timeout: Duration::from_secs(15),
            webhook_max_connections: 4096,
            webhook_concurrency: 256,
        },
        group_id: "unused".into(),
        batch_size: 50,
        batch_linger_ms: 5,
        group_protocol: GroupProtocol::Classic,
        session_timeout_ms: 6_000,
        fetch_wait_max_ms: 25,
        commit_interval_ms: 1000,
        group_instance_id: None,
        hold_retry_ms: 300,
        lag_sample_ms: 1000,
        metrics_addr: "127.0.0.1:0".parse().expect("addr"),
        unsafe_split_txn: None,
        inbox_retention: Retention::parse("16d").expect("retention"),
        unsafe_inbox_retention: false,
        unsafe_apply_after_horizon: false,
        inbox_partition: Duration::from_secs(86_400),
        clock_skew: Duration::from_secs(300),
    }
}

struct Receiver {
    url: String,
    secret: Secret,
    client: reqwest::Client,
    service: Service,
}

/// The response's status and JSON body.
type Answer = (StatusCode, serde_json::Value);

impl Receiver {
    async fn spawn(db: &TestDb) -> Self {
        Self::spawn_with(db, Secret::generate()).await
    }

    /// A receiver whose webhook settings `tune` changes first.
    async fn spawn_tuned(db: &TestDb, tune: impl FnOnce(&mut WebhookArgs)) -> Self {
        Self::spawn_configured(db, Secret::generate(), tune).await
    }

    async fn spawn_with(db: &TestDb, secret: Secret) -> Self {
        Self::spawn_configured(db, secret, |_| {}).await
    }

    async fn spawn_configured(
        db: &TestDb,
        secret: Secret,
        tune: impl FnOnce(&mut WebhookArgs),
    ) -> Self {
        let webhooks = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!(
            "http://{}{WEBHOOK_PATH}",
            webhooks.local_addr().expect("addr")
        );
        let mut config = config(db, &secret);
        tune(&mut config.webhook);
        let service = Service::spawn("payments", move |metrics, cancel| {
            run_on(config, metrics, Some(webhooks), cancel)
        })
        .await;
        Self {
            url,
            secret,
            client: reqwest::Client::new(),
            service,
        }
    }

    /// Posts `body` under `id`, signed at `timestamp` with `secret`.
    async fn post_as(&self, secret: &Secret, id: &str, timestamp: i64, body: &[u8]) -> Answer {
        let signature =
            webhook::signature_header(std::slice::from_ref(secret), id, timestamp, body);
        self.post_raw(id, &timestamp.to_string(), &signature, body.to_vec())
            .await
    }

    async fn post_raw(&self, id: &str, timestamp: &str, signature: &str, body: Vec<u8>) -> Answer {
        // The server may still be starting: retry a refused connection.
        for _ in 0..100 {
            let sent = self
                .client
                .post(&self.url)
                .header(webhook::HEADER_ID, id)
                .header(webhook::HEADER_TIMESTAMP, timestamp)
                .header(webhook::HEADER_SIGNATURE, signature)
                .header("content-type", "application/json")
                .body(body.clone())
                .send()
                .await;
            match sent {
                Ok(response) => {
                    let status = response.status();
                    let json = response.json().await.unwrap_or(serde_json::Value::Null);
                    return (status, json);
                }
                Err(e) if e.is_connect() => tokio::time::sleep(Duration::from_millis(100)).await,
                Err(e) => panic!("post: {e}"),
            }
        }
        panic!("the receiver never listened");
    }

    /// Posts `body` under `msg_id`, signed now with the receiver's secret.
    async fn post(&self, msg_id: Uuid, body: &[u8]) -> Answer {
        let now = chrono::Utc::now().timestamp();
        self.post_as(&self.secret, &msg_id.to_string(), now, body)
            .await
    }

    async fn metric(&self, series: &str) -> f64 {
        self.service.metric(series).await
    }

    async fn stop(self) {
        self.service.stop().await;
    }
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

const CHARGES: &str = "SELECT count(*) FROM payments.charges";
const LEDGER: &str = "SELECT count(*) FROM payments.ledger";
const INBOX: &str = "SELECT count(*) FROM fx.partitioned_inbox WHERE consumer = 'payments'";
const CLAIMS: &str = "SELECT count(*) FROM payments.webhook_inbox";
const UNPROCESSED: &str = "SELECT count(*) FROM payments.webhook_inbox WHERE processed_at IS NULL";
