//! The library's relay (`effectively::store::Relay`) against the real
//! PostgreSQL, through a sink the test scripts (which rows fail, and how;
//! a send that never ends), and through `KafkaSink` to the real broker.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use effectively::store::{Effectively, Event, KafkaSink, Outgoing, Relay, SendError, Sink};
use pipeline::testing::{TestDb, TestTopic};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

async fn store() -> (TestDb, PgPool, Effectively) {
    super::store::store("shop_fx").await
}

/// What a scripted sink does with a row, by its payload (a JSON number).
#[derive(Clone, Copy)]
enum Script {
    Retry,
    Reject,
    Hang,
}

/// Records every send in order; fails or hangs the rows its script names.
#[derive(Default, Clone)]
struct Recorder {
    sent: Arc<Mutex<Vec<(String, i64)>>>,
    script: Arc<Mutex<HashMap<i64, Script>>>,
}

impl Recorder {
    fn sent(&self) -> Vec<(String, i64)> {
        self.sent.lock().expect("lock").clone()
    }
    fn set(&self, n: i64, script: Option<Script>) {
        let mut s = self.script.lock().expect("lock");
        match script {
            Some(x) => s.insert(n, x),
            None => s.remove(&n),
        };
    }
    /// Each key's payloads in the order they were sent.
    fn by_key(&self) -> HashMap<String, Vec<i64>> {
        let mut m: HashMap<String, Vec<i64>> = HashMap::new();
        for (k, n) in self.sent() {
            m.entry(k).or_default().push(n);
        }
        m
    }
}

impl Sink for Recorder {
    async fn send(&self, row: &Outgoing) -> Result<(), SendError> {
        let n: i64 = serde_json::from_slice(&row.payload).expect("a number");
        let script = self.script.lock().expect("lock").get(&n).copied();
        match script {
            Some(Script::Retry) => return Err(SendError::Retry("scripted".into())),
            Some(Script::Reject) => return Err(SendError::Reject("scripted refusal".into())),
            Some(Script::Hang) => std::future::pending::<()>().await,
            None => {}
        }
        self.sent.lock().expect("lock").push((row.key.clone(), n));
        Ok(())
    }
}

/// Enqueues payloads `ns` for keys `k0..k{keys}` in turn, in one transaction.
async fn enqueue(fx: &Effectively, keys: i64, ns: std::ops::Range<i64>) {
    let events: Vec<Event> = ns
        .map(|n| {
            Event::json("carts", &format!("k{}", n % keys), "cart.updated", &n)
                .expect("a valid event")
        })
        .collect();
    fx.outbox()
        .enqueue_batch(fx.pool(), &events)
        .await
        .expect("enqueue");
}

async fn pending(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM shop_fx.outbox WHERE published_at IS NULL AND failed_at IS NULL",
    )
    .fetch_one(pool)
    .await
    .expect("count")
}

fn ascending(v: &[i64]) -> bool {
    v.windows(2).all(|w| w[0] < w[1])
}

#[tokio::test]
async fn every_row_is_sent_once_each_key_in_order_and_marked() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 7, 0..300).await;
    let sink = Recorder::default();
    let relay = Relay::new(&fx, sink.clone()).batch_size(20);
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!(pass.published, 300);
    assert_eq!(pending(&pool).await, 0);
    let by_key = sink.by_key();
    assert_eq!(by_key.len(), 7);
    for (key, ns) in &by_key {
        assert!(ascending(ns), "{key}: {ns:?}");
    }
    assert_eq!(sink.sent().len(), 300);
    // Nothing left: a second pass sends nothing.
    assert_eq!(relay.relay_all().await.expect("relay").published, 0);
    assert_eq!(sink.sent().len(), 300);
}

/// A sink that takes 30 ms for each row.
#[derive(Clone, Default)]
struct Slow;

impl Sink for Slow {
    async fn send(&self, _row: &Outgoing) -> Result<(), SendError> {
        tokio::time::sleep(Duration::from_millis(30)).await;
        Ok(())
    }
}

