//! The Payments consumer: for each polled batch of `order.events`, ONE
//! transaction claims the msg_ids in the inbox and writes the charges of the
//! new ones; offsets are committed only after that transaction commits.
//!
//! Dedup keys on the msg_id carried in the event, never on a Kafka offset: a
//! relay re-publish lands at a new offset with the same msg_id. Redelivery
//! (a crash before the offset commit, a rebalance, a re-publish) is expected
//! and is a provable no-op.

pub mod decode;
pub mod dup;
pub mod expiry;
mod hold;
pub mod horizon;
pub mod inbox;
pub mod metrics;
pub mod receiver;
pub mod unsafe_split;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use clap::Parser;
use effectively::config::{DbArgs, KafkaArgs};
use effectively::contract::{InjectedDuplicate, SplitTxn, UNSAFE_SPLIT_TXN_ENV};
use effectively::crash::{CrashArgs, Crasher};
use effectively::kafka::FatalState;
use effectively::retry::Backoff;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{BorrowedMessage, Message, OwnedMessage};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use effectively::db::{ErrorClass, classify as classify_db_error};

use crate::horizon::Retention;
use crate::inbox::{Applied, ChargeIntent, Delivery, Held, Source};
use crate::metrics::PaymentsMetrics;

/// Payments settings; every flag is also an environment variable.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "payments",
    version,
    about = "Payments consumer: inbox claim + charge in one transaction; a redelivered event is a no-op"
)]
pub struct Config {
    #[command(flatten)]
    pub db: DbArgs,

    #[command(flatten)]
    pub kafka: KafkaArgs,

    #[command(flatten)]
    pub crash: CrashArgs,

    #[command(flatten)]
    pub dup: dup::DupArgs,

    /// Where the events come from: `kafka` (consume `order.events`) or
    /// `http` (receive them as signed webhooks, POST /webhooks/orders on
    /// --webhook-addr, from `relay --sink http`).
    #[arg(long, env = effectively::contract::env::PAYMENTS_SOURCE, value_enum, default_value_t = Transport::Kafka)]
    pub source: Transport,

    #[command(flatten)]
    pub webhook: receiver::WebhookArgs,

    /// Kafka consumer group.
    #[arg(long, env = "PAYMENTS_GROUP_ID", default_value = "payments")]
    pub group_id: String,

    /// Most messages applied per transaction.
    #[arg(long, env = "PAYMENTS_BATCH_SIZE", default_value_t = 500)]
    pub batch_size: usize,

    /// How long to wait for more messages to fill a batch, in milliseconds.
    #[arg(long, env = "PAYMENTS_BATCH_LINGER_MS", default_value_t = 5)]
    pub batch_linger_ms: u64,

    /// Consumer session timeout in milliseconds (how fast a dead member's
    /// partitions move to the survivors).
    #[arg(long, env = "PAYMENTS_SESSION_TIMEOUT_MS", default_value_t = 10_000)]
    pub session_timeout_ms: u64,

    /// The longest the broker may hold a fetch that has no new data, in
    /// milliseconds (Kafka `fetch.wait.max.ms`, librdkafka's default 500).
    /// Kafka answers a held fetch as soon as data arrives; the embedded broker
    /// holds it to the end, so a message could wait for the rest of it before
    /// payments saw it: at 1,000 orders/s, 25 ms instead of 500 cut
    /// commit→effect p99 by 125–170 ms (FINDINGS §14). Lower costs only more
    /// requests while the topic is idle.
    #[arg(long, env = "PAYMENTS_FETCH_WAIT_MAX_MS", default_value_t = DEFAULT_FETCH_WAIT_MAX_MS,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub fetch_wait_max_ms: u64,

    /// Offsets are committed at most this often, in milliseconds: the latest
    /// offset of every partition whose batches have committed in the database
    /// since. 0 commits after every batch. Each commit is a request to the
    /// group coordinator; one per batch (a dozen a second) made the embedded
    /// broker answer heartbeats late enough to time the session out
    /// (FINDINGS §14). A crash redelivers what was applied after the last
    /// commit, up to this long's worth: inbox hits, no effect.
    #[arg(long, env = "PAYMENTS_COMMIT_INTERVAL_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub commit_interval_ms: u64,

    /// How long a partition stays paused on a message the inbox cannot
    /// record yet (a msg_id beyond the inbox's partitions: a producer's clock
    /// ahead, or partitions not created for a while) before the message is
    /// tried again, in milliseconds. Such a message is never dropped nor
    /// acknowledged: its offset is not committed past it
    /// (`payments_held_partitions`, `payments_future_msg_ids_total`).
    #[arg(long, env = "PAYMENTS_HOLD_RETRY_MS", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub hold_retry_ms: u64,

    /// Static group membership (Kafka `group.instance.id`): a restarted
    /// process with the same id gets its partitions back without waiting for
    /// its dead predecessor's session to time out. Unique per process.
    #[arg(long, env = effectively::contract::env::PAYMENTS_GROUP_INSTANCE_ID)]
    pub group_instance_id: Option<String>,

    /// How often the consumer lag per partition (`payments_consumer_lag`:
    /// the partition's high watermark minus the group's committed offset) is
    /// refreshed, in milliseconds.
    #[arg(long, env = "PAYMENTS_LAG_SAMPLE_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..=86_400_000))]
    pub lag_sample_ms: u64,

    /// Address serving GET /metrics.
    #[arg(long, env = effectively::contract::env::PAYMENTS_METRICS_ADDR, default_value = "127.0.0.1:9102")]
    pub metrics_addr: SocketAddr,

    /// UNSAFE, for the split-transaction counter-example only: write the inbox
    /// row and the effect in two transactions (crash point `split` between
    /// them). inbox-first loses effects under crashes, effect-first doubles
    /// them. Never use it for real.
    #[arg(long, env = UNSAFE_SPLIT_TXN_ENV, value_enum)]
    pub unsafe_split_txn: Option<SplitTxn>,

