//! `relay --sink http` against the real PostgreSQL of `make up` and a
//! receiver in this process whose answers each test scripts. No broker.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
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
use pipeline::testing::{Service, TestDb, eventually};
use relay::webhooks::{Admin, Destination, Keyring, ReceiverHorizon, SecretsArgs, Specs};
use relay::{Config, Mode, Sink, run};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
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

#[tokio::test]
async fn every_row_is_delivered_signed_to_every_destination_in_per_key_order() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (a, a_url) = Receiver::start(|_| Reply::OK).await;
    let (b, b_url) = Receiver::start(|_| Reply::OK).await;
    let keys: Vec<Uuid> = (0..6).map(|_| Uuid::now_v7()).collect();
    for seq in 0..10 {
        for key in &keys {
            enqueue(&pool, *key, seq).await;
        }
    }
    let relay = spawn_relay(config(
        &db,
        vec![
            a.destination("a", &a_url, ",concurrency=8"),
            b.destination("b", &b_url, ",concurrency=3"),
        ],
        1.0,
    ))
    .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            a.hits().len() >= 60 && b.hits().len() >= 60 && count(&pool, OPEN).await == 0
        })
        .await,
        "delivered: a {}, b {}",
        a.hits().len(),
        b.hits().len()
    );
    for (name, r) in [("a", &a), ("b", &b)] {
        let hits = r.hits();
        assert_eq!(hits.len(), 60, "{name}: each event once (none failed)");
        assert!(
            hits.iter().all(|h| h.authentic),
            "{name}: every request signed"
        );
        for (key, seqs) in delivered_order(&hits) {
            assert_eq!(
                seqs,
                (0..10).collect::<Vec<_>>(),
                "{name}: key {key} in order"
            );
        }
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.outbox WHERE published_at IS NULL"
        )
        .await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE delivered_at IS NOT NULL AND attempts = 1 AND last_status = 200").await,
        120
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.webhook_attempts WHERE outcome = 'delivered'"
        )
        .await,
        120
    );
    assert_eq!(relay.metric("relay_webhook_fanned_out_total").await, 120.0);
    assert_eq!(
        relay
            .metric(r#"relay_webhook_attempts_total{destination="b",outcome="delivered"}"#)
            .await,
        60.0
    );
    relay.stop().await;

    // Delivered deliveries expire with their attempts after the outbox
    // retention (here a millisecond), as the relay's role; an open one stays.
    enqueue(&pool, keys[0], 10).await;
    sqlx::query(
        "INSERT INTO orders.webhook_deliveries (destination, outbox_id, aggregate_id, msg_id, body) \
         SELECT 'a', id, aggregate_id, msg_id, payload FROM orders.outbox WHERE published_at IS NULL",
    )
    .execute(&pool)
    .await
    .expect("an open delivery");
    sqlx::query("UPDATE orders.outbox_policy SET retention = interval '1 millisecond'")
        .execute(&pool)
        .await
        .expect("retention");
    let as_relay = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as relay");
    let mut expired = 0;
    loop {
        let n = relay::webhooks::expire(&as_relay, 50)
            .await
            .expect("expire");
        expired += n;
        if n < 50 {
            break;
        }
    }
    assert_eq!(expired, 120);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders.webhook_attempts").await,
        0
    );
    assert_eq!(count(&pool, OPEN).await, 1, "the open delivery stays");
}

/// A key's first event fails its first attempt: its later events wait
/// until it is delivered, another key's do not, and the retry comes after
/// the scheduled wait (5 s scaled by 0.1, with jitter: 400 to 600 ms). The
/// scale leaves the other key's four deliveries 3 s and more before the
/// held one's third try, so a busy machine does not make them look held
/// (at 0.01 they had 290 ms, and a CI run under load missed it).
#[tokio::test]
async fn a_failing_first_attempt_holds_back_its_key_only_and_is_retried_on_schedule() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (held, other) = (Uuid::now_v7(), Uuid::now_v7());
    let first = enqueue(&pool, held, 0).await;
    for seq in 1..4 {
        enqueue(&pool, held, seq).await;
    }
    for seq in 0..4 {
        enqueue(&pool, other, seq).await;
    }
    let (r, url) = Receiver::start(move |h| {
        if h.msg_id == first && h.nth < 3 {
            Reply::status(503)
        } else {
            Reply::OK
        }
    })
    .await;
    let relay = spawn_relay(config(&db, vec![r.destination("r", &url, "")], 0.1)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, OPEN).await == 0 && r.hits().len() == 10
        })
        .await,
        "{:?}",
        r.hits()
    );
    let hits = r.hits();
    let order = delivered_order(&hits);
    assert_eq!(order[&held], vec![0, 1, 2, 3]);
    assert_eq!(order[&other], vec![0, 1, 2, 3]);
    let tries: Vec<&Hit> = hits.iter().filter(|h| h.msg_id == first).collect();
    assert_eq!(tries.len(), 3, "two 503s, then 200");
    let delivered_at = tries[2].at;
    assert!(
        hits.iter()
            .filter(|h| h.key == held && h.msg_id != first)
            .all(|h| h.at > delivered_at),
        "the key's later events came after its first was delivered"
    );
    assert!(
        hits.iter()
            .filter(|h| h.key == other)
            .all(|h| h.at < delivered_at),
        "the other key did not wait"
    );
    // 5 s and 30 s, scaled by 0.1, with jitter x[0.8, 1.2].
    let (w1, w2) = (tries[1].at - tries[0].at, tries[2].at - tries[1].at);
    assert!(w1 >= Duration::from_millis(400), "first wait {w1:?}");
    assert!(w2 >= Duration::from_millis(2400), "second wait {w2:?}");
    let attempts: Vec<(i32, Option<i32>, String)> = sqlx::query_as(
        "SELECT a.attempt, a.status, a.outcome FROM orders.webhook_attempts a \
         JOIN orders.webhook_deliveries d USING (destination, outbox_id) \
         WHERE d.msg_id = $1 ORDER BY a.attempt",
    )
    .bind(first)
    .fetch_all(&pool)
    .await
    .expect("attempts");
    assert_eq!(
        attempts,
        vec![
            (1, Some(503), "retry".to_owned()),
            (2, Some(503), "retry".to_owned()),
            (3, Some(200), "delivered".to_owned()),
        ]
    );
    relay.stop().await;
}

