//! Chaos settings; every flag is also an environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

use crate::fault::Fault;
use pipeline::contract::{CrashPoint, ServiceName, SplitTxn};

/// How the events cross from the relay to payments (`--transport`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Kafka: relay publishes to KAFKA_TOPIC, payments consumes it.
    #[default]
    Kafka,
    /// Signed webhooks: relay --sink http delivers to payments --source http.
    Http,
}

/// What publishes the outbox to Kafka (`--relay-kind`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RelayKind {
    /// The project's relay (`RELAY_MODE` in the environment picks poll or wal).
    #[default]
    Relay,
    /// Debezium's PostgreSQL connector with its Outbox Event Router, on one
    /// standalone Kafka Connect worker: `--debezium-script run` in the
    /// foreground, ready once the connector and its task run.
    Debezium,
}

/// Chaos: the pipeline under load, duplicates and kill -9, then recon's proof.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "chaos",
    version,
    about = "Runs orders, relay and payments under load with duplicate delivery and kill -9, restarts them, then runs recon",
    long_about = "Runs orders, relay and payments as child processes against DATABASE_URL and \
        KAFKA_BOOTSTRAP_SERVERS/KAFKA_TOPIC (inherited by the children; each child, and recon, \
        gets its own role's URL as DATABASE_URL when ORDERS_, RELAY_, PAYMENTS_ or \
        RECON_DATABASE_URL is set, as .stack/env sets them), drives load with loadgen, \
        injects faults (crash points where a service SIGKILLs itself, SIGKILLs from outside at random \
        moments, duplicate delivery on the consumer), restarts every service that dies, and records \
        kills, restarts and recovery times. When the load ends the faults stop (restarted services \
        come back unarmed), the pipeline drains, and recon proves distinct effects == distinct \
        intents. The exit status is recon's: 0 clean, 1 drift, 2 error (chaos's own errors too).\n\n\
        Chaos never writes business data: only the services do."
)]
pub struct Config {
    /// Directory of the orders, relay, payments, loadgen and recon binaries
    /// (and kafka-tool, which offset-reset runs). Default: the directory of
    /// this executable.
    #[arg(long, env = "CHAOS_BIN_DIR")]
    pub bin_dir: Option<PathBuf>,

    /// Directory for the services' logs, loadgen's outputs, recon's report and
    /// the summary (created; files in it are overwritten).
    #[arg(long, env = "CHAOS_OUT", default_value = ".stack/chaos")]
    pub out: PathBuf,

    /// Write the JSON summary here. Default: OUT/chaos.json.
    #[arg(long, env = "CHAOS_JSON")]
    pub json: Option<PathBuf>,

    // --- load ---------------------------------------------------------------
    /// New intents per second sent by loadgen (retries come on top).
    #[arg(long, env = "CHAOS_RATE", default_value_t = 300.0)]
    pub rate: f64,

    /// Seconds of load; faults are injected during this time. With
    /// --max-duration, the least seconds of load.
    #[arg(long, env = "CHAOS_DURATION", default_value_t = 20)]
    pub duration: u64,

    /// Keep the load on past --duration until --fault-count faults have
    /// been injected and each recovered (or waited for), but no longer than
    /// this many seconds in all. A run then holds the faults it asked for,
    /// however long each took to recover on this machine. Needs --fault and
    /// --fault-count.
    #[arg(long, env = "CHAOS_MAX_DURATION", value_name = "SECONDS")]
    pub max_duration: Option<u64>,

    /// Fraction of intents loadgen retries 1-3x with the same key and body.
    #[arg(long, env = "CHAOS_RETRY_RATE", default_value_t = 0.15)]
    pub retry_rate: f64,

    /// loadgen's --protocol (http, grpc, mixed).
    #[arg(long, env = "CHAOS_PROTOCOL", default_value = "mixed")]
    pub protocol: String,

    /// loadgen's --zipf-s (0: a fresh key per intent).
    #[arg(long, env = "CHAOS_ZIPF_S", default_value_t = 0.0)]
    pub zipf_s: f64,

    /// loadgen's --seed (a reproducible sequence of keys and retries).
    #[arg(long, env = "CHAOS_SEED")]
    pub seed: Option<u64>,

    /// One more argument for loadgen (repeat the flag for several).
    #[arg(long = "loadgen-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub loadgen_args: Vec<String>,

