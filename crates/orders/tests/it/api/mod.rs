//! Orders API against the real PostgreSQL started by `make up`: a fresh
//! database per test, the real `run` on port 0, HTTP and gRPC clients.
//! Here the shared harness (the app, its replies, the row counts); each
//! concern's tests in a file of their own.

use std::net::SocketAddr;
use std::time::Duration;

use orders::config::Config;
use orders::proto::orders_client::OrdersClient;
use orders::run;
use orders::store::InjectFault;
use pipeline::config::DbArgs;
use pipeline::db::ServiceRole;
use pipeline::idempotency::ClaimStrategy;
use pipeline::testing::TestDb;
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

// Callers, their tokens and their own key scopes.
mod auth;
// The claim strategies, coalesced batches and the no-idempotency baseline.
mod claims;
// The start-up check of the clock against the database's.
mod clock;
// Failures in the transaction, a crash at commit, database errors.
mod faults;
// Retries, concurrent duplicates and reuse of one key, over HTTP and gRPC.
mod idempotency;
// The metrics port and what it counts.
mod metrics;
// The outbox's NOTIFY to the relay.
mod outbox;
// The key retention, whatever the clock that minted the order.
mod retention;
// Slow HTTP and gRPC clients, the timeouts and the connection cap.
mod slow_clients;
// Bad input: its errors, and no key consumed.
mod validation;
// The write queue's bound, load shedding and requests whose client left.
mod write_queue;

struct TestApp {
    http: String,
    metrics: String,
    http_addr: SocketAddr,
    grpc: SocketAddr,
    client: reqwest::Client,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl TestApp {
    async fn spawn(db: &TestDb, fault: InjectFault) -> Self {
        Self::spawn_with(db, fault, 4, 4096, false).await
    }

    async fn spawn_with(
        db: &TestDb,
        fault: InjectFault,
        writers: usize,
        queue: usize,
        no_idempotency: bool,
    ) -> Self {
        Self::spawn_tuned(db, fault, writers, queue, no_idempotency, |_| {}).await
    }

    /// Like `spawn_with`, with `tune` setting more of the config.
    async fn spawn_tuned(
        db: &TestDb,
        fault: InjectFault,
        writers: usize,
        queue: usize,
        no_idempotency: bool,
        tune: impl FnOnce(&mut Config),
    ) -> Self {
        let http = TcpListener::bind("127.0.0.1:0").await.expect("bind http");
        let grpc = TcpListener::bind("127.0.0.1:0").await.expect("bind grpc");
        let metrics = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind metrics");
        let metrics_addr = metrics.local_addr().expect("metrics addr");
        let http_addr = http.local_addr().expect("http addr");
        let grpc_addr = grpc.local_addr().expect("grpc addr");
        // The service's own role: the grants are proven by every test here.
        let db_args = DbArgs::for_url(db.url_as(ServiceRole::Orders));
        let mut config = Config {
            db: db_args,
            runtime: pipeline::config::RuntimeArgs { worker_threads: 0 },
            crash: pipeline::crash::CrashArgs::default(),
            http_addr,
            grpc_addr,
            metrics_addr,
            max_body_bytes: 1024,
            shutdown_timeout_secs: 5,
            writers,
            write_batch_max: 128,
            write_linger_us: 1_000,
            write_queue: queue,
            migrate_only: false,
            inject_fault: fault,
            no_idempotency,
            claim_strategy: ClaimStrategy::OnConflict,
            max_clock_skew_secs: 60,
            header_read_timeout_ms: 10_000,
            request_timeout_ms: 30_000,
            max_connections: 4096,
            grpc_max_streams_per_connection: 200,
            grpc_keepalive_interval_ms: 30_000,
            grpc_keepalive_timeout_ms: 10_000,
            auth_tokens_file: None,
        };
        tune(&mut config);
        let cancel = CancellationToken::new();
        let listeners = orders::Listeners {
            http,
            grpc,
            metrics,
        };
        let task = tokio::spawn(run(config, listeners, cancel.clone()));
        Self {
            http: format!("http://{http_addr}"),
            metrics: format!("http://{metrics_addr}/metrics"),
            http_addr,
            grpc: grpc_addr,
            client: reqwest::Client::new(),
            cancel,
            task,
        }
    }

    async fn post(&self, key: Option<&str>, content_type: Option<&str>, body: &str) -> Reply {
        let mut request = self
            .client
            .post(format!("{}/orders", self.http))
            .body(body.to_owned());
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        if let Some(ct) = content_type {
            request = request.header("Content-Type", ct);
        }
        Reply::from(request.send().await.expect("send")).await
    }

    async fn create(&self, key: &str, body: &str) -> Reply {
        self.post(Some(key), Some("application/json"), body).await
    }

    /// Its metrics, from the metrics address.
    async fn scrape(&self) -> String {
        self.client
            .get(&self.metrics)
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("text")
    }

    async fn grpc(&self) -> OrdersClient<tonic::transport::Channel> {
        OrdersClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("grpc connect")
    }

    async fn stop(self) {
        self.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("shutdown in time")
            .expect("join")
            .expect("run ok");
    }
}

/// What the client sees, minus the Date header.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Reply {
    status: StatusCode,
    location: Option<String>,
    etag: Option<String>,
    content_type: Option<String>,
    body: Vec<u8>,
}

impl Reply {
    async fn from(response: reqwest::Response) -> Self {
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().expect("ascii header").to_owned())
        };
        let (location, etag, content_type) =
            (header("location"), header("etag"), header("content-type"));
        Self {
            status: response.status(),
            location,
            etag,
            content_type,
            body: response.bytes().await.expect("body").to_vec(),
        }
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("json body")
    }

    fn error_code(&self) -> String {
        let json = self.json();
        assert!(
            json["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "error body has a message: {json}"
        );
        json["error"]["code"]
            .as_str()
            .expect("error code")
            .to_owned()
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Counts {
    keys: i64,
    orders: i64,
    outbox: i64,
}

async fn counts(db: &TestDb) -> Counts {
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (keys, orders, outbox) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM fx.idempotency_keys), \
                (SELECT count(*) FROM orders.orders), \
                (SELECT count(*) FROM orders.outbox)",
    )
    .fetch_one(&pool)
    .await
    .expect("counts");
    pool.close().await;
    Counts {
        keys,
        orders,
        outbox,
    }
}

fn n(count: i64) -> Counts {
    Counts {
        keys: count,
        orders: count,
        outbox: count,
    }
}

const BODY: &str = r#"{"account_id": 42, "amount_cents": 1999}"#;
