//! The Payments consumer against the real PostgreSQL and broker of `make up`:
//! a fresh database, topic and consumer group per test.

use std::process::Stdio;
use std::time::Duration;

use effectively::v7::{minted_ago, minted_ahead};
use payments::dup::{DupArgs, DupKind};
use payments::horizon::Retention;
use payments::receiver::WebhookArgs;
use payments::{Config, GroupProtocol, Transport, run};
use pipeline::config::DbArgs;
use pipeline::crash::CrashArgs;
use pipeline::db::ServiceRole;
use pipeline::envelope::Envelope;
use pipeline::testing::{Service, TestDb, TestTopic, eventually};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;
use uuid::Uuid;

pub(crate) struct Event {
    pub(crate) msg_id: Uuid,
    pub(crate) order_id: Uuid,
    pub(crate) amount_cents: i64,
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

pub(crate) fn envelope(e: &Event) -> Vec<u8> {
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

/// An idempotent producer to `topic`'s cluster.
fn producer(topic: &TestTopic) -> FutureProducer {
    topic
        .client()
        .set("enable.idempotence", "true")
        .create()
        .expect("producer")
}

async fn produce(topic: &TestTopic, messages: &[(String, Vec<u8>)]) {
    let producer = producer(topic);
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

pub(crate) fn config(db: &TestDb, topic: &TestTopic, group: &str) -> Config {
    let db_args = DbArgs::for_url(db.url_as(ServiceRole::Payments));
    Config {
        db: db_args,
        runtime: pipeline::config::RuntimeArgs { worker_threads: 0 },
        kafka: topic.kafka_args(),
        crash: CrashArgs::default(),
        group_id: group.to_owned(),
        batch_size: 50,
        batch_linger_ms: 5,
        group_protocol: GroupProtocol::Classic,
        session_timeout_ms: 6_000,
        fetch_wait_max_ms: 25,
        commit_interval_ms: 1000,
        metrics_addr: "127.0.0.1:0".parse().expect("addr"),
        lag_sample_ms: 100,
        unsafe_split_txn: None,
        dup: DupArgs::default(),
        source: Transport::Kafka,
        input_format: payments::InputFormat::Envelope,
        webhook: WebhookArgs {
            webhook_addr: "127.0.0.1:0".parse().expect("addr"),
            webhook_secret: Vec::new(),
            webhook_tolerance: Duration::from_secs(300),
            webhook_receipts_kept: Duration::from_secs(86_400),
            webhook_poll_ms: 1000,
            webhook_header_read_timeout: Duration::from_secs(10),
            webhook_request_timeout: Duration::from_secs(15),
            webhook_max_connections: 4096,
            webhook_concurrency: 256,
        },
        group_instance_id: None,
        hold_retry_ms: 300,
        inbox_retention: Retention::parse("16d").expect("retention"),
        unsafe_inbox_retention: false,
        unsafe_apply_after_horizon: false,
        inbox_partition: Duration::from_secs(86_400),
        clock_skew: Duration::from_secs(300),
    }
}

/// Payments on `config`, in this process.
async fn spawn_payments(config: Config) -> Service {
    Service::spawn("payments", |metrics, cancel| run(config, metrics, cancel)).await
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

const CHARGES: &str = "SELECT count(*) FROM payments.charges";
const LEDGER: &str = "SELECT count(*) FROM payments.ledger";
/// The library's first partition of the inbox: every msg_id minted before
/// the migration made it (the nil uuid's, 1970's, name).
const FIRST_PARTITION: &str = "pinbox_19700101t000000000";
const INBOX: &str = "SELECT count(*) FROM fx.partitioned_inbox WHERE consumer = 'payments'";
const DOUBLES: &str =
    "SELECT count(*) FROM (SELECT order_id FROM payments.ledger GROUP BY 1 HAVING count(*) > 1) d";

#[tokio::test]
async fn charges_each_event_once_and_a_republish_is_a_noop() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let events = events(100);
    produce_events(&topic, &events).await;

    let consumer = spawn_payments(config(&db, &topic, "g-republish")).await;
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

/// Records in the shape Debezium's Outbox Event Router gives outbox rows
/// (`--input-format outbox-router`): key = aggregate id, value = the
/// payload's JSON, headers `id`, `event_type`, `created_at`. Each sent twice
/// (a Connect worker's replay after a kill): charged once, the second an
/// inbox hit; one without `event_type` dead-lettered with the setting that
/// places it.
#[tokio::test]
async fn outbox_router_records_are_charged_once_and_their_replays_are_inbox_hits() {
    use rdkafka::message::{Header, OwnedHeaders};
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let events = events(50);
    let producer = producer(&topic);
    let send = |e: &Event, event_type: Option<&str>| {
        let payload = format!(
            r#"{{"order_id" : "{}", "account_id" : 7, "amount_cents" : {}, "status" : "created"}}"#,
            e.order_id, e.amount_cents
        );
        let (key, id) = (e.order_id.to_string(), e.msg_id.to_string());
        let mut headers = OwnedHeaders::new().insert(Header {
            key: "id",
            value: Some(id.as_str()),
        });
        if let Some(t) = event_type {
            headers = headers.insert(Header {
                key: "event_type",
                value: Some(t),
            });
        }
        headers = headers.insert(Header {
            key: "created_at",
            value: Some("2026-12-03T17:07:53.351115Z"),
        });
        let producer = producer.clone();
        let topic = topic.name.clone();
        async move {
            producer
                .send(
                    FutureRecord::to(&topic)
                        .key(&key)
                        .payload(payload.as_bytes())
                        .headers(headers),
                    Duration::from_secs(10),
                )
                .await
                .expect("produce");
        }
    };
    for _ in 0..2 {
        for e in &events {
            send(e, Some("order.created")).await;
        }
    }
    let untyped = Event {
        msg_id: Uuid::now_v7(),
        order_id: Uuid::now_v7(),
        amount_cents: 1,
    };
    send(&untyped, None).await;

    let mut cfg = config(&db, &topic, "g-router");
    cfg.input_format = payments::InputFormat::OutboxRouter;
    let consumer = spawn_payments(cfg).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            consumer.metric("payments_dedup_hits_total").await >= 50.0
                && count(&pool, "SELECT count(*) FROM payments.dead_letters").await == 1
        })
        .await,
        "every replay an inbox hit, the untyped record a dead letter"
    );
    assert_eq!(count(&pool, CHARGES).await, 50);
    assert_eq!(count(&pool, LEDGER).await, 50);
    assert_eq!(count(&pool, INBOX).await, 50);
    assert_eq!(count(&pool, DOUBLES).await, 0);
    let inboxed: Vec<Uuid> = sqlx::query_scalar(
        "SELECT msg_id FROM fx.partitioned_inbox WHERE consumer = 'payments' ORDER BY msg_id",
    )
    .fetch_all(&pool)
    .await
    .expect("inbox");
    let mut sent: Vec<Uuid> = events.iter().map(|e| e.msg_id).collect();
    sent.sort();
    assert_eq!(
        inboxed, sent,
        "the inbox keys on header id, the outbox's msg_id"
    );
    let reason: String = sqlx::query_scalar("SELECT reason FROM payments.dead_letters")
        .fetch_one(&pool)
        .await
        .expect("dead letter");
    assert!(reason.contains("event_type"), "{reason}");
    consumer.stop().await;
}

/// The series of `payments_consumer_lag` (one per owned partition): how
/// many there are and their sum.
async fn consumer_lag(consumer: &Service) -> (usize, f64) {
    let text = reqwest::get(consumer.metrics_url())
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    text.lines()
        .filter(|l| l.starts_with("payments_consumer_lag{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .fold((0, 0.0), |(n, sum), v| (n + 1, sum + v))
}

/// The largest `payments_consumer_lag_age_seconds` (one series per owned
/// partition) and how many series there are.
async fn consumer_lag_age(consumer: &Service) -> (usize, f64) {
    let text = reqwest::get(consumer.metrics_url())
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    text.lines()
        .filter(|l| l.starts_with("payments_consumer_lag_age_seconds{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .fold((0, 0.0), |(n, max), v| (n + 1, f64::max(max, v)))
}

/// `payments_consumer_lag` is, per owned partition, the high watermark minus
/// the group's committed offset: events the consumer cannot apply (its role
/// lost INSERT on the inbox, a transient error it retries) are lag, and the
/// lag goes back to 0 once they are applied and their offsets committed.
/// `payments_consumer_lag_age_seconds` (the age to hold against the topic's
/// retention) grows meanwhile, and is 0 again after.
#[tokio::test]
async fn consumer_lag_per_partition_is_what_no_commit_covers() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let consumer = spawn_payments(config(&db, &topic, "g-lag")).await;
    produce_events(&topic, &events(6)).await;
    // Applied, and a series per partition; the database fails right after,
    // whether or not the last batches' offsets were committed yet: they are
    // committed while the next batch waits on it, so the lag below is exactly
    // what is not applied (it read 45 when they waited for that batch).
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 6 && consumer_lag(&consumer).await.0 == 3
        })
        .await,
        "applied, a lag series per partition ({:?})",
        consumer_lag(&consumer).await
    );

    let role = ServiceRole::Payments.name();
    sqlx::query(&format!(
        "REVOKE INSERT ON fx.partitioned_inbox FROM {role}"
    ))
    .execute(&pool)
    .await
    .expect("revoke");
    produce_events(&topic, &events(40)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            consumer_lag(&consumer).await == (3, 40.0)
        })
        .await,
        "the 40 events it cannot apply are its lag ({:?})",
        consumer_lag(&consumer).await
    );
    assert_eq!(count(&pool, CHARGES).await, 6, "nothing applied meanwhile");
    // The events waiting were produced before the assertion above: their age
    // passes a few seconds while the consumer stays stuck.
    assert!(
        eventually(Duration::from_secs(30), || async {
            let (n, age) = consumer_lag_age(&consumer).await;
            n == 3 && age >= 3.0
        })
        .await,
        "the lag's age grows while nothing is applied ({:?})",
        consumer_lag_age(&consumer).await
    );

    sqlx::query(&format!("GRANT INSERT ON fx.partitioned_inbox TO {role}"))
        .execute(&pool)
        .await
        .expect("grant");
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 46 && consumer_lag(&consumer).await == (3, 0.0)
        })
        .await,
        "applied once the grant is back, and the lag is 0 again ({:?})",
        consumer_lag(&consumer).await
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            consumer_lag_age(&consumer).await == (3, 0.0)
        })
        .await,
        "no lag, no age ({:?})",
        consumer_lag_age(&consumer).await
    );
    consumer.stop().await;
}

