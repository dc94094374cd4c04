//! Payments over HTTP (`--source http`) against the real PostgreSQL of
//! `make up`: signed webhooks claimed by the receiver, applied by its inbox
//! processor. A fresh database per test; no broker is involved (the Kafka
//! settings point at a closed port, and payments must not need them).

use std::process::Stdio;
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
use pipeline::testing::{Service, TestDb, eventually, free_port};
use reqwest::StatusCode;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
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

/// A dead letter: transport, kind, msg_id, payload, topic.
type DeadRow = (
    String,
    String,
    Option<Uuid>,
    Option<Vec<u8>>,
    Option<String>,
);

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

#[tokio::test]
async fn a_signed_event_is_claimed_answered_at_once_and_charged_once() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn(&db).await;
    let events: Vec<(Uuid, Vec<u8>)> = (0..20)
        .map(|i| {
            let msg_id = Uuid::now_v7();
            (msg_id, event(msg_id, Uuid::now_v7(), 100 + i))
        })
        .collect();
    for (msg_id, body) in &events {
        let (status, json) = receiver.post(*msg_id, body).await;
        assert_eq!(status, StatusCode::OK, "{json}");
        assert_eq!(json["status"], "accepted");
        assert_eq!(json["msg_id"], msg_id.to_string());
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 20
        })
        .await,
        "the inbox processor applied every claim"
    );
    assert_eq!(count(&pool, UNPROCESSED).await, 0);

    // The sender's retries: signed anew, the same ids and bodies.
    for (msg_id, body) in &events {
        let (status, json) = receiver.post(*msg_id, body).await;
        assert_eq!(status, StatusCode::OK, "{json}");
        assert_eq!(json["status"], "duplicate");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&pool, CHARGES).await, 20);
    assert_eq!(count(&pool, LEDGER).await, 20, "one effect per event");
    assert_eq!(count(&pool, INBOX).await, 20);
    assert_eq!(count(&pool, CLAIMS).await, 20);
    let sum: i64 = sqlx::query_scalar("SELECT sum(amount_cents)::int8 FROM payments.charges")
        .fetch_one(&pool)
        .await
        .expect("sum");
    assert_eq!(sum, (0..20).map(|i| 100 + i).sum::<i64>());
    assert_eq!(
        receiver
            .metric(r#"payments_webhook_requests_total{outcome="accepted"}"#)
            .await,
        20.0
    );
    assert_eq!(
        receiver
            .metric(r#"payments_webhook_requests_total{outcome="duplicate"}"#)
            .await,
        20.0
    );
    assert_eq!(receiver.metric("payments_charges_total").await, 20.0);
    // Over HTTP the horizon is the outbox's 7 days, the sender's retry span
    // (30h28m) and the skew (5 min): 8 days 6h33m, no broker asked.
    assert_eq!(
        receiver.metric("payments_redelivery_horizon_seconds").await,
        (8 * 86_400 + 6 * 3600 + 33 * 60) as f64
    );
    receiver.stop().await;
}

#[tokio::test]
async fn a_request_that_fails_verification_or_is_not_an_event_is_refused_and_leaves_nothing() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn(&db).await;
    let msg_id = Uuid::now_v7();
    let body = event(msg_id, Uuid::now_v7(), 500);
    let id = msg_id.to_string();
    let now = chrono::Utc::now().timestamp();

    let refused = |(status, json): Answer, want: StatusCode, code: &str, case: &str| {
        assert_eq!(status, want, "{case}: {json}");
        assert_eq!(json["error"]["code"], code, "{case}: {json}");
        assert!(
            json["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{case}: a reason"
        );
    };
    // Another secret's signature.
    let stranger = Secret::generate();
    refused(
        receiver.post_as(&stranger, &id, now, &body).await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "wrong secret",
    );
    // A body other than the one signed.
    let signature =
        webhook::signature_header(std::slice::from_ref(&receiver.secret), &id, now, &body);
    let tampered = event(msg_id, Uuid::now_v7(), 999_999);
    refused(
        receiver
            .post_raw(&id, &now.to_string(), &signature, tampered)
            .await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "tampered body",
    );
    // A captured request replayed after the tolerance; its signature is good.
    refused(
        receiver
            .post_as(&receiver.secret, &id, now - 301, &body)
            .await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "replayed old request",
    );
    refused(
        receiver.post_raw(&id, "", "", body.clone()).await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "no signature",
    );
    // Authenticated, but not an event: the Kafka path's decoder rules.
    let junk = br#"{"hello":"world"}"#;
    refused(
        receiver.post_as(&receiver.secret, &id, now, junk).await,
        StatusCode::BAD_REQUEST,
        "bad_request",
        "not an event",
    );
    // Authenticated, an event, but under another id.
    let other = Uuid::now_v7().to_string();
    refused(
        receiver.post_as(&receiver.secret, &other, now, &body).await,
        StatusCode::BAD_REQUEST,
        "bad_request",
        "webhook-id is not the msg_id",
    );
    // Over the body limit.
    let big = vec![b' '; payments::receiver::MAX_BODY_BYTES + 1];
    let (status, _) = receiver.post_as(&receiver.secret, &id, now, &big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);

    assert_eq!(count(&pool, CLAIMS).await, 0, "nothing claimed");
    assert_eq!(count(&pool, CHARGES).await, 0, "nothing charged");
    assert_eq!(
        receiver
            .metric(r#"payments_webhook_requests_total{outcome="unauthorized"}"#)
            .await,
        4.0
    );
    // The same event, signed right: taken.
    let (status, json) = receiver.post(msg_id, &body).await;
    assert_eq!(
        (status, &json["status"]),
        (StatusCode::OK, &"accepted".into())
    );
    receiver.stop().await;
}

#[tokio::test]
async fn the_same_id_with_another_event_is_refused_and_dead_lettered_once_and_the_first_stands() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn(&db).await;
    let (msg_id, order_id) = (Uuid::now_v7(), Uuid::now_v7());
    let first = event(msg_id, order_id, 100);
    let (status, _) = receiver.post(msg_id, &first).await;
    assert_eq!(status, StatusCode::OK);
    let second = event(msg_id, order_id, 200);
    for _ in 0..2 {
        let (status, json) = receiver.post(msg_id, &second).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{json}");
        assert_eq!(json["error"]["code"], "conflict");
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 1
        })
        .await
    );
    let amount: i64 = sqlx::query_scalar("SELECT amount_cents FROM payments.charges")
        .fetch_one(&pool)
        .await
        .expect("amount");
    assert_eq!(amount, 100, "the first event stands");
    let dead: Vec<DeadRow> =
        sqlx::query_as("SELECT transport, kind, msg_id, payload, topic FROM payments.dead_letters")
            .fetch_all(&pool)
            .await
            .expect("dead letters");
    assert_eq!(dead.len(), 1, "recorded once: {dead:?}");
    assert_eq!(
        (dead[0].0.as_str(), dead[0].1.as_str(), dead[0].2),
        ("http", "msg_id_conflict", Some(msg_id))
    );
    assert_eq!(
        dead[0].3.as_deref(),
        Some(&second[..]),
        "the refused body kept"
    );
    assert_eq!(dead[0].4, None);
    receiver.stop().await;
}

