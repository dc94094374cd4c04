//! Idempotency keys: sequential and concurrent retries replay one order,
//! a key reused for another request is a conflict, and HTTP and gRPC share keys.

use orders::proto::{CreateOrderRequest, GetOrderRequest};
use orders::store::InjectFault;
use pipeline::testing::TestDb;
use reqwest::StatusCode;
use serde_json::Value;
use sqlx::PgPool;

use super::{BODY, TestApp, counts, n};

#[tokio::test]
async fn sequential_retries_return_one_order_and_identical_responses() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;

    let first = app.create("seq-key-1", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let order_id = first.json()["order_id"]
        .as_str()
        .expect("order_id")
        .to_owned();
    assert_eq!(first.json()["status"], "created");
    assert_eq!(
        first.location.as_deref(),
        Some(format!("/orders/{order_id}").as_str())
    );
    assert!(first.etag.is_some());
    for _ in 0..5 {
        assert_eq!(app.create("seq-key-1", BODY).await, first);
    }
    // Same request, other whitespace and key order: the same request.
    let reordered = app
        .create(
            "seq-key-1",
            "{\n  \"amount_cents\":1999 , \"account_id\":42}",
        )
        .await;
    assert_eq!(reordered, first);
    assert_eq!(counts(&db).await, n(1));

    let got = app
        .client
        .get(format!("{}/orders/{order_id}", app.http))
        .send()
        .await
        .expect("get");
    assert_eq!(got.status(), StatusCode::OK);
    let got: Value = got.json().await.expect("json");
    assert_eq!(got["order_id"], order_id.as_str());
    assert_eq!(got["account_id"], 42);
    assert_eq!(got["amount_cents"], 1999);

    // The outbox row carries the order.
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (aggregate_id, event_type, payload, published): (
        uuid::Uuid,
        String,
        Vec<u8>,
        Option<chrono::DateTime<chrono::Utc>>,
    ) = sqlx::query_as("SELECT aggregate_id, event_type, payload, published_at FROM orders.outbox")
        .fetch_one(&pool)
        .await
        .expect("outbox row");
    assert_eq!(aggregate_id.to_string(), order_id);
    assert_eq!(event_type, "order.created");
    assert!(
        published.is_none(),
        "nothing is published in the request path"
    );
    let payload: Value = serde_json::from_slice(&payload).expect("payload json");
    assert_eq!(payload["amount_cents"], 1999);
    pool.close().await;
    app.stop().await;
}

#[tokio::test]
async fn fifty_concurrent_requests_with_one_key_make_one_order() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;

    let replies = futures::future::join_all((0..50).map(|_| app.create("hot-key", BODY))).await;
    let first = &replies[0];
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    for reply in &replies {
        assert_eq!(reply, first);
    }
    assert_eq!(counts(&db).await, n(1));

    // And different keys at the same time are different orders.
    let keys: Vec<String> = (0..20).map(|i| format!("many-{i}")).collect();
    let replies = futures::future::join_all(keys.iter().map(|k| app.create(k, BODY))).await;
    assert!(replies.iter().all(|r| r.status == StatusCode::CREATED));
    assert_eq!(counts(&db).await, n(21));
    app.stop().await;
}

#[tokio::test]
async fn same_key_with_a_different_request_is_a_conflict_and_writes_nothing() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;

    let first = app.create("reused", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = app
        .create("reused", r#"{"account_id": 42, "amount_cents": 2000}"#)
        .await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(other.error_code(), "idempotency_key_reused");
    assert_eq!(counts(&db).await, n(1));
    // The original is untouched.
    assert_eq!(app.create("reused", BODY).await, first);

    let mut grpc = app.grpc().await;
    let mut request = tonic::Request::new(CreateOrderRequest {
        account_id: 7,
        amount_cents: 1,
    });
    request
        .metadata_mut()
        .insert("idempotency-key", "reused".parse().expect("metadata"));
    let status = grpc.create(request).await.expect_err("mismatch");
    assert_eq!(status.code(), tonic::Code::AlreadyExists);
    assert_eq!(counts(&db).await, n(1));
    app.stop().await;
}

#[tokio::test]
async fn a_key_used_over_http_and_retried_over_grpc_is_one_order() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;

    let first = app.create("cross-protocol", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let order_id = first.json()["order_id"].as_str().expect("id").to_owned();

    let mut grpc = app.grpc().await;
    for _ in 0..3 {
        let mut request = tonic::Request::new(CreateOrderRequest {
            account_id: 42,
            amount_cents: 1999,
        });
        request.metadata_mut().insert(
            "idempotency-key",
            "cross-protocol".parse().expect("metadata"),
        );
        let reply = grpc
            .create(request)
            .await
            .expect("grpc create")
            .into_inner();
        assert_eq!(reply.order_id, order_id);
        assert_eq!(reply.status, "created");
    }

    // And the other way round: gRPC first, then HTTP.
    let mut request = tonic::Request::new(CreateOrderRequest {
        account_id: 5,
        amount_cents: 10,
    });
    request
        .metadata_mut()
        .insert("idempotency-key", "grpc-first".parse().expect("metadata"));
    let reply = grpc
        .create(request)
        .await
        .expect("grpc create")
        .into_inner();
    let http = app
        .create("grpc-first", r#"{"account_id": 5, "amount_cents": 10}"#)
        .await;
    assert_eq!(http.status, StatusCode::CREATED);
    assert_eq!(http.json()["order_id"], reply.order_id.as_str());
    assert_eq!(counts(&db).await, n(2));

    let order = grpc
        .get(GetOrderRequest {
            order_id: order_id.clone(),
        })
        .await
        .expect("grpc get")
        .into_inner();
    assert_eq!(order.amount_cents, 1999);
    app.stop().await;
}
