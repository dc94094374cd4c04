//! Retries and failures: the schedule, a 401 from a skewed clock, refusals and
//! errors failing after the last attempt, a 410 disabling its destination
//! (replayed and enabled again), `Retry-After`, a slow destination.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, eventually};
use relay::webhooks::{Admin, ReceiverHorizon};
use sqlx::PgPool;
use uuid::Uuid;

use super::{
    Hit, OPEN, Receiver, Reply, config, count, delivered_order, enqueue, spawn_relay, specs,
};

/// A key's first event fails its first attempt: its later events wait
/// until it is delivered, another key's do not, and the retry comes after
/// the scheduled wait (5 s scaled by 0.1, with jitter: 400 to 600 ms). The
/// scale leaves the other key's four deliveries 3 s and more before the
/// held one's third try, so a busy machine does not make them look held
/// (at 0.01 they had 290 ms, and a CI run under load missed it).
#[tokio::test]
async fn a_failing_first_attempt_holds_back_its_key_only_and_is_retried_on_schedule() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (held, other) = (Uuid::now_v7(), Uuid::now_v7());
    let first = enqueue(&pool, held, 0).await;
    for seq in 1..4 {
        enqueue(&pool, held, seq).await;
    }
    for seq in 0..4 {
        enqueue(&pool, other, seq).await;
    }
    let (r, url) = Receiver::start(move |h| {
        if h.msg_id == first && h.nth < 3 {
            Reply::status(503)
        } else {
            Reply::OK
        }
    })
    .await;
    let relay = spawn_relay(config(&db, vec![r.destination("r", &url, "")], 0.1)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, OPEN).await == 0 && r.hits().len() == 10
        })
        .await,
        "{:?}",
        r.hits()
    );
    let hits = r.hits();
    let order = delivered_order(&hits);
    assert_eq!(order[&held], vec![0, 1, 2, 3]);
    assert_eq!(order[&other], vec![0, 1, 2, 3]);
    let tries: Vec<&Hit> = hits.iter().filter(|h| h.msg_id == first).collect();
    assert_eq!(tries.len(), 3, "two 503s, then 200");
    let delivered_at = tries[2].at;
    assert!(
        hits.iter()
            .filter(|h| h.key == held && h.msg_id != first)
            .all(|h| h.at > delivered_at),
        "the key's later events came after its first was delivered"
    );
    assert!(
        hits.iter()
            .filter(|h| h.key == other)
            .all(|h| h.at < delivered_at),
        "the other key did not wait"
    );
    // 5 s and 30 s, scaled by 0.1, with jitter x[0.8, 1.2].
    let (w1, w2) = (tries[1].at - tries[0].at, tries[2].at - tries[1].at);
    assert!(w1 >= Duration::from_millis(400), "first wait {w1:?}");
    assert!(w2 >= Duration::from_millis(2400), "second wait {w2:?}");
    let attempts: Vec<(i32, Option<i32>, String)> = sqlx::query_as(
        "SELECT a.attempt, a.status, a.outcome FROM orders.webhook_attempts a \
         JOIN orders.webhook_deliveries d USING (destination, outbox_id) \
         WHERE d.msg_id = $1 ORDER BY a.attempt",
    )
    .bind(first)
    .fetch_all(&pool)
    .await
    .expect("attempts");
    assert_eq!(
        attempts,
        vec![
            (1, Some(503), "retry".to_owned()),
            (2, Some(503), "retry".to_owned()),
            (3, Some(200), "delivered".to_owned()),
        ]
    );
    relay.stop().await;
}

