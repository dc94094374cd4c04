//! `recon --committed-past` against a seeded database: each message the
//! consumer group committed past must be recorded (its msg_id in the inbox,
//! a dead letter at its position, or parked); one that is not is a lost
//! effect, and an event whose outbox row is gone is named too.

use pipeline::testing::TestDb;
use recon::{CommittedMessage, CommittedReport, Floors, check_committed, check_committed_below};
use sqlx::PgPool;
use uuid::Uuid;

fn message(offset: i64, msg_id: Option<Uuid>, aggregate_id: Option<Uuid>) -> CommittedMessage {
    CommittedMessage {
        topic: "order.events".into(),
        partition: 0,
        offset,
        msg_id,
        aggregate_id,
    }
}

#[tokio::test]
async fn what_the_group_committed_past_must_be_recorded() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    recon::seed::seed(&pool, 5).await.expect("seed");
    let events: Vec<(Uuid, Uuid)> =
        sqlx::query_as("SELECT msg_id, aggregate_id FROM orders.outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("the seed's events");
    assert_eq!(events.len(), 5);
    let mut messages: Vec<CommittedMessage> = events
        .iter()
        .zip(0..)
        .map(|(&(m, a), offset)| message(offset, Some(m), Some(a)))
        .collect();
    // The seed expires nothing: its floors are at the bottom.
    let clean = check_committed(&pool, &messages).await.expect("check");
    assert_eq!(
        clean,
        CommittedReport {
            messages: 5,
            recorded: 5,
            ..CommittedReport::default()
        }
    );
    assert!(clean.is_clean());

    // Not an envelope, dead-lettered at its position: recorded.
    sqlx::query(
        "INSERT INTO payments.dead_letters (topic, partition, \"offset\", reason) \
         VALUES ('order.events', 0, 5, 'not an event envelope')",
    )
    .execute(&pool)
    .await
    .expect("dead letter");
    messages.push(message(5, None, None));
    // Not an envelope and no dead letter: lost.
    messages.push(message(6, None, None));
    // An event the database has no trace of, its order above the floors:
    // its effect lost, its outbox row gone.
    messages.push(message(7, Some(Uuid::now_v7()), Some(Uuid::now_v7())));
    // Parked: recorded (payments applies it later).
    let parked = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO payments.parked (msg_id, order_id, account_id, amount_cents, payload_hash, \
         topic, partition, \"offset\", reason) VALUES ($1, $2, 1, 1, 0, 'order.events', 0, 8, 'parked')",
    )
    .bind(parked)
    .bind(events[0].1)
    .execute(&pool)
    .await
    .expect("park");
    messages.push(message(8, Some(parked), Some(events[0].1)));
    let dirty = check_committed(&pool, &messages).await.expect("check");
    assert_eq!(
        dirty,
        CommittedReport {
            messages: 9,
            recorded: 7,
            inbox_expired: 0,
            lost_effects: 2,
            // The parked event's msg_id has no outbox row either.
            events_without_outbox_row: 2,
        }
    );
    assert!(!dirty.is_clean());
    assert!(dirty.table().contains("lost effects (no trace at all)"));
    // The check reads the floors itself, in its own snapshot: with the
    // outbox's floor moved past every order, no missing outbox row counts.
    sqlx::query("UPDATE orders.outbox_policy SET floor = 'ffffffff-ffff-ffff-ffff-ffffffffffff'")
        .execute(&pool)
        .await
        .expect("move the outbox's floor");
    let expired_rows = check_committed(&pool, &messages).await.expect("check");
    assert_eq!(
        expired_rows.events_without_outbox_row, 0,
        "{expired_rows:?}"
    );
    assert_eq!(expired_rows.lost_effects, 2, "{expired_rows:?}");

    // Below the inbox's floor a missing inbox row may have expired by
    // design; below the outbox's, a missing outbox row.
    let high = Floors {
        inbox: Uuid::max(),
        outbox: Uuid::max(),
        ..Floors::NONE
    };
    let mut conn = pool.acquire().await.expect("connect");
    let expired = check_committed_below(&mut conn, &messages[7..8], high)
        .await
        .expect("check");
    assert_eq!(
        expired,
        CommittedReport {
            messages: 1,
            inbox_expired: 1,
            ..CommittedReport::default()
        }
    );
    assert!(expired.is_clean());
}
