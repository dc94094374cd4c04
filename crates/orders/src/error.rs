//! One API error type, mapped to an HTTP status + JSON body and to a gRPC
//! status; the order's, the store's and the writer's errors become it here,
//! at the edge. A 500 never carries internals: they are logged where handled.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pipeline::idempotency::KeyError;
use serde_json::json;

use crate::auth::AuthError;
use crate::order::InvalidOrder;
use crate::store::StoreError;
use crate::writer::WriteError;

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// No valid bearer token (`--auth-tokens-file`); the answer does not say
    /// which of [`AuthError`]'s reasons (the metric does).
    #[error("authentication required: send Authorization: Bearer TOKEN with a valid token")]
    Unauthenticated(AuthError),
    /// Missing or malformed idempotency key.
    #[error("{0}")]
    InvalidKey(#[from] KeyError),
    /// The body is not declared as `application/json`.
    #[error("the body must be sent with Content-Type: application/json")]
    UnsupportedMediaType,
    /// The body is larger than the configured limit.
    #[error("the body is larger than {0} bytes")]
    PayloadTooLarge(usize),
    /// The body could not be read.
    #[error("the body could not be read: {0}")]
    UnreadableBody(String),
    /// The request (its body, its handling) took longer than the request
    /// timeout; retrying with the same key is safe.
    #[error("the request took longer than {} ms; retry with the same idempotency key", .0.as_millis())]
    RequestTimeout(std::time::Duration),
    /// The body is not well-formed JSON.
    #[error("malformed JSON: {0}")]
    MalformedJson(String),
    /// The body is JSON but not a valid request (unknown field, wrong type,
    /// value out of range).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The idempotency key was used before with a different request.
    #[error(
        "this idempotency key was already used with a different request; use a new key for a new request"
    )]
    KeyReused,
    /// No such resource.
    #[error("{0}")]
    NotFound(String),
    /// The route exists but does not take this method (HTTP only; the
    /// `Allow` header lists the ones it takes).
    #[error("this route does not take the method {0}")]
    MethodNotAllowed(String),
    /// The write queue is full: the service sheds load rather than letting
    /// requests wait past their clients' timeouts. Retrying later is safe.
    #[error("the service is overloaded; retry with the same idempotency key")]
    Overloaded,
    /// The database is saturated or unreachable; retrying later is safe.
    #[error("the service is temporarily unavailable; retry with the same idempotency key")]
    Unavailable,
    /// Anything else; the details are logged, not returned.
    #[error("internal error")]
    Internal(#[source] anyhow::Error),
    /// A failure already logged where it was handled (a failed write batch,
    /// logged once by its writer): answered as [`ApiError::Internal`] is, and
    /// not logged again for each of its requests.
    #[error("internal error")]
    InternalLogged,
}

impl ApiError {
    /// Machine-readable error code for the JSON body.
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Unauthenticated(_) => "unauthenticated",
            ApiError::InvalidKey(KeyError::Missing) => "missing_idempotency_key",
            ApiError::InvalidKey(_) => "invalid_idempotency_key",
            ApiError::UnsupportedMediaType => "unsupported_media_type",
            ApiError::PayloadTooLarge(_) => "payload_too_large",
            ApiError::UnreadableBody(_) => "unreadable_body",
            ApiError::RequestTimeout(_) => "request_timeout",
            ApiError::MalformedJson(_) => "malformed_json",
            ApiError::InvalidRequest(_) => "invalid_request",
            ApiError::KeyReused => "idempotency_key_reused",
            ApiError::NotFound(_) => "not_found",
            ApiError::MethodNotAllowed(_) => "method_not_allowed",
            ApiError::Overloaded => "overloaded",
            ApiError::Unavailable => "unavailable",
            ApiError::Internal(_) | ApiError::InternalLogged => "internal",
        }
    }

    /// HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            ApiError::InvalidKey(_)
            | ApiError::UnreadableBody(_)
            | ApiError::MalformedJson(_)
            | ApiError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::KeyReused => StatusCode::CONFLICT,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Overloaded | ApiError::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) | ApiError::InternalLogged => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// gRPC status. A key reused with a different request is ALREADY_EXISTS:
    /// the key is bound to another request, the canonical code for HTTP 409,
    /// and one no client retries blindly.
    pub fn to_status(&self) -> tonic::Status {
        let message = self.to_string();
        match self {
            ApiError::Unauthenticated(_) => tonic::Status::unauthenticated(message),
            ApiError::InvalidKey(_)
            | ApiError::UnsupportedMediaType
            | ApiError::PayloadTooLarge(_)
            | ApiError::UnreadableBody(_)
            | ApiError::MalformedJson(_)
            | ApiError::InvalidRequest(_) => tonic::Status::invalid_argument(message),
            ApiError::KeyReused => tonic::Status::already_exists(message),
            ApiError::RequestTimeout(_) => tonic::Status::deadline_exceeded(message),
            ApiError::NotFound(_) => tonic::Status::not_found(message),
            ApiError::MethodNotAllowed(_) => tonic::Status::unimplemented(message),
            ApiError::Overloaded | ApiError::Unavailable => tonic::Status::unavailable(message),
            ApiError::Internal(_) | ApiError::InternalLogged => tonic::Status::internal(message),
        }
    }

    fn log(&self) {
        if let ApiError::Internal(error) = self {
            tracing::error!(error = format!("{error:#}"), "request failed");
        }
    }
}

impl From<InvalidOrder> for ApiError {
    fn from(error: InvalidOrder) -> Self {
        ApiError::InvalidRequest(error.to_string())
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        if error.is_unavailable() {
            return ApiError::Unavailable;
        }
        ApiError::Internal(anyhow::Error::new(error))
    }
}

impl From<WriteError> for ApiError {
    fn from(error: WriteError) -> Self {
        match error {
            WriteError::Overloaded => ApiError::Overloaded,
            WriteError::Unavailable => ApiError::Unavailable,
            WriteError::Failed => ApiError::InternalLogged,
            WriteError::Dropped => ApiError::Internal(anyhow::Error::new(error)),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.log();
        let body = json!({ "error": { "code": self.code(), "message": self.to_string() } });
        if let ApiError::Unauthenticated(_) = self {
            // RFC 6750: the scheme to use.
            let challenge = [(axum::http::header::WWW_AUTHENTICATE, "Bearer")];
            return (self.status(), challenge, Json(body)).into_response();
        }
        (self.status(), Json(body)).into_response()
    }
}

impl From<ApiError> for tonic::Status {
    fn from(error: ApiError) -> Self {
        error.log();
        error.to_status()
    }
}
