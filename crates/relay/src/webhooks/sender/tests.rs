//! The webhook sender's unit tests.

use super::*;
use crate::webhooks::admin::{ReceiverHorizon, replay_failed};
use effectively::webhook::Secret;
use uuid::Uuid;

/// A sender paused past its lease (before the delivery failed and was
/// replayed) records its stale result nowhere: the replay's attempt of
/// the same number is another attempt. And the attempts log keeps both
/// runs' attempt 1.
#[tokio::test]
async fn a_stale_result_from_before_a_replay_is_not_recorded_over_it() {
    use pipeline::db::ServiceRole;
    let db = pipeline::testing::TestDb::create().await;
    let pool = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect");
    let owner = PgPool::connect(&db.url).await.expect("connect");
    let secret = Secret::generate().to_whsec();
    let d: Destination = format!("p=http://127.0.0.1:9/h,secret={secret},allow-http")
        .parse()
        .expect("destination");
    sqlx::query(
        "INSERT INTO orders.webhook_deliveries (destination, outbox_id, aggregate_id, msg_id, body) \
         VALUES ('p', 1, $1, $2, '\\x7b7d')",
    )
    .bind(Uuid::now_v7())
    .bind(Uuid::now_v7())
    .execute(&owner)
    .await
    .expect("delivery");
    let sender = Sender::new(
        pool.clone(),
        Specs::Plaintext,
        Arc::new(RelayMetrics::new().expect("metrics")),
        Arc::new(Crasher::default()),
        Egress::public_only(),
        1.0,
    );
    let lease = Duration::from_secs(60);
    let stale = claim(&pool, "p", 10, lease).await.expect("claim");
    assert_eq!(stale.len(), 1);
    // Meanwhile the delivery failed for good and an operator replayed it.
    sqlx::query("UPDATE orders.webhook_deliveries SET failed_at = now()")
        .execute(&owner)
        .await
        .expect("fail");
    let (replayed, _) = replay_failed(&pool, None, None, &ReceiverHorizon::default())
        .await
        .expect("replay");
    assert_eq!(replayed, 1);
    let fresh = claim(&pool, "p", 10, lease).await.expect("claim");
    assert_eq!(fresh.len(), 1);
    assert_eq!(fresh[0].attempts, stale[0].attempts, "the same number");

    let now = Utc::now();
    let gone = Outcome::Gone("stale".into());
    let recorded = sender
        .record(&d, &stale[0], &gone, now, Duration::ZERO, 0.5)
        .await
        .expect("record");
    assert_eq!(recorded, None, "the stale result is fenced off");
    let disabled: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM orders.webhook_destinations WHERE disabled_at IS NOT NULL",
    )
    .fetch_one(&owner)
    .await
    .expect("destinations");
    assert_eq!(disabled, 0, "nothing of the stale result took effect");
    let recorded = sender
        .record(
            &d,
            &fresh[0],
            &Outcome::Delivered(200),
            now,
            Duration::ZERO,
            0.5,
        )
        .await
        .expect("record");
    assert_eq!(recorded, Some("delivered"));
    let (delivered, logged): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM orders.webhook_deliveries WHERE delivered_at IS NOT NULL), \
                (SELECT count(*) FROM orders.webhook_attempts WHERE replay = 1 AND attempt = 1)",
    )
    .fetch_one(&owner)
    .await
    .expect("state");
    assert_eq!((delivered, logged), (1, 1));
}
