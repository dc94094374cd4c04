//! When the pipeline is drained: open webhook deliveries, an unmarked outbox
//! and parked events are waited for.

use std::time::Duration;

use recon::Policy;

use super::seeded;

/// Drained waits for the sender too: a delivery the receiver has applied
/// (its inbox has the event) but the sender has not marked delivered (the
/// answer was lost; its retry is still due) is not drained yet.
#[tokio::test]
async fn drained_waits_for_an_open_webhook_delivery() {
    let (_db, pool) = seeded(5).await;
    let wait = || recon::wait_drained(&pool, Duration::from_millis(300), Policy::default());
    assert!(wait().await.expect("drain query"), "the seed is drained");
    let open = "INSERT INTO orders.webhook_deliveries (destination, outbox_id, aggregate_id, msg_id, body) \
                SELECT 'd', id, aggregate_id, msg_id, payload FROM orders.outbox ORDER BY id LIMIT 1";
    sqlx::query(open).execute(&pool).await.expect(open);
    assert!(
        !wait().await.expect("drain query"),
        "an open delivery is not drained, though its event is in the inbox"
    );
    sqlx::query("UPDATE orders.webhook_deliveries SET delivered_at = now()")
        .execute(&pool)
        .await
        .expect("mark delivered");
    assert!(wait().await.expect("drain query"), "delivered: drained");
}

/// Under a relay that leaves the outbox unmarked (Debezium), published_at
/// stays NULL on every row: recon --unmarked-outbox calls that drained and
/// clean once each event is in the inbox, and still catches one that is not.
#[tokio::test]
async fn an_unmarked_outbox_is_drained_once_every_event_is_consumed() {
    let (_db, pool) = seeded(5).await;
    let unmarked = Policy {
        unmarked_outbox: true,
        ..Policy::default()
    };
    sqlx::query("UPDATE orders.outbox SET published_at = NULL")
        .execute(&pool)
        .await
        .expect("unmark");
    let wait = |policy| recon::wait_drained(&pool, Duration::from_millis(300), policy);
    assert!(
        !wait(Policy::default()).await.expect("drain query"),
        "rows never marked: not drained for a marking relay"
    );
    assert!(
        wait(unmarked).await.expect("drain query"),
        "every event in the inbox: drained"
    );
    let mut conn = pool.acquire().await.expect("connect");
    let report = recon::reconcile(&mut conn).await.expect("recon");
    assert_eq!(report.pending_rows, 5);
    assert!(
        report.drift(Policy::default()).contains(&"pending_rows"),
        "{}",
        report.table(Policy::default())
    );
    assert!(report.is_clean(unmarked), "{}", report.table(unmarked));
    drop(conn);

    let lose = "DELETE FROM fx.partitioned_inbox WHERE msg_id = (SELECT msg_id FROM orders.outbox ORDER BY id LIMIT 1)";
    sqlx::query(lose).execute(&pool).await.expect(lose);
    assert!(
        !wait(unmarked).await.expect("drain query"),
        "an event not in the inbox: not drained"
    );
    let mut conn = pool.acquire().await.expect("connect");
    let report = recon::reconcile(&mut conn).await.expect("recon");
    assert!(
        report.drift(unmarked).contains(&"events_not_consumed"),
        "{}",
        report.table(unmarked)
    );
}

/// Drained waits for payments' parked events too (an event the inbox could
/// not record yet, applied later): even one that no outbox row accounts
/// for. While one waits, recon reports it and calls it drift.
#[tokio::test]
async fn drained_waits_for_a_parked_event_and_recon_reports_it() {
    let (_db, pool) = seeded(5).await;
    let wait = || recon::wait_drained(&pool, Duration::from_millis(300), Policy::default());
    assert!(wait().await.expect("drain query"), "the seed is drained");
    let park = "INSERT INTO payments.parked (msg_id, order_id, account_id, amount_cents, payload_hash, \
                topic, partition, \"offset\", reason) \
                VALUES (gen_random_uuid(), gen_random_uuid(), 1, 1, 0, 't', 0, 0, 'parked')";
    sqlx::query(park).execute(&pool).await.expect(park);
    assert!(
        !wait().await.expect("drain query"),
        "a parked event is not drained"
    );
    let mut tx = pool.begin().await.expect("begin");
    let report = recon::reconcile(&mut tx).await.expect("recon");
    assert_eq!(report.parked_events, 1);
    assert!(
        report.drift(Policy::default()).contains(&"parked_events"),
        "{}",
        report.table(Policy::default())
    );
    assert!(
        report
            .table(Policy::default())
            .contains("events parked, not applied"),
        "the table names it"
    );
    tx.rollback().await.expect("rollback");
    sqlx::query("DELETE FROM payments.parked")
        .execute(&pool)
        .await
        .expect("apply it");
    assert!(wait().await.expect("drain query"), "applied: drained");
}
