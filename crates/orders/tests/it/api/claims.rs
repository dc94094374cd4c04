//! How a key is claimed: coalesced write batches and every claim strategy
//! keep the per-key semantics, the advisory lock is really taken, and the
//! no-idempotency baseline really skips the check.

use std::time::Duration;

use orders::store::InjectFault;
use pipeline::idempotency::ClaimStrategy;
use pipeline::testing::TestDb;
use reqwest::StatusCode;
use sqlx::PgPool;

use super::{BODY, Counts, Reply, TestApp, counts, n};

/// New keys, their concurrent retries and conflicting requests for the same
/// keys, all at once: they land in shared write batches. Per key, exactly one
/// request body wins; every request with it gets the identical 201, every
/// request with the other body gets 409.
#[tokio::test]
async fn coalesced_batches_keep_per_key_semantics() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;
    check_per_key_semantics(&app).await;
    assert_eq!(counts(&db).await, n(15));
    app.stop().await;
}

/// Both claim strategies, with and without coalescing (one request per
/// transaction), keep the per-key semantics: one order per key, every
/// request with the winning body gets its 201, the other body 409, and 50
/// concurrent sends of one key make one order.
#[tokio::test]
async fn every_claim_strategy_keeps_per_key_semantics_with_and_without_coalescing() {
    for strategy in [ClaimStrategy::OnConflict, ClaimStrategy::AdvisoryLock] {
        for batch_max in [128, 1] {
            let db = TestDb::create().await;
            let app = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, |c| {
                c.claim_strategy = strategy;
                c.write_batch_max = batch_max;
            })
            .await;
            check_per_key_semantics(&app).await;
            let replies =
                futures::future::join_all((0..50).map(|_| app.create("hot-key", BODY))).await;
            assert_eq!(
                replies[0].status,
                StatusCode::CREATED,
                "{strategy:?} {batch_max}"
            );
            assert!(
                replies.iter().all(|r| r == &replies[0]),
                "{strategy:?} {batch_max}"
            );
            assert_eq!(counts(&db).await, n(16), "{strategy:?} {batch_max}");
            app.stop().await;
        }
    }
}

/// The advisory-lock strategy really takes the key's lock: while another
/// session holds it, a create with that key waits; released, it completes.
/// (The on-conflict strategy does not wait for it.)
#[tokio::test]
async fn the_advisory_lock_strategy_waits_for_the_keys_lock() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let mut holder = pool.acquire().await.expect("holder");
    sqlx::query("SELECT pg_advisory_lock($1, hashtext('held-key'))")
        .bind(pipeline::idempotency::ADVISORY_LOCK_CLASS)
        .execute(&mut *holder)
        .await
        .expect("hold the key's lock");

    let plain = TestApp::spawn(&db, InjectFault::None).await;
    let reply = tokio::time::timeout(Duration::from_secs(5), plain.create("other-key", BODY))
        .await
        .expect("on-conflict does not wait for the advisory lock");
    assert_eq!(reply.status, StatusCode::CREATED);
    plain.stop().await;

    let locking = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, |c| {
        c.claim_strategy = ClaimStrategy::AdvisoryLock;
    })
    .await;
    // The request runs in a task of its own while the lock is held.
    let request = locking
        .client
        .post(format!("{}/orders", locking.http))
        .header("Idempotency-Key", "held-key")
        .header("Content-Type", "application/json")
        .body(BODY);
    let waiting =
        tokio::spawn(async move { Reply::from(request.send().await.expect("send")).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !waiting.is_finished(),
        "the create waits for the key's lock"
    );
    sqlx::query("SELECT pg_advisory_unlock($1, hashtext('held-key'))")
        .bind(pipeline::idempotency::ADVISORY_LOCK_CLASS)
        .execute(&mut *holder)
        .await
        .expect("release");
    let reply = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("completes once released")
        .expect("join");
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(counts(&db).await, n(2));
    locking.stop().await;
}

/// 15 keys, 4 concurrent sends each, two bodies per key.
async fn check_per_key_semantics(app: &TestApp) {
    let mut sends = Vec::new();
    for k in 0..15 {
        for r in 0..4 {
            // Bodies A (r even) and B (r odd) for the same key.
            let amount = if r % 2 == 0 { 100 + k } else { 900 + k };
            sends.push((format!("mix-{k}"), amount));
        }
    }
    let replies = futures::future::join_all(sends.iter().map(|(key, amount)| {
        let body = format!(r#"{{"account_id": 3, "amount_cents": {amount}}}"#);
        let app = &app;
        async move { (key.clone(), *amount, app.create(key, &body).await) }
    }))
    .await;
    for k in 0..15 {
        let key = format!("mix-{k}");
        let mine: Vec<&(String, i64, Reply)> =
            replies.iter().filter(|(k2, _, _)| *k2 == key).collect();
        let winners: Vec<&Reply> = mine
            .iter()
            .filter(|(_, _, r)| r.status == StatusCode::CREATED)
            .map(|(_, _, r)| r)
            .collect();
        let winning_amount = mine
            .iter()
            .find(|(_, _, r)| r.status == StatusCode::CREATED)
            .map(|(_, a, _)| *a)
            .expect("one body wins");
        for (_, amount, reply) in &mine {
            if *amount == winning_amount {
                assert_eq!(
                    reply, winners[0],
                    "{key}: every request with the winning body gets the same 201"
                );
            } else {
                assert_eq!(
                    reply.status,
                    StatusCode::CONFLICT,
                    "{key}: the other body is refused"
                );
                assert_eq!(reply.error_code(), "idempotency_key_reused");
            }
        }
    }
}

/// `--no-idempotency` is experiment 1's unsafe measurement baseline; it is
/// only a baseline if it really skips the check. With it, a retried key makes
/// a second order and event (and concurrent retries one each, in shared
/// batches); without it, one order. The key is still required either way.
#[tokio::test]
async fn no_idempotency_baseline_really_skips_the_check() {
    for no_idempotency in [false, true] {
        let db = TestDb::create().await;
        let app = TestApp::spawn_with(&db, InjectFault::None, 4, 4096, no_idempotency).await;
        let first = app.create("retried", BODY).await;
        let retry = app.create("retried", BODY).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(retry.status, StatusCode::CREATED);
        if no_idempotency {
            assert_ne!(
                first.json()["order_id"],
                retry.json()["order_id"],
                "the retry got a new order"
            );
            let two = Counts {
                keys: 0,
                orders: 2,
                outbox: 2,
            };
            assert_eq!(counts(&db).await, two, "two orders, no key stored");
            let replies = futures::future::join_all((0..10).map(|_| app.create("hot", BODY))).await;
            assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
            assert_eq!(counts(&db).await.orders, 12, "one order per request");
        } else {
            assert_eq!(retry, first, "the retry replays the first response");
            assert_eq!(counts(&db).await, n(1));
        }
        let missing = app.post(None, Some("application/json"), BODY).await;
        assert_eq!(missing.status, StatusCode::BAD_REQUEST);
        assert_eq!(missing.error_code(), "missing_idempotency_key");
        app.stop().await;
    }
}
