//! The run's summary: what chaos prints at the end and writes to
//! `chaos.json` (schema `effectively.chaos.v1`).
//!
//! The experiment scripts read `chaos.json` by key paths
//! (`services.relay.deaths`, `faults.pg-crash.recovery_ms.p99`, ...), so the
//! types here are that file's contract: a renamed field or a changed nesting
//! breaks them, and `tests::the_json_shape_is_pinned` fails first.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use serde::Serialize;
use serde_json::Value;

use pipeline::contract::{CrashPoint, ServiceName, SplitTxn};

use crate::config::{Config, RelayKind, Transport};
use crate::fault::Fault;
use crate::faults::FaultRecord;
use crate::scrape;
use crate::supervisor::{self, End, Life};

/// The `schema` of every summary this version writes.
pub const SCHEMA: &str = "effectively.chaos.v1";

/// The whole summary (`chaos.json`).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Always [`SCHEMA`].
    pub schema: &'static str,
    /// Whether SIGINT/SIGTERM cut the run short (then recon did not run).
    pub interrupted: bool,
    /// Seconds from chaos's start to the summary.
    pub elapsed_s: f64,
    /// When chaos started, in milliseconds since the Unix epoch: the zero of
    /// every `*_ms` time in `fault_log` and the lives, so they can be set
    /// beside the database's timestamps.
    pub started_at_unix_ms: u64,
    /// The settings of the run.
    pub params: Params,
    /// Crash-point and random kills over all services.
    pub kills_total: u64,
    /// Per infrastructure fault kind (`pg-crash`, ...), the ones injected.
    pub faults: BTreeMap<String, FaultSummary>,
    /// Every infrastructure fault, in order.
    pub fault_log: Vec<FaultRecord>,
    /// Per service (`orders`, `relay`, `payments`), over all its instances.
    pub services: BTreeMap<String, ServiceSummary>,
    /// The counters of [`scrape::COUNTERS`] summed over services and lives.
    pub totals: BTreeMap<&'static str, f64>,
    /// Duplicates payments injected (reprocessed + redelivered).
    pub injected_duplicates: f64,
    /// loadgen's JSON report as it wrote it (`null` if it wrote none).
    pub load: Value,
    /// `recon --json` as it printed it (`null` if recon did not run).
    pub recon: Value,
    /// recon's exit status (chaos's own errors: [`crate::EXIT_ERROR`]).
    pub recon_exit: u8,
    /// The verdict read from `recon_exit`.
    pub result: Verdict,
    /// The `--out` directory, resolved.
    pub out_dir: String,
}

/// The run's settings, as flags gave them.
#[derive(Debug, Clone, Serialize)]
pub struct Params {
    /// New intents per second.
    pub rate: f64,
    /// Seconds of load (the least, with `max_duration_s`).
    pub duration_s: u64,
    /// The most seconds of load, when it waited for `fault_count` faults.
    pub max_duration_s: Option<u64>,
    /// Fraction of intents retried.
    pub retry_rate: f64,
    /// loadgen's protocol.
    pub protocol: String,
    /// loadgen's Zipf exponent.
    pub zipf_s: f64,
    /// Orders instances.
    pub orders: u16,
    /// Relay instances.
    pub relays: u16,
    /// Payments instances.
    pub payments: u16,
    /// loadgen's seed.
    pub seed: Option<u64>,
    /// Armed crash points.
    pub crash_point: Vec<CrashPoint>,
    /// Fire every Nth pass.
    pub crash_every: Option<u64>,
    /// Fire with this probability per pass.
    pub crash_probability: f64,
    /// Services killed from outside.
    pub random_kill: Vec<ServiceName>,
    /// `[min, max]` pause between random kills.
    pub kill_interval_ms: (u64, u64),
    /// Infrastructure faults, in turn.
    pub fault: Vec<Fault>,
    /// `[min, max]` pause before each infrastructure fault.
    pub fault_interval_ms: (u64, u64),
    /// At most this many infrastructure faults.
    pub fault_count: Option<u64>,
    /// How long PostgreSQL or the broker stays down.
    pub fault_down_ms: u64,
    /// How long pg-lagged-failover stops the primary's WAL senders first.
    pub pg_lag_ms: u64,
    /// How long pg-partition cuts the primary off.
    pub pg_partition_ms: u64,
    /// How long relay-pause stops the relay.
    pub relay_pause_ms: u64,
    /// Fraction of messages payments delivers twice.
    pub dup_rate: f64,
    /// Which duplicates.
    pub dup_kind: String,
    /// The unsafe counter-example, if run.
    pub unsafe_split_txn: Option<SplitTxn>,
    /// Static group membership for payments.
    pub static_membership: bool,
    /// Seconds recon waited for the pipeline to drain.
    pub drain_timeout_s: u64,
    /// How events went from the relay to payments.
    pub transport: Transport,
    /// What published the outbox.
    pub relay_kind: RelayKind,
    /// `http`: the factor on the relay's retry schedule.
    pub webhook_schedule_scale: f64,
    /// `http`: the relay's timeout per attempt.
    pub webhook_timeout_ms: u64,
    /// `http`: attempts before a delivery is given up.
    pub webhook_max_attempts: u32,
}

