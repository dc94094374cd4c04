//! The relay against the real PostgreSQL and broker of `make up`: a fresh
//! database and topic per test. The helpers the tests share are here, the
//! tests in a module per concern.

mod crash;
mod database;
mod failures;
mod notify;
mod order;
mod topic;
mod wal;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use pipeline::config::DbArgs;
use pipeline::crash::CrashArgs;
use pipeline::db::ServiceRole;
use pipeline::envelope::Envelope;
use pipeline::outbox::{Outbox, OutboxMessage};
use pipeline::testing::{Service, TestDb, TestTopic, TopicMessage, eventually};
use relay::{Config, Mode, Sink, run};
use sqlx::PgPool;
use uuid::Uuid;

fn config(db: &TestDb, topic: &TestTopic, workers: u16, batch_size: i64) -> Config {
    let db_args = DbArgs::for_url(db.url_as(ServiceRole::Relay));
    Config {
        command: None,
        db: db_args,
        runtime: pipeline::config::RuntimeArgs { worker_threads: 0 },
        kafka: topic.kafka_args(),
        crash: CrashArgs::default(),
        batch_size,
        workers,
        shard_groups: 2,
        shard_depth: 1,
        poll_interval_ms: 200,
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
        sink: Sink::Kafka,
        webhook_destination: Vec::new(),
        webhook_allow_addresses: Vec::new(),
        webhook_schedule_scale: 1.0,
        webhook_secrets: Default::default(),
    }
}

/// The relay on `config`, in this process.
async fn spawn_relay(config: Config) -> Service {
    Service::spawn("relay", |metrics, cancel| run(config, metrics, cancel)).await
}

/// [`config`] for `--mode wal`, with heartbeats every 200 ms.
fn wal_config(db: &TestDb, topic: &TestTopic, workers: u16, batch_size: i64) -> Config {
    Config {
        mode: Mode::Wal,
        wal_heartbeat_ms: 200,
        ..config(db, topic, workers, batch_size)
    }
}

/// A test event of `aggregate_id` whose payload carries `seq` (read back by
/// [`per_key_sequences`]).
fn seq_event(aggregate_id: Uuid, seq: usize) -> OutboxMessage {
    OutboxMessage {
        aggregate_id,
        msg_id: Uuid::now_v7(),
        event_type: "test.event".into(),
        payload: format!(r#"{{"seq":{seq}}}"#).into_bytes(),
    }
}

/// Appends `events_per_key` events for each of `keys` aggregates, one
/// transaction per event, interleaving the keys; event payloads carry `seq`.
async fn fill_outbox(pool: &PgPool, keys: &[Uuid], events_per_key: usize) {
    fill_outbox_seqs(pool, keys, 0..events_per_key).await;
}

/// As [`fill_outbox`], the events numbered `seqs`.
async fn fill_outbox_seqs(pool: &PgPool, keys: &[Uuid], seqs: std::ops::Range<usize>) {
    let outbox = Outbox;
    for seq in seqs {
        for key in keys {
            let mut tx = pool.begin().await.expect("begin");
            outbox
                .enqueue_batch(&mut tx, &[seq_event(*key, seq)])
                .await
                .expect("enqueue");
            tx.commit().await.expect("commit");
        }
    }
}

async fn pending(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders.outbox WHERE published_at IS NULL")
        .fetch_one(pool)
        .await
        .expect("pending")
}

/// Decodes the topic: per key, the seq values in topic order, and every msg_id seen.
fn per_key_sequences(messages: &[TopicMessage]) -> (HashMap<String, Vec<i64>>, Vec<Uuid>) {
    let mut seqs: HashMap<String, Vec<i64>> = HashMap::new();
    let mut msg_ids = Vec::new();
    for TopicMessage { key, value, .. } in messages {
        let key = String::from_utf8(key.clone().expect("key")).expect("utf8 key");
        let env = Envelope::decode(value.as_deref().expect("value")).expect("envelope");
        assert_eq!(
            env.aggregate_id.to_string(),
            key,
            "the message key is the aggregate id"
        );
        let payload: serde_json::Value = serde_json::from_str(env.payload.get()).expect("payload");
        seqs.entry(key)
            .or_default()
            .push(payload["seq"].as_i64().expect("seq"));
        msg_ids.push(env.msg_id);
    }
    (seqs, msg_ids)
}

/// Per key, the first occurrence of each seq must come in increasing order;
/// a later duplicate (a re-publish) is allowed, a reordering is not.
fn assert_first_occurrences_in_order(seqs: &HashMap<String, Vec<i64>>, events_per_key: usize) {
    for (key, seq) in seqs {
        let mut seen = HashSet::new();
        let firsts: Vec<i64> = seq.iter().copied().filter(|s| seen.insert(*s)).collect();
        let expected: Vec<i64> = (0..events_per_key as i64).collect();
        assert_eq!(
            firsts, expected,
            "key {key}: events out of order or missing: {seq:?}"
        );
    }
}

/// Reads the topic and asserts each of `keys` × `events_per_key` events
/// arrived exactly once, every key's in outbox order. Reads one more than
/// was written, so a duplicate would show.
async fn assert_each_event_once_in_order(topic: &TestTopic, keys: usize, events_per_key: usize) {
    let written = keys * events_per_key;
    let messages = topic.read_all(written + 1, Duration::from_secs(20)).await;
    assert_eq!(
        messages.len(),
        written,
        "each event once: no crash, no re-publish"
    );
    let (seqs, _) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), keys);
    let expected: Vec<i64> = (0..events_per_key as i64).collect();
    for (key, seq) in &seqs {
        assert_eq!(seq, &expected, "key {key} in outbox order");
    }
}

/// Waits (up to 30 s) until the test database's WAL relay slot exists and
/// is streaming (`active`), or is idle.
async fn wait_for_slot(pool: &PgPool, db: &TestDb, active: bool) {
    let slot = relay::wal::default_slot_name(&db.name);
    assert!(
        eventually(Duration::from_secs(30), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&slot)
            .fetch_optional(pool)
            .await
            .expect("slot")
                == Some(active)
        })
        .await,
        "slot {slot} active = {active} within 30 s"
    );
}

/// Drops the test database's WAL relay slot once its relay has let go (a
/// slot left behind would hold the server's WAL).
async fn drop_slot(pool: &PgPool, db: &TestDb) {
    wait_for_slot(pool, db, false).await;
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(relay::wal::default_slot_name(&db.name))
        .execute(pool)
        .await
        .expect("drop slot");
}

async fn insert_raw(pool: &PgPool, aggregate: Uuid, payload: &[u8]) -> Uuid {
    let msg_id = Uuid::now_v7();
    let mut conn = pool.acquire().await.expect("acquire");
    Outbox
        .enqueue_batch(
            &mut conn,
            &[OutboxMessage {
                aggregate_id: aggregate,
                msg_id,
                event_type: "test.event".into(),
                payload: payload.to_vec(),
            }],
        )
        .await
        .expect("enqueue");
    msg_id
}

/// The PID of the walsender streaming the test database's slot, if any.
async fn walsender_pid(pool: &PgPool, db: &TestDb) -> Option<i32> {
    sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
        .bind(relay::wal::default_slot_name(&db.name))
        .fetch_optional(pool)
        .await
        .expect("slot")
        .flatten()
}
