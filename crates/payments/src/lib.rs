//! The Payments consumer: for each polled batch of `order.events`, ONE
//! transaction claims the msg_ids in the inbox and writes the charges of the
//! new ones; offsets are committed only after that transaction commits.
//!
//! Dedup keys on the msg_id carried in the event, never on a Kafka offset: a
//! relay re-publish lands at a new offset with the same msg_id. Redelivery
//! (a crash before the offset commit, a rebalance, a re-publish) is expected
//! and is a provable no-op.
//!
//! The walk of a message to its charge: [`run`] → [`consumer::consume`]
//! (batches, offset commits; the client in [`kafka`]) or the webhook
//! receiver ([`receiver`]) → [`process`] (decode, retry, bisect) →
//! [`inbox::apply_batch`] (the one transaction); events it cannot record
//! yet wait in [`park`].

pub mod config;
pub mod consumer;
pub mod decode;
pub mod delivery;
pub mod dup;
pub mod expiry;
mod hold;
pub mod horizon;
pub mod inbox;
pub mod kafka;
pub mod metrics;
pub mod park;
pub mod process;
pub mod receiver;
pub mod unsafe_split;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pipeline::crash::Crasher;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use crate::config::{
    Config, DEFAULT_FETCH_WAIT_MAX_MS, GroupProtocol, HorizonRefusal, Transport, check_horizon,
    check_topic,
};
pub use crate::decode::InputFormat;
pub use crate::kafka::{PaymentsConsumer, RebalanceContext, partition_lag};
use crate::metrics::PaymentsMetrics;
use crate::process::Apply;
pub use crate::process::classify;

/// Runs payments until `cancel` fires: the Kafka consumer, or with
/// `--source http` the webhook receiver on `--webhook-addr`.
pub async fn run(
    config: Config,
    metrics_listener: TcpListener,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let webhooks = match config.source {
        Transport::Http => Some(
            TcpListener::bind(config.webhook.webhook_addr)
                .await
                .with_context(|| format!("bind webhooks {}", config.webhook.webhook_addr))?,
        ),
        Transport::Kafka => None,
    };
    run_on(config, metrics_listener, webhooks, cancel).await
}

/// [`run`] on listeners already bound: `webhooks` serves POST
/// /webhooks/orders with `--source http` (and is required then).
pub async fn run_on(
    config: Config,
    metrics_listener: TcpListener,
    webhooks: Option<TcpListener>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    config.check().map_err(anyhow::Error::msg)?;
    // A batch's transaction runs its statements back to back: seconds are
    // plenty; a consumer hung mid-transaction releases its rows in 30 s.
    let limits = pipeline::config::SessionLimits {
        statement_timeout: Duration::from_secs(30),
        idle_in_transaction_timeout: Duration::from_secs(30),
        custom_plans: false,
        defer_outbox_notify: false,
        asynchronous_commit: false,
        ordered_reads: false,
    };
    let pool = pipeline::db::connect(&config.db, limits).await?;
    let metrics = Arc::new(PaymentsMetrics::new().context("register metrics")?);
    let horizon = check_horizon(&pool, &config, &metrics, &cancel).await?;
    if config.source == Transport::Kafka {
        check_topic(&config, &cancel).await?;
    }
    // Partitions ahead exist before the first claim; then the maintenance
    // keeps them (and expires the old ones) while payments runs.
    // A database failing over right after the connect is waited for here too.
    let lifecycle = config.lifecycle();
    pipeline::db::patiently(config.db.connect_patience(), || {
        expiry::extend(&pool, lifecycle.ahead, lifecycle.granule)
    })
    .await
    .context("create the inbox partitions ahead")?;
    let maintenance = tokio::spawn(expiry::maintain(
        pool.clone(),
        config.hop(),
        config.clock_skew,
        lifecycle,
        horizon,
        metrics.clone(),
        cancel.child_token(),
    ));
    let crasher = Arc::new(Crasher::new(config.crash.clone()));
    // The metrics server stops when the work has ended, for whatever reason
    // (a shutdown, or a fatal client error).
    let serving = cancel.child_token();
    let metrics_task = pipeline::metrics::spawn_server(
        metrics_listener,
        metrics.registry.clone(),
        serving.clone(),
    );
    let apply = config.apply();
    match apply {
        Apply::Split(mode) => tracing::warn!(
            ?mode,
            "UNSAFE: inbox and effect in two transactions (--unsafe-split-txn); crashes WILL lose or double effects"
        ),
        Apply::Inbox(rules) if rules.after_horizon == delivery::AfterHorizon::UnsafeApply => {
            tracing::warn!(
                "UNSAFE: messages after the dedup horizon are applied (--unsafe-apply-after-horizon); a late duplicate WILL be applied twice"
            )
        }
        Apply::Inbox(_) => {}
    }
    let outcome = match config.source {
        Transport::Kafka => {
            // Parked events (the inbox could not record them yet) are
            // applied in per-key order once it can.
            let parked = tokio::spawn(park::drain(
                pool.clone(),
                Duration::from_millis(config.hold_retry_ms),
                crasher.clone(),
                metrics.clone(),
                cancel.child_token(),
            ));
            let outcome =
                consume_rejoining(&config, &pool, apply, &crasher, &metrics, &cancel).await;
            parked.abort();
            let _ = parked.await;
            outcome
        }
        Transport::Http => {
            receive(&config, webhooks, &pool, apply, &crasher, &metrics, &cancel).await
        }
    };
    serving.cancel();
    let _ = metrics_task.await;
    maintenance.abort();
    let _ = maintenance.await;
    pool.close().await;
    outcome
}