impl Params {
    /// The summary's copy of `config`.
    pub fn of(config: &Config) -> Self {
        Self {
            rate: config.rate,
            duration_s: config.duration,
            max_duration_s: config.max_duration,
            retry_rate: config.retry_rate,
            protocol: config.protocol.clone(),
            zipf_s: config.zipf_s,
            orders: config.count(ServiceName::Orders),
            relays: config.count(ServiceName::Relay),
            payments: config.count(ServiceName::Payments),
            seed: config.seed,
            crash_point: config.crash_point.clone(),
            crash_every: config.crash_every,
            crash_probability: config.crash_probability,
            random_kill: config.random_kill.clone(),
            kill_interval_ms: config.kill_interval_ms,
            fault: config.fault.clone(),
            fault_interval_ms: config.fault_interval_ms,
            fault_count: config.fault_count,
            fault_down_ms: config.fault_down_ms,
            pg_lag_ms: config.pg_lag_ms,
            pg_partition_ms: config.pg_partition_ms,
            relay_pause_ms: config.relay_pause_ms,
            dup_rate: config.dup_rate,
            dup_kind: config.dup_kind.clone(),
            unsafe_split_txn: config.unsafe_split_txn,
            static_membership: config.static_membership,
            drain_timeout_s: config.drain_timeout,
            transport: config.transport,
            relay_kind: config.relay_kind,
            webhook_schedule_scale: config.webhook_schedule_scale,
            webhook_timeout_ms: config.webhook_timeout_ms,
            webhook_max_attempts: config.webhook_max_attempts,
        }
    }
}

/// One service over the run, its instances together.
#[derive(Debug, Clone, Serialize)]
pub struct ServiceSummary {
    /// Process lives, of all its instances.
    pub lives: usize,
    /// Lives after each instance's first.
    pub restarts: usize,
    /// Deaths by [`End::label`] (`crash_point:publish`, `random_kill`, ...);
    /// the stop at the end and stops for a fault are not deaths.
    pub deaths: BTreeMap<String, u64>,
    /// Recovery times after deaths.
    pub recovery_ms: RecoverySummary,
    /// The service's counters summed over its lives.
    pub counters: BTreeMap<&'static str, f64>,
    /// Every life, instance by instance (see `instances` for how many each).
    pub life_log: Vec<Life>,
    /// Each instance (one when the service runs alone), in order.
    pub instances: Vec<InstanceSummary>,
}

/// One instance of a service over the run.
#[derive(Debug, Clone, Serialize)]
pub struct InstanceSummary {
    /// Its name (`relay`, or `relay-2` of several).
    pub label: String,
    /// Its process lives.
    pub lives: usize,
    /// Its deaths, by [`End::label`].
    pub deaths: BTreeMap<String, u64>,
}