/// A receipt deleted after `--webhook-receipts-kept` no longer answers a
/// retry "duplicate", but the inbox (the dedup record that lasts the
/// horizon) still makes it a no-op.
#[tokio::test]
async fn a_retry_after_its_receipt_was_pruned_is_still_a_no_op() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn(&db).await;
    let msg_id = Uuid::now_v7();
    let body = event(msg_id, Uuid::now_v7(), 100);
    receiver.post(msg_id, &body).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, UNPROCESSED).await == 0 && count(&pool, CHARGES).await == 1
        })
        .await
    );
    let pruned = payments::receiver::prune(&pool, Duration::ZERO)
        .await
        .expect("prune");
    assert_eq!(pruned, 1);
    assert_eq!(count(&pool, CLAIMS).await, 0);
    let (status, json) = receiver.post(msg_id, &body).await;
    assert_eq!(
        (status, &json["status"]),
        (StatusCode::OK, &"accepted".into())
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, UNPROCESSED).await == 0
        })
        .await
    );
    assert_eq!(count(&pool, CHARGES).await, 1);
    assert_eq!(count(&pool, LEDGER).await, 1, "not applied twice");
    assert_eq!(receiver.metric("payments_dedup_hits_total").await, 1.0);
    receiver.stop().await;
}

/// The payments binary SIGKILLs itself after the claim commits and before
/// it answers (crash point `respond`): the sender sees no answer and
/// retries; the restarted receiver answers "duplicate" and the event is
/// charged once. A claim left unprocessed by the dead process is applied by
/// the next one's processor.
#[tokio::test]
async fn a_receiver_killed_before_it_answers_is_retried_into_a_duplicate() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let secret = Secret::generate();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}{WEBHOOK_PATH}");
    let spawn = |crash: bool| {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_payments"));
        child
            .env("DATABASE_URL", db.url_as(ServiceRole::Payments))
            .env("PAYMENTS_SOURCE", "http")
            .env("PAYMENTS_WEBHOOK_ADDR", format!("127.0.0.1:{port}"))
            .env("PAYMENTS_WEBHOOK_SECRET", secret.to_whsec())
            .env("PAYMENTS_METRICS_ADDR", "127.0.0.1:0")
            .env("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9")
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        if crash {
            child.env("CRASH_POINT", "respond").env("CRASH_EVERY", "1");
        }
        child.spawn().expect("spawn payments")
    };
    let client = reqwest::Client::new();
    let msg_id = Uuid::now_v7();
    let body = event(msg_id, Uuid::now_v7(), 100);
    let send = || async {
        let now = chrono::Utc::now().timestamp();
        let id = msg_id.to_string();
        client
            .post(&url)
            .header(webhook::HEADER_ID, &id)
            .header(webhook::HEADER_TIMESTAMP, now.to_string())
            .header(
                webhook::HEADER_SIGNATURE,
                webhook::signature_header(std::slice::from_ref(&secret), &id, now, &body),
            )
            .body(body.clone())
            .send()
            .await
    };
    let ready = || async {
        client
            .get(&url)
            .send()
            .await
            .is_ok_and(|r| r.status() == StatusCode::METHOD_NOT_ALLOWED)
    };

    let mut dying = spawn(true);
    assert!(
        eventually(Duration::from_secs(30), ready).await,
        "listening"
    );
    let answer = send().await;
    assert!(
        answer.is_err(),
        "no answer from a killed receiver: {answer:?}"
    );
    let status = dying.wait().await.expect("wait");
    assert!(!status.success(), "killed by its crash point");
    assert_eq!(count(&pool, CLAIMS).await, 1, "the claim committed");

    let mut next = spawn(false);
    assert!(
        eventually(Duration::from_secs(30), ready).await,
        "listening"
    );
    let retry = send().await.expect("answered");
    assert_eq!(retry.status(), StatusCode::OK);
    let json: serde_json::Value = retry.json().await.expect("json");
    assert_eq!(json["status"], "duplicate");
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 1 && count(&pool, UNPROCESSED).await == 0
        })
        .await,
        "the dead process's claim is applied by the next one"
    );
    assert_eq!(count(&pool, LEDGER).await, 1);
    next.kill().await.expect("kill");
}

