//! The outbox in the caller's transaction: an event exists if and only if
//! its transaction commits; any executor; a batch's order.

use std::time::Duration;

use effectively::store::Event;
use sqlx::Connection;
use sqlx::postgres::PgListener;
use uuid::Uuid;

use super::{count, store};

#[tokio::test]
async fn an_event_exists_if_and_only_if_its_transaction_commits() {
    let (_db, pool, fx) = store("shop_fx").await;
    sqlx::query("CREATE TABLE carts (id int PRIMARY KEY)")
        .execute(&pool)
        .await
        .expect("test step");
    let outbox = fx.outbox();
    let mut listener = PgListener::connect_with(&pool).await.expect("connect");
    listener.listen("shop_fx.outbox").await.expect("connect");

    // Rolled back: neither the cart nor its event.
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO carts VALUES (1)")
        .execute(&mut *tx)
        .await
        .expect("the statement");
    let lost = Event::json(
        "cart.events",
        "cart-1",
        "cart.created",
        &serde_json::json!({"id": 1}),
    )
    .expect("a valid event");
    outbox.enqueue(&mut *tx, &lost).await.expect("enqueue");
    tx.rollback().await.expect("rollback");
    assert_eq!(count(&pool, "SELECT count(*) FROM shop_fx.outbox").await, 0);

    // Committed: both, and the relay's channel is told.
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO carts VALUES (1)")
        .execute(&mut *tx)
        .await
        .expect("the statement");
    let event = Event::json(
        "cart.events",
        "cart-1",
        "cart.created",
        &serde_json::json!({"id": 1}),
    )
    .expect("test step")
    .with_header(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    .expect("test step");
    outbox.enqueue(&mut *tx, &event).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let note = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("a NOTIFY on the schema's channel")
        .expect("test step");
    assert_eq!(note.channel(), "shop_fx.outbox");

    let row: (Uuid, String, String, String, Vec<u8>, String, serde_json::Value, i16) = sqlx::query_as(
        "SELECT msg_id, destination, key, event_type, payload, content_type, headers, shard FROM shop_fx.outbox",
    )
    .fetch_one(&pool)
    .await
    .expect("test step");
    assert_eq!(row.0, event.msg_id());
    assert_eq!(
        (row.1.as_str(), row.2.as_str(), row.3.as_str()),
        ("cart.events", "cart-1", "cart.created")
    );
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&row.4).expect("JSON payload"),
        serde_json::json!({"id": 1})
    );
    assert_eq!(row.5, "application/json");
    assert_eq!(
        row.6,
        serde_json::json!([[
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        ]])
    );
    assert_eq!(row.7, effectively::store::shard_of("cart-1"));

    // The same msg_id again is refused whole.
    assert!(outbox.enqueue(&pool, &event).await.is_err());
    assert_eq!(count(&pool, "SELECT count(*) FROM shop_fx.outbox").await, 1);
}

#[tokio::test]
async fn enqueue_takes_a_pool_a_connection_or_a_transaction_and_a_batch_keeps_its_order() {
    let (_db, pool, fx) = store("shop_fx").await;
    let outbox = fx.outbox();
    let e =
        |i: i32| Event::json("cart.events", "cart-9", "cart.updated", &i).expect("a valid event");
    outbox.enqueue(&pool, &e(0)).await.expect("enqueue");
    let mut conn = pool.acquire().await.expect("the statement");
    outbox.enqueue(&mut *conn, &e(1)).await.expect("enqueue");
    let mut tx = conn.begin().await.expect("begin");
    let batch: Vec<Event> = (2..50).map(e).collect();
    assert_eq!(
        outbox
            .enqueue_batch(&mut *tx, &batch)
            .await
            .expect("enqueue"),
        48
    );
    tx.commit().await.expect("commit");
    let payloads: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT payload FROM shop_fx.outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("test step");
    let order: Vec<i32> = payloads
        .iter()
        .map(|p| serde_json::from_slice(p).expect("JSON payload"))
        .collect();
    assert_eq!(order, (0..50).collect::<Vec<_>>());
}