#[tokio::test]
async fn injected_duplicates_of_both_kinds_are_absorbed_by_the_inbox() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let events = events(200);
    let mut cfg = config(&db, &topic, "g-dup");
    cfg.dup = DupArgs {
        dup_rate: 1.0,
        dup_kind: DupKind::Both,
    };
    let consumer = spawn_payments(cfg).await;
    // The kind is drawn once per partition and batch: produced all at once,
    // 200 messages can come in one batch per partition, six draws, all of one
    // kind once in 32 runs. Ten waves, each charged before the next is
    // produced, make dozens of draws.
    for (i, wave) in events.chunks(20).enumerate() {
        produce_events(&topic, wave).await;
        let charged = 20 * (i as i64 + 1);
        assert!(
            eventually(Duration::from_secs(60), || async {
                count(&pool, CHARGES).await == charged
            })
            .await,
            "wave {i} charged"
        );
    }
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
    let consumer = spawn_payments(config(&db, &topic, "g-dead")).await;
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

/// The payments binary as a child process on `db` and `topic` in consumer
/// group `group` (metrics on a free port, errors only, output discarded,
/// killed when dropped); callers add their own settings.
fn payments_process(db: &TestDb, topic: &TestTopic, group: &str) -> tokio::process::Command {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_payments"));
    child
        .env("DATABASE_URL", db.url_as(ServiceRole::Payments))
        .env("KAFKA_BOOTSTRAP_SERVERS", &topic.bootstrap_servers)
        .env("KAFKA_TOPIC", &topic.name)
        .env("PAYMENTS_GROUP_ID", group)
        .env("PAYMENTS_METRICS_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    child
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
        let mut child = payments_process(db, topic, group);
        child
            .env("PAYMENTS_BATCH_SIZE", "10")
            .env("PAYMENTS_SESSION_TIMEOUT_MS", "6000")
            // A static member, as chaos runs it: the restarted process takes
            // the dead one's place in the group at once, without waiting for
            // its session to expire and a rebalance.
            .env("PAYMENTS_GROUP_INSTANCE_ID", format!("{group}-1"));
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

/// SIGTERM under a load that never lets the prefetch run dry (a backlog,
/// and production that goes on): payments stops within seconds, exits 0,
/// and its final commit covers exactly what it applied, so the next owner
/// neither skips nor re-reads an applied event. (Before, the loop looked at
/// the cancellation only when a batch came back empty, which under load it
/// never did: the supervisor's SIGTERM became its SIGKILL.)
#[tokio::test]
async fn sigterm_under_a_steady_load_stops_within_seconds_and_commits_what_it_applied() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let group = "g-sigterm";
    // Bounded: at most 200 chunks of 500, at most 90 s.
    let producing = tokio_util::sync::CancellationToken::new();
    let producer = tokio::spawn({
        let topic = topic.clone();
        let stop = producing.clone();
        async move {
            let producer: FutureProducer = topic
                .client()
                .set("enable.idempotence", "true")
                .set("linger.ms", "5")
                .create()
                .expect("producer");
            let until = tokio::time::Instant::now() + Duration::from_secs(90);
            let mut sent = 0;
            for _ in 0..200 {
                if stop.is_cancelled() || tokio::time::Instant::now() > until {
                    break;
                }
                let chunk = events(500);
                let sends = chunk.iter().map(|e| {
                    let (key, value) = (e.order_id.to_string(), envelope(e));
                    let producer = &producer;
                    let topic = &topic.name;
                    async move {
                        producer
                            .send(
                                FutureRecord::to(topic).key(&key).payload(&value),
                                Duration::from_secs(10),
                            )
                            .await
                            .map_err(|(e, _)| e)
                    }
                });
                for sent_one in futures::future::join_all(sends).await {
                    sent_one.expect("produce");
                }
                sent += chunk.len();
            }
            sent
        }
    });
    // A backlog first, so every batch has a next one waiting.
    assert!(
        eventually(Duration::from_secs(60), || async {
            topic_end(&topic) >= 5_000
        })
        .await,
        "a backlog was produced"
    );
    let mut child = payments_process(&db, &topic, group)
        .env("PAYMENTS_BATCH_SIZE", "100")
        .spawn()
        .expect("spawn payments");
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, INBOX).await >= 1_000
        })
        .await,
        "payments consumes"
    );
    let pid = child.id().expect("pid").to_string();
    let status = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .expect("kill -TERM");
    assert!(status.success());
    let stopped = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
    let produced_meanwhile = topic_end(&topic);
    producing.cancel();
    let sent = producer.await.expect("producer task");
    let exit = stopped
        .expect("payments still running 10 s after SIGTERM under load")
        .expect("wait");
    assert!(exit.success(), "a clean stop exits 0: {exit}");
    let applied = count(&pool, INBOX).await;
    assert!(
        applied < produced_meanwhile,
        "it stopped with a backlog left ({applied} of {produced_meanwhile}; {sent} sent in all)"
    );
    assert_eq!(
        committed_offset(&topic, group),
        applied,
        "the final commit covers exactly what was applied"
    );
    assert_eq!(count(&pool, CHARGES).await, applied);
}