    /// How long the inbox remembers a msg_id (`forever`, or e.g. 16d, 36h).
    #[arg(
        long,
        env = "PAYMENTS_INBOX_RETENTION",
        default_value = "16d",
        value_parser = Retention::parse,
        long_help = INBOX_RETENTION_HELP
    )]
    pub inbox_retention: Retention,

    /// UNSAFE, for experiment 5 only: run with an inbox retention shorter
    /// than the redelivery horizon, and expire partitions at that retention.
    /// A redelivery after expiry is still refused (dead letter "arrived after
    /// the dedup horizon"), never applied.
    #[arg(long, env = "PAYMENTS_UNSAFE_INBOX_RETENTION")]
    pub unsafe_inbox_retention: bool,

    /// UNSAFE, for experiment 5's resurrection run only: apply a message
    /// older than the oldest inbox partition kept as if it were new, as a
    /// consumer whose dedup record expired would. A redelivered duplicate is
    /// then applied twice (its ledger entry doubles; recon reports the double
    /// charge). Never use it for real.
    #[arg(
        long,
        env = "PAYMENTS_UNSAFE_APPLY_AFTER_HORIZON",
        conflicts_with = "unsafe_split_txn"
    )]
    pub unsafe_apply_after_horizon: bool,

    /// The span of msg_ids (by their UUIDv7 mint time) in one inbox
    /// partition: expiry drops whole partitions, so a msg_id is remembered
    /// for up to the retention plus one partition. At least 1s (experiment 5
    /// uses seconds; keep hours or a day for real).
    #[arg(long, env = "PAYMENTS_INBOX_PARTITION", default_value = "1d", value_parser = parse_granule)]
    pub inbox_partition: Duration,

    /// Allowance for clocks and work in flight added to the redelivery
    /// horizon: msg_ids carry the orders host's clock, expiry the database's.
    #[arg(long, env = "PAYMENTS_CLOCK_SKEW", default_value = "5m", value_parser = parse_duration)]
    pub clock_skew: Duration,
}

/// Payments' default `--fetch-wait-max-ms`; the raw consumer baseline of
/// `make bench-pipeline` takes the same.
pub const DEFAULT_FETCH_WAIT_MAX_MS: u64 = 25;

/// `payments --help` on `--inbox-retention`: the horizon's derivation.
const INBOX_RETENTION_HELP: &str = "\
How long the inbox remembers a msg_id: `forever`, or a duration (16d, 36h, 90m).

It must cover the redelivery horizon, the longest time after a msg_id was minted
(a UUIDv7, at outbox commit) that a copy of its event can still arrive:

    outbox retention          orders.outbox_policy (7 days by default): until then
                              a row can be published, or re-marked pending and
                              published again
  + producer delivery timeout 5 min, the most the relay allows (--message-timeout-ms)
  + topic retention.ms        read from the broker; a group reset to earliest
                              redelivers anything still in the topic
  + topic segment.ms          read from the broker: Kafka deletes whole segments
  + clock skew                --clock-skew (5 min)

For the topic as this project creates it (retention.ms 7 days, segment.ms 1 day)
that is 15 days 10 min, so the default is 16 days. A key the broker does not report
is taken at Kafka's default (7 days); retention.ms -1 makes the horizon unbounded.
At start-up payments derives the horizon and refuses to run (exit 2) with a shorter
retention, unless --unsafe-inbox-retention. Expiry drops whole partitions and never
before the horizon (re-derived every round). A message older than the oldest
partition kept is dead-lettered (kind after_horizon) and never applied.";

/// Where payments takes its events from (`--source`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// A Kafka consumer of `order.events`.
    #[default]
    Kafka,
    /// A webhook receiver (`POST /webhooks/orders`).
    Http,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("{s:?}: {e} (e.g. 5m, 1h, 1d)"))
}

fn parse_granule(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_secs(1) {
        return Err(format!("{s:?}: an inbox partition spans at least 1s"));
    }
    Ok(d)
}

/// Payments refused to start: its inbox retention is shorter than the
/// redelivery horizon. `main` exits with status 2.
#[derive(Debug)]
pub struct HorizonRefusal(pub String);

impl std::fmt::Display for HorizonRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for HorizonRefusal {}

/// How a slice is applied: the consume transaction, or one of the UNSAFE
/// counter-examples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Apply {
    /// [`inbox::apply_batch`], with what it does after the dedup horizon.
    Inbox(inbox::AfterHorizon),
    /// [`unsafe_split::apply_batch`].
    Split(SplitTxn),
}

impl Config {
    /// How this process applies what it consumes.
    fn apply(&self) -> Apply {
        match self.unsafe_split_txn {
            Some(mode) => Apply::Split(mode),
            None if self.unsafe_apply_after_horizon => {
                Apply::Inbox(inbox::AfterHorizon::UnsafeApply)
            }
            None => Apply::Inbox(inbox::AfterHorizon::Refuse),
        }
    }

    /// Settings that cannot go together, as the message `run` refuses them
    /// with.
    pub fn check(&self) -> Result<(), String> {
        if self.source == Transport::Http {
            if self.webhook.webhook_secret.is_empty() {
                return Err(
                    "--source http needs --webhook-secret (PAYMENTS_WEBHOOK_SECRET): \
                            the whsec_ secret(s) the sender signs with"
                        .into(),
                );
            }
            if self.unsafe_split_txn.is_some() {
                return Err(
                    "--unsafe-split-txn is the Kafka consumer's counter-example; \
                            it does not run with --source http"
                        .into(),
                );
            }
            if self.dup.dup_rate > 0.0 {
                return Err(
                    "--dup-rate injects Kafka redeliveries; over HTTP the sender's \
                            retries and chaos make the duplicates"
                        .into(),
                );
            }
        }
        Ok(())
    }

    /// Where the horizon's hop terms come from.
    fn hop(&self) -> expiry::HopSource {
        match self.source {
            Transport::Kafka => expiry::HopSource::Kafka(self.kafka.clone()),
            Transport::Http => expiry::HopSource::Webhook,
        }
    }

    /// The inbox's lifecycle as configured.
    pub fn lifecycle(&self) -> expiry::Lifecycle {
        expiry::Lifecycle {
            retention: self.inbox_retention,
            granule: self.inbox_partition,
            ahead: 2 * self.inbox_partition + self.clock_skew,
            hold_to_horizon: !self.unsafe_inbox_retention,
        }
    }
}