/// A receiver whose clock runs 10 minutes ahead of the sender's refuses
/// the first two attempts with 401 (their `webhook-timestamp` is outside its
/// 5-minute tolerance as it sees them), and takes the third (say its
/// operator widened the tolerance): a 401 is retried on the schedule like a
/// 5xx, never given up at once, and the delivery ends delivered. The sender
/// counted each answer by status and measured the skew from the answers'
/// `Date`.
#[tokio::test]
async fn a_401_from_a_receiver_with_a_skewed_clock_is_retried_until_delivered() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let msg_id = enqueue(&pool, Uuid::now_v7(), 0).await;
    let ahead: i64 = 600;
    let (r, url) = Receiver::start(move |h| Reply {
        clock_off: Some(ahead),
        ..Reply::status(if h.nth <= 2 { 401 } else { 200 })
    })
    .await;
    let relay = spawn_relay(config(&db, vec![r.destination("r", &url, "")], 0.01)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE delivered_at IS NOT NULL OR failed_at IS NOT NULL").await == 1
        })
        .await,
        "{:?}",
        r.hits()
    );
    let (attempts, delivered, failed): (i32, bool, bool) = sqlx::query_as(
        "SELECT attempts, delivered_at IS NOT NULL, failed_at IS NOT NULL \
         FROM orders.webhook_deliveries WHERE msg_id = $1",
    )
    .bind(msg_id)
    .fetch_one(&pool)
    .await
    .expect("the delivery");
    assert_eq!(
        (attempts, delivered, failed),
        (3, true, false),
        "(attempts, delivered, failed): two 401s retried, then delivered"
    );
    let answers: Vec<(i32, Option<i32>, String)> = sqlx::query_as(
        "SELECT attempt, status, outcome FROM orders.webhook_attempts ORDER BY attempt",
    )
    .fetch_all(&pool)
    .await
    .expect("attempts");
    assert_eq!(
        answers,
        vec![
            (1, Some(401), "retry".to_owned()),
            (2, Some(401), "retry".to_owned()),
            (3, Some(200), "delivered".to_owned()),
        ]
    );
    assert_eq!(
        relay
            .metric(r#"relay_webhook_failed_total{destination="r"}"#)
            .await,
        0.0
    );
    assert_eq!(
        relay
            .metric(r#"relay_webhook_responses_total{destination="r",status="401"}"#)
            .await,
        2.0
    );
    assert_eq!(
        relay
            .metric(r#"relay_webhook_responses_total{destination="r",status="200"}"#)
            .await,
        1.0
    );
    // Receiver minus sender, to the Date's whole second (and the answer's
    // time in flight).
    let skew = relay
        .metric(r#"relay_webhook_clock_skew_seconds{destination="r"}"#)
        .await;
    assert!(
        ((ahead - 2) as f64..=(ahead + 1) as f64).contains(&skew),
        "skew {skew}"
    );
    relay.stop().await;
}

/// A 4xx (here 422) or a 5xx on every attempt fails a delivery after its
/// last attempt, not before; then the key's next event goes on. A 410
/// disables its destination and leaves the delivery pending.
#[tokio::test]
async fn refusals_and_errors_fail_after_the_last_attempt_and_gone_disables_the_destination() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (k1, k2) = (Uuid::now_v7(), Uuid::now_v7());
    let refused = enqueue(&pool, k1, 0).await;
    enqueue(&pool, k1, 1).await;
    let broken = enqueue(&pool, k2, 0).await;
    enqueue(&pool, k2, 1).await;
    let healed = Arc::new(AtomicBool::new(false));
    let h1 = healed.clone();
    let (r, url) = Receiver::start(move |h| {
        if h1.load(Ordering::SeqCst) {
            Reply::OK
        } else if h.msg_id == refused {
            Reply::status(422)
        } else if h.msg_id == broken {
            Reply::status(500)
        } else {
            Reply::OK
        }
    })
    .await;
    let h2 = healed.clone();
    let (gone, gone_url) = Receiver::start(move |_| {
        if h2.load(Ordering::SeqCst) {
            Reply::OK
        } else {
            Reply::status(410)
        }
    })
    .await;
    let relay = spawn_relay(config(
        &db,
        vec![
            r.destination("r", &url, ",max-attempts=3"),
            gone.destination("gone", &gone_url, ",concurrency=1"),
        ],
        0.01,
    ))
    .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'r' AND (delivered_at IS NOT NULL OR failed_at IS NOT NULL)").await == 4
        })
        .await
    );
    let hits = r.hits();
    assert_eq!(
        hits.iter().filter(|h| h.msg_id == refused).count(),
        3,
        "422: max-attempts, like a 5xx"
    );
    assert_eq!(
        hits.iter().filter(|h| h.msg_id == broken).count(),
        3,
        "500: max-attempts"
    );
    let order = delivered_order(&hits);
    assert_eq!((order[&k1].clone(), order[&k2].clone()), (vec![1], vec![1]));
    let failed: Vec<(Uuid, i32, Option<i32>, Option<String>)> = sqlx::query_as(
        "SELECT msg_id, attempts, last_status, last_error FROM orders.webhook_deliveries \
         WHERE destination = 'r' AND failed_at IS NOT NULL ORDER BY outbox_id",
    )
    .fetch_all(&pool)
    .await
    .expect("failed");
    assert_eq!(failed.len(), 2);
    assert_eq!(
        (failed[0].0, failed[0].1, failed[0].2),
        (refused, 3, Some(422))
    );
    assert_eq!(
        (failed[1].0, failed[1].1, failed[1].2),
        (broken, 3, Some(500))
    );
    assert!(failed[1].3.as_deref().is_some_and(|e| e.contains("500")));
    assert_eq!(
        relay
            .metric(r#"relay_webhook_failed_total{destination="r"}"#)
            .await,
        2.0
    );

    // The 410: one attempt, then the destination is disabled.
    assert!(
        eventually(Duration::from_secs(10), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_destinations WHERE destination = 'gone' AND disabled_at IS NOT NULL").await == 1
        })
        .await
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        gone.hits().len(),
        1,
        "nothing more is sent to a disabled destination"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'gone' AND delivered_at IS NULL AND failed_at IS NULL").await,
        4,
        "its deliveries wait"
    );

    // The receivers are fixed: the operator replays the failed deliveries
    // and enables the destination; everything is delivered.
    healed.store(true, Ordering::SeqCst);
    let as_relay = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as relay");
    let replay = Admin::Replay {
        failed: true,
        destination: Some("r".into()),
        since: None,
        horizon: ReceiverHorizon::default(),
    };
    assert_eq!(
        replay.run(&as_relay, &specs()).await.expect("replay"),
        "2 failed deliveries queued again\n"
    );
    let enable = Admin::Enable {
        destination: "gone".into(),
        horizon: ReceiverHorizon::default(),
    };
    assert_eq!(
        enable.run(&as_relay, &specs()).await.expect("enable"),
        "destination gone enabled\n"
    );
    assert!(
        Admin::Enable {
            destination: "nowhere".into(),
            horizon: ReceiverHorizon::default(),
        }
        .run(&as_relay, &specs())
        .await
        .is_err()
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(
                &pool,
                "SELECT count(*) FROM orders.webhook_deliveries WHERE delivered_at IS NOT NULL",
            )
            .await
                == 8
        })
        .await
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.webhook_deliveries WHERE replays = 1"
        )
        .await,
        2
    );
    let status = Admin::Status
        .run(&as_relay, &specs())
        .await
        .expect("status");
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("gone ") && l.contains(" 4 ") && l.ends_with("enabled")),
        "{status}"
    );
    relay.stop().await;
}