/// The end offset of partition 0 of `topic`: how many messages it holds.
fn topic_end(topic: &TestTopic) -> i64 {
    let consumer: BaseConsumer = topic.client().create().expect("consumer");
    consumer
        .fetch_watermarks(&topic.name, 0, Duration::from_secs(10))
        .map(|(_, high)| high)
        .unwrap_or(0)
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
    let a = spawn_payments(config(&db, &topic, "g-split")).await;
    let b = spawn_payments(config(&db, &topic, "g-split")).await;
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

/// The partitions a member owns now: assigned minus revoked, from its
/// `payments_partitions_moved_total`.
async fn owned(member: &Service) -> f64 {
    member
        .metric(r#"payments_partitions_moved_total{event="assigned"}"#)
        .await
        - member
            .metric(r#"payments_partitions_moved_total{event="revoked"}"#)
            .await
}

#[tokio::test]
async fn a_member_joining_moves_only_the_partitions_that_change_owner() {
    a_member_joins(GroupProtocol::Classic, "g-coop").await;
}

/// The same with the consumer protocol (KIP-848): the coordinator assigns,
/// incrementally too.
#[tokio::test]
async fn with_the_consumer_protocol_a_member_joining_moves_only_what_changes_owner() {
    a_member_joins(GroupProtocol::Consumer, "g-coop-848").await;
}

async fn a_member_joins(protocol: GroupProtocol, group: &str) {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let member = || {
        let mut c = config(&db, &topic, group);
        c.group_protocol = protocol;
        c
    };
    let a = spawn_payments(member()).await;
    let first = events(200);
    produce_events(&topic, &first).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            owned(&a).await == 6.0 && count(&pool, CHARGES).await == 200
        })
        .await,
        "the first member owns all six partitions and charged the first events"
    );

    // A second member joins while events keep coming.
    let b = spawn_payments(member()).await;
    let second = events(200);
    produce_events(&topic, &second).await;
    assert!(
        eventually(Duration::from_secs(90), || async {
            owned(&a).await == 3.0 && owned(&b).await == 3.0
        })
        .await,
        "the partitions split three and three: a owns {}, b owns {}",
        owned(&a).await,
        owned(&b).await
    );
    // Cooperative-sticky: the first member gave up the three that moved and
    // kept the other three throughout (an eager rebalance revokes all six,
    // then assigns three back).
    let revoked = a
        .metric(r#"payments_partitions_moved_total{event="revoked"}"#)
        .await;
    assert_eq!(revoked, 3.0, "the first member revoked only what moved");
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 400
        })
        .await
    );
    assert_eq!(count(&pool, LEDGER).await, 400);
    assert_eq!(count(&pool, DOUBLES).await, 0);
    a.stop().await;
    b.stop().await;
}

/// With the consumer protocol (KIP-848) a member killed -9 holds its
/// partitions for the brokers' session (`group.consumer.session.timeout.ms`,
/// the stack's 10 s) and no longer; meanwhile the other member goes on with
/// its own, then takes the dead one's and applies what waited there.
#[tokio::test]
async fn with_the_consumer_protocol_a_member_killed_gives_its_partitions_up_after_its_session() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let group = "g-kill-848";
    let mut cfg = config(&db, &topic, group);
    cfg.group_protocol = GroupProtocol::Consumer;
    let a = spawn_payments(cfg).await;
    let mut b = payments_process(&db, &topic, group)
        .env("PAYMENTS_GROUP_PROTOCOL", "consumer")
        .spawn()
        .expect("spawn payments");
    produce_events(&topic, &events(200)).await;
    assert!(
        eventually(Duration::from_secs(90), || async {
            owned(&a).await == 3.0 && count(&pool, CHARGES).await == 200
        })
        .await,
        "the two members split the partitions and charged the first events (a owns {})",
        owned(&a).await
    );
    b.start_kill().expect("kill -9");
    b.wait().await.expect("wait");
    let killed = std::time::Instant::now();
    produce_events(&topic, &events(200)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            owned(&a).await == 6.0 && count(&pool, CHARGES).await == 400
        })
        .await,
        "the survivor took all six partitions and charged everything (owns {}, {} charges)",
        owned(&a).await,
        count(&pool, CHARGES).await
    );
    let took = killed.elapsed();
    assert!(
        took >= Duration::from_secs(5),
        "the dead member's partitions waited for its session, not {took:?}"
    );
    assert_eq!(count(&pool, DOUBLES).await, 0);
    a.stop().await;
}

#[tokio::test]
async fn a_static_member_fenced_again_by_a_second_process_with_its_id_exits_with_an_error() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(2).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let mut static_config = config(&db, &topic, "g-fenced");
    static_config.group_instance_id = Some("payments-1".into());
    let old = spawn_payments(static_config.clone()).await;
    produce_events(&topic, &events(20)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 20
        })
        .await
    );
    // A second process with the same group.instance.id: the broker fences
    // the older one, whose client turns fatal. It joins again once, which
    // fences the newer one, which joins again too: fenced a second time
    // within the rejoin window, the older one must end, with the reason.
    let new = spawn_payments(static_config).await;
    let ended = old.ended(Duration::from_secs(120)).await;
    let error = ended.expect_err("the fenced member ends with an error");
    assert!(
        format!("{error:#}").to_lowercase().contains("fenc"),
        "the error says it was fenced: {error:#}"
    );
    assert_eq!(new.metric("payments_consumer_rejoins_total").await, 1.0);
    // The new member carries on.
    produce_events(&topic, &events(20)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 40
        })
        .await
    );
    new.stop().await;
}

