//! The Orders service: idempotent order creation over HTTP and gRPC, the
//! order and its outbox event written in one transaction. It never publishes
//! to Kafka; the relay does, after the commit.

pub mod api;
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
pub mod proto {
    tonic::include_proto!("orders.v1");
}

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use effectively::config::DbArgs;
use effectively::crash::{CrashArgs, Crasher};
use effectively::idempotency::ClaimStrategy;
use effectively::outbox::Notifier;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The Orders service's database session limits (flags override them): its
/// statements are single-round-trip writes and key lookups, and its write
/// transactions run back to back, so a few seconds is already a fault.
pub const SESSION_LIMITS: effectively::config::SessionLimits = effectively::config::SessionLimits {
    statement_timeout: Duration::from_secs(10),
    idle_in_transaction_timeout: Duration::from_secs(10),
    custom_plans: false,
    // Four writers commit outbox rows back to back; a NOTIFY in each commit
    // would make them commit one at a time (effectively::outbox).
    defer_outbox_notify: true,
};

use crate::api::OrdersApi;
use crate::metrics::OrdersMetrics;
use crate::store::{InjectFault, Store};
use crate::writer::{WriteQueue, WriterSettings};

/// Orders service settings; every flag is also an environment variable.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "orders",
    version,
    about = "Orders service: idempotent POST /orders (HTTP) and orders.v1.Orders/Create (gRPC)",
    long_about = "Orders service: idempotent POST /orders (HTTP) and orders.v1.Orders/Create (gRPC).\n\n\
        Every create carries a client-chosen idempotency key (HTTP header Idempotency-Key, gRPC \
        metadata idempotency-key). Retries of a key return the first response; the same key with \
        a different request is refused (HTTP 409, gRPC ALREADY_EXISTS). The order and its outbox \
        event commit in one PostgreSQL transaction; the relay publishes them later."
)]
pub struct Config {
    #[command(flatten)]
    pub db: DbArgs,

    /// Crash point `commit`: SIGKILL after a write transaction commits and
    /// before its clients get their responses (they see an error and retry).
    #[command(flatten)]
    pub crash: CrashArgs,

    /// Address of the HTTP API (POST /orders, GET /orders/{id}, GET /metrics).
    #[arg(long, env = effectively::contract::env::ORDERS_HTTP_ADDR, default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,

    /// Address of the gRPC API (orders.v1.Orders).
    #[arg(long, env = effectively::contract::env::ORDERS_GRPC_ADDR, default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,

    /// Largest accepted request body in bytes; larger ones get 413.
    #[arg(long, env = "ORDERS_MAX_BODY_BYTES", default_value_t = 16 * 1024)]
    pub max_body_bytes: usize,

    /// How long a client may take to send a request's head, in
    /// milliseconds. HTTP: the request line and headers, counted from
    /// accept or from the previous response on a keep-alive connection (so
    /// it is also how long an idle keep-alive connection stays open). gRPC:
    /// the HTTP/2 connection preface, from accept. Past it the connection
    /// is closed. A valid client sends these at once; without the bound a
    /// client sending a byte a second holds its connection indefinitely.
    #[arg(long, env = "ORDERS_HEADER_READ_TIMEOUT_MS", default_value_t = 10_000)]
    pub header_read_timeout_ms: u64,

    /// Most time from a request's head to its response, in milliseconds,
    /// reading the body included. Past it, HTTP answers 408
    /// `request_timeout` and gRPC CANCELLED "Timeout expired" (retrying
    /// with the same key is safe: a create written meanwhile is replayed).
    /// Above the database's own 10 s limits, so a database fault is
    /// answered as one (503) rather than as a timeout; it bounds a client
    /// that trickles its body.
    #[arg(long, env = "ORDERS_REQUEST_TIMEOUT_MS", default_value_t = 30_000)]
    pub request_timeout_ms: u64,

    /// Connections open at once, on each API (HTTP, gRPC). At the cap the
    /// API accepts no more until one closes: new clients wait in the
    /// kernel's accept backlog (1,024; past it their SYNs are dropped and
    /// retried) rather than being refused, so a burst is served in turn (a
    /// slow client's slot frees within the header read timeout). Keep twice
    /// this under the process's open-file limit.
    #[arg(long, env = "ORDERS_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,