    // --- faults -------------------------------------------------------------
    /// Arm these crash points (comma list) in the services that own them:
    /// `commit` (orders), `publish` (relay), `claim`, `effect`, `split`
    /// (payments). The service SIGKILLs itself there; chaos restarts it.
    #[arg(long, env = "CHAOS_CRASH_POINT", value_enum, value_delimiter = ',')]
    pub crash_point: Vec<CrashPoint>,

    /// Fire an armed crash point every Nth pass (per point and process life;
    /// of two points passed in turn, the first always fires first: use
    /// `--crash-probability` to spread kills over several points).
    #[arg(long, env = "CHAOS_CRASH_EVERY")]
    pub crash_every: Option<u64>,

    /// Fire the armed crash point with this probability per pass.
    #[arg(long, env = "CHAOS_CRASH_PROBABILITY", default_value_t = 0.0)]
    pub crash_probability: f64,

    /// SIGKILL these services from outside at random moments (comma list of
    /// orders, relay, payments).
    #[arg(long, env = "CHAOS_RANDOM_KILL", value_enum, value_delimiter = ',')]
    pub random_kill: Vec<ServiceName>,

    /// Random kills come after a pause drawn uniformly from MIN..MAX
    /// milliseconds, counted from the previous kill.
    #[arg(long, env = "CHAOS_KILL_INTERVAL_MS", value_name = "MIN..MAX",
          default_value = "2000..5000", value_parser = parse_range)]
    pub kill_interval_ms: (u64, u64),

    /// Infrastructure faults (comma list of pg-crash, broker-kill,
    /// broker-quorum-loss, broker-pause, relay-pause, offset-reset,
    /// payments-scale, the network's broker-partition, net-lag, relay-cut and
    /// payments-db-cut; with --transport http also receiver-down,
    /// receiver-errors, receiver-slow), injected one at a time in turn, each after
    /// a pause drawn from `--fault-interval-ms`, while the load runs. Chaos
    /// does not restart the services for them (offset-reset excepted: see
    /// its doc); it records each fault's outage and the time until the whole
    /// pipeline moved again.
    #[arg(long, env = "CHAOS_FAULT", value_enum, value_delimiter = ',')]
    pub fault: Vec<Fault>,

    /// Pause before each infrastructure fault, drawn uniformly from MIN..MAX
    /// milliseconds, counted from the previous fault's recovery.
    #[arg(long, env = "CHAOS_FAULT_INTERVAL_MS", value_name = "MIN..MAX",
          default_value = "5000..10000", value_parser = parse_range)]
    pub fault_interval_ms: (u64, u64),

    /// Inject at most this many infrastructure faults (default: until the
    /// load ends). With --max-duration, the load waits for them.
    #[arg(long, env = "CHAOS_FAULT_COUNT")]
    pub fault_count: Option<u64>,

    /// How long PostgreSQL or the Kafka nodes stay down in pg-crash,
    /// broker-kill and broker-quorum-loss, in milliseconds.
    #[arg(long, env = "CHAOS_FAULT_DOWN_MS", default_value_t = 2000)]
    pub fault_down_ms: u64,

    /// How long pg-lagged-failover keeps the primary's WAL senders to its
    /// standbys stopped before the primary is lost, in milliseconds.
    #[arg(long, env = "CHAOS_PG_LAG_MS", default_value_t = 2000)]
    pub pg_lag_ms: u64,

    /// How long pg-partition cuts the primary off, in milliseconds: longer
    /// than the cluster's leader key TTL (20 s) for a standby to be promoted
    /// meanwhile.
    #[arg(long, env = "CHAOS_PG_PARTITION_MS", default_value_t = 30_000)]
    pub pg_partition_ms: u64,

    /// How long broker-pause keeps a Kafka node stopped, in milliseconds:
    /// longer than the brokers' replica.lag.time.max.ms (10 s on the stack)
    /// for the ISR to shrink.
    #[arg(long, env = "CHAOS_BROKER_PAUSE_MS", default_value_t = 15_000)]
    pub broker_pause_ms: u64,

    /// How long relay-pause keeps the relay stopped, in milliseconds. Chaos
    /// starts the relay with an idle-in-transaction limit of half of it (and
    /// a broker ack timeout of a quarter), so the pause outlasts the limit.
    #[arg(long, env = "CHAOS_RELAY_PAUSE_MS", default_value_t = 12_000)]
    pub relay_pause_ms: u64,

    /// How long the network faults last (broker-partition, net-lag, relay-cut,
    /// payments-db-cut), in milliseconds.
    #[arg(long, env = "CHAOS_NET_FAULT_MS", default_value_t = 15_000)]
    pub net_fault_ms: u64,

    /// net-lag: the time added to a round trip between the services and the
    /// Kafka nodes (half each way), drawn per fault from MIN..MAX
    /// milliseconds.
    #[arg(long, env = "CHAOS_NET_DELAY_MS", value_name = "MIN..MAX",
          default_value = "50..200", value_parser = parse_range)]
    pub net_delay_ms: (u64, u64),

    /// net-lag: the share of packets dropped each way, drawn per fault from
    /// MIN..MAX percent.
    #[arg(long, env = "CHAOS_NET_LOSS_PCT", value_name = "MIN..MAX",
          default_value = "1..5", value_parser = parse_range)]
    pub net_loss_pct: (u64, u64),

    /// net-lag: the NFQUEUE number chaos's delay line reads.
    #[arg(long, env = "CHAOS_NET_QUEUE", default_value_t = 4077)]
    pub net_queue: u16,

    /// The script that crashes and restarts PostgreSQL and the Kafka nodes:
    /// `SCRIPT crash postgres|broker|quorum DOWN_MS`, `SCRIPT pause broker
    /// MS`, the PostgreSQL cluster's `SCRIPT pg failover|switchover|
    /// standby-loss|check [DOWN_MS]` and the network faults' `SCRIPT net
    /// partition|lag|cut|heal ...`
    /// (the embedded stack's
    /// `scripts/stack.sh` has it; for another stack, write one that does the
    /// same).
    #[arg(long, env = "CHAOS_STACK_SCRIPT", default_value = "scripts/stack.sh")]
    pub stack_script: PathBuf,

    /// The partitions of KAFKA_TOPIC (the stack's topics have 6): the
    /// payments-scale fault waits until the running members own them all,
    /// before and after each step.
    #[arg(long, env = "CHAOS_PARTITIONS", default_value_t = 6,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub partitions: u32,

    /// The consumer group payments uses (offset-reset resets it).
    #[arg(long, env = "PAYMENTS_GROUP_ID", default_value = "payments")]
    pub payments_group: String,

    /// Duplicate delivery on the consumer: about this fraction of messages is
    /// delivered twice (payments --dup-rate).
    #[arg(long, env = "CHAOS_DUP_RATE", default_value_t = 0.0)]
    pub dup_rate: f64,

    /// Which duplicates: reprocess, redeliver or both (payments --dup-kind).
    #[arg(long, env = "CHAOS_DUP_KIND", default_value = "both")]
    pub dup_kind: String,

    /// UNSAFE counter-example: run payments with --unsafe-split-txn (inbox and
    /// effect in two transactions). Recon is expected to find drift.
    #[arg(long, env = "CHAOS_UNSAFE_SPLIT_TXN", value_enum)]
    pub unsafe_split_txn: Option<SplitTxn>,

    // --- transport ----------------------------------------------------------
    /// How events go from the relay to payments: `kafka`, or `http` (relay
    /// --sink http delivers signed webhooks to payments --source http on
    /// --webhook-addr; crash points `deliver` and `respond` exist there,
    /// `publish` and the broker's faults do not, and the duplicates come
    /// from the sender's retries and the crashes rather than --dup-rate).
    #[arg(long, env = "CHAOS_TRANSPORT", value_enum, default_value_t = Transport::Kafka)]
    pub transport: Transport,

    /// What publishes the outbox: `relay` (the project's), or `debezium`
    /// (its worker started as `--debezium-script run`, killed -9 from
    /// outside with `--random-kill relay`; payments then needs
    /// `PAYMENTS_INPUT_FORMAT=outbox-router` and recon `RECON_UNMARKED_OUTBOX`,
    /// both inherited from chaos's environment). One worker, over Kafka, with
    /// kills and duplicates only: the infrastructure faults judge recovery
    /// by the relay's metrics, which the worker does not serve.
    #[arg(long, env = "CHAOS_RELAY_KIND", value_enum, default_value_t = RelayKind::Relay)]
    pub relay_kind: RelayKind,

    /// `--relay-kind debezium`: the script whose `run` starts the Kafka
    /// Connect worker in the foreground (its DEBEZIUM_* settings inherited
    /// from chaos's environment).
    #[arg(
        long,
        env = "CHAOS_DEBEZIUM_SCRIPT",
        default_value = "scripts/debezium.sh"
    )]
    pub debezium_script: PathBuf,

    /// `--relay-kind debezium`: the worker's REST address (given to the
    /// script as DEBEZIUM_PORT; readiness is its connector's status).
    #[arg(long, env = "CHAOS_DEBEZIUM_REST", default_value = "127.0.0.1:28083")]
    pub debezium_rest: SocketAddr,

    /// `--transport http`: the address payments receives webhooks on.
    #[arg(long, env = "CHAOS_WEBHOOK_ADDR", default_value = "127.0.0.1:18403")]
    pub webhook_addr: SocketAddr,

    /// `--transport http`: the relay's retry schedule scaled by this (0.01
    /// turns 5 s, 30 s, 5 min into 50 ms, 300 ms, 3 s), so a run of minutes
    /// sees its retries.
    #[arg(long, env = "CHAOS_WEBHOOK_SCHEDULE_SCALE", default_value_t = 1.0)]
    pub webhook_schedule_scale: f64,

    /// `--transport http`: the address of chaos's proxy between relay and
    /// payments (the relay's destination; the receiver faults act there).
    #[arg(
        long,
        env = "CHAOS_WEBHOOK_PROXY_ADDR",
        default_value = "127.0.0.1:18404"
    )]
    pub webhook_proxy_addr: SocketAddr,

    /// `--transport http`: the relay's timeout per attempt, in milliseconds
    /// (at most 30000).
    #[arg(long, env = "CHAOS_WEBHOOK_TIMEOUT_MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(100..=30_000))]
    pub webhook_timeout_ms: u64,

    /// `--transport http`: attempts before the relay gives a delivery up
    /// (1 to 8; `relay webhooks replay --failed` sends it again).
    #[arg(long, env = "CHAOS_WEBHOOK_MAX_ATTEMPTS", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..=8))]
    pub webhook_max_attempts: u32,

    /// `--transport http`: the signing secret relay and payments share
    /// (`whsec_...`). Default: a fresh one per run.
    #[arg(long, env = "CHAOS_WEBHOOK_SECRET", hide_env_values = true)]
    pub webhook_secret: Option<effectively::webhook::Secret>,

    // --- services -----------------------------------------------------------
    /// Orders instances, each its own process on its own ports (instance i
    /// on --http-addr and --grpc-addr with the port plus 100·i); loadgen
    /// spreads its sends over all of them (`--loadgen-arg=--spread` chooses
    /// how), so one key's retries reach different instances.
    #[arg(long, env = "CHAOS_ORDERS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=MAX_INSTANCES as i64))]
    pub orders: u16,

    /// Relay instances, sharing the outbox by its shard leases (instance i's
    /// metrics on --relay-metrics-addr's port plus 100·i). With `RELAY_MODE=wal`
    /// one holds the slot and the others wait for it.
    #[arg(long, env = "CHAOS_RELAYS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=MAX_INSTANCES as i64))]
    pub relays: u16,

    /// Payments instances, one consumer group (instance i's metrics on
    /// --payments-metrics-addr's port plus 100·i); more than the topic's
    /// partitions leaves the rest idle until a member dies. One with
    /// --transport http (one receiver behind the proxy).
    #[arg(long, env = "CHAOS_PAYMENTS", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..=MAX_INSTANCES as i64))]
    pub payments: u16,

    /// The payments-scale fault's counts of running payments instances, in
    /// turn (comma list, each 1 to --payments). Default: 1, then --payments.
    #[arg(long, env = "CHAOS_PAYMENTS_SCALE", value_delimiter = ',',
          value_parser = clap::value_parser!(u16).range(1..=MAX_INSTANCES as i64))]
    pub payments_scale: Vec<u16>,

    /// Orders HTTP address (of the first instance; see --orders).
    #[arg(long, env = "CHAOS_HTTP_ADDR", default_value = "127.0.0.1:18480")]
    pub http_addr: SocketAddr,

    /// Orders gRPC address (of the first instance).
    #[arg(long, env = "CHAOS_GRPC_ADDR", default_value = "127.0.0.1:18451")]
    pub grpc_addr: SocketAddr,

    /// Orders metrics address (of the first instance).
    #[arg(
        long,
        env = "CHAOS_ORDERS_METRICS_ADDR",
        default_value = "127.0.0.1:18400"
    )]
    pub orders_metrics_addr: SocketAddr,

    /// Relay metrics address (of the first instance; see --relays).
    #[arg(
        long,
        env = "CHAOS_RELAY_METRICS_ADDR",
        default_value = "127.0.0.1:18401"
    )]
    pub relay_metrics_addr: SocketAddr,

    /// Payments metrics address (of the first instance; see --payments).
    #[arg(
        long,
        env = "CHAOS_PAYMENTS_METRICS_ADDR",
        default_value = "127.0.0.1:18402"
    )]
    pub payments_metrics_addr: SocketAddr,

    /// Run payments with static group membership (a fixed Kafka
    /// `group.instance.id` for every life of this run): a restarted consumer
    /// gets its partitions back at once instead of after its dead
    /// predecessor's session timeout. `false` shows the dynamic-membership cost.
    #[arg(long, env = "CHAOS_STATIC_MEMBERSHIP", default_value_t = true, action = clap::ArgAction::Set)]
    pub static_membership: bool,

    /// Seconds a (re)started service has to answer GET /metrics.
    #[arg(long, env = "CHAOS_READY_TIMEOUT", default_value_t = 30)]
    pub ready_timeout: u64,

    // --- the end ------------------------------------------------------------
    /// After the load: seconds to wait for the pipeline to drain (recon
    /// --wait-drained) before recon reports anyway.
    #[arg(long, env = "CHAOS_DRAIN_TIMEOUT", default_value_t = 120)]
    pub drain_timeout: u64,
}

