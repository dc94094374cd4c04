//! The library's webhook receiver (`WebhookReceiver`) over a real socket, fed
//! by the library's relay and `WebhookSink`, and by hand: every event applied
//! once through re-publishes and a handler that says "not now", a refused
//! event dead-lettered once, forged, stale and reused-id requests answered
//! as documented and never applied.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use effectively::store::{Handler, HandlerError, Relay, WebhookReceiver, WebhookSink};
use effectively::webhook::{Secret, signature_header};
use futures::future::BoxFuture;
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use crate::store::store;

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// The handler: event `n` adds a row of `effects`; 7 is refused for good,
/// 8 is "not now" the first time it is seen.
fn handler(not_yet: Arc<AtomicBool>) -> Arc<Handler> {
    Arc::new(move |tx: &mut PgConnection, record| {
        let not_yet = not_yet.clone();
        let work: BoxFuture<'_, Result<(), HandlerError>> = Box::pin(async move {
            let n: i64 = serde_json::from_slice(&record.payload)
                .map_err(|e| HandlerError::Reject(format!("not a number: {e}")))?;
            if n == 7 {
                return Err(HandlerError::Reject("seven is refused".into()));
            }
            if n == 8 && not_yet.swap(false, Ordering::SeqCst) {
                return Err(HandlerError::Retry("not now".into()));
            }
            sqlx::query("INSERT INTO effects (n, msg_id) VALUES ($1, $2)")
                .bind(n)
                .bind(&record.msg_id)
                .execute(&mut *tx)
                .await?;
            Ok(())
        });
        work
    })
}

/// Serves `receiver` with `handler` on `/hooks`; its URL and its stop.
async fn serve(receiver: WebhookReceiver, handler: Arc<Handler>) -> (String, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/hooks", listener.local_addr().expect("addr"));
    async fn hook(
        State((receiver, handler)): State<(WebhookReceiver, Arc<Handler>)>,
        headers: HeaderMap,
        body: Bytes,
    ) -> Response {
        receiver.receive(&headers, &body, handler.as_ref()).await
    }
    let router = axum::Router::new()
        .route("/hooks", axum::routing::post(hook))
        .with_state((receiver, handler));
    let cancel = CancellationToken::new();
    pipeline::metrics::spawn_router("receiver", listener, router, cancel.clone());
    (url, cancel)
}