/// A receiver whose clock runs 10 minutes ahead of the sender's refuses
/// the first two attempts with 401 (their `webhook-timestamp` is outside its
/// 5-minute tolerance as it sees them), and takes the third (say its
/// operator widened the tolerance): a 401 is retried on the schedule like a
/// 5xx, never given up at once, and the delivery ends delivered. The sender
/// counted each answer by status and measured the skew from the answers'
/// `Date`.
#[tokio::test]
async fn a_401_from_a_receiver_with_a_skewed_clock_is_retried_until_delivered() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let msg_id = enqueue(&pool, Uuid::now_v7(), 0).await;
    let ahead: i64 = 600;
    let (r, url) = Receiver::start(move |h| Reply {
        clock_off: Some(ahead),
        ..Reply::status(if h.nth <= 2 { 401 } else { 200 })
    })
    .await;
    let relay = spawn_relay(config(&db, vec![r.destination("r", &url, "")], 0.01)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE delivered_at IS NOT NULL OR failed_at IS NOT NULL").await == 1
        })
        .await,
        "{:?}",
        r.hits()
    );
    let (attempts, delivered, failed): (i32, bool, bool) = sqlx::query_as(
        "SELECT attempts, delivered_at IS NOT NULL, failed_at IS NOT NULL \
         FROM orders.webhook_deliveries WHERE msg_id = $1",
    )
    .bind(msg_id)
    .fetch_one(&pool)
    .await
    .expect("the delivery");
    assert_eq!(
        (attempts, delivered, failed),
        (3, true, false),
        "(attempts, delivered, failed): two 401s retried, then delivered"
    );
    let answers: Vec<(i32, Option<i32>, String)> = sqlx::query_as(
        "SELECT attempt, status, outcome FROM orders.webhook_attempts ORDER BY attempt",
    )
    .fetch_all(&pool)
    .await
    .expect("attempts");
    assert_eq!(
        answers,
        vec![
            (1, Some(401), "retry".to_owned()),
            (2, Some(401), "retry".to_owned()),
            (3, Some(200), "delivered".to_owned()),
        ]
    );
    assert_eq!(
        relay
            .metric(r#"relay_webhook_failed_total{destination="r"}"#)
            .await,
        0.0
    );
    assert_eq!(
        relay
            .metric(r#"relay_webhook_responses_total{destination="r",status="401"}"#)
            .await,
        2.0
    );
    assert_eq!(
        relay
            .metric(r#"relay_webhook_responses_total{destination="r",status="200"}"#)
            .await,
        1.0
    );
    // Receiver minus sender, to the Date's whole second (and the answer's
    // time in flight).
    let skew = relay
        .metric(r#"relay_webhook_clock_skew_seconds{destination="r"}"#)
        .await;
    assert!(
        ((ahead - 2) as f64..=(ahead + 1) as f64).contains(&skew),
        "skew {skew}"
    );
    relay.stop().await;
}

/// A 4xx (here 422) or a 5xx on every attempt fails a delivery after its
/// last attempt, not before; then the key's next event goes on. A 410
/// disables its destination and leaves the delivery pending.
#[tokio::test]
async fn refusals_and_errors_fail_after_the_last_attempt_and_gone_disables_the_destination() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (k1, k2) = (Uuid::now_v7(), Uuid::now_v7());
    let refused = enqueue(&pool, k1, 0).await;
    enqueue(&pool, k1, 1).await;
    let broken = enqueue(&pool, k2, 0).await;
    enqueue(&pool, k2, 1).await;
    let healed = Arc::new(AtomicBool::new(false));
    let h1 = healed.clone();
    let (r, url) = Receiver::start(move |h| {
        if h1.load(Ordering::SeqCst) {
            Reply::OK
        } else if h.msg_id == refused {
            Reply::status(422)
        } else if h.msg_id == broken {
            Reply::status(500)
        } else {
            Reply::OK
        }
    })
    .await;
    let h2 = healed.clone();
    let (gone, gone_url) = Receiver::start(move |_| {
        if h2.load(Ordering::SeqCst) {
            Reply::OK
        } else {
            Reply::status(410)
        }
    })
    .await;
    let relay = spawn_relay(config(
        &db,
        vec![
            r.destination("r", &url, ",max-attempts=3"),
            gone.destination("gone", &gone_url, ",concurrency=1"),
        ],
        0.01,
    ))
    .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'r' AND (delivered_at IS NOT NULL OR failed_at IS NOT NULL)").await == 4
        })
        .await
    );
    let hits = r.hits();
    assert_eq!(
        hits.iter().filter(|h| h.msg_id == refused).count(),
        3,
        "422: max-attempts, like a 5xx"
    );
    assert_eq!(
        hits.iter().filter(|h| h.msg_id == broken).count(),
        3,
        "500: max-attempts"
    );
    let order = delivered_order(&hits);
    assert_eq!((order[&k1].clone(), order[&k2].clone()), (vec![1], vec![1]));
    let failed: Vec<(Uuid, i32, Option<i32>, Option<String>)> = sqlx::query_as(
        "SELECT msg_id, attempts, last_status, last_error FROM orders.webhook_deliveries \
         WHERE destination = 'r' AND failed_at IS NOT NULL ORDER BY outbox_id",
    )
    .fetch_all(&pool)
    .await
    .expect("failed");
    assert_eq!(failed.len(), 2);
    assert_eq!(
        (failed[0].0, failed[0].1, failed[0].2),
        (refused, 3, Some(422))
    );
    assert_eq!(
        (failed[1].0, failed[1].1, failed[1].2),
        (broken, 3, Some(500))
    );
    assert!(failed[1].3.as_deref().is_some_and(|e| e.contains("500")));
    assert_eq!(
        relay
            .metric(r#"relay_webhook_failed_total{destination="r"}"#)
            .await,
        2.0
    );

    // The 410: one attempt, then the destination is disabled.
    assert!(
        eventually(Duration::from_secs(10), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_destinations WHERE destination = 'gone' AND disabled_at IS NOT NULL").await == 1
        })
        .await
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        gone.hits().len(),
        1,
        "nothing more is sent to a disabled destination"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'gone' AND delivered_at IS NULL AND failed_at IS NULL").await,
        4,
        "its deliveries wait"
    );

    // The receivers are fixed: the operator replays the failed deliveries
    // and enables the destination; everything is delivered.
    healed.store(true, Ordering::SeqCst);
    let as_relay = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as relay");
    let replay = Admin::Replay {
        failed: true,
        destination: Some("r".into()),
        since: None,
        horizon: ReceiverHorizon::default(),
    };
    assert_eq!(
        replay.run(&as_relay, &specs()).await.expect("replay"),
        "2 failed deliveries queued again\n"
    );
    let enable = Admin::Enable {
        destination: "gone".into(),
        horizon: ReceiverHorizon::default(),
    };
    assert_eq!(
        enable.run(&as_relay, &specs()).await.expect("enable"),
        "destination gone enabled\n"
    );
    assert!(
        Admin::Enable {
            destination: "nowhere".into(),
            horizon: ReceiverHorizon::default(),
        }
        .run(&as_relay, &specs())
        .await
        .is_err()
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(
                &pool,
                "SELECT count(*) FROM orders.webhook_deliveries WHERE delivered_at IS NOT NULL",
            )
            .await
                == 8
        })
        .await
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.webhook_deliveries WHERE replays = 1"
        )
        .await,
        2
    );
    let status = Admin::Status
        .run(&as_relay, &specs())
        .await
        .expect("status");
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("gone ") && l.contains(" 4 ") && l.ends_with("enabled")),
        "{status}"
    );
    relay.stop().await;
}

