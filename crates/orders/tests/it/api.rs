//! Orders API against the real PostgreSQL started by `make up`: a fresh
//! database per test, the real `run` on port 0, HTTP and gRPC clients.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use orders::auth::Caller;
use orders::config::Config;
use orders::proto::orders_client::OrdersClient;
use orders::proto::{CreateOrderRequest, GetOrderRequest};
use orders::run;
use orders::store::InjectFault;
use pipeline::config::DbArgs;
use pipeline::db::ServiceRole;
use pipeline::idempotency::ClaimStrategy;
use pipeline::testing::slow::{all_closed, slow_clients};
use pipeline::testing::{TestDb, eventually, free_port};
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

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

#[tokio::test]
async fn sequential_retries_return_one_order_and_identical_responses() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;

    let first = app.create("seq-key-1", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let order_id = first.json()["order_id"]
        .as_str()
        .expect("order_id")
        .to_owned();
    assert_eq!(first.json()["status"], "created");
    assert_eq!(
        first.location.as_deref(),
        Some(format!("/orders/{order_id}").as_str())
    );
    assert!(first.etag.is_some());
    for _ in 0..5 {
        assert_eq!(app.create("seq-key-1", BODY).await, first);
    }
    // Same request, other whitespace and key order: the same request.
    let reordered = app
        .create(
            "seq-key-1",
            "{\n  \"amount_cents\":1999 , \"account_id\":42}",
        )
        .await;
    assert_eq!(reordered, first);
    assert_eq!(counts(&db).await, n(1));

    let got = app
        .client
        .get(format!("{}/orders/{order_id}", app.http))
        .send()
        .await
        .expect("get");
    assert_eq!(got.status(), StatusCode::OK);
    let got: Value = got.json().await.expect("json");
    assert_eq!(got["order_id"], order_id.as_str());
    assert_eq!(got["account_id"], 42);
    assert_eq!(got["amount_cents"], 1999);

    // The outbox row carries the order.
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (aggregate_id, event_type, payload, published): (
        uuid::Uuid,
        String,
        Vec<u8>,
        Option<chrono::DateTime<chrono::Utc>>,
    ) = sqlx::query_as("SELECT aggregate_id, event_type, payload, published_at FROM orders.outbox")
        .fetch_one(&pool)
        .await
        .expect("outbox row");
    assert_eq!(aggregate_id.to_string(), order_id);
    assert_eq!(event_type, "order.created");
    assert!(
        published.is_none(),
        "nothing is published in the request path"
    );
    let payload: Value = serde_json::from_slice(&payload).expect("payload json");
    assert_eq!(payload["amount_cents"], 1999);
    pool.close().await;
    app.stop().await;
}

/// A connection listening on the channel the relay is woken on.
async fn outbox_listener(db: &TestDb) -> sqlx::postgres::PgListener {
    let mut listener = sqlx::postgres::PgListener::connect(&db.url)
        .await
        .expect("listener");
    listener
        .listen(pipeline::outbox::NOTIFY_CHANNEL)
        .await
        .expect("listen");
    listener
}

/// The outbox's NOTIFY wakes the relay when a write inserts events, and only
/// then: a batch of replays inserts no outbox row, so it notifies no one.
#[tokio::test]
async fn a_new_order_notifies_the_relay_and_a_replay_does_not() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;
    let mut listener = outbox_listener(&db).await;
    let quiet = Duration::from_millis(500);

    assert_eq!(
        app.create("notify-1", BODY).await.status,
        StatusCode::CREATED
    );
    let woken = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await;
    let Ok(Ok(notification)) = woken else {
        panic!("a new order notifies: {woken:?}");
    };
    // It names the relay shard of the order's outbox row, and no other.
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let shard: i16 = sqlx::query_scalar("SELECT shard FROM orders.outbox")
        .fetch_one(&pool)
        .await
        .expect("shard");
    assert_eq!(
        notification.payload(),
        pipeline::outbox::shards_payload(1 << shard),
        "the NOTIFY names shard {shard}"
    );
    for _ in 0..3 {
        assert_eq!(
            app.create("notify-1", BODY).await.status,
            StatusCode::CREATED
        );
    }
    let after_replays = tokio::time::timeout(quiet, listener.recv()).await;
    assert!(
        after_replays.is_err(),
        "replays notify nobody: {after_replays:?}"
    );
    assert_eq!(counts(&db).await, n(1));
    app.stop().await;
}

/// The outbox trigger wakes the relay on the commit of any session that
/// inserts outbox rows, except a session that turned it off
/// (`effectively.outbox_notify = off`, as Orders' sessions do: its
/// `Notifier` wakes the relay instead, outside the write transactions).
#[tokio::test]
async fn the_outbox_trigger_notifies_unless_the_session_turned_it_off() {
    use sqlx::ConnectOptions;
    let db = TestDb::create().await;
    let mut listener = outbox_listener(&db).await;
    let options: sqlx::postgres::PgConnectOptions = db.url.parse().expect("url");
    let insert = "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
                  VALUES (gen_random_uuid(), gen_random_uuid(), 'order.created', '\\x7b7d')";

    let mut quiet = options
        .clone()
        .options([(pipeline::outbox::NOTIFY_SETTING, "off")])
        .connect()
        .await
        .expect("connect with the NOTIFY off");
    sqlx::query(insert)
        .execute(&mut quiet)
        .await
        .expect("insert");
    let heard = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await;
    assert!(heard.is_err(), "a session with the NOTIFY off: {heard:?}");

    let mut plain = options.connect().await.expect("connect");
    sqlx::query(insert)
        .execute(&mut plain)
        .await
        .expect("insert");
    let heard = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await;
    assert!(matches!(heard, Ok(Ok(_))), "any other session: {heard:?}");
}

