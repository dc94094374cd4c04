//! The outbox relay: publishes committed outbox rows to Kafka, at least once,
//! keeping each key's events in order, and marks them published.
//!
//! At-least-once by design: a relay that dies after the broker acked a batch
//! and before its commit re-publishes that batch (same msg_ids) on restart.
//! The Payments inbox absorbs the duplicates; the relay never tries to be
//! exactly-once.
//!
//! Ordering across any number of relay processes: rows are split into
//! [`outbox::SHARDS`] shards by aggregate id; a worker publishes a batch of
//! a shard only while its transaction holds one of the shard's advisory
//! locks (a slot), awaits every delivery report, marks the delivered rows
//! and commits. The claim takes a key's row only when no earlier row of the
//! key is pending, and skips rows locked by a claim in flight, so a key's
//! next event is claimed only after its previous one was acked and
//! committed published, by whichever transaction. See ARCHITECTURE.md.
//!
//! Pipelining: every shard has a loop of its own in each process (with
//! `--shard-depth` N, N loops, one per lock slot), and up to `--workers` of
//! them hold a shard transaction at once, so one shard's claim, mark and
//! commit overlap the others' broker acks, and at a depth over 1 its own.
//! A key's event is never in flight from two places: a claim skips the rows
//! in flight and every later row of their keys (`outbox::try_lock_shard`).

pub mod metrics;
pub mod outbox;
pub mod wal;
pub mod webhooks;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use clap::Parser;
use effectively::config::{DbArgs, KafkaArgs};
use effectively::contract::{CrashPoint, RELAY_MAX_MESSAGE_TIMEOUT};
use effectively::crash::{CrashArgs, Crasher};
use effectively::envelope::{HEADER_EVENT_TYPE, HEADER_MSG_ID};
use effectively::kafka::FatalState;
use effectively::retry::Backoff;
use futures::future::join_all;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::util::Timeout;
use rdkafka::{ClientConfig, ClientContext};
use sqlx::postgres::PgListener;
use sqlx::{PgPool, Postgres, Transaction};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

use crate::metrics::RelayMetrics;
use crate::outbox::{PendingRow, SHARDS};

/// Relay settings; every flag is also an environment variable.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "relay",
    version,
    about = "Outbox relay: publishes committed outbox rows to Kafka at least once, in per-key order"
)]
pub struct Config {
    /// An operator's command instead of running the relay.
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub db: DbArgs,

    #[command(flatten)]
    pub kafka: KafkaArgs,

    #[command(flatten)]
    pub crash: CrashArgs,

    /// Most rows claimed from one shard per transaction. At most `--workers`
    /// × this many rows are in flight to the broker at once, and the drain
    /// rate is about that over the ack latency (on the embedded broker 8 ×
    /// 1,000 drains faster than 8 × 500: FINDINGS §14). A crash at
    /// `publish` re-publishes up to that many (the inbox absorbs them).
    #[arg(long, env = "RELAY_BATCH_SIZE", default_value_t = 1000)]
    pub batch_size: i64,

