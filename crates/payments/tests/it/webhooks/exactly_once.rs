//! A signed event claimed, answered at once and charged once: the sender's
//! retries, a retry after its receipt was pruned, and a receiver killed
//! before it answers.

use std::process::Stdio;
use std::time::Duration;

use effectively::webhook::{self, Secret};
use pipeline::contract::WEBHOOK_PATH;
use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, eventually, free_port};
use reqwest::StatusCode;
use sqlx::PgPool;
use uuid::Uuid;

use super::{CHARGES, CLAIMS, INBOX, LEDGER, Receiver, UNPROCESSED, count, event};

#[tokio::test]
async fn a_signed_event_is_claimed_answered_at_once_and_charged_once() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn(&db).await;
    let events: Vec<(Uuid, Vec<u8>)> = (0..20)
        .map(|i| {
            let msg_id = Uuid::now_v7();
            (msg_id, event(msg_id, Uuid::now_v7(), 100 + i))
        })
        .collect();
    for (msg_id, body) in &events {
        let (status, json) = receiver.post(*msg_id, body).await;
        assert_eq!(status, StatusCode::OK, "{json}");
        assert_eq!(json["status"], "accepted");
        assert_eq!(json["msg_id"], msg_id.to_string());
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 20
        })
        .await,
        "the inbox processor applied every claim"
    );
    assert_eq!(count(&pool, UNPROCESSED).await, 0);

    // The sender's retries: signed anew, the same ids and bodies.
    for (msg_id, body) in &events {
        let (status, json) = receiver.post(*msg_id, body).await;
        assert_eq!(status, StatusCode::OK, "{json}");
        assert_eq!(json["status"], "duplicate");
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&pool, CHARGES).await, 20);
    assert_eq!(count(&pool, LEDGER).await, 20, "one effect per event");
    assert_eq!(count(&pool, INBOX).await, 20);
    assert_eq!(count(&pool, CLAIMS).await, 20);
    let sum: i64 = sqlx::query_scalar("SELECT sum(amount_cents)::int8 FROM payments.charges")
        .fetch_one(&pool)
        .await
        .expect("sum");
    assert_eq!(sum, (0..20).map(|i| 100 + i).sum::<i64>());
    assert_eq!(
        receiver
            .metric(r#"payments_webhook_requests_total{outcome="accepted"}"#)
            .await,
        20.0
    );
    assert_eq!(
        receiver
            .metric(r#"payments_webhook_requests_total{outcome="duplicate"}"#)
            .await,
        20.0
    );
    assert_eq!(receiver.metric("payments_charges_total").await, 20.0);
    // Over HTTP the horizon is the outbox's 7 days, the sender's retry span
    // (30h28m) and the skew (5 min): 8 days 6h33m, no broker asked.
    assert_eq!(
        receiver.metric("payments_redelivery_horizon_seconds").await,
        (8 * 86_400 + 6 * 3600 + 33 * 60) as f64
    );
    receiver.stop().await;
}

/// A receipt deleted after `--webhook-receipts-kept` no longer answers a
/// retry "duplicate", but the inbox (the dedup record that lasts the
/// horizon) still makes it a no-op.
#[tokio::test]
async fn a_retry_after_its_receipt_was_pruned_is_still_a_no_op() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let receiver = Receiver::spawn(&db).await;
    let msg_id = Uuid::now_v7();
    let body = event(msg_id, Uuid::now_v7(), 100);
    receiver.post(msg_id, &body).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, UNPROCESSED).await == 0 && count(&pool, CHARGES).await == 1
        })
        .await
    );
    let pruned = payments::receiver::prune(&pool, Duration::ZERO)
        .await
        .expect("prune");
    assert_eq!(pruned, 1);
    assert_eq!(count(&pool, CLAIMS).await, 0);
    let (status, json) = receiver.post(msg_id, &body).await;
    assert_eq!(
        (status, &json["status"]),
        (StatusCode::OK, &"accepted".into())
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, UNPROCESSED).await == 0
        })
        .await
    );
    assert_eq!(count(&pool, CHARGES).await, 1);
    assert_eq!(count(&pool, LEDGER).await, 1, "not applied twice");
    assert_eq!(receiver.metric("payments_dedup_hits_total").await, 1.0);
    receiver.stop().await;
}

/// The payments binary SIGKILLs itself after the claim commits and before
/// it answers (crash point `respond`): the sender sees no answer and
/// retries; the restarted receiver answers "duplicate" and the event is
/// charged once. A claim left unprocessed by the dead process is applied by
/// the next one's processor.
#[tokio::test]
async fn a_receiver_killed_before_it_answers_is_retried_into_a_duplicate() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let secret = Secret::generate();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}{WEBHOOK_PATH}");
    let spawn = |crash: bool| {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_payments"));
        child
            .env("DATABASE_URL", db.url_as(ServiceRole::Payments))
            .env("PAYMENTS_SOURCE", "http")
            .env("PAYMENTS_WEBHOOK_ADDR", format!("127.0.0.1:{port}"))
            .env("PAYMENTS_WEBHOOK_SECRET", secret.to_whsec())
            .env("PAYMENTS_METRICS_ADDR", "127.0.0.1:0")
            .env("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9")
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        if crash {
            child.env("CRASH_POINT", "respond").env("CRASH_EVERY", "1");
        }
        child.spawn().expect("spawn payments")
    };
    let client = reqwest::Client::new();
    let msg_id = Uuid::now_v7();
    let body = event(msg_id, Uuid::now_v7(), 100);
    let send = || async {
        let now = chrono::Utc::now().timestamp();
        let id = msg_id.to_string();
        client
            .post(&url)
            .header(webhook::HEADER_ID, &id)
            .header(webhook::HEADER_TIMESTAMP, now.to_string())
            .header(
                webhook::HEADER_SIGNATURE,
                webhook::signature_header(std::slice::from_ref(&secret), &id, now, &body),
            )
            .body(body.clone())
            .send()
            .await
    };
    let ready = || async {
        client
            .get(&url)
            .send()
            .await
            .is_ok_and(|r| r.status() == StatusCode::METHOD_NOT_ALLOWED)
    };

    let mut dying = spawn(true);
    assert!(
        eventually(Duration::from_secs(30), ready).await,
        "listening"
    );
    let answer = send().await;
    assert!(
        answer.is_err(),
        "no answer from a killed receiver: {answer:?}"
    );
    let status = dying.wait().await.expect("wait");
    assert!(!status.success(), "killed by its crash point");
    assert_eq!(count(&pool, CLAIMS).await, 1, "the claim committed");

    let mut next = spawn(false);
    assert!(
        eventually(Duration::from_secs(30), ready).await,
        "listening"
    );
    let retry = send().await.expect("answered");
    assert_eq!(retry.status(), StatusCode::OK);
    let json: serde_json::Value = retry.json().await.expect("json");
    assert_eq!(json["status"], "duplicate");
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, CHARGES).await == 1 && count(&pool, UNPROCESSED).await == 0
        })
        .await,
        "the dead process's claim is applied by the next one"
    );
    assert_eq!(count(&pool, LEDGER).await, 1);
    next.kill().await.expect("kill");
}