/// Derives the redelivery horizon and checks the inbox retention against it;
/// returns the horizon (`None`: unbounded), `Err(HorizonRefusal)` when the
/// retention is shorter (unless unsafe).
///
/// The terms are read from the database and the broker; while either is
/// unreachable it retries with backoff (as the consumer would wait for them),
/// until `cancel` fires.
pub async fn check_horizon(
    pool: &sqlx::PgPool,
    config: &Config,
    metrics: &PaymentsMetrics,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<Duration>> {
    let mut backoff = Backoff::new();
    let sources = loop {
        match expiry::read_sources(pool, &config.hop(), config.clock_skew).await {
            Ok(sources) => break sources,
            Err(error) => {
                tracing::warn!(error = %format!("{error:#}"), "reading the redelivery horizon's terms failed; retrying");
                if !backoff.wait(cancel).await {
                    return Err(error.context("derive the redelivery horizon"));
                }
            }
        }
    };
    let horizon = sources.horizon();
    expiry::record_horizon(metrics, horizon);
    metrics
        .inbox_retention_seconds
        .set(match config.inbox_retention {
            Retention::Forever => f64::INFINITY,
            Retention::For(d) => d.as_secs_f64(),
        });
    if config.inbox_retention.covers(horizon) {
        tracing::info!(retention = %config.inbox_retention, derivation = %sources, "inbox retention covers the redelivery horizon");
        return Ok(horizon);
    }
    let of = match config.source {
        Transport::Kafka => format!("topic {}", config.kafka.kafka_topic),
        Transport::Http => "the webhook sender".to_owned(),
    };
    let message = format!(
        "the inbox retention ({}) is shorter than the redelivery horizon of {of}:\n{sources}\n\
         A redelivery after the retention could find its dedup record gone. Set \
         --inbox-retention to at least the horizon (or `forever`), or shorten the terms above \
         (the topic's retention.ms / segment.ms, orders.outbox_policy).",
        config.inbox_retention
    );
    if config.unsafe_inbox_retention {
        tracing::warn!("UNSAFE (--unsafe-inbox-retention): {message}");
        return Ok(horizon);
    }
    Err(HorizonRefusal(message).into())
}

/// The consumer's callbacks: tracks this member's assignment so that offsets
/// of revoked partitions are never committed (a late commit could move the
/// new owner's offset back) and their lag series go, counts failed offset
/// commits, and turns a fatal client error into the end of the process.
pub struct RebalanceContext {
    assigned: Mutex<HashSet<(String, i32)>>,
    /// The group's committed offset of each owned partition, as far as this
    /// member knows: read once from the broker after the assignment, then
    /// from its own commits.
    committed: Mutex<HashMap<(String, i32), i64>>,
    /// Fired by a fatal client error (e.g. this static member was fenced by
    /// another process with the same `group.instance.id`): see [`FatalState`].
    fatal: FatalState,
    commit_failures: prometheus::IntCounter,
    lag: prometheus::IntGaugeVec,
    moved: prometheus::IntCounterVec,
}

impl RebalanceContext {
    /// A context that fires `fatal` on a fatal client error, counts failed
    /// asynchronous offset commits in `commit_failures`, and holds `lag`
    /// (labels `topic`, `partition`): set by the lag sampler for the
    /// partitions this member owns, a revoked partition's series removed,
    /// and counts the partitions each rebalance moves in `moved` (label
    /// `event`: `assigned`, `revoked`).
    pub fn new(
        fatal: FatalState,
        commit_failures: prometheus::IntCounter,
        lag: prometheus::IntGaugeVec,
        moved: prometheus::IntCounterVec,
    ) -> Self {
        Self {
            assigned: Mutex::default(),
            committed: Mutex::default(),
            fatal,
            commit_failures,
            lag,
            moved,
        }
    }

    fn owns(&self, topic: &str, partition: i32) -> bool {
        self.assigned
            .lock()
            .map(|a| a.contains(&(topic.to_owned(), partition)))
            .unwrap_or(false)
    }

    /// Records the offsets this member committed, for the lag of the
    /// partitions it still owns. Taken when the asynchronous commit is handed
    /// to the client: a commit the broker then refuses is counted
    /// (`commit_callback`) and the lag reads low until the next one.
    fn record_commit(&self, tpl: &TopicPartitionList) {
        if let Ok(mut committed) = self.committed.lock() {
            for e in tpl.elements() {
                if let Offset::Offset(o) = e.offset()
                    && self.owns(e.topic(), e.partition())
                {
                    committed.insert((e.topic().to_owned(), e.partition()), o);
                }
            }
        }
    }

    /// The committed offset of each owned partition, as far as this member
    /// knows (a copy).
    fn known_commits(&self) -> HashMap<(String, i32), i64> {
        self.committed.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Partitions currently assigned to this member.
    pub fn assignment(&self) -> Vec<(String, i32)> {
        self.assigned
            .lock()
            .map(|a| a.iter().cloned().collect())
            .unwrap_or_default()
    }
}

impl ClientContext for RebalanceContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.fatal.on_error("consumer", error, reason);
    }
}

/// Every `every`: the lag of each partition this member owns, as the
/// partition's high watermark minus the group's committed offset. It runs
/// beside the consumer loop, so a consumer stuck on its database still shows
/// its lag growing. The watermarks are asked of the partition's leader; the
/// committed offset is the one this member last committed, and
/// only a partition new to this member has its committed offset read from
/// the group coordinator, once: no request of the sampler's queues ahead of
/// the group's heartbeats on the coordinator's connection in the steady
/// state (a bench run saw sessions time out on an overloaded broker while
/// an earlier version asked the coordinator every second). A revoked
/// partition loses its series in `pre_rebalance`.
async fn sample_lag(consumer: Arc<PaymentsConsumer>, every: Duration, cancel: CancellationToken) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = cancel.cancelled() => return,
        }
        let c = consumer.clone();
        match tokio::task::spawn_blocking(move || read_lag(&c)).await {
            Ok(lags) => {
                let context = consumer.context();
                for ((topic, partition), value) in lags {
                    // Re-checked: a revoke may have come meanwhile.
                    if context.owns(&topic, partition) {
                        context
                            .lag
                            .with_label_values(&[topic.as_str(), &partition.to_string()])
                            .set(value);
                    }
                }
            }
            Err(error) => tracing::debug!(%error, "consumer lag task"),
        }
    }
}

/// The lag of every partition this member owns whose offsets are known (see
/// [`partition_lag`]).
fn read_lag(consumer: &PaymentsConsumer) -> Vec<((String, i32), i64)> {
    let context = consumer.context();
    let owned = context.assignment();
    let unknown: Vec<&(String, i32)> = {
        let committed = context.known_commits();
        owned
            .iter()
            .filter(|k| !committed.contains_key(*k))
            .collect()
    };
    if !unknown.is_empty() {
        let mut tpl = TopicPartitionList::new();
        for (topic, partition) in &unknown {
            tpl.add_partition(topic, *partition);
        }
        match consumer.committed_offsets(tpl, Duration::from_secs(5)) {
            Ok(read) => {
                if let Ok(mut committed) = context.committed.lock() {
                    for e in read.elements() {
                        let offset = match e.offset() {
                            Offset::Offset(o) => o,
                            _ => -1, // nothing committed yet
                        };
                        // A commit of this member's may have landed meanwhile.
                        committed
                            .entry((e.topic().to_owned(), e.partition()))
                            .or_insert(offset);
                    }
                }
            }
            Err(error) => tracing::debug!(%error, "reading committed offsets for the lag"),
        }
    }
    let committed = context.known_commits();
    owned
        .into_iter()
        .filter_map(|key| {
            let offset = *committed.get(&key)?;
            let (low, high) = consumer
                .fetch_watermarks(&key.0, key.1, Duration::from_secs(5))
                .ok()?;
            partition_lag(high, offset, low).map(|lag| (key, lag))
        })
        .collect()
}