#[tokio::test]
async fn fifty_concurrent_requests_with_one_key_make_one_order() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;

    let replies = futures::future::join_all((0..50).map(|_| app.create("hot-key", BODY))).await;
    let first = &replies[0];
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    for reply in &replies {
        assert_eq!(reply, first);
    }
    assert_eq!(counts(&db).await, n(1));

    // And different keys at the same time are different orders.
    let keys: Vec<String> = (0..20).map(|i| format!("many-{i}")).collect();
    let replies = futures::future::join_all(keys.iter().map(|k| app.create(k, BODY))).await;
    assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
    assert_eq!(counts(&db).await, n(21));
    app.stop().await;
}

#[tokio::test]
async fn same_key_with_a_different_request_is_a_conflict_and_writes_nothing() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;

    let first = app.create("reused", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = app
        .create("reused", r#"{"account_id": 42, "amount_cents": 2000}"#)
        .await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(other.error_code(), "idempotency_key_reused");
    assert_eq!(counts(&db).await, n(1));
    // The original is untouched.
    assert_eq!(app.create("reused", BODY).await, first);

    let mut grpc = app.grpc().await;
    let mut request = tonic::Request::new(CreateOrderRequest {
        account_id: 7,
        amount_cents: 1,
    });
    request
        .metadata_mut()
        .insert("idempotency-key", "reused".parse().expect("metadata"));
    let status = grpc.create(request).await.expect_err("mismatch");
    assert_eq!(status.code(), tonic::Code::AlreadyExists);
    assert_eq!(counts(&db).await, n(1));
    app.stop().await;
}

#[tokio::test]
async fn bad_input_gets_a_clear_error_and_does_not_consume_the_key() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;
    let json = Some("application/json");
    let long_key = "k".repeat(256);
    let big_body = format!(
        r#"{{"account_id": 1, "amount_cents": 1, "pad": "{}"}}"#,
        "x".repeat(2048)
    );

    // (key, content type, body, expected status, expected error code)
    type Case<'a> = (
        Option<&'a str>,
        Option<&'a str>,
        &'a str,
        StatusCode,
        &'a str,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            None,
            json,
            BODY,
            StatusCode::BAD_REQUEST,
            "missing_idempotency_key",
        ),
        (
            Some(""),
            json,
            BODY,
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
        ),
        (
            Some(&long_key),
            json,
            BODY,
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
        ),
        (
            Some("has space"),
            json,
            BODY,
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
        ),
        (
            Some("k1"),
            json,
            "{not json",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            Some("k1"),
            json,
            "",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 1, "amount_cents": 5, "extra": true}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": "1", "amount_cents": 5}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 1}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 0, "amount_cents": 5}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 1, "amount_cents": -5}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 1, "amount_cents": 10000000001}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 1, "amount_cents": 1.5}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            "[1, 2]",
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            Some("text/plain"),
            BODY,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            Some("k1"),
            None,
            BODY,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            Some("k1"),
            json,
            &big_body,
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
    ];
    for (key, content_type, body, status, code) in cases {
        let reply = app.post(key, content_type, body).await;
        assert_eq!(reply.status, status, "{key:?} {content_type:?} {body:.60}");
        assert_eq!(
            reply.error_code(),
            code,
            "{key:?} {content_type:?} {body:.60}"
        );
        assert_eq!(reply.content_type.as_deref(), Some("application/json"));
    }
    assert_eq!(counts(&db).await, n(0));

    // None of the rejected requests consumed "k1".
    let ok = app.create("k1", BODY).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(counts(&db).await, n(1));

    let missing = app
        .client
        .get(format!("{}/orders/{}", app.http, uuid::Uuid::now_v7()))
        .send()
        .await
        .expect("get");
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    let not_uuid = app
        .client
        .get(format!("{}/orders/not-a-uuid", app.http))
        .send()
        .await
        .expect("get");
    assert_eq!(not_uuid.status(), StatusCode::NOT_FOUND);

    // gRPC: a missing key and bad fields are INVALID_ARGUMENT.
    let mut grpc = app.grpc().await;
    let status = grpc
        .create(CreateOrderRequest {
            account_id: 1,
            amount_cents: 1,
        })
        .await
        .expect_err("no key");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let mut request = tonic::Request::new(CreateOrderRequest {
        account_id: 1,
        amount_cents: 0,
    });
    request
        .metadata_mut()
        .insert("idempotency-key", "grpc-bad".parse().expect("metadata"));
    assert_eq!(
        grpc.create(request).await.expect_err("bad amount").code(),
        tonic::Code::InvalidArgument
    );
    assert_eq!(counts(&db).await, n(1));
    app.stop().await;
}

#[tokio::test]
async fn a_key_used_over_http_and_retried_over_grpc_is_one_order() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;

    let first = app.create("cross-protocol", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let order_id = first.json()["order_id"].as_str().expect("id").to_owned();

    let mut grpc = app.grpc().await;
    for _ in 0..3 {
        let mut request = tonic::Request::new(CreateOrderRequest {
            account_id: 42,
            amount_cents: 1999,
        });
        request.metadata_mut().insert(
            "idempotency-key",
            "cross-protocol".parse().expect("metadata"),
        );
        let reply = grpc
            .create(request)
            .await
            .expect("grpc create")
            .into_inner();
        assert_eq!(reply.order_id, order_id);
        assert_eq!(reply.status, "created");
    }

    // And the other way round: gRPC first, then HTTP.
    let mut request = tonic::Request::new(CreateOrderRequest {
        account_id: 5,
        amount_cents: 10,
    });
    request
        .metadata_mut()
        .insert("idempotency-key", "grpc-first".parse().expect("metadata"));
    let reply = grpc
        .create(request)
        .await
        .expect("grpc create")
        .into_inner();
    let http = app
        .create("grpc-first", r#"{"account_id": 5, "amount_cents": 10}"#)
        .await;
    assert_eq!(http.status, StatusCode::CREATED);
    assert_eq!(http.json()["order_id"], reply.order_id.as_str());
    assert_eq!(counts(&db).await, n(2));

    let order = grpc
        .get(GetOrderRequest {
            order_id: order_id.clone(),
        })
        .await
        .expect("grpc get")
        .into_inner();
    assert_eq!(order.amount_cents, 1999);
    app.stop().await;
}

#[tokio::test]
async fn a_failure_inside_the_transaction_leaves_nothing_and_the_retry_succeeds() {
    let db = TestDb::create().await;
    let failing = TestApp::spawn(&db, InjectFault::AfterOrderInsert).await;
    let reply = failing.create("doomed", BODY).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.error_code(), "internal");
    assert!(
        !String::from_utf8_lossy(&reply.body).contains("injected"),
        "a 500 does not leak internals"
    );
    assert_eq!(counts(&db).await, n(0), "no key, order or outbox row left");
    failing.stop().await;

    let healthy = TestApp::spawn(&db, InjectFault::None).await;
    let retry = healthy.create("doomed", BODY).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(counts(&db).await, n(1));
    healthy.stop().await;
}

