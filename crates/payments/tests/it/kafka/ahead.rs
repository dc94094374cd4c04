//! msg_ids ahead of the inbox's partitions: beyond the accepted clock skew
//! dead-lettered at once; within it parked, with only its order waiting.

use std::time::Duration;

use effectively::v7::minted_ahead;
use payments::horizon::Retention;
use pipeline::testing::{TestDb, TestTopic, eventually};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;
use uuid::Uuid;

use super::{
    CHARGES, DOUBLES, Event, LEDGER, committed_offset, config, count, envelope, events,
    produce_events, spawn_payments,
};

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