#[tokio::test]
async fn retry_after_is_honoured_and_a_slow_destination_delays_no_other() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    for key in &keys {
        enqueue(&pool, *key, 0).await;
    }
    // Slower than its timeout, every time.
    let (slow, slow_url) = Receiver::start(|_| Reply {
        delay: Duration::from_secs(5),
        ..Reply::OK
    })
    .await;
    // 429 with Retry-After: 1 on each first attempt.
    let (busy, busy_url) = Receiver::start(|h| {
        if h.nth == 1 {
            Reply {
                retry_after: Some(1),
                ..Reply::status(429)
            }
        } else {
            Reply::OK
        }
    })
    .await;
    let (fast, fast_url) = Receiver::start(|_| Reply::OK).await;
    let started = Instant::now();
    let relay = spawn_relay(config(
        &db,
        vec![
            slow.destination("slow", &slow_url, ",timeout=1s,concurrency=2"),
            busy.destination("busy", &busy_url, ""),
            fast.destination("fast", &fast_url, ""),
        ],
        0.001,
    ))
    .await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'fast' AND delivered_at IS NOT NULL").await == 20
        })
        .await
    );
    let fast_done = started.elapsed();
    assert!(
        fast_done < Duration::from_secs(5),
        "the fast destination finished in {fast_done:?} beside a slow one"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'slow' AND delivered_at IS NOT NULL").await,
        0,
        "the slow one answers after its timeout: never delivered"
    );
    assert!(
        eventually(Duration::from_secs(20), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'busy' AND delivered_at IS NOT NULL").await == 20
        })
        .await
    );
    let hits = busy.hits();
    for key in &keys {
        let tries: Vec<&Hit> = hits.iter().filter(|h| h.key == *key).collect();
        assert_eq!(tries.len(), 2);
        let waited = tries[1].at - tries[0].at;
        // The schedule's 5 ms (scaled) would retry at once: Retry-After rules.
        assert!(waited >= Duration::from_millis(950), "waited {waited:?}");
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'slow' AND last_error LIKE 'timed out%' AND last_status IS NULL").await > 0
        })
        .await,
        "an attempt past its timeout is recorded as timed out"
    );
    relay.stop().await;
}