#[tokio::test]
async fn a_static_member_fenced_once_joins_again_and_carries_on() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(2).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let group = format!("g-fenced-once-{}", topic.name);
    let mut static_config = config(&db, &topic, &group);
    static_config.group_instance_id = Some("payments-1".into());
    let member = spawn_payments(static_config.clone()).await;
    produce_events(&topic, &events(20)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 20
        })
        .await
    );
    // A client with the member's id joins the group and goes away (a static
    // member's close does not leave the group): the coordinator fences the
    // member, as one that lost track of it does.
    let intruder: BaseConsumer = topic
        .client()
        .set("group.id", &group)
        .set("group.instance.id", "payments-1")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", "6000")
        .create()
        .expect("intruder");
    intruder.subscribe(&[&topic.name]).expect("subscribe");
    let joined = tokio::task::spawn_blocking(move || {
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while std::time::Instant::now() < until {
            let _ = intruder.poll(Duration::from_millis(100));
            if intruder.assignment().is_ok_and(|a| a.count() > 0) {
                return true;
            }
        }
        false
    })
    .await
    .expect("intruder task");
    assert!(joined, "the intruder got partitions");
    assert!(
        eventually(Duration::from_secs(60), || async {
            member.metric("payments_consumer_rejoins_total").await == 1.0
        })
        .await,
        "the fenced member joined again"
    );
    // It carries on: what comes next is charged, nothing twice.
    produce_events(&topic, &events(20)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 40
        })
        .await
    );
    assert_eq!(count(&pool, DOUBLES).await, 0);
    member.stop().await;
}

/// What a hand-made message must become.
enum Expect {
    /// Charged once.
    Charged,
    /// A dead letter of this kind whose reason contains this text.
    Dead(&'static str, &'static str),
}

/// A raw Kafka record: key and value, either may be absent.
type Raw = (Option<Vec<u8>>, Option<Vec<u8>>);

async fn produce_raw(topic: &TestTopic, messages: &[Raw]) {
    let producer = producer(topic);
    for (key, value) in messages {
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&topic.name);
        if let Some(k) = key {
            record = record.key(k.as_slice());
        }
        if let Some(v) = value {
            record = record.payload(v.as_slice());
        }
        producer
            .send(record, Duration::from_secs(10))
            .await
            .expect("produce");
    }
}

/// An `order.created` envelope with the given raw JSON text for each field.
fn raw_envelope(msg_id: &str, event_type: &str, aggregate: &str, payload: &str) -> Vec<u8> {
    format!(
        r#"{{"msg_id":{msg_id},"event_type":{event_type},"aggregate_id":{aggregate},"created_at":"2026-01-01T00:00:00Z","payload":{payload}}}"#
    )
    .into_bytes()
}

fn quoted(u: Uuid) -> String {
    format!("\"{u}\"")
}

