//! The Payments consumer against the real PostgreSQL and broker of `make up`:
//! a fresh database, topic and consumer group per test.

use std::process::Stdio;
use std::time::Duration;

use effectively::config::DbArgs;
use effectively::crash::CrashArgs;
use effectively::envelope::Envelope;
use effectively::testing::{TestDb, TestTopic, eventually};
use payments::dup::{DupArgs, DupKind};
use payments::{Config, run};
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

struct Event {
    msg_id: Uuid,
    order_id: Uuid,
    amount_cents: i64,
}

fn events(n: usize) -> Vec<Event> {
    (0..n)
        .map(|i| Event {
            msg_id: Uuid::now_v7(),
            order_id: Uuid::now_v7(),
            amount_cents: 100 + i as i64,
        })
        .collect()
}

fn envelope(e: &Event) -> Vec<u8> {
    let payload = format!(
        r#"{{"order_id":"{}","account_id":7,"amount_cents":{},"status":"created"}}"#,
        e.order_id, e.amount_cents
    );
    Envelope::new(
        e.msg_id,
        "order.created".into(),
        e.order_id,
        chrono::Utc::now(),
        payload.as_bytes(),
    )
    .expect("envelope")
    .encode()
    .expect("encode")
}

async fn produce(topic: &TestTopic, messages: &[(String, Vec<u8>)]) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &topic.bootstrap_servers)
        .set("enable.idempotence", "true")
        .create()
        .expect("producer");
    for (key, value) in messages {
        producer
            .send(
                FutureRecord::to(&topic.name).key(key).payload(value),
                Duration::from_secs(10),
            )
            .await
            .expect("produce");
    }
}

async fn produce_events(topic: &TestTopic, events: &[Event]) {
    let messages: Vec<(String, Vec<u8>)> = events
        .iter()
        .map(|e| (e.order_id.to_string(), envelope(e)))
        .collect();
    produce(topic, &messages).await;
}

fn config(db: &TestDb, topic: &TestTopic, group: &str) -> Config {
    let mut db_args = DbArgs::for_url(&db.url);
    db_args.db_migrate = false;
    Config {
        db: db_args,
        kafka: topic.kafka_args(),
        crash: CrashArgs::default(),
        group_id: group.to_owned(),
        batch_size: 50,
        batch_linger_ms: 5,
        session_timeout_ms: 6_000,
        metrics_addr: "127.0.0.1:0".parse().expect("addr"),
        unsafe_split_txn: None,
        dup: DupArgs::default(),
        group_instance_id: None,
    }
}

struct Running {
    metrics_url: String,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Running {
    async fn spawn(config: Config) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let metrics_url = format!("http://{}/metrics", listener.local_addr().expect("addr"));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run(config, listener, cancel.clone()));
        Self {
            metrics_url,
            cancel,
            task,
        }
    }

    async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(&self.metrics_url)
            .await
            .expect("scrape")
            .text()
            .await
            .expect("text");
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
            .map(|v| v.trim().parse().expect("number"))
            .unwrap_or(0.0)
    }

    async fn stop(self) {
        self.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("stops in time")
            .expect("join")
            .expect("payments ok");
    }
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

const CHARGES: &str = "SELECT count(*) FROM payments.charges";
const LEDGER: &str = "SELECT count(*) FROM payments.ledger";
const INBOX: &str = "SELECT count(*) FROM payments.inbox";
const DOUBLES: &str =
    "SELECT count(*) FROM (SELECT order_id FROM payments.ledger GROUP BY 1 HAVING count(*) > 1) d";

#[tokio::test]
async fn charges_each_event_once_and_a_republish_is_a_noop() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let events = events(100);
    produce_events(&topic, &events).await;

    let consumer = Running::spawn(config(&db, &topic, "g-republish")).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 100
        })
        .await
    );

    // A relay re-publish: the same msg_ids at new offsets.
    produce_events(&topic, &events).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            consumer.metric("payments_dedup_hits_total").await >= 100.0
        })
        .await,
        "the re-published events were consumed as inbox hits"
    );
    assert_eq!(count(&pool, CHARGES).await, 100);
    assert_eq!(count(&pool, LEDGER).await, 100);
    assert_eq!(count(&pool, INBOX).await, 100);
    assert_eq!(consumer.metric("payments_charges_total").await, 100.0);
    let sum: i64 = sqlx::query_scalar("SELECT sum(amount_cents)::int8 FROM payments.charges")
        .fetch_one(&pool)
        .await
        .expect("sum");
    assert_eq!(sum, events.iter().map(|e| e.amount_cents).sum::<i64>());
    consumer.stop().await;
}

