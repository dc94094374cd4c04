//! `relay --sink http` against the real PostgreSQL of `make up` and a
//! receiver in this process whose answers each test scripts. No broker.
//! The receiver and the helpers the tests share are here, the tests in a
//! module per concern.

mod delivery;
mod destinations;
mod retries;
mod secrets;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use effectively::webhook::{self, Secret};
use pipeline::config::{DbArgs, KafkaArgs};
use pipeline::crash::CrashArgs;
use pipeline::db::ServiceRole;
use pipeline::envelope::Envelope;
use pipeline::outbox::{Outbox, OutboxMessage};
use pipeline::testing::{Service, TestDb};
use relay::webhooks::{Destination, SecretsArgs, Specs};
use relay::{Config, Mode, Sink, run};
use sqlx::PgPool;
use tokio::net::TcpListener;
use uuid::Uuid;

/// What the receiver answers.
#[derive(Debug, Clone, Copy)]
struct Reply {
    status: u16,
    retry_after: Option<u64>,
    delay: Duration,
    /// The answer's `Date` this many seconds off the real time (the
    /// receiver's clock is wrong); `None`: the server's own `Date`.
    clock_off: Option<i64>,
}

impl Reply {
    const OK: Reply = Reply::status(200);

    const fn status(status: u16) -> Self {
        Self {
            status,
            retry_after: None,
            delay: Duration::ZERO,
            clock_off: None,
        }
    }
}

/// One request as the receiver saw it.
#[derive(Debug, Clone)]
struct Hit {
    at: Instant,
    msg_id: Uuid,
    key: Uuid,
    seq: i64,
    /// The n-th request of this msg_id (1 for the first).
    nth: u32,
    reply: Reply,
    /// The signature verified with the receiver's secret, within the
    /// tolerance; `Idempotency-Key` and `webhook-id` are the msg_id.
    authentic: bool,
}

type Script = dyn Fn(&Hit) -> Reply + Send + Sync;

#[derive(Clone)]
struct Receiver {
    secret: Secret,
    hits: Arc<Mutex<Vec<Hit>>>,
    script: Arc<Script>,
}