/// A partition's lag: its high watermark minus the committed offset. Before
/// the group has committed anything there, the consumer starts from the
/// earliest offset (`auto.offset.reset`), so the lag is the watermark minus
/// the partition's low watermark. `None` while the offsets it needs are
/// unknown (negative). Never negative:
/// a watermark older than the commit counts as zero lag.
pub fn partition_lag(high_watermark: i64, committed: i64, low_watermark: i64) -> Option<i64> {
    let from = if committed >= 0 {
        committed
    } else {
        low_watermark
    };
    (high_watermark >= 0 && from >= 0).then(|| (high_watermark - from).max(0))
}

impl ConsumerContext for RebalanceContext {
    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        if let Err(error) = result {
            // Harmless for correctness (the batch is redelivered and is a
            // no-op), but a consumer whose commits keep failing redoes its
            // work after every restart: count it.
            self.commit_failures.inc();
            tracing::warn!(%error, "offset commit failed; the batch will be redelivered (no-op)");
        }
    }

    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance
            && let Ok(mut assigned) = self.assigned.lock()
        {
            for e in tpl.elements() {
                assigned.remove(&(e.topic().to_owned(), e.partition()));
                if let Ok(mut committed) = self.committed.lock() {
                    committed.remove(&(e.topic().to_owned(), e.partition()));
                }
                let _ = self
                    .lag
                    .remove_label_values(&[e.topic(), &e.partition().to_string()]);
            }
            self.moved
                .with_label_values(&["revoked"])
                .inc_by(tpl.count() as u64);
            tracing::info!(
                revoked = tpl.count(),
                owned = assigned.len(),
                "partitions revoked"
            );
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance
            && let Ok(mut assigned) = self.assigned.lock()
        {
            for e in tpl.elements() {
                assigned.insert((e.topic().to_owned(), e.partition()));
            }
            self.moved
                .with_label_values(&["assigned"])
                .inc_by(tpl.count() as u64);
            tracing::info!(
                assigned = tpl.count(),
                owned = assigned.len(),
                "partitions assigned"
            );
        }
    }
}

/// The consumer type.
pub type PaymentsConsumer = StreamConsumer<RebalanceContext>;

/// Builds the consumer: manual offset commits, earliest reset, and
/// cooperative-sticky assignment: a rebalance revokes only the partitions
/// that change owner (KIP-429), so a member joining or leaving does not
/// stop the whole group. The in-flight batches of a revoked partition finish
/// their transactions (the inbox makes a second owner's re-read of them a
/// no-op) and their offsets are dropped, never committed over the new
/// owner's ([`Commits::take`]).
pub fn consumer(config: &Config, context: RebalanceContext) -> anyhow::Result<PaymentsConsumer> {
    let mut client = ClientConfig::new();
    if let Some(id) = &config.group_instance_id {
        client.set("group.instance.id", id);
    }
    let consumer: PaymentsConsumer = client
        .set("bootstrap.servers", &config.kafka.kafka_bootstrap_servers)
        .set("group.id", &config.group_id)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("session.timeout.ms", config.session_timeout_ms.to_string())
        .set("fetch.wait.max.ms", config.fetch_wait_max_ms.to_string())
        .set("enable.partition.eof", "false")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .create_with_context(context)
        .context("create kafka consumer")?;
    consumer
        .subscribe(&[&config.kafka.kafka_topic])
        .context("subscribe")?;
    Ok(consumer)
}

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
    let limits = effectively::config::SessionLimits {
        statement_timeout: Duration::from_secs(30),
        idle_in_transaction_timeout: Duration::from_secs(30),
        custom_plans: false,
        defer_outbox_notify: false,
    };
    let pool = effectively::db::connect(&config.db, limits).await?;
    let metrics = Arc::new(PaymentsMetrics::new().context("register metrics")?);
    let horizon = check_horizon(&pool, &config, &metrics, &cancel).await?;
    // Partitions ahead exist before the first claim; then the maintenance
    // keeps them (and expires the old ones) while payments runs.
    let lifecycle = config.lifecycle();
    expiry::extend(&pool, lifecycle.ahead, lifecycle.granule)
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
    let metrics_task = effectively::metrics::spawn_server(
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
        Apply::Inbox(inbox::AfterHorizon::UnsafeApply) => tracing::warn!(
            "UNSAFE: messages after the dedup horizon are applied (--unsafe-apply-after-horizon); a late duplicate WILL be applied twice"
        ),
        Apply::Inbox(inbox::AfterHorizon::Refuse) => {}
    }
    let work = Work {
        config: &config,
        pool: &pool,
        apply,
        crasher: &crasher,
        metrics: &metrics,
        cancel: &cancel,
    };
    let outcome = match config.source {
        Transport::Kafka => work.consume().await,
        Transport::Http => work.receive(webhooks).await,
    };
    serving.cancel();
    let _ = metrics_task.await;
    maintenance.abort();
    let _ = maintenance.await;
    pool.close().await;
    outcome
}

/// What either transport's loop works with.
struct Work<'a> {
    config: &'a Config,
    pool: &'a sqlx::PgPool,
    apply: Apply,
    crasher: &'a Arc<Crasher>,
    metrics: &'a Arc<PaymentsMetrics>,
    cancel: &'a CancellationToken,
}