/// Posts `body` as webhook `id` signed with `secret` at `timestamp`; the
/// status and the JSON answer.
async fn post(
    url: &str,
    secret: Option<&Secret>,
    id: &str,
    timestamp: i64,
    body: &str,
) -> (u16, Value) {
    let signature = secret.map_or_else(
        || "v1,AAAA".to_owned(),
        |s| signature_header(std::slice::from_ref(s), id, timestamp, body.as_bytes()),
    );
    let response = reqwest::Client::new()
        .post(url)
        .header("webhook-id", id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .header("authorization", "Bearer not-to-be-kept")
        .body(body.to_owned())
        .send()
        .await
        .expect("send");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON answer"))
}

#[tokio::test]
async fn relayed_webhooks_are_applied_once_each_through_re_publishes_retries_and_refusals() {
    let (_db, pool, fx) = store("shop_fx").await;
    sqlx::query("CREATE TABLE effects (n bigint NOT NULL, msg_id text NOT NULL)")
        .execute(&pool)
        .await
        .expect("effects");
    let secret = Secret::generate();
    let receiver = WebhookReceiver::new(&fx, fx.inbox("billing"), vec![secret.clone()]);
    let (url, stop) = serve(receiver, handler(Arc::new(AtomicBool::new(true)))).await;

    let events: Vec<_> = (0..10i64)
        .map(|n| {
            effectively::store::Event::json("billing", &format!("cart-{n}"), "cart.paid", &n)
                .expect("an event")
        })
        .collect();
    fx.outbox()
        .enqueue_batch(&pool, &events)
        .await
        .expect("enqueue");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("a client");
    let sink = WebhookSink::new(client)
        .destination("billing", &url, vec![secret.clone()])
        .expect("a destination");
    let relay = Relay::new(&fx, sink);
    // 8 is answered 503 once (the handler's "not now") and goes next pass.
    let first = relay.relay_all().await.expect("relay");
    assert_eq!((first.published, first.retried, first.failed), (9, 1, 0));
    assert_eq!(relay.relay_all().await.expect("relay").published, 1);
    // Every event published again (a relay that crashed before its mark):
    // each a duplicate, answered 200, applied no second time.
    sqlx::query("UPDATE shop_fx.outbox SET published_at = NULL")
        .execute(&pool)
        .await
        .expect("re-publish");
    assert_eq!(relay.relay_all().await.expect("relay").published, 10);

    let applied: Vec<(i64, i64)> =
        sqlx::query_as("SELECT n, count(*) FROM effects GROUP BY n ORDER BY n")
            .fetch_all(&pool)
            .await
            .expect("effects");
    let expected: Vec<(i64, i64)> = (0..10).filter(|n| *n != 7).map(|n| (n, 1)).collect();
    assert_eq!(applied, expected);
    let dead: Vec<(String, Option<String>, String)> = sqlx::query_as(
        "SELECT consumer, msg_id, reason FROM shop_fx.dead_letters WHERE source = 'webhook'",
    )
    .fetch_all(&pool)
    .await
    .expect("dead letters");
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "billing");
    assert_eq!(
        dead[0].1.as_deref(),
        Some(events[7].msg_id().to_string().as_str())
    );
    assert_eq!(dead[0].2, "seven is refused");

    // By hand: an id applied before, with another body: kept, not applied.
    let id = events[3].msg_id().to_string();
    let now = chrono::Utc::now().timestamp();
    let (status, answer) = post(&url, Some(&secret), &id, now, "33").await;
    assert_eq!(
        (status, answer["status"].as_str()),
        (200, Some("dead_lettered"))
    );
    assert!(
        answer["reason"]
            .as_str()
            .is_some_and(|r| r.contains("another payload")),
        "{answer}"
    );
    // The same request again, and a new one, byte for byte twice.
    let (status, answer) = post(&url, Some(&secret), &id, now, "3").await;
    assert_eq!(
        (status, answer["status"].as_str()),
        (200, Some("duplicate"))
    );
    for expect in ["applied", "duplicate"] {
        let (status, answer) = post(&url, Some(&secret), "by-hand-1", now, "11").await;
        assert_eq!((status, answer["status"].as_str()), (200, Some(expect)));
    }
    // Forged, unsigned for this secret, and stale: 401, nothing read.
    let other = Secret::generate();
    for (secret, timestamp) in [
        (Some(&other), now),
        (None, now),
        (Some(&secret), now - 3600),
        (Some(&secret), now + 3600),
    ] {
        let (status, answer) = post(&url, secret, "forged-1", timestamp, "12").await;
        assert_eq!(status, 401, "{answer}");
        assert_eq!(answer["error"]["code"], "unauthorized");
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM effects WHERE n IN (12, 33)").await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM effects WHERE n = 11").await,
        1
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM shop_fx.inbox WHERE msg_id = 'forged-1'"
        )
        .await,
        0
    );
    // The dead letter keeps the request's headers but its credentials.
    let headers: Value = sqlx::query_scalar(
        "SELECT headers FROM shop_fx.dead_letters WHERE msg_id = $1 AND payload = '33'",
    )
    .bind(&id)
    .fetch_one(&pool)
    .await
    .expect("the reused id's dead letter");
    let names: Vec<&str> = headers
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|h| h[0].as_str())
        .collect();
    assert!(names.contains(&"webhook-id"), "{names:?}");
    assert!(!names.contains(&"authorization"), "{names:?}");
    stop.cancel();
}
