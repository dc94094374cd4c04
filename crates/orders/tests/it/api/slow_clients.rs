//! Slow clients: trickling HTTP heads and bodies and gRPC prefaces are
//! closed after the timeouts, and a client past the connection cap waits.

use std::time::{Duration, Instant};

use orders::proto::CreateOrderRequest;
use orders::store::InjectFault;
use pipeline::testing::TestDb;
use pipeline::testing::slow::{all_closed, slow_clients};
use reqwest::StatusCode;

use super::{BODY, TestApp, counts, n};

/// A request line and headers trickled a byte a second.
const SLOW_HEAD: &[u8] = b"POST /orders HTTP/1.1\r\nHost: orders\r\n\
    Content-Type: application/json\r\nIdempotency-Key: slow-head\r\n\r\n";

/// A complete head whose body is then trickled a byte a second.
const SLOW_BODY_HEAD: &[u8] = b"POST /orders HTTP/1.1\r\nHost: orders\r\n\
    Content-Type: application/json\r\nIdempotency-Key: slow-body\r\n\
    Content-Length: 40\r\n\r\n";

/// Thousands of HTTP clients sending their request's head a byte a second
/// (and some their body) are closed after the header read timeout (the
/// body's after the request timeout, with a 408), an idle keep-alive
/// connection after the header read timeout too; valid requests are
/// answered while they are connected.
#[tokio::test]
async fn slow_http_clients_are_closed_after_the_timeouts_and_valid_requests_go_on() {
    const SLOW_HEADS: usize = 1500;
    const SLOW_BODIES: usize = 100;
    const VALID: usize = 40;
    let timeout = Duration::from_secs(3);
    let patience = timeout + Duration::from_secs(4);
    let db = TestDb::create().await;
    let app = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, |config| {
        config.header_read_timeout_ms = 3000;
        config.request_timeout_ms = 3000;
    })
    .await;
    // Serving (the slow clients' timeouts start at accept).
    assert_eq!(app.create("first", BODY).await.status, StatusCode::CREATED);

    let started = Instant::now();
    let mut heads = slow_clients(app.http_addr, SLOW_HEADS, b"", SLOW_HEAD, patience).await;
    let bodies = slow_clients(
        app.http_addr,
        SLOW_BODIES,
        SLOW_BODY_HEAD,
        BODY.as_bytes(),
        patience,
    )
    .await;
    let idle = slow_clients(
        app.http_addr,
        1,
        b"GET /orders/none HTTP/1.1\r\nHost: orders\r\n\r\n",
        b"",
        patience,
    )
    .await;
    let connected = started.elapsed();

    // Valid requests while the slow clients hold their connections: one at
    // a time and all at once.
    let valid_started = Instant::now();
    for i in 0..VALID / 2 {
        let reply = app.create(&format!("valid-{i}"), BODY).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    let shared = &app;
    let replies = futures::future::join_all(
        (VALID / 2..VALID).map(|i| async move { shared.create(&format!("valid-{i}"), BODY).await }),
    )
    .await;
    for reply in replies {
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    let valid_took = valid_started.elapsed();
    // All of them on an idle machine; a busy one may take longer than the
    // timeout to connect them all and send the valid requests.
    let still_open = heads.iter().filter(|c| !c.is_finished()).count();
    assert!(
        still_open >= 1000,
        "the valid requests were answered while {still_open} of {SLOW_HEADS} slow clients \
         were connected (connecting took {connected:?}, the valid requests {valid_took:?})"
    );

    heads.extend(idle);
    let ends = all_closed("slow heads", heads, timeout, patience).await;
    let idle = ends.last().expect("the idle client");
    assert!(
        idle.received.starts_with(b"HTTP/1.1 404"),
        "the idle client's request was answered: {:?}",
        String::from_utf8_lossy(&idle.received)
    );
    for end in all_closed("slow bodies", bodies, timeout, patience).await {
        let answer = String::from_utf8_lossy(&end.received);
        assert!(
            answer.starts_with("HTTP/1.1 408") && answer.contains("\"request_timeout\""),
            "a slow body is answered 408 request_timeout: {answer:?}"
        );
    }
    assert_eq!(
        counts(&db).await,
        n(1 + VALID as i64),
        "no slow request written"
    );
    app.stop().await;
}

/// At the connection cap, a new client waits (in the kernel's accept
/// backlog) until a slot frees up, and is then served; it is not refused.
#[tokio::test]
async fn a_client_past_the_connection_cap_waits_for_a_slot() {
    const CAP: usize = 8;
    let timeout = Duration::from_secs(3);
    let patience = timeout + Duration::from_secs(4);
    let db = TestDb::create().await;
    let app = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, |config| {
        config.header_read_timeout_ms = 3000;
        config.max_connections = CAP;
    })
    .await;
    assert_eq!(app.create("first", BODY).await.status, StatusCode::CREATED);
    // The first request's keep-alive connection holds a slot until the
    // header read timeout; the slow clients hold the others.
    let slow = slow_clients(app.http_addr, CAP - 1, b"", SLOW_HEAD, patience).await;
    let waited = Instant::now();
    let reply = reqwest::Client::new()
        .post(format!("{}/orders", app.http))
        .header("Idempotency-Key", "past-the-cap")
        .header("Content-Type", "application/json")
        .body(BODY)
        .send()
        .await
        .expect("the client past the cap is served, not refused");
    let waited = waited.elapsed();
    assert_eq!(reply.status(), StatusCode::CREATED);
    assert!(
        waited >= timeout.mul_f64(0.8),
        "the client past the cap waited for a slot (served after {waited:?})"
    );
    all_closed("slow heads", slow, timeout, patience).await;
    app.stop().await;
}

/// The HTTP/2 preface trickled a byte a second.
const SLOW_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Hundreds of gRPC clients sending the HTTP/2 preface a byte a second are
/// closed after the header read timeout; valid calls are answered while
/// they are connected.
#[tokio::test]
async fn slow_grpc_clients_are_closed_after_the_timeout_and_valid_calls_go_on() {
    const SLOW: usize = 500;
    let timeout = Duration::from_secs(3);
    let patience = timeout + Duration::from_secs(4);
    let db = TestDb::create().await;
    let app = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, |config| {
        config.header_read_timeout_ms = 3000;
    })
    .await;
    let mut grpc = app.grpc().await;
    let create = |key: &str| {
        let mut request = tonic::Request::new(CreateOrderRequest {
            account_id: 42,
            amount_cents: 1999,
        });
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().expect("metadata"));
        request
    };
    grpc.create(create("first")).await.expect("serving");

    let slow = slow_clients(app.grpc, SLOW, b"", SLOW_PREFACE, patience).await;
    for i in 0..20 {
        grpc.create(create(&format!("valid-{i}")))
            .await
            .expect("a valid call while the slow clients are connected");
    }
    let still_open = slow.iter().filter(|c| !c.is_finished()).count();
    assert!(
        still_open >= SLOW / 2,
        "the valid calls were answered while {still_open} of {SLOW} slow clients were connected"
    );
    all_closed("slow gRPC prefaces", slow, timeout, patience).await;
    // The valid client's connection was not touched.
    grpc.create(create("after"))
        .await
        .expect("after the slow ones");
    assert_eq!(counts(&db).await, n(22));
    app.stop().await;
}
