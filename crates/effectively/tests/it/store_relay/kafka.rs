//! The relay through `KafkaSink` to the real broker: each row to its topic
//! with its key and headers, a key stopped at a refused row, a missing topic.

use std::collections::HashMap;
use std::time::Duration;

use effectively::store::{Effectively, Event, KafkaSink, Relay};
use pipeline::testing::TestTopic;

use super::{ascending, pending, store};

/// A relay of `fx` through a `KafkaSink` to `topic`'s brokers, with one
/// producer setting of the test's.
fn kafka_relay(fx: &Effectively, topic: &TestTopic, setting: (&str, &str)) -> Relay<KafkaSink> {
    let mut config = topic.client();
    config.set(setting.0, setting.1);
    Relay::new(fx, KafkaSink::new(&config).expect("a producer"))
}

#[tokio::test]
async fn kafka_sink_produces_each_row_to_its_topic_with_its_key_and_headers() {
    let (_db, pool, fx) = store().await;
    let topic = TestTopic::create(3).await;
    let mut events = Vec::new();
    for n in 0..30i64 {
        events.push(
            Event::json(&topic.name, &format!("cart-{}", n % 4), "cart.updated", &n)
                .expect("a valid event")
                .with_header("traceparent", &format!("00-{n:032x}-{n:016x}-01"))
                .expect("a valid header"),
        );
    }
    // One row too large for the producer's limit: refused for itself.
    let big = Event::bytes(
        &topic.name,
        "cart-big",
        "cart.updated",
        "application/octet-stream",
        vec![7; 200_000],
    )
    .expect("a valid event");
    fx.outbox()
        .enqueue_batch(&pool, &events)
        .await
        .expect("enqueue");
    fx.outbox().enqueue(&pool, &big).await.expect("enqueue");

    let relay = kafka_relay(&fx, &topic, ("message.max.bytes", "100000"));
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed), (30, 1));

    let got = topic.read_all(30, Duration::from_secs(30)).await;
    assert_eq!(got.len(), 30);
    let mut by_key: HashMap<Vec<u8>, Vec<i64>> = HashMap::new();
    let sent: HashMap<String, &Event> =
        events.iter().map(|e| (e.msg_id().to_string(), e)).collect();
    for m in &got {
        let header = |name: &str| {
            m.headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| String::from_utf8(v.clone()).expect("utf-8"))
        };
        let msg_id = header("msg_id").expect("msg_id header");
        let event = sent[&msg_id];
        let n: i64 = serde_json::from_slice(m.value.as_deref().expect("a value")).expect("json");
        assert_eq!(m.key.as_deref(), Some(event.key().as_bytes()));
        assert_eq!(header("event_type").as_deref(), Some("cart.updated"));
        assert_eq!(header("content-type").as_deref(), Some("application/json"));
        assert_eq!(
            header("traceparent"),
            Some(format!("00-{n:032x}-{n:016x}-01"))
        );
        by_key
            .entry(m.key.clone().expect("a key"))
            .or_default()
            .push(n);
    }
    for (key, ns) in &by_key {
        assert!(ascending(ns), "{}: {ns:?}", String::from_utf8_lossy(key));
    }
    let error: String =
        sqlx::query_scalar("SELECT error FROM shop_fx.outbox WHERE key = 'cart-big'")
            .fetch_one(&pool)
            .await
            .expect("the refused row");
    assert!(error.contains("200000 bytes"), "{error}");
}

/// The Kafka sink has a key's rows in flight together: a row the producer
/// refuses (too large) stops its key there, so the rows before it are on the
/// topic in order, it is failed, and the rows after it wait, unsent.
#[tokio::test]
async fn kafka_sink_stops_a_key_at_a_refused_row_and_sends_none_after_it() {
    let (_db, pool, fx) = store().await;
    let topic = TestTopic::create(1).await;
    let event = |n: usize| {
        let size = if n == 3 { 200_000 } else { 10 };
        Event::bytes(
            &topic.name,
            "cart-1",
            "cart.updated",
            "application/octet-stream",
            vec![u8::try_from(n).expect("a small n"); size],
        )
        .expect("a valid event")
    };
    let events: Vec<Event> = (0..8).map(event).collect();
    fx.outbox()
        .enqueue_batch(&pool, &events)
        .await
        .expect("enqueue");
    let relay = kafka_relay(&fx, &topic, ("message.max.bytes", "100000"));
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed, pass.retried), (3, 1, 4));
    let got = topic.read_all(3, Duration::from_secs(30)).await;
    let firsts: Vec<u8> = got
        .iter()
        .map(|m| {
            m.value
                .as_deref()
                .and_then(|v| v.first().copied())
                .expect("a value")
        })
        .collect();
    assert_eq!(firsts, [0, 1, 2]);
    assert_eq!(pending(&pool).await, 4);
    assert_eq!(
        relay
            .stats()
            .reordered
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    // The held rows stay held: another pass sends nothing.
    let again = relay.relay_all().await.expect("relay");
    assert_eq!((again.published, again.failed), (0, 0));
}

#[tokio::test]
async fn kafka_sink_leaves_a_row_for_a_missing_topic_pending() {
    let (_db, pool, fx) = store().await;
    let topic = TestTopic::create(1).await;
    let missing = format!("{}-not-made", topic.name);
    let event = Event::json(&missing, "k", "t", &1).expect("a valid event");
    fx.outbox().enqueue(&pool, &event).await.expect("enqueue");
    let relay = kafka_relay(&fx, &topic, ("message.timeout.ms", "3000"));
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed, pass.retried), (0, 0, 1));
    assert_eq!(pending(&pool).await, 1);
}
