//! `payments_consumer_lag` and its age: the events no commit covers yet,
//! while the database refuses them and after.

use std::time::Duration;

use pipeline::db::ServiceRole;
use pipeline::testing::{Service, TestDb, TestTopic, eventually};
use sqlx::PgPool;

use super::{CHARGES, config, count, events, produce_events, spawn_payments};

/// The series of `payments_consumer_lag` (one per owned partition): how
/// many there are and their sum.
async fn consumer_lag(consumer: &Service) -> (usize, f64) {
    let text = reqwest::get(consumer.metrics_url())
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    text.lines()
        .filter(|l| l.starts_with("payments_consumer_lag{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .fold((0, 0.0), |(n, sum), v| (n + 1, sum + v))
}

/// The largest `payments_consumer_lag_age_seconds` (one series per owned
/// partition) and how many series there are.
async fn consumer_lag_age(consumer: &Service) -> (usize, f64) {
    let text = reqwest::get(consumer.metrics_url())
        .await
        .expect("scrape")
        .text()
        .await
        .expect("text");
    text.lines()
        .filter(|l| l.starts_with("payments_consumer_lag_age_seconds{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .fold((0, 0.0), |(n, max), v| (n + 1, f64::max(max, v)))
}

/// `payments_consumer_lag` is, per owned partition, the high watermark minus
/// the group's committed offset: events the consumer cannot apply (its role
/// lost INSERT on the inbox, a transient error it retries) are lag, and the
/// lag goes back to 0 once they are applied and their offsets committed.
/// `payments_consumer_lag_age_seconds` (the age to hold against the topic's
/// retention) grows meanwhile, and is 0 again after.
#[tokio::test]
async fn consumer_lag_per_partition_is_what_no_commit_covers() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let consumer = spawn_payments(config(&db, &topic, "g-lag")).await;
    produce_events(&topic, &events(6)).await;
    // Applied, and a series per partition; the database fails right after,
    // whether or not the last batches' offsets were committed yet: they are
    // committed while the next batch waits on it, so the lag below is exactly
    // what is not applied (it read 45 when they waited for that batch).
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 6 && consumer_lag(&consumer).await.0 == 3
        })
        .await,
        "applied, a lag series per partition ({:?})",
        consumer_lag(&consumer).await
    );

    let role = ServiceRole::Payments.name();
    sqlx::query(&format!(
        "REVOKE INSERT ON fx.partitioned_inbox FROM {role}"
    ))
    .execute(&pool)
    .await
    .expect("revoke");
    produce_events(&topic, &events(40)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            consumer_lag(&consumer).await == (3, 40.0)
        })
        .await,
        "the 40 events it cannot apply are its lag ({:?})",
        consumer_lag(&consumer).await
    );
    assert_eq!(count(&pool, CHARGES).await, 6, "nothing applied meanwhile");
    // The events waiting were produced before the assertion above: their age
    // passes a few seconds while the consumer stays stuck.
    assert!(
        eventually(Duration::from_secs(30), || async {
            let (n, age) = consumer_lag_age(&consumer).await;
            n == 3 && age >= 3.0
        })
        .await,
        "the lag's age grows while nothing is applied ({:?})",
        consumer_lag_age(&consumer).await
    );

    sqlx::query(&format!("GRANT INSERT ON fx.partitioned_inbox TO {role}"))
        .execute(&pool)
        .await
        .expect("grant");
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 46 && consumer_lag(&consumer).await == (3, 0.0)
        })
        .await,
        "applied once the grant is back, and the lag is 0 again ({:?})",
        consumer_lag(&consumer).await
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            consumer_lag_age(&consumer).await == (3, 0.0)
        })
        .await,
        "no lag, no age ({:?})",
        consumer_lag_age(&consumer).await
    );
    consumer.stop().await;
}