/// Hostile input: every kind of malformed message, each followed by a valid
/// one, on one partition. Every valid event is charged, every bad one is a
/// dead letter with a readable reason, and the consumer never stops.
#[tokio::test]
async fn no_message_however_malformed_stops_the_partition() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");

    let first = events(1).remove(0);
    let order = Uuid::now_v7();
    let good_payload = |o: Uuid, amount: i64| {
        format!(r#"{{"order_id":"{o}","account_id":7,"amount_cents":{amount},"status":"created"}}"#)
    };
    let et = "\"order.created\"";
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    type Case = (Option<Vec<u8>>, Option<Vec<u8>>, Expect);
    let mut bad: Vec<Case> = vec![
        // NUL in each field that matters (the original report: msg_id "\u0000").
        (Some(b"k".to_vec()), Some(raw_envelope(r#""\u0000""#, et, &quoted(order), &good_payload(order, 5))), Expect::Dead("undecodable", "\\u{0}")),
        (Some(b"k\0k".to_vec()), Some(raw_envelope(&quoted(Uuid::now_v7()), r#""order.created\u0000""#, &quoted(order), &good_payload(order, 5))), Expect::Dead("undecodable", "unknown event type")),
        (None, Some(raw_envelope(&quoted(Uuid::now_v7()), et, r#""\u0000""#, &good_payload(order, 5))), Expect::Dead("undecodable", "not an event envelope")),
        (None, Some(raw_envelope(&quoted(Uuid::now_v7()), et, &quoted(order), r#"{"order_id":"\u0000","account_id":7,"amount_cents":5}"#)), Expect::Dead("undecodable", "order.created payload")),
        (None, Some(b"{\"msg_id\":\"\0\"}".to_vec()), Expect::Dead("undecodable", "not an event envelope")),
        // Invalid UTF-8 inside a string.
        (Some(b"\xff\xfe".to_vec()), Some(raw_envelope("\"\u{0}\"", et, &quoted(order), &good_payload(order, 5)).into_iter().map(|b| if b == 0 { 0xff } else { b }).collect()), Expect::Dead("undecodable", "not an event envelope")),
        // Null value (a tombstone) and an empty value.
        (Some(b"tomb".to_vec()), None, Expect::Dead("undecodable", "null message value")),
        (None, Some(Vec::new()), Expect::Dead("undecodable", "not an event envelope")),
        // 900 KB of garbage.
        (None, Some(vec![b'x'; 900 * 1024]), Expect::Dead("undecodable", "not an event envelope")),
        // Deep nesting, in the value and inside the payload.
        (None, Some(deep.clone().into_bytes()), Expect::Dead("undecodable", "not an event envelope")),
        (None, Some(raw_envelope(&quoted(Uuid::now_v7()), et, &quoted(order), &deep)), Expect::Dead("undecodable", "recursion limit|order.created payload")),
        // Numbers out of range.
        (None, Some(raw_envelope(&quoted(Uuid::now_v7()), et, &quoted(order), &format!(r#"{{"order_id":"{order}","account_id":7,"amount_cents":99999999999999999999999}}"#))), Expect::Dead("undecodable", "order.created payload")),
        (None, Some(raw_envelope(&quoted(Uuid::now_v7()), et, &quoted(order), &format!(r#"{{"order_id":"{order}","account_id":-1,"amount_cents":5}}"#))), Expect::Dead("undecodable", "non-positive")),
        // Duplicate fields.
        (None, Some(format!(r#"{{"msg_id":"{}","msg_id":"{}","event_type":"order.created","aggregate_id":"{order}","created_at":"2026-01-01T00:00:00Z","payload":{}}}"#, Uuid::now_v7(), Uuid::now_v7(), good_payload(order, 5)).into_bytes()), Expect::Dead("undecodable", "duplicate field")),
        // Unknown event type; msg_id not a UUID.
        (None, Some(raw_envelope(&quoted(Uuid::now_v7()), "\"order.refunded\"", &quoted(order), &good_payload(order, 5))), Expect::Dead("undecodable", "unknown event type")),
        (None, Some(raw_envelope("\"not-a-uuid\"", et, &quoted(order), &good_payload(order, 5))), Expect::Dead("undecodable", "not an event envelope")),
        // A redelivery that lies: the first event's msg_id with another amount.
        (None, Some(raw_envelope(&quoted(first.msg_id), et, &quoted(first.order_id), &good_payload(first.order_id, first.amount_cents + 1))), Expect::Dead("msg_id_conflict", "another payload")),
        // A new msg_id for the order the first event charged.
        (None, Some(raw_envelope(&quoted(Uuid::now_v7()), et, &quoted(first.order_id), &good_payload(first.order_id, first.amount_cents))), Expect::Dead("order_conflict", "already charged")),
    ];
    // Each bad message is followed by a valid event; the first event leads.
    let mut messages = vec![(
        Some(first.order_id.to_string().into_bytes()),
        Some(envelope(&first)),
        Expect::Charged,
    )];
    let mut valid = vec![first];
    for (key, value, expect) in bad.drain(..) {
        messages.push((key, value, expect));
        let e = events(1).remove(0);
        messages.push((
            Some(e.order_id.to_string().into_bytes()),
            Some(envelope(&e)),
            Expect::Charged,
        ));
        valid.push(e);
    }
    let raw: Vec<Raw> = messages
        .iter()
        .map(|(k, v, _)| (k.clone(), v.clone()))
        .collect();
    produce_raw(&topic, &raw).await;

    let consumer = spawn_payments(config(&db, &topic, "g-hostile")).await;
    let dead_expected = messages
        .iter()
        .filter(|m| matches!(m.2, Expect::Dead(..)))
        .count() as i64;
    assert!(
        eventually(Duration::from_secs(90), || async {
            count(&pool, CHARGES).await == valid.len() as i64
                && count(&pool, "SELECT count(*) FROM payments.dead_letters").await == dead_expected
        })
        .await,
        "every valid event charged and every bad one dead-lettered: {} charges, {} dead letters",
        count(&pool, CHARGES).await,
        count(&pool, "SELECT count(*) FROM payments.dead_letters").await
    );
    let sum: i64 = sqlx::query_scalar("SELECT sum(amount_cents)::int8 FROM payments.ledger")
        .fetch_one(&pool)
        .await
        .expect("sum");
    assert_eq!(
        sum,
        valid.iter().map(|e| e.amount_cents).sum::<i64>(),
        "the first effects stand"
    );
    assert_eq!(count(&pool, DOUBLES).await, 0);

    let dead: Vec<(i64, String, String, Option<Vec<u8>>)> = sqlx::query_as(
        "SELECT \"offset\", kind, reason, payload FROM payments.dead_letters ORDER BY \"offset\"",
    )
    .fetch_all(&pool)
    .await
    .expect("dead letters");
    let expected: Vec<(i64, &str, &str, &Option<Vec<u8>>)> = messages
        .iter()
        .enumerate()
        .filter_map(|(offset, (_, value, e))| match e {
            Expect::Dead(kind, text) => Some((offset as i64, *kind, *text, value)),
            Expect::Charged => None,
        })
        .collect();
    assert_eq!(dead.len(), expected.len());
    for ((offset, kind, reason, payload), (want_offset, want_kind, want_text, want_payload)) in
        dead.iter().zip(&expected)
    {
        assert_eq!(offset, want_offset);
        assert_eq!(kind, want_kind, "offset {offset}: {reason}");
        assert!(
            want_text.split('|').any(|t| reason.contains(t)),
            "offset {offset}: {reason:?} lacks {want_text:?}"
        );
        assert!(reason.len() <= 2_100, "offset {offset}: reason capped");
        assert_eq!(payload, *want_payload, "offset {offset}: raw bytes kept");
    }
    assert_eq!(
        consumer.metric("payments_msg_id_conflicts_total").await,
        1.0
    );
    assert_eq!(
        consumer.metric("payments_charge_conflicts_total").await,
        1.0
    );
    assert_eq!(
        consumer.metric("payments_dead_letters_total").await,
        dead_expected as f64
    );
    consumer.stop().await;
}

/// A message the database refuses to apply (here: a CHECK constraint the
/// test adds, standing for any deterministic data error) is isolated from
/// its batch, dead-lettered with the database's reason, and the rest of the
/// batch is charged; the partition moves on.
#[tokio::test]
async fn a_message_the_database_refuses_is_isolated_and_the_rest_applied() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    sqlx::query("ALTER TABLE payments.charges ADD CONSTRAINT no_666 CHECK (amount_cents <> 666)")
        .execute(&pool)
        .await
        .expect("add check");
    let mut events = events(40);
    events[17].amount_cents = 666;
    events[31].amount_cents = 666;
    produce_events(&topic, &events).await;

    let consumer = spawn_payments(config(&db, &topic, "g-refused")).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 38
                && count(&pool, "SELECT count(*) FROM payments.dead_letters").await == 2
        })
        .await,
        "38 charged, 2 dead-lettered"
    );
    let dead: Vec<(i64, String, String, Option<Uuid>)> = sqlx::query_as(
        "SELECT \"offset\", kind, reason, msg_id FROM payments.dead_letters ORDER BY \"offset\"",
    )
    .fetch_all(&pool)
    .await
    .expect("dead letters");
    assert_eq!(dead[0].0, 17);
    assert_eq!(dead[1].0, 31);
    for (i, (_, kind, reason, msg_id)) in dead.iter().enumerate() {
        assert_eq!(kind, "rejected");
        assert!(reason.contains("no_666"), "{reason}");
        assert_eq!(*msg_id, Some(events[[17, 31][i]].msg_id));
    }
    assert_eq!(
        count(&pool, INBOX).await,
        38,
        "the refused messages are not claimed"
    );
    assert_eq!(consumer.metric("payments_rejected_total").await, 2.0);
    assert!(
        consumer
            .metric("payments_consumer_errors_total{stage=\"db_refused\"}")
            .await
            >= 2.0
    );
    consumer.stop().await;
}

/// Expiry drops whole partitions; a message older than the oldest partition
/// kept is dead-lettered as after the dedup horizon and never applied; one
/// minted a month ahead is refused too (`ahead_of_clock`); the rest is
/// charged.
#[tokio::test]
async fn after_expiry_a_late_message_is_refused_not_applied() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(2).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // Minted an hour before the migration made its first partition: in the
    // first partition (every msg_id minted before the migration), which an
    // expiry with retention 0 drops.
    let mut late = events(3);
    for e in &mut late {
        e.msg_id = minted_ago(Duration::from_secs(3600));
    }
    let mut future = events(1);
    future[0].msg_id = minted_ahead(Duration::from_secs(30 * 86_400));
    let fresh = events(5);
    let dropped: Vec<String> =
        sqlx::query_scalar("SELECT fx.partitioned_inbox_expire('payments', '0s')")
            .fetch_all(&pool)
            .await
            .expect("expire");
    assert_eq!(
        dropped,
        [FIRST_PARTITION],
        "only the partition wholly in the past"
    );
    produce_events(&topic, &late).await;
    produce_events(&topic, &future).await;
    produce_events(&topic, &fresh).await;

    let consumer = spawn_payments(config(&db, &topic, "g-late")).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 5
                && count(&pool, "SELECT count(*) FROM payments.dead_letters").await == 4
        })
        .await,
        "the fresh events charged, the late ones and the future one dead-lettered"
    );
    let ahead: Vec<Uuid> = sqlx::query_scalar(
        "SELECT msg_id FROM payments.dead_letters WHERE kind = 'ahead_of_clock'",
    )
    .fetch_all(&pool)
    .await
    .expect("ahead of clock");
    assert_eq!(ahead, [future[0].msg_id]);
    let kinds: Vec<(String, Uuid, String)> = sqlx::query_as(
        "SELECT kind, msg_id, reason FROM payments.dead_letters \
         WHERE kind <> 'ahead_of_clock' ORDER BY kind, msg_id",
    )
    .fetch_all(&pool)
    .await
    .expect("dead letters");
    let mut late_ids: Vec<Uuid> = late.iter().map(|e| e.msg_id).collect();
    late_ids.sort();
    for ((kind, msg_id, reason), expected) in kinds.iter().zip(&late_ids) {
        assert_eq!(kind, "after_horizon");
        assert_eq!(msg_id, expected);
        assert!(
            reason.starts_with("arrived after the dedup horizon"),
            "{reason}"
        );
    }
    assert_eq!(kinds.len(), 3);
    assert_eq!(consumer.metric("payments_after_horizon_total").await, 3.0);
    assert_eq!(consumer.metric("payments_ahead_of_clock_total").await, 1.0);
    assert!(consumer.metric("payments_inbox_partitions").await >= 2.0);
    assert_eq!(
        consumer.metric("payments_redelivery_horizon_seconds").await,
        (15 * 86_400 + 600) as f64,
        "the horizon of the topic as the project creates it"
    );
    // Not one of them touched the inbox or the ledger.
    assert_eq!(count(&pool, INBOX).await, 5);
    assert_eq!(count(&pool, LEDGER).await, 5);
    consumer.stop().await;
}

/// The committed offset of partition 0 of `topic` for `group` (-1: none).
fn committed_offset(topic: &TestTopic, group: &str) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = topic
        .client()
        .set("group.id", group)
        .create()
        .expect("consumer");
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition(&topic.name, 0);
    let committed = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed offsets");
    match committed.elements()[0].offset() {
        rdkafka::Offset::Offset(o) => o,
        _ => -1,
    }
}

/// A valid event whose msg_id was minted further ahead of the database's
/// clock than the clock skew payments accepts (here: an orders clock 30 days
/// fast, the skew 5 minutes) is refused at once, visibly: a dead letter
/// `ahead_of_clock` with its reason, counted, and the partition moves on
/// (the offset is committed past it). It once held its whole partition
/// until the inbox's partitions reached its mint time: a month.
#[tokio::test]
async fn an_event_minted_ahead_of_every_accepted_clock_is_dead_lettered_and_the_partition_moves_on()
{
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let mut future = events(1);
    future[0].msg_id = minted_ahead(Duration::from_secs(30 * 86_400));
    let after = events(3);
    produce_events(&topic, &future).await;
    produce_events(&topic, &after).await;

    let group = "g-ahead";
    let consumer = spawn_payments(config(&db, &topic, group)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 3
                && count(&pool, "SELECT count(*) FROM payments.dead_letters").await == 1
        })
        .await,
        "the events after it charged, it dead-lettered: {} charges",
        count(&pool, CHARGES).await
    );
    let (kind, msg_id, order_id, reason, offset): (String, Uuid, Uuid, String, i64) =
        sqlx::query_as(
            "SELECT kind, msg_id, order_id, reason, \"offset\" FROM payments.dead_letters",
        )
        .fetch_one(&pool)
        .await
        .expect("dead letter");
    assert_eq!(kind, "ahead_of_clock");
    assert_eq!(
        (msg_id, order_id, offset),
        (future[0].msg_id, future[0].order_id, 0)
    );
    assert!(reason.contains("--clock-skew 300s"), "{reason}");
    assert!(
        eventually(Duration::from_secs(30), || async {
            committed_offset(&topic, group) == 4
        })
        .await,
        "the offset moves past every event"
    );
    assert_eq!(consumer.metric("payments_ahead_of_clock_total").await, 1.0);
    assert_eq!(consumer.metric("payments_dead_letters_total").await, 1.0);
    assert_eq!(consumer.metric("payments_held_partitions").await, 0.0);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM payments.parked").await,
        0
    );
    assert_eq!(count(&pool, LEDGER).await, 3, "each charged once");
    consumer.stop().await;
}

/// The inbox's partitions stop short, as when their maintenance is behind:
/// the partitions beyond the next two days are dropped, and payments may no
/// longer create any (its grant taken back), until [`maintenance_resumes`].
async fn maintenance_behind(pool: &PgPool) {
    sqlx::query(
        "DO $$ DECLARE p record; BEGIN \
           REVOKE EXECUTE ON FUNCTION fx.partitioned_inbox_extend(timestamptz, interval, uuid) \
             FROM effectively_payments; \
           FOR p IN SELECT name FROM fx.partitioned_inbox_parts \
                    WHERE lo >= effectively.v7_floor(now() + interval '2 days') LOOP \
             EXECUTE format('ALTER TABLE fx.partitioned_inbox DETACH PARTITION fx.%I', p.name); \
             EXECUTE format('DROP TABLE fx.%I', p.name); \
             DELETE FROM fx.partitioned_inbox_parts WHERE name = p.name; \
           END LOOP; \
         END $$",
    )
    .execute(pool)
    .await
    .expect("partitions cut short");
}

/// The partitions reach `days` ahead again, and payments may extend them.
async fn maintenance_resumes(pool: &PgPool, days: u32) {
    sqlx::query(
        "GRANT EXECUTE ON FUNCTION fx.partitioned_inbox_extend(timestamptz, interval, uuid) \
         TO effectively_payments",
    )
    .execute(pool)
    .await
    .expect("grant");
    sqlx::query(
        "SELECT fx.partitioned_inbox_extend(now() + $1 * interval '1 day', interval '1 day')",
    )
    .bind(f64::from(days))
    .execute(pool)
    .await
    .expect("extend");
}

/// The hostile sequence of the review, scaled down, on one partition: a
/// valid event whose msg_id lies beyond the inbox's partitions (their
/// maintenance behind; within the clock skew payments accepts), then 2,000
/// malformed messages, a valid event of another order, and a later event of
/// the first one's order. Only that order waits: the first event is parked
/// (durably, in `payments.parked`) with its order's later event behind it,
/// the malformed ones are dead-lettered, the valid one is charged within
/// seconds and the offset moves past them all. Once the partitions reach
/// it, the parked event is applied, then its order's later one (an
/// `order_conflict` dead letter, as for any second event of a charged
/// order: it was not applied first). It once held the whole partition.
#[tokio::test]
async fn an_event_the_inbox_cannot_record_yet_is_parked_and_only_its_order_waits() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let group = "g-parked";
    let mut config = config(&db, &topic, group);
    // Producers' clocks may run up to 30 days ahead; the horizon grows by as
    // much, so the inbox keeps everything.
    config.clock_skew = Duration::from_secs(30 * 86_400);
    config.inbox_retention = Retention::Forever;
    let consumer = spawn_payments(config).await;
    // Once its start-up has made the partitions ahead (the gauge is set
    // after that).
    assert!(
        eventually(Duration::from_secs(30), || async {
            consumer.metric("payments_inbox_partitions").await >= 1.0
        })
        .await,
        "payments started"
    );
    maintenance_behind(&pool).await;

    let mut early = events(1);
    early[0].msg_id = minted_ahead(Duration::from_secs(10 * 86_400));
    let early = early.remove(0);
    let valid = events(1).remove(0);
    let later = Event {
        msg_id: Uuid::now_v7(),
        order_id: early.order_id,
        amount_cents: 999,
    };
    const MALFORMED: usize = 2_000;
    let producer: FutureProducer = topic
        .client()
        .set("enable.idempotence", "true")
        .set("linger.ms", "20")
        .create()
        .expect("producer");
    let mut messages: Vec<(String, Vec<u8>)> = vec![(early.order_id.to_string(), envelope(&early))];
    for i in 0..MALFORMED {
        messages.push((
            format!("junk-{i}"),
            format!("not an event {i}").into_bytes(),
        ));
    }
    messages.push((valid.order_id.to_string(), envelope(&valid)));
    messages.push((later.order_id.to_string(), envelope(&later)));
    let sent = std::time::Instant::now();
    let deliveries: Vec<_> = messages
        .iter()
        .map(|(key, value)| {
            producer.send(
                FutureRecord::to(&topic.name).key(key).payload(value),
                Duration::from_secs(30),
            )
        })
        .collect();
    for d in futures::future::join_all(deliveries).await {
        d.expect("produce");
    }
    let charged = |msg_id: Uuid| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM payments.charges WHERE msg_id = $1")
                .bind(msg_id)
                .fetch_one(&pool)
                .await
                .expect("charged")
                == 1
        }
    };
    assert!(
        eventually(Duration::from_secs(30), || charged(valid.msg_id)).await,
        "the valid event behind the parked one is charged within seconds: {} charges, {} dead letters",
        count(&pool, CHARGES).await,
        count(&pool, "SELECT count(*) FROM payments.dead_letters").await
    );
    let charged_after = sent.elapsed();
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, "SELECT count(*) FROM payments.dead_letters").await == MALFORMED as i64
        })
        .await,
        "every malformed message dead-lettered"
    );
    let drained_after = sent.elapsed();
    assert!(
        eventually(Duration::from_secs(30), || async {
            committed_offset(&topic, group) == MALFORMED as i64 + 3
        })
        .await,
        "the offset moves past the parked event and everything after it"
    );
    println!(
        "valid event charged {charged_after:?} after the sequence was sent; \
         {MALFORMED} malformed dead-lettered after {drained_after:?}"
    );
    let parked: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT msg_id, \"offset\" FROM payments.parked ORDER BY seq")
            .fetch_all(&pool)
            .await
            .expect("parked");
    assert_eq!(
        parked,
        [(early.msg_id, 0), (later.msg_id, MALFORMED as i64 + 2)],
        "the early event parked, its order's later one behind it"
    );
    let order_charges: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payments.charges WHERE order_id = $1")
            .bind(early.order_id)
            .fetch_one(&pool)
            .await
            .expect("order charges");
    assert_eq!(
        order_charges, 0,
        "the later event did not overtake the parked one"
    );
    assert_eq!(consumer.metric("payments_parked_total").await, 2.0);
    assert!(
        eventually(Duration::from_secs(10), || async {
            consumer.metric("payments_parked_events").await == 2.0
        })
        .await,
        "the gauge shows them"
    );
    assert_eq!(consumer.metric("payments_held_partitions").await, 0.0);

    // The partitions reach it: the parked event is applied, then its order's
    // later event, which finds the order charged.
    maintenance_resumes(&pool, 11).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, "SELECT count(*) FROM payments.parked").await == 0
        })
        .await,
        "the parked events are applied once the inbox can record them"
    );
    let by: Uuid = sqlx::query_scalar("SELECT msg_id FROM payments.charges WHERE order_id = $1")
        .bind(early.order_id)
        .fetch_one(&pool)
        .await
        .expect("the order's charge");
    assert_eq!(
        by, early.msg_id,
        "the parked event charged its order, first"
    );
    let (kind, offset): (String, i64) =
        sqlx::query_as("SELECT kind, \"offset\" FROM payments.dead_letters WHERE msg_id = $1")
            .bind(later.msg_id)
            .fetch_one(&pool)
            .await
            .expect("the later event's dead letter");
    assert_eq!(
        (kind.as_str(), offset),
        ("order_conflict", MALFORMED as i64 + 2),
        "the later event applied after it"
    );
    assert_eq!(count(&pool, CHARGES).await, 2);
    assert_eq!(count(&pool, DOUBLES).await, 0);
    assert!(
        eventually(Duration::from_secs(10), || async {
            consumer.metric("payments_parked_applied_total").await == 2.0
        })
        .await,
        "both counted as applied from the park"
    );
    consumer.stop().await;
}

