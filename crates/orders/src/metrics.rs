//! The Orders service's Prometheus metrics.

use pipeline::contract::{
    ORDERS_WRITE_BATCH_SIZE, ORDERS_WRITE_ERROR_LABEL, ORDERS_WRITE_ERRORS_TOTAL,
};
use pipeline::metrics::LATENCY_BUCKETS;
use prometheus::{
    Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry,
};

/// Everything the Orders service counts. Registered in one [`Registry`],
/// served at `GET /metrics` on the metrics address (`--metrics-addr`).
#[derive(Debug, Clone)]
pub struct OrdersMetrics {
    /// The registry holding these metrics.
    pub registry: Registry,
    /// HTTP requests finished, by matched route, method and status code.
    pub http_requests_total: IntCounterVec,
    /// HTTP request duration in seconds, by matched route and method.
    pub http_request_duration_seconds: HistogramVec,
    /// gRPC calls finished, by method and status code name.
    pub grpc_requests_total: IntCounterVec,
    /// gRPC call duration in seconds, by method.
    pub grpc_request_duration_seconds: HistogramVec,
    /// Idempotency-key outcomes of create requests (both protocols):
    /// `new` (first use), `replay` (same key, same request), `mismatch`
    /// (same key, different request).
    pub idempotency_outcomes_total: IntCounterVec,
    /// Create requests per write transaction (the coalescing factor).
    pub write_batch_size: Histogram,
    /// Create requests accepted and not yet answered: queued, deferred
    /// behind their key, or in a write transaction. `--write-queue` bounds it.
    pub write_inflight: IntGauge,
    /// Create requests dropped unwritten because their client went away
    /// before a writer took them.
    pub write_abandoned_total: IntCounter,
    /// Write transactions that failed, by kind (`StoreError::kind`:
    /// unavailable, deadlock, serialization, lock_timeout,
    /// statement_timeout, db, other).
    pub write_errors_total: IntCounterVec,
    /// Idempotency keys deleted after the key retention
    /// (`orders.key_policy`): a retry of one of them is a new request.
    pub keys_expired_total: IntCounter,
    /// The database's clock minus this host's, in seconds, measured at
    /// start-up and every minute (`pipeline::clock`): the order ids and
    /// msg_ids minted here carry this host's time.
    pub clock_skew_seconds: Gauge,
    /// Requests refused for want of a valid bearer token
    /// (`--auth-tokens-file`), by reason: `missing`, `malformed`, `unknown`.
    pub auth_refusals_total: IntCounterVec,
}

impl OrdersMetrics {
    /// Creates and registers the metrics in a fresh registry.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = pipeline::metrics::registry();
        let http_requests_total = IntCounterVec::new(
            Opts::new("http_requests_total", "HTTP requests finished"),
            &["route", "method", "status"],
        )?;
        let http_request_duration_seconds = HistogramVec::new(
            HistogramOpts::new(
                "http_request_duration_seconds",
                "HTTP request duration in seconds",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["route", "method"],
        )?;
        let grpc_requests_total = IntCounterVec::new(
            Opts::new("grpc_requests_total", "gRPC calls finished"),
            &["method", "code"],
        )?;
        let grpc_request_duration_seconds = HistogramVec::new(
            HistogramOpts::new(
                "grpc_request_duration_seconds",
                "gRPC call duration in seconds",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["method"],
        )?;
        let idempotency_outcomes_total = IntCounterVec::new(
            Opts::new(
                "idempotency_outcomes_total",
                "Idempotency-key outcomes of create requests: new, replay, mismatch",
            ),
            &["outcome"],
        )?;
        let write_batch_size = Histogram::with_opts(
            HistogramOpts::new(
                ORDERS_WRITE_BATCH_SIZE,
                "Create requests per write transaction (the coalescing factor)",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]),
        )?;
        let write_inflight = IntGauge::new(
            "orders_write_inflight",
            "Create requests accepted and not yet answered (bounded by --write-queue)",
        )?;
        let write_abandoned_total = IntCounter::new(
            "orders_write_abandoned_total",
            "Create requests dropped unwritten because their client went away",
        )?;
        let write_errors_total = IntCounterVec::new(
            Opts::new(
                ORDERS_WRITE_ERRORS_TOTAL,
                "Write transactions that failed, by kind (unavailable, deadlock, serialization, lock_timeout, statement_timeout, db, other)",
            ),
            &[ORDERS_WRITE_ERROR_LABEL],
        )?;
        for kind in crate::store::WriteErrorKind::ALL {
            write_errors_total.with_label_values(&[kind.label()]);
        }
        registry.register(Box::new(write_errors_total.clone()))?;
        let keys_expired_total = IntCounter::new(
            "orders_idempotency_keys_expired_total",
            "Idempotency keys deleted after the key retention (a retry of one is a new request)",
        )?;
        registry.register(Box::new(keys_expired_total.clone()))?;
        let clock_skew_seconds = Gauge::new(
            "orders_clock_skew_seconds",
            "The database's clock minus this host's, in seconds (ids minted here carry this host's time)",
        )?;
        registry.register(Box::new(clock_skew_seconds.clone()))?;
        let auth_refusals_total = IntCounterVec::new(
            Opts::new(
                "orders_auth_refusals_total",
                "Requests refused for want of a valid bearer token, by reason (missing, malformed, unknown)",
            ),
            &["reason"],
        )?;
        for reason in crate::auth::AuthError::ALL {
            auth_refusals_total.with_label_values(&[reason.label()]);
        }
        registry.register(Box::new(auth_refusals_total.clone()))?;
        registry.register(Box::new(write_batch_size.clone()))?;
        registry.register(Box::new(write_inflight.clone()))?;
        registry.register(Box::new(write_abandoned_total.clone()))?;
        registry.register(Box::new(http_requests_total.clone()))?;
        registry.register(Box::new(http_request_duration_seconds.clone()))?;
        registry.register(Box::new(grpc_requests_total.clone()))?;
        registry.register(Box::new(grpc_request_duration_seconds.clone()))?;
        registry.register(Box::new(idempotency_outcomes_total.clone()))?;
        for outcome in ["new", "replay", "mismatch"] {
            idempotency_outcomes_total.with_label_values(&[outcome]);
        }
        Ok(Self {
            registry,
            http_requests_total,
            http_request_duration_seconds,
            grpc_requests_total,
            grpc_request_duration_seconds,
            idempotency_outcomes_total,
            write_batch_size,
            write_inflight,
            write_abandoned_total,
            write_errors_total,
            keys_expired_total,
            clock_skew_seconds,
            auth_refusals_total,
        })
    }
}