impl Receiver {
    /// Serves on a free port; returns it and the URL to configure.
    async fn start(script: impl Fn(&Hit) -> Reply + Send + Sync + 'static) -> (Self, String) {
        let receiver = Self {
            secret: Secret::generate(),
            hits: Arc::default(),
            script: Arc::new(script),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
        let app = Router::new()
            .route("/hook", post(receive))
            .with_state(receiver.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (receiver, url)
    }

    fn hits(&self) -> Vec<Hit> {
        self.hits.lock().expect("lock").clone()
    }

    /// The destination setting for this receiver.
    fn destination(&self, name: &str, url: &str, extra: &str) -> Destination {
        format!(
            "{name}={url},secret={},allow-http{extra}",
            self.secret.to_whsec()
        )
        .parse()
        .expect("destination")
    }
}

async fn receive(State(r): State<Receiver>, headers: HeaderMap, body: Bytes) -> Response {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    };
    let id = header(webhook::HEADER_ID);
    let verified = webhook::verify(
        std::slice::from_ref(&r.secret),
        &id,
        &header(webhook::HEADER_TIMESTAMP),
        &header(webhook::HEADER_SIGNATURE),
        &body,
        chrono::Utc::now().timestamp(),
        webhook::DEFAULT_TOLERANCE,
    )
    .is_ok();
    let envelope = Envelope::decode(&body).expect("an envelope");
    let payload: serde_json::Value = serde_json::from_str(envelope.payload.get()).expect("payload");
    let mut hit = Hit {
        at: Instant::now(),
        msg_id: envelope.msg_id,
        key: envelope.aggregate_id,
        seq: payload["seq"].as_i64().unwrap_or(-1),
        nth: 0,
        reply: Reply::OK,
        authentic: verified && id == envelope.msg_id.to_string() && header("idempotency-key") == id,
    };
    hit.nth = 1 + r
        .hits
        .lock()
        .expect("lock")
        .iter()
        .filter(|h| h.msg_id == hit.msg_id)
        .count() as u32;
    let reply = (r.script)(&hit);
    hit.reply = reply;
    r.hits.lock().expect("lock").push(hit);
    tokio::time::sleep(reply.delay).await;
    let mut response = StatusCode::from_u16(reply.status)
        .expect("status")
        .into_response();
    if let Some(seconds) = reply.retry_after {
        response
            .headers_mut()
            .insert("retry-after", seconds.to_string().parse().expect("value"));
    }
    if let Some(off) = reply.clock_off {
        let now = std::time::SystemTime::now();
        let by = Duration::from_secs(off.unsigned_abs());
        let at = if off >= 0 { now + by } else { now - by };
        // Set here, the server sends no Date of its own.
        response
            .headers_mut()
            .insert("date", httpdate::fmt_http_date(at).parse().expect("value"));
    }
    response
}

fn config(db: &TestDb, destinations: Vec<Destination>, scale: f64) -> Config {
    Config {
        command: None,
        db: DbArgs::for_url(db.url_as(ServiceRole::Relay)),
        runtime: pipeline::config::RuntimeArgs { worker_threads: 0 },
        // Nothing listens there: the http sink never asks a broker.
        kafka: KafkaArgs {
            kafka_bootstrap_servers: "127.0.0.1:9".into(),
            kafka_client_config: None,
            kafka_topic: "unused".into(),
            allow_under_replicated_topic: false,
        },
        crash: CrashArgs::default(),
        batch_size: 100,
        workers: 2,
        shard_groups: 2,
        shard_depth: 1,
        poll_interval_ms: 100,
        lag_sample_ms: 200,
        synchronous_commit: false,
        metrics_addr: "127.0.0.1:0".parse().expect("addr"),
        linger_ms: 2,
        busy_linger_ms: 0,
        busy_rows_per_sec: 2_000,
        message_timeout_ms: 10_000,
        max_attempts: 5,
        mode: Mode::Poll,
        wal_slot: None,
        wal_heartbeat_ms: 10_000,
        sink: Sink::Http,
        webhook_destination: destinations,
        // The receivers of these tests listen on loopback.
        webhook_allow_addresses: vec!["127.0.0.1/32".parse().expect("net")],
        webhook_schedule_scale: scale,
        webhook_secrets: secrets_args(),
    }
}

/// The stack's sealing key (.stack/secrets/webhook-secrets.key), as the
/// relay takes it.
fn secrets_args() -> SecretsArgs {
    SecretsArgs {
        webhook_secrets_key_file: Some(
            pipeline::testing::stack_var("RELAY_WEBHOOK_SECRETS_KEY_FILE").into(),
        ),
        unsafe_plaintext_webhook_secrets: false,
    }
}

/// How the relay stores the specs, with the stack's key.
fn specs() -> Specs {
    Specs::from_args(&secrets_args()).expect("the stack's webhook secrets key")
}

/// The relay on `config`, in this process.
async fn spawn_relay(config: Config) -> Service {
    Service::spawn("relay", |metrics, cancel| run(config, metrics, cancel)).await
}

/// Appends an event of `key` with payload `{"seq": seq}`; returns its msg_id.
async fn enqueue(pool: &PgPool, key: Uuid, seq: i64) -> Uuid {
    let msg_id = Uuid::now_v7();
    let mut conn = pool.acquire().await.expect("acquire");
    Outbox
        .enqueue_batch(
            &mut conn,
            &[OutboxMessage {
                aggregate_id: key,
                msg_id,
                event_type: "test.event".into(),
                payload: format!(r#"{{"seq":{seq}}}"#).into_bytes(),
            }],
        )
        .await
        .expect("enqueue");
    msg_id
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

const OPEN: &str = "SELECT count(*) FROM orders.webhook_deliveries WHERE delivered_at IS NULL AND failed_at IS NULL";

/// Per key, the seqs of the first delivery of each msg_id that was answered
/// 2xx, in arrival order.
fn delivered_order(hits: &[Hit]) -> HashMap<Uuid, Vec<i64>> {
    let mut order: HashMap<Uuid, Vec<i64>> = HashMap::new();
    for h in hits.iter().filter(|h| (200..300).contains(&h.reply.status)) {
        let seqs = order.entry(h.key).or_default();
        if !seqs.contains(&h.seq) {
            seqs.push(h.seq);
        }
    }
    order
}