/// The resurrection that expiry must never allow, on purpose: an event is
/// charged, its partition expires, and the group is replayed from the start.
/// With `--unsafe-apply-after-horizon` the late duplicate is applied again
/// (a second ledger entry: a double charge; the charge row's own guard holds);
/// with the refusal on (the default) it is dead-lettered, naming its order
/// and msg_id, which are the order's charge's: a provable late duplicate.
#[tokio::test]
async fn a_late_duplicate_is_applied_twice_only_when_the_refusal_is_off() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // In the first partition (every msg_id minted before the migration),
    // which an expiry with retention 0 drops.
    let mut old = events(2);
    for e in &mut old {
        e.msg_id = minted_ago(Duration::from_secs(3600));
    }
    produce_events(&topic, &old).await;
    let first = spawn_payments(config(&db, &topic, "g-first")).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, LEDGER).await == 2
        })
        .await,
        "charged once, before expiry"
    );
    first.stop().await;
    let dropped: Vec<String> =
        sqlx::query_scalar("SELECT fx.partitioned_inbox_expire('payments', '0s')")
            .fetch_all(&pool)
            .await
            .expect("expire");
    assert_eq!(dropped, [FIRST_PARTITION]);

    // A new group reads the topic from the start: the same two events again.
    let mut unsafe_config = config(&db, &topic, "g-unsafe");
    unsafe_config.unsafe_apply_after_horizon = true;
    let replay = spawn_payments(unsafe_config).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, LEDGER).await == 4
        })
        .await,
        "the refusal off: both duplicates applied again"
    );
    assert_eq!(
        replay.metric("payments_applied_after_horizon_total").await,
        2.0
    );
    replay.stop().await;
    assert_eq!(
        count(&pool, CHARGES).await,
        2,
        "the charge rows' guard holds"
    );
    assert_eq!(
        count(&pool, INBOX).await,
        0,
        "no partition to record them in"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM payments.dead_letters").await,
        0
    );

    let refusing = spawn_payments(config(&db, &topic, "g-safe")).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, "SELECT count(*) FROM payments.dead_letters").await == 2
        })
        .await,
        "the refusal on: both dead-lettered"
    );
    refusing.stop().await;
    assert_eq!(count(&pool, LEDGER).await, 4, "nothing more applied");
    let late_duplicates = count(
        &pool,
        "SELECT count(*) FROM payments.dead_letters d JOIN payments.charges c \
         ON c.order_id = d.order_id AND c.msg_id = d.msg_id WHERE d.kind = 'after_horizon'",
    )
    .await;
    assert_eq!(
        late_duplicates, 2,
        "each names its order and the msg_id that charged it"
    );
}