#[tokio::test]
async fn retry_after_is_honoured_and_a_slow_destination_delays_no_other() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    for key in &keys {
        enqueue(&pool, *key, 0).await;
    }
    // Slower than its timeout, every time.
    let (slow, slow_url) = Receiver::start(|_| Reply {
        delay: Duration::from_secs(5),
        ..Reply::OK
    })
    .await;
    // 429 with Retry-After: 1 on each first attempt.
    let (busy, busy_url) = Receiver::start(|h| {
        if h.nth == 1 {
            Reply {
                retry_after: Some(1),
                ..Reply::status(429)
            }
        } else {
            Reply::OK
        }
    })
    .await;
    let (fast, fast_url) = Receiver::start(|_| Reply::OK).await;
    let started = Instant::now();
    let relay = spawn_relay(config(
        &db,
        vec![
            slow.destination("slow", &slow_url, ",timeout=1s,concurrency=2"),
            busy.destination("busy", &busy_url, ""),
            fast.destination("fast", &fast_url, ""),
        ],
        0.001,
    ))
    .await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'fast' AND delivered_at IS NOT NULL").await == 20
        })
        .await
    );
    let fast_done = started.elapsed();
    assert!(
        fast_done < Duration::from_secs(5),
        "the fast destination finished in {fast_done:?} beside a slow one"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'slow' AND delivered_at IS NOT NULL").await,
        0,
        "the slow one answers after its timeout: never delivered"
    );
    assert!(
        eventually(Duration::from_secs(20), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'busy' AND delivered_at IS NOT NULL").await == 20
        })
        .await
    );
    let hits = busy.hits();
    for key in &keys {
        let tries: Vec<&Hit> = hits.iter().filter(|h| h.key == *key).collect();
        assert_eq!(tries.len(), 2);
        let waited = tries[1].at - tries[0].at;
        // The schedule's 5 ms (scaled) would retry at once: Retry-After rules.
        assert!(waited >= Duration::from_millis(950), "waited {waited:?}");
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'slow' AND last_error LIKE 'timed out%' AND last_status IS NULL").await > 0
        })
        .await,
        "an attempt past its timeout is recorded as timed out"
    );
    relay.stop().await;
}