#[tokio::test]
async fn http_without_a_secret_is_refused_with_a_clear_error() {
    let db = TestDb::create().await;
    let mut config = config(&db, &Secret::generate());
    config.webhook.webhook_secret.clear();
    let metrics = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let webhooks = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let error = run_on(config, metrics, Some(webhooks), CancellationToken::new())
        .await
        .expect_err("refused");
    assert!(error.to_string().contains("--webhook-secret"), "{error}");
}

/// Two payments processes on one database (two receivers, two inbox
/// processors scanning the same claims): each claim is applied once.
#[tokio::test]
async fn two_processors_on_one_database_apply_each_claim_once() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // One secret, as two replicas behind one URL would have.
    let a = Receiver::spawn(&db).await;
    let b = Receiver::spawn_with(&db, a.secret.clone()).await;
    let n = 300;
    let events: Vec<(Uuid, Vec<u8>)> = (0..n)
        .map(|i| {
            let msg_id = Uuid::now_v7();
            (msg_id, event(msg_id, Uuid::now_v7(), 100 + i))
        })
        .collect();
    let mut sends = Vec::new();
    for (i, (msg_id, body)) in events.iter().enumerate() {
        // Every event to one replica, every third also to the other.
        let (first, other) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        sends.push(first.post(*msg_id, body));
        if i % 3 == 0 {
            sends.push(other.post(*msg_id, body));
        }
    }
    for (status, json) in futures::future::join_all(sends).await {
        assert_eq!(status, StatusCode::OK, "{json}");
    }
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, UNPROCESSED).await == 0
        })
        .await
    );
    assert_eq!(count(&pool, CHARGES).await, n);
    assert_eq!(count(&pool, LEDGER).await, n, "each claim applied once");
    a.stop().await;
    b.stop().await;
}