/// An HTTP create as `token`'s caller (no `Authorization` when `None`).
async fn create_as(app: &TestApp, token: Option<&str>, key: &str, body: &str) -> Reply {
    let mut request = app
        .client
        .post(format!("{}/orders", app.http))
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body.to_owned());
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    Reply::from(request.send().await.expect("send")).await
}

#[tokio::test]
async fn callers_authenticate_and_each_has_its_own_keys() {
    let db = TestDb::create().await;
    let dir = std::env::temp_dir().join(format!("orders-auth-{}", db.name));
    std::fs::create_dir_all(&dir).expect("dir");
    let tokens = dir.join("tokens");
    let (shop, shop_line) = orders::auth::new_token("shop").expect("token");
    let (billing, billing_line) = orders::auth::new_token("billing").expect("token");
    std::fs::write(&tokens, format!("{shop_line}\n{billing_line}\n")).expect("write");
    let path = tokens.clone();
    let app = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, move |c| {
        c.auth_tokens_file = Some(path);
    })
    .await;

    // No token, a token not in the file, another scheme: 401, nothing written.
    let (forged, _) = orders::auth::new_token("shop").expect("token");
    for token in [None, Some(forged.as_str()), Some("shop")] {
        let reply = create_as(&app, token, "k", BODY).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{token:?}");
        assert_eq!(reply.error_code(), "unauthenticated");
    }
    let basic = app
        .client
        .post(format!("{}/orders", app.http))
        .basic_auth("shop", Some(&shop))
        .send()
        .await
        .expect("send");
    assert_eq!(basic.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        basic
            .headers()
            .get("www-authenticate")
            .map(|v| v.as_bytes()),
        Some(b"Bearer".as_slice())
    );
    assert_eq!(counts(&db).await, n(0));

    // One key from two callers: two intents, two orders; a retry of each
    // replays its own; each caller's key still refuses another request.
    let first = create_as(&app, Some(&shop), "k", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = create_as(&app, Some(&billing), "k", BODY).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert_ne!(first.json()["order_id"], other.json()["order_id"]);
    assert_eq!(create_as(&app, Some(&shop), "k", BODY).await, first);
    assert_eq!(create_as(&app, Some(&billing), "k", BODY).await, other);
    let changed = r#"{"account_id": 42, "amount_cents": 2}"#;
    for token in [&shop, &billing] {
        let reply = create_as(&app, Some(token), "k", changed).await;
        assert_eq!(reply.status, StatusCode::CONFLICT);
    }
    assert_eq!(counts(&db).await, n(2));
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let scopes: Vec<String> =
        sqlx::query_scalar("SELECT scope FROM fx.idempotency_keys WHERE key = 'k' ORDER BY 1")
            .fetch_all(&pool)
            .await
            .expect("scopes");
    assert_eq!(scopes, ["billing", "shop"]);

    // Reads need a token too.
    let id = first.json()["order_id"].as_str().expect("id").to_owned();
    let read = |token: Option<String>| {
        let mut request = app.client.get(format!("{}/orders/{id}", app.http));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };
    assert_eq!(
        read(None).await.expect("get").status(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        read(Some(billing.clone())).await.expect("get").status(),
        StatusCode::OK
    );

    // gRPC: the same callers, the same scopes.
    let mut grpc = app.grpc().await;
    let call = |token: Option<&str>| {
        let mut request = tonic::Request::new(CreateOrderRequest {
            account_id: 42,
            amount_cents: 1999,
        });
        request
            .metadata_mut()
            .insert("idempotency-key", "k".parse().expect("metadata"));
        if let Some(token) = token {
            request.metadata_mut().insert(
                "authorization",
                format!("Bearer {token}").parse().expect("metadata"),
            );
        }
        request
    };
    let refused = grpc.create(call(None)).await.expect_err("no token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let refused = grpc.create(call(Some(&forged))).await.expect_err("forged");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let replay = grpc
        .create(call(Some(&shop)))
        .await
        .expect("replay")
        .into_inner();
    assert_eq!(
        replay.order_id,
        first.json()["order_id"].as_str().expect("id")
    );
    let get = tonic::Request::new(orders::proto::GetOrderRequest { order_id: id });
    let refused = grpc.get(get).await.expect_err("a read without a token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert_eq!(counts(&db).await, n(2));

    // Counted by reason; the answers never said which.
    let text = app.scrape().await;
    let refusals = |reason: &str| {
        pipeline::testing::series_value(
            &text,
            &format!("orders_auth_refusals_total{{reason=\"{reason}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(refusals("missing"), 4.0, "{text}");
    assert_eq!(refusals("unknown"), 2.0);
    assert_eq!(refusals("malformed"), 2.0);
    app.stop().await;
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn metrics_count_requests_and_idempotency_outcomes() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;
    app.create("m1", BODY).await;
    app.create("m1", BODY).await;
    app.create("m1", r#"{"account_id": 1, "amount_cents": 1}"#)
        .await;
    let public = app
        .client
        .get(format!("{}/metrics", app.http))
        .send()
        .await
        .expect("public /metrics");
    assert_eq!(
        public.status(),
        StatusCode::NOT_FOUND,
        "the metrics are off the public port"
    );
    let text = app.scrape().await;
    for line in [
        r#"idempotency_outcomes_total{outcome="new"} 1"#,
        r#"idempotency_outcomes_total{outcome="replay"} 1"#,
        r#"idempotency_outcomes_total{outcome="mismatch"} 1"#,
        r#"http_requests_total{method="POST",route="/orders",status="201"} 2"#,
        r#"http_requests_total{method="POST",route="/orders",status="409"} 1"#,
        r#"http_request_duration_seconds_count{method="POST",route="/orders"} 3"#,
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
    app.stop().await;
}

/// New keys, their concurrent retries and conflicting requests for the same
/// keys, all at once: they land in shared write batches. Per key, exactly one
/// request body wins; every request with it gets the identical 201, every
/// request with the other body gets 409.
#[tokio::test]
async fn coalesced_batches_keep_per_key_semantics() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;
    check_per_key_semantics(&app).await;
    assert_eq!(counts(&db).await, n(15));
    app.stop().await;
}

/// Both claim strategies, with and without coalescing (one request per
/// transaction), keep the per-key semantics: one order per key, every
/// request with the winning body gets its 201, the other body 409, and 50
/// concurrent sends of one key make one order.
#[tokio::test]
async fn every_claim_strategy_keeps_per_key_semantics_with_and_without_coalescing() {
    for strategy in [ClaimStrategy::OnConflict, ClaimStrategy::AdvisoryLock] {
        for batch_max in [128, 1] {
            let db = TestDb::create().await;
            let app = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, |c| {
                c.claim_strategy = strategy;
                c.write_batch_max = batch_max;
            })
            .await;
            check_per_key_semantics(&app).await;
            let replies =
                futures::future::join_all((0..50).map(|_| app.create("hot-key", BODY))).await;
            assert_eq!(
                replies[0].status,
                StatusCode::CREATED,
                "{strategy:?} {batch_max}"
            );
            assert!(
                replies.iter().all(|r| r == &replies[0]),
                "{strategy:?} {batch_max}"
            );
            assert_eq!(counts(&db).await, n(16), "{strategy:?} {batch_max}");
            app.stop().await;
        }
    }
}

/// The advisory-lock strategy really takes the key's lock: while another
/// session holds it, a create with that key waits; released, it completes.
/// (The on-conflict strategy does not wait for it.)
#[tokio::test]
async fn the_advisory_lock_strategy_waits_for_the_keys_lock() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let mut holder = pool.acquire().await.expect("holder");
    sqlx::query("SELECT pg_advisory_lock($1, hashtext('held-key'))")
        .bind(pipeline::idempotency::ADVISORY_LOCK_CLASS)
        .execute(&mut *holder)
        .await
        .expect("hold the key's lock");

    let plain = TestApp::spawn(&db, InjectFault::None).await;
    let reply = tokio::time::timeout(Duration::from_secs(5), plain.create("other-key", BODY))
        .await
        .expect("on-conflict does not wait for the advisory lock");
    assert_eq!(reply.status, StatusCode::CREATED);
    plain.stop().await;

    let locking = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, |c| {
        c.claim_strategy = ClaimStrategy::AdvisoryLock;
    })
    .await;
    // The request runs in a task of its own while the lock is held.
    let request = locking
        .client
        .post(format!("{}/orders", locking.http))
        .header("Idempotency-Key", "held-key")
        .header("Content-Type", "application/json")
        .body(BODY);
    let waiting =
        tokio::spawn(async move { Reply::from(request.send().await.expect("send")).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !waiting.is_finished(),
        "the create waits for the key's lock"
    );
    sqlx::query("SELECT pg_advisory_unlock($1, hashtext('held-key'))")
        .bind(pipeline::idempotency::ADVISORY_LOCK_CLASS)
        .execute(&mut *holder)
        .await
        .expect("release");
    let reply = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("completes once released")
        .expect("join");
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(counts(&db).await, n(2));
    locking.stop().await;
}

/// 15 keys, 4 concurrent sends each, two bodies per key.
async fn check_per_key_semantics(app: &TestApp) {
    let mut sends = Vec::new();
    for k in 0..15 {
        for r in 0..4 {
            // Bodies A (r even) and B (r odd) for the same key.
            let amount = if r % 2 == 0 { 100 + k } else { 900 + k };
            sends.push((format!("mix-{k}"), amount));
        }
    }
    let replies = futures::future::join_all(sends.iter().map(|(key, amount)| {
        let body = format!(r#"{{"account_id": 3, "amount_cents": {amount}}}"#);
        let app = &app;
        async move { (key.clone(), *amount, app.create(key, &body).await) }
    }))
    .await;
    for k in 0..15 {
        let key = format!("mix-{k}");
        let mine: Vec<&(String, i64, Reply)> =
            replies.iter().filter(|(k2, _, _)| *k2 == key).collect();
        let winners: Vec<&Reply> = mine
            .iter()
            .filter(|(_, _, r)| r.status == StatusCode::CREATED)
            .map(|(_, _, r)| r)
            .collect();
        let winning_amount = mine
            .iter()
            .find(|(_, _, r)| r.status == StatusCode::CREATED)
            .map(|(_, a, _)| *a)
            .expect("one body wins");
        for (_, amount, reply) in &mine {
            if *amount == winning_amount {
                assert_eq!(
                    reply, winners[0],
                    "{key}: every request with the winning body gets the same 201"
                );
            } else {
                assert_eq!(
                    reply.status,
                    StatusCode::CONFLICT,
                    "{key}: the other body is refused"
                );
                assert_eq!(reply.error_code(), "idempotency_key_reused");
            }
        }
    }
}

/// `--no-idempotency` is experiment 1's unsafe measurement baseline; it is
/// only a baseline if it really skips the check. With it, a retried key makes
/// a second order and event (and concurrent retries one each, in shared
/// batches); without it, one order. The key is still required either way.
#[tokio::test]
async fn no_idempotency_baseline_really_skips_the_check() {
    for no_idempotency in [false, true] {
        let db = TestDb::create().await;
        let app = TestApp::spawn_with(&db, InjectFault::None, 4, 4096, no_idempotency).await;
        let first = app.create("retried", BODY).await;
        let retry = app.create("retried", BODY).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(retry.status, StatusCode::CREATED);
        if no_idempotency {
            assert_ne!(
                first.json()["order_id"],
                retry.json()["order_id"],
                "the retry got a new order"
            );
            let two = Counts {
                keys: 0,
                orders: 2,
                outbox: 2,
            };
            assert_eq!(counts(&db).await, two, "two orders, no key stored");
            let replies = futures::future::join_all((0..10).map(|_| app.create("hot", BODY))).await;
            assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
            assert_eq!(counts(&db).await.orders, 12, "one order per request");
        } else {
            assert_eq!(retry, first, "the retry replays the first response");
            assert_eq!(counts(&db).await, n(1));
        }
        let missing = app.post(None, Some("application/json"), BODY).await;
        assert_eq!(missing.status, StatusCode::BAD_REQUEST);
        assert_eq!(missing.error_code(), "missing_idempotency_key");
        app.stop().await;
    }
}

/// A full write queue sheds load with 503 `overloaded` at once; a shed
/// request consumed nothing and its retry succeeds.
#[tokio::test]
async fn a_full_write_queue_answers_503_and_the_retry_succeeds() {
    let db = TestDb::create().await;
    let app = TestApp::spawn_with(&db, InjectFault::None, 1, 1, false).await;
    let keys: Vec<String> = (0..200).map(|i| format!("burst-{i}")).collect();
    let replies = futures::future::join_all(keys.iter().map(|k| app.create(k, BODY))).await;
    let mut shed = Vec::new();
    for (key, reply) in keys.iter().zip(&replies) {
        match reply.status {
            StatusCode::CREATED => {}
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(reply.error_code(), "overloaded");
                shed.push(key);
            }
            other => panic!("{key}: unexpected {other}"),
        }
    }
    assert_eq!(
        counts(&db).await,
        n((200 - shed.len()) as i64),
        "a shed request wrote nothing"
    );
    for key in &shed {
        assert_eq!(app.create(key, BODY).await.status, StatusCode::CREATED);
    }
    assert_eq!(counts(&db).await, n(200));
    app.stop().await;
}

/// Crash point `commit`: the orders binary SIGKILLs itself right after a
/// write transaction commits, before answering. The client sees a broken
/// connection; its retry (to a restarted service) gets the stored 201 of the
/// order that did commit, and no second order exists.
#[tokio::test]
async fn a_crash_between_commit_and_response_is_healed_by_the_retry() {
    let db = TestDb::create().await;
    let (port, grpc_port, metrics_port) = (free_port(), free_port(), free_port());
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_orders"))
        .env("DATABASE_URL", db.url_as(ServiceRole::Orders))
        .env("ORDERS_HTTP_ADDR", format!("127.0.0.1:{port}"))
        .env("ORDERS_GRPC_ADDR", format!("127.0.0.1:{grpc_port}"))
        .env("ORDERS_METRICS_ADDR", format!("127.0.0.1:{metrics_port}"))
        .env("CRASH_POINT", "commit")
        .env("CRASH_EVERY", "1")
        .env("RUST_LOG", "error")
        .kill_on_drop(true)
        .spawn()
        .expect("spawn orders");
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}");
    let up = pipeline::testing::eventually(Duration::from_secs(20), || async {
        client
            .get(format!("http://127.0.0.1:{metrics_port}/metrics"))
            .send()
            .await
            .is_ok()
    })
    .await;
    assert!(up, "orders came up");
    let first = client
        .post(format!("{url}/orders"))
        .header("Idempotency-Key", "crash-at-commit")
        .header("Content-Type", "application/json")
        .body(BODY)
        .send()
        .await;
    assert!(first.is_err(), "the client saw no response: {first:?}");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("orders died")
        .expect("wait");
    assert!(!status.success());
    assert_eq!(
        counts(&db).await,
        n(1),
        "the order committed before the crash"
    );

    let healthy = TestApp::spawn(&db, InjectFault::None).await;
    let retry = healthy.create("crash-at-commit", BODY).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let stored: uuid::Uuid = sqlx::query_scalar("SELECT order_id FROM orders.orders")
        .fetch_one(&pool)
        .await
        .expect("order");
    assert_eq!(retry.json()["order_id"], stored.to_string().as_str());
    assert_eq!(counts(&db).await, n(1));
    healthy.stop().await;
}

/// The write path driven in-process (no sockets: 5,000 concurrent clients fit
/// in one test), with one writer and a bound of `queue`.
struct Writers {
    api: orders::api::OrdersApi,
    metrics: std::sync::Arc<orders::metrics::OrdersMetrics>,
    pool: PgPool,
}

impl Writers {
    async fn start(db: &TestDb, queue: usize) -> Self {
        let pool = PgPool::connect(&db.url).await.expect("pool");
        let metrics = std::sync::Arc::new(orders::metrics::OrdersMetrics::new().expect("metrics"));
        let store = std::sync::Arc::new(orders::store::Store::new(
            pool.clone(),
            InjectFault::None,
            false,
            pipeline::crash::Crasher::default(),
        ));
        let (writes, _writers) = orders::writer::WriteQueue::start(
            store.clone(),
            orders::writer::WriterSettings {
                writers: 1,
                max_batch: 128,
                queue,
                linger: std::time::Duration::ZERO,
            },
            metrics.clone(),
        );
        Self {
            api: orders::api::OrdersApi::new(store, writes, metrics.clone()),
            metrics,
            pool,
        }
    }

    /// Holds the keys table so the next write transaction waits in its claim;
    /// returns once a write is waiting on it.
    async fn hold_keys(&self) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let mut tx = self.pool.begin().await.expect("begin");
        sqlx::query("LOCK TABLE fx.idempotency_keys IN EXCLUSIVE MODE")
            .execute(&mut *tx)
            .await
            .expect("lock");
        tx
    }

    async fn wait_for_blocked_writer(&self) {
        let blocked = || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&self.pool)
            .await
            .expect("pg_stat_activity");
            waiting > 0
        };
        assert!(
            eventually(Duration::from_secs(10), blocked).await,
            "no write waits on the lock"
        );
    }

    async fn wait_for_inflight(&self, value: i64) {
        let reached = || async { self.metrics.write_inflight.get() == value };
        assert!(
            eventually(Duration::from_secs(30), reached).await,
            "in flight: {} (expected {value})",
            self.metrics.write_inflight.get()
        );
    }
}

/// 5,000 concurrent requests reusing one key with another body: requests
/// deferred behind the key count against `--write-queue` (exactly `queue` are
/// accepted, the rest get 503 at once), and when the key's claim settles as a
/// mismatch every deferred request with that body is answered with it, in
/// the same batch — not one per batch.
#[tokio::test]
async fn a_flood_on_one_key_is_bounded_and_settled_at_once() {
    const QUEUE: usize = 256;
    const FLOOD: usize = 5_000;
    let db = TestDb::create().await;
    let writers = Writers::start(&db, QUEUE).await;
    let key = pipeline::idempotency::IdempotencyKey::parse(b"flooded").expect("key");
    let first = orders::order::CreateOrder {
        account_id: 1,
        amount_cents: 100,
    };
    writers
        .api
        .create(&Caller::anonymous(), &key, &first)
        .await
        .expect("first use");
    let batches_before = writers.metrics.write_batch_size.get_sample_count();

    let lock = writers.hold_keys().await;
    let other = orders::order::CreateOrder {
        account_id: 1,
        amount_cents: 200,
    };
    let (done, mut answers) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..FLOOD {
        let (api, key, done) = (writers.api.clone(), key.clone(), done.clone());
        tokio::spawn(async move {
            let _ = done.send(
                api.create(&Caller::anonymous(), &key, &other)
                    .await
                    .map(|_| ()),
            );
        });
    }
    drop(done);
    // Every request beyond the bound is shed at once, while the accepted
    // ones wait (their claim is blocked on the lock).
    let mut shed = 0;
    while shed < FLOOD - QUEUE {
        let answer = tokio::time::timeout(Duration::from_secs(30), answers.recv())
            .await
            .expect("the shed requests are answered at once")
            .expect("answer");
        match answer {
            Err(orders::error::ApiError::Overloaded) => shed += 1,
            other => panic!("before the claim settles: {other:?}"),
        }
    }
    writers.wait_for_blocked_writer().await;
    assert_eq!(writers.metrics.write_inflight.get(), QUEUE as i64);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), answers.recv())
            .await
            .is_err(),
        "nothing more is answered while the claim waits"
    );

    lock.rollback().await.expect("release");
    let mut refused = 0;
    while let Some(answer) = tokio::time::timeout(Duration::from_secs(30), answers.recv())
        .await
        .expect("every accepted request is answered")
    {
        match answer {
            Err(orders::error::ApiError::KeyReused) => refused += 1,
            other => panic!("after the claim: {other:?}"),
        }
    }
    assert_eq!(refused, QUEUE);
    writers.wait_for_inflight(0).await;
    let batches = writers.metrics.write_batch_size.get_sample_count() - batches_before;
    assert!(
        batches <= 3,
        "{batches} batches for {QUEUE} requests on one key"
    );
    assert_eq!(counts(&db).await, n(1), "nothing written by the flood");
}