/// The relay binary SIGKILLs itself after a 2xx and before marking the
/// delivery (crash point `deliver`): the next life delivers it again, so the
/// receiver sees it twice (its inbox makes that a no-op), and nothing is
/// lost.
#[tokio::test]
async fn a_sender_killed_after_the_2xx_delivers_again() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let key = Uuid::now_v7();
    for seq in 0..3 {
        enqueue(&pool, key, seq).await;
    }
    let (r, url) = Receiver::start(|_| Reply::OK).await;
    let spawn = |crash: bool| {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_relay"));
        child
            .env("DATABASE_URL", db.url_as(ServiceRole::Relay))
            .env("RELAY_SINK", "http")
            .env(
                "RELAY_WEBHOOK_DESTINATIONS",
                format!(
                    "r={url},secret={},timeout=1s,allow-http",
                    r.secret.to_whsec()
                ),
            )
            .env("RELAY_WEBHOOK_ALLOW_ADDRESSES", "127.0.0.1")
            .env("RELAY_METRICS_ADDR", "127.0.0.1:0")
            .env("RELAY_POLL_INTERVAL_MS", "100")
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        if crash {
            child.env("CRASH_POINT", "deliver").env("CRASH_EVERY", "1");
        }
        child.spawn().expect("spawn relay")
    };
    let mut dying = spawn(true);
    let status = tokio::time::timeout(Duration::from_secs(30), dying.wait())
        .await
        .expect("dies at its crash point")
        .expect("wait");
    assert!(!status.success());
    assert_eq!(r.hits().len(), 1, "the first event reached the receiver");
    // The lease (timeout 1 s + 5 s) runs out, then the next life sends it again.
    let mut next = spawn(false);
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, OPEN).await == 0
        })
        .await
    );
    next.kill().await.expect("kill");
    let hits = r.hits();
    assert_eq!(hits.len(), 4, "the first event twice, then the others");
    assert_eq!(hits[0].msg_id, hits[1].msg_id);
    assert_eq!(delivered_order(&hits)[&key], vec![0, 1, 2]);
}

/// A key's backlog moves to the deliveries in one pass (every row of a key
/// the shard's read holds), but a row that is not JSON fails at once
/// (`--sink http` gives it one attempt: no retry makes it JSON) and holds
/// back its key's later rows, pending and never delivered; the rows before
/// it and every other key's are delivered in order.
#[tokio::test]
async fn a_row_that_is_not_json_fails_and_holds_back_only_its_key() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (bad, good) = (Uuid::now_v7(), Uuid::now_v7());
    for seq in 0..3 {
        enqueue(&pool, bad, seq).await;
    }
    let mut conn = pool.acquire().await.expect("acquire");
    Outbox
        .enqueue_batch(
            &mut conn,
            &[OutboxMessage {
                aggregate_id: bad,
                msg_id: Uuid::now_v7(),
                event_type: "test.event".into(),
                payload: b"\xff{ not json".to_vec(),
            }],
        )
        .await
        .expect("enqueue");
    drop(conn);
    for seq in 4..6 {
        enqueue(&pool, bad, seq).await;
    }
    for seq in 0..20 {
        enqueue(&pool, good, seq).await;
    }
    let (r, url) = Receiver::start(|_| Reply::OK).await;
    let relay = spawn_relay(config(&db, vec![r.destination("r", &url, "")], 1.0)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            r.hits().len() >= 23 && count(&pool, OPEN).await == 0
        })
        .await,
        "delivered {}",
        r.hits().len()
    );
    let order = delivered_order(&r.hits());
    assert_eq!(order[&bad], vec![0, 1, 2], "up to the row that is not JSON");
    assert_eq!(order[&good], (0..20).collect::<Vec<_>>());
    let rows: Vec<(i32, Option<String>, bool)> = sqlx::query_as(
        "SELECT attempts, last_error, failed_at IS NOT NULL FROM orders.outbox \
         WHERE published_at IS NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("rows");
    assert_eq!(rows.len(), 3, "the bad row and the two behind it");
    assert_eq!(
        (rows[0].0, rows[0].2),
        (1, true),
        "failed on its one attempt"
    );
    assert!(
        rows[0].1.as_deref().unwrap_or("").contains("not JSON"),
        "{:?}",
        rows[0].1
    );
    assert!(
        rows[1..].iter().all(|row| (row.0, row.2) == (0, false)),
        "held back, never tried: {rows:?}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders.webhook_deliveries").await,
        23
    );
    assert_eq!(relay.metric("relay_rows_failed_total").await, 1.0);
    assert_eq!(relay.metric("relay_published_total").await, 23.0);
    relay.stop().await;
}

