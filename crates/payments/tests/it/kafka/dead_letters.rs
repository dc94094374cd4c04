//! Bad input: malformed messages, and messages the database refuses, are
//! dead-lettered with a readable reason and the partition moves on.

use std::time::Duration;

use pipeline::testing::{TestDb, TestTopic, eventually};
use rdkafka::producer::FutureRecord;
use sqlx::PgPool;
use uuid::Uuid;

use super::{
    CHARGES, DOUBLES, INBOX, config, count, envelope, events, produce, produce_events, producer,
    spawn_payments,
};

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