    /// Shard transactions this process keeps open at once, each publishing
    /// one shard's batch (claim, produce, await acks, mark, commit). One
    /// shard's acks overlap the others' database work; more than the shards
    /// (16) adds nothing.
    #[arg(long, env = "RELAY_WORKERS", default_value_t = 8,
          value_parser = clap::value_parser!(u16).range(1..=SHARDS as i64))]
    pub workers: u16,

    /// Transactions one shard can have in flight at once (`--mode poll`),
    /// within `--workers`. At 1, a row committed while its shard awaits
    /// its batch's acks waits for them, the mark and the commit; at 2, a
    /// second transaction claims it meanwhile. Per-key order holds at any
    /// depth: a claim skips the rows in flight and every later row of their
    /// keys. Worth it where the broker's acks, not the CPU, are the wait: on
    /// 2 shared cores and the embedded broker, 2 gained nothing (FINDINGS
    /// §14).
    #[arg(long, env = "RELAY_SHARD_DEPTH", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(1..=outbox::MAX_SHARD_DEPTH as i64))]
    pub shard_depth: u8,

    /// Fallback poll interval in milliseconds when no NOTIFY arrives.
    #[arg(long, env = "RELAY_POLL_INTERVAL_MS", default_value_t = 500)]
    pub poll_interval_ms: u64,

    /// How often the backlog metrics are sampled, in milliseconds; less
    /// often while a sample is slow (over a large backlog), so that it keeps
    /// to a sixth of one database backend.
    #[arg(long, env = "RELAY_LAG_SAMPLE_MS", default_value_t = 1000)]
    pub lag_sample_ms: u64,

    /// Address serving GET /metrics.
    #[arg(long, env = effectively::contract::env::RELAY_METRICS_ADDR, default_value = "127.0.0.1:9101")]
    pub metrics_addr: SocketAddr,

    /// Producer linger in milliseconds (batching on the wire).
    #[arg(long, env = "RELAY_LINGER_MS", default_value_t = 5)]
    pub linger_ms: u64,

    /// Publish attempts an outbox row gets when the failure is the row's own
    /// (payload not JSON, over the broker's size limit) before it is marked
    /// failed: it is then never retried, holds back only the later events of
    /// its own key, and shows in `outbox_failed_rows` and in recon. Broker
    /// outages and timeouts do not count: those rows are retried forever.
    #[arg(long, env = "RELAY_MAX_ATTEMPTS", default_value_t = 5, value_parser = clap::value_parser!(i32).range(1..))]
    pub max_attempts: i32,

    /// Broker ack timeout for one message, in milliseconds; an unacked row
    /// stays pending and is retried. At most 300000 (5 min): payments adds
    /// that maximum to its redelivery horizon (a send still being retried can
    /// land that late).
    #[arg(long, env = effectively::contract::env::RELAY_MESSAGE_TIMEOUT_MS, default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1..=RELAY_MAX_MESSAGE_TIMEOUT.as_millis() as u64))]
    pub message_timeout_ms: u64,

    /// Where the outbox is read from. `poll`: each shard's pending rows are
    /// claimed in id order, woken by NOTIFY. `wal`: the rows arrive from
    /// PostgreSQL's logical replication (publication `effectively_outbox`,
    /// plugin pgoutput) in commit order; it needs `wal_level = logical` and
    /// the REPLICATION attribute for the relay's role (the migrations grant
    /// it when run as a superuser). Both mark rows published after the
    /// broker's ack and keep each key in order (ARCHITECTURE.md §6).
    #[arg(long, env = "RELAY_MODE", value_enum, default_value_t = Mode::Poll)]
    pub mode: Mode,

    /// `--mode wal`: the logical replication slot, made on first start.
    /// Default `effectively_outbox_<database>`. While the relay is down the
    /// slot keeps the server's WAL (up to `max_slot_wal_keep_size`, then the
    /// server invalidates it and the relay says what to do).
    #[arg(long, env = "RELAY_WAL_SLOT")]
    pub wal_slot: Option<String>,

    /// `--mode wal`: milliseconds between heartbeats, a logical message
    /// whose commit lets the slot's confirmed position follow the server's
    /// WAL when no outbox row is written.
    #[arg(long, env = "RELAY_WAL_HEARTBEAT_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(100..))]
    pub wal_heartbeat_ms: u64,

    /// Where the outbox goes. `kafka`: published to --kafka-topic. `http`:
    /// delivered as signed webhooks (Standard Webhooks) to every destination
    /// of `orders.webhook_destinations` (`relay webhooks add|remove|status`,
    /// or --webhook-destination), each at least once, in per-key order per
    /// destination, retried on a schedule of 5s, 30s, 5m, 30m, then 4h, with
    /// jitter, up to 8 attempts (then `failed`). Needs --mode poll.
    #[arg(long, env = effectively::contract::env::RELAY_SINK, value_enum, default_value_t = Sink::Kafka)]
    pub sink: Sink,

    /// `--sink http`: a destination, `NAME=URL,secret=whsec_...` with
    /// optional `,secret=...` (more secrets: every request is signed with
    /// each, for a rotation), `,timeout=10s` (per attempt, at most 30s),
    /// `,concurrency=16` (attempts in flight), `,max-attempts=8` (at most
    /// 8). Repeat the flag for more destinations; in the environment,
    /// separate them with `;`. At start-up each is added to (or replaces its
    /// namesake in) `orders.webhook_destinations`, the destinations every
    /// relay delivers to; `relay webhooks add|remove` change them while
    /// relays run.
    #[arg(
        long,
        env = effectively::contract::env::RELAY_WEBHOOK_DESTINATIONS,
        value_delimiter = ';',
        hide_env_values = true
    )]
    pub webhook_destination: Vec<webhooks::Destination>,

    /// `--sink http`, for tests and experiments: every scheduled retry wait
    /// is multiplied by this (0.001 turns 4 h into 14 s). 1 for real: the
    /// receivers' dedup horizon assumes the real schedule.
    #[arg(long, env = effectively::contract::env::RELAY_WEBHOOK_SCHEDULE_SCALE, default_value_t = 1.0,
          value_parser = parse_scale)]
    pub webhook_schedule_scale: f64,
}

/// The relay's operator commands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// The webhook deliveries of `--sink http`.
    #[command(subcommand)]
    Webhooks(webhooks::Admin),
}

fn parse_scale(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("{s:?}: a factor over 0 and at most 1")),
    }
}