/// One instance's lives, as the run hands them to [`summarize`].
#[derive(Debug, Clone)]
pub struct InstanceLives {
    /// The service.
    pub service: ServiceName,
    /// The instance's name.
    pub label: String,
    /// Its lives.
    pub lives: Vec<Life>,
}

/// A service's recovery times (see [`supervisor::recoveries`]).
#[derive(Debug, Clone, Serialize)]
pub struct RecoverySummary {
    /// Death → next life answers `/metrics`.
    pub to_ready: Stats,
    /// Death → next life's work counter moved.
    pub to_progress: Stats,
}

/// One infrastructure fault kind over the run.
#[derive(Debug, Clone, Serialize)]
pub struct FaultSummary {
    /// How many were attempted.
    pub injected: usize,
    /// How many could not be injected.
    pub failed_to_inject: usize,
    /// How many the whole pipeline recovered from.
    pub recovered: usize,
    /// Injection → component back.
    pub outage_ms: Stats,
    /// Injection → every service working again.
    pub recovery_ms: Stats,
    /// Inbox hits (re-reads) from the injection to the recovery.
    pub inbox_hits: Stats,
    /// Injection → the PostgreSQL cluster whole again (its faults only).
    pub whole_ms: Stats,
}

/// Count and percentiles of a sample of milliseconds (`null` when empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Sample size.
    pub count: usize,
    /// Median.
    pub p50: Option<u64>,
    /// 99th percentile.
    pub p99: Option<u64>,
    /// Largest.
    pub max: Option<u64>,
}

impl Stats {
    /// The stats of `sample`.
    pub fn of(mut sample: Vec<u64>) -> Self {
        sample.sort_unstable();
        Self {
            count: sample.len(),
            p50: percentile(&sample, 0.5),
            p99: percentile(&sample, 0.99),
            max: sample.last().copied(),
        }
    }
}

/// recon's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    /// recon exit 0: distinct effects == distinct intents.
    Clean,
    /// recon exit 1: a difference.
    Drift,
    /// Anything else: recon or chaos failed.
    Error,
}

impl Verdict {
    /// The verdict of recon's exit status.
    pub fn of(recon_exit: u8) -> Self {
        match recon_exit {
            0 => Self::Clean,
            1 => Self::Drift,
            _ => Self::Error,
        }
    }

    /// As in the JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Clean => "CLEAN",
            Self::Drift => "DRIFT",
            Self::Error => "ERROR",
        }
    }
}

/// What a run produced besides the services' lives.
#[derive(Debug, Default)]
pub struct Outcome {
    /// loadgen's JSON report.
    pub load: Value,
    /// recon's exit status.
    pub recon_code: u8,
    /// Whether the run was interrupted.
    pub interrupted: bool,
    /// The infrastructure faults injected.
    pub faults: Vec<FaultRecord>,
}

