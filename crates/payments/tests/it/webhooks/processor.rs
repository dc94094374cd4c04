//! The inbox processor: two on one database apply each claim once, one that
//! finds every claim held backs off, and a claim the inbox cannot record yet
//! waits unprocessed.

use std::time::Duration;

use pipeline::testing::{TestDb, eventually};
use reqwest::StatusCode;
use sqlx::PgPool;
use uuid::Uuid;

use super::{CHARGES, LEDGER, Receiver, UNPROCESSED, count, event};

/// Two payments processes on one database (two receivers, two inbox
/// processors scanning the same claims): each claim is applied once.
#[tokio::test]
async fn two_processors_on_one_database_apply_each_claim_once() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // One secret, as two replicas behind one URL would have.
    let a = Receiver::spawn(&db).await;
    let b = Receiver::spawn_with(&db, a.secret.clone()).await;
    let n = 300;
    let events: Vec<(Uuid, Vec<u8>)> = (0..n)
        .map(|i| {
            let msg_id = Uuid::now_v7();
            (msg_id, event(msg_id, Uuid::now_v7(), 100 + i))
        })
        .collect();
    let mut sends = Vec::new();
    for (i, (msg_id, body)) in events.iter().enumerate() {
        // Every event to one replica, every third also to the other.
        let (first, other) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
        sends.push(first.post(*msg_id, body));
        if i % 3 == 0 {
            sends.push(other.post(*msg_id, body));
        }
    }
    for (status, json) in futures::future::join_all(sends).await {
        assert_eq!(status, StatusCode::OK, "{json}");
    }
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, UNPROCESSED).await == 0
        })
        .await
    );
    assert_eq!(count(&pool, CHARGES).await, n);
    assert_eq!(count(&pool, LEDGER).await, n, "each claim applied once");
    a.stop().await;
    b.stop().await;
}

/// While every unprocessed claim is held by another processor (its
/// transaction has the row locked, so `FOR UPDATE SKIP LOCKED` skips it),
/// the processor backs off between scans instead of scanning again at once:
/// over a second, a bounded handful of scans (each reads the held claim:
/// `payments_consumed_total`), not hundreds. Once the lock is gone, the
/// claim is applied within the backoff's bound (the poll interval, here
/// 100 ms).
#[tokio::test]
async fn a_processor_that_finds_every_claim_held_backs_off_instead_of_spinning() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let msg_id = Uuid::now_v7();
    let body = event(msg_id, Uuid::now_v7(), 100);
    payments::receiver::claim(&pool, msg_id, &body, 0)
        .await
        .expect("claim");
    // The other processor, mid-batch.
    let mut other = pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM payments.webhook_inbox WHERE msg_id = $1 FOR UPDATE")
        .bind(msg_id)
        .execute(&mut *other)
        .await
        .expect("lock the claim");
    let receiver = Receiver::spawn(&db).await;
    const SCANNED: &str = "payments_consumed_total";
    assert!(
        eventually(Duration::from_secs(10), || async {
            receiver.metric(SCANNED).await >= 1.0
        })
        .await,
        "the processor read the held claim"
    );
    let before = receiver.metric(SCANNED).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let scans = receiver.metric(SCANNED).await - before;
    assert_eq!(count(&pool, CHARGES).await, 0, "held: not applied");
    // Doubling from 5 ms to the 100 ms poll: about 14 in a second.
    assert!(
        scans <= 20.0,
        "{scans} scans in 1 s while the only claim was held"
    );
    other.rollback().await.expect("release");
    let released = std::time::Instant::now();
    assert!(
        eventually(Duration::from_secs(5), || async {
            count(&pool, CHARGES).await == 1
        })
        .await
    );
    assert!(
        released.elapsed() < Duration::from_secs(1),
        "applied {:?} after the release",
        released.elapsed()
    );
    assert_eq!(count(&pool, UNPROCESSED).await, 0);
    receiver.stop().await;
}

/// Over HTTP a webhook whose msg_id lies beyond the inbox's partitions (an
/// orders clock 30 days fast) is still answered 200 (its claim is stored),
/// and its claim waits unprocessed: not applied, not dead-lettered, while
/// the claims after it are applied. Once the partitions reach it, it is.
/// A claim with the nil msg_id is processed too (the scan once began after
/// it).
#[tokio::test]
async fn a_claim_the_inbox_cannot_record_yet_waits_unprocessed_not_dead_lettered() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn(&db).await;
    let future = effectively::v7::minted_ahead(Duration::from_secs(30 * 86_400));
    let (status, json) = receiver
        .post(future, &event(future, Uuid::now_v7(), 500))
        .await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["status"], "accepted");
    for i in 0..3 {
        let msg_id = Uuid::now_v7();
        let (status, json) = receiver
            .post(msg_id, &event(msg_id, Uuid::now_v7(), 100 + i))
            .await;
        assert_eq!(status, StatusCode::OK, "{json}");
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 3
        })
        .await,
        "the claims after the held one are applied"
    );
    assert!(
        eventually(Duration::from_secs(10), || async {
            receiver.metric("payments_future_msg_ids_total").await >= 2.0
        })
        .await,
        "the held claim is tried again"
    );
    assert_eq!(count(&pool, UNPROCESSED).await, 1, "the held claim waits");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM payments.dead_letters").await,
        0
    );
    sqlx::query("SELECT fx.partitioned_inbox_extend(now() + interval '31 days', interval '1 day')")
        .execute(&pool)
        .await
        .expect("extend");
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 4
        })
        .await,
        "the held claim is applied once the inbox can record it"
    );
    assert_eq!(count(&pool, UNPROCESSED).await, 0);
    assert_eq!(count(&pool, LEDGER).await, 4);

    // The nil msg_id is processed too: the scan once started after it, so
    // it was never read.
    payments::receiver::claim(
        &pool,
        Uuid::nil(),
        &event(Uuid::nil(), Uuid::now_v7(), 7),
        0,
    )
    .await
    .expect("claim");
    assert!(
        eventually(Duration::from_secs(10), || async {
            count(&pool, UNPROCESSED).await == 0
        })
        .await,
        "the nil msg_id's claim is processed"
    );
    receiver.stop().await;
}
