//! [`Idempotent`]: idempotency keys on any axum route (feature `http`).
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use effectively::store::{Effectively, Idempotent, StoredResponse};
//!
//! async fn checkout(request: Idempotent) -> axum::response::Response {
//!     request
//!         .run(|tx, body| {
//!             Box::pin(async move {
//!                 let cart: i32 = std::str::from_utf8(body)
//!                     .ok()
//!                     .and_then(|b| b.trim().parse().ok())
//!                     .ok_or_else(|| Idempotent::error(400, "invalid_request", "a cart number"))?;
//!                 sqlx::query("INSERT INTO checkouts (cart) VALUES ($1)")
//!                     .bind(cart)
//!                     .execute(&mut *tx)
//!                     .await
//!                     .map_err(|_| Idempotent::error(503, "unavailable", "try again"))?;
//!                 Ok(StoredResponse { status: 201, headers: vec![], body: b"made".to_vec() })
//!             })
//!         })
//!         .await
//! }
//!
//! # fn app(fx: Effectively) -> Router {
//! Router::new().route("/checkouts", post(checkout)).with_state(fx)
//! # }
//! ```

use axum::body::{Body, Bytes};
use axum::extract::{FromRef, FromRequest, Request};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use sqlx::{Acquire, PgConnection};

use super::Effectively;
use super::keys::{KeyClaim, Keys};
use crate::idempotency::{Fingerprint, IdempotencyKey, KeyError, StoredResponse};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// Who is calling, as the user's authentication decided: put it in the
/// request's extensions (a middleware that checked a token, say), and keys
/// are scoped by it: the same key from two principals is two keys. Without
/// one, every caller shares the empty scope.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Principal(pub String);

/// A request with an idempotency key: its body read, its fingerprint taken
/// (the method, the path and query, and the body's bytes), its key and
/// scope known. [`Idempotent::run`] does the work once per key; every retry
/// gets the first response back, byte for byte.
///
/// Refused before any work: no `Idempotency-Key` header, or one that is not
/// 1 to 255 visible ASCII characters (400, a JSON body with `code`
/// `missing_idempotency_key` or `invalid_idempotency_key`); a body that
/// cannot be read (400 `unreadable_body`, or axum's 413 over its body limit).
#[derive(Debug)]
pub struct Idempotent {
    keys: Keys,
    fx: Effectively,
    scope: String,
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    body: Bytes,
}

/// A JSON error answer: `{"error": {"code": …, "message": …}}`.
pub(super) fn error_response(status: u16, code: &str, message: &str) -> Response {
    let body = serde_json::json!({ "error": { "code": code, "message": message } });
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, axum::Json(body)).into_response()
}

impl<S> FromRequest<S> for Idempotent
where
    Effectively: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let fx = Effectively::from_ref(state);
        let key = match request.headers().get(IDEMPOTENCY_KEY_HEADER) {
            None => Err(KeyError::Missing),
            Some(value) => IdempotencyKey::parse(value.as_bytes()),
        }
        .map_err(|error| {
            let code = if error == KeyError::Missing {
                "missing_idempotency_key"
            } else {
                "invalid_idempotency_key"
            };
            error_response(400, code, &error.to_string())
        })?;
        let scope = request
            .extensions()
            .get::<Principal>()
            .map(|p| p.0.clone())
            .unwrap_or_default();
        let method = request.method().as_str().to_owned();
        let target = request.uri().path_and_query().map_or_else(
            || request.uri().path().to_owned(),
            |pq| pq.as_str().to_owned(),
        );
        let body = Bytes::from_request(request, state)
            .await
            .map_err(IntoResponse::into_response)?;
        let mut canonical = Vec::with_capacity(method.len() + target.len() + body.len() + 2);
        canonical.extend_from_slice(method.as_bytes());
        canonical.push(0);
        canonical.extend_from_slice(target.as_bytes());
        canonical.push(0);
        canonical.extend_from_slice(&body);
        Ok(Self {
            keys: fx.keys(),
            fx,
            scope,
            key,
            fingerprint: Fingerprint::new("effectively.http-request v1", &canonical),
            body,
        })
    }
}

impl Idempotent {
    /// An error answer for [`Idempotent::run`]'s work to return: `status`
    /// with `{"error": {"code": code, "message": message}}`. Not stored: the
    /// key is free again, and a retry does the work.
    pub fn error(status: u16, code: &str, message: &str) -> Response {
        error_response(status, code, message)
    }

    /// The request's body.
    pub fn body(&self) -> &[u8] {
        &self.body
    }

    /// The key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// The scope (the [`Principal`]'s name, or empty).
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// Claims the key in a transaction and, when it is new, runs `work` in
    /// that transaction with the body; its response is stored with the key,
    /// and both commit with the work. An `Err` from `work` rolls all of it
    /// back and is answered as it is (not stored).
    ///
    /// A retry of a request that committed gets the stored response again,
    /// byte for byte (status, headers, body). A retry while the first is in
    /// flight waits for it, then gets its response. The same key with
    /// another request (method, path or body) is 409 `idempotency_key_reused`.
    /// The database failing is 503 `unavailable`.
    pub async fn run<F>(self, work: F) -> Response
    where
        F: for<'c> FnOnce(
            &'c mut PgConnection,
            &'c [u8],
        ) -> BoxFuture<'c, Result<StoredResponse, Response>>,
    {
        match self.try_run(work).await {
            Ok(response) => response,
            Err(error) => {
                tracing::warn!(%error, "idempotent request: the database failed");
                error_response(
                    503,
                    "unavailable",
                    "the database is unavailable; retry with the same key",
                )
            }
        }
    }

    async fn try_run<F>(self, work: F) -> Result<Response, sqlx::Error>
    where
        F: for<'c> FnOnce(
            &'c mut PgConnection,
            &'c [u8],
        ) -> BoxFuture<'c, Result<StoredResponse, Response>>,
    {
        let mut conn = self.fx.pool().acquire().await?;
        let mut tx = conn.begin().await?;
        match self
            .keys
            .claim(&mut tx, &self.scope, &self.key, &self.fingerprint)
            .await?
        {
            KeyClaim::New => {}
            KeyClaim::Replay(stored) => return Ok(replay(&stored)),
            KeyClaim::Mismatch => {
                return Ok(error_response(
                    409,
                    "idempotency_key_reused",
                    "this idempotency key was used with another request",
                ));
            }
            KeyClaim::Unfinished => {
                return Ok(error_response(
                    409,
                    "idempotency_key_unfinished",
                    "this idempotency key's first request committed without a response",
                ));
            }
        }
        let response = match work(&mut tx, &self.body).await {
            Ok(response) => response,
            Err(answer) => {
                tx.rollback().await?;
                return Ok(answer);
            }
        };
        self.keys
            .complete(
                &mut tx,
                &self.scope,
                &self.key,
                &self.fingerprint,
                &response,
            )
            .await?;
        tx.commit().await?;
        Ok(replay(&response))
    }
}

/// A stored response as an HTTP response: its status, headers and body as
/// stored. A header that cannot be sent (never stored by [`Idempotent`]) is
/// left out.
fn replay(stored: &StoredResponse) -> Response {
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            response.headers_mut().append(name, value);
        }
    }
    response
}
