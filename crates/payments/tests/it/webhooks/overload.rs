//! The receiver under load: slow clients closed after the timeouts while
//! valid webhooks go on, and 503 with `Retry-After` past its handling slots.

use std::time::Duration;

use effectively::webhook;
use pipeline::contract::WEBHOOK_PATH;
use pipeline::testing::{TestDb, eventually};
use reqwest::StatusCode;
use sqlx::PgPool;
use uuid::Uuid;

use super::{CHARGES, CLAIMS, Receiver, count, event};

/// A webhook request's head trickled a byte a second.
const SLOW_HEAD: &[u8] = b"POST /webhooks/orders HTTP/1.1\r\nHost: payments\r\n\
    Content-Type: application/json\r\nwebhook-id: slow\r\n\r\n";

/// A complete head whose body is then trickled a byte a second.
const SLOW_BODY_HEAD: &[u8] = b"POST /webhooks/orders HTTP/1.1\r\nHost: payments\r\n\
    Content-Type: application/json\r\nContent-Length: 100\r\n\r\n";

/// What the slow bodies trickle.
const SLOW_BODY: &[u8] = b"{\"msg_id\": \"slow\"}";

/// Hundreds of clients sending a webhook's head a byte a second, and some
/// its body, are closed after the header read timeout (a body's after the
/// request timeout, answered 408 `request_timeout`); signed webhooks are
/// accepted and applied while they are connected. Requests past the
/// handling slots are answered 503 `overloaded` with `Retry-After: 1`.
#[tokio::test]
async fn slow_webhook_clients_are_closed_after_the_timeouts_and_valid_webhooks_go_on() {
    use pipeline::testing::slow::{all_closed, slow_clients};
    const SLOW_HEADS: usize = 800;
    const SLOW_BODIES: usize = 100;
    const VALID: usize = 30;
    let timeout = Duration::from_secs(3);
    let patience = timeout + Duration::from_secs(4);
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn_tuned(&db, |args| {
        args.webhook_header_read_timeout = timeout;
        args.webhook_request_timeout = timeout;
    })
    .await;
    let first = Uuid::now_v7();
    let (status, json) = receiver.post(first, &event(first, Uuid::now_v7(), 1)).await;
    assert_eq!(status, StatusCode::OK, "{json}");
    let addr: std::net::SocketAddr = receiver
        .url
        .trim_start_matches("http://")
        .trim_end_matches(WEBHOOK_PATH)
        .parse()
        .expect("addr");

    let started = std::time::Instant::now();
    let heads = slow_clients(addr, SLOW_HEADS, b"", SLOW_HEAD, patience).await;
    let bodies = slow_clients(addr, SLOW_BODIES, SLOW_BODY_HEAD, SLOW_BODY, patience).await;
    let connected = started.elapsed();
    let shared = &receiver;
    let answers = futures::future::join_all((0..VALID).map(|i| async move {
        let msg_id = Uuid::now_v7();
        shared
            .post(msg_id, &event(msg_id, Uuid::now_v7(), 100 + i as i64))
            .await
    }))
    .await;
    for (status, json) in answers {
        assert_eq!(status, StatusCode::OK, "{json}");
        assert_eq!(json["status"], "accepted");
    }
    let still_open = heads.iter().filter(|c| !c.is_finished()).count();
    assert!(
        still_open >= SLOW_HEADS / 2,
        "the valid webhooks were accepted while {still_open} of {SLOW_HEADS} slow clients \
         were connected (connecting took {connected:?})"
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 1 + VALID as i64
        })
        .await,
        "and applied"
    );
    all_closed("slow heads", heads, timeout, patience).await;
    for end in all_closed("slow bodies", bodies, timeout, patience).await {
        let answer = String::from_utf8_lossy(&end.received);
        assert!(
            answer.starts_with("HTTP/1.1 408") && answer.contains("\"request_timeout\""),
            "a slow body is answered 408 request_timeout: {answer:?}"
        );
    }
    assert_eq!(
        receiver
            .metric(r#"payments_webhook_requests_total{outcome="request_timeout"}"#)
            .await,
        SLOW_BODIES as f64
    );
    assert_eq!(
        count(&pool, CLAIMS).await,
        1 + VALID as i64,
        "no slow request claimed"
    );
    receiver.stop().await;
}

/// Past its handling slots the receiver answers 503 `overloaded` with
/// `Retry-After: 1` at once, and takes requests again when a slot frees.
#[tokio::test]
async fn past_its_handling_slots_the_receiver_answers_503_with_retry_after() {
    let db = TestDb::create().await;
    let receiver = Receiver::spawn_tuned(&db, |args| args.webhook_concurrency = 1).await;
    // The one slot is held while the claim waits for a lock another
    // transaction holds on the same webhook-id.
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let msg_id = Uuid::now_v7();
    let body = event(msg_id, Uuid::now_v7(), 5);
    let mut other = pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO payments.webhook_inbox (msg_id, payload, payload_hash) VALUES ($1, $2, 0)",
    )
    .bind(msg_id)
    .bind(&body)
    .execute(&mut *other)
    .await
    .expect("claim in another transaction");
    let shared = &receiver;
    let held = tokio::spawn({
        let (url, secret, client) = (
            receiver.url.clone(),
            receiver.secret.clone(),
            receiver.client.clone(),
        );
        let body = body.clone();
        async move {
            let now = chrono::Utc::now().timestamp();
            let id = msg_id.to_string();
            let signature =
                webhook::signature_header(std::slice::from_ref(&secret), &id, now, &body);
            client
                .post(&url)
                .header(webhook::HEADER_ID, id)
                .header(webhook::HEADER_TIMESTAMP, now.to_string())
                .header(webhook::HEADER_SIGNATURE, signature)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .expect("send")
                .status()
        }
    });
    assert!(
        eventually(Duration::from_secs(10), || async {
            let pid: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()",
            )
            .fetch_one(&pool)
            .await
            .expect("activity");
            pid > 0
        })
        .await,
        "the first request waits on the lock, holding the slot"
    );
    let other_id = Uuid::now_v7();
    let now = chrono::Utc::now().timestamp();
    let other_body = event(other_id, Uuid::now_v7(), 6);
    let signature = webhook::signature_header(
        std::slice::from_ref(&shared.secret),
        &other_id.to_string(),
        now,
        &other_body,
    );
    let response = shared
        .client
        .post(&shared.url)
        .header(webhook::HEADER_ID, other_id.to_string())
        .header(webhook::HEADER_TIMESTAMP, now.to_string())
        .header(webhook::HEADER_SIGNATURE, signature)
        .header("content-type", "application/json")
        .body(other_body.clone())
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let json: serde_json::Value = response.json().await.expect("json");
    assert_eq!(json["error"]["code"], "overloaded");
    other.rollback().await.expect("release");
    assert_eq!(held.await.expect("join"), StatusCode::OK);
    // The slot is free again: the refused one is taken on its retry.
    let (status, json) = receiver.post(other_id, &other_body).await;
    assert_eq!(status, StatusCode::OK, "{json}");
    assert_eq!(json["status"], "accepted");
    receiver.stop().await;
}