/// Builds the summary from the settings, each instance's lives, what the run
/// produced and recon's report (`null` if none).
pub fn summarize(
    config: &Config,
    out: &Path,
    services: &[InstanceLives],
    outcome: Outcome,
    recon: Value,
    t0: Instant,
) -> Summary {
    let Outcome {
        load,
        recon_code,
        interrupted,
        faults,
    } = outcome;
    let mut by_service = BTreeMap::new();
    let mut all_counters: BTreeMap<&'static str, f64> = BTreeMap::new();
    let mut total_kills = 0u64;
    for name in ServiceName::ALL {
        let of: Vec<&InstanceLives> = services.iter().filter(|i| i.service == name).collect();
        if of.is_empty() {
            continue;
        }
        let mut deaths: BTreeMap<String, u64> = BTreeMap::new();
        let mut instances = Vec::with_capacity(of.len());
        let (mut to_ready, mut to_progress) = (Vec::new(), Vec::new());
        for instance in &of {
            let mine = deaths_of(&instance.lives);
            for (k, v) in &mine {
                *deaths.entry(k.clone()).or_insert(0) += v;
            }
            let recovery = supervisor::recoveries(&instance.lives);
            to_ready.extend(recovery.ready_ms);
            to_progress.extend(recovery.progress_ms);
            instances.push(InstanceSummary {
                label: instance.label.clone(),
                lives: instance.lives.len(),
                deaths: mine,
            });
        }
        total_kills += deaths
            .iter()
            .filter(|(k, _)| k.starts_with("crash_point") || *k == "random_kill")
            .map(|(_, v)| v)
            .sum::<u64>();
        let lives: Vec<Life> = of.iter().flat_map(|i| i.lives.iter().cloned()).collect();
        let counters = scrape::sum_lives(lives.iter().map(|l| &l.counters));
        for (k, v) in &counters {
            *all_counters.entry(k).or_insert(0.0) += v;
        }
        by_service.insert(
            name.as_str().to_owned(),
            ServiceSummary {
                lives: lives.len(),
                restarts: lives.len().saturating_sub(of.len()),
                deaths,
                recovery_ms: RecoverySummary {
                    to_ready: Stats::of(to_ready),
                    to_progress: Stats::of(to_progress),
                },
                counters,
                life_log: lives,
                instances,
            },
        );
    }
    let injected_duplicates = all_counters
        .get("injected_reprocess")
        .copied()
        .unwrap_or(0.0)
        + all_counters
            .get("injected_redeliver")
            .copied()
            .unwrap_or(0.0);
    Summary {
        schema: SCHEMA,
        interrupted,
        elapsed_s: t0.elapsed().as_secs_f64(),
        started_at_unix_ms: unix_ms_at(t0),
        params: Params::of(config),
        kills_total: total_kills,
        faults: fault_summary(&faults),
        fault_log: faults,
        services: by_service,
        totals: all_counters,
        injected_duplicates,
        load,
        recon,
        recon_exit: recon_code,
        result: Verdict::of(recon_code),
        out_dir: out.to_string_lossy().into_owned(),
    }
}