/// With no allowlist, webhooks reach public addresses only: a destination
/// whose URL is a loopback address never starts, and one whose URL is a
/// name that resolves to loopback (`localhost`, the way a name rebound to
/// an inside address would) is refused by the resolver at every
/// connection: the receiver on 127.0.0.1 gets nothing. Allowed by the
/// operator, both deliver, each event once per destination.
#[tokio::test]
async fn webhooks_never_reach_an_address_the_operator_did_not_allow() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // Three keys: a key's later delivery waits for its earlier one.
    for _ in 0..3 {
        enqueue(&pool, Uuid::now_v7(), 0).await;
    }
    let (r, url) = Receiver::start(|_| Reply::OK).await;
    let by_name = url.replace("127.0.0.1", "localhost");
    let destinations = vec![
        r.destination("literal", &url, ""),
        r.destination("name", &by_name, ""),
    ];
    let mut guarded = config(&db, destinations.clone(), 0.01);
    guarded.webhook_allow_addresses = Vec::new();
    let relay = spawn_relay(guarded).await;
    let refused = "SELECT count(*) FROM orders.webhook_deliveries \
                   WHERE destination = 'name' AND attempts >= 2 AND last_error LIKE '%loopback%'";
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, refused).await == 3
                && relay
                    .metric(r#"relay_errors_total{stage="destinations"}"#)
                    .await
                    >= 1.0
        })
        .await,
        "the name refused at connection ({} deliveries), the literal not started",
        count(&pool, refused).await
    );
    assert!(r.hits().is_empty(), "nothing reached the receiver");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'literal' AND attempts = 0"
        )
        .await,
        3,
        "the literal's deliveries wait, never tried"
    );
    relay.stop().await;

    let relay = spawn_relay(config(&db, destinations, 0.01)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, OPEN).await == 0
        })
        .await,
        "allowed, both deliver (open: {})",
        count(&pool, OPEN).await
    );
    relay.stop().await;
    let hits = r.hits();
    assert_eq!(hits.len(), 6, "each event once per destination");
    assert!(hits.iter().all(|h| h.authentic));
}

#[tokio::test]
async fn the_http_sink_without_a_destination_or_with_wal_is_refused() {
    let db = TestDb::create().await;
    let mut c = config(&db, Vec::new(), 1.0);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let error = run(c.clone(), listener, CancellationToken::new())
        .await
        .expect_err("refused");
    assert!(
        error.to_string().contains("--webhook-destination"),
        "{error}"
    );
    let (r, url) = Receiver::start(|_| Reply::OK).await;
    c.webhook_destination = vec![r.destination("r", &url, "")];
    c.mode = Mode::Wal;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let error = run(c, listener, CancellationToken::new())
        .await
        .expect_err("refused");
    assert!(error.to_string().contains("--mode poll"), "{error}");
}