/// While every unprocessed claim is held by another processor (its
/// transaction has the row locked, so `FOR UPDATE SKIP LOCKED` skips it),
/// the processor backs off between scans instead of scanning again at once:
/// over a second, a bounded handful of scans (each reads the held claim:
/// `payments_consumed_total`), not hundreds. Once the lock is gone, the
/// claim is applied within the backoff's bound (the poll interval, here
/// 100 ms).
#[tokio::test]
async fn a_processor_that_finds_every_claim_held_backs_off_instead_of_spinning() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let msg_id = Uuid::now_v7();
    let body = event(msg_id, Uuid::now_v7(), 100);
    payments::receiver::claim(&pool, msg_id, &body, 0)
        .await
        .expect("claim");
    // The other processor, mid-batch.
    let mut other = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM payments.webhook_inbox WHERE msg_id = $1 FOR UPDATE")
        .bind(msg_id)
        .execute(&mut *other)
        .await
        .expect("lock the claim");
    let receiver = Receiver::spawn(&db).await;
    const SCANNED: &str = "payments_consumed_total";
    assert!(
        eventually(Duration::from_secs(10), || async {
            receiver.metric(SCANNED).await >= 1.0
        })
        .await,
        "the processor read the held claim"
    );
    let before = receiver.metric(SCANNED).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let scans = receiver.metric(SCANNED).await - before;
    assert_eq!(count(&pool, CHARGES).await, 0, "held: not applied");
    // Doubling from 5 ms to the 100 ms poll: about 14 in a second.
    assert!(
        scans <= 20.0,
        "{scans} scans in 1 s while the only claim was held"
    );
    other.rollback().await.expect("release");
    let released = std::time::Instant::now();
    assert!(
        eventually(Duration::from_secs(5), || async {
            count(&pool, CHARGES).await == 1
        })
        .await
    );
    assert!(
        released.elapsed() < Duration::from_secs(1),
        "applied {:?} after the release",
        released.elapsed()
    );
    assert_eq!(count(&pool, UNPROCESSED).await, 0);
    receiver.stop().await;
}

