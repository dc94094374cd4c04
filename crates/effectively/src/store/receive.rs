//! [`WebhookReceiver`]: signed webhooks received into an [`Inbox`] (feature
//! `http`), the receiving end of [`WebhookSink`](super::WebhookSink) or of
//! any Standard Webhooks sender.
//!
//! ```no_run
//! use axum::{Router, body::Bytes, extract::State, http::HeaderMap, response::Response, routing::post};
//! use effectively::store::{Effectively, HandlerError, Record, WebhookReceiver};
//! use effectively::webhook::Secret;
//! use futures::future::BoxFuture;
//! use sqlx::PgConnection;
//!
//! fn invoice<'c>(tx: &'c mut PgConnection, record: &'c Record) -> BoxFuture<'c, Result<(), HandlerError>> {
//!     Box::pin(async move {
//!         sqlx::query("INSERT INTO billing.invoices (body) VALUES ($1)")
//!             .bind(&record.payload)
//!             .execute(&mut *tx)
//!             .await?;
//!         Ok(())
//!     })
//! }
//!
//! async fn hook(State(receiver): State<WebhookReceiver>, headers: HeaderMap, body: Bytes) -> Response {
//!     receiver.receive(&headers, &body, &invoice).await
//! }
//!
//! # fn app(fx: Effectively, secret: Secret) -> Router {
//! let receiver = WebhookReceiver::new(&fx, fx.inbox("billing"), vec![secret]);
//! Router::new().route("/webhooks/checkouts", post(hook)).with_state(receiver)
//! # }
//! ```

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};

use super::Effectively;
use super::handle::{Handled, Handler, HandlerError, Record, handle};
use super::http::error_response;
use super::inbox::Inbox;
use crate::webhook::{self, HEADER_ID, HEADER_TIMESTAMP, Secret};

/// Request headers never written into a dead letter: credentials.
const NOT_KEPT: [&str; 4] = [
    "authorization",
    "cookie",
    "proxy-authorization",
    "x-api-key",
];

/// Receives signed webhooks into an inbox: each request verified (Standard
/// Webhooks: HMAC-SHA256 over id, timestamp and the raw body, the timestamp
/// within a tolerance), then [`handle`]d: its `webhook-id` claimed in the
/// inbox and the user's handler run in one transaction, or a dead letter.
///
/// The answers, each with a JSON body:
///
/// * 200 `{"status": "applied"}`: the effect committed with its claim;
/// * 200 `{"status": "duplicate"}`: the id was applied before: nothing done,
///   and the sender can stop retrying;
/// * 200 `{"status": "dead_lettered", "reason": …}`: the handler refused it,
///   the id came before with another body, or it is older than the inbox
///   keeps ids; it is in `<schema>.dead_letters` with its claim kept, so a
///   retry cannot change it, and the sender is told to stop;
/// * 401 `{"error": {"code": "unauthorized", …}}`: the signature or the
///   timestamp failed verification; nothing was read or written;
/// * 503 `{"error": {"code": "unavailable", …}}` with `Retry-After: 1`: the
///   database or the handler said not now; nothing was committed, and the
///   sender's retry is handled again.
///
/// A crash between the commit and the answer makes the sender retry; the
/// retry is a duplicate. Cheap to clone (its secrets are shared).
#[derive(Clone)]
pub struct WebhookReceiver {
    fx: Effectively,
    inbox: Inbox,
    secrets: Arc<Vec<Secret>>,
    tolerance: Duration,
}

impl std::fmt::Debug for WebhookReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookReceiver")
            .field("consumer", &self.inbox.consumer())
            .field("secrets", &self.secrets.len())
            .field("tolerance", &self.tolerance)
            .finish()
    }
}

impl WebhookReceiver {
    /// A receiver into `inbox` (of `fx`'s schema) that accepts a signature
    /// under any of `secrets` (two during a rotation), within the standard
    /// tolerance of five minutes ([`webhook::DEFAULT_TOLERANCE`]).
    pub fn new(fx: &Effectively, inbox: Inbox, secrets: Vec<Secret>) -> Self {
        Self {
            fx: fx.clone(),
            inbox,
            secrets: Arc::new(secrets),
            tolerance: webhook::DEFAULT_TOLERANCE,
        }
    }

    /// How far a request's `webhook-timestamp` may be from now, either way.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Verifies and handles one request: `headers` and `body` exactly as
    /// they arrived (the raw body: a re-serialized one is not what was
    /// signed). See the type's docs for the answers.
    pub async fn receive(&self, headers: &HeaderMap, body: &[u8], handler: &Handler) -> Response {
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
        };
        let msg_id = text(HEADER_ID);
        let timestamp = text(HEADER_TIMESTAMP);
        if let Err(error) = webhook::verify(
            &self.secrets,
            msg_id,
            timestamp,
            text(webhook::HEADER_SIGNATURE),
            body,
            Utc::now().timestamp(),
            self.tolerance,
        ) {
            return error_response(401, "unauthorized", &error.to_string());
        }
        // Verified: the timestamp is integer seconds within the tolerance.
        let sent_at = timestamp
            .parse()
            .ok()
            .and_then(|secs| DateTime::from_timestamp(secs, 0))
            .unwrap_or_else(Utc::now);
        let record = Record {
            source: "webhook".to_owned(),
            key: None,
            payload: body.to_vec(),
            headers: headers
                .iter()
                .filter(|(name, _)| !NOT_KEPT.contains(&name.as_str()))
                .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
                .collect(),
            msg_id: msg_id.to_owned(),
            sent_at,
        };
        match handle(&self.fx, &self.inbox, handler, &record).await {
            Ok(Handled::Applied) => status("applied", None),
            Ok(Handled::Duplicate) => status("duplicate", None),
            Ok(Handled::DeadLettered(why)) => status("dead_lettered", Some(&why)),
            Err(HandlerError::Retry(why) | HandlerError::Reject(why)) => {
                tracing::warn!(consumer = self.inbox.consumer(), %msg_id, %why, "webhook not applied; the sender retries");
                let mut response = error_response(503, "unavailable", "not applied; try again");
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                response
            }
        }
    }
}

/// A 200 with `{"status": …}` (and `"reason"`).
fn status(status: &str, reason: Option<&str>) -> Response {
    let body = match reason {
        Some(reason) => serde_json::json!({ "status": status, "reason": reason }),
        None => serde_json::json!({ "status": status }),
    };
    (StatusCode::OK, axum::Json(body)).into_response()
}