/// Where the relay sends the outbox (`--sink`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Sink {
    /// Publish to Kafka.
    #[default]
    Kafka,
    /// Deliver as signed webhooks.
    Http,
}

/// Where the relay reads the outbox from (`--mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Claim pending rows shard by shard (NOTIFY and a poll wake it).
    Poll,
    /// Read inserted rows from the logical replication stream.
    Wal,
}

/// The producer's callbacks: a fatal client error ends the relay with an
/// error (see [`FatalState`]); the rows in flight stay unmarked and the next
/// life publishes them.
#[derive(Clone, Default)]
pub struct RelayContext {
    /// Fired by a fatal producer error.
    pub fatal: FatalState,
}

impl ClientContext for RelayContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.fatal.on_error("producer", error, reason);
    }
}

/// The relay's producer type.
pub type RelayProducer = FutureProducer<RelayContext>;

/// Builds the idempotent, acks=all producer: every send waits for
/// `min.insync.replicas` of the partition's replicas (2 of 3 on the stack),
/// at most 5 requests in flight per broker (the most idempotence keeps in
/// order across retries), and a send gives up after `--message-timeout-ms`,
/// a term of the consumers' redelivery horizon. It never creates its topic
/// (librdkafka's producer would by default, with the broker's default
/// partition count and configs): a missing topic is an operator's mistake,
/// so its sends fail, the rows stay pending and the error is logged.
///
/// `max_message_bytes` (the topic's `max.message.bytes`) becomes the
/// producer's `message.max.bytes`, so that librdkafka refuses a row over
/// the topic's limit itself, alone, and keeps its batches under it: the
/// broker refuses a whole batch that is over the limit, every row in it.
pub fn producer(
    config: &Config,
    context: RelayContext,
    max_message_bytes: usize,
) -> anyhow::Result<RelayProducer> {
    ClientConfig::new()
        .set("message.max.bytes", max_message_bytes.to_string())
        .set("bootstrap.servers", &config.kafka.kafka_bootstrap_servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("linger.ms", config.linger_ms.to_string())
        .set("message.timeout.ms", config.message_timeout_ms.to_string())
        .set("queue.buffering.max.messages", "1000000")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4")
        .set("allow.auto.create.topics", "false")
        .create_with_context(context)
        .context("create kafka producer")
}

/// The relay's database session settings (flags override the timeouts).
///
/// A shard's transaction stays open while the batch is produced and its
/// acks awaited (up to `--message-timeout-ms`), so its idle-in-transaction
/// limit must exceed that; it is also the bound on how long a hung relay
/// (SIGSTOP) keeps its shard locked.
///
/// Every statement is planned for its parameters: the outbox is a queue, its
/// pending rows swing from none to a backlog, and the claim's generic plan,
/// made while the outbox was empty, scans every pending row once per claimed
/// row (3.4 s a claim at 40,000 pending rows; the acceptance run's first
/// minute, FINDINGS §12).
pub fn session_limits(config: &Config) -> effectively::config::SessionLimits {
    effectively::config::SessionLimits {
        statement_timeout: Duration::from_secs(30),
        idle_in_transaction_timeout: Duration::from_millis(config.message_timeout_ms)
            + Duration::from_secs(10),
        custom_plans: true,
        defer_outbox_notify: false,
    }
}

/// Runs the relay until `cancel` fires.
pub async fn run(
    config: Config,
    metrics_listener: TcpListener,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    if config.sink == Sink::Http && config.mode != Mode::Poll {
        anyhow::bail!("--sink http needs --mode poll (the WAL relay publishes to Kafka only)");
    }
    let mut db = config.db.clone();
    let connections = match config.sink {
        Sink::Kafka => u32::from(config.workers),
        // Each destination's attempts record their outcome on a connection;
        // destinations may be added while the relay runs.
        Sink::Http => 64,
    };
    db.db_max_connections = db.db_max_connections.max(connections + 3);
    let pool = effectively::db::connect(&db, session_limits(&config)).await?;
    let metrics = Arc::new(RelayMetrics::new().context("register metrics")?);
    if config.sink == Sink::Http {
        return run_webhooks(config, pool, metrics, metrics_listener, cancel).await;
    }
    let max_message_bytes = topic_max_message_bytes(&config.kafka).await;
    let cfg = config.clone();
    let context = RelayContext::default();
    let fatal = context.fatal.clone();
    let producer = tokio::task::spawn_blocking(move || producer(&cfg, context, max_message_bytes))
        .await
        .context("create producer task")??;
    // Everything below stops on a shutdown or on a fatal producer error.
    let outer = cancel;
    let cancel = outer.child_token();
    let crasher = Arc::new(Crasher::new(config.crash.clone()));

    let mut tasks = vec![effectively::metrics::spawn_server(
        metrics_listener,
        metrics.registry.clone(),
        cancel.clone(),
    )];
    tasks.push(tokio::spawn(sample_lag(
        pool.clone(),
        metrics.clone(),
        Duration::from_millis(config.lag_sample_ms),
        cancel.clone(),
    )));
    // Published rows older than the outbox retention go, a batch at a time.
    match effectively::lifecycle::outbox_retention(&pool).await {
        Ok(retention) => tracing::info!(
            retention = %humantime::format_duration(retention),
            "published outbox rows expire after the outbox retention (orders.outbox_policy)"
        ),
        Err(error) => tracing::warn!(%error, "reading the outbox retention failed"),
    }
    tasks.push(spawn_outbox_expiry(&pool, &metrics, &cancel));
    // A fatal error the producer's error callback does not see as one.
    tasks.push(fatal.watch_producer(producer.clone(), Duration::from_millis(500), cancel.clone()));

    let workers = usize::from(config.workers.max(1));
    let worker = Arc::new(Worker {
        pool: pool.clone(),
        producer: producer.clone(),
        topic: config.kafka.kafka_topic.clone(),
        batch_size: config.batch_size.max(1),
        max_attempts: config.max_attempts.max(1),
        max_message_bytes,
        metrics: metrics.clone(),
        crasher,
        permits: Semaphore::new(workers),
    });
    let mut worker_tasks = Vec::new();
    // The WAL relay's end, when it ends by itself (a lost slot).
    let (wal_end_tx, mut wal_end) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
    match config.mode {
        Mode::Poll => {
            let (wake_tx, wake_rx) = watch::channel(0u64);
            tasks.push(tokio::spawn(listen(
                pool.clone(),
                wake_tx,
                metrics.clone(),
                cancel.clone(),
            )));
            let poll = Duration::from_millis(config.poll_interval_ms);
            for shard in 0..SHARDS {
                for slot in 0..config.shard_depth.max(1) {
                    worker_tasks.push(tokio::spawn(worker.clone().run_shard(
                        shard,
                        slot,
                        poll,
                        wake_rx.clone(),
                        cancel.clone(),
                    )));
                }
            }
            drop(wal_end_tx);
        }
        Mode::Wal => {
            let slot = wal::slot_name(&pool, config.wal_slot.as_deref()).await?;
            tasks.push(tokio::spawn(sample_slot(
                pool.clone(),
                slot.clone(),
                metrics.clone(),
                Duration::from_millis(config.lag_sample_ms),
                cancel.clone(),
            )));
            let wal_config = wal::WalConfig {
                database_url: config.db.database_url.clone(),
                slot,
                max_in_flight: workers * usize::try_from(config.batch_size.max(1)).unwrap_or(1),
                mark_batch: usize::try_from(config.batch_size.max(1)).unwrap_or(1),
                heartbeat: Duration::from_millis(config.wal_heartbeat_ms),
            };
            let (worker, cancel) = (worker.clone(), cancel.clone());
            worker_tasks.push(tokio::spawn(async move {
                let _ = wal_end_tx.send(wal::run(worker, wal_config, cancel).await);
            }));
        }
    }
    tracing::info!(mode = ?config.mode, workers, shard_depth = config.shard_depth, batch_size = config.batch_size, topic = %config.kafka.kafka_topic, "relay running");

    let mut wal_result = Ok(());
    tokio::select! {
        () = outer.cancelled() => {}
        () = fatal.fired() => {}
        Ok(result) = &mut wal_end => wal_result = result,
    }
    cancel.cancel();
    for t in worker_tasks {
        let _ = t.await;
    }
    if let Ok(result) = wal_end.try_recv() {
        wal_result = result;
    }
    for t in tasks {
        let _ = t.await;
    }
    let fatal_reason = fatal.reason();
    let _ =
        tokio::task::spawn_blocking(move || producer.flush(Timeout::After(Duration::from_secs(5))))
            .await;
    pool.close().await;
    match fatal_reason {
        // The rows in flight stay pending (unmarked) and are published by
        // the next life.
        Some(reason) => anyhow::bail!("kafka producer in a fatal state: {reason}"),
        None => wal_result,
    }
}

/// Deletes published outbox rows older than the outbox retention, a batch
/// at a time, every [`effectively::lifecycle::INTERVAL`], until `cancel`.
fn spawn_outbox_expiry(
    pool: &PgPool,
    metrics: &RelayMetrics,
    cancel: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let pool = pool.clone();
    tokio::spawn(effectively::lifecycle::every(
        "outbox",
        effectively::lifecycle::INTERVAL,
        effectively::lifecycle::BATCH,
        metrics.relay_outbox_expired_total.clone(),
        cancel.clone(),
        move |batch| {
            let pool = pool.clone();
            async move { outbox::expire(&pool, batch).await }
        },
    ))
}

/// `--sink http`: the fan-out and the destinations' delivery loops (see
/// [`webhooks`]), with the metrics server, the backlog sampler and the
/// outbox's expiry, until `cancel` fires.
async fn run_webhooks(
    config: Config,
    pool: PgPool,
    metrics: Arc<RelayMetrics>,
    metrics_listener: TcpListener,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let work = cancel.child_token();
    let mut tasks = vec![
        effectively::metrics::spawn_server(
            metrics_listener,
            metrics.registry.clone(),
            work.clone(),
        ),
        tokio::spawn(sample_lag(
            pool.clone(),
            metrics.clone(),
            Duration::from_millis(config.lag_sample_ms),
            work.clone(),
        )),
    ];
    tasks.push(spawn_outbox_expiry(&pool, &metrics, &work));
    {
        let pool = pool.clone();
        tasks.push(tokio::spawn(effectively::lifecycle::every(
            "webhook deliveries",
            effectively::lifecycle::INTERVAL,
            effectively::lifecycle::BATCH,
            metrics.relay_webhook_expired_total.clone(),
            work.clone(),
            move |batch| {
                let pool = pool.clone();
                async move { webhooks::expire(&pool, batch).await }
            },
        )));
    }
    let (wake_tx, wake_rx) = watch::channel(0u64);
    tasks.push(tokio::spawn(listen(
        pool.clone(),
        wake_tx,
        metrics.clone(),
        work.clone(),
    )));
    webhooks::upsert(&pool, &config.webhook_destination)
        .await
        .context("add the --webhook-destination flags to orders.webhook_destinations")?;
    let destinations = webhooks::active(&pool)
        .await
        .context("read orders.webhook_destinations")?;
    if destinations.is_empty() {
        anyhow::bail!(
            "--sink http needs a destination: --webhook-destination NAME=URL,secret=whsec_... \
             or `relay webhooks add NAME=URL,secret=whsec_...` (orders.webhook_destinations has none)"
        );
    }
    let names: Vec<&str> = destinations.iter().map(|d| d.name.as_str()).collect();
    tracing::info!(destinations = ?names, scale = config.webhook_schedule_scale, "relay delivering webhooks");
    if config.webhook_schedule_scale < 1.0 {
        tracing::warn!(
            scale = config.webhook_schedule_scale,
            "the retry schedule is scaled down (--webhook-schedule-scale): for tests and experiments only"
        );
    }
    let sender = Arc::new(webhooks::Sender::new(
        pool.clone(),
        metrics.clone(),
        Arc::new(Crasher::new(config.crash.clone())),
        config.webhook_schedule_scale,
    ));
    let result = sender
        .run(
            config.batch_size.max(1),
            Duration::from_millis(config.poll_interval_ms),
            wake_rx,
            work.clone(),
        )
        .await;
    work.cancel();
    for t in tasks {
        let _ = t.await;
    }
    pool.close().await;
    result
}

/// What the shard loops share: the clients, the settings, and the permits
/// that bound the shard transactions open at once (`--workers`).
struct Worker {
    pool: PgPool,
    producer: RelayProducer,
    topic: String,
    batch_size: i64,
    max_attempts: i32,
    /// The topic's `max.message.bytes`: a row larger than this is refused
    /// for itself; a smaller one refused as too large was refused for its
    /// batch (see [`Worker::publish`]).
    max_message_bytes: usize,
    metrics: Arc<RelayMetrics>,
    crasher: Arc<Crasher>,
    permits: Semaphore,
}

/// How publishing one row ended.
#[derive(Debug)]
enum Publish {
    /// The broker acked it.
    Delivered,
    /// The broker or the network failed; the row is retried, uncounted.
    Retry,
    /// The row itself cannot be published (the error says why); the attempt
    /// counts against `--max-attempts`.
    Rejected(String),
}

impl Worker {
    /// One shard slot's loop (`--shard-depth` of them per shard): publish a
    /// batch while there is one, then wait for a NOTIFY or the poll. A
    /// batch holds one of the `--workers` permits from its claim to its
    /// commit; the semaphore is fair, so a busy shard queues behind the
    /// others between batches instead of starving them.
    async fn run_shard(
        self: Arc<Self>,
        shard: i16,
        slot: u8,
        poll: Duration,
        mut wake: watch::Receiver<u64>,
        cancel: CancellationToken,
    ) {
        let mut backoff = Backoff::new();
        while !cancel.is_cancelled() {
            // Mark notifications seen *before* the batch: one arriving
            // meanwhile makes `changed()` below return at once.
            wake.borrow_and_update();
            let permit = tokio::select! {
                p = self.permits.acquire() => match p {
                    Ok(p) => p,
                    Err(_) => return, // closed: shutting down
                },
                () = cancel.cancelled() => return,
            };
            self.metrics.relay_shards_in_flight.inc();
            // Not cut short by a shutdown: a batch handed to the producer is
            // awaited and marked, so a clean stop re-publishes nothing.
            let result = self.relay_shard(shard, slot).await;
            self.metrics.relay_shards_in_flight.dec();
            drop(permit);
            match result {
                // A full or partial batch: there may be more right away.
                Ok(n) if n > 0 => backoff.reset(),
                // Nothing claimable, or another relay holds the shard.
                Ok(_) => {
                    backoff.reset();
                    tokio::select! {
                        _ = wake.changed() => {}
                        () = tokio::time::sleep(poll) => {}
                        () = cancel.cancelled() => return,
                    }
                }
                Err(error) => {
                    self.metrics
                        .relay_errors_total
                        .with_label_values(&["db"])
                        .inc();
                    tracing::warn!(
                        shard,
                        slot,
                        error = format!("{error:#}"),
                        retry_in_ms = backoff.next().as_millis() as u64,
                        "relay batch failed; will retry"
                    );
                    if !backoff.wait(&cancel).await {
                        return;
                    }
                }
            }
        }
    }

    /// One transaction: lock the shard's slot, claim, publish, await acks,
    /// mark, commit.
    ///
    /// Its span names the shard and, once claimed, the batch's row count, so
    /// every log of a row's publish says which batch it was in.
    #[tracing::instrument(level = "info", skip(self), fields(rows = tracing::field::Empty))]
    async fn relay_shard(&self, shard: i16, slot: u8) -> anyhow::Result<usize> {
        let mut tx = self.pool.begin().await.context("begin")?;
        if !outbox::try_lock_shard(&mut tx, shard, slot)
            .await
            .context("lock shard")?
        {
            return Ok(0);
        }
        let rows = outbox::claim(&mut tx, shard, self.batch_size)
            .await
            .context("claim outbox batch")?;
        if rows.is_empty() {
            tx.commit().await.context("commit empty claim")?;
            return Ok(0);
        }
        tracing::Span::current().record("rows", rows.len());
        let start = Instant::now();
        let results = join_all(rows.iter().map(|row| self.publish(row))).await;
        let mut delivered = Vec::with_capacity(rows.len());
        let mut rejected = Vec::new();
        for (row, result) in rows.iter().zip(results) {
            match result {
                Publish::Delivered => delivered.push(row.id),
                Publish::Retry => {}
                Publish::Rejected(error) => rejected.push((row.id, error)),
            }
        }
        self.metrics
            .relay_publish_duration_seconds
            .observe(start.elapsed().as_secs_f64());
        self.mark_batch(tx, &delivered, &rejected, self.max_attempts)
            .await?;
        Ok(delivered.len())
    }

    /// After the broker's acks: marks `delivered` published and records
    /// `rejected` (each row's own failure; marked failed at its
    /// `max_attempts`th), then commits `tx`. Both relay modes end a batch
    /// here.
    async fn mark_batch(
        &self,
        mut tx: Transaction<'_, Postgres>,
        delivered: &[i64],
        rejected: &[(i64, String)],
        max_attempts: i32,
    ) -> anyhow::Result<()> {
        // The broker has acked; the rows are not yet marked. A crash here
        // re-publishes them on restart: the at-least-once window.
        self.crasher.point(CrashPoint::Publish);
        outbox::mark_published(&mut tx, delivered)
            .await
            .context("mark published")?;
        let failed = if rejected.is_empty() {
            0
        } else {
            outbox::record_failures(&mut tx, rejected, max_attempts)
                .await
                .context("record failed publish attempts")?
        };
        tx.commit().await.context("commit published batch")?;
        if failed > 0 {
            tracing::error!(
                failed,
                max_attempts,
                "outbox rows marked failed: they will not be published (see orders.outbox.last_error); \
                 later events of their keys are held back"
            );
        }
        self.metrics.relay_rows_failed_total.inc_by(failed);
        self.metrics
            .relay_published_total
            .inc_by(delivered.len() as u64);
        self.metrics
            .relay_batch_size
            .observe(delivered.len() as f64);
        Ok(())
    }

    /// Produces one row.
    async fn publish(&self, row: &PendingRow) -> Publish {
        let value = match row.encode() {
            Ok(value) => value,
            Err(error) => {
                self.metrics
                    .relay_errors_total
                    .with_label_values(&["encode"])
                    .inc();
                tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, attempts = row.attempts + 1, %error, "outbox payload is not JSON");
                return Publish::Rejected(format!("payload is not JSON: {error}"));
            }
        };
        let key = row.aggregate_id.to_string();
        let msg_id = row.msg_id.to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: HEADER_MSG_ID,
                value: Some(msg_id.as_bytes()),
            })
            .insert(Header {
                key: HEADER_EVENT_TYPE,
                value: Some(row.event_type.as_bytes()),
            });
        let record = FutureRecord::to(&self.topic)
            .key(&key)
            .payload(&value)
            .headers(headers);
        match self
            .producer
            .send(record, Timeout::After(Duration::from_secs(10)))
            .await
        {
            Ok(_) => {
                let age = (Utc::now() - row.created_at)
                    .num_microseconds()
                    .unwrap_or(0) as f64
                    / 1e6;
                self.metrics
                    .relay_commit_to_publish_seconds
                    .observe(age.max(0.0));
                Publish::Delivered
            }
            Err((error, _))
                if error.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge)
                    && record_bytes(&key, &value, &msg_id, &row.event_type)
                        <= self.max_message_bytes =>
            {
                // The broker refused the batch this row was in, over the
                // topic's limit because of another row: this row is fine
                // and goes again, in another batch.
                self.metrics
                    .relay_errors_total
                    .with_label_values(&["produce"])
                    .inc();
                tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, bytes = value.len(), %error, "refused with a batch over the topic's limit; the row itself is under it and stays pending");
                Publish::Retry
            }
            Err((error, _)) if rejects_the_row(&error) => {
                self.metrics
                    .relay_errors_total
                    .with_label_values(&["rejected"])
                    .inc();
                tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, attempts = row.attempts + 1, bytes = value.len(), %error, "the row cannot be published");
                Publish::Rejected(format!("{error} ({} bytes)", value.len()))
            }
            Err((error, _)) => {
                self.metrics
                    .relay_errors_total
                    .with_label_values(&["produce"])
                    .inc();
                tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, %error, "publish failed; row stays pending");
                Publish::Retry
            }
        }
    }
}

