//! The relay's settings (every flag is also an environment variable), its
//! operator commands, and its database session settings.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use pipeline::config::{DbArgs, KafkaArgs, RuntimeArgs};
use pipeline::contract::RELAY_MAX_MESSAGE_TIMEOUT;
use pipeline::crash::CrashArgs;

use crate::outbox::SHARDS;
use crate::webhooks;

/// Relay settings; every flag is also an environment variable.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "relay",
    version,
    about = "Outbox relay: publishes committed outbox rows to Kafka at least once, each key's first publishes in order"
)]
pub struct Config {
    /// An operator's command instead of running the relay.
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub db: DbArgs,

    #[command(flatten)]
    pub runtime: RuntimeArgs,

    #[command(flatten)]
    pub kafka: KafkaArgs,

    #[command(flatten)]
    pub crash: CrashArgs,

    /// Most rows a pass reads: in `--mode poll`, an equal share for each
    /// shard of its group (the webhook fan-out: per shard). At most
    /// `--shard-groups` × this many rows are in flight to the broker at
    /// once, and the drain rate is about that over the ack latency
    /// (FINDINGS §15, §26). A crash at `publish` re-publishes up to that
    /// many (the inbox absorbs them).
    #[arg(long, env = "RELAY_BATCH_SIZE", default_value_t = 1000)]
    pub batch_size: i64,

    /// Transactions this process keeps open at once, each publishing one
    /// group's batch (read, produce, await acks, mark, commit). One
    /// group's acks overlap the others' database work; more than
    /// `--shard-groups` adds nothing (the WAL relay's start-up drain: up
    /// to this many shards at once).
    #[arg(long, env = "RELAY_WORKERS", default_value_t = 8,
          value_parser = clap::value_parser!(u16).range(1..=SHARDS as i64))]
    pub workers: u16,

    /// Groups the outbox's 16 shards are split into (`--mode poll`): shard
    /// `s` is in group `s % N`, and each group has a loop whose
    /// transaction reads all its shards at once, an equal share of
    /// `--batch-size` each. A batch's cycle collects
    /// every row its shards got meanwhile, so fewer groups mean fewer,
    /// larger transactions for the same rows, and fewer produce requests;
    /// at most N transactions are in flight, within `--workers`.
    /// At 2 (against 16, a loop per shard) the pipeline spent 30% less CPU
    /// per order at 1,000 orders/s and 22% less at 3,850, commit→effect's
    /// p99 halved, and a backlog drained 1–13% slower; at 1 it drained at
    /// half the rate (FINDINGS §15).
    #[arg(long, env = "RELAY_SHARD_GROUPS", default_value_t = 2,
          value_parser = clap::value_parser!(u8).range(1..=SHARDS as i64))]
    pub shard_groups: u8,

    /// Kept so that existing settings still parse: a shard has one pass in
    /// flight at a time, whatever this says. The relay reads each key's
    /// pending rows, sends them in order and marks them after the acks
    /// (the library's engine), so a second pass over the shard would send
    /// the same rows; a depth over 1 is logged and not taken. (It had 2
    /// passes overlap when a claim marked its rows; 2 gained nothing on 2
    /// shared cores: FINDINGS §15.)
    #[arg(long, env = "RELAY_SHARD_DEPTH", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(1..=effectively::store::MAX_SHARD_DEPTH as i64))]
    pub shard_depth: u8,

    /// Fallback poll interval in milliseconds when no NOTIFY arrives.
    #[arg(long, env = "RELAY_POLL_INTERVAL_MS", default_value_t = 500)]
    pub poll_interval_ms: u64,

    /// How often the backlog metrics are sampled, in milliseconds; less
    /// often while a sample is slow (over a large backlog), so that it keeps
    /// to a sixth of one database backend.
    #[arg(long, env = "RELAY_LAG_SAMPLE_MS", default_value_t = 1000)]
    pub lag_sample_ms: u64,

    /// `--mode poll` with `--sink kafka`: wait for each commit's WAL to reach
    /// the disk (`synchronous_commit = on`) before claiming the shard's next
    /// batch. Off by default: no client and no consumer offset depends on a
    /// mark, and a mark a crash of PostgreSQL undoes leaves its rows pending,
    /// so they are published again and the inbox absorbs them, as after a
    /// relay killed between its acks and its commit. A crash of the relay
    /// undoes nothing (its commits are the server's), and the server undoes
    /// only the last commits, in order, so each key's first publishes stay
    /// in order (the re-publishes land after a later event of their key,
    /// and the inbox absorbs them). Orders'
    /// and payments' commits, and the operator commands', always wait.
    #[arg(long, env = "RELAY_SYNCHRONOUS_COMMIT", default_value_t = false, action = clap::ArgAction::Set)]
    pub synchronous_commit: bool,

    /// Address serving GET /metrics.
    #[arg(long, env = pipeline::contract::env::RELAY_METRICS_ADDR, default_value = "127.0.0.1:9101")]
    pub metrics_addr: SocketAddr,

    /// Producer linger in milliseconds (batching on the wire). Each produce
    /// request costs the brokers a request and its replicas' fetches: at
    /// 1,000 orders/s on 2 shared cores, 10 ms instead of 5 took the brokers
    /// from 0.80 to 0.61 cores and lowered commit→effect's p50 and p99
    /// (less queueing for the CPU); 20 ms saved more and raised the p50 over
    /// 50 ms (FINDINGS §15).
    #[arg(long, env = "RELAY_LINGER_MS", default_value_t = 10)]
    pub linger_ms: u64,

    /// `--mode wal`: the linger of a second producer, taken while the
    /// stream reads at least `--busy-rows-per-sec` (0: no second producer,
    /// every row lingers `--linger-ms`). At a high rate a longer linger
    /// sends fewer, larger produce requests: at 6,000 rows/s, 50 ms instead
    /// of 10 cut the relay's own CPU per event by a quarter and the
    /// brokers' by more than half, for 18 ms more at p50 (FINDINGS §29); at
    /// a low rate it would only add to each event's wait. The poll relay
    /// sends a claimed batch at once and keeps one producer.
    #[arg(long, env = "RELAY_BUSY_LINGER_MS", default_value_t = 50)]
    pub busy_linger_ms: u64,

    /// `--mode wal`: rows a second read from the stream from which its rows
    /// go through the `--busy-linger-ms` producer, counted each second; it
    /// is left after a second under half of it.
    #[arg(long, env = "RELAY_BUSY_ROWS_PER_SEC", default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub busy_rows_per_sec: u64,

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
    #[arg(long, env = pipeline::contract::env::RELAY_MESSAGE_TIMEOUT_MS, default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1..=RELAY_MAX_MESSAGE_TIMEOUT.as_millis() as u64))]
    pub message_timeout_ms: u64,

    /// Where the outbox is read from. `poll`: each shard's pending rows are
    /// claimed in id order, woken by NOTIFY. `wal`: the rows arrive from
    /// PostgreSQL's logical replication (publication `effectively_outbox`,
    /// plugin pgoutput) in commit order; it needs `wal_level = logical` and
    /// the REPLICATION attribute for the relay's role (the migrations grant
    /// it when run as a superuser). Both mark rows published after the
    /// broker's ack and keep each key's first publishes in order
    /// (ARCHITECTURE.md §6).
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
    #[arg(long, env = pipeline::contract::env::RELAY_SINK, value_enum, default_value_t = Sink::Kafka)]
    pub sink: Sink,

    /// `--sink http`: a destination, `NAME=URL,secret=whsec_...` with
    /// optional `,secret=...` (more secrets: every request is signed with
    /// each, for a rotation), `,timeout=10s` (per attempt, at most 30s),
    /// `,concurrency=16` (attempts in flight), `,max-attempts=8` (at most
    /// 8), `,allow-http` (the URL may be plain `http://`; otherwise only
    /// `https://` is taken). Repeat the flag for more destinations; in the environment,
    /// separate them with `;`. At start-up each one missing from
    /// `orders.webhook_destinations`, the destinations every relay delivers
    /// to, is added; one already there (or removed) is left as the database
    /// has it, with a warning: `relay webhooks add|remove` change them.
    #[arg(
        long,
        env = pipeline::contract::env::RELAY_WEBHOOK_DESTINATIONS,
        value_delimiter = ';',
        hide_env_values = true
    )]
    pub webhook_destination: Vec<webhooks::Destination>,

    /// `--sink http`: networks webhooks may reach besides public addresses,
    /// comma-separated (`127.0.0.1/32`, `10.1.0.0/16`, `::1`). Every other
    /// loopback, private, link-local, unique-local, shared or cloud-metadata
    /// address is refused when the sender connects, after DNS resolution (a
    /// name that resolves there is refused too, however it resolved when the
    /// destination was added); a destination whose URL is such an address
    /// does not start. Default: none (public addresses only).
    #[arg(
        long,
        env = pipeline::contract::env::RELAY_WEBHOOK_ALLOW_ADDRESSES,
        value_delimiter = ',',
        value_parser = parse_net
    )]
    pub webhook_allow_addresses: Vec<ipnet::IpNet>,

    /// `--sink http`, for tests and experiments: every scheduled retry wait
    /// is multiplied by this (0.001 turns 4 h into 14 s). 1 for real: the
    /// receivers' dedup horizon assumes the real schedule.
    #[arg(long, env = pipeline::contract::env::RELAY_WEBHOOK_SCHEDULE_SCALE, default_value_t = 1.0,
          value_parser = parse_scale)]
    pub webhook_schedule_scale: f64,

    /// `--sink http` and `relay webhooks`: the keys that seal the
    /// destinations' specs at rest.
    #[command(flatten)]
    pub webhook_secrets: webhooks::SecretsArgs,
}

