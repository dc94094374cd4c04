//! `--mode wal`: the start-up drain and the stream, a failed predecessor holding
//! back its key, the standby, the gap probe, and the slot's confirmed position.

use std::collections::HashSet;
use std::time::Duration;

use pipeline::outbox::{Outbox, OutboxMessage};
use pipeline::testing::{KafkaPrincipal, TestDb, TestTopic, eventually};
use relay::Config;
use sqlx::PgPool;
use uuid::Uuid;

use super::{
    assert_each_event_once_in_order, assert_first_occurrences_in_order, config, drop_slot,
    fill_outbox_seqs, insert_raw, pending, per_key_sequences, seq_event, spawn_relay,
    wait_for_slot, wal_config, walsender_pid,
};

/// The WAL relay holds back a key's next event when the one before it fails,
/// even when the next one arrives while the failing one is still in flight:
/// it must wait for the predecessor's outcome and only then decide (it used
/// to look at the failed keys first and then wait, and published the next
/// event of a key whose predecessor had just failed). The failing rows are
/// refused by the broker (over the topic's max.message.bytes, so the
/// refusal takes a round trip), fifty keys of them each followed by a good
/// row, in one transaction.
#[tokio::test]
async fn wal_mode_never_publishes_an_event_after_its_keys_predecessor_failed() {
    let db = TestDb::create().await;
    let bootstrap_servers = pipeline::testing::stack_var("KAFKA_BOOTSTRAP_SERVERS");
    let name = format!("test-{}", Uuid::new_v4().simple());
    let mut configs = pipeline::contract::order_events_topic_configs().to_vec();
    configs.push(("max.message.bytes", "4096".into()));
    pipeline::kafka::ensure_topic(&KafkaPrincipal::Admin.client(), &name, 3, -1, &configs)
        .await
        .expect("create the topic");
    let topic = TestTopic {
        name,
        bootstrap_servers,
    };
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let relay = spawn_relay(wal_config(&db, &topic, 2, 10)).await;
    wait_for_slot(&pool, &db, true).await;
    let keys: Vec<Uuid> = (0..50).map(|_| Uuid::now_v7()).collect();
    // Random hex does not compress below the topic's limit.
    let blob = || -> String {
        (0..2_000)
            .map(|_| Uuid::new_v4().simple().to_string())
            .collect()
    };
    let messages: Vec<OutboxMessage> = keys
        .iter()
        .flat_map(|&key| {
            [
                OutboxMessage {
                    aggregate_id: key,
                    msg_id: Uuid::now_v7(),
                    event_type: "test.event".into(),
                    payload: format!(r#"{{"blob":"{}"}}"#, blob()).into_bytes(),
                },
                seq_event(key, 1),
            ]
        })
        .collect();
    let mut conn = pool.acquire().await.expect("acquire");
    Outbox
        .enqueue_batch(&mut conn, &messages)
        .await
        .expect("enqueue");
    assert!(
        eventually(Duration::from_secs(90), || async {
            relay.metric("outbox_failed_rows").await >= 50.0
        })
        .await,
        "the fifty rows over the limit failed: {} failed, {} pending",
        relay.metric("outbox_failed_rows").await,
        pending(&pool).await
    );
    assert_eq!(
        relay.metric("outbox_failed_rows").await,
        50.0,
        "only they failed"
    );
    let published = topic.read_all(1, Duration::from_secs(5)).await;
    assert!(
        published.is_empty(),
        "no event of a key whose predecessor failed was published: {} were",
        published.len()
    );
    assert_eq!(
        pending(&pool).await,
        100,
        "50 failed and 50 held back, none published"
    );
    relay.stop().await;
}

/// `--mode wal`: rows committed before the slot existed are published by
/// the start-up drain, rows committed after it from the stream; every key in
/// order, every row marked. A row that cannot be published is marked failed
/// at once and holds back the later events of its key only. The slot's
/// confirmed position moves past the last commit (heartbeats).
#[tokio::test]
async fn wal_mode_publishes_from_before_and_after_its_slot_in_per_key_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    fill_outbox_seqs(&pool, &keys, 0..2).await;

    let relay = spawn_relay(wal_config(&db, &topic, 2, 10)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "the rows from before the slot drained"
    );
    wait_for_slot(&pool, &db, true).await;

    // From the stream: two more events of every key, and two keys whose
    // first event cannot be published.
    let (not_json, too_big) = (Uuid::now_v7(), Uuid::now_v7());
    insert_raw(&pool, not_json, b"\xff{ not json").await;
    insert_raw(&pool, not_json, br#"{"seq":1}"#).await;
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    insert_raw(&pool, too_big, big.as_bytes()).await;
    insert_raw(&pool, too_big, br#"{"seq":1}"#).await;
    fill_outbox_seqs(&pool, &keys, 2..4).await;
    let last: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .expect("lsn");
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 4 && relay.metric("outbox_failed_rows").await == 2.0
        })
        .await,
        "everything else published, the two bad rows failed, the next of their keys held back (pending {})",
        pending(&pool).await
    );
    let rows: Vec<(Uuid, bool, Option<String>)> = sqlx::query_as(
        "SELECT aggregate_id, failed_at IS NOT NULL, last_error \
         FROM orders.outbox WHERE published_at IS NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("rows");
    let shape: Vec<(Uuid, bool)> = rows.iter().map(|r| (r.0, r.1)).collect();
    assert_eq!(
        shape,
        [
            (not_json, true),
            (not_json, false),
            (too_big, true),
            (too_big, false)
        ],
        "each bad row failed, the next event of its key held back: {rows:?}"
    );
    assert!(rows[0].2.as_deref().unwrap_or("").contains("not JSON"));
    assert!(rows[2].2.as_deref().unwrap_or("").contains("too large"));
    assert_eq!(relay.metric("relay_wal_held_back_total").await, 2.0);
    assert_eq!(relay.metric("relay_rows_failed_total").await, 2.0);

    let messages = topic.read_all(80, Duration::from_secs(30)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 20, "only the good keys were published");
    assert_first_occurrences_in_order(&seqs, 4);
    let distinct: HashSet<Uuid> = msg_ids.iter().copied().collect();
    assert_eq!(distinct.len(), 80, "every event of the good keys");

    // A heartbeat after the last commit lets the slot confirm past it; a
    // clean stop sends the last confirmation.
    tokio::time::sleep(Duration::from_secs(1)).await;
    relay.stop().await;
    // The last confirmation is sent as the stream stops, unanswered: the
    // slot shows it once its walsender has let go.
    wait_for_slot(&pool, &db, false).await;
    let confirmed: bool = sqlx::query_scalar(
        "SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = $2",
    )
    .bind(&last)
    .bind(relay::wal::default_slot_name(&db.name))
    .fetch_one(&pool)
    .await
    .expect("slot");
    assert!(confirmed, "the slot confirmed past {last}");
    drop_slot(&pool, &db).await;
}