/// Over HTTP a webhook whose msg_id lies beyond the inbox's partitions (an
/// orders clock 30 days fast) is still answered 200 (its claim is stored),
/// and its claim waits unprocessed: not applied, not dead-lettered, while
/// the claims after it are applied. Once the partitions reach it, it is.
/// A claim with the nil msg_id is processed too (the scan once began after
/// it).
#[tokio::test]
async fn a_claim_the_inbox_cannot_record_yet_waits_unprocessed_not_dead_lettered() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn(&db).await;
    let future = effectively::v7::minted_ahead(Duration::from_secs(30 * 86_400));
    let (status, json) = receiver
        .post(future, &event(future, Uuid::now_v7(), 500))
        .await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["status"], "accepted");
    for i in 0..3 {
        let msg_id = Uuid::now_v7();
        let (status, json) = receiver
            .post(msg_id, &event(msg_id, Uuid::now_v7(), 100 + i))
            .await;
        assert_eq!(status, StatusCode::OK, "{json}");
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 3
        })
        .await,
        "the claims after the held one are applied"
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            receiver.metric("payments_future_msg_ids_total").await >= 2.0
        })
        .await,
        "the held claim is tried again"
    );
    assert_eq!(count(&pool, UNPROCESSED).await, 1, "the held claim waits");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM payments.dead_letters").await,
        0
    );
    sqlx::query("SELECT fx.partitioned_inbox_extend(now() + interval '31 days', interval '1 day')")
        .execute(&pool)
        .await
        .expect("extend");
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 4
        })
        .await,
        "the held claim is applied once the inbox can record it"
    );
    assert_eq!(count(&pool, UNPROCESSED).await, 0);
    assert_eq!(count(&pool, LEDGER).await, 4);

    // The nil msg_id is processed too: the scan once started after it, so
    // it was never read.
    payments::receiver::claim(
        &pool,
        Uuid::nil(),
        &event(Uuid::nil(), Uuid::now_v7(), 7),
        0,
    )
    .await
    .expect("claim");
    assert!(
        eventually(Duration::from_secs(10), || async {
            count(&pool, UNPROCESSED).await == 0
        })
        .await,
        "the nil msg_id's claim is processed"
    );
    receiver.stop().await;
}

/// A webhook request's head trickled a byte a second.
const SLOW_HEAD: &[u8] = b"POST /webhooks/orders HTTP/1.1\r\nHost: payments\r\n\
    Content-Type: application/json\r\nwebhook-id: slow\r\n\r\n";

/// A complete head whose body is then trickled a byte a second.
const SLOW_BODY_HEAD: &[u8] = b"POST /webhooks/orders HTTP/1.1\r\nHost: payments\r\n\
    Content-Type: application/json\r\nContent-Length: 100\r\n\r\n";

/// What the slow bodies trickle.
const SLOW_BODY: &[u8] = b"{\"msg_id\": \"slow\"}";

/// Hundreds of clients sending a webhook's head a byte a second, and some
/// its body, are closed after the header read timeout (a body's after the
/// request timeout, answered 408 `request_timeout`); signed webhooks are
/// accepted and applied while they are connected. Requests past the
/// handling slots are answered 503 `overloaded` with `Retry-After: 1`.
#[tokio::test]
async fn slow_webhook_clients_are_closed_after_the_timeouts_and_valid_webhooks_go_on() {
    use pipeline::testing::slow::{all_closed, slow_clients};
    const SLOW_HEADS: usize = 800;
    const SLOW_BODIES: usize = 100;
    const VALID: usize = 30;
    let timeout = Duration::from_secs(3);
    let patience = timeout + Duration::from_secs(4);
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn_tuned(&db, |args| {
        args.webhook_header_read_timeout = timeout;
        args.webhook_request_timeout = timeout;
    })
    .await;
    let first = Uuid::now_v7();
    let (status, json) = receiver.post(first, &event(first, Uuid::now_v7(), 1)).await;
    assert_eq!(status, StatusCode::OK, "{json}");
    let addr: std::net::SocketAddr = receiver
        .url
        .trim_start_matches("http://")
        .trim_end_matches(WEBHOOK_PATH)
        .parse()
        .expect("addr");

    let started = std::time::Instant::now();
    let heads = slow_clients(addr, SLOW_HEADS, b"", SLOW_HEAD, patience).await;
    let bodies = slow_clients(addr, SLOW_BODIES, SLOW_BODY_HEAD, SLOW_BODY, patience).await;
    let connected = started.elapsed();
    let shared = &receiver;
    let answers = futures::future::join_all((0..VALID).map(|i| async move {
        let msg_id = Uuid::now_v7();
        shared
            .post(msg_id, &event(msg_id, Uuid::now_v7(), 100 + i as i64))
            .await
    }))
    .await;
    for (status, json) in answers {
        assert_eq!(status, StatusCode::OK, "{json}");
        assert_eq!(json["status"], "accepted");
    }
    let still_open = heads.iter().filter(|c| !c.is_finished()).count();
    assert!(
        still_open >= SLOW_HEADS / 2,
        "the valid webhooks were accepted while {still_open} of {SLOW_HEADS} slow clients \
         were connected (connecting took {connected:?})"
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 1 + VALID as i64
        })
        .await,
        "and applied"
    );
    all_closed("slow heads", heads, timeout, patience).await;
    for end in all_closed("slow bodies", bodies, timeout, patience).await {
        let answer = String::from_utf8_lossy(&end.received);
        assert!(
            answer.starts_with("HTTP/1.1 408") && answer.contains("\"request_timeout\""),
            "a slow body is answered 408 request_timeout: {answer:?}"
        );
    }
    assert_eq!(
        receiver
            .metric(r#"payments_webhook_requests_total{outcome="request_timeout"}"#)
            .await,
        SLOW_BODIES as f64
    );
    assert_eq!(
        count(&pool, CLAIMS).await,
        1 + VALID as i64,
        "no slow request claimed"
    );
    receiver.stop().await;
}