/// `t0` in milliseconds since the Unix epoch (0 if the clock is before it).
fn unix_ms_at(t0: Instant) -> u64 {
    std::time::SystemTime::now()
        .checked_sub(t0.elapsed())
        .and_then(|at| at.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The deaths among `lives`, by [`End::label`]: the stop at the end and
/// stops for a fault are not deaths.
fn deaths_of(lives: &[Life]) -> BTreeMap<String, u64> {
    let mut deaths = BTreeMap::new();
    for end in lives.iter().filter_map(|l| l.end.as_ref()) {
        if !matches!(end, End::Stopped | End::Fault { .. }) {
            *deaths.entry(end.label()).or_insert(0) += 1;
        }
    }
    deaths
}

/// Per fault kind: how many, how many recovered, outage and recovery
/// percentiles.
pub fn fault_summary(records: &[FaultRecord]) -> BTreeMap<String, FaultSummary> {
    let mut by_kind = BTreeMap::new();
    for &fault in <Fault as clap::ValueEnum>::value_variants() {
        let of: Vec<&FaultRecord> = records.iter().filter(|r| r.fault == fault).collect();
        if of.is_empty() {
            continue;
        }
        let outage: Vec<u64> = of.iter().filter_map(|r| r.outage_ms).collect();
        let recovery: Vec<u64> = of.iter().filter_map(|r| r.recovery_ms).collect();
        let hits: Vec<u64> = of.iter().filter_map(|r| r.inbox_hits).collect();
        let whole: Vec<u64> = of.iter().filter_map(|r| r.whole_ms).collect();
        by_kind.insert(
            fault.as_str().to_owned(),
            FaultSummary {
                injected: of.len(),
                failed_to_inject: of.iter().filter(|r| r.error.is_some()).count(),
                recovered: recovery.len(),
                outage_ms: Stats::of(outage),
                recovery_ms: Stats::of(recovery),
                inbox_hits: Stats::of(hits),
                whole_ms: Stats::of(whole),
            },
        );
    }
    by_kind
}

/// `summary` as `chaos.json` holds it: pretty, keys sorted at every level.
///
/// Through a [`Value`] because serde_json's map (without its
/// `preserve_order` feature) sorts keys: the file keeps the byte layout it
/// had before the summary was typed, whatever the field order of the structs.
pub fn to_json(summary: &Summary) -> serde_json::Result<String> {
    serde_json::to_string_pretty(&serde_json::to_value(summary)?)
}

/// Prints the summary table to stdout.
pub fn print(summary: &Summary, path: &Path) {
    println!("\n== chaos summary");
    println!(
        "{:<12} {:>5} {:<44} {:>22} {:>22}",
        "service", "lives", "deaths", "death→ready p50/max ms", "death→work p50/max ms"
    );
    let pair = |s: &Stats| format!("{}/{}", show(s.p50), show(s.max));
    for (name, s) in &summary.services {
        let name = if s.instances.len() > 1 {
            format!("{name} x{}", s.instances.len())
        } else {
            name.clone()
        };
        let deaths = s
            .deaths
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        let deaths = if deaths.is_empty() {
            "-".into()
        } else {
            deaths
        };
        println!(
            "{:<12} {:>5} {:<44} {:>22} {:>22}",
            name,
            s.lives,
            deaths,
            pair(&s.recovery_ms.to_ready),
            pair(&s.recovery_ms.to_progress)
        );
    }
    let t = |name: &str| show(summary.totals.get(name).copied());
    println!(
        "injected duplicates: {} (reprocess {}, redeliver {}); inbox hits {}, misses {}; published {}, consumed {}",
        show(summary.injected_duplicates),
        t("injected_reprocess"),
        t("injected_redeliver"),
        t("inbox_hits"),
        t("inbox_misses"),
        t("published"),
        t("consumed"),
    );
    if summary.params.transport == Transport::Http {
        println!(
            "webhooks: accepted {}, answered as duplicates {}; sender retries {}, given up {}; \
             proxy passed {}, answered 500 {}, held past the timeout {}",
            t("webhook_accepted"),
            t("webhook_duplicates"),
            t("webhook_retries"),
            t("webhook_failed"),
            t("proxy_passed"),
            t("proxy_errored"),
            t("proxy_held"),
        );
    }
    if !summary.faults.is_empty() {
        println!(
            "{:<18} {:>8} {:>10} {:>24} {:>24} {:>18}",
            "fault",
            "injected",
            "recovered",
            "outage p50/max ms",
            "recovery p50/max ms",
            "inbox hits p50/max"
        );
        for (name, f) in &summary.faults {
            println!(
                "{:<18} {:>8} {:>10} {:>24} {:>24} {:>18}",
                name,
                show(f.injected),
                show(f.recovered),
                pair(&f.outage_ms),
                pair(&f.recovery_ms),
                pair(&f.inbox_hits)
            );
        }
        for r in summary.fault_log.iter().filter(|r| r.note.is_some()) {
            println!(
                "  at {} ms {}: {}, outage {} ms, recovery {} ms, inbox hits {}",
                r.injected_ms,
                r.fault.as_str(),
                r.note.as_deref().unwrap_or_default(),
                show(r.outage_ms),
                show(r.recovery_ms),
                show(r.inbox_hits)
            );
        }
    }
    println!(
        "(counters are summed over process lives from 250 ms scrapes: lower bounds; recon is the proof)"
    );
    println!(
        "result: {} (recon exit {}); summary: {}",
        summary.result.as_str(),
        summary.recon_exit,
        path.display()
    );
}

/// A number as the table shows it: `-` for none (or not finite), whole
/// numbers without a fraction, others as JSON writes them.
fn show(v: impl Into<Value>) -> String {
    match v.into() {
        Value::Null => "-".into(),
        Value::Number(n) => n
            .as_f64()
            .filter(|f| f.fract() == 0.0)
            .map(|f| format!("{f:.0}"))
            .unwrap_or_else(|| n.to_string()),
        other => other.to_string(),
    }
}

fn percentile(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

#[cfg(test)]
mod tests;
