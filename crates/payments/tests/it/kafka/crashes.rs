//! The binary killed at its crash points and restarted, and stopped by SIGTERM
//! under load: nothing lost, nothing doubled; and the split-transaction
//! counter-example, which must lose or double effects.

use std::time::Duration;

use pipeline::testing::{TestDb, TestTopic, eventually};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;

use super::{
    CHARGES, DOUBLES, INBOX, LEDGER, committed_offset, count, envelope, events, payments_process,
    produce_events,
};

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