/// A delivery whose event was minted before the receiver's dedup horizon,
/// or so close to it that its retries (about 28 h of them) could arrive
/// after it, would be refused there as `after_horizon` and dead-lettered: `replay
/// --failed` and `enable` refuse to send it (nothing is changed), or leave it
/// out with `--skip-past-horizon` (a waiting one is marked failed, with why).
#[tokio::test]
async fn replays_and_enables_refuse_events_past_the_receivers_horizon() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    let as_relay = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as relay");
    let old = effectively::v7::minted_ago(Duration::from_secs(20 * 86_400));
    sqlx::query("INSERT INTO orders.webhook_destinations (destination, disabled_at, reason) VALUES ('r', NULL, NULL), ('gone', now(), 'HTTP 410')")
        .execute(&owner)
        .await
        .expect("destinations");
    // Inside the horizon, but its retries (up to about 28 h) could reach the
    // receiver past it.
    let late = effectively::v7::minted_ago(Duration::from_secs(15 * 86_400 + 12 * 3600));
    // r: one old, one late and one young failed delivery; gone: one old and
    // one young waiting.
    for (destination, outbox_id, msg_id, failed) in [
        ("r", 1_i64, old, true),
        ("r", 5, late, true),
        ("r", 2, Uuid::now_v7(), true),
        ("gone", 3, old, false),
        ("gone", 4, Uuid::now_v7(), false),
    ] {
        sqlx::query(
            "INSERT INTO orders.webhook_deliveries \
               (destination, outbox_id, aggregate_id, msg_id, body, failed_at) \
             VALUES ($1, $2, $3, $3, '\\x7b7d', CASE WHEN $4 THEN now() END)",
        )
        .bind(destination)
        .bind(outbox_id)
        .bind(msg_id)
        .bind(failed)
        .execute(&owner)
        .await
        .expect("delivery");
    }
    let failed = || {
        count(
            &owner,
            "SELECT count(*) FROM orders.webhook_deliveries WHERE failed_at IS NOT NULL",
        )
    };

    let replay = |skip: bool| Admin::Replay {
        failed: true,
        destination: None,
        since: None,
        horizon: ReceiverHorizon {
            skip_past_horizon: skip,
            ..ReceiverHorizon::default()
        },
    };
    let refused = replay(false)
        .run(&as_relay, &specs())
        .await
        .expect_err("refused");
    let cutoff = humantime::format_duration(ReceiverHorizon::default().cutoff()).to_string();
    assert!(
        format!("{refused:#}").contains(&format!(
            "2 of the failed deliveries selected carry events minted more than {cutoff} ago: \
             the receiver's dedup horizon (--receiver-horizon 16days"
        )),
        "{refused:#}"
    );
    assert_eq!(failed().await, 3, "nothing was replayed");
    assert_eq!(
        replay(true).run(&as_relay, &specs()).await.expect("replay"),
        "1 failed deliveries queued again\n2 left failed: their events are past the receiver's horizon\n"
    );
    assert_eq!(failed().await, 2, "the old and the late one stay failed");

    let enable = |skip: bool| Admin::Enable {
        destination: "gone".into(),
        horizon: ReceiverHorizon {
            skip_past_horizon: skip,
            ..ReceiverHorizon::default()
        },
    };
    assert!(
        enable(false).run(&as_relay, &specs()).await.is_err(),
        "refused"
    );
    assert_eq!(
        count(
            &owner,
            "SELECT count(*) FROM orders.webhook_destinations WHERE disabled_at IS NOT NULL"
        )
        .await,
        1,
        "still disabled"
    );
    assert_eq!(
        enable(true).run(&as_relay, &specs()).await.expect("enable"),
        "destination gone enabled\n1 waiting deliveries marked failed: their events are past the receiver's horizon\n"
    );
    assert_eq!(failed().await, 3);
    assert_eq!(
        count(&owner, "SELECT count(*) FROM orders.webhook_deliveries WHERE last_error LIKE 'past the receiver%'").await,
        1
    );
}

/// The destinations live in `orders.webhook_destinations`, one source of
/// truth for every relay. A relay started without a destination fans out
/// and delivers to one added by `relay webhooks add` while it runs (the
/// events committed after the add); a second relay started with other
/// flags adds its own and keeps the first's. A destination removed by
/// `relay webhooks remove` gets no later event, and its pending deliveries
/// are marked failed at once with the reason (not left open forever);
/// `add` and `replay --failed` send them after all.
#[tokio::test]
async fn destinations_added_and_removed_in_the_database_are_followed_by_running_relays() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let relay_pool = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as the relay");
    let (a, a_url) = Receiver::start(|_| Reply::OK).await;
    let (b, b_url) = Receiver::start(|_| Reply::OK).await;
    // c refuses everything: its deliveries stay pending (next try in 5 s).
    let (c, c_url) = Receiver::start(|_| Reply::status(500)).await;
    let first = spawn_relay(config(&db, vec![a.destination("a", &a_url, "")], 1.0)).await;
    let key = Uuid::now_v7();
    enqueue(&pool, key, 0).await;
    assert!(
        eventually(Duration::from_secs(20), || async { a.hits().len() == 1 }).await,
        "a gets the first event"
    );

    // b is added by the command; c by a second relay's flag.
    let added = Admin::Add {
        destination: b.destination("b", &b_url, ""),
    }
    .run(&relay_pool, &specs())
    .await
    .expect("add b");
    assert!(added.contains("destination b delivers to"), "{added}");
    let second = spawn_relay(config(&db, vec![c.destination("c", &c_url, "")], 1.0)).await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            count(
                &pool,
                "SELECT count(*) FROM orders.webhook_destinations WHERE spec IS NOT NULL AND removed_at IS NULL",
            )
            .await
                == 3
        })
        .await
    );
    for seq in 1..=3 {
        enqueue(&pool, key, seq).await;
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            a.hits().len() == 4 && b.hits().len() == 3 && !c.hits().is_empty()
        })
        .await,
        "a {} (4), b {} (3: from its add on), c {} (tried)",
        a.hits().len(),
        b.hits().len(),
        c.hits().len()
    );
    let b_seqs: Vec<i64> = b.hits().iter().map(|h| h.seq).collect();
    assert_eq!(
        b_seqs,
        [1, 2, 3],
        "b gets the events committed after its add"
    );
    let pending_c = count(
        &pool,
        "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'c' \
         AND delivered_at IS NULL AND failed_at IS NULL",
    )
    .await;
    assert_eq!(pending_c, 3, "c's deliveries wait for their next try");

    // c is removed: its pending deliveries fail at once, with the reason,
    // and no later event is fanned out to it.
    let removed = Admin::Remove {
        destination: "c".into(),
    }
    .run(&relay_pool, &specs())
    .await
    .expect("remove c");
    assert!(
        removed.contains("3 pending deliveries marked failed"),
        "{removed}"
    );
    let failed: Vec<String> = sqlx::query_scalar(
        "SELECT last_error FROM orders.webhook_deliveries WHERE destination = 'c' AND failed_at IS NOT NULL",
    )
    .fetch_all(&pool)
    .await
    .expect("failed");
    assert_eq!(failed.len(), 3);
    assert!(
        failed
            .iter()
            .all(|e| e.contains("the destination was removed")),
        "{failed:?}"
    );
    let c_tries = c.hits().len();
    enqueue(&pool, key, 4).await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            a.hits().len() == 5 && b.hits().len() == 4
        })
        .await
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'c'"
        )
        .await,
        3,
        "no delivery for c after its removal"
    );
    tokio::time::sleep(Duration::from_secs(6)).await; // past c's next try
    assert_eq!(c.hits().len(), c_tries, "c's loop stopped");
    let error = Admin::Remove {
        destination: "c".into(),
    }
    .run(&relay_pool, &specs())
    .await
    .expect_err("already removed");
    assert!(
        error.to_string().contains("no destination \"c\""),
        "{error}"
    );
    let status = Admin::Status
        .run(&relay_pool, &specs())
        .await
        .expect("status");
    assert!(
        status
            .lines()
            .any(|l| l.starts_with('c') && l.contains("removed since")),
        "{status}"
    );
    assert_eq!(count(&pool, OPEN).await, 0);
    first.stop().await;
    second.stop().await;
}