/// A request whose client went away before a writer took it is dropped
/// unwritten and gives its place back.
#[tokio::test]
async fn a_request_whose_client_left_is_not_written() {
    let db = TestDb::create().await;
    let writers = Writers::start(&db, 256).await;
    let body = orders::order::CreateOrder {
        account_id: 7,
        amount_cents: 700,
    };
    let lock = writers.hold_keys().await;
    let stays = {
        let api = writers.api.clone();
        let key = pipeline::idempotency::IdempotencyKey::parse(b"stays").expect("key");
        tokio::spawn(async move { api.create(&Caller::anonymous(), &key, &body).await })
    };
    writers.wait_for_blocked_writer().await;
    let leaving: Vec<_> = (0..100)
        .map(|i| {
            let api = writers.api.clone();
            let key =
                pipeline::idempotency::IdempotencyKey::parse(format!("leaves-{i}").as_bytes())
                    .expect("key");
            tokio::spawn(async move { api.create(&Caller::anonymous(), &key, &body).await })
        })
        .collect();
    writers.wait_for_inflight(101).await;
    for task in &leaving {
        task.abort(); // the client disconnects: its handler future is dropped
    }
    for task in leaving {
        assert!(task.await.expect_err("aborted").is_cancelled());
    }
    lock.rollback().await.expect("release");
    stays
        .await
        .expect("task")
        .expect("the waiting client is answered");
    writers.wait_for_inflight(0).await;
    assert_eq!(writers.metrics.write_abandoned_total.get(), 100);
    assert_eq!(counts(&db).await, n(1), "only the client that stayed");
}