#[tokio::test]
async fn the_stats_count_passes_that_claimed_and_time_each_phase() {
    let (_db, _pool, fx) = store().await;
    enqueue(&fx, 1, 0..3).await;
    let relay = Relay::new(&fx, Slow);
    let stats = relay.stats();
    let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    // One key: its 3 rows one after the other, 90 ms of sending.
    assert_eq!(relay.relay_all().await.expect("relay").published, 3);
    assert_eq!(relay.relay_all().await.expect("relay").published, 0);
    assert_eq!(
        load(&stats.passes),
        1,
        "a pass that claimed nothing is not counted"
    );
    assert!(load(&stats.send_micros) >= 90_000, "{stats:?}");
    assert!(load(&stats.claim_micros) > 0, "{stats:?}");
    assert!(load(&stats.mark_micros) > 0, "{stats:?}");
}

#[tokio::test]
async fn a_retried_row_holds_only_its_key_and_goes_first_next_time() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 3, 0..30).await; // k0: 0, 3, 6, ...
    let sink = Recorder::default();
    sink.set(6, Some(Script::Retry));
    let relay = Relay::new(&fx, sink.clone());
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!(pass.retried, 8, "6 and k0's 7 later rows stay");
    assert_eq!(sink.by_key()["k0"], [0, 3]);
    assert_eq!(sink.by_key()["k1"].len(), 10);
    assert_eq!(pending(&pool).await, 8);
    sink.set(6, None);
    relay.relay_all().await.expect("relay");
    assert_eq!(pending(&pool).await, 0);
    assert_eq!(sink.by_key()["k0"], (0..30).step_by(3).collect::<Vec<_>>());
}

/// A sink with a key's rows all in flight at once that answers for every
/// one, a failure or not (as a Kafka broker may deliver a key's later
/// records after refusing one).
#[derive(Clone, Default)]
struct AllInFlight(Recorder);

impl Sink for AllInFlight {
    async fn send(&self, row: &Outgoing) -> Result<(), SendError> {
        self.0.send(row).await
    }
    async fn send_in_order(&self, rows: &[&Outgoing]) -> Vec<Result<(), SendError>> {
        futures::future::join_all(rows.iter().map(|row| self.0.send(row))).await
    }
}

#[tokio::test]
async fn rows_delivered_after_their_keys_failed_row_are_published_and_counted_as_reordered() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 3, 0..30).await; // k0: 0, 3, 6, ..., 27; k1: 1, 4, ..., 28
    let sink = AllInFlight::default();
    sink.0.set(6, Some(Script::Retry));
    sink.0.set(7, Some(Script::Reject));
    let relay = Relay::new(&fx, sink.clone());
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed, pass.retried), (28, 1, 1));
    // k0's 7 rows after 6, and k1's 7 after 7, went ahead of them.
    assert_eq!(
        relay
            .stats()
            .reordered
            .load(std::sync::atomic::Ordering::Relaxed),
        14
    );
    assert_eq!(pending(&pool).await, 1);
    sink.0.set(6, None);
    relay.relay_all().await.expect("relay");
    assert_eq!(pending(&pool).await, 0);
    assert_eq!(sink.0.by_key()["k0"].last(), Some(&6));
}

#[tokio::test]
async fn a_refused_row_is_marked_failed_and_holds_its_key_back() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 2, 0..10).await; // k0: 0 2 4 6 8
    let sink = Recorder::default();
    sink.set(4, Some(Script::Reject));
    let relay = Relay::new(&fx, sink.clone());
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed), (7, 1));
    let (error,): (String,) = sqlx::query_as(
        "SELECT error FROM shop_fx.outbox WHERE failed_at IS NOT NULL AND payload = '4'",
    )
    .fetch_one(&pool)
    .await
    .expect("the failed row");
    assert_eq!(error, "scripted refusal");
    // k0's 6 and 8 wait behind it, pass after pass; k1 is done.
    relay.relay_all().await.expect("relay");
    assert_eq!(sink.by_key()["k0"], [0, 2]);
    assert_eq!(sink.by_key()["k1"], [1, 3, 5, 7, 9]);
    assert_eq!(pending(&pool).await, 2);
}