/// A relay's `--webhook-destination` flags add a destination the database
/// does not have, and nothing more: after an operator rotated a's secret
/// (`relay webhooks add`) and removed b, a relay started again with its old
/// flags keeps the rotated secret, leaves b removed (no later event is
/// fanned out to it) and says so. (Before, every start re-applied the
/// flags: the removed destination came back and the rotation was reverted.)
#[tokio::test]
async fn a_relay_s_flags_never_overwrite_or_bring_back_a_destination() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let relay_pool = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as the relay");
    let (a, a_url) = Receiver::start(|_| Reply::OK).await;
    let (b, b_url) = Receiver::start(|_| Reply::OK).await;
    let flags = vec![
        a.destination("a", &a_url, ""),
        b.destination("b", &b_url, ""),
    ];
    let spec = |name: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT spec FROM orders.webhook_destinations WHERE destination = $1",
            )
            .bind(name)
            .fetch_optional(&pool)
            .await
            .expect("spec")
            .flatten()
        }
    };
    let relay = spawn_relay(config(&db, flags.clone(), 1.0)).await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            spec("a").await.is_some()
        })
        .await,
        "the relay's flag adds a"
    );
    let first = spec("a").await.expect("a's spec");
    assert!(!first.contains(&a.secret.to_whsec()), "sealed at rest");
    let first = specs().open("a", &first).expect("opens");
    assert!(first.contains(&a.secret.to_whsec()), "the flag added a");
    relay.stop().await;

    // The operator rotates a's secret and removes b.
    let new_secret = Secret::generate().to_whsec();
    let rotated_spec = format!(
        "a={a_url},secret={new_secret},secret={},allow-http",
        a.secret.to_whsec()
    );
    Admin::Add {
        destination: rotated_spec.parse().expect("destination"),
    }
    .run(&relay_pool, &specs())
    .await
    .expect("rotate a");
    Admin::Remove {
        destination: "b".into(),
    }
    .run(&relay_pool, &specs())
    .await
    .expect("remove b");

    let added = relay::webhooks::add_missing(&relay_pool, &specs(), &flags)
        .await
        .expect("flags");
    assert_eq!(
        added,
        relay::webhooks::Added {
            added: vec![],
            differing: vec!["a".into()],
            removed: vec!["b".into()],
        }
    );
    let relay = spawn_relay(config(&db, flags.clone(), 1.0)).await;
    enqueue(&pool, Uuid::now_v7(), 0).await;
    assert!(
        eventually(Duration::from_secs(20), || async { a.hits().len() == 1 }).await,
        "a gets the event: the relay is past its start-up"
    );
    let kept = specs()
        .open("a", &spec("a").await.expect("a's spec"))
        .expect("opens");
    assert!(kept.contains(&new_secret), "the rotation stays");
    assert_ne!(kept, first);
    let removed: i64 = count(
        &pool,
        "SELECT count(*) FROM orders.webhook_destinations WHERE destination = 'b' AND removed_at IS NOT NULL",
    )
    .await;
    assert_eq!(removed, 1, "b stays removed");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'b'"
        )
        .await,
        0,
        "nothing fanned out to b"
    );
    assert!(b.hits().is_empty());
    relay.stop().await;
}