/// Kafka's default `max.message.bytes`, taken when the topic's cannot be read.
const KAFKA_DEFAULT_MAX_MESSAGE_BYTES: usize = 1_048_588;

/// What a record adds to its key, value and headers in a batch (lengths,
/// attributes, offsets and timestamps as varints, the batch header), at most.
const RECORD_OVERHEAD_BYTES: usize = 128;

/// A record's size in a batch, at most.
fn record_bytes(key: &str, value: &[u8], msg_id: &str, event_type: &str) -> usize {
    key.len()
        + value.len()
        + HEADER_MSG_ID.len()
        + msg_id.len()
        + HEADER_EVENT_TYPE.len()
        + event_type.len()
        + RECORD_OVERHEAD_BYTES
}

/// The topic's `max.message.bytes`, read from the broker at start-up;
/// Kafka's default when it cannot be read (a topic not created yet: its
/// sends fail until it is, see [`producer`]).
async fn topic_max_message_bytes(kafka: &effectively::config::KafkaArgs) -> usize {
    const KEY: &str = "max.message.bytes";
    match effectively::kafka::topic_configs(
        &kafka.kafka_bootstrap_servers,
        &kafka.kafka_topic,
        &[KEY],
    )
    .await
    .map(|configs| configs.get(KEY).and_then(|v| v.parse::<usize>().ok()))
    {
        Ok(Some(bytes)) => {
            tracing::info!(bytes, topic = %kafka.kafka_topic, "the topic's max.message.bytes");
            bytes
        }
        Ok(None) => KAFKA_DEFAULT_MAX_MESSAGE_BYTES,
        Err(error) => {
            tracing::warn!(%error, topic = %kafka.kafka_topic, default = KAFKA_DEFAULT_MAX_MESSAGE_BYTES, "could not read the topic's max.message.bytes; using Kafka's default");
            KAFKA_DEFAULT_MAX_MESSAGE_BYTES
        }
    }
}

