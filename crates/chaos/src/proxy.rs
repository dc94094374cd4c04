//! `--transport http`: the webhook proxy between the relay and payments.
//!
//! The relay's destination is this proxy, which passes every request on to
//! payments' receiver unchanged (the signature covers the body and the
//! headers it needs) and its answer back. The receiver faults make it
//! misbehave for a while: answer 500 without passing the request on
//! (`receiver-errors`), or hold each request past the sender's timeout and
//! only then pass it on (`receiver-slow`: the receiver applies it, the sender
//! has given up on the attempt and retries, and the retry is a duplicate).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use effectively::webhook;
use pipeline::contract::{IDEMPOTENCY_KEY, WEBHOOK_PATH};
use tokio_util::sync::CancellationToken;

/// What the proxy does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Pass it on.
    Pass = 0,
    /// Answer 500 at once.
    Errors = 1,
    /// Hold it past the sender's timeout, then pass it on.
    Slow = 2,
}

/// The proxy's state: its mode and what it did.
pub struct Proxy {
    mode: AtomicU8,
    /// The receiver's webhook URL.
    target: String,
    /// How long `Slow` holds a request.
    hold: Duration,
    client: reqwest::Client,
    /// Requests passed on, answered 500, held.
    pub passed: AtomicU64,
    /// See [`Proxy::passed`].
    pub errored: AtomicU64,
    /// See [`Proxy::passed`].
    pub held: AtomicU64,
}

impl Proxy {
    /// A proxy to payments' receiver at `receiver`; `Slow` holds a request
    /// for `hold`.
    pub fn new(receiver: SocketAddr, hold: Duration) -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            mode: AtomicU8::new(Mode::Pass as u8),
            target: format!("http://{receiver}{WEBHOOK_PATH}"),
            hold,
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .timeout(Duration::from_secs(60))
                .build()?,
            passed: AtomicU64::new(0),
            errored: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }))
    }

    /// Sets the mode.
    pub fn set(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
    }

    fn mode(&self) -> Mode {
        match self.mode.load(Ordering::SeqCst) {
            1 => Mode::Errors,
            2 => Mode::Slow,
            _ => Mode::Pass,
        }
    }

    /// Serves on `listener` until `cancel` fires.
    pub fn spawn(
        self: &Arc<Self>,
        listener: tokio::net::TcpListener,
        cancel: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let app = Router::new()
            .route(WEBHOOK_PATH, post(forward))
            .with_state(self.clone());
        pipeline::metrics::spawn_router("webhook proxy", listener, app, cancel)
    }
}

/// The headers a webhook carries that the receiver reads.
const PASSED_HEADERS: [&str; 5] = [
    webhook::HEADER_ID,
    webhook::HEADER_TIMESTAMP,
    webhook::HEADER_SIGNATURE,
    IDEMPOTENCY_KEY,
    "content-type",
];

async fn forward(State(proxy): State<Arc<Proxy>>, headers: HeaderMap, body: Bytes) -> Response {
    match proxy.mode() {
        Mode::Errors => {
            proxy.errored.fetch_add(1, Ordering::Relaxed);
            return (StatusCode::INTERNAL_SERVER_ERROR, "chaos: receiver-errors").into_response();
        }
        Mode::Slow => {
            proxy.held.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(proxy.hold).await;
        }
        Mode::Pass => {}
    }
    proxy.passed.fetch_add(1, Ordering::Relaxed);
    let mut request = proxy.client.post(&proxy.target).body(body);
    for name in PASSED_HEADERS {
        if let Some(value) = headers.get(name) {
            request = request.header(name, value);
        }
    }
    match request.send().await {
        Ok(answer) => {
            let status = answer.status();
            let retry_after = answer.headers().get("retry-after").cloned();
            let body = answer.bytes().await.unwrap_or_default();
            let mut response = (status, body).into_response();
            if let Some(value) = retry_after {
                response
                    .headers_mut()
                    .insert(HeaderName::from_static("retry-after"), value);
            }
            response
        }
        // The receiver is down or died mid-request: the sender retries.
        Err(error) => (
            StatusCode::BAD_GATEWAY,
            format!("chaos: the receiver did not answer: {error}"),
        )
            .into_response(),
    }
}