#[tokio::test]
async fn a_relay_that_keeps_no_published_row_deletes_what_it_delivered_and_keeps_the_rest() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 3, 0..12).await; // k0: 0 3 6 9, k1: 1 4 7 10, k2: 2 5 8 11
    let sink = Recorder::default();
    sink.set(4, Some(Script::Retry));
    sink.set(5, Some(Script::Reject));
    let relay = Relay::new(&fx, sink.clone()).keep_published(Some(Duration::ZERO));
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed), (6, 1), "{pass:?}");
    let left: Vec<(String, bool)> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8'), failed_at IS NOT NULL FROM shop_fx.outbox ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("the rows left");
    // The delivered rows are gone; the retried one and its key's later
    // rows wait, the refused one is kept failed with its key's later rows.
    let left: Vec<(&str, bool)> = left.iter().map(|(p, f)| (p.as_str(), *f)).collect();
    assert_eq!(
        left,
        [
            ("4", false),
            ("5", true),
            ("7", false),
            ("8", false),
            ("10", false),
            ("11", false)
        ]
    );
    sink.set(4, None);
    assert_eq!(relay.relay_all().await.expect("relay").published, 3);
    assert_eq!(sink.by_key()["k1"], [1, 4, 7, 10]);
    assert_eq!(pending(&pool).await, 2, "k2's 8 and 11 wait behind 5");
}

#[tokio::test]
async fn the_backlog_shows_what_waits_a_released_row_goes_first_and_published_rows_expire() {
    let (_db, pool, fx) = store().await;
    let outbox = fx.outbox();
    let empty = outbox.backlog(&pool).await.expect("backlog");
    assert_eq!(
        (empty.pending, empty.failed, empty.oldest_pending),
        (0, 0, None)
    );
    enqueue(&fx, 2, 0..10).await; // k0: 0 2 4 6 8
    sqlx::query("UPDATE shop_fx.outbox SET created_at = created_at - interval '1 hour'")
        .execute(&pool)
        .await
        .expect("age the rows");
    let waiting = outbox.backlog(&pool).await.expect("backlog");
    assert_eq!((waiting.pending, waiting.failed), (10, 0));
    assert!(
        waiting.oldest_pending >= Some(Duration::from_secs(3600)),
        "{waiting:?}"
    );

    let sink = Recorder::default();
    sink.set(4, Some(Script::Reject));
    let relay = Relay::new(&fx, sink.clone());
    relay.relay_all().await.expect("relay");
    let after = outbox.backlog(&pool).await.expect("backlog");
    assert_eq!(
        (after.pending, after.failed),
        (2, 1),
        "k0's 6 and 8 behind 4"
    );
    let failed = outbox.failed(&pool, 10).await.expect("failed");
    assert_eq!(failed.len(), 1);
    assert_eq!(
        (failed[0].key.as_str(), failed[0].error.as_deref()),
        ("k0", Some("scripted refusal"))
    );

    // Published rows older than what is kept go; the failed and the pending
    // ones stay, whatever their age.
    assert_eq!(
        outbox
            .expire(&pool, Duration::from_secs(7200), 2)
            .await
            .expect("expire"),
        0
    );
    assert_eq!(
        outbox
            .expire(&pool, Duration::from_secs(60), 2)
            .await
            .expect("expire"),
        7
    );
    let left: Vec<String> =
        sqlx::query_scalar("SELECT convert_from(payload, 'UTF8') FROM shop_fx.outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("rows");
    assert_eq!(left, ["4", "6", "8"]);

    // Released (the destination was fixed), 4 goes, then its key's 6 and 8.
    sink.set(4, None);
    assert_eq!(
        outbox
            .release(&pool, &[failed[0].id, failed[0].id + 1000])
            .await
            .expect("release"),
        1
    );
    relay.relay_all().await.expect("relay");
    assert_eq!(sink.by_key()["k0"], [0, 2, 4, 6, 8]);
    let done = outbox.backlog(&pool).await.expect("backlog");
    assert_eq!(
        (done.pending, done.failed, done.oldest_pending),
        (0, 0, None)
    );
}

#[tokio::test]
async fn run_expires_published_rows_it_is_told_not_to_keep() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 3, 0..6).await;
    sqlx::query("UPDATE shop_fx.outbox SET created_at = created_at - interval '2 days'")
        .execute(&pool)
        .await
        .expect("age the rows");
    let sink = Recorder::default();
    let relay = Arc::new(
        Relay::new(&fx, sink.clone()).keep_published(Some(Duration::from_secs(24 * 3600))),
    );
    let cancel = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, cancel) = (relay.clone(), cancel.clone());
        async move { relay.run(cancel).await }
    });
    // Published in its first pass, expired in its first expiry after it (a
    // minute later, or at once on a relay started on an old backlog) or,
    // as here, by the next run.
    let published =
        pipeline::testing::eventually(Duration::from_secs(10), || async { sink.sent().len() == 6 })
            .await;
    assert!(published);
    cancel.cancel();
    running.await.expect("run ends");
    let again = Arc::new(
        Relay::new(&fx, sink.clone()).keep_published(Some(Duration::from_secs(24 * 3600))),
    );
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let running = tokio::spawn({
        let again = again.clone();
        async move { again.run(cancel).await }
    });
    let gone = pipeline::testing::eventually(Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM shop_fx.outbox")
            .fetch_one(&pool)
            .await
            .expect("count")
            == 0
    })
    .await;
    stop.cancel();
    running.await.expect("run ends");
    assert!(gone, "the published rows were expired");
    // Each row expired once: by the first run's expiry if its passes had
    // published it by then (they run side by side), else by the second's.
    let expired =
        |r: &Relay<Recorder>| r.stats().expired.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(expired(&relay) + expired(&again), 6);
}