/// Whether a produce error is about the message itself (the same message
/// fails again, whatever the broker's health) rather than the broker.
fn rejects_the_row(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidRecord
        )
    )
}

/// Wakes the workers on every `NOTIFY orders_outbox` (sent on commit). A lost
/// connection is re-established with [`Backoff`] (reset once a LISTEN
/// succeeds); the workers poll meanwhile.
async fn listen(
    pool: PgPool,
    wake: watch::Sender<u64>,
    metrics: Arc<RelayMetrics>,
    cancel: CancellationToken,
) {
    let mut backoff = Backoff::new();
    loop {
        let started = Instant::now();
        match listen_once(&pool, &wake, &cancel).await {
            Ok(()) => return, // cancelled
            Err((error, listened)) => {
                metrics
                    .relay_errors_total
                    .with_label_values(&["listen"])
                    .inc();
                // A LISTEN that held a while starts the schedule again; one
                // cut right after it is established keeps backing off.
                if listened && started.elapsed() >= LISTEN_HELD {
                    backoff.reset();
                }
                tracing::warn!(%error, retry_in_ms = backoff.next().as_millis() as u64, "LISTEN lost; polling meanwhile");
                if !backoff.wait(&cancel).await {
                    return;
                }
            }
        }
    }
}

/// How long a LISTEN connection must have lived for its loss to restart the
/// reconnect backoff from its first delay.
const LISTEN_HELD: Duration = Duration::from_secs(5);

