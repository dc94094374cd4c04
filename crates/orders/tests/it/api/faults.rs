//! Faults: a failure inside the transaction, a crash between commit and
//! response, and which database errors are "unavailable".

use std::time::Duration;

use orders::store::InjectFault;
use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, free_port};
use reqwest::StatusCode;
use sqlx::PgPool;

use super::{BODY, TestApp, counts, n};

#[tokio::test]
async fn a_failure_inside_the_transaction_leaves_nothing_and_the_retry_succeeds() {
    let db = TestDb::create().await;
    let failing = TestApp::spawn(&db, InjectFault::AfterOrderInsert).await;
    let reply = failing.create("doomed", BODY).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(reply.error_code(), "internal");
    assert!(
        !String::from_utf8_lossy(&reply.body).contains("injected"),
        "a 500 does not leak internals"
    );
    assert_eq!(counts(&db).await, n(0), "no key, order or outbox row left");
    failing.stop().await;

    let healthy = TestApp::spawn(&db, InjectFault::None).await;
    let retry = healthy.create("doomed", BODY).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(counts(&db).await, n(1));
    healthy.stop().await;
}

/// Crash point `commit`: the orders binary SIGKILLs itself right after a
/// write transaction commits, before answering. The client sees a broken
/// connection; its retry (to a restarted service) gets the stored 201 of the
/// order that did commit, and no second order exists.
#[tokio::test]
async fn a_crash_between_commit_and_response_is_healed_by_the_retry() {
    let db = TestDb::create().await;
    let (port, grpc_port, metrics_port) = (free_port(), free_port(), free_port());
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_orders"))
        .env("DATABASE_URL", db.url_as(ServiceRole::Orders))
        .env("ORDERS_HTTP_ADDR", format!("127.0.0.1:{port}"))
        .env("ORDERS_GRPC_ADDR", format!("127.0.0.1:{grpc_port}"))
        .env("ORDERS_METRICS_ADDR", format!("127.0.0.1:{metrics_port}"))
        .env("CRASH_POINT", "commit")
        .env("CRASH_EVERY", "1")
        .env("RUST_LOG", "error")
        .kill_on_drop(true)
        .spawn()
        .expect("spawn orders");
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}");
    let up = pipeline::testing::eventually(Duration::from_secs(20), || async {
        client
            .get(format!("http://127.0.0.1:{metrics_port}/metrics"))
            .send()
            .await
            .is_ok()
    })
    .await;
    assert!(up, "orders came up");
    let first = client
        .post(format!("{url}/orders"))
        .header("Idempotency-Key", "crash-at-commit")
        .header("Content-Type", "application/json")
        .body(BODY)
        .send()
        .await;
    assert!(first.is_err(), "the client saw no response: {first:?}");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("orders died")
        .expect("wait");
    assert!(!status.success());
    assert_eq!(
        counts(&db).await,
        n(1),
        "the order committed before the crash"
    );

    let healthy = TestApp::spawn(&db, InjectFault::None).await;
    let retry = healthy.create("crash-at-commit", BODY).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let stored: uuid::Uuid = sqlx::query_scalar("SELECT order_id FROM orders.orders")
        .fetch_one(&pool)
        .await
        .expect("order");
    assert_eq!(retry.json()["order_id"], stored.to_string().as_str());
    assert_eq!(counts(&db).await, n(1));
    healthy.stop().await;
}

/// Which database errors the service answers with 503 (retry as is) rather
/// than 500: the real server's errors, not made-up ones.
#[tokio::test]
async fn a_database_going_away_is_unavailable_and_a_bad_statement_is_not() {
    use pipeline::db::is_unavailable;
    use sqlx::Connection;
    let db = TestDb::create().await;
    let mut conn = sqlx::PgConnection::connect(&db.url).await.expect("connect");
    let division = sqlx::query("SELECT 1 / 0")
        .execute(&mut conn)
        .await
        .expect_err("division by zero");
    assert!(!is_unavailable(&division), "{division}");
    let terminated = sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
        .execute(&mut conn)
        .await
        .expect_err("terminated");
    assert!(is_unavailable(&terminated), "{terminated}");
    let after = sqlx::query("SELECT 1")
        .execute(&mut conn)
        .await
        .expect_err("the connection is gone");
    assert!(is_unavailable(&after), "{after}");
    assert!(is_unavailable(&sqlx::Error::PoolTimedOut));
    assert!(!is_unavailable(&sqlx::Error::RowNotFound));
}