/// Which database errors the service answers with 503 (retry as is) rather
/// than 500: the real server's errors, not made-up ones.
#[tokio::test]
async fn a_database_going_away_is_unavailable_and_a_bad_statement_is_not() {
    use pipeline::db::is_unavailable;
    use sqlx::Connection;
    let db = TestDb::create().await;
    let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    let division = sqlx::query("SELECT 1 / 0")
        .execute(&mut conn)
        .await
        .expect_err("division by zero");
    assert!(!is_unavailable(&division), "{division}");
    let terminated = sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
        .execute(&mut conn)
        .await
        .expect_err("terminated");
    assert!(is_unavailable(&terminated), "{terminated}");
    let after = sqlx::query("SELECT 1")
        .execute(&mut conn)
        .await
        .expect_err("the connection is gone");
    assert!(is_unavailable(&after), "{after}");
    assert!(is_unavailable(&sqlx::Error::PoolTimedOut));
    assert!(!is_unavailable(&sqlx::Error::RowNotFound));
}

/// A key is kept for the key retention (`orders.key_policy`); once expired,
/// a retry with it is a new request: a second order. The service deletes
/// expired keys itself (every minute); here the test calls the same
/// function as the service's role.
#[tokio::test]
async fn a_retry_after_the_key_retention_is_a_new_request() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;
    let first = app.create("expiring-key", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let as_orders = PgPool::connect(&db.url_as(ServiceRole::Orders))
        .await
        .expect("connect as orders");
    let expired: i32 = sqlx::query_scalar("SELECT orders.keys_expire(100)")
        .fetch_one(&as_orders)
        .await
        .expect("expire");
    assert_eq!(expired, 0, "24 h by default: nothing is old enough");
    assert_eq!(app.create("expiring-key", BODY).await, first, "a replay");

    let owner = PgPool::connect(&db.url).await.expect("connect");
    sqlx::query("UPDATE orders.key_policy SET retention = interval '1 millisecond'")
        .execute(&owner)
        .await
        .expect("shorten");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let expired: i32 = sqlx::query_scalar("SELECT orders.keys_expire(100)")
        .fetch_one(&as_orders)
        .await
        .expect("expire");
    assert_eq!(expired, 1);
    let again = app.create("expiring-key", BODY).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_ne!(
        again.json()["order_id"],
        first.json()["order_id"],
        "a new request, a new order"
    );
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders.orders")
        .fetch_one(&owner)
        .await
        .expect("orders");
    assert_eq!(orders, 2);
    app.stop().await;
}