/// One LISTEN connection until it breaks (`Err`, with whether the LISTEN
/// itself had succeeded) or `cancel` fires (`Ok`). The listener does not
/// reconnect by itself: a lost connection ends it, and the caller opens a new
/// one after its backoff — whose first pass finds the rows whose NOTIFY was
/// lost meanwhile.
async fn listen_once(
    pool: &PgPool,
    wake: &watch::Sender<u64>,
    cancel: &CancellationToken,
) -> Result<(), (sqlx::Error, bool)> {
    let mut listener = PgListener::connect_with(pool)
        .await
        .map_err(|e| (e, false))?;
    listener.eager_reconnect(false);
    listener
        .listen(effectively::outbox::NOTIFY_CHANNEL)
        .await
        .map_err(|e| (e, false))?;
    // Rows committed while no one listened are found by the next pass.
    wake.send_modify(|g| *g = g.wrapping_add(1));
    loop {
        tokio::select! {
            n = listener.try_recv() => match n {
                Ok(Some(_)) => wake.send_modify(|g| *g = g.wrapping_add(1)),
                Ok(None) => {
                    let lost = std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "the LISTEN connection was lost",
                    );
                    return Err((sqlx::Error::Io(lost), true));
                }
                Err(error) => return Err((error, true)),
            },
            () = cancel.cancelled() => return Ok(()),
        }
    }
}