    /// gRPC: concurrent requests (HTTP/2 streams) on one connection, both
    /// advertised to the client (SETTINGS_MAX_CONCURRENT_STREAMS) and
    /// enforced; hyper's default. One connection cannot take the whole
    /// write queue.
    #[arg(
        long,
        env = "ORDERS_GRPC_MAX_STREAMS_PER_CONNECTION",
        default_value_t = 200
    )]
    pub grpc_max_streams_per_connection: usize,

    /// gRPC: how often an HTTP/2 PING checks a connection, in
    /// milliseconds, and the TCP keepalive time of its socket; a peer that
    /// does not answer a PING within `--grpc-keepalive-timeout-ms` is
    /// closed (a dead or wedged client frees its connection).
    #[arg(
        long,
        env = "ORDERS_GRPC_KEEPALIVE_INTERVAL_MS",
        default_value_t = 30_000
    )]
    pub grpc_keepalive_interval_ms: u64,

    /// gRPC: how long an HTTP/2 PING may go unanswered, in milliseconds,
    /// before the connection is closed.
    #[arg(
        long,
        env = "ORDERS_GRPC_KEEPALIVE_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub grpc_keepalive_timeout_ms: u64,

    /// On SIGTERM, how long in-flight requests may take before the process exits anyway.
    #[arg(long, env = "ORDERS_SHUTDOWN_TIMEOUT_SECS", default_value_t = 10)]
    pub shutdown_timeout_secs: u64,

    /// Writer tasks: concurrent write transactions, each carrying a batch of
    /// coalesced create requests.
    #[arg(long, env = "ORDERS_WRITERS", default_value_t = 4)]
    pub writers: usize,

    /// Most create requests coalesced into one transaction.
    #[arg(long, env = "ORDERS_WRITE_BATCH_MAX", default_value_t = 128)]
    pub write_batch_max: usize,

    /// Create requests accepted and not yet answered (queued, deferred
    /// behind an earlier request with the same key, or being written); beyond
    /// it, new ones get 503 `overloaded` at once (load shedding).
    #[arg(long, env = "ORDERS_WRITE_QUEUE", default_value_t = 4096)]
    pub write_queue: usize,

    /// How the write claims idempotency keys. `on-conflict`: one statement
    /// inserts the keys not taken yet with INSERT … ON CONFLICT DO NOTHING,
    /// the orders and outbox rows of those, and reads the others (a
    /// committed key is a plain read; a key whose first request is in flight
    /// waits for it). `advisory-lock`: a transaction takes an advisory lock
    /// on each key's hash, then runs the same statement (every request of a
    /// key waits for the lock, replays too). Experiment 7 compares them.
    #[arg(long, env = "ORDERS_CLAIM_STRATEGY", value_enum, default_value_t = ClaimStrategy::OnConflict)]
    pub claim_strategy: ClaimStrategy,

    /// Refuse to start when this host's clock differs from the database's
    /// by more than this many seconds. The order ids and msg_ids minted here
    /// are UUIDv7s of this host's time; payments files msg_ids by it and
    /// allows `--clock-skew` (5 minutes) for another host's clock, so keep
    /// this below that. A skew over 1 s is logged as a warning, and
    /// `orders_clock_skew_seconds` shows it.
    #[arg(long, env = "ORDERS_MAX_CLOCK_SKEW_SECS", default_value_t = 60)]
    pub max_clock_skew_secs: u64,

    /// Apply the database migrations and exit. Run it with the URL of the
    /// schemas' owner (the stack's DATABASE_URL), not the service's role.
    #[arg(long, env = "ORDERS_MIGRATE_ONLY")]
    pub migrate_only: bool,

    /// Testing only: fail every create inside its transaction at this point.
    #[arg(long, env = "ORDERS_INJECT_FAULT", value_enum, default_value_t = InjectFault::None, hide = true)]
    pub inject_fault: InjectFault,

    /// UNSAFE, MEASUREMENT ONLY: skip the idempotency check; every retry
    /// creates a DUPLICATE order.
    ///
    /// A baseline for experiment 1 (what does the idempotency check cost?):
    /// creates skip the key claim, the lookup of a stored response and the
    /// storing of one. Every request, first attempt or retry, writes a new
    /// order and a new outbox event (so Payments charges it again), in the
    /// same coalesced write transaction as with the check. The key is still
    /// required and validated, so the same clients work. Never run this
    /// where the orders matter: recon reports drift for every retried key.
    #[arg(long, env = "ORDERS_NO_IDEMPOTENCY")]
    pub no_idempotency: bool,
}

/// Runs both servers on the given listeners until `cancel` fires, then drains
/// in-flight requests (up to the shutdown timeout).
pub async fn run(
    config: Config,
    http: TcpListener,
    grpc: TcpListener,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    if config.no_idempotency {
        tracing::warn!(
            "--no-idempotency: the idempotency check is OFF; every retry creates a duplicate \
             order (measurement baseline only, never for real orders)"
        );
    }
    let pool = effectively::db::connect(&config.db, SESSION_LIMITS).await?;
    let metrics = Arc::new(OrdersMetrics::new().context("register metrics")?);
    let clock_bounds = effectively::clock::Bounds {
        refuse: Duration::from_secs(config.max_clock_skew_secs),
        ..Default::default()
    };
    effectively::clock::check_at_start(
        "orders",
        &pool,
        clock_bounds,
        &metrics.clock_skew_seconds,
        std::time::SystemTime::now,
    )
    .await?;
    let clock_watch = tokio::spawn(effectively::clock::watch(
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
        tokio::spawn(effectively::lifecycle::every(
            "idempotency keys",
            effectively::lifecycle::INTERVAL,
            effectively::lifecycle::BATCH,
            metrics.keys_expired_total.clone(),
            cancel.child_token(),
            move |batch| {
                let store = store.clone();
                async move { store.expire_keys(batch).await }
            },
        ))
    };
    let (writes, writers) = WriteQueue::start(store.clone(), settings, metrics.clone());
    let api = OrdersApi::new(store, writes, metrics);

    let request_timeout = Duration::from_millis(config.request_timeout_ms);
    let header_read_timeout = Duration::from_millis(config.header_read_timeout_ms);
    let app = http::router(api.clone(), config.max_body_bytes, request_timeout);
    let limits = effectively::serve::Limits {
        header_read_timeout,
        max_connections: config.max_connections,
    };
    let http_cancel = cancel.clone();
    let http_task = tokio::spawn(async move {
        effectively::serve::serve(http, app, limits, http_cancel).await;
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
    pool.close().await;
    first.context("server task panicked")?
}
