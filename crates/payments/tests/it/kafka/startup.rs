//! What the binary refuses at start-up (exit status 2), and runs on with the
//! flag that allows it: a retention under the horizon, a topic with one replica.

use std::process::Stdio;
use std::time::Duration;

use pipeline::testing::{TestDb, TestTopic, eventually};
use sqlx::PgPool;

use super::{CHARGES, count, events, payments_process, produce_events};

/// A retention shorter than the redelivery horizon: the binary refuses to
/// start, with status 2 and the derivation; with the unsafe flag it runs.
#[tokio::test]
async fn a_retention_under_the_horizon_is_refused_at_start_up() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let binary = |retention: &str, unsafe_flag: bool| {
        let mut child = payments_process(&db, &topic, "g-horizon");
        child
            .env("PAYMENTS_INBOX_RETENTION", retention)
            .stderr(Stdio::piped());
        if unsafe_flag {
            child.env("PAYMENTS_UNSAFE_INBOX_RETENTION", "true");
        }
        child
    };
    let out = tokio::time::timeout(Duration::from_secs(60), binary("15d", false).output())
        .await
        .expect("exits in time")
        .expect("run payments");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("shorter than the redelivery horizon"),
        "{stderr}"
    );
    assert!(
        stderr.contains("= redelivery horizon"),
        "the derivation is printed: {stderr}"
    );

    produce_events(&topic, &events(1)).await;
    let mut child = binary("15d", true).spawn().expect("spawn");
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 1
        })
        .await,
        "with --unsafe-inbox-retention it runs"
    );
    child.kill().await.expect("kill");
}

/// Issue item 11 for payments: a topic with one replica loses, with its
/// broker, events the relay already marked published, which no one would
/// ever send again. Payments refuses it at start-up (status 2) naming the
/// replication factor, and runs on it with `--allow-under-replicated-topic`.
#[tokio::test]
async fn a_topic_with_one_replica_is_refused_at_start_up() {
    let db = TestDb::create().await;
    let topic = TestTopic::create_with(1, 1, &[("min.insync.replicas", "1")]).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let binary = |allow: &str| {
        let mut child = payments_process(&db, &topic, "g-replicas");
        child
            .env("KAFKA_ALLOW_UNDER_REPLICATED_TOPIC", allow)
            .stderr(Stdio::piped());
        child
    };
    let out = tokio::time::timeout(Duration::from_secs(60), binary("false").output())
        .await
        .expect("payments still runs on a topic with one replica after 60 s")
        .expect("run payments");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "payments refuses topic {}: replication factor is 1",
            topic.name
        )),
        "{stderr}"
    );

    produce_events(&topic, &events(1)).await;
    let mut child = binary("true").spawn().expect("spawn");
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 1
        })
        .await,
        "with --allow-under-replicated-topic it runs"
    );
    child.kill().await.expect("kill");
}
