//! Payments' settings (every flag is also an environment variable) and the
//! start-up check of the inbox retention against the redelivery horizon.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use effectively::retry::Backoff;
use pipeline::config::{DbArgs, KafkaArgs, RuntimeArgs};
use pipeline::contract::{SplitTxn, UNSAFE_SPLIT_TXN_ENV};
use pipeline::crash::CrashArgs;
use pipeline::kafka::TopicCheck;
use tokio_util::sync::CancellationToken;

use crate::decode::InputFormat;
use crate::delivery::{AfterHorizon, Rules};
use crate::horizon::{Retention, parse_duration};
use crate::metrics::PaymentsMetrics;
use crate::process::Apply;
use crate::{dup, expiry, receiver};

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
    pub runtime: RuntimeArgs,

    #[command(flatten)]
    pub kafka: KafkaArgs,

    #[command(flatten)]
    pub crash: CrashArgs,

    #[command(flatten)]
    pub dup: dup::DupArgs,

    /// Where the events come from: `kafka` (consume `order.events`) or
    /// `http` (receive them as signed webhooks, POST /webhooks/orders on
    /// --webhook-addr, from `relay --sink http`).
    #[arg(long, env = pipeline::contract::env::PAYMENTS_SOURCE, value_enum, default_value_t = Transport::Kafka)]
    pub source: Transport,

    /// How the Kafka records are shaped: `envelope`, the project's relays'
    /// (`relay`, poll or WAL mode), or `outbox-router`, Debezium's Outbox
    /// Event Router over `orders.outbox` (`scripts/debezium.sh`): key = the
    /// aggregate id, value = the payload's JSON, header `id` = the msg_id,
    /// header `event_type`, and `created_at` (optional, RFC 3339) for the
    /// commit-to-effect latency. Either way the inbox keys on the msg_id, so
    /// an event is one event whichever relay published it.
    #[arg(long, env = "PAYMENTS_INPUT_FORMAT", value_enum, default_value_t = InputFormat::Envelope)]
    pub input_format: InputFormat,

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

    /// The consumer group protocol. `classic`: the client-side
    /// cooperative-sticky assignor, where every rebalance waits for every
    /// member to rejoin, a member killed -9 included until its session
    /// (below) times out. `consumer` (KIP-848, Kafka 4): the group
    /// coordinator assigns, and a member's partitions move without stopping
    /// the others; the session and heartbeat are then the brokers' settings
    /// (`group.consumer.session.timeout.ms`, `group.consumer.heartbeat.interval.ms`)
    /// and the two flags below are not used.
    #[arg(long, env = "PAYMENTS_GROUP_PROTOCOL", value_enum, default_value_t = GroupProtocol::Classic)]
    pub group_protocol: GroupProtocol,

    /// Consumer session timeout in milliseconds: how long the group waits
    /// for a member that stopped heartbeating (killed -9) before its
    /// partitions move to the survivors. A rebalance waits for every member,
    /// so a dead one also holds up every other move meanwhile; a group whose
    /// members die often needs a session shorter than the usual time between
    /// deaths (FINDINGS §12, the long run). The heartbeat goes every third of
    /// it, at most every 3 s (librdkafka's default). The brokers must allow
    /// it (`group.min.session.timeout.ms`; the stack's allow 1,000).
    #[arg(long, env = "PAYMENTS_SESSION_TIMEOUT_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1_000..=3_600_000))]
    pub session_timeout_ms: u64,

    /// The longest the broker may hold a fetch that has no new data, in
    /// milliseconds (Kafka `fetch.wait.max.ms`, librdkafka's default 500).
    /// Kafka answers a held fetch as soon as data arrives; the embedded broker
    /// holds it to the end, so a message could wait for the rest of it before
    /// payments saw it: at 1,000 orders/s, 25 ms instead of 500 cut
    /// commit→effect p99 by 125–170 ms (FINDINGS §15). Lower costs only more
    /// requests while the topic is idle.
    #[arg(long, env = "PAYMENTS_FETCH_WAIT_MAX_MS", default_value_t = DEFAULT_FETCH_WAIT_MAX_MS,
          value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub fetch_wait_max_ms: u64,

    /// Offsets are committed at most this often, in milliseconds: the latest
    /// offset of every partition whose batches have committed in the database
    /// since. 0 commits after every batch. Each commit is a request to the
    /// group coordinator; one per batch (a dozen a second) made the embedded
    /// broker answer heartbeats late enough to time the session out
    /// (FINDINGS §15). A crash redelivers what was applied after the last
    /// commit, up to this long's worth: inbox hits, no effect.
    #[arg(long, env = "PAYMENTS_COMMIT_INTERVAL_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub commit_interval_ms: u64,

    /// How often events the inbox cannot record yet (a msg_id beyond the
    /// inbox's partitions: partitions not created for a while) are tried
    /// again, in milliseconds: a Kafka event's park (`payments.parked`,
    /// `payments_parked_events`; its offset is committed, only its order
    /// waits), and how long a partition a message was held on stays paused.
    /// Such a message is never dropped (`payments_future_msg_ids_total`).
    #[arg(long, env = "PAYMENTS_HOLD_RETRY_MS", default_value_t = 5000,
          value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub hold_retry_ms: u64,

    /// Static group membership (Kafka `group.instance.id`): a restarted
    /// process with the same id gets its partitions back without waiting for
    /// its dead predecessor's session to time out. Unique per process.
    #[arg(long, env = pipeline::contract::env::PAYMENTS_GROUP_INSTANCE_ID)]
    pub group_instance_id: Option<String>,

    /// How often the consumer lag per partition (`payments_consumer_lag`:
    /// the partition's high watermark minus the group's committed offset) is
    /// refreshed, in milliseconds.
    #[arg(long, env = "PAYMENTS_LAG_SAMPLE_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..=86_400_000))]
    pub lag_sample_ms: u64,

    /// Address serving GET /metrics.
    #[arg(long, env = pipeline::contract::env::PAYMENTS_METRICS_ADDR, default_value = "127.0.0.1:9102")]
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

