//! The outbox relay: publishes committed outbox rows to Kafka, at least once,
//! each key's first publishes in its events' order, and marks them
//! published. A re-publish (a stale relay's produce, a restart's) may land
//! after a later event of its key; the inbox absorbs it (ARCHITECTURE.md §6).
//!
//! At-least-once by design: a relay that dies after the broker acked a batch
//! and before its commit re-publishes that batch (same msg_ids) on restart.
//! The Payments inbox absorbs the duplicates; the relay never tries to be
//! exactly-once.
//!
//! The engine is the library's (`effectively::store::Relay`): its passes,
//! shard locks, groups, depth slots, wake-ups and backoff. This crate gives
//! it `orders.outbox` as its source, the envelope and metrics as its sink
//! and hooks ([`engine`]), and runs it from the command line ([`Config`]).
//!
//! Ordering across any number of relay processes: rows are split into
//! [`outbox::SHARDS`] shards by aggregate id; a pass publishes a shard's
//! rows only while its transaction holds the shard's advisory lock, reads
//! its oldest pending rows, sends each key's in id order (all in flight at
//! once through the idempotent producer, which keeps them in order on the
//! key's partition), awaits every delivery report, marks what was
//! delivered and commits. See ARCHITECTURE.md.
//!
//! Pipelining: the shards are split into `--shard-groups` groups, every
//! group has a loop of passes in each process, and up to `--workers` of
//! them hold a transaction at once, so one group's claim, mark and commit
//! overlap the others' broker acks. A key's events are in flight from one
//! pass at a time: its shard's.
//!
//! The modes: poll (the library relay's loops) and [`wal`] (the replication
//! stream) publish to Kafka through the same sink ([`publish`]);
//! [`webhooks`] delivers the same outbox as signed HTTP. [`run`] picks one
//! from the [`Config`].

pub mod config;
pub mod engine;
pub mod metrics;
pub mod outbox;
pub mod publish;
mod topic;
mod upkeep;
mod wake;
pub mod wal;
pub mod webhooks;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use effectively::egress::Egress;
use effectively::store::Relay;
use pipeline::crash::Crasher;
use rdkafka::producer::Producer;
use rdkafka::util::Timeout;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