#[tokio::test]
async fn injected_duplicates_of_both_kinds_are_absorbed_by_the_inbox() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let events = events(200);
    produce_events(&topic, &events).await;

    let mut cfg = config(&db, &topic, "g-dup");
    cfg.dup = DupArgs {
        dup_rate: 1.0,
        dup_kind: DupKind::Both,
    };
    let consumer = Running::spawn(cfg).await;
    // Every message arrives twice (once injected, each kind about half), and
    // every second arrival is an inbox hit.
    assert!(
        eventually(Duration::from_secs(60), || async {
            let injected = consumer
                .metric("payments_injected_duplicates_total{kind=\"reprocess\"}")
                .await
                + consumer
                    .metric("payments_injected_duplicates_total{kind=\"redeliver\"}")
                    .await;
            count(&pool, CHARGES).await == 200
                && injected >= 200.0
                && consumer.metric("payments_dedup_hits_total").await >= injected
        })
        .await,
        "all charged, every message duplicated once and absorbed"
    );
    for kind in ["reprocess", "redeliver"] {
        let name = format!("payments_injected_duplicates_total{{kind=\"{kind}\"}}");
        assert!(consumer.metric(&name).await > 0.0, "{kind} injected");
    }
    assert_eq!(count(&pool, CHARGES).await, 200);
    assert_eq!(count(&pool, LEDGER).await, 200);
    assert_eq!(count(&pool, DOUBLES).await, 0);
    assert_eq!(consumer.metric("payments_charges_total").await, 200.0);
    consumer.stop().await;
}

#[tokio::test]
async fn a_malformed_message_is_dead_lettered_and_the_next_one_is_charged() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let good = events(1);
    let order = Uuid::now_v7();
    let no_msg_id = format!(
        r#"{{"event_type":"order.created","aggregate_id":"{order}","created_at":"2026-01-01T00:00:00Z","payload":{{}}}}"#
    );
    produce(
        &topic,
        &[
            ("k".into(), b"\xff not json at all".to_vec()),
            ("k".into(), no_msg_id.into_bytes()),
            (good[0].order_id.to_string(), envelope(&good[0])),
        ],
    )
    .await;
    let consumer = Running::spawn(config(&db, &topic, "g-dead")).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 1
        })
        .await
    );
    let dead: Vec<(i64, Option<Vec<u8>>, String)> = sqlx::query_as(
        "SELECT \"offset\", payload, reason FROM payments.dead_letters ORDER BY \"offset\"",
    )
    .fetch_all(&pool)
    .await
    .expect("dead letters");
    assert_eq!(dead.len(), 2);
    assert_eq!(dead[0].0, 0);
    assert_eq!(
        dead[0].1.as_deref(),
        Some(&b"\xff not json at all"[..]),
        "raw bytes kept"
    );
    assert!(dead[0].2.contains("not an event envelope"), "{}", dead[0].2);
    assert!(dead[1].2.contains("msg_id"), "{}", dead[1].2);
    assert_eq!(consumer.metric("payments_dead_letters_total").await, 2.0);
    consumer.stop().await;
}

/// Runs the payments binary (group `group`, env `extra`) again and again,
/// each life ending at its armed crash point, until every event's msg_id is
/// in the inbox; returns how many lives were killed.
async fn run_with_crashes(
    db: &TestDb,
    topic: &TestTopic,
    group: &str,
    extra: &[(&str, &str)],
    total: i64,
) -> usize {
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let mut kills = 0;
    for _ in 0..40 {
        if count(&pool, INBOX).await == total {
            break;
        }
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_payments"));
        child
            .env("DATABASE_URL", &db.url)
            .env("DB_MIGRATE", "false")
            .env("KAFKA_BOOTSTRAP_SERVERS", &topic.bootstrap_servers)
            .env("KAFKA_TOPIC", &topic.name)
            .env("PAYMENTS_GROUP_ID", group)
            .env("PAYMENTS_METRICS_ADDR", "127.0.0.1:0")
            .env("PAYMENTS_BATCH_SIZE", "10")
            .env("PAYMENTS_SESSION_TIMEOUT_MS", "6000")
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        for (k, v) in extra {
            child.env(k, v);
        }
        let mut child = child.spawn().expect("spawn payments");
        // It dies by its crash point, or idles once everything is in the inbox.
        let pool2 = pool.clone();
        tokio::select! {
            status = child.wait() => {
                assert!(!status.expect("wait").success());
                kills += 1;
            }
            _ = eventually(Duration::from_secs(60), || async { count(&pool2, INBOX).await == total }) => {
                child.kill().await.expect("kill");
            }
        }
    }
    assert_eq!(
        count(&pool, INBOX).await,
        total,
        "every event reached the inbox"
    );
    kills
}

