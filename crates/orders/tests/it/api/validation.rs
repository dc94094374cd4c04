//! Bad input over HTTP and gRPC: a clear error for each, nothing written,
//! and the key not consumed.

use orders::proto::CreateOrderRequest;
use orders::store::InjectFault;
use pipeline::testing::TestDb;
use reqwest::StatusCode;

use super::{BODY, TestApp, counts, n};

#[tokio::test]
async fn bad_input_gets_a_clear_error_and_does_not_consume_the_key() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;
    let json = Some("application/json");
    let long_key = "k".repeat(256);
    let big_body = format!(
        r#"{{"account_id": 1, "amount_cents": 1, "pad": "{}"}}"#,
        "x".repeat(2048)
    );

    // (key, content type, body, expected status, expected error code)
    type Case<'a> = (
        Option<&'a str>,
        Option<&'a str>,
        &'a str,
        StatusCode,
        &'a str,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            None,
            json,
            BODY,
            StatusCode::BAD_REQUEST,
            "missing_idempotency_key",
        ),
        (
            Some(""),
            json,
            BODY,
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
        ),
        (
            Some(&long_key),
            json,
            BODY,
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
        ),
        (
            Some("has space"),
            json,
            BODY,
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
        ),
        (
            Some("k1"),
            json,
            "{not json",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            Some("k1"),
            json,
            "",
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 1, "amount_cents": 5, "extra": true}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": "1", "amount_cents": 5}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 1}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 0, "amount_cents": 5}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 1, "amount_cents": -5}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 1, "amount_cents": 10000000001}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            r#"{"account_id": 1, "amount_cents": 1.5}"#,
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            json,
            "[1, 2]",
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            Some("k1"),
            Some("text/plain"),
            BODY,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            Some("k1"),
            None,
            BODY,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            Some("k1"),
            json,
            &big_body,
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
    ];
    for (key, content_type, body, status, code) in cases {
        let reply = app.post(key, content_type, body).await;
        assert_eq!(reply.status, status, "{key:?} {content_type:?} {body:.60}");
        assert_eq!(
            reply.error_code(),
            code,
            "{key:?} {content_type:?} {body:.60}"
        );
        assert_eq!(reply.content_type.as_deref(), Some("application/json"));
    }
    assert_eq!(counts(&db).await, n(0));

    // None of the rejected requests consumed "k1".
    let ok = app.create("k1", BODY).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(counts(&db).await, n(1));

    let missing = app
        .client
        .get(format!("{}/orders/{}", app.http, uuid::Uuid::now_v7()))
        .send()
        .await
        .expect("get");
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    let not_uuid = app
        .client
        .get(format!("{}/orders/not-a-uuid", app.http))
        .send()
        .await
        .expect("get");
    assert_eq!(not_uuid.status(), StatusCode::NOT_FOUND);

    // gRPC: a missing key and bad fields are INVALID_ARGUMENT.
    let mut grpc = app.grpc().await;
    let status = grpc
        .create(CreateOrderRequest {
            account_id: 1,
            amount_cents: 1,
        })
        .await
        .expect_err("no key");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let mut request = tonic::Request::new(CreateOrderRequest {
        account_id: 1,
        amount_cents: 0,
    });
    request
        .metadata_mut()
        .insert("idempotency-key", "grpc-bad".parse().expect("metadata"));
    assert_eq!(
        grpc.create(request).await.expect_err("bad amount").code(),
        tonic::Code::InvalidArgument
    );
    assert_eq!(counts(&db).await, n(1));
    app.stop().await;
}