/// A key lives its full retention by the database's clock, whatever the
/// clock that minted its order id (issue: an orders host 11 minutes slow,
/// a 10-minute retention, and a retry 80 s later became a second order).
/// The key is written as such a host writes it: an order id whose UUIDv7
/// time is 11 minutes behind the database's, stamped now by the database.
#[tokio::test]
async fn a_key_minted_by_a_slow_clock_lives_its_full_retention() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    sqlx::query("UPDATE orders.key_policy SET retention = interval '10 minutes'")
        .execute(&owner)
        .await
        .expect("retention");
    let order_id = effectively::v7::minted_ago(Duration::from_secs(11 * 60));
    sqlx::query(
        "INSERT INTO fx.idempotency_keys \
             (scope, key, request_hash, reference, response_status, response_headers, response_body) \
         VALUES ('', 'slow-clock', '\\x00', $1, 201, '[]', '\\x7b7d')",
    )
    .bind(order_id.to_string())
    .execute(&owner)
    .await
    .expect("insert the key");
    let as_orders = PgPool::connect(&db.url_as(ServiceRole::Orders))
        .await
        .expect("connect as orders");
    let expire = || async {
        sqlx::query_scalar::<_, i32>("SELECT orders.keys_expire(100)")
            .fetch_one(&as_orders)
            .await
            .expect("expire")
    };
    assert_eq!(
        expire().await,
        0,
        "written a moment ago by the database's clock: kept"
    );
    // Ten minutes later by the database's clock, it goes.
    sqlx::query(
        "UPDATE fx.idempotency_keys SET created_at = now() - interval '10 minutes 1 second'",
    )
    .execute(&owner)
    .await
    .expect("age the key");
    assert_eq!(expire().await, 1, "past its retention: expired");
}

