//! Expiry and the dedup horizon: messages older than the inbox's oldest
//! partition refused, late duplicates applied again only with the refusal off,
//! and the partitions tiling the window.

use std::time::Duration;

use effectively::v7::{minted_ago, minted_ahead};
use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, TestTopic, eventually};
use sqlx::PgPool;
use uuid::Uuid;

use super::{CHARGES, INBOX, LEDGER, config, count, events, produce_events, spawn_payments};

/// The library's first partition of the inbox: every msg_id minted before
/// the migration made it (the nil uuid's, 1970's, name).
const FIRST_PARTITION: &str = "pinbox_19700101t000000000";

/// Expiry drops whole partitions; a message older than the oldest partition
/// kept is dead-lettered as after the dedup horizon and never applied; one
/// minted a month ahead is refused too (`ahead_of_clock`); the rest is
/// charged.
#[tokio::test]
async fn after_expiry_a_late_message_is_refused_not_applied() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(2).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // Minted an hour before the migration made its first partition: in the
    // first partition (every msg_id minted before the migration), which an
    // expiry with retention 0 drops.
    let mut late = events(3);
    for e in &mut late {
        e.msg_id = minted_ago(Duration::from_secs(3600));
    }
    let mut future = events(1);
    future[0].msg_id = minted_ahead(Duration::from_secs(30 * 86_400));
    let fresh = events(5);
    let dropped: Vec<String> =
        sqlx::query_scalar("SELECT fx.partitioned_inbox_expire('payments', '0s')")
            .fetch_all(&pool)
            .await
            .expect("expire");
    assert_eq!(
        dropped,
        [FIRST_PARTITION],
        "only the partition wholly in the past"
    );
    produce_events(&topic, &late).await;
    produce_events(&topic, &future).await;
    produce_events(&topic, &fresh).await;

    let consumer = spawn_payments(config(&db, &topic, "g-late")).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 5
                && count(&pool, "SELECT count(*) FROM payments.dead_letters").await == 4
        })
        .await,
        "the fresh events charged, the late ones and the future one dead-lettered"
    );
    let ahead: Vec<Uuid> = sqlx::query_scalar(
        "SELECT msg_id FROM payments.dead_letters WHERE kind = 'ahead_of_clock'",
    )
    .fetch_all(&pool)
    .await
    .expect("ahead of clock");
    assert_eq!(ahead, [future[0].msg_id]);
    let kinds: Vec<(String, Uuid, String)> = sqlx::query_as(
        "SELECT kind, msg_id, reason FROM payments.dead_letters \
         WHERE kind <> 'ahead_of_clock' ORDER BY kind, msg_id",
    )
    .fetch_all(&pool)
    .await
    .expect("dead letters");
    let mut late_ids: Vec<Uuid> = late.iter().map(|e| e.msg_id).collect();
    late_ids.sort();
    for ((kind, msg_id, reason), expected) in kinds.iter().zip(&late_ids) {
        assert_eq!(kind, "after_horizon");
        assert_eq!(msg_id, expected);
        assert!(
            reason.starts_with("arrived after the dedup horizon"),
            "{reason}"
        );
    }
    assert_eq!(kinds.len(), 3);
    assert_eq!(consumer.metric("payments_after_horizon_total").await, 3.0);
    assert_eq!(consumer.metric("payments_ahead_of_clock_total").await, 1.0);
    assert!(consumer.metric("payments_inbox_partitions").await >= 2.0);
    assert_eq!(
        consumer.metric("payments_redelivery_horizon_seconds").await,
        (15 * 86_400 + 600) as f64,
        "the horizon of the topic as the project creates it"
    );
    // Not one of them touched the inbox or the ledger.
    assert_eq!(count(&pool, INBOX).await, 5);
    assert_eq!(count(&pool, LEDGER).await, 5);
    consumer.stop().await;
}