/// A fenced static member rejoins at most once in this long; fenced again
/// within it, the process ends.
pub const REJOIN_WINDOW: Duration = Duration::from_secs(60);

/// [`consumer::consume`], with one way back from being fenced
/// ([`consumer::Fenced`]): the member joins again under its own
/// `group.instance.id` with a fresh client, after a second (what was applied
/// and not committed is re-read; the inbox absorbs it). Fenced again within
/// [`REJOIN_WINDOW`] of that rejoin, another live process holds the id (the
/// two would fence each other in turn for ever): it ends with the error, as
/// does every other fatal error, so that a misconfiguration is seen. Of two
/// processes with one id, the one fenced first is the one that ends.
async fn consume_rejoining(
    config: &Config,
    pool: &sqlx::PgPool,
    apply: Apply,
    crasher: &Crasher,
    metrics: &Arc<PaymentsMetrics>,
    cancel: &CancellationToken,
) -> anyhow::Result<()> {
    let mut rejoined: Option<std::time::Instant> = None;
    loop {
        let outcome = consumer::consume(config, pool, apply, crasher, metrics, cancel).await;
        let fenced = match &outcome {
            Err(error) => error.downcast_ref::<consumer::Fenced>(),
            Ok(()) => None,
        };
        let again = rejoined.is_some_and(|at| at.elapsed() < REJOIN_WINDOW);
        let Some(fenced) = fenced.filter(|_| !again && !cancel.is_cancelled()) else {
            return outcome;
        };
        tracing::warn!(reason = %fenced.0, instance = config.group_instance_id.as_deref(),
            "fenced: joining the group again with a fresh client");
        metrics.consumer_rejoins_total.inc();
        rejoined = Some(std::time::Instant::now());
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            () = cancel.cancelled() => return Ok(()),
        }
    }
}

/// The webhook receiver on `listener` and its inbox processor, until
/// `cancel` fires; then the requests in flight are answered and the
/// processor's batch in hand finishes (or rolls back).
async fn receive(
    config: &Config,
    listener: Option<TcpListener>,
    pool: &sqlx::PgPool,
    apply: Apply,
    crasher: &Arc<Crasher>,
    metrics: &Arc<PaymentsMetrics>,
    cancel: &CancellationToken,
) -> anyhow::Result<()> {
    let listener = listener.context("--source http needs a listener for the webhooks")?;
    let addr = listener.local_addr().context("webhook listener address")?;
    let args = &config.webhook;
    let wake = Arc::new(tokio::sync::Notify::new());
    let processor = tokio::spawn(
        receiver::Processor {
            pool: pool.clone(),
            apply,
            crasher: crasher.clone(),
            metrics: metrics.clone(),
            batch: config.batch_size,
            poll: Duration::from_millis(args.webhook_poll_ms),
            wake: wake.clone(),
        }
        .run(cancel.child_token()),
    );
    let upkeep = tokio::spawn(receiver::upkeep(
        pool.clone(),
        args.webhook_receipts_kept,
        metrics.clone(),
        cancel.child_token(),
    ));
    let router = receiver::router(pool.clone(), args, crasher.clone(), metrics.clone(), wake);
    let (limits, cancel) = (args.limits(), cancel.child_token());
    let server = tokio::spawn(async move {
        pipeline::serve::serve(listener, router, limits, cancel).await;
    });
    tracing::info!(%addr, path = pipeline::contract::WEBHOOK_PATH, secrets = args.webhook_secret.len(),
        "payments receiving webhooks");
    let _ = server.await;
    let _ = processor.await;
    let _ = upkeep.await;
    Ok(())
}