impl Work<'_> {
    /// The Kafka consumer, until `cancel` fires or the client is in a fatal
    /// state.
    async fn consume(&self) -> anyhow::Result<()> {
        let Work {
            config,
            pool,
            apply,
            crasher,
            metrics,
            cancel,
        } = *self;
        let crasher: &Crasher = crasher;
        let metrics: &PaymentsMetrics = metrics;
        let cfg = config.clone();
        let fatal = FatalState::new();
        let context = RebalanceContext::new(
            fatal.clone(),
            metrics
                .consumer_errors_total
                .with_label_values(&["commit_callback"]),
            metrics.consumer_lag.clone(),
            metrics.partitions_moved_total.clone(),
        );
        let consumer = Arc::new(
            tokio::task::spawn_blocking(move || consumer(&cfg, context))
                .await
                .context("create consumer task")??,
        );
        let sampling = cancel.child_token();
        let lag_task = tokio::spawn(sample_lag(
            consumer.clone(),
            Duration::from_millis(config.lag_sample_ms),
            sampling.clone(),
        ));
        tracing::info!(group = %config.group_id, topic = %config.kafka.kafka_topic, "payments consuming");
        let mut injector = dup::Injector::new(config.dup.clone());
        if injector.enabled() {
            tracing::warn!(
                rate = config.dup.dup_rate,
                kind = ?config.dup.dup_kind,
                "chaos: injecting duplicate deliveries (--dup-rate)"
            );
        }
        let linger = Duration::from_millis(config.batch_linger_ms);
        let max = config.batch_size.max(1);
        let mut commits = Commits::new(Duration::from_millis(config.commit_interval_ms));
        let mut holds = hold::Holds::new(Duration::from_millis(config.hold_retry_ms));
        // The batch in hand: filled here, or fetched while the previous one's
        // transaction ran.
        let mut batch: Vec<OwnedMessage> = Vec::with_capacity(max);
        loop {
            if holds.any() {
                holds.resume_due(&consumer, metrics);
            }
            if batch.is_empty() {
                tokio::select! {
                    () = fill_batch(&consumer, &mut batch, max, linger, metrics) => {}
                    // Idle with offsets not yet committed: commit them when due.
                    () = commits.due_in(), if commits.any() => {
                        commits.flush(&consumer, metrics, CommitMode::Async);
                    }
                    // A held partition's wait is over: resumed next turn.
                    () = holds.next_due(), if holds.any() => {}
                    () = cancel.cancelled() => break,
                    () = fatal.fired() => break,
                }
            }
            // A fatal error reaches the error callback as its underlying code
            // (e.g. FencedInstanceId), and the receive as an error: ask the client.
            if fatal.check("consumer", consumer.client()) {
                break;
            }
            if batch.is_empty() {
                continue;
            }
            // Pipelined: the next batch is fetched while this one's transaction
            // runs. The fetch stops when the transaction ends (a receive is
            // cancel-safe, and what it received is in `next`); its messages'
            // offsets are committed only after their own transaction, next turn.
            let mut next = Vec::with_capacity(max);
            let applied = {
                let fetch = fill_batch(&consumer, &mut next, max, linger, metrics);
                tokio::pin!(fetch);
                let work = process(pool, apply, &batch, crasher, metrics, cancel);
                tokio::pin!(work);
                let mut fetching = true;
                loop {
                    tokio::select! {
                        biased;
                        applied = &mut work => break applied,
                        () = &mut fetch, if fetching => fetching = false,
                    }
                }
            };
            let Some(held) = applied else {
                break; // cancelled while the database was failing; nothing committed
            };
            // A held message's partition goes back to it and waits; what came
            // after it in the batch was applied, but its offset is not
            // committed past the held one, and the copies prefetched are dropped.
            let firsts = hold::firsts(&held);
            if !firsts.is_empty() {
                holds.hold(&consumer, &firsts, metrics);
                next.retain(|m| !firsts.contains_key(&(m.topic().to_owned(), m.partition())));
            }
            commits.add(
                batch
                    .iter()
                    .filter(|m| hold::before_hold(&firsts, m.topic(), m.partition(), m.offset())),
            );
            if commits.due() {
                commits.flush(&consumer, metrics, CommitMode::Async);
            }
            // Injected duplicates come only now, after the originals committed
            // (none for a batch that held a message: its partition was sought).
            let plan = if firsts.is_empty() {
                injector.plan(&batch)
            } else {
                dup::Plan::default()
            };
            let rewound = dup::seek_back(&consumer, &plan, metrics);
            // A rewound partition's messages fetched before the seek come again
            // after it, in order: drop these copies.
            next.retain(|m| !rewound.contains(&(m.topic().to_owned(), m.partition())));
            if !plan.reprocess.is_empty() {
                // Applied again in a transaction of its own; offsets are already
                // committed, so nothing to commit for them.
                if process(pool, apply, &plan.reprocess, crasher, metrics, cancel)
                    .await
                    .is_none()
                {
                    break;
                }
                metrics
                    .injected_duplicates_total
                    .with_label_values(&[InjectedDuplicate::Reprocess.as_str()])
                    .inc_by(plan.reprocess.len() as u64);
            }
            batch = next;
        }
        let fatal_reason = fatal.reason();
        if fatal_reason.is_none() {
            // What was applied since the last commit, so the next owner does
            // not redeliver it; then leaving the group hands the partitions
            // over at once instead of after the session timeout.
            let (c, m) = (consumer.clone(), self.metrics.clone());
            let _ = tokio::task::spawn_blocking(move || {
                commits.flush(&c, &m, CommitMode::Sync);
                c.unsubscribe();
            })
            .await;
        }
        sampling.cancel();
        let _ = lag_task.await;
        match fatal_reason {
            // Nothing of the batch in hand was committed: it is redelivered
            // to whoever takes the partitions.
            Some(reason) => anyhow::bail!("kafka consumer in a fatal state: {reason}"),
            None => Ok(()),
        }
    }

    /// The webhook receiver on `listener` and its inbox processor, until
    /// `cancel` fires; then the requests in flight are answered and the
    /// processor's batch in hand finishes (or rolls back).
    async fn receive(&self, listener: Option<TcpListener>) -> anyhow::Result<()> {
        let listener = listener.context("--source http needs a listener for the webhooks")?;
        let addr = listener.local_addr().context("webhook listener address")?;
        let args = &self.config.webhook;
        let wake = Arc::new(tokio::sync::Notify::new());
        let processor = tokio::spawn(
            receiver::Processor {
                pool: self.pool.clone(),
                apply: self.apply,
                crasher: self.crasher.clone(),
                metrics: self.metrics.clone(),
                batch: self.config.batch_size,
                poll: Duration::from_millis(args.webhook_poll_ms),
                wake: wake.clone(),
            }
            .run(self.cancel.child_token()),
        );
        let upkeep = tokio::spawn(receiver::upkeep(
            self.pool.clone(),
            args.webhook_receipts_kept,
            self.metrics.clone(),
            self.cancel.child_token(),
        ));
        let router = receiver::router(
            self.pool.clone(),
            args,
            self.crasher.clone(),
            self.metrics.clone(),
            wake,
        );
        let (limits, cancel) = (args.limits(), self.cancel.child_token());
        let server = tokio::spawn(async move {
            effectively::serve::serve(listener, router, limits, cancel).await;
        });
        tracing::info!(%addr, path = effectively::contract::WEBHOOK_PATH, secrets = args.webhook_secret.len(),
            "payments receiving webhooks");
        let _ = server.await;
        let _ = processor.await;
        let _ = upkeep.await;
        Ok(())
    }
}