/// The relay's operator commands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// The webhook deliveries of `--sink http`.
    #[command(subcommand)]
    Webhooks(webhooks::Admin),
}

/// A network (`10.0.0.0/8`) or one address (`127.0.0.1`, `::1`).
fn parse_net(s: &str) -> Result<ipnet::IpNet, String> {
    let s = s.trim();
    s.parse::<ipnet::IpNet>()
        .or_else(|_| s.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
        .map_err(|_| format!("{s:?}: a network (10.0.0.0/8) or an address (127.0.0.1)"))
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
/// minute, FINDINGS §13).
///
/// Polling for Kafka, its commits do not wait for their WAL's flush unless
/// `--synchronous-commit` says so (why that loses nothing: the flag's help).
pub fn session_limits(config: &Config) -> pipeline::config::SessionLimits {
    pipeline::config::SessionLimits {
        statement_timeout: Duration::from_secs(30),
        idle_in_transaction_timeout: Duration::from_millis(config.message_timeout_ms)
            + Duration::from_secs(10),
        custom_plans: true,
        defer_outbox_notify: false,
        asynchronous_commit: config.command.is_none()
            && config.mode == Mode::Poll
            && config.sink == Sink::Kafka
            && !config.synchronous_commit,
        // The passes read each shard's oldest pending rows by walking
        // `outbox_pending_by_shard` in order (outbox.rs, `read_shards`).
        ordered_reads: true,
    }
}
