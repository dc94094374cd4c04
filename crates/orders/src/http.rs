//! HTTP front end (axum): `POST /orders`, `GET /orders/{id}`. The metrics
//! are served on an address of their own (`--metrics-addr`), not here.
//! Every error, an unknown route or a method a route does not take included,
//! is JSON with a code (see [`ApiError`]). The connections are served by
//! `pipeline::serve` (a header read timeout, a cap on connections); the
//! router bounds a request's body and handling (a request timeout).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use pipeline::contract::IDEMPOTENCY_KEY;
use pipeline::idempotency::{IdempotencyKey, KeyError, StoredResponse};
use uuid::Uuid;

use crate::api::OrdersApi;
use crate::error::ApiError;
use crate::metrics::OrdersMetrics;
use crate::order::CreateOrder;

#[derive(Clone)]
struct AppState {
    api: OrdersApi,
    max_body_bytes: usize,
}

/// The HTTP router, with a body limit of `max_body_bytes` and a request
/// timeout of `request_timeout` on its routes (from the request's head to
/// its response, the body's reading included: past it, 408
/// `request_timeout`). Routes that do not read the body (an unknown one, a
/// method not allowed) answer at once, and an unread body closes the
/// connection.
pub fn router(api: OrdersApi, max_body_bytes: usize, request_timeout: Duration) -> Router {
    let metrics = Arc::new(api.metrics().clone());
    Router::new()
        .route("/orders", post(create_order))
        .route("/orders/{id}", get(get_order))
        // Inside `track`, so that a request timed out is counted (408).
        .route_layer(middleware::from_fn_with_state(request_timeout, time_limit))
        .route_layer(middleware::from_fn_with_state(metrics, track))
        .with_state(AppState {
            api,
            max_body_bytes,
        })
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        // axum adds `Allow`.
        .method_not_allowed_fallback(|method: Method| async move {
            ApiError::MethodNotAllowed(method.to_string())
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
}

async fn create_order(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match create_inner(&state, &headers, body).await {
        Ok(stored) => stored_into_response(stored),
        Err(error) => error.into_response(),
    }
}

async fn create_inner(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<StoredResponse, ApiError> {
    let caller = authenticate(state, headers)?;
    if !is_json(headers) {
        return Err(ApiError::UnsupportedMediaType);
    }
    let key = headers
        .get(IDEMPOTENCY_KEY)
        .ok_or(ApiError::InvalidKey(KeyError::Missing))
        .and_then(|raw| Ok(IdempotencyKey::parse(raw.as_bytes())?))?;
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(state.max_body_bytes)
        } else {
            ApiError::UnreadableBody(rejection.body_text())
        }
    })?;
    let request: CreateOrder = serde_json::from_slice(&body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => ApiError::InvalidRequest(e.to_string()),
        _ => ApiError::MalformedJson(e.to_string()),
    })?;
    // serde's derived struct visitor also accepts the array form `[1, 2]`;
    // the contract is an object with named fields.
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(ApiError::InvalidRequest(
            "the body must be a JSON object".into(),
        ));
    }
    state.api.create(&caller, &key, &request).await
}

/// The caller of the request, from its `Authorization` header.
fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<crate::auth::Caller, ApiError> {
    state.api.authenticate(
        headers
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes),
    )
}

/// `application/json`, optionally with parameters such as `charset=utf-8`.
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"))
}

/// Turns a stored response back into HTTP, byte for byte.
fn stored_into_response(stored: StoredResponse) -> Response {
    let status = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = status;
    for (name, value) in &stored.headers {
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            (Ok(name), Ok(value)) => {
                response.headers_mut().append(name, value);
            }
            _ => tracing::warn!(header = %name, "stored header not representable; skipped"),
        }
    }
    response
}

/// Any id that is not a UUID, one that does not percent-decode to UTF-8
/// included, names no order: 404 like an unknown UUID.
async fn get_order(
    State(state): State<AppState>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> Response {
    if let Err(error) = authenticate(&state, &headers) {
        return error.into_response();
    }
    let Ok(Path(id)) = id else {
        return ApiError::NotFound("no such order".into()).into_response();
    };
    let Ok(order_id) = Uuid::parse_str(&id) else {
        return ApiError::NotFound(format!("no order {id}")).into_response();
    };
    match state.api.get(order_id).await {
        Ok(order) => Json(order).into_response(),
        Err(error) => error.into_response(),
    }
}

/// Answers 408 `request_timeout` when the request (its body read, its
/// handling) takes longer than the request timeout. The handler's future is
/// dropped: a create not yet taken by a writer is not written; one already
/// written is replayed to the client's retry with the same key.
async fn time_limit(State(limit): State<Duration>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => ApiError::RequestTimeout(limit).into_response(),
    }
}

/// Counts and times every routed request by its route template (not the raw
/// path, which would give one series per order id).
async fn track(
    State(metrics): State<Arc<OrdersMetrics>>,
    request: Request,
    next: Next,
) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = request.method().clone();
    let start = Instant::now();
    let response = next.run(request).await;
    metrics
        .http_requests_total
        .with_label_values(&[route.as_str(), method.as_str(), response.status().as_str()])
        .inc();
    metrics
        .http_request_duration_seconds
        .with_label_values(&[route.as_str(), method.as_str()])
        .observe(start.elapsed().as_secs_f64());
    response
}
