//! Rows that cannot be published, and broker faults (a topic that does not
//! exist yet, an outage longer than the server's `wal_sender_timeout`): failed
//! publishes are retried in place or put back pending, never out of order.

use std::collections::HashSet;
use std::time::Duration;

use pipeline::db::ServiceRole;
use pipeline::outbox::{Outbox, OutboxMessage};
use pipeline::testing::{Service, TestDb, TestTopic, eventually};
use relay::Config;
use sqlx::PgPool;
use uuid::Uuid;

use super::{
    assert_each_event_once_in_order, assert_first_occurrences_in_order, config, drop_slot,
    fill_outbox, fill_outbox_seqs, insert_raw, pending, per_key_sequences, seq_event, spawn_relay,
    wait_for_slot, wal_config, walsender_pid,
};

/// Outbox rows that can never be published (payload not JSON, over the
/// broker's size limit) are tried `--max-attempts` times, then marked failed
/// with their error; they hold back the later events of their own key and
/// nothing else.
#[tokio::test]
async fn a_row_that_cannot_be_published_fails_alone_and_holds_back_only_its_key() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (not_json, too_big) = (Uuid::now_v7(), Uuid::now_v7());
    insert_raw(&pool, not_json, b"\xff{ not json").await;
    insert_raw(&pool, not_json, br#"{"seq":1}"#).await;
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    insert_raw(&pool, too_big, big.as_bytes()).await;
    insert_raw(&pool, too_big, br#"{"seq":1}"#).await;
    let keys: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &keys, 2).await;

    let mut cfg = config(&db, &topic, 1, 10);
    cfg.max_attempts = 3;
    let relay = spawn_relay(cfg).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 4
                && relay.metric("outbox_failed_rows").await == 2.0
                // A sample taken once the rest was published (the backlog
                // sampler runs apart from the batches).
                && relay.metric("outbox_pending_rows").await == 2.0
        })
        .await,
        "everything else published, the two bad rows failed (pending {})",
        pending(&pool).await
    );
    let rows: Vec<(Uuid, i32, Option<String>, bool)> = sqlx::query_as(
        "SELECT aggregate_id, attempts, last_error, failed_at IS NOT NULL \
         FROM orders.outbox WHERE published_at IS NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("rows");
    assert_eq!(rows.len(), 4);
    assert_eq!((rows[0].0, rows[0].1, rows[0].3), (not_json, 3, true));
    assert!(
        rows[0].2.as_deref().unwrap_or("").contains("not JSON"),
        "{:?}",
        rows[0].2
    );
    assert_eq!(
        (rows[1].0, rows[1].1, rows[1].3),
        (not_json, 0, false),
        "held back, never tried"
    );
    assert_eq!((rows[2].0, rows[2].1, rows[2].3), (too_big, 3, true));
    assert!(
        rows[2].2.as_deref().unwrap_or("").contains("too large"),
        "{:?}",
        rows[2].2
    );
    assert_eq!(
        (rows[3].0, rows[3].1, rows[3].3),
        (too_big, 0, false),
        "held back, never tried"
    );
    assert_eq!(relay.metric("relay_rows_failed_total").await, 2.0);

    let messages = topic.read_all(80, Duration::from_secs(30)).await;
    let (seqs, _) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 40, "only the good keys were published");
    assert_first_occurrences_in_order(&seqs, 2);
    relay.stop().await;
}

/// A topic that does not exist yet: the relay's sends to it fail until
/// [`create_topic_and_drain_without_a_restart`] creates it.
fn missing_topic() -> TestTopic {
    TestTopic {
        name: format!("test-{}", Uuid::new_v4().simple()),
        bootstrap_servers: pipeline::testing::stack_var("KAFKA_BOOTSTRAP_SERVERS"),
    }
}

