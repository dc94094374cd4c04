//! Prometheus plumbing shared by every service: a registry, its text
//! exposition, and (feature `http`) a `GET /metrics` router and server.

#[cfg(feature = "http")]
use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use prometheus::{Encoder, Registry, TextEncoder};

/// Latency buckets in seconds, from 100 µs to 10 s: fine enough at the low end
/// for a sub-millisecond database hop, wide enough for commit→effect.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.075, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A registry with the process collector (CPU seconds, resident memory, open
/// fds, start time) already in it: restarts and leaks show on every service.
pub fn registry() -> Registry {
    let registry = Registry::new();
    #[cfg(target_os = "linux")]
    if let Err(error) = registry.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    )) {
        tracing::warn!(%error, "process metrics unavailable");
    }
    registry
}

/// Renders `registry` in the Prometheus text format.
pub fn render(registry: &Registry) -> Result<String, prometheus::Error> {
    let mut buf = Vec::with_capacity(16 * 1024);
    TextEncoder::new().encode(&registry.gather(), &mut buf)?;
    String::from_utf8(buf).map_err(|e| prometheus::Error::Msg(e.to_string()))
}

/// A router serving `GET /metrics` from `registry`.
#[cfg(feature = "http")]
pub fn router(registry: Registry) -> Router {
    Router::new()
        .route("/metrics", get(serve))
        .with_state(registry)
}

/// Serves `GET /metrics` from `registry` on `listener` until `cancel` fires:
/// the metrics endpoint of a service that has no HTTP API of its own.
#[cfg(feature = "http")]
pub fn spawn_server(
    listener: tokio::net::TcpListener,
    registry: Registry,
    cancel: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    spawn_router("metrics", listener, router(registry), cancel)
}

/// Serves `router` on `listener` until `cancel` fires, then lets the
/// requests in flight finish; within the default [`crate::serve::Limits`]
/// (a header read timeout, a cap on open connections); `what` names the
/// server in the log.
#[cfg(feature = "http")]
pub fn spawn_router(
    what: &'static str,
    listener: tokio::net::TcpListener,
    router: Router,
    cancel: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        crate::serve::serve(listener, router, crate::serve::Limits::default(), cancel).await;
        tracing::debug!("{what} server stopped");
    })
}

#[cfg(feature = "http")]
async fn serve(State(registry): State<Registry>) -> Response {
    match render(&registry) {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(error) => {
            tracing::error!(%error, "render metrics");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}