/// `relay webhooks add|rekey` as the relay's role, with the sealing keys of
/// `keys` (none: neither the file nor the environment's).
fn relay_webhooks(
    db: &TestDb,
    keys: Option<&std::path::Path>,
    args: &[&str],
) -> std::process::Output {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_relay"));
    command
        .arg("webhooks")
        .args(args)
        .env("DATABASE_URL", db.url_as(ServiceRole::Relay))
        .env_remove("RELAY_WEBHOOK_SECRETS_KEY_FILE")
        .env_remove(relay::webhooks::KEY_ENV)
        .env_remove("RELAY_UNSAFE_PLAINTEXT_WEBHOOK_SECRETS");
    if let Some(file) = keys {
        command.env("RELAY_WEBHOOK_SECRETS_KEY_FILE", file);
    }
    command.output().expect("run relay webhooks")
}

/// A key file of `lines` (0600) in `dir`.
fn key_file(dir: &std::path::Path, name: &str, lines: &[&str]) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, lines.join("\n")).expect("write");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    path
}

/// What `keys` reads of the destinations: their secrets, by name.
async fn readable(pool: &PgPool, keys: &std::path::Path) -> Vec<(String, usize)> {
    let specs = Specs::from_args(&SecretsArgs {
        webhook_secrets_key_file: Some(keys.to_owned()),
        unsafe_plaintext_webhook_secrets: false,
    })
    .expect("keys");
    relay::webhooks::active(pool, &specs)
        .await
        .expect("active")
        .into_iter()
        .map(|d| (d.name, d.secrets.len()))
        .collect()
}

#[tokio::test]
async fn destination_secrets_are_sealed_at_rest_rotated_by_rekey_and_need_a_key() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    let relay_pool = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as the relay");
    let dir = tempfile::tempdir().expect("tempdir");
    let (old, new) = (Keyring::generate_line("old"), Keyring::generate_line("new"));
    let old_only = key_file(dir.path(), "old.key", &[&old]);
    let rotating = key_file(dir.path(), "rotating.key", &[&new, &old]);
    let new_only = key_file(dir.path(), "new.key", &[&new]);
    let secret = Secret::generate().to_whsec();
    // The secret from a file: it is in no process's arguments.
    let secret_file = key_file(dir.path(), "p.secret", &[&secret]);
    let spec = format!(
        "p=https://hooks.example.com/orders,secret-file={}",
        secret_file.display()
    );
    let stored = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT spec FROM orders.webhook_destinations WHERE destination = 'p'",
        )
        .fetch_optional(&owner)
        .await
        .expect("spec")
    };

    let refused = relay_webhooks(&db, None, &["add", &spec]);
    assert!(!refused.status.success(), "added without a key");
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("--webhook-secrets-key-file"), "{why}");
    assert_eq!(stored().await, None, "nothing stored");

    let added = relay_webhooks(&db, Some(&old_only), &["add", &spec]);
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    let sealed = stored().await.expect("stored");
    assert!(sealed.starts_with("sealed:v1:old:"), "{sealed}");
    assert!(
        !sealed.contains(&secret[6..]) && !sealed.contains("example.com"),
        "neither the secret nor the URL in the database"
    );
    assert_eq!(
        readable(&relay_pool, &old_only).await,
        vec![("p".into(), 1)]
    );
    assert!(
        readable(&relay_pool, &new_only).await.is_empty(),
        "another key opens nothing"
    );

    // An older relay's plaintext row, next to it.
    sqlx::query(
        "INSERT INTO orders.webhook_destinations (destination, spec) VALUES ('legacy', $1)",
    )
    .bind(format!(
        "legacy=https://legacy.example.com/h,secret={secret}"
    ))
    .execute(&owner)
    .await
    .expect("a plaintext row");
    assert_eq!(
        relay::webhooks::plaintext(&relay_pool)
            .await
            .expect("plaintext"),
        vec!["legacy"]
    );

    // The rotation: the new key first, the old one kept; rekey; the old one dropped.
    let rekeyed = relay_webhooks(&db, Some(&rotating), &["rekey"]);
    assert!(
        rekeyed.status.success(),
        "{}",
        String::from_utf8_lossy(&rekeyed.stderr)
    );
    let said = String::from_utf8_lossy(&rekeyed.stdout);
    assert!(
        said.starts_with("2 destination specs sealed again under key new"),
        "{said}"
    );
    assert!(
        stored()
            .await
            .expect("stored")
            .starts_with("sealed:v1:new:")
    );
    assert!(
        relay::webhooks::plaintext(&relay_pool)
            .await
            .expect("plaintext")
            .is_empty()
    );
    assert_eq!(
        readable(&relay_pool, &new_only).await,
        vec![("legacy".into(), 1), ("p".into(), 1)],
        "the new key alone reads both"
    );
    assert!(
        readable(&relay_pool, &old_only).await.is_empty(),
        "the old key reads nothing now"
    );
    let again = relay_webhooks(&db, Some(&new_only), &["rekey"]);
    let said = String::from_utf8_lossy(&again.stdout);
    assert!(
        said.starts_with("0 destination specs sealed again"),
        "{said}"
    );
}