/// Past its handling slots the receiver answers 503 `overloaded` with
/// `Retry-After: 1` at once, and takes requests again when a slot frees.
#[tokio::test]
async fn past_its_handling_slots_the_receiver_answers_503_with_retry_after() {
    let db = TestDb::create().await;
    let receiver = Receiver::spawn_tuned(&db, |args| args.webhook_concurrency = 1).await;
    // The one slot is held while the claim waits for a lock another
    // transaction holds on the same webhook-id.
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let msg_id = Uuid::now_v7();
    let body = event(msg_id, Uuid::now_v7(), 5);
    let mut other = pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO payments.webhook_inbox (msg_id, payload, payload_hash) VALUES ($1, $2, 0)",
    )
    .bind(msg_id)
    .bind(&body)
    .execute(&mut *other)
    .await
    .expect("claim in another transaction");
    let shared = &receiver;
    let held = tokio::spawn({
        let (url, secret, client) = (
            receiver.url.clone(),
            receiver.secret.clone(),
            receiver.client.clone(),
        );
        let body = body.clone();
        async move {
            let now = chrono::Utc::now().timestamp();
            let id = msg_id.to_string();
            let signature =
                webhook::signature_header(std::slice::from_ref(&secret), &id, now, &body);
            client
                .post(&url)
                .header(webhook::HEADER_ID, id)
                .header(webhook::HEADER_TIMESTAMP, now.to_string())
                .header(webhook::HEADER_SIGNATURE, signature)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .expect("send")
                .status()
        }
    });
    assert!(
        eventually(Duration::from_secs(10), || async {
            let pid: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()",
            )
            .fetch_one(&pool)
            .await
            .expect("activity");
            pid > 0
        })
        .await,
        "the first request waits on the lock, holding the slot"
    );
    let other_id = Uuid::now_v7();
    let now = chrono::Utc::now().timestamp();
    let other_body = event(other_id, Uuid::now_v7(), 6);
    let signature = webhook::signature_header(
        std::slice::from_ref(&shared.secret),
        &other_id.to_string(),
        now,
        &other_body,
    );
    let response = shared
        .client
        .post(&shared.url)
        .header(webhook::HEADER_ID, other_id.to_string())
        .header(webhook::HEADER_TIMESTAMP, now.to_string())
        .header(webhook::HEADER_SIGNATURE, signature)
        .header("content-type", "application/json")
        .body(other_body.clone())
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let json: serde_json::Value = response.json().await.expect("json");
    assert_eq!(json["error"]["code"], "overloaded");
    other.rollback().await.expect("release");
    assert_eq!(held.await.expect("join"), StatusCode::OK);
    // The slot is free again: the refused one is taken on its retry.
    let (status, json) = receiver.post(other_id, &other_body).await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["status"], "accepted");
    receiver.stop().await;
}
