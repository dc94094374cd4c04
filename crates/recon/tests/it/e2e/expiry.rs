//! After expiry: recon checks what the stores kept, keys that outlive the key
//! floor are not drift, and a recon between two expiry batches is clean.

use recon::Policy;

use super::{seeded, shared};

/// After the keys, the published outbox rows and the inbox's oldest
/// partition expired, recon checks each order against what still covers it
/// (orders, charges and the ledger never expire), stays CLEAN, says where
/// each store starts, and still catches drift in what is covered.
#[tokio::test]
async fn recon_checks_what_the_stores_kept_after_expiry() {
    let (_db, pool) = seeded(40).await;
    let mut conn = pool.acquire().await.expect("connect");
    let before = recon::reconcile(&mut conn).await.expect("recon");
    assert_eq!(before.floors, recon::Floors::NONE);
    assert!(
        before
            .table(Policy::default())
            .contains("keys: all; events: all")
    );
    drop(conn);

    // Expire everything the seed made (its ids are minted in 1970).
    for sql in [
        "UPDATE orders.key_policy SET retention = interval '1 millisecond'",
        "UPDATE orders.outbox_policy SET retention = interval '1 millisecond'",
        "SELECT orders.keys_expire(1000)",
        "SELECT orders.outbox_expire(1000)",
        "SELECT fx.partitioned_inbox_expire('payments', interval '0')",
    ] {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    let mut conn = pool.acquire().await.expect("connect");
    let after = recon::reconcile_in_parts(&pool, 3).await.expect("recon");
    let table = after.table(Policy::default());
    assert!(after.is_clean(Policy::default()), "{table}");
    assert_eq!(
        (after.intents, after.outbox_rows, after.inbox_msg_ids),
        (0, 0, 0)
    );
    assert_eq!((after.distinct_orders, after.distinct_charges), (40, 40));
    assert!(after.floors.keys > uuid::Uuid::nil() && after.floors.outbox > uuid::Uuid::nil());
    assert!(table.contains("keys: since 20"), "{table}");
    assert_eq!(
        after,
        recon::reconcile(&mut conn).await.expect("recon"),
        "in parts or whole"
    );

    // Charges and the ledger are still checked for every order...
    sqlx::query(
        "INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
         SELECT account_id, order_id, msg_id, amount_cents FROM payments.ledger \
         WHERE order_id = '00000000000000000000000000000007'::uuid",
    )
    .execute(&mut *conn)
    .await
    .expect("double");
    // ... and an order minted after the floors still needs its key and event.
    sqlx::query(
        "INSERT INTO orders.orders (order_id, account_id, amount_cents, status) \
         VALUES (effectively.v7_floor(now() + interval '1 second'), 1, 100, 'created')",
    )
    .execute(&mut *conn)
    .await
    .expect("new order");
    let drift = recon::reconcile(&mut conn).await.expect("recon");
    let names = drift.drift(Policy::default());
    for name in [
        "double_charges",
        "orders_without_key",
        "orders_without_event",
        "orders_without_charge",
    ] {
        assert!(names.contains(&name), "{name} in {names:?}");
    }
}

/// A key is deleted when its order id is below the cut and its own
/// `created_at` (the database's clock at the insert) is older than the
/// retention. A key's `created_at` lags its order id's mint time (the
/// request's queue and the writers' linger, more with a slow orders clock),
/// so keys below the cut survive a pass while the key floor moves to the
/// cut. Recon counts intents from the floor up, as it counts the orders
/// that need one: CLEAN on such a database, and still CLEAN once those keys
/// expire too. (Before, recon counted every key as an intent and only the
/// orders from the floor up: "distinct_orders - intents" was -5.)
#[tokio::test]
async fn keys_that_outlive_the_key_floor_are_not_drift() {
    let (_db, pool) = seeded(40).await;
    // The seed's order ids are minted in 1970; its keys were written two
    // hours ago, but five of them only now.
    let written = "UPDATE fx.idempotency_keys SET created_at = now() - interval '2 hours'";
    let lagging = "UPDATE fx.idempotency_keys SET created_at = now() \
                   WHERE reference IN (SELECT reference FROM fx.idempotency_keys \
                                       ORDER BY reference OFFSET 20 LIMIT 5)";
    for sql in [
        written,
        lagging,
        "UPDATE orders.key_policy SET retention = interval '1 hour'",
    ] {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    let expired: i32 = sqlx::query_scalar("SELECT orders.keys_expire(1000)")
        .fetch_one(&pool)
        .await
        .expect("expire");
    assert_eq!(expired, 35, "the keys younger than the retention survive");
    let below: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fx.idempotency_keys \
         WHERE effectively.uuid_of(reference) < (SELECT floor FROM orders.key_policy)",
    )
    .fetch_one(&pool)
    .await
    .expect("below the floor");
    assert_eq!(below, 5, "the floor moved past the surviving keys");

    let mut conn = pool.acquire().await.expect("connect");
    let whole = recon::reconcile(&mut conn).await.expect("recon");
    let table = whole.table(Policy::default());
    assert!(whole.is_clean(Policy::default()), "{table}");
    assert_eq!(
        (
            whole.intents,
            whole.orders_since_key_floor,
            whole.distinct_orders
        ),
        (0, 0, 40)
    );
    for jobs in [1, 3, 7] {
        let parts = recon::reconcile_in_parts(&pool, jobs).await.expect("recon");
        assert_eq!(parts, whole, "--jobs {jobs}");
    }

    // The client's successes: an expired key is matched by the order it was
    // given (orders never expire); a success whose order is not there is
    // missing, expired key or not.
    let mut succeeded: Vec<(String, uuid::Uuid)> = (1..=40_u128)
        .map(|i| (format!("seed-{i}"), uuid::Uuid::from_u128(i)))
        .collect();
    let client = recon::ClientIntents {
        succeeded: shared(&succeeded),
        ambiguous: vec![],
        failed: vec![],
    };
    let intents = recon::check_intents(&pool, &client).await.expect("intents");
    assert!(intents.is_clean(), "{}", intents.table());
    assert_eq!((intents.matched, intents.key_expired), (40, 35));
    succeeded.push(("seed-lost".into(), uuid::Uuid::from_u128(1000)));
    let lost = recon::check_intents(
        &pool,
        &recon::ClientIntents {
            succeeded: shared(&succeeded),
            ambiguous: vec![],
            failed: vec![],
        },
    )
    .await
    .expect("intents");
    assert_eq!((lost.matched, lost.missing_in_db), (40, 1));
    assert!(!lost.is_clean());

    // A key below the floor is still checked for pointing at an order.
    sqlx::query(
        "UPDATE fx.idempotency_keys SET reference = '00000000-0000-0000-0000-0000000000ff' \
         WHERE reference = (SELECT reference FROM fx.idempotency_keys ORDER BY reference LIMIT 1)",
    )
    .execute(&mut *conn)
    .await
    .expect("orphan key");
    let drift = recon::reconcile(&mut conn).await.expect("recon");
    let names = drift.drift(Policy::default());
    assert!(names.contains(&"intents_without_order"), "{names:?}");
}

/// Expiry drains in batches, one transaction each (`pipeline::lifecycle`),
/// and a recon may run between two of them: each batch's transaction moves
/// its store's floor up to the cut before it deletes below it, so what recon
/// checks (everything at and above the floors) is all there after any batch.
/// (Before, the floor moved only when a call found fewer than a batch left:
/// between two batches the deleted keys' and events' orders lay above the
/// old floor, and recon called them drift.)
#[tokio::test]
async fn a_recon_between_two_expiry_batches_is_clean() {
    let (_db, pool) = seeded(40).await;
    for sql in [
        "UPDATE fx.idempotency_keys SET created_at = now() - interval '2 hours'",
        "UPDATE orders.key_policy SET retention = interval '1 hour'",
        "UPDATE orders.outbox_policy SET retention = interval '1 hour'",
    ] {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    for (store, expire) in [
        ("keys", "SELECT orders.keys_expire(10)"),
        ("outbox", "SELECT orders.outbox_expire(10)"),
    ] {
        for batch in 1..=4 {
            let n: i32 = sqlx::query_scalar(expire)
                .fetch_one(&pool)
                .await
                .expect(expire);
            assert_eq!(n, 10, "{store}: batch {batch} deletes a whole batch");
            let report = recon::reconcile_in_parts(&pool, 2).await.expect("recon");
            assert!(
                report.is_clean(Policy::default()),
                "{store}, after batch {batch}:\n{}",
                report.table(Policy::default())
            );
        }
    }
    let mut conn = pool.acquire().await.expect("connect");
    let after = recon::reconcile(&mut conn).await.expect("recon");
    assert_eq!((after.intents, after.outbox_rows), (0, 0));
    assert_eq!(after.distinct_charges, 40);
}