/// The slot was there before the relay (a restart): the rows committed
/// while it was away are pending in the table and in the stream alike. The
/// start-up drain publishes them, and the stream, reading them again,
/// leaves them (it used to publish every one of them a second time): each
/// event is on the topic once, and what the stream carries after them
/// goes out as before.
#[tokio::test]
async fn rows_the_drain_published_are_not_published_again_by_the_stream() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    let first = spawn_relay(wal_config(&db, &topic, 2, 10)).await;
    wait_for_slot(&pool, &db, true).await;
    first.stop().await;
    wait_for_slot(&pool, &db, false).await;

    fill_outbox_seqs(&pool, &keys, 0..3).await;
    let relay = spawn_relay(wal_config(&db, &topic, 2, 10)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "the rows committed while the relay was away drained"
    );
    wait_for_slot(&pool, &db, true).await;
    fill_outbox_seqs(&pool, &keys, 3..5).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
                && relay.metric("relay_wal_drained_skipped_total").await >= 60.0
        })
        .await,
        "the stream's rows published, the drained ones left (pending {}, left {})",
        pending(&pool).await,
        relay.metric("relay_wal_drained_skipped_total").await
    );
    assert_eq!(
        relay.metric("relay_wal_drained_skipped_total").await,
        60.0,
        "the stream left the drain's 60 rows and no other"
    );
    let messages = topic.read_all(usize::MAX, Duration::from_secs(10)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 20);
    assert_first_occurrences_in_order(&seqs, 5);
    assert_eq!(
        msg_ids.iter().collect::<HashSet<_>>().len(),
        100,
        "every event published"
    );
    assert_eq!(messages.len(), 100, "each of them once");
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// Under load the stream's rows go through the busy producer (here from 50
/// rows a second), and back through the relay's once it is quiet; a key's
/// events switch producers between them and stay in order, each published.
#[tokio::test]
async fn a_busy_stream_switches_producers_and_every_key_stays_in_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    let relay = spawn_relay(Config {
        busy_linger_ms: 20,
        busy_rows_per_sec: 50,
        ..wal_config(&db, &topic, 2, 10)
    })
    .await;
    wait_for_slot(&pool, &db, true).await;
    fill_outbox_seqs(&pool, &keys, 0..40).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "every row published (pending {})",
        pending(&pool).await
    );
    let busy = relay.metric("relay_wal_busy_rows_total").await;
    assert!(
        busy > 0.0 && busy < 800.0,
        "the busy producer took the rows after the first second, not all: {busy}"
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            relay.metric("relay_wal_busy").await == 0.0
        })
        .await,
        "quiet: back to the relay's producer"
    );
    fill_outbox_seqs(&pool, &keys, 40..41).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            pending(&pool).await == 0
        })
        .await
    );
    assert_eq!(
        relay.metric("relay_wal_busy_rows_total").await,
        busy,
        "the rows after the quiet went through the relay's producer"
    );
    assert_each_event_once_in_order(&topic, 20, 41).await;
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// Two WAL relays and a poll relay at once: the second WAL relay stands by
/// (the slot is exclusive), the poll relay's claims and the stream race
/// (duplicates, never out of order). Then the first WAL relay and the poll
/// relay stop, and the standby takes the slot over and publishes the rest.
#[tokio::test]
async fn a_standby_wal_relay_takes_over_and_every_key_stays_in_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..30).map(|_| Uuid::now_v7()).collect();
    let r1 = spawn_relay(wal_config(&db, &topic, 2, 7)).await;
    wait_for_slot(&pool, &db, true).await;
    let r2 = spawn_relay(wal_config(&db, &topic, 3, 5)).await;
    let r3 = spawn_relay(config(&db, &topic, 2, 5)).await;
    fill_outbox_seqs(&pool, &keys, 0..4).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await
    );
    r1.stop().await;
    r3.stop().await;
    fill_outbox_seqs(&pool, &keys, 4..8).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "the standby took the slot over"
    );
    let messages = topic.read_all(usize::MAX, Duration::from_secs(10)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 30);
    assert_first_occurrences_in_order(&seqs, 8);
    assert_eq!(
        msg_ids.iter().collect::<HashSet<_>>().len(),
        240,
        "every event published"
    );
    r2.stop().await;
    drop_slot(&pool, &db).await;
}

