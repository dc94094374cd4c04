//! What the receiver refuses: requests that fail verification or are not
//! events, the same id with another event (dead-lettered once), and HTTP
//! without a secret.

use std::time::Duration;

use effectively::webhook::{self, Secret};
use payments::run_on;
use pipeline::testing::{TestDb, eventually};
use reqwest::StatusCode;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{Answer, CHARGES, CLAIMS, Receiver, config, count, event};

/// A dead letter: transport, kind, msg_id, payload, topic.
type DeadRow = (
    String,
    String,
    Option<Uuid>,
    Option<Vec<u8>>,
    Option<String>,
);

#[tokio::test]
async fn a_request_that_fails_verification_or_is_not_an_event_is_refused_and_leaves_nothing() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn(&db).await;
    let msg_id = Uuid::now_v7();
    let body = event(msg_id, Uuid::now_v7(), 500);
    let id = msg_id.to_string();
    let now = chrono::Utc::now().timestamp();

    let refused = |(status, json): Answer, want: StatusCode, code: &str, case: &str| {
        assert_eq!(status, want, "{case}: {json}");
        assert_eq!(json["error"]["code"], code, "{case}: {json}");
        assert!(
            json["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{case}: a reason"
        );
    };
    // Another secret's signature.
    let stranger = Secret::generate();
    refused(
        receiver.post_as(&stranger, &id, now, &body).await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "wrong secret",
    );
    // A body other than the one signed.
    let signature =
        webhook::signature_header(std::slice::from_ref(&receiver.secret), &id, now, &body);
    let tampered = event(msg_id, Uuid::now_v7(), 999_999);
    refused(
        receiver
            .post_raw(&id, &now.to_string(), &signature, tampered)
            .await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "tampered body",
    );
    // A captured request replayed after the tolerance; its signature is good.
    refused(
        receiver
            .post_as(&receiver.secret, &id, now - 301, &body)
            .await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "replayed old request",
    );
    refused(
        receiver.post_raw(&id, "", "", body.clone()).await,
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "no signature",
    );
    // Authenticated, but not an event: the Kafka path's decoder rules.
    let junk = br#"{"hello":"world"}"#;
    refused(
        receiver.post_as(&receiver.secret, &id, now, junk).await,
        StatusCode::BAD_REQUEST,
        "bad_request",
        "not an event",
    );
    // Authenticated, an event, but under another id.
    let other = Uuid::now_v7().to_string();
    refused(
        receiver.post_as(&receiver.secret, &other, now, &body).await,
        StatusCode::BAD_REQUEST,
        "bad_request",
        "webhook-id is not the msg_id",
    );
    // Over the body limit.
    let big = vec![b' '; payments::receiver::MAX_BODY_BYTES + 1];
    let (status, _) = receiver.post_as(&receiver.secret, &id, now, &big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);

    assert_eq!(count(&pool, CLAIMS).await, 0, "nothing claimed");
    assert_eq!(count(&pool, CHARGES).await, 0, "nothing charged");
    assert_eq!(
        receiver
            .metric(r#"payments_webhook_requests_total{outcome="unauthorized"}"#)
            .await,
        4.0
    );
    // The same event, signed right: taken.
    let (status, json) = receiver.post(msg_id, &body).await;
    assert_eq!(
        (status, &json["status"]),
        (StatusCode::OK, &"accepted".into())
    );
    receiver.stop().await;
}

#[tokio::test]
async fn the_same_id_with_another_event_is_refused_and_dead_lettered_once_and_the_first_stands() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn(&db).await;
    let (msg_id, order_id) = (Uuid::now_v7(), Uuid::now_v7());
    let first = event(msg_id, order_id, 100);
    let (status, _) = receiver.post(msg_id, &first).await;
    assert_eq!(status, StatusCode::OK);
    let second = event(msg_id, order_id, 200);
    for _ in 0..2 {
        let (status, json) = receiver.post(msg_id, &second).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{json}");
        assert_eq!(json["error"]["code"], "conflict");
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 1
        })
        .await
    );
    let amount: i64 = sqlx::query_scalar("SELECT amount_cents FROM payments.charges")
        .fetch_one(&pool)
        .await
        .expect("amount");
    assert_eq!(amount, 100, "the first event stands");
    let dead: Vec<DeadRow> =
        sqlx::query_as("SELECT transport, kind, msg_id, payload, topic FROM payments.dead_letters")
            .fetch_all(&pool)
            .await
            .expect("dead letters");
    assert_eq!(dead.len(), 1, "recorded once: {dead:?}");
    assert_eq!(
        (dead[0].0.as_str(), dead[0].1.as_str(), dead[0].2),
        ("http", "msg_id_conflict", Some(msg_id))
    );
    assert_eq!(
        dead[0].3.as_deref(),
        Some(&second[..]),
        "the refused body kept"
    );
    assert_eq!(dead[0].4, None);
    receiver.stop().await;
}

#[tokio::test]
async fn http_without_a_secret_is_refused_with_a_clear_error() {
    let db = TestDb::create().await;
    let mut config = config(&db, &Secret::generate());
    config.webhook.webhook_secret.clear();
    let metrics = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let webhooks = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let error = run_on(config, metrics, Some(webhooks), CancellationToken::new())
        .await
        .expect_err("refused");
    assert!(error.to_string().contains("--webhook-secret"), "{error}");
}
