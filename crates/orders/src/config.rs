//! The Orders service's settings: its flags (every one also an environment
//! variable) and its database session limits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use pipeline::config::{DbArgs, RuntimeArgs};
use pipeline::crash::CrashArgs;
use pipeline::idempotency::ClaimStrategy;

use crate::store::InjectFault;

/// The Orders service's database session limits (flags override them): its
/// statements are single-round-trip writes and key lookups, and its write
/// transactions run back to back, so a few seconds is already a fault.
pub const SESSION_LIMITS: pipeline::config::SessionLimits = pipeline::config::SessionLimits {
    statement_timeout: Duration::from_secs(10),
    idle_in_transaction_timeout: Duration::from_secs(10),
    custom_plans: false,
    // Four writers commit outbox rows back to back; a NOTIFY in each commit
    // would make them commit one at a time (pipeline::outbox).
    defer_outbox_notify: true,
    asynchronous_commit: false,
    ordered_reads: false,
};

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
        event commit in one PostgreSQL transaction; the relay publishes them later.\n\n\
        With --auth-tokens-file every request needs a bearer token, and its caller scopes the \
        idempotency keys (the same key from two callers is two orders). `orders new-token CALLER` \
        mints a token (`orders new-token --help`)."
)]
pub struct Config {
    #[command(flatten)]
    pub db: DbArgs,

    #[command(flatten)]
    pub runtime: RuntimeArgs,

    /// Crash point `commit`: SIGKILL after a write transaction commits and
    /// before its clients get their responses (they see an error and retry).
    #[command(flatten)]
    pub crash: CrashArgs,

    /// Address of the HTTP API (POST /orders, GET /orders/{id}).
    #[arg(long, env = pipeline::contract::env::ORDERS_HTTP_ADDR, default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,

    /// Address of GET /metrics (Prometheus text), off the public HTTP port:
    /// the API's clients never see the service's counters, and a scraper
    /// needs no way in to the API. Keep it on a network only the scraper
    /// reaches.
    #[arg(long, env = pipeline::contract::env::ORDERS_METRICS_ADDR, default_value = "127.0.0.1:9100")]
    pub metrics_addr: SocketAddr,

    /// Address of the gRPC API (orders.v1.Orders).
    #[arg(long, env = pipeline::contract::env::ORDERS_GRPC_ADDR, default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,

    /// Bearer tokens: every request must carry one (`Authorization: Bearer
    /// CALLER.SECRET`; gRPC metadata `authorization`), else 401
    /// `unauthenticated` (gRPC UNAUTHENTICATED). The file holds one line per
    /// token, `CALLER sha256:HEX` (the token's digest, never the token;
    /// `orders new-token` writes it); SIGHUP re-reads it. The caller scopes
    /// its idempotency keys. Unset: no authentication, every caller shares
    /// one key scope.
    #[arg(long, env = "ORDERS_AUTH_TOKENS_FILE")]
    pub auth_tokens_file: Option<PathBuf>,

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

    /// How long, in microseconds, a writer with room in its batch may wait
    /// for more create requests before it writes: fewer, larger commits for
    /// the same requests, at the price of up to this much latency. A writer
    /// waits only while requests arrive fast enough that at least one more
    /// is expected in that time (the rate over the last 10 ms or more), so
    /// a lone request is written at once. 0 turns it off. 2 ms rather than 1:
    /// at 1,000 req/s, 1 ms is the threshold itself and batches stayed near
    /// one request (FINDINGS §15).
    #[arg(long, env = "ORDERS_WRITE_LINGER_US", default_value_t = 2_000)]
    pub write_linger_us: u64,

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

/// `orders new-token`: mints a bearer token for a caller.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "orders new-token",
    about = "Mint a bearer token for CALLER: the token on stdout (shown once), its line for --auth-tokens-file appended to --append-to (made 0600) or written to stderr",
    long_about = "Mint a bearer token for CALLER: CALLER.SECRET, 256 random bits in base64url, on \
        stdout (it is shown once; the service keeps only its digest). Its line for the tokens file \
        (`CALLER sha256:HEX`) is appended to --append-to, a file made 0600 when new, or written to \
        stderr. Rotate by minting a second token for the caller, moving the caller to it, deleting \
        the old line and sending orders SIGHUP."
)]
pub struct NewToken {
    /// The caller's name: 1 to 64 ASCII letters, digits, '_' or '-'.
    pub caller: String,

    /// The tokens file to append the token's line to.
    #[arg(long)]
    pub append_to: Option<PathBuf>,
}