/// Most instances of one service.
pub const MAX_INSTANCES: u16 = 16;

/// Instance i of a service listens on its first address's port plus
/// `PORT_STRIDE`·i: with the default addresses (ports 18401 to 18480, all
/// different modulo 100) no two instances of any services meet.
pub const PORT_STRIDE: u16 = 100;

/// One process chaos runs: which service, and which of its instances.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Instance {
    /// The service.
    pub service: ServiceName,
    /// 0-based.
    pub index: u16,
    /// How many instances the service has.
    pub of: u16,
}

impl Instance {
    /// Its name in logs, files and the summary: the service's own name when
    /// it runs alone (`relay`), else numbered from 1 (`relay-2`).
    pub fn label(&self) -> String {
        if self.of <= 1 {
            self.service.as_str().to_owned()
        } else {
            format!("{}-{}", self.service.as_str(), self.index + 1)
        }
    }

    /// `base` with the port this instance uses (see [`PORT_STRIDE`]); `None`
    /// past the last port.
    pub fn addr(&self, base: SocketAddr) -> Option<SocketAddr> {
        let port = base
            .port()
            .checked_add(PORT_STRIDE.checked_mul(self.index)?)?;
        Some(SocketAddr::new(base.ip(), port))
    }
}

fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("`{s}` is not MIN..MAX (e.g. 2000..5000)"))?;
    let a: u64 = a.trim().parse().map_err(|e| format!("MIN: {e}"))?;
    let b: u64 = b.trim().parse().map_err(|e| format!("MAX: {e}"))?;
    if a == 0 || a > b {
        return Err(format!("need 0 < MIN <= MAX, got {a}..{b}"));
    }
    Ok((a, b))
}

