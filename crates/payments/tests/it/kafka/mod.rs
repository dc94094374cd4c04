//! The Payments consumer against the real PostgreSQL and broker of `make up`:
//! a fresh database, topic and consumer group per test.

// Exactly-once apply: republishes, outbox-router replays, injected duplicates.
mod exactly_once;
// The consumer-lag metrics: what no commit covers, and its age.
mod lag;
// Malformed and refused messages: dead letters, and the partition moves on.
mod dead_letters;
// Crash points, restarts and SIGTERM; the split-transaction counter-example.
mod crashes;
// Group membership: rebalances, both protocols, static members fenced.
mod group;
// Expiry and the dedup horizon: late messages and late duplicates refused.
mod horizon;
// msg_ids ahead of the inbox's partitions: dead-lettered or parked.
mod ahead;
// Start-up refusals of the binary: retention, replication factor.
mod startup;

use std::process::Stdio;
use std::time::Duration;

use payments::dup::DupArgs;
use payments::horizon::Retention;
use payments::receiver::WebhookArgs;
use payments::{Config, GroupProtocol, Transport, run};
use pipeline::config::DbArgs;
use pipeline::crash::CrashArgs;
use pipeline::db::ServiceRole;
use pipeline::envelope::Envelope;
use pipeline::testing::{Service, TestDb, TestTopic};
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
const INBOX: &str = "SELECT count(*) FROM fx.partitioned_inbox WHERE consumer = 'payments'";
const DOUBLES: &str =
    "SELECT count(*) FROM (SELECT order_id FROM payments.ledger GROUP BY 1 HAVING count(*) > 1) d";

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
