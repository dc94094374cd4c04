//! Each event applied exactly once: a relay's republish, Debezium outbox-router
//! records and their replays, and injected duplicates of both kinds.

use std::time::Duration;

use payments::dup::{DupArgs, DupKind};
use pipeline::testing::{TestDb, TestTopic, eventually};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;
use uuid::Uuid;

use super::{
    CHARGES, DOUBLES, Event, INBOX, LEDGER, config, count, events, produce_events, producer,
    spawn_payments,
};

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