/// Fills `batch` up to `max`: waits for a first message if it has none,
/// then takes whatever else arrives within `linger`. Cancel-safe: dropped at
/// any point, `batch` holds every message received (a receive hands over a
/// message only when it completes).
async fn fill_batch(
    consumer: &PaymentsConsumer,
    batch: &mut Vec<OwnedMessage>,
    max: usize,
    linger: Duration,
    metrics: &PaymentsMetrics,
) {
    if batch.is_empty() && !keep(batch, consumer.recv().await, metrics) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        return;
    }
    let deadline = tokio::time::Instant::now() + linger;
    while batch.len() < max {
        let Ok(received) = tokio::time::timeout_at(deadline, consumer.recv()).await else {
            break; // lingered long enough
        };
        if !keep(batch, received, metrics) {
            break;
        }
    }
}

/// Adds a received message to `batch` (true), or counts and logs the
/// receive's error (false).
fn keep(
    batch: &mut Vec<OwnedMessage>,
    received: KafkaResult<BorrowedMessage<'_>>,
    metrics: &PaymentsMetrics,
) -> bool {
    match received {
        Ok(m) => {
            batch.push(m.detach());
            metrics.consumed_total.inc();
            true
        }
        Err(error) => {
            metrics
                .consumer_errors_total
                .with_label_values(&["kafka"])
                .inc();
            tracing::warn!(%error, "kafka receive failed");
            false
        }
    }
}

/// Decodes a batch: each message with its intent or its dead-letter reason.
pub fn classify(batch: &[OwnedMessage]) -> (Vec<Delivery<'_>>, HashMap<Uuid, DateTime<Utc>>) {
    let mut deliveries = Vec::with_capacity(batch.len());
    let mut committed_at = HashMap::with_capacity(batch.len());
    for m in batch {
        let content = match decode::decode(m.payload()) {
            Ok((intent, created_at)) => {
                committed_at.insert(intent.msg_id, created_at);
                Ok(intent)
            }
            Err(reason) => {
                tracing::warn!(
                    partition = m.partition(),
                    offset = m.offset(),
                    reason = %effectively::text::storable(&reason),
                    "dead-lettering message"
                );
                Err(reason)
            }
        };
        deliveries.push(Delivery {
            source: Source::kafka(m.topic(), m.partition(), m.offset(), m.key(), m.payload()),
            content,
        });
    }
    (deliveries, committed_at)
}

/// How one attempt at a slice of the batch ended.
enum Attempt {
    Applied(Applied),
    /// The database refused the slice for its data (see [`ErrorClass`]).
    Refused(sqlx::Error),
    Cancelled,
}

/// Applies the batch. Transient database failures are retried with backoff
/// until the work commits. A deterministic failure (the data of some message
/// makes the transaction fail every time) is never retried as it is: the
/// slice is split in halves, each applied in a transaction of its own, until
/// the one offending message is alone; it is dead-lettered with the
/// database's reason and the rest is applied. So no message stops its
/// partition. Returns the deliveries held back (`Applied::held`), or `None`
/// when cancelled first (then the rest is not committed and will be
/// redelivered; what did commit is a no-op on redelivery).
///
/// Its span counts the batch's messages; a message handled alone (refused
/// by the database) gets a span of its own with its msg_id and order_id.
async fn process(
    pool: &sqlx::PgPool,
    apply: Apply,
    batch: &[OwnedMessage],
    crasher: &Crasher,
    metrics: &PaymentsMetrics,
    cancel: &CancellationToken,
) -> Option<Vec<Held>> {
    let (deliveries, committed_at) = classify(batch);
    process_deliveries(
        pool,
        apply,
        &deliveries,
        &committed_at,
        crasher,
        metrics,
        cancel,
    )
    .await
    .map(|left| left.held)
}

/// What applying a batch left undone.
#[derive(Debug, Default)]
pub(crate) struct Left {
    /// Webhooks left alone because another processor holds (or has just
    /// processed) their claim (`Applied::skipped`; always 0 for Kafka).
    pub(crate) skipped: u64,
    /// Deliveries held back: valid, but the inbox cannot record them yet.
    pub(crate) held: Vec<Held>,
}