/// The consumer binary SIGKILLs itself between the charge insert and the
/// commit (crash point `effect`), and between the inbox claim and the charge
/// (`claim`); restarted each time, it resumes from the committed offsets.
#[tokio::test]
async fn a_consumer_killed_before_commit_loses_nothing_and_doubles_nothing() {
    for point in ["effect", "claim"] {
        let db = TestDb::create().await;
        let topic = TestTopic::create(3).await;
        let pool = PgPool::connect(&db.url).await.expect("connect");
        produce_events(&topic, &events(120)).await;
        let extra = [("CRASH_POINT", point), ("CRASH_EVERY", "4")];
        let kills = run_with_crashes(&db, &topic, &format!("g-crash-{point}"), &extra, 120).await;
        assert!(kills >= 2, "{point}: killed mid-stream ({kills} times)");
        assert_eq!(count(&pool, CHARGES).await, 120, "{point}: nothing lost");
        assert_eq!(
            count(&pool, LEDGER).await,
            120,
            "{point}: one effect per event"
        );
        assert_eq!(count(&pool, DOUBLES).await, 0, "{point}: nothing doubled");
    }
}

/// The counter-example: the same crashes with inbox and effect in TWO
/// transactions (`--unsafe-split-txn`, crash point `split` between them) must
/// lose effects (inbox-first) and double them (effect-first). If this test
/// ever passes without drift, the experiment proves nothing.
#[tokio::test]
async fn splitting_inbox_and_effect_loses_or_doubles_effects_under_crashes() {
    for mode in ["inbox-first", "effect-first"] {
        let db = TestDb::create().await;
        let topic = TestTopic::create(3).await;
        let pool = PgPool::connect(&db.url).await.expect("connect");
        produce_events(&topic, &events(120)).await;
        let extra = [
            ("PAYMENTS_UNSAFE_SPLIT_TXN", mode),
            ("CRASH_POINT", "split"),
            ("CRASH_EVERY", "3"),
        ];
        let kills = run_with_crashes(&db, &topic, &format!("g-split-{mode}"), &extra, 120).await;
        assert!(
            kills >= 2,
            "{mode}: killed between the transactions ({kills} times)"
        );
        let (charges, ledger, doubles) = (
            count(&pool, CHARGES).await,
            count(&pool, LEDGER).await,
            count(&pool, DOUBLES).await,
        );
        match mode {
            "inbox-first" => {
                assert!(
                    charges < 120,
                    "inbox-first lost effects: {charges} charges for 120 events"
                );
                assert_eq!(doubles, 0);
            }
            _ => {
                assert_eq!(
                    charges, 120,
                    "the UNIQUE guard keeps one charge row per order"
                );
                assert!(
                    doubles > 0 && ledger > 120,
                    "effect-first doubled effects: {ledger} ledger entries, {doubles} orders twice"
                );
            }
        }
    }
}

#[tokio::test]
async fn two_consumers_in_one_group_split_the_partitions() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let a = Running::spawn(config(&db, &topic, "g-split")).await;
    let b = Running::spawn(config(&db, &topic, "g-split")).await;
    let events = events(300);
    produce_events(&topic, &events).await;
    assert!(
        eventually(Duration::from_secs(90), || async {
            count(&pool, CHARGES).await == 300
        })
        .await
    );
    let (consumed_a, consumed_b) = (
        a.metric("payments_consumed_total").await,
        b.metric("payments_consumed_total").await,
    );
    assert!(
        consumed_a > 0.0 && consumed_b > 0.0,
        "both members consumed: {consumed_a} / {consumed_b}"
    );
    assert_eq!(count(&pool, LEDGER).await, 300);
    assert_eq!(count(&pool, DOUBLES).await, 0);
    a.stop().await;
    b.stop().await;
}