/// `--mode wal`: samples the WAL the slot retains.
async fn sample_slot(
    pool: PgPool,
    slot: String,
    metrics: Arc<RelayMetrics>,
    every: Duration,
    cancel: CancellationToken,
) {
    loop {
        match wal::slot_state(&pool, &slot).await {
            Ok(Some(state)) => metrics
                .relay_wal_slot_retained_bytes
                .set(state.retained_bytes),
            Ok(None) => metrics.relay_wal_slot_retained_bytes.set(0),
            Err(error) => tracing::debug!(%error, "sample the replication slot"),
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = cancel.cancelled() => return,
        }
    }
}

/// How many times its own duration the backlog sampler waits between two
/// samples, at least: the count reads every pending row, so over a large
/// backlog one sample costs a backend's second or more.
const LAG_SAMPLE_DUTY: u32 = 5;

/// The wait after a backlog sample that took `took`: `every`, or longer when
/// the sample was slow, so that sampling keeps to at most 1 /
/// (1 + [`LAG_SAMPLE_DUTY`]) of one database backend. Over a 1M-row backlog
/// a sample took 1.2–1.5 s; taken every second, it kept a backend busy
/// throughout the drain it was measuring (FINDINGS §14).
fn lag_sample_wait(every: Duration, took: Duration) -> Duration {
    every.max(took.saturating_mul(LAG_SAMPLE_DUTY))
}

