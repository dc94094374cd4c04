//! The relay through `WebhookSink` to a receiver that verifies each
//! signature and answers as its script says.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use effectively::store::{Event, Relay};
use tokio_util::sync::CancellationToken;

use super::{pending, store};

/// A receiver on 127.0.0.1 that verifies each request's signature and
/// answers the status its script gives the payload (200 by default),
/// recording what it took.
/// A request taken: its `webhook-id`, body and `traceparent`.
type Took = (String, Vec<u8>, Option<String>);

#[derive(Clone, Default)]
struct Receiver {
    took: Arc<Mutex<Vec<Took>>>,
    answer: Arc<Mutex<HashMap<Vec<u8>, u16>>>,
}

async fn receive(
    secret: effectively::webhook::Secret,
    receiver: Receiver,
) -> (String, CancellationToken) {
    use axum::body::Bytes;
    use axum::http::{HeaderMap, StatusCode};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/hooks", listener.local_addr().expect("addr"));
    let router = axum::Router::new().route(
        "/hooks",
        axum::routing::post(move |headers: HeaderMap, body: Bytes| {
            let (secret, receiver) = (secret.clone(), receiver.clone());
            async move {
                let h = |n: &str| {
                    headers
                        .get(n)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned()
                };
                let verified = effectively::webhook::verify(
                    &[secret],
                    &h("webhook-id"),
                    &h("webhook-timestamp"),
                    &h("webhook-signature"),
                    &body,
                    chrono::Utc::now().timestamp(),
                    effectively::webhook::DEFAULT_TOLERANCE,
                );
                if verified.is_err() {
                    return StatusCode::UNAUTHORIZED;
                }
                let status = receiver
                    .answer
                    .lock()
                    .expect("lock")
                    .get(body.as_ref())
                    .copied()
                    .unwrap_or(200);
                if status == 200 {
                    let trace = headers
                        .get("traceparent")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    receiver.took.lock().expect("lock").push((
                        h("webhook-id"),
                        body.to_vec(),
                        trace,
                    ));
                }
                StatusCode::from_u16(status).expect("a status")
            }
        }),
    );
    let cancel = CancellationToken::new();
    pipeline::metrics::spawn_router("receiver", listener, router, cancel.clone());
    (url, cancel)
}

#[tokio::test]
async fn webhook_sink_delivers_signed_requests_and_judges_the_answers() {
    use effectively::store::WebhookSink;
    use effectively::webhook::Secret;
    let (_db, pool, fx) = store().await;
    let secret = Secret::generate();
    let receiver = Receiver::default();
    let (url, stop) = receive(secret.clone(), receiver.clone()).await;
    // Payload 5 is answered 503 (tried again), 6 is answered 410 (refused).
    receiver
        .answer
        .lock()
        .expect("lock")
        .insert(b"5".to_vec(), 503);
    receiver
        .answer
        .lock()
        .expect("lock")
        .insert(b"6".to_vec(), 410);
    let mut events: Vec<Event> = (0..8i64)
        .map(|n| {
            Event::json("billing", &format!("cart-{n}"), "cart.updated", &n)
                .expect("a valid event")
                .with_header("traceparent", &format!("00-{n:032x}-{n:016x}-01"))
                .expect("a valid header")
        })
        .collect();
    events.push(Event::json("nowhere", "cart-x", "cart.updated", &9).expect("a valid event"));
    fx.outbox()
        .enqueue_batch(&pool, &events)
        .await
        .expect("enqueue");

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("a client");
    let sink = WebhookSink::new(client)
        .destination("billing", &url, vec![Secret::generate(), secret])
        .expect("a destination");
    assert!(
        WebhookSink::new(reqwest::Client::new())
            .destination("x", "ftp://host/", vec![Secret::generate()])
            .is_err()
    );
    let relay = Relay::new(&fx, sink);
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed, pass.retried), (6, 2, 1));
    let took = receiver.took.lock().expect("lock").clone();
    assert_eq!(took.len(), 6);
    for (id, body, trace) in &took {
        let n: i64 = serde_json::from_slice(body).expect("json");
        let event = &events[usize::try_from(n).expect("small")];
        assert_eq!(id, &event.msg_id().to_string());
        assert_eq!(
            trace.as_deref(),
            Some(format!("00-{n:032x}-{n:016x}-01").as_str())
        );
    }
    let errors: Vec<(String, String)> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8'), error FROM shop_fx.outbox WHERE failed_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("the refused rows");
    assert_eq!(errors[0].0, "6");
    assert!(errors[0].1.starts_with("HTTP 410"), "{errors:?}");
    assert_eq!(errors[1].0, "9");
    assert!(
        errors[1]
            .1
            .contains("no webhook destination named \"nowhere\""),
        "{errors:?}"
    );
    // The receiver is back: the 503'd row goes.
    receiver
        .answer
        .lock()
        .expect("lock")
        .remove(b"5".as_slice());
    assert_eq!(relay.relay_all().await.expect("relay").published, 1);
    assert_eq!(pending(&pool).await, 0);
    stop.cancel();
}