#[tokio::test]
async fn a_pass_cut_off_mid_send_publishes_nothing_and_blocks_no_other_relay_after() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 1, 0..5).await; // one key, one shard
    let shard = effectively::store::shard_of("k0");
    let stuck = Recorder::default();
    stuck.set(2, Some(Script::Hang));
    let first = Relay::new(&fx, stuck.clone());
    let other_sink = Recorder::default();
    let other = Relay::new(&fx, other_sink.clone());
    // While the first pass hangs on row 2 it holds the shard: the other
    // relay's pass is turned away.
    let cut = tokio::time::timeout(Duration::from_millis(1500), async {
        tokio::join!(first.relay_shard(shard), async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let pass = other.relay_shard(shard).await.expect("pass");
            assert!(pass.busy, "the shard is held by the hung pass");
        })
    })
    .await;
    assert!(cut.is_err(), "the hung pass was cut off");
    assert_eq!(stuck.sent(), [("k0".into(), 0), ("k0".into(), 1)]);
    // Nothing was marked; once the cut-off pass's session is gone the
    // other relay sends them all again, in order (at least once).
    assert_eq!(pending(&pool).await, 5);
    let mut published = 0;
    for _ in 0..50 {
        published += other.relay_shard(shard).await.expect("pass").published;
        if published == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(published, 5);
    assert_eq!(other_sink.by_key()["k0"], [0, 1, 2, 3, 4]);
}

