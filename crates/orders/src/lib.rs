//! The Orders service: idempotent order creation over HTTP and gRPC, the
//! order and its outbox event written in one transaction. It never publishes
//! to Kafka; the relay does, after the commit.

pub mod api;
pub mod auth;
pub mod config;
pub mod error;
pub mod grpc;
pub mod http;
pub mod incoming;
pub mod metrics;
pub mod order;
pub mod store;
pub mod writer;

/// Types generated from `proto/orders.proto`.
#[allow(unreachable_pub, clippy::all, missing_docs)]
pub mod proto;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pipeline::crash::Crasher;
use pipeline::outbox::Notifier;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::OrdersApi;
use crate::auth::Authenticator;
use crate::config::{Config, SESSION_LIMITS};
use crate::metrics::OrdersMetrics;
use crate::store::Store;
use crate::writer::{WriteQueue, WriterSettings};

/// Where the service listens: its two APIs and, apart from them, its metrics.
#[derive(Debug)]
pub struct Listeners {
    /// The HTTP API (`POST /orders`, `GET /orders/{id}`).
    pub http: TcpListener,
    /// The gRPC API (`orders.v1.Orders`).
    pub grpc: TcpListener,
    /// `GET /metrics`.
    pub metrics: TcpListener,
}

/// Runs both servers and the metrics endpoint on the given listeners until
/// `cancel` fires, then drains in-flight requests (up to the shutdown
/// timeout).
pub async fn run(
    config: Config,
    listeners: Listeners,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let Listeners {
        http,
        grpc,
        metrics: metrics_listener,
    } = listeners;
    if config.no_idempotency {
        tracing::warn!(
            "--no-idempotency: the idempotency check is OFF; every retry creates a duplicate \
             order (measurement baseline only, never for real orders)"
        );
    }
    let auth = Arc::new(match &config.auth_tokens_file {
        Some(path) => Authenticator::from_file(path).map_err(anyhow::Error::msg)?,
        None => Authenticator::off(),
    });
    match auth.counts() {
        Some((tokens, callers)) => tracing::info!(
            tokens,
            callers,
            "callers authenticate with bearer tokens; each caller's idempotency keys are its own"
        ),
        None => tracing::warn!(
            "no --auth-tokens-file: callers are not authenticated and share one idempotency key scope"
        ),
    }
    let pool = pipeline::db::connect(&config.db, SESSION_LIMITS).await?;
    let metrics = Arc::new(OrdersMetrics::new().context("register metrics")?);
    let clock_bounds = pipeline::clock::Bounds {
        refuse: Duration::from_secs(config.max_clock_skew_secs),
        ..Default::default()
    };
    pipeline::clock::check_at_start(
        "orders",
        &pool,
        clock_bounds,
        config.db.connect_patience(),
        &metrics.clock_skew_seconds,
        std::time::SystemTime::now,
    )
    .await?;
    let clock_watch = tokio::spawn(pipeline::clock::watch(
        clock_bounds,
        pool.clone(),
        metrics.clock_skew_seconds.clone(),
        cancel.child_token(),
    ));
    // Its own token: it sends the wake-up of the writers' last batches after
    // they finish, then stops.
    let notify_cancel = CancellationToken::new();
    let (notifier, notify_task) = Notifier::start(pool.clone(), notify_cancel.clone());
    let store = Arc::new(
        Store::new(
            pool.clone(),
            config.inject_fault,
            config.no_idempotency,
            Crasher::new(config.crash.clone()),
        )
        .with_claim_strategy(config.claim_strategy)
        .with_notifier(notifier),
    );
    let settings = WriterSettings {
        writers: config.writers,
        max_batch: config.write_batch_max,
        queue: config.write_queue,
        linger: std::time::Duration::from_micros(config.write_linger_us),
    };
    // Keys older than the key retention go, a batch at a time.
    match store.key_retention_secs().await {
        Ok(secs) => tracing::info!(
            retention_secs = secs,
            "idempotency keys expire after the key retention (orders.key_policy); a retry after it is a new request"
        ),
        Err(error) => tracing::warn!(%error, "reading the key retention failed"),
    }
    let expiry = {
        let store = store.clone();
        tokio::spawn(pipeline::lifecycle::every(
            "idempotency keys",
            pipeline::lifecycle::INTERVAL,
            pipeline::lifecycle::BATCH,
            metrics.keys_expired_total.clone(),
            cancel.child_token(),
            move |batch| {
                let store = store.clone();
                async move { store.expire_keys(batch).await }
            },
        ))
    };
    let (writes, writers) = WriteQueue::start(store.clone(), settings, metrics.clone());
    let metrics_server =
        pipeline::metrics::spawn_server(metrics_listener, metrics.registry.clone(), cancel.clone());
    let api = OrdersApi::new(store, writes, metrics).with_auth(auth.clone());
    let reload = tokio::spawn(reload_on_hangup(auth, cancel.child_token()));

    let request_timeout = Duration::from_millis(config.request_timeout_ms);
    let header_read_timeout = Duration::from_millis(config.header_read_timeout_ms);
    let app = http::router(api.clone(), config.max_body_bytes, request_timeout);
    let limits = pipeline::serve::Limits {
        header_read_timeout,
        max_connections: config.max_connections,
    };
    let http_cancel = cancel.clone();
    let http_task = tokio::spawn(async move {
        pipeline::serve::serve(http, app, limits, http_cancel).await;
        anyhow::Ok(())
    });

    let grpc_cancel = cancel.clone();
    let grpc_service = proto::orders_server::OrdersServer::new(grpc::OrdersGrpc::new(api));
    let keepalive = Duration::from_millis(config.grpc_keepalive_interval_ms);
    let incoming = incoming::bounded(grpc, config.max_connections, header_read_timeout, keepalive);
    let streams = config.grpc_max_streams_per_connection.max(1);
    let grpc_server = tonic::transport::Server::builder()
        .timeout(request_timeout)
        .concurrency_limit_per_connection(streams)
        .max_concurrent_streams(u32::try_from(streams).unwrap_or(u32::MAX))
        .http2_keepalive_interval(Some(keepalive))
        .http2_keepalive_timeout(Some(Duration::from_millis(
            config.grpc_keepalive_timeout_ms,
        )));
    let grpc_task = tokio::spawn(async move {
        let mut grpc_server = grpc_server;
        grpc_server
            .add_service(grpc_service)
            .serve_with_incoming_shutdown(incoming, grpc_cancel.cancelled_owned())
            .await
            .context("serve grpc")
    });

    // Either server failing stops the other; a signal stops both. A task
    // that already finished here must not be awaited again (a JoinHandle
    // polled after completion panics), hence the two flags.
    let mut http_task = http_task;
    let mut grpc_task = grpc_task;
    let (mut http_done, mut grpc_done) = (false, false);
    let first = tokio::select! {
        r = &mut http_task => { http_done = true; r }
        r = &mut grpc_task => { grpc_done = true; r }
        () = cancel.cancelled() => Ok(Ok(())),
    };
    cancel.cancel();
    let deadline = Duration::from_secs(config.shutdown_timeout_secs);
    let drained = tokio::time::timeout(deadline, async {
        if !http_done {
            let _ = (&mut http_task).await;
        }
        if !grpc_done {
            let _ = (&mut grpc_task).await;
        }
        // The servers (and with them every handle on the queue) are gone:
        // the writers finish the batch in hand and stop.
        for writer in writers {
            let _ = writer.await;
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!("in-flight requests did not finish within the shutdown timeout");
    }
    notify_cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(1), notify_task).await;
    expiry.abort();
    let _ = expiry.await;
    clock_watch.abort();
    let _ = clock_watch.await;
    reload.abort();
    let _ = reload.await;
    let _ = tokio::time::timeout(Duration::from_secs(1), metrics_server).await;
    pool.close().await;
    first.context("server task panicked")?
}

/// Re-reads the tokens file on each SIGHUP until `cancel` fires; a file that
/// does not parse leaves the tokens in use (and says why).
async fn reload_on_hangup(auth: Arc<Authenticator>, cancel: CancellationToken) {
    if !auth.is_on() {
        return;
    }
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangups = match signal(SignalKind::hangup()) {
            Ok(hangups) => hangups,
            Err(error) => {
                tracing::warn!(%error, "no SIGHUP handler: the tokens file is read at start only");
                return;
            }
        };
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                got = hangups.recv() => if got.is_none() { return },
            }
            match auth.reload() {
                Ok(Some((tokens, callers))) => {
                    tracing::info!(tokens, callers, "SIGHUP: the tokens file read again")
                }
                Ok(None) => {}
                Err(error) => tracing::error!(
                    %error,
                    "SIGHUP: the tokens file does not read; the tokens in use stay"
                ),
            }
        }
    }
    #[cfg(not(unix))]
    cancel.cancelled().await;
}