/// Waits for the relay to fail a send.
async fn wait_for_a_failed_send(relay: &Service) {
    assert!(
        eventually(Duration::from_secs(30), || async {
            relay.metric(r#"relay_errors_total{stage="produce"}"#).await >= 1.0
        })
        .await,
        "the sends failed"
    );
}

/// Creates the [`missing_topic`] and waits until every row is published.
async fn create_topic_and_drain(pool: &PgPool, topic: &TestTopic) {
    pipeline::kafka::ensure_topic(
        &topic.client(),
        &topic.name,
        3,
        // The brokers' default replication (3): the relay checks the topic
        // again once it exists, and refuses one replica.
        -1,
        &pipeline::contract::order_events_topic_configs(),
    )
    .await
    .expect("create the topic");
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(pool).await == 0
        })
        .await,
        "every row published once the topic exists"
    );
}

/// [`create_topic_and_drain`], and checks that the WAL relay's stream never
/// restarted meanwhile.
async fn create_topic_and_drain_without_a_restart(
    pool: &PgPool,
    topic: &TestTopic,
    relay: &Service,
) {
    create_topic_and_drain(pool, topic).await;
    assert_eq!(
        relay.metric(r#"relay_errors_total{stage="wal"}"#).await,
        0.0,
        "the stream never restarted"
    );
}

/// A publish the broker fails (here: the topic does not exist yet, so each
/// send times out after `--message-timeout-ms`) is tried again in place: once
/// the topic is there every row goes out, in per-key order, and the stream
/// never restarted (a restart would send its whole unconfirmed window again).
#[tokio::test]
async fn a_failed_publish_is_retried_in_place_without_a_stream_restart() {
    let db = TestDb::create().await;
    let topic = missing_topic();
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let config = Config {
        message_timeout_ms: 1_000,
        ..wal_config(&db, &topic, 1, 10)
    };
    let relay = spawn_relay(config).await;
    wait_for_slot(&pool, &db, true).await;

    let keys: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    for seq in 0..3 {
        for key in &keys {
            insert_raw(&pool, *key, format!(r#"{{"seq":{seq}}}"#).as_bytes()).await;
        }
    }
    wait_for_a_failed_send(&relay).await;
    create_topic_and_drain_without_a_restart(&pool, &topic, &relay).await;
    let messages = topic.read_all(15, Duration::from_secs(30)).await;
    let (seqs, _) = per_key_sequences(&messages);
    for key in &keys {
        assert_eq!(
            seqs.get(&key.to_string()),
            Some(&vec![0, 1, 2]),
            "key {key}"
        );
    }
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// The WAL relay starts its stream only once the rows pending from before
/// its slot are published, however long that takes: here the topic does
/// not exist yet, so every send of the start-up drain fails. The drain used
/// to end at a round that delivered nothing, and the stream, started with
/// the older rows pending, published each key's later event (committed
/// after the slot) before them.
#[tokio::test]
async fn wal_mode_streams_only_once_the_rows_from_before_its_slot_are_published() {
    let db = TestDb::create().await;
    let topic = missing_topic();
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    fill_outbox_seqs(&pool, &keys, 0..2).await;
    let config = Config {
        message_timeout_ms: 1_000,
        ..wal_config(&db, &topic, 1, 10)
    };
    let relay = spawn_relay(config).await;
    // The drain sends: the slot is made, the rows from before it known.
    wait_for_a_failed_send(&relay).await;
    // Committed after the slot: the stream's.
    fill_outbox_seqs(&pool, &keys, 2..3).await;
    // A round sends each key's first row: more failed sends than keys, a
    // second round (or, before, the stream's sends).
    assert!(
        eventually(Duration::from_secs(60), || async {
            relay.metric(r#"relay_errors_total{stage="produce"}"#).await > keys.len() as f64
        })
        .await,
        "the sends failed again"
    );
    let active: Option<bool> =
        sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
            .bind(relay::wal::default_slot_name(&db.name))
            .fetch_optional(&pool)
            .await
            .expect("slot");
    assert_eq!(
        active,
        Some(false),
        "the slot is made, and the stream waits for the rows from before it"
    );
    assert_eq!(pending(&pool).await, 15);
    create_topic_and_drain(&pool, &topic).await;
    // The drain may take rows committed after the slot too, and the stream
    // sends them again: duplicates, never a key's later event first.
    let messages = topic.read_all(usize::MAX, Duration::from_secs(10)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), keys.len());
    assert_first_occurrences_in_order(&seqs, 3);
    assert_eq!(msg_ids.iter().collect::<HashSet<_>>().len(), 15);
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// The poll relay's claim marks the rows it takes; a row the broker did
/// not ack is put back before the batch commits. Here every send fails
/// (the topic does not exist yet, `--message-timeout-ms` 1 s): batches
/// commit, and every row stays pending. Once the topic is there, every row
/// goes out once, in per-key order.
#[tokio::test]
async fn rows_the_broker_did_not_ack_are_put_back_pending() {
    let db = TestDb::create().await;
    let topic = missing_topic();
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let config = Config {
        message_timeout_ms: 1_000,
        ..config(&db, &topic, 2, 10)
    };
    let relay = spawn_relay(config).await;
    let keys: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    for seq in 0..3 {
        for key in &keys {
            insert_raw(&pool, *key, format!(r#"{{"seq":{seq}}}"#).as_bytes()).await;
        }
    }
    // Only each key's first row is claimable: 5 sends fail a round. More
    // than 5 failed sends: a second round began, so a first batch
    // committed.
    assert!(
        eventually(Duration::from_secs(60), || async {
            relay.metric(r#"relay_errors_total{stage="produce"}"#).await > 5.0
        })
        .await,
        "the sends failed, twice"
    );
    assert_eq!(pending(&pool).await, 15, "no unacked row is left marked");
    assert_eq!(relay.metric("relay_published_total").await, 0.0);
    create_topic_and_drain(&pool, &topic).await;
    assert_each_event_once_in_order(&topic, 5, 3).await;
    relay.stop().await;
}

/// A broker failing for longer than the server's `wal_sender_timeout`
/// (2 s here, for the relay's role in the test's database) does not end the stream: while
/// its read-ahead is full, the WAL relay still tells the server where it
/// stands. Before, nothing answered the server then, the walsender gave
/// up, and the restart sent the unconfirmed window again (FINDINGS §22).
#[tokio::test]
async fn a_broker_outage_longer_than_the_senders_timeout_keeps_the_stream() {
    let db = TestDb::create().await;
    let topic = missing_topic();
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // The relay's sessions in this database only (the replication
    // connection ignores a URL's `options`).
    sqlx::query(&format!(
        "ALTER ROLE {} IN DATABASE {} SET wal_sender_timeout = '2s'",
        ServiceRole::Relay.name(),
        db.name
    ))
    .execute(&pool)
    .await
    .expect("set the relay's wal_sender_timeout");
    // 50 rows in flight, one per key.
    let config = Config {
        message_timeout_ms: 1_000,
        ..wal_config(&db, &topic, 1, 50)
    };
    let relay = spawn_relay(config).await;
    wait_for_slot(&pool, &db, true).await;
    let walsender = walsender_pid(&pool, &db).await;
    assert!(walsender.is_some(), "the relay streams");

    // More events than the read-ahead holds (4,096): 100 transactions of
    // one event for each of 50 keys, with no topic to send them to.
    let (keys, events_per_key) = (50, 100);
    let aggregates: Vec<Uuid> = (0..keys).map(|_| Uuid::now_v7()).collect();
    let mut conn = pool.acquire().await.expect("acquire");
    for seq in 0..events_per_key {
        let messages: Vec<OutboxMessage> =
            aggregates.iter().map(|key| seq_event(*key, seq)).collect();
        Outbox
            .enqueue_batch(&mut conn, &messages)
            .await
            .expect("enqueue");
    }
    drop(conn);
    wait_for_a_failed_send(&relay).await;
    // Three of the server's timeouts with the read-ahead full.
    tokio::time::sleep(Duration::from_secs(6)).await;
    create_topic_and_drain_without_a_restart(&pool, &topic, &relay).await;
    assert_eq!(
        walsender_pid(&pool, &db).await,
        walsender,
        "the same walsender streams"
    );
    assert_each_event_once_in_order(&topic, keys, events_per_key).await;
    relay.stop().await;
    drop_slot(&pool, &db).await;
}