#[tokio::test]
async fn two_relays_at_once_keep_each_key_in_order() {
    let (_db, pool, fx) = store().await;
    let sink = Recorder::default();
    let a = Relay::new(&fx, sink.clone())
        .batch_size(7)
        .poll_every(Duration::from_millis(20));
    let b = Relay::new(&fx, sink.clone())
        .batch_size(5)
        .poll_every(Duration::from_millis(20));
    let cancel = CancellationToken::new();
    let writer = async {
        for chunk in 0..20 {
            enqueue(&fx, 11, chunk * 50..(chunk + 1) * 50).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for _ in 0..200 {
            if pending(&pool).await == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cancel.cancel();
    };
    tokio::join!(a.run(cancel.clone()), b.run(cancel.clone()), writer);
    assert_eq!(pending(&pool).await, 0);
    let by_key = sink.by_key();
    let total: usize = by_key.values().map(Vec::len).sum();
    assert_eq!(total, 1000, "each row sent once (no pass was cut off)");
    for (key, ns) in &by_key {
        assert!(ascending(ns), "{key}: {ns:?}");
    }
    assert!(
        a.stats()
            .published
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    assert!(
        b.stats()
            .published
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
}

#[tokio::test]
async fn a_commit_wakes_the_relay_without_waiting_for_its_poll() {
    let (_db, pool, fx) = store().await;
    let sink = Recorder::default();
    let relay = Relay::new(&fx, sink.clone()).poll_every(Duration::from_secs(3600));
    let cancel = CancellationToken::new();
    let run = relay.run(cancel.clone());
    let check = async {
        // Its first pass finds nothing; then it waits on the NOTIFY.
        tokio::time::sleep(Duration::from_millis(500)).await;
        enqueue(&fx, 1, 0..3).await;
        let mut woke = false;
        for _ in 0..100 {
            if pending(&pool).await == 0 {
                woke = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cancel.cancel();
        woke
    };
    let ((), woke) = tokio::join!(run, check);
    assert!(
        woke,
        "the rows were published within 5 s, with the poll an hour away"
    );
}

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

/// A receiver on 127.0.0.1 that verifies each request's signature and
/// answers the status its script gives the payload (200 by default),
/// recording what it took.
/// A request taken: its `webhook-id`, body and `traceparent`.
type Took = (String, Vec<u8>, Option<String>);

#[derive(Clone, Default)]
struct Receiver {
    took: Arc<Mutex<Vec<Took>>>,
    answer: Arc<Mutex<HashMap<Vec<u8>, u16>>>,
}

async fn receive(
    secret: effectively::webhook::Secret,
    receiver: Receiver,
) -> (String, CancellationToken) {
    use axum::body::Bytes;
    use axum::http::{HeaderMap, StatusCode};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/hooks", listener.local_addr().expect("addr"));
    let router = axum::Router::new().route(
        "/hooks",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let (secret, receiver) = (secret.clone(), receiver.clone());
            async move {
                let h = |n: &str| {
                    headers
                        .get(n)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned()
                };
                let verified = effectively::webhook::verify(
                    &[secret],
                    &h("webhook-id"),
                    &h("webhook-timestamp"),
                    &h("webhook-signature"),
                    &body,
                    chrono::Utc::now().timestamp(),
                    effectively::webhook::DEFAULT_TOLERANCE,
                );
                if verified.is_err() {
                    return StatusCode::UNAUTHORIZED;
                }
                let status = receiver
                    .answer
                    .lock()
                    .expect("lock")
                    .get(body.as_ref())
                    .copied()
                    .unwrap_or(200);
                if status == 200 {
                    let trace = headers
                        .get("traceparent")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    receiver.took.lock().expect("lock").push((
                        h("webhook-id"),
                        body.to_vec(),
                        trace,
                    ));
                }
                StatusCode::from_u16(status).expect("a status")
            }
        }),
    );
    let cancel = CancellationToken::new();
    pipeline::metrics::spawn_router("receiver", listener, router, cancel.clone());
    (url, cancel)
}

#[tokio::test]
async fn webhook_sink_delivers_signed_requests_and_judges_the_answers() {
    use effectively::store::WebhookSink;
    use effectively::webhook::Secret;
    let (_db, pool, fx) = store().await;
    let secret = Secret::generate();
    let receiver = Receiver::default();
    let (url, stop) = receive(secret.clone(), receiver.clone()).await;
    // Payload 5 is answered 503 (tried again), 6 is answered 410 (refused).
    receiver
        .answer
        .lock()
        .expect("lock")
        .insert(b"5".to_vec(), 503);
    receiver
        .answer
        .lock()
        .expect("lock")
        .insert(b"6".to_vec(), 410);
    let mut events: Vec<Event> = (0..8i64)
        .map(|n| {
            Event::json("billing", &format!("cart-{n}"), "cart.updated", &n)
                .expect("a valid event")
                .with_header("traceparent", &format!("00-{n:032x}-{n:016x}-01"))
                .expect("a valid header")
        })
        .collect();
    events.push(Event::json("nowhere", "cart-x", "cart.updated", &9).expect("a valid event"));
    fx.outbox()
        .enqueue_batch(&pool, &events)
        .await
        .expect("enqueue");

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("a client");
    let sink = WebhookSink::new(client)
        .destination("billing", &url, vec![Secret::generate(), secret])
        .expect("a destination");
    assert!(
        WebhookSink::new(reqwest::Client::new())
            .destination("x", "ftp://host/", vec![Secret::generate()])
            .is_err()
    );
    let relay = Relay::new(&fx, sink);
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed, pass.retried), (6, 2, 1));
    let took = receiver.took.lock().expect("lock").clone();
    assert_eq!(took.len(), 6);
    for (id, body, trace) in &took {
        let n: i64 = serde_json::from_slice(body).expect("json");
        let event = &events[usize::try_from(n).expect("small")];
        assert_eq!(id, &event.msg_id().to_string());
        assert_eq!(
            trace.as_deref(),
            Some(format!("00-{n:032x}-{n:016x}-01").as_str())
        );
    }
    let errors: Vec<(String, String)> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8'), error FROM shop_fx.outbox WHERE failed_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("the refused rows");
    assert_eq!(errors[0].0, "6");
    assert!(errors[0].1.starts_with("HTTP 410"), "{errors:?}");
    assert_eq!(errors[1].0, "9");
    assert!(
        errors[1]
            .1
            .contains("no webhook destination named \"nowhere\""),
        "{errors:?}"
    );
    // The receiver is back: the 503'd row goes.
    receiver
        .answer
        .lock()
        .expect("lock")
        .remove(b"5".as_slice());
    assert_eq!(relay.relay_all().await.expect("relay").published, 1);
    assert_eq!(pending(&pool).await, 0);
    stop.cancel();
}

/// Rows of `shop_fx.outbox` read so far by this session (live rows fetched
/// through an index, rows a sequential scan read), its own counts flushed
/// first. `pool` has one connection, so the relay's passes are this
/// session's.
async fn outbox_reads(pool: &PgPool) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .expect("flush");
    sqlx::query_scalar(
        "SELECT coalesce(idx_tup_fetch, 0) + seq_tup_read FROM pg_stat_user_tables \
         WHERE relid = 'shop_fx.outbox'::regclass",
    )
    .fetch_one(pool)
    .await
    .expect("this session's reads")
}

/// A pass's claim walks each shard's pending rows by the pending index,
/// whatever the statistics say: taken while the backlog was all pending
/// (a relay back after a stop), or while the outbox was empty (a burst
/// after a quiet hour). Under the first, the claim walked the primary key
/// and read every row published before it, of every shard, per shard: a
/// 2,000-row claim on a 20,000-row backlog half published took 132 ms
/// instead of 5 (FINDINGS.md §26). The count is the session's reads, not a
/// time.
#[tokio::test]
async fn a_pass_reads_about_the_rows_it_claims_after_a_backlog_was_analyzed() {
    for analyzed_empty in [false, true] {
        let (db, _pool, _) = store().await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&db.url)
            .await
            .expect("connect");
        let fx = Effectively::postgres(pool.clone())
            .schema("shop_fx")
            .expect("schema name");
        if analyzed_empty {
            sqlx::query("ANALYZE shop_fx.outbox")
                .execute(&pool)
                .await
                .expect("analyze");
        }
        enqueue(&fx, 16_000, 0..16_000).await;
        if !analyzed_empty {
            sqlx::query("ANALYZE shop_fx.outbox")
                .execute(&pool)
                .await
                .expect("analyze");
        }
        let all: Vec<i16> = (0..16).collect();
        let relay = Relay::new(&fx, Recorder::default()).batch_size(2000);
        for _ in 0..3 {
            relay.relay_shards(&all).await.expect("a pass");
        }
        let before = outbox_reads(&pool).await;
        let pass = relay.relay_shards(&all).await.expect("a pass");
        let read = outbox_reads(&pool).await - before;
        let published = i64::try_from(pass.published).expect("a count");
        assert!(published > 1500, "{pass:?}");
        // At most the table once (the mark may scan it rather than probe
        // 2,000 ids of 16,000) and the claim's rows a few times over (each
        // shard's walk steps over the index entries of its rows published
        // since the last vacuum). Walking the primary key read, per shard,
        // every row published before and its share of the rest: 144,046.
        assert!(
            read <= 16_000 + 3 * published,
            "analyzed {}: a pass of {published} rows read {read} rows of the outbox",
            if analyzed_empty { "empty" } else { "full" }
        );
    }
}