/// The partitions tile one window without gaps; expiry drops only partitions
/// wholly older than the retention; and the database itself has no place for
/// an expired msg_id (no DEFAULT partition), so even a writer that skipped
/// the window check could not record it.
#[tokio::test]
async fn partitions_tile_the_window_and_an_expired_msg_id_has_no_place() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url_as(ServiceRole::Payments))
        .await
        .expect("connect as payments");
    let made = payments::expiry::extend(
        &pool,
        Duration::from_secs(3 * 86_400),
        Duration::from_secs(3600),
    )
    .await
    .expect("extend as the payments role");
    assert!(
        made >= 24,
        "hourly partitions for the third day ahead: {made}"
    );
    let bounds: Vec<(Uuid, Uuid)> =
        sqlx::query_as("SELECT lo, hi FROM fx.partitioned_inbox_parts ORDER BY lo")
            .fetch_all(&pool)
            .await
            .expect("bounds");
    assert_eq!(
        bounds[0].0,
        Uuid::nil(),
        "the first partition starts at the bottom"
    );
    for pair in bounds.windows(2) {
        assert_eq!(pair[0].1, pair[1].0, "no gap, no overlap");
    }
    let (n, floor, ceiling) = payments::expiry::partitions(&pool)
        .await
        .expect("partitions");
    assert_eq!(n as usize, bounds.len());
    assert_eq!(floor, Some(Uuid::nil()));
    assert_eq!(
        ceiling,
        bounds.last().map(|b| b.1),
        "the newest partition's end"
    );

    // The SQL and the Rust reading of a UUIDv7's time agree.
    let id = Uuid::now_v7();
    let sql_ms: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM effectively.v7_time($1))::float8 * 1000")
            .bind(id)
            .fetch_one(&pool)
            .await
            .expect("v7_time");
    assert_eq!(
        sql_ms.round() as i64,
        effectively::v7::mint_time(id).timestamp_millis()
    );

    let old = minted_ago(Duration::from_secs(2 * 3600));
    sqlx::query("INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) VALUES ('payments', $1, '')")
        .bind(old)
        .execute(&pool)
        .await
        .expect("before expiry the first partition takes it");
    let dropped = payments::expiry::expire(&pool, Duration::ZERO)
        .await
        .expect("expire as the payments role");
    assert_eq!(dropped, [FIRST_PARTITION]);
    let (_, floor, _) = payments::expiry::partitions(&pool)
        .await
        .expect("partitions");
    assert_eq!(floor, Some(bounds[1].0));
    let again = sqlx::query(
        "INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) VALUES ('payments', $1, '')",
    )
        .bind(old)
        .execute(&pool)
        .await;
    match again {
        Err(sqlx::Error::Database(e)) => {
            assert_eq!(e.code().as_deref(), Some("23514"), "{e}");
            assert!(e.message().contains("no partition"), "{e}");
        }
        other => panic!("an expired msg_id must have no partition: {other:?}"),
    }
    // The payments role cannot make or drop tables itself.
    let refused = sqlx::query("DROP TABLE fx.partitioned_inbox_parts")
        .execute(&pool)
        .await;
    assert!(refused.is_err());
}

