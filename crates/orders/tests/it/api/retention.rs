//! The key retention: an expired key's retry is a new request, and a key
//! lives its full retention by the database's clock, whatever minted its order.

use std::time::Duration;

use orders::store::InjectFault;
use pipeline::db::ServiceRole;
use pipeline::testing::TestDb;
use reqwest::StatusCode;
use sqlx::PgPool;

use super::{BODY, TestApp};

/// A key is kept for the key retention (`orders.key_policy`); once expired,
/// a retry with it is a new request: a second order. The service deletes
/// expired keys itself (every minute); here the test calls the same
/// function as the service's role.
#[tokio::test]
async fn a_retry_after_the_key_retention_is_a_new_request() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;
    let first = app.create("expiring-key", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let as_orders = PgPool::connect(&db.url_as(ServiceRole::Orders))
        .await
        .expect("connect as orders");
    let expired: i32 = sqlx::query_scalar("SELECT orders.keys_expire(100)")
        .fetch_one(&as_orders)
        .await
        .expect("expire");
    assert_eq!(expired, 0, "24 h by default: nothing is old enough");
    assert_eq!(app.create("expiring-key", BODY).await, first, "a replay");

    let owner = PgPool::connect(&db.url).await.expect("connect");
    sqlx::query("UPDATE orders.key_policy SET retention = interval '1 millisecond'")
        .execute(&owner)
        .await
        .expect("shorten");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let expired: i32 = sqlx::query_scalar("SELECT orders.keys_expire(100)")
        .fetch_one(&as_orders)
        .await
        .expect("expire");
    assert_eq!(expired, 1);
    let again = app.create("expiring-key", BODY).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_ne!(
        again.json()["order_id"],
        first.json()["order_id"],
        "a new request, a new order"
    );
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders.orders")
        .fetch_one(&owner)
        .await
        .expect("orders");
    assert_eq!(orders, 2);
    app.stop().await;
}

/// A key lives its full retention by the database's clock, whatever the
/// clock that minted its order id (issue: an orders host 11 minutes slow,
/// a 10-minute retention, and a retry 80 s later became a second order).
/// The key is written as such a host writes it: an order id whose UUIDv7
/// time is 11 minutes behind the database's, stamped now by the database.
#[tokio::test]
async fn a_key_minted_by_a_slow_clock_lives_its_full_retention() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    sqlx::query("UPDATE orders.key_policy SET retention = interval '10 minutes'")
        .execute(&owner)
        .await
        .expect("retention");
    let order_id = effectively::v7::minted_ago(Duration::from_secs(11 * 60));
    sqlx::query(
        "INSERT INTO fx.idempotency_keys \
             (scope, key, request_hash, reference, response_status, response_headers, response_body) \
         VALUES ('', 'slow-clock', '\\x00', $1, 201, '[]', '\\x7b7d')",
    )
    .bind(order_id.to_string())
    .execute(&owner)
    .await
    .expect("insert the key");
    let as_orders = PgPool::connect(&db.url_as(ServiceRole::Orders))
        .await
        .expect("connect as orders");
    let expire = || async {
        sqlx::query_scalar::<_, i32>("SELECT orders.keys_expire(100)")
            .fetch_one(&as_orders)
            .await
            .expect("expire")
    };
    assert_eq!(
        expire().await,
        0,
        "written a moment ago by the database's clock: kept"
    );
    // Ten minutes later by the database's clock, it goes.
    sqlx::query(
        "UPDATE fx.idempotency_keys SET created_at = now() - interval '10 minutes 1 second'",
    )
    .execute(&owner)
    .await
    .expect("age the key");
    assert_eq!(expire().await, 1, "past its retention: expired");
}