/// Samples the backlog gauges, every `every` or more ([`lag_sample_wait`]).
async fn sample_lag(
    pool: PgPool,
    metrics: Arc<RelayMetrics>,
    every: Duration,
    cancel: CancellationToken,
) {
    loop {
        let start = Instant::now();
        let lag = match pool.acquire().await {
            Ok(mut conn) => outbox::lag(&mut conn).await,
            Err(error) => Err(error),
        };
        // Waiting for a connection counts too: the workers hold them while
        // the database is busy.
        let took = start.elapsed();
        match lag {
            Ok((pending, age, failed)) => {
                metrics.outbox_pending_rows.set(pending);
                metrics.outbox_failed_rows.set(failed);
                metrics.outbox_oldest_pending_age_seconds.set(age);
            }
            Err(error) => tracing::debug!(%error, "sample outbox lag"),
        }
        tokio::select! {
            () = tokio::time::sleep(lag_sample_wait(every, took)) => {}
            () = cancel.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_backlog_sample_stretches_the_wait_to_its_duty() {
        let every = Duration::from_secs(1);
        assert_eq!(lag_sample_wait(every, Duration::from_millis(3)), every);
        assert_eq!(lag_sample_wait(every, Duration::from_millis(200)), every);
        assert_eq!(
            lag_sample_wait(every, Duration::from_millis(1_300)),
            Duration::from_millis(6_500)
        );
        assert_eq!(
            lag_sample_wait(Duration::from_millis(200), Duration::from_millis(100)),
            Duration::from_millis(500)
        );
    }
}