/// Orders measures its clock against the database's at start-up and refuses
/// to run past `--max-clock-skew-secs` (the measurement, with a shifted local
/// clock, is `pipeline::clock`'s; the service's refusal is checked here).
#[tokio::test]
async fn a_clock_past_the_bound_is_refused_and_a_small_skew_is_measured() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let gauge = prometheus::Gauge::new("skew", "skew").expect("gauge");
    let bounds = pipeline::clock::Bounds::default();
    let slow = || std::time::SystemTime::now() - Duration::from_secs(11 * 60);
    let patience = Duration::from_secs(5);
    let refused = pipeline::clock::check_at_start("orders", &pool, bounds, patience, &gauge, slow)
        .await
        .expect_err("11 minutes slow is refused");
    assert!(
        format!("{refused}").contains("clock differs from the database's by +66"),
        "{refused}"
    );
    assert!(
        (gauge.get() - 660.0).abs() < 5.0,
        "the gauge shows it: {}",
        gauge.get()
    );
    let skew = pipeline::clock::check_at_start(
        "orders",
        &pool,
        bounds,
        patience,
        &gauge,
        std::time::SystemTime::now,
    )
    .await
    .expect("the same host's clock is accepted");
    assert!(skew.seconds.abs() < 1.0, "{skew:?}");
}

/// A database that goes away between orders' connect and its clock check (a
/// primary crashed in that instant: experiment 10's long run saw it end an
/// instance) is waited for, as at connect: the check fails only once the
/// connect patience is spent, not at the first refusal.
#[tokio::test]
async fn the_clock_check_waits_out_an_unavailable_database() {
    // Nothing listens there: every connection is refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(200))
        .connect_lazy(&format!("postgres://nobody@127.0.0.1:{port}/none"))
        .expect("a lazy pool");
    let gauge = prometheus::Gauge::new("skew", "skew").expect("gauge");
    let patience = Duration::from_millis(1500);
    let started = std::time::Instant::now();
    let error = pipeline::clock::check_at_start(
        "orders",
        &pool,
        pipeline::clock::Bounds::default(),
        patience,
        &gauge,
        std::time::SystemTime::now,
    )
    .await
    .expect_err("no database, no measurement");
    assert!(
        started.elapsed() >= patience,
        "it gave up after {:?}, before its patience: {error:#}",
        started.elapsed()
    );
    assert!(
        format!("{error:#}").contains("measure the database's clock"),
        "{error:#}"
    );
}

/// A request line and headers trickled a byte a second.
const SLOW_HEAD: &[u8] = b"POST /orders HTTP/1.1\r\nHost: orders\r\n\
    Content-Type: application/json\r\nIdempotency-Key: slow-head\r\n\r\n";

/// A complete head whose body is then trickled a byte a second.
const SLOW_BODY_HEAD: &[u8] = b"POST /orders HTTP/1.1\r\nHost: orders\r\n\
    Content-Type: application/json\r\nIdempotency-Key: slow-body\r\n\
    Content-Length: 40\r\n\r\n";