/// The consumer group protocol (`--group-protocol`): Kafka's
/// `group.protocol`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum GroupProtocol {
    /// The classic protocol, with the cooperative-sticky assignor.
    #[default]
    Classic,
    /// The consumer protocol of KIP-848: the coordinator assigns.
    Consumer,
}

/// Where payments takes its events from (`--source`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// A Kafka consumer of `order.events`.
    #[default]
    Kafka,
    /// A webhook receiver (`POST /webhooks/orders`).
    Http,
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

impl Config {
    /// The consumer's heartbeat interval in milliseconds: a third of the
    /// session, so two heartbeats may be lost before it times out, and at
    /// most librdkafka's default 3 s. Live members learn of a rebalance from
    /// a heartbeat's answer, so a shorter one also makes rebalances quicker.
    pub(crate) fn heartbeat_interval_ms(&self) -> u64 {
        (self.session_timeout_ms / 3).clamp(1, 3_000)
    }

    /// How this process applies what it consumes.
    pub(crate) fn apply(&self) -> Apply {
        match self.unsafe_split_txn {
            Some(mode) => Apply::Split(mode),
            None => Apply::Inbox(Rules {
                after_horizon: if self.unsafe_apply_after_horizon {
                    AfterHorizon::UnsafeApply
                } else {
                    AfterHorizon::Refuse
                },
                clock_skew: self.clock_skew,
            }),
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
            if self.input_format != InputFormat::Envelope {
                return Err(
                    "--input-format names a Kafka record shape; over HTTP the body is the envelope"
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
    pub(crate) fn hop(&self) -> expiry::HopSource {
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

/// Checks that the topic keeps what the relay's `acks=all` acknowledges
/// ([`pipeline::kafka::check_topic`]): an event lost with an
/// under-replicated partition was already marked published, so no one would
/// ever send it again and its charge would be missing for good. While the
/// topic cannot be read it waits with backoff, as [`check_horizon`] does,
/// until `cancel` fires; `Err(TopicRefusal)` when refused.
pub async fn check_topic(config: &Config, cancel: &CancellationToken) -> anyhow::Result<()> {
    let mut backoff = Backoff::new();
    loop {
        match pipeline::kafka::check_topic("payments", &config.kafka).await? {
            TopicCheck::Passed(_) => return Ok(()),
            TopicCheck::Unreadable(error) => {
                tracing::warn!(error = %format!("{error:#}"), "reading the topic's replication failed; retrying");
                if !backoff.wait(cancel).await {
                    return Err(error.context("check the topic's replication"));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<Config, clap::Error> {
        let base = ["payments", "--database-url", "postgres://localhost/x"];
        Config::try_parse_from(base.into_iter().chain(args.iter().copied()))
    }

    #[test]
    fn the_heartbeat_is_a_third_of_the_session_and_at_most_three_seconds() {
        let heartbeat = |session: &str| {
            parse(&["--session-timeout-ms", session])
                .expect("a valid session")
                .heartbeat_interval_ms()
        };
        assert_eq!(heartbeat("10000"), 3_000);
        assert_eq!(heartbeat("60000"), 3_000);
        assert_eq!(heartbeat("3000"), 1_000);
        assert_eq!(heartbeat("1000"), 333);
    }

    #[test]
    fn a_session_under_a_second_is_refused_with_the_flag_named() {
        let error = parse(&["--session-timeout-ms", "500"])
            .expect_err("under a second")
            .to_string();
        assert!(error.contains("--session-timeout-ms"), "{error}");
    }
}