/// [`process`] of decoded deliveries, from either transport; `committed_at`
/// holds each event's outbox commit time (for the commit-to-effect latency).
/// Returns what it left undone, or `None` when `cancel` fired.
#[tracing::instrument(level = "info", skip_all, fields(messages = deliveries.len()))]
pub(crate) async fn process_deliveries(
    pool: &sqlx::PgPool,
    apply: Apply,
    deliveries: &[Delivery<'_>],
    committed_at: &HashMap<Uuid, DateTime<Utc>>,
    crasher: &Crasher,
    metrics: &PaymentsMetrics,
    cancel: &CancellationToken,
) -> Option<Left> {
    let mut left = Left::default();
    // Slices still to apply, the next one last; halves keep message order.
    let mut work: Vec<&[Delivery<'_>]> = vec![deliveries];
    while let Some(slice) = work.pop() {
        match apply_with_retry(pool, apply, slice, crasher, metrics, cancel).await {
            Attempt::Applied(mut applied) => {
                left.skipped += applied.skipped;
                record(metrics, &applied, committed_at);
                left.held.append(&mut applied.held);
            }
            Attempt::Cancelled => return None,
            Attempt::Refused(error) if slice.len() == 1 => {
                let reason = format!("{error}");
                let intent = slice[0].content.as_ref().ok();
                let span = tracing::info_span!(
                    "message",
                    msg_id = tracing::field::Empty,
                    order_id = tracing::field::Empty,
                );
                if let Some(intent) = intent {
                    span.record("msg_id", tracing::field::display(intent.msg_id));
                    span.record("order_id", tracing::field::display(intent.order_id));
                }
                let rejected = async {
                    tracing::warn!(
                        source = %slice[0].source.origin,
                        reason = %effectively::text::storable(&reason),
                        "the database refused a message; dead-lettering it alone"
                    );
                    reject_with_retry(pool, slice[0].source, intent, &reason, metrics, cancel).await
                }
                .instrument(span)
                .await;
                if !rejected {
                    return None;
                }
            }
            Attempt::Refused(error) => {
                metrics.bisections_total.inc();
                tracing::info!(size = slice.len(), %error, "the database refused a batch; splitting it to find the message");
                let (first, second) = slice.split_at(slice.len() / 2);
                work.push(second);
                work.push(first);
            }
        }
    }
    Some(left)
}

/// One slice in one transaction, retried with backoff while the failure is
/// transient.
async fn apply_with_retry(
    pool: &sqlx::PgPool,
    apply: Apply,
    slice: &[Delivery<'_>],
    crasher: &Crasher,
    metrics: &PaymentsMetrics,
    cancel: &CancellationToken,
) -> Attempt {
    let mut backoff = Backoff::new();
    loop {
        let start = Instant::now();
        let result = match apply {
            Apply::Inbox(after_horizon) => {
                inbox::apply_batch(pool, slice, after_horizon, crasher).await
            }
            Apply::Split(mode) => unsafe_split::apply_batch(pool, mode, slice, crasher).await,
        };
        match result {
            Ok(applied) => {
                metrics
                    .processing_duration_seconds
                    .observe(start.elapsed().as_secs_f64());
                return Attempt::Applied(applied);
            }
            Err(error) if classify_db_error(&error) == ErrorClass::Deterministic => {
                metrics
                    .consumer_errors_total
                    .with_label_values(&["db_refused"])
                    .inc();
                return Attempt::Refused(error);
            }
            Err(error) => {
                metrics
                    .consumer_errors_total
                    .with_label_values(&["db"])
                    .inc();
                tracing::warn!(%error, "applying batch failed; retrying");
                if !backoff.wait(cancel).await {
                    return Attempt::Cancelled;
                }
            }
        }
    }
}

/// Dead-letters a message the database refused, retrying transient failures.
/// Should the database refuse even the dead letter (it takes the raw bytes
/// as `bytea` and a storable reason, so it should not), the message is
/// recorded without its key and payload, which stay in the topic.
async fn reject_with_retry(
    pool: &sqlx::PgPool,
    source: Source<'_>,
    intent: Option<&ChargeIntent>,
    reason: &str,
    metrics: &PaymentsMetrics,
    cancel: &CancellationToken,
) -> bool {
    let mut source = source;
    let mut backoff = Backoff::new();
    loop {
        match inbox::reject(pool, source, intent, reason).await {
            Ok(written) => {
                metrics.rejected_total.inc();
                if written {
                    metrics.dead_letters_total.inc();
                }
                return true;
            }
            Err(error)
                if classify_db_error(&error) == ErrorClass::Deterministic
                    && (source.key.is_some() || source.payload.is_some()) =>
            {
                tracing::error!(%error, source = %source.origin,
                    "the dead letter itself was refused; recording it without key and payload");
                source.key = None;
                source.payload = None;
            }
            Err(error) => {
                metrics
                    .consumer_errors_total
                    .with_label_values(&["db"])
                    .inc();
                tracing::warn!(%error, "writing a dead letter failed; retrying");
                if !backoff.wait(cancel).await {
                    return false;
                }
            }
        }
    }
}

/// Counts what a committed slice did.
fn record(
    metrics: &PaymentsMetrics,
    applied: &Applied,
    committed_at: &HashMap<Uuid, DateTime<Utc>>,
) {
    metrics.dedup_misses_total.inc_by(applied.charged);
    metrics.dedup_hits_total.inc_by(applied.duplicates);
    metrics
        .charges_total
        .inc_by(applied.charged - applied.charge_conflicts);
    metrics
        .charge_conflicts_total
        .inc_by(applied.charge_conflicts);
    metrics
        .msg_id_conflicts_total
        .inc_by(applied.msg_id_conflicts);
    metrics.after_horizon_total.inc_by(applied.after_horizon);
    metrics
        .applied_after_horizon_total
        .inc_by(applied.applied_after_horizon);
    metrics.charges_total.inc_by(applied.charged_after_horizon);
    if applied.applied_after_horizon > 0 {
        tracing::warn!(
            applied = applied.applied_after_horizon,
            "UNSAFE: deliveries after the dedup horizon applied (--unsafe-apply-after-horizon)"
        );
    }
    metrics
        .future_msg_ids_total
        .inc_by(applied.held.len() as u64);
    if applied.after_horizon + applied.never_recordable > 0 {
        tracing::warn!(
            after_horizon = applied.after_horizon,
            never_recordable = applied.never_recordable,
            "deliveries outside the inbox's partitions dead-lettered, not applied"
        );
    }
    metrics
        .dead_letters_total
        .inc_by(applied.dead_lettered.len() as u64);
    if applied.charge_conflicts + applied.msg_id_conflicts > 0 {
        tracing::warn!(
            order_conflicts = applied.charge_conflicts,
            msg_id_conflicts = applied.msg_id_conflicts,
            "conflicting redeliveries dead-lettered; the first effects stand"
        );
    }
    let now = Utc::now();
    for msg_id in &applied.new_msg_ids {
        if let Some(created) = committed_at.get(msg_id) {
            let secs = (now - *created).num_microseconds().unwrap_or(0) as f64 / 1e6;
            metrics.commit_to_effect_seconds.observe(secs.max(0.0));
        }
    }
}

/// The offsets to commit: after each batch's transaction its partitions'
/// next offsets are added, and they go to the broker in one commit at most
/// every `interval` (every batch when it is zero). Offsets never go back: an
/// offset at or below the partition's committed one as the consumer context
/// knows it (e.g. re-added after an injected redelivery rewound the
/// partition) is left out.
struct Commits {
    interval: Duration,
    pending: BTreeMap<(String, i32), i64>,
    last: tokio::time::Instant,
}

impl Commits {
    /// The first batch's offsets are due at once: a life killed within
    /// the interval still moves its partitions on by a batch (a consumer
    /// killed every few batches would otherwise commit nothing, ever).
    fn new(interval: Duration) -> Self {
        let now = tokio::time::Instant::now();
        Self {
            interval,
            pending: BTreeMap::new(),
            last: now.checked_sub(interval).unwrap_or(now),
        }
    }

    /// Adds a batch whose transaction committed.
    fn add<'m>(&mut self, batch: impl IntoIterator<Item = &'m OwnedMessage>) {
        for m in batch {
            let next = m.offset() + 1;
            let e = self
                .pending
                .entry((m.topic().to_owned(), m.partition()))
                .or_insert(next);
            *e = (*e).max(next);
        }
    }

    fn any(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether the pending offsets are due.
    fn due(&self) -> bool {
        self.any() && self.last.elapsed() >= self.interval
    }

    /// Completes when the pending offsets are due.
    async fn due_in(&self) {
        tokio::time::sleep_until(self.last + self.interval).await;
    }

    /// Takes the pending offsets to commit: of the partitions `owns` says
    /// this member still owns, above what `committed` says each has (a
    /// revoked partition's are dropped: a late commit could move the new
    /// owner's offset back; it redelivers them instead, as no-ops). Restarts
    /// the interval.
    fn take(
        &mut self,
        owns: impl Fn(&str, i32) -> bool,
        committed: &HashMap<(String, i32), i64>,
    ) -> Vec<((String, i32), i64)> {
        self.last = tokio::time::Instant::now();
        std::mem::take(&mut self.pending)
            .into_iter()
            .filter(|(key, offset)| {
                owns(&key.0, key.1) && committed.get(key).is_none_or(|c| offset > c)
            })
            .collect()
    }

    /// Commits what [`Commits::take`] takes, against the consumer context's
    /// assignment and known commits, and records it there.
    fn flush(&mut self, consumer: &PaymentsConsumer, metrics: &PaymentsMetrics, mode: CommitMode) {
        let context = consumer.context();
        let mut tpl = TopicPartitionList::new();
        for ((topic, partition), offset) in
            self.take(|t, p| context.owns(t, p), &context.known_commits())
        {
            if let Err(error) = tpl.add_partition_offset(&topic, partition, Offset::Offset(offset))
            {
                tracing::warn!(%error, "build offset list");
            }
        }
        if tpl.count() == 0 {
            return;
        }
        match consumer.commit(&tpl, mode) {
            Ok(()) => context.record_commit(&tpl),
            Err(error) => {
                metrics
                    .consumer_errors_total
                    .with_label_values(&["commit"])
                    .inc();
                tracing::warn!(%error, "offset commit failed; the batches will be redelivered (no-ops)");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dup::tests::msg;
    use rdkafka::types::RDKafkaErrorCode;

    #[tokio::test]
    async fn commits_coalesce_to_each_partitions_latest_offset_and_never_go_back() {
        let mut c = Commits::new(Duration::from_secs(3600));
        assert!(!c.any() && !c.due());
        let all = |_: &str, _: i32| true;
        let mut known = HashMap::new();
        c.add(&[msg(2, 0)]);
        assert!(c.due(), "a life's first batch is due at once");
        assert_eq!(c.take(all, &known), vec![(("t".to_owned(), 2), 1)]);
        c.add(&[msg(0, 10), msg(1, 5), msg(0, 11)]);
        c.add(&[msg(0, 12), msg(1, 4)]);
        assert!(c.any());
        assert!(!c.due(), "then not before the interval");
        assert_eq!(
            c.take(all, &known),
            vec![(("t".to_owned(), 0), 13), (("t".to_owned(), 1), 6)]
        );
        assert!(!c.any());
        // What the flush records in the consumer context.
        known.insert(("t".to_owned(), 0), 13);
        known.insert(("t".to_owned(), 1), 6);
        // An injected redelivery of partition 0 re-adds offsets already
        // committed: nothing to commit for them.
        c.add(&[msg(0, 10), msg(0, 12)]);
        assert!(
            c.take(all, &known).is_empty(),
            "an offset at or below the committed one is left out"
        );
        c.add(&[msg(0, 13)]);
        assert_eq!(c.take(all, &known), vec![(("t".to_owned(), 0), 14)]);
    }

    #[tokio::test]
    async fn a_revoked_partitions_offsets_are_dropped_and_it_comes_back_clean() {
        let mut c = Commits::new(Duration::ZERO);
        let all = |_: &str, _: i32| true;
        let mut known = HashMap::new();
        c.add(&[msg(0, 100), msg(1, 100)]);
        assert!(c.due(), "an interval of 0 commits after every batch");
        assert_eq!(
            c.take(|_, p| p == 1, &known),
            vec![(("t".to_owned(), 1), 101)]
        );
        c.add(&[msg(1, 200)]);
        assert_eq!(c.take(all, &known), vec![(("t".to_owned(), 1), 201)]);
        known.insert(("t".to_owned(), 1), 201);
        // Partition 1 revoked (the context forgets its committed offset),
        // then assigned again with the group's offset moved back (another
        // member's reset): its offsets count again.
        known.remove(&("t".to_owned(), 1));
        c.add(&[msg(1, 50)]);
        assert_eq!(c.take(all, &known), vec![(("t".to_owned(), 1), 51)]);
    }

    #[test]
    fn lag_is_the_watermark_minus_the_committed_offset_or_the_earliest() {
        assert_eq!(partition_lag(120, 100, 0), Some(20));
        assert_eq!(partition_lag(100, 100, 0), Some(0));
        assert_eq!(partition_lag(99, 100, 0), Some(0), "never negative");
        assert_eq!(
            partition_lag(120, -1001, 20),
            Some(100),
            "nothing committed yet: from the earliest offset"
        );
        assert_eq!(partition_lag(120, -1001, -1), None, "neither known");
        assert_eq!(partition_lag(-1, 100, 0), None, "no watermark fetched yet");
    }

    // The broker side of fencing (a second process with the same
    // group.instance.id) is tested against the stack's Kafka in
    // tests/payments.rs. The mapping of a fatal error to
    // the end of the process is `effectively::kafka::FatalState`'s, tested
    // there; this checks the consumer's own callbacks.
    #[test]
    fn a_fatal_error_fires_the_state_and_failed_commits_are_counted() {
        let fatal = FatalState::new();
        let commits = prometheus::IntCounter::new("c", "c").expect("counter");
        let lag =
            prometheus::IntGaugeVec::new(prometheus::Opts::new("l", "l"), &["topic", "partition"])
                .expect("gauge");
        let moved = prometheus::IntCounterVec::new(prometheus::Opts::new("m", "m"), &["event"])
            .expect("counter");
        let context = RebalanceContext::new(fatal.clone(), commits.clone(), lag, moved);
        context.error(
            KafkaError::Global(RDKafkaErrorCode::Fatal),
            "static consumer fenced by other consumer with same group.instance.id",
        );
        assert!(fatal.reason().is_some_and(|r| r.contains("fenced")));

        context.commit_callback(Ok(()), &TopicPartitionList::new());
        assert_eq!(commits.get(), 0);
        context.commit_callback(
            Err(KafkaError::ConsumerCommit(
                RDKafkaErrorCode::RebalanceInProgress,
            )),
            &TopicPartitionList::new(),
        );
        assert_eq!(commits.get(), 1, "a failed async commit is counted");
    }
}