/// Thousands of HTTP clients sending their request's head a byte a second
/// (and some their body) are closed after the header read timeout (the
/// body's after the request timeout, with a 408), an idle keep-alive
/// connection after the header read timeout too; valid requests are
/// answered while they are connected.
#[tokio::test]
async fn slow_http_clients_are_closed_after_the_timeouts_and_valid_requests_go_on() {
    const SLOW_HEADS: usize = 1500;
    const SLOW_BODIES: usize = 100;
    const VALID: usize = 40;
    let timeout = Duration::from_secs(3);
    let patience = timeout + Duration::from_secs(4);
    let db = TestDb::create().await;
    let app = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, |config| {
        config.header_read_timeout_ms = 3000;
        config.request_timeout_ms = 3000;
    })
    .await;
    // Serving (the slow clients' timeouts start at accept).
    assert_eq!(app.create("first", BODY).await.status, StatusCode::CREATED);

    let started = Instant::now();
    let mut heads = slow_clients(app.http_addr, SLOW_HEADS, b"", SLOW_HEAD, patience).await;
    let bodies = slow_clients(
        app.http_addr,
        SLOW_BODIES,
        SLOW_BODY_HEAD,
        BODY.as_bytes(),
        patience,
    )
    .await;
    let idle = slow_clients(
        app.http_addr,
        1,
        b"GET /orders/none HTTP/1.1\r\nHost: orders\r\n\r\n",
        b"",
        patience,
    )
    .await;
    let connected = started.elapsed();

    // Valid requests while the slow clients hold their connections: one at
    // a time and all at once.
    let valid_started = Instant::now();
    for i in 0..VALID / 2 {
        let reply = app.create(&format!("valid-{i}"), BODY).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    let shared = &app;
    let replies = futures::future::join_all(
        (VALID / 2..VALID).map(|i| async move { shared.create(&format!("valid-{i}"), BODY).await }),
    )
    .await;
    for reply in replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    let valid_took = valid_started.elapsed();
    // All of them on an idle machine; a busy one may take longer than the
    // timeout to connect them all and send the valid requests.
    let still_open = heads.iter().filter(|c| !c.is_finished()).count();
    assert!(
        still_open >= 1000,
        "the valid requests were answered while {still_open} of {SLOW_HEADS} slow clients \
         were connected (connecting took {connected:?}, the valid requests {valid_took:?})"
    );

    heads.extend(idle);
    let ends = all_closed("slow heads", heads, timeout, patience).await;
    let idle = ends.last().expect("the idle client");
    assert!(
        idle.received.starts_with(b"HTTP/1.1 404"),
        "the idle client's request was answered: {:?}",
        String::from_utf8_lossy(&idle.received)
    );
    for end in all_closed("slow bodies", bodies, timeout, patience).await {
        let answer = String::from_utf8_lossy(&end.received);
        assert!(
            answer.starts_with("HTTP/1.1 408") && answer.contains("\"request_timeout\""),
            "a slow body is answered 408 request_timeout: {answer:?}"
        );
    }
    assert_eq!(
        counts(&db).await,
        n(1 + VALID as i64),
        "no slow request written"
    );
    app.stop().await;
}

/// At the connection cap, a new client waits (in the kernel's accept
/// backlog) until a slot frees up, and is then served; it is not refused.
#[tokio::test]
async fn a_client_past_the_connection_cap_waits_for_a_slot() {
    const CAP: usize = 8;
    let timeout = Duration::from_secs(3);
    let patience = timeout + Duration::from_secs(4);
    let db = TestDb::create().await;
    let app = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, |config| {
        config.header_read_timeout_ms = 3000;
        config.max_connections = CAP;
    })
    .await;
    assert_eq!(app.create("first", BODY).await.status, StatusCode::CREATED);
    // The first request's keep-alive connection holds a slot until the
    // header read timeout; the slow clients hold the others.
    let slow = slow_clients(app.http_addr, CAP - 1, b"", SLOW_HEAD, patience).await;
    let waited = Instant::now();
    let reply = reqwest::Client::new()
        .post(format!("{}/orders", app.http))
        .header("Idempotency-Key", "past-the-cap")
        .header("Content-Type", "application/json")
        .body(BODY)
        .send()
        .await
        .expect("the client past the cap is served, not refused");
    let waited = waited.elapsed();
    assert_eq!(reply.status(), StatusCode::CREATED);
    assert!(
        waited >= timeout.mul_f64(0.8),
        "the client past the cap waited for a slot (served after {waited:?})"
    );
    all_closed("slow heads", slow, timeout, patience).await;
    app.stop().await;
}

/// The HTTP/2 preface trickled a byte a second.
const SLOW_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Hundreds of gRPC clients sending the HTTP/2 preface a byte a second are
/// closed after the header read timeout; valid calls are answered while
/// they are connected.
#[tokio::test]
async fn slow_grpc_clients_are_closed_after_the_timeout_and_valid_calls_go_on() {
    const SLOW: usize = 500;
    let timeout = Duration::from_secs(3);
    let patience = timeout + Duration::from_secs(4);
    let db = TestDb::create().await;
    let app = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, |config| {
        config.header_read_timeout_ms = 3000;
    })
    .await;
    let mut grpc = app.grpc().await;
    let create = |key: &str| {
        let mut request = tonic::Request::new(CreateOrderRequest {
            account_id: 42,
            amount_cents: 1999,
        });
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().expect("metadata"));
        request
    };
    grpc.create(create("first")).await.expect("serving");

    let slow = slow_clients(app.grpc, SLOW, b"", SLOW_PREFACE, patience).await;
    for i in 0..20 {
        grpc.create(create(&format!("valid-{i}")))
            .await
            .expect("a valid call while the slow clients are connected");
    }
    let still_open = slow.iter().filter(|c| !c.is_finished()).count();
    assert!(
        still_open >= SLOW / 2,
        "the valid calls were answered while {still_open} of {SLOW} slow clients were connected"
    );
    all_closed("slow gRPC prefaces", slow, timeout, patience).await;
    // The valid client's connection was not touched.
    grpc.create(create("after"))
        .await
        .expect("after the slow ones");
    assert_eq!(counts(&db).await, n(22));
    app.stop().await;
}