/// A retention shorter than the redelivery horizon: the binary refuses to
/// start, with status 2 and the derivation; with the unsafe flag it runs.
#[tokio::test]
async fn a_retention_under_the_horizon_is_refused_at_start_up() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let binary = |retention: &str, unsafe_flag: bool| {
        let mut child = payments_process(&db, &topic, "g-horizon");
        child
            .env("PAYMENTS_INBOX_RETENTION", retention)
            .stderr(Stdio::piped());
        if unsafe_flag {
            child.env("PAYMENTS_UNSAFE_INBOX_RETENTION", "true");
        }
        child
    };
    let out = tokio::time::timeout(Duration::from_secs(60), binary("15d", false).output())
        .await
        .expect("exits in time")
        .expect("run payments");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("shorter than the redelivery horizon"),
        "{stderr}"
    );
    assert!(
        stderr.contains("= redelivery horizon"),
        "the derivation is printed: {stderr}"
    );

    produce_events(&topic, &events(1)).await;
    let mut child = binary("15d", true).spawn().expect("spawn");
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 1
        })
        .await,
        "with --unsafe-inbox-retention it runs"
    );
    child.kill().await.expect("kill");
}

/// Issue item 11 for payments: a topic with one replica loses, with its
/// broker, events the relay already marked published, which no one would
/// ever send again. Payments refuses it at start-up (status 2) naming the
/// replication factor, and runs on it with `--allow-under-replicated-topic`.
#[tokio::test]
async fn a_topic_with_one_replica_is_refused_at_start_up() {
    let db = TestDb::create().await;
    let topic = TestTopic::create_with(1, 1, &[("min.insync.replicas", "1")]).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let binary = |allow: &str| {
        let mut child = payments_process(&db, &topic, "g-replicas");
        child
            .env("KAFKA_ALLOW_UNDER_REPLICATED_TOPIC", allow)
            .stderr(Stdio::piped());
        child
    };
    let out = tokio::time::timeout(Duration::from_secs(60), binary("false").output())
        .await
        .expect("payments still runs on a topic with one replica after 60 s")
        .expect("run payments");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "payments refuses topic {}: replication factor is 1",
            topic.name
        )),
        "{stderr}"
    );

    produce_events(&topic, &events(1)).await;
    let mut child = binary("true").spawn().expect("spawn");
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 1
        })
        .await,
        "with --allow-under-replicated-topic it runs"
    );
    child.kill().await.expect("kill");
}