/// The resurrection that expiry must never allow, on purpose: an event is
/// charged, its partition expires, and the group is replayed from the start.
/// With `--unsafe-apply-after-horizon` the late duplicate is applied again
/// (a second ledger entry: a double charge; the charge row's own guard holds);
/// with the refusal on (the default) it is dead-lettered, naming its order
/// and msg_id, which are the order's charge's: a provable late duplicate.
#[tokio::test]
async fn a_late_duplicate_is_applied_twice_only_when_the_refusal_is_off() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // In the first partition (every msg_id minted before the migration),
    // which an expiry with retention 0 drops.
    let mut old = events(2);
    for e in &mut old {
        e.msg_id = minted_ago(Duration::from_secs(3600));
    }
    produce_events(&topic, &old).await;
    let first = spawn_payments(config(&db, &topic, "g-first")).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, LEDGER).await == 2
        })
        .await,
        "charged once, before expiry"
    );
    first.stop().await;
    let dropped: Vec<String> =
        sqlx::query_scalar("SELECT fx.partitioned_inbox_expire('payments', '0s')")
            .fetch_all(&pool)
            .await
            .expect("expire");
    assert_eq!(dropped, [FIRST_PARTITION]);

    // A new group reads the topic from the start: the same two events again.
    let mut unsafe_config = config(&db, &topic, "g-unsafe");
    unsafe_config.unsafe_apply_after_horizon = true;
    let replay = spawn_payments(unsafe_config).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, LEDGER).await == 4
        })
        .await,
        "the refusal off: both duplicates applied again"
    );
    assert_eq!(
        replay.metric("payments_applied_after_horizon_total").await,
        2.0
    );
    replay.stop().await;
    assert_eq!(
        count(&pool, CHARGES).await,
        2,
        "the charge rows' guard holds"
    );
    assert_eq!(
        count(&pool, INBOX).await,
        0,
        "no partition to record them in"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM payments.dead_letters").await,
        0
    );

    let refusing = spawn_payments(config(&db, &topic, "g-safe")).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, "SELECT count(*) FROM payments.dead_letters").await == 2
        })
        .await,
        "the refusal on: both dead-lettered"
    );
    refusing.stop().await;
    assert_eq!(count(&pool, LEDGER).await, 4, "nothing more applied");
    let late_duplicates = count(
        &pool,
        "SELECT count(*) FROM payments.dead_letters d JOIN payments.charges c \
         ON c.order_id = d.order_id AND c.msg_id = d.msg_id WHERE d.kind = 'after_horizon'",
    )
    .await;
    assert_eq!(
        late_duplicates, 2,
        "each names its order and the msg_id that charged it"
    );
}

/// The partitions tile one window without gaps; expiry drops only partitions
/// wholly older than the retention; and the database itself has no place for
/// an expired msg_id (no DEFAULT partition), so even a writer that skipped
/// the window check could not record it.
#[tokio::test]
async fn partitions_tile_the_window_and_an_expired_msg_id_has_no_place() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url_as(ServiceRole::Payments))
        .await
        .expect("connect as payments");
    let made = payments::expiry::extend(
        &pool,
        Duration::from_secs(3 * 86_400),
        Duration::from_secs(3600),
    )
    .await
    .expect("extend as the payments role");
    assert!(
        made >= 24,
        "hourly partitions for the third day ahead: {made}"
    );
    let bounds: Vec<(Uuid, Uuid)> =
        sqlx::query_as("SELECT lo, hi FROM fx.partitioned_inbox_parts ORDER BY lo")
            .fetch_all(&pool)
            .await
            .expect("bounds");
    assert_eq!(
        bounds[0].0,
        Uuid::nil(),
        "the first partition starts at the bottom"
    );
    for pair in bounds.windows(2) {
        assert_eq!(pair[0].1, pair[1].0, "no gap, no overlap");
    }
    let (n, floor, ceiling) = payments::expiry::partitions(&pool)
        .await
        .expect("partitions");
    assert_eq!(n as usize, bounds.len());
    assert_eq!(floor, Some(Uuid::nil()));
    assert_eq!(
        ceiling,
        bounds.last().map(|b| b.1),
        "the newest partition's end"
    );

    // The SQL and the Rust reading of a UUIDv7's time agree.
    let id = Uuid::now_v7();
    let sql_ms: f64 =
        sqlx::query_scalar("SELECT extract(epoch FROM effectively.v7_time($1))::float8 * 1000")
            .bind(id)
            .fetch_one(&pool)
            .await
            .expect("v7_time");
    assert_eq!(
        sql_ms.round() as i64,
        effectively::v7::mint_time(id).timestamp_millis()
    );

    let old = minted_ago(Duration::from_secs(2 * 3600));
    sqlx::query("INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) VALUES ('payments', $1, '')")
        .bind(old)
        .execute(&pool)
        .await
        .expect("before expiry the first partition takes it");
    let dropped = payments::expiry::expire(&pool, Duration::ZERO)
        .await
        .expect("expire as the payments role");
    assert_eq!(dropped, [FIRST_PARTITION]);
    let (_, floor, _) = payments::expiry::partitions(&pool)
        .await
        .expect("partitions");
    assert_eq!(floor, Some(bounds[1].0));
    let again = sqlx::query(
        "INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) VALUES ('payments', $1, '')",
    )
        .bind(old)
        .execute(&pool)
        .await;
    match again {
        Err(sqlx::Error::Database(e)) => {
            assert_eq!(e.code().as_deref(), Some("23514"), "{e}");
            assert!(e.message().contains("no partition"), "{e}");
        }
        other => panic!("an expired msg_id must have no partition: {other:?}"),
    }
    // The payments role cannot make or drop tables itself.
    let refused = sqlx::query("DROP TABLE fx.partitioned_inbox_parts")
        .execute(&pool)
        .await;
    assert!(refused.is_err());
}