pub use crate::config::{Command, Config, Mode, Sink, session_limits};
use crate::engine::{Hooks, OrdersOutbox};
use crate::metrics::RelayMetrics;
pub use crate::publish::{RelayContext, producer_config, sink};
use crate::publish::{Worker, topic_max_message_bytes};
use crate::upkeep::{sample_lag, sample_slot, spawn_outbox_expiry};
use crate::wake::{Wakes, listen};

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
    let pool = pipeline::db::connect(&db, session_limits(&config)).await?;
    let metrics = Arc::new(RelayMetrics::new().context("register metrics")?);
    if config.sink == Sink::Http {
        return run_webhooks(config, pool, metrics, metrics_listener, cancel).await;
    }
    // A topic that cannot keep what acks=all acknowledges is refused before
    // a row is published to it.
    // Both read the brokers, each up to its timeout while they do not answer.
    let (checked, max_message_bytes) = tokio::join!(
        topic::check(&config.kafka),
        topic_max_message_bytes(&config.kafka)
    );
    let unreadable = checked?;
    if let Some(error) = &unreadable {
        tracing::warn!(
            topic = %config.kafka.kafka_topic,
            error = %format!("{error:#}"),
            "could not read the topic's replication at start-up; checking it again while running"
        );
    }
    let cfg = config.clone();
    let context = RelayContext::default();
    let fatal = context.fatal.clone();
    let sink_metrics = metrics.clone();
    let busy_context = context.clone();
    let sink = tokio::task::spawn_blocking(move || {
        publish::sink(&cfg, context, max_message_bytes, sink_metrics)
    })
    .await
    .context("create producer task")??;
    // The WAL relay's second producer, taken while the stream is busy
    // (`wal::pace`); its fatal errors end the relay as the first's do.
    let busy = if config.mode == Mode::Wal
        && config.busy_linger_ms > 0
        && config.busy_linger_ms != config.linger_ms
    {
        let (cfg, metrics) = (config.clone(), metrics.clone());
        Some(
            tokio::task::spawn_blocking(move || {
                publish::sink_lingering(
                    &cfg,
                    cfg.busy_linger_ms,
                    busy_context,
                    max_message_bytes,
                    metrics,
                )
            })
            .await
            .context("create the busy producer task")??,
        )
    } else {
        None
    };
    // Everything below stops on a shutdown or on a fatal producer error.
    let outer = cancel;
    let cancel = outer.child_token();
    let crasher = Arc::new(Crasher::new(config.crash.clone()));

    let mut tasks = vec![pipeline::metrics::spawn_server(
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
    match pipeline::lifecycle::outbox_retention(&pool).await {
        Ok(retention) => tracing::info!(
            retention = %humantime::format_duration(retention),
            "published outbox rows expire after the outbox retention (orders.outbox_policy)"
        ),
        Err(error) => tracing::warn!(%error, "reading the outbox retention failed"),
    }
    tasks.push(spawn_outbox_expiry(&pool, &metrics, &cancel));
    // The topic unreadable at start-up: checked again until it can be read;
    // a refusal then ends the relay as it would have at start-up.
    let (refused_tx, mut refused) = tokio::sync::oneshot::channel();
    if unreadable.is_some() {
        let (kafka, cancel) = (config.kafka.clone(), cancel.clone());
        tasks.push(tokio::spawn(async move {
            if let Some(refusal) = topic::recheck(kafka, cancel).await {
                let _ = refused_tx.send(refusal);
            }
        }));
    }
    // A fatal error the producers' error callback does not see as one.
    for producer in std::iter::once(&sink).chain(&busy) {
        tasks.push(fatal.watch_producer(
            producer.kafka().producer().clone(),
            Duration::from_millis(500),
            cancel.clone(),
        ));
    }

    let workers = usize::from(config.workers.max(1));
    if config.shard_depth > 1 {
        tracing::warn!(
            shard_depth = config.shard_depth,
            "--shard-depth over 1 is not taken: a shard has one pass in flight at a time \
             (the relay reads a key's rows and marks them after the acks)"
        );
    }
    let max_attempts = config.max_attempts.max(1);
    let source = OrdersOutbox {
        topic: config.kafka.kafka_topic.clone(),
        max_attempts,
    };
    let hooks = Arc::new(Hooks {
        metrics: metrics.clone(),
        crasher: crasher.clone(),
        max_attempts,
    });
    let relay = Relay::over(pool.clone(), source, sink)
        .batch_size(u32::try_from(config.batch_size.max(1)).unwrap_or(u32::MAX))
        .shard_groups(config.shard_groups)
        .passes_at_once(workers)
        .poll_every(Duration::from_millis(config.poll_interval_ms))
        .hooks(hooks);
    let worker = Arc::new(Worker {
        pool: pool.clone(),
        relay: Arc::new(relay),
        metrics: metrics.clone(),
        crasher,
        permits: Semaphore::new(workers),
        busy,
    });
    let mut worker_tasks = Vec::new();
    // The WAL relay's end, when it ends by itself (a lost slot).
    let (wal_end_tx, mut wal_end) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
    match config.mode {
        Mode::Poll => {
            let (relay, cancel) = (worker.relay.clone(), cancel.clone());
            worker_tasks.push(tokio::spawn(async move { relay.run(cancel).await }));
            drop(wal_end_tx);
        }
        Mode::Wal => {
            let slot = wal::slot_name(
                &pool,
                config.wal_slot.as_deref(),
                config.db.connect_patience(),
            )
            .await?;
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
                busy_rows_per_sec: worker.busy.as_ref().map(|_| config.busy_rows_per_sec),
            };
            let (worker, cancel) = (worker.clone(), cancel.clone());
            worker_tasks.push(tokio::spawn(async move {
                let _ = wal_end_tx.send(wal::run(worker, wal_config, cancel).await);
            }));
        }
    }
    tracing::info!(mode = ?config.mode, workers, shard_groups = config.shard_groups, shard_depth = config.shard_depth, batch_size = config.batch_size, topic = %config.kafka.kafka_topic, "relay running");

    let mut wal_result = Ok(());
    let mut topic_refusal = None;
    tokio::select! {
        () = outer.cancelled() => {}
        () = fatal.fired() => {}
        Ok(result) = &mut wal_end => wal_result = result,
        Ok(refusal) = &mut refused => {
            tracing::error!(%refusal, "stopping: the topic cannot keep what it acknowledges");
            topic_refusal = Some(refusal);
        }
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
    let producers: Vec<_> = std::iter::once(worker.relay.sink())
        .chain(&worker.busy)
        .map(|sink| sink.kafka().producer().clone())
        .collect();
    let _ = tokio::task::spawn_blocking(move || {
        for producer in producers {
            let _ = producer.flush(Timeout::After(Duration::from_secs(5)));
        }
    })
    .await;
    pool.close().await;
    if let Some(refusal) = topic_refusal {
        return Err(refusal.into());
    }
    match fatal_reason {
        // The rows in flight stay pending (unmarked) and are published by
        // the next life.
        Some(reason) => anyhow::bail!("kafka producer in a fatal state: {reason}"),
        None => wal_result,
    }
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
        pipeline::metrics::spawn_server(metrics_listener, metrics.registry.clone(), work.clone()),
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
        tasks.push(tokio::spawn(pipeline::lifecycle::every(
            "webhook deliveries",
            pipeline::lifecycle::INTERVAL,
            pipeline::lifecycle::BATCH,
            metrics.relay_webhook_expired_total.clone(),
            work.clone(),
            move |batch| {
                let pool = pool.clone();
                async move { webhooks::expire(&pool, batch).await }
            },
        )));
    }
    let wakes = Wakes::new();
    let wake_rx = wakes.any();
    tasks.push(tokio::spawn(listen(
        pool.clone(),
        wakes,
        metrics.clone(),
        work.clone(),
    )));
    let specs = webhooks::Specs::from_args(&config.webhook_secrets)?;
    if let webhooks::Specs::Sealed(ring) = &specs {
        tracing::info!(
            key = ring.current(),
            "the destinations' specs are sealed at rest"
        );
        let plain = webhooks::plaintext(&pool)
            .await
            .context("read orders.webhook_destinations")?;
        if !plain.is_empty() {
            tracing::warn!(destinations = ?plain, "these destinations' signing secrets are stored in plaintext: `relay webhooks rekey` seals them");
        }
    } else {
        tracing::warn!(
            "--unsafe-plaintext-webhook-secrets: the destinations' signing secrets are stored in plaintext"
        );
    }
    let flags = webhooks::add_missing(&pool, &specs, &config.webhook_destination)
        .await
        .context("add the --webhook-destination flags to orders.webhook_destinations")?;
    if !flags.added.is_empty() {
        tracing::info!(destinations = ?flags.added, "added the --webhook-destination flags the database did not have");
    }
    if !flags.differing.is_empty() {
        tracing::warn!(
            destinations = ?flags.differing,
            "--webhook-destination differs from orders.webhook_destinations: the database's is kept \
             (change a destination with `relay webhooks add`, which every relay follows)"
        );
    }
    if !flags.removed.is_empty() {
        tracing::warn!(
            destinations = ?flags.removed,
            "--webhook-destination names destinations an operator removed: they stay removed \
             (`relay webhooks add` brings one back)"
        );
    }
    let destinations = webhooks::active(&pool, &specs)
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
    let egress = config
        .webhook_allow_addresses
        .iter()
        .fold(Egress::public_only(), |egress, net| egress.allow(*net));
    if !egress.allowed().is_empty() {
        tracing::info!(allowed = ?egress.allowed(), "webhooks may reach these networks besides public addresses");
    }
    let sender = Arc::new(webhooks::Sender::new(
        pool.clone(),
        specs,
        metrics.clone(),
        Arc::new(Crasher::new(config.crash.clone())),
        egress,
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