/// A committed row the stream never delivers (here: written while the
/// publication left inserts out) is found by the relay's comparison of the
/// table with the stream, and the stream's restart publishes it.
#[tokio::test]
async fn a_row_the_stream_never_delivered_is_found_and_published() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let relay = spawn_relay(wal_config(&db, &topic, 2, 10)).await;
    wait_for_slot(&pool, &db, true).await;

    let key = Uuid::now_v7();
    sqlx::query("ALTER PUBLICATION effectively_outbox SET (publish = 'delete')")
        .execute(&pool)
        .await
        .expect("publication without inserts");
    insert_raw(&pool, key, br#"{"seq":0}"#).await;
    sqlx::query("ALTER PUBLICATION effectively_outbox SET (publish = 'insert')")
        .execute(&pool)
        .await
        .expect("publication with inserts");
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "the row the stream skipped was published"
    );
    assert!(relay.metric("relay_wal_stream_gaps_total").await >= 1.0);
    let messages = topic.read_all(1, Duration::from_secs(30)).await;
    let (seqs, _) = per_key_sequences(&messages);
    assert_eq!(seqs.get(&key.to_string()), Some(&vec![0]));
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// A transaction open for longer than the gap check's period, with many
/// rows: its rows were written (`created_at`, the transaction's start) long
/// before the commits around them, and stay in flight for a while after its
/// own. The check compares positions, not times: it takes none of them for
/// rows the stream missed (the time-based check did, and restarted the
/// stream, which sent the window again).
#[tokio::test]
async fn a_long_transaction_is_not_taken_for_a_gap() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // 500 rows in flight: with 10 (one worker, batches of 10) each row
    // waits for its acks (acks=all, three replicas) in turn, and the 20,000
    // took 60 s alone and over 120 s on a busy machine.
    let relay = spawn_relay(wal_config(&db, &topic, 1, 500)).await;
    wait_for_slot(&pool, &db, true).await;

    const ROWS: usize = 20_000;
    let mut tx = pool.begin().await.expect("begin");
    let messages: Vec<OutboxMessage> = (0..ROWS).map(|i| seq_event(Uuid::now_v7(), i)).collect();
    Outbox
        .enqueue_batch(&mut tx, &messages)
        .await
        .expect("enqueue");
    // Heartbeats commit meanwhile: the stream reads commits 12 s younger
    // than these rows.
    tokio::time::sleep(Duration::from_secs(12)).await;
    tx.commit().await.expect("commit");
    assert!(
        eventually(Duration::from_secs(120), || async {
            pending(&pool).await == 0
        })
        .await,
        "every row published"
    );
    // Two more checks' periods with nothing pending.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(relay.metric("relay_wal_stream_gaps_total").await, 0.0);
    assert_eq!(
        relay.metric(r#"relay_errors_total{stage="wal"}"#).await,
        0.0,
        "the stream never restarted"
    );
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// A row the stream delivered that the relay's marks cannot see (a commit
/// decoded but not yet visible: a synchronous standby that does not answer
/// holds a committing backend after its commit record is flushed, and a
/// logical walsender does not wait for it) ends the stream after the
/// visibility wait, and nothing past it is confirmed: the stream reads it
/// again, and once it is visible marks it itself. The last mark of the
/// stream whose wait failed used to confirm past it all the same (the rows
/// waited for were dropped), so it was left pending behind the slot.
///
/// Row-level security stands in for the invisible commit: a policy on this
/// test's database hides the row from the relay's role, and lifting it
/// (a delete, no lock on the outbox) makes it visible. A synchronous
/// standby name would hold every commit of the shared server's other
/// databases, and only a server-wide setting makes one.
#[tokio::test]
async fn a_row_the_marks_cannot_see_is_never_confirmed_past() {
    a_row_the_relay_cannot_mark_is_never_confirmed_past(Hidden::FromEveryStatement).await;
}

/// A mark whose `UPDATE` changed fewer rows than it meant to (here a row the
/// relay's role sees but may not update) confirms nothing past them either:
/// the relay checks what its mark left pending, and the stream reads it
/// again. The mark's row count used to go unread, and the slot was
/// confirmed past the row it left pending.
#[tokio::test]
async fn a_row_a_mark_did_not_change_is_never_confirmed_past() {
    a_row_the_relay_cannot_mark_is_never_confirmed_past(Hidden::FromUpdates).await;
}

/// What the policy of [`a_row_the_relay_cannot_mark_is_never_confirmed_past`]
/// hides a row from.
enum Hidden {
    /// Every statement of the relay: the row is not there for it.
    FromEveryStatement,
    /// The relay's `UPDATE`s: its marks leave the row pending.
    FromUpdates,
}

/// A row of `public.invisible_to_the_relay` is hidden from the relay's role
/// as `hidden` says until it is deleted from there: the slot is never
/// confirmed past it meanwhile, and then the relay marks it.
async fn a_row_the_relay_cannot_mark_is_never_confirmed_past(hidden: Hidden) {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    const NOT_HIDDEN: &str =
        "NOT EXISTS (SELECT 1 FROM public.invisible_to_the_relay h WHERE h.id = outbox.id)";
    let policies = match hidden {
        Hidden::FromEveryStatement => vec![format!(
            "CREATE POLICY the_relay_sees ON orders.outbox TO effectively_relay USING ({NOT_HIDDEN})"
        )],
        Hidden::FromUpdates => vec![
            "CREATE POLICY the_relay_reads ON orders.outbox FOR SELECT TO effectively_relay \
             USING (true)"
                .to_owned(),
            format!(
                "CREATE POLICY the_relay_marks ON orders.outbox FOR UPDATE TO effectively_relay \
                 USING ({NOT_HIDDEN})"
            ),
        ],
    };
    let setup = [
        "CREATE TABLE public.invisible_to_the_relay (id int8 PRIMARY KEY)".to_owned(),
        "GRANT SELECT ON public.invisible_to_the_relay TO effectively_relay".to_owned(),
        "ALTER TABLE orders.outbox ENABLE ROW LEVEL SECURITY".to_owned(),
    ];
    for sql in setup.iter().chain(&policies) {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    // No heartbeats: the stream's only commits are this test's, so the
    // slot's position says which of them the relay confirmed.
    let config = Config {
        wal_heartbeat_ms: 3_600_000,
        ..wal_config(&db, &topic, 1, 10)
    };
    let relay = spawn_relay(config).await;
    wait_for_slot(&pool, &db, true).await;
    let first_stream = walsender_pid(&pool, &db).await;
    let (seen, unseen) = (Uuid::now_v7(), Uuid::now_v7());
    insert_raw(&pool, seen, br#"{"seq":0}"#).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            pending(&pool).await == 0
        })
        .await,
        "a visible row is published and marked"
    );

    let before: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&pool)
        .await
        .expect("lsn");
    let mut tx = pool.begin().await.expect("begin");
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
         VALUES ($1, $2, 'test.event', '{\"seq\":0}') RETURNING id",
    )
    .bind(unseen)
    .bind(Uuid::now_v7())
    .fetch_one(&mut *tx)
    .await
    .expect("insert");
    sqlx::query("INSERT INTO public.invisible_to_the_relay (id) VALUES ($1)")
        .bind(id)
        .execute(&mut *tx)
        .await
        .expect("hide");
    tx.commit().await.expect("commit");

    // The mark fails (an invisible row after waiting 10 s for it), the
    // stream ends, and its walsender lets go of the slot with the last
    // confirmation.
    assert!(
        eventually(Duration::from_secs(60), || async {
            relay.metric(r#"relay_errors_total{stage="wal"}"#).await >= 1.0
        })
        .await,
        "the stream ended: its mark could not see the row"
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            walsender_pid(&pool, &db).await != first_stream
        })
        .await,
        "the first stream let go of the slot"
    );
    let (confirmed, past): (String, bool) = sqlx::query_as(
        "SELECT confirmed_flush_lsn::text, confirmed_flush_lsn > $1::pg_lsn \
         FROM pg_replication_slots WHERE slot_name = $2",
    )
    .bind(&before)
    .bind(relay::wal::default_slot_name(&db.name))
    .fetch_one(&pool)
    .await
    .expect("slot");
    assert!(
        !past,
        "the slot confirmed {confirmed}, past the commit of row {id} (after {before}), \
         which the relay could not mark"
    );
    assert_eq!(pending(&pool).await, 1, "the row is pending");

    sqlx::query("DELETE FROM public.invisible_to_the_relay")
        .execute(&pool)
        .await
        .expect("show the row");
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "once visible, the row is marked"
    );
    assert_eq!(
        relay.metric("relay_wal_stream_gaps_total").await,
        0.0,
        "the relay marked the row again (the stream read it again, or the drain of a \
         restart took it): it was never left behind the slot"
    );
    let messages = topic.read_all(usize::MAX, Duration::from_secs(10)).await;
    let (seqs, _) = per_key_sequences(&messages);
    assert_eq!(seqs.get(&seen.to_string()), Some(&vec![0]));
    assert!(
        seqs.get(&unseen.to_string())
            .is_some_and(|s| !s.is_empty() && s.iter().all(|&q| q == 0)),
        "the row is published (once per stream that read it): {seqs:?}"
    );
    relay.stop().await;
    drop_slot(&pool, &db).await;
}