impl Config {
    /// Checks what clap cannot: combinations and ranges.
    pub fn validate(&self) -> Result<(), String> {
        let unit = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(format!("--{name} must be in [0, 1], got {v}"))
            }
        };
        unit("dup-rate", self.dup_rate)?;
        unit("retry-rate", self.retry_rate)?;
        unit("crash-probability", self.crash_probability)?;
        if self.rate <= 0.0 || !self.rate.is_finite() {
            return Err(format!("--rate must be > 0, got {}", self.rate));
        }
        if self.duration == 0 {
            return Err("--duration must be at least 1 second".into());
        }
        if let Some(max) = self.max_duration {
            if self.fault.is_empty() || self.fault_count.is_none() {
                return Err(
                    "--max-duration needs --fault and --fault-count (the load goes on until \
                     that many faults are done)"
                        .into(),
                );
            }
            if max < self.duration {
                return Err(format!(
                    "--max-duration {max} is shorter than --duration {}",
                    self.duration
                ));
            }
        }
        for &point in &self.crash_point {
            if self.crash_every.unwrap_or(0) == 0 && self.crash_probability == 0.0 {
                return Err(format!(
                    "--crash-point {} needs --crash-every N or --crash-probability P",
                    point.as_str()
                ));
            }
            if point == CrashPoint::Split && self.unsafe_split_txn.is_none() {
                return Err(
                    "--crash-point split exists only with --unsafe-split-txn (the counter-example)"
                        .into(),
                );
            }
        }
        let http = self.transport == Transport::Http;
        for &point in &self.crash_point {
            let needs_http = matches!(point, CrashPoint::Deliver | CrashPoint::Respond);
            if needs_http && !http {
                return Err(format!(
                    "--crash-point {} exists only with --transport http",
                    point.as_str()
                ));
            }
            if http && matches!(point, CrashPoint::Publish | CrashPoint::Split) {
                return Err(format!(
                    "--crash-point {} does not exist with --transport http (the relay's fan-out \
                     is one transaction; its window is `deliver`)",
                    point.as_str()
                ));
            }
        }
        if !http && let Some(fault) = self.fault.iter().find(|f| f.needs_http()) {
            return Err(format!(
                "--fault {} exists only with --transport http",
                fault.as_str()
            ));
        }
        if http {
            if self.dup_rate > 0.0 {
                return Err(
                    "--dup-rate injects Kafka redeliveries; with --transport http the \
                            sender's retries and the crash points make the duplicates"
                        .into(),
                );
            }
            for fault in [
                Fault::BrokerKill,
                Fault::BrokerQuorumLoss,
                Fault::BrokerPause,
                Fault::OffsetReset,
                Fault::PaymentsScale,
                Fault::BrokerPartition,
                Fault::NetLag,
                Fault::RelayCut,
            ] {
                if self.fault.contains(&fault) {
                    return Err(format!(
                        "--fault {} needs --transport kafka (no broker in the http pipeline)",
                        fault.as_str()
                    ));
                }
            }
            if !(self.webhook_schedule_scale > 0.0 && self.webhook_schedule_scale <= 1.0) {
                return Err(format!(
                    "--webhook-schedule-scale must be over 0 and at most 1, got {}",
                    self.webhook_schedule_scale
                ));
            }
        }
        if self.relay_kind == RelayKind::Debezium {
            self.check_debezium()?;
        }
        if self.fault.contains(&Fault::RelayPause) && self.relay_pause_ms < 2_000 {
            return Err(format!(
                "--relay-pause-ms must be at least 2000 (the relay's idle limit is half of it), got {}",
                self.relay_pause_ms
            ));
        }
        if self.net_loss_pct.1 > 100 {
            return Err(format!(
                "--net-loss-pct is a percentage, at most 100, got {}",
                self.net_loss_pct.1
            ));
        }
        if self.fault.contains(&Fault::PaymentsScale) {
            if self.payments < 2 {
                return Err("--fault payments-scale needs --payments 2 or more".into());
            }
            if let Some(n) = self.payments_scale.iter().find(|&&n| n > self.payments) {
                return Err(format!(
                    "--payments-scale {n} is more than --payments {}",
                    self.payments
                ));
            }
        }
        if http && self.payments > 1 {
            return Err(format!(
                "--payments {} needs --transport kafka (over http one receiver sits behind \
                 chaos's proxy)",
                self.payments
            ));
        }
        self.check_addresses()
    }

    /// What `--relay-kind debezium` runs with: one worker, over Kafka, no
    /// relay crash point, no infrastructure fault.
    fn check_debezium(&self) -> Result<(), String> {
        if self.transport == Transport::Http {
            return Err(
                "--relay-kind debezium publishes to Kafka; it does not run with --transport http"
                    .into(),
            );
        }
        if self.relays != 1 {
            return Err(format!(
                "--relay-kind debezium runs one Kafka Connect worker: --relays 1, not {}",
                self.relays
            ));
        }
        if self.crash_point.contains(&CrashPoint::Publish) {
            return Err(
                "--crash-point publish is the project's relay's; Debezium's worker is killed \
                 from outside (--random-kill relay)"
                    .into(),
            );
        }
        if let Some(fault) = self.fault.first() {
            return Err(format!(
                "--fault {} does not run with --relay-kind debezium: a fault's recovery is read \
                 from the relay's metrics, which Debezium's worker does not serve (kills and \
                 duplicates only)",
                fault.as_str()
            ));
        }
        Ok(())
    }

    /// Every address a child listens on, with the flag it comes from: none
    /// past the last port, no two alike.
    fn check_addresses(&self) -> Result<(), String> {
        let mut taken: Vec<(SocketAddr, String)> = Vec::new();
        let mut take = |base: SocketAddr, flag: &str, instance: Option<Instance>| {
            let (addr, who) = match instance {
                Some(i) => (i.addr(base), format!("{flag} of {}", i.label())),
                None => (Some(base), flag.to_owned()),
            };
            let addr = addr.ok_or_else(|| {
                format!("{who}: {base}'s port plus {PORT_STRIDE} per instance is past 65535")
            })?;
            if let Some((_, other)) = taken.iter().find(|(a, _)| *a == addr) {
                return Err(format!(
                    "{who} and {other} would both listen on {addr}: choose other addresses"
                ));
            }
            taken.push((addr, who));
            Ok(())
        };
        for i in self.instances() {
            match i.service {
                ServiceName::Orders => {
                    take(self.http_addr, "--http-addr", Some(i))?;
                    take(self.grpc_addr, "--grpc-addr", Some(i))?;
                    take(self.orders_metrics_addr, "--orders-metrics-addr", Some(i))?;
                }
                ServiceName::Relay => {
                    take(self.relay_metrics_addr, "--relay-metrics-addr", Some(i))?
                }
                ServiceName::Payments => {
                    take(
                        self.payments_metrics_addr,
                        "--payments-metrics-addr",
                        Some(i),
                    )?;
                }
            }
        }
        if self.transport == Transport::Http {
            take(self.webhook_addr, "--webhook-addr", None)?;
            take(self.webhook_proxy_addr, "--webhook-proxy-addr", None)?;
        }
        Ok(())
    }

    /// The payments-scale fault's `round`-th count (0-based), in turn.
    pub fn payments_scale_step(&self, round: usize) -> u16 {
        let steps = if self.payments_scale.is_empty() {
            vec![1, self.count(ServiceName::Payments)]
        } else {
            self.payments_scale.clone()
        };
        steps[round % steps.len()]
    }

    /// How many instances `service` runs as.
    pub fn count(&self, service: ServiceName) -> u16 {
        match service {
            ServiceName::Orders => self.orders,
            ServiceName::Relay => self.relays,
            ServiceName::Payments => self.payments,
        }
        .max(1)
    }

    /// Every process chaos runs, service by service, in instance order.
    pub fn instances(&self) -> Vec<Instance> {
        ServiceName::ALL
            .iter()
            .flat_map(|&service| {
                let of = self.count(service);
                (0..of).map(move |index| Instance { service, index, of })
            })
            .collect()
    }

    /// Each orders instance's (HTTP, gRPC) address.
    pub fn orders_addrs(&self) -> Vec<(SocketAddr, SocketAddr)> {
        self.instances()
            .into_iter()
            .filter(|i| i.service == ServiceName::Orders)
            .map(|i| self.orders_addr(i))
            .collect()
    }

    /// An orders instance's (HTTP, gRPC) address. Checked by
    /// [`Self::validate`] to exist.
    pub fn orders_addr(&self, instance: Instance) -> (SocketAddr, SocketAddr) {
        (
            instance.addr(self.http_addr).unwrap_or(self.http_addr),
            instance.addr(self.grpc_addr).unwrap_or(self.grpc_addr),
        )
    }

    /// The crash points armed in `service`, as its `CRASH_POINT` takes them.
    pub fn crash_points_of(&self, service: ServiceName) -> Option<String> {
        let points: Vec<&str> = self
            .crash_point
            .iter()
            .filter(|p| p.service() == service)
            .map(|p| p.as_str())
            .collect();
        (!points.is_empty()).then(|| points.join(","))
    }

    /// The address `instance` serves `/metrics` on. Checked by
    /// [`Self::validate`] to exist.
    pub fn metrics_addr(&self, instance: Instance) -> SocketAddr {
        let base = match instance.service {
            ServiceName::Orders => self.orders_metrics_addr,
            ServiceName::Relay => self.relay_metrics_addr,
            ServiceName::Payments => self.payments_metrics_addr,
        };
        instance.addr(base).unwrap_or(base)
    }

    /// The metrics URL of `instance`.
    pub fn metrics_url(&self, instance: Instance) -> String {
        format!("http://{}/metrics", self.metrics_addr(instance))
    }
}

#[cfg(test)]
mod tests;
