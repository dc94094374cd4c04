//! Infrastructure faults (`--fault`): PostgreSQL crashed, the PostgreSQL
//! cluster's primary lost or switched over, its synchronous standby lost, one Kafka node
//! killed, two of three killed (quorum loss), one paused out of the ISR, the
//! relay hung, the consumer group's offsets reset, the payments group
//! scaled; and the network's: a Kafka node partitioned from the others,
//! latency and loss between the services and the nodes, a relay cut off
//! from the nodes, a payments instance cut off from PostgreSQL. One at a
//! time, in turn, while the load runs. Chaos does not restart the services for them
//! (offset-reset excepted, see [`Fault::OffsetReset`]): the point is that
//! they recover by themselves. Each fault is recorded with its outage (from
//! the injection to the component being back) and its recovery (from the
//! injection until every service's work counter moved again: of a service
//! run as several instances, one instance's is enough, since one may have no
//! work of its own, a consumer without partitions or a relay without shards).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use pipeline::contract::ServiceName;
use rand::Rng;
use serde::Serialize;
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::cgroup::Groups;
use crate::config::Config;
use crate::fault::Fault;
use crate::netlag::{DelayLine, Lag};
use crate::proxy::{Mode as ProxyMode, Proxy};
use crate::supervisor::Supervisor;

/// The project's Kafka tool (crates/effectively), which offset-reset runs.
pub const KAFKA_TOOL: &str = "kafka-tool";

/// How long a fault's recovery is waited for before the next fault anyway.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(120);

/// One injected fault.
#[derive(Debug, Clone, Serialize)]
pub struct FaultRecord {
    /// Which fault.
    pub fault: Fault,
    /// Milliseconds since the run started, at the injection.
    pub injected_ms: u64,
    /// Injection → the component is back (restarted, continued, reset).
    pub outage_ms: Option<u64>,
    /// Injection → every service's work counter moved again after the
    /// component was back; absent if that did not happen within
    /// [`RECOVERY_TIMEOUT`] or before the load ended.
    pub recovery_ms: Option<u64>,
    /// Why the fault could not be injected, if it could not.
    pub error: Option<String>,
    /// What the fault did, when it says more than its name (payments-scale:
    /// `payments 6 -> 2`).
    pub note: Option<String>,
    /// Messages payments found already in the inbox (re-reads and
    /// redeliveries, injected duplicates included) from the injection until
    /// the pipeline moved again; absent if it did not.
    pub inbox_hits: Option<u64>,
    /// Injection → the PostgreSQL cluster whole again after one of its
    /// faults (`SCRIPT pg check`, after the recovery: the node the fault took
    /// away streaming, rewound or re-cloned, so no fault leaves the next one
    /// a cluster a node short); absent for other faults and runs without the
    /// cluster.
    pub whole_ms: Option<u64>,
}

/// What the faults act on besides the services: the webhook proxy
/// (`--transport http`) and the instances' cgroups (relay-cut,
/// payments-db-cut).
#[derive(Clone, Default)]
pub struct Levers {
    /// Chaos's proxy in front of the webhook receiver.
    pub proxy: Option<Arc<Proxy>>,
    /// One cgroup per instance.
    pub groups: Option<Arc<Groups>>,
}

/// Injects `config.fault` in turn until `faults` is cancelled or
/// `--fault-count` faults were injected; returns what happened. `bin_dir`
/// holds `kafka-tool` (offset-reset runs it).
pub async fn run(
    config: Config,
    bin_dir: PathBuf,
    supervisors: Vec<Arc<Supervisor>>,
    levers: Levers,
    t0: Instant,
    faults: CancellationToken,
) -> Vec<FaultRecord> {
    let mut records = Vec::new();
    let kinds = config.fault.clone();
    if kinds.is_empty() {
        return records;
    }
    let network = kinds.iter().any(|f| f.is_network());
    // The PostgreSQL cluster's run: after each fault of the database, `pg check`.
    let cluster = kinds.iter().any(|f| f.needs_pg_cluster());
    if network {
        // What a chaos killed mid-fault may have left.
        heal(&config.stack_script).await;
    }
    let payments: Vec<Arc<Supervisor>> = supervisors
        .iter()
        .filter(|s| s.name() == ServiceName::Payments)
        .cloned()
        .collect();
    let inbox_hits = || -> f64 { payments.iter().map(|s| s.total("inbox_hits")).sum() };
    for i in 0.. {
        if config.fault_count.is_some_and(|n| i >= n) {
            break;
        }
        let pause =
            rand::rng().random_range(config.fault_interval_ms.0..=config.fault_interval_ms.1);
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(pause)) => {}
            () = faults.cancelled() => break,
        }
        let fault = kinds[(i as usize) % kinds.len()];
        // How many of this kind came before (payments-scale takes its steps in turn).
        let round = records
            .iter()
            .filter(|r: &&FaultRecord| r.fault == fault)
            .count();
        let injected = Instant::now();
        let hits_before = inbox_hits();
        let mut record = FaultRecord {
            fault,
            injected_ms: t0.elapsed().as_millis() as u64,
            outage_ms: None,
            recovery_ms: None,
            error: None,
            note: None,
            inbox_hits: None,
            whole_ms: None,
        };
        tracing::info!(fault = fault.as_str(), "injecting");
        eprintln!("chaos: fault {}", fault.as_str());
        match inject(&config, &bin_dir, &supervisors, &levers, fault, round).await {
            Ok(note) => {
                record.note = note;
                record.outage_ms = Some(injected.elapsed().as_millis() as u64);
                let marks: Vec<(usize, f64)> =
                    supervisors.iter().map(|s| s.progress_mark()).collect();
                let deadline = Instant::now() + RECOVERY_TIMEOUT;
                loop {
                    if every_service_moved(
                        supervisors
                            .iter()
                            .zip(&marks)
                            .map(|(s, mark)| (s.name(), s.moved_since(*mark))),
                    ) {
                        record.recovery_ms = Some(injected.elapsed().as_millis() as u64);
                        record.inbox_hits = Some((inbox_hits() - hits_before).max(0.0) as u64);
                        break;
                    }
                    if Instant::now() > deadline || faults.is_cancelled() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                // Outside the outage and the recovery: the pipeline runs on
                // the primary meanwhile, and a stall there is the pipeline's.
                if cluster && fault.touches_pg() {
                    match stack_run(&config.stack_script, &["pg", "check"]).await {
                        Ok(said) => {
                            record.whole_ms = Some(injected.elapsed().as_millis() as u64);
                            record.note = Some(match record.note.take() {
                                Some(note) => format!("{note}; {said}"),
                                None => said,
                            });
                        }
                        Err(error) => {
                            tracing::error!(
                                fault = fault.as_str(),
                                error = format!("{error:#}"),
                                "the cluster not whole after the fault"
                            );
                            record.error =
                                Some(format!("the cluster not whole after it: {error:#}"));
                        }
                    }
                }
            }
            Err(error) => {
                tracing::error!(
                    fault = fault.as_str(),
                    error = format!("{error:#}"),
                    "fault not injected"
                );
                record.error = Some(format!("{error:#}"));
            }
        }
        records.push(record);
    }
    if network {
        heal(&config.stack_script).await;
    }
    records
}

/// Before a run with the PostgreSQL cluster's faults or network faults:
/// whether the stack can make them (`SCRIPT pg check`: the cluster up with
/// every replica streaming; `SCRIPT net check [netns]`: root, iptables, and
/// the Kafka nodes in network namespaces for broker-partition and net-lag).
pub async fn preflight(config: &Config) -> anyhow::Result<()> {
    if config.fault.iter().any(|f| f.needs_pg_cluster()) {
        // A primary and every replica streaming (`SCRIPT pg check`).
        stack_run(&config.stack_script, &["pg", "check"]).await?;
    }
    if !config.fault.iter().any(|f| f.is_network()) {
        return Ok(());
    }
    let netns = config.fault.iter().any(|f| f.needs_netns());
    let mut args = vec!["net", "check"];
    args.extend(netns.then_some("netns"));
    stack_run(&config.stack_script, &args).await.map(drop)
}

/// `SCRIPT net heal`: no network fault rule left; a failure is only logged.
async fn heal(script: &Path) {
    if let Err(error) = stack_run(script, &["net", "heal"]).await {
        tracing::warn!(error = format!("{error:#}"), "net heal");
    }
}

async fn inject(
    config: &Config,
    bin_dir: &Path,
    supervisors: &[Arc<Supervisor>],
    levers: &Levers,
    fault: Fault,
    round: usize,
) -> anyhow::Result<Option<String>> {
    let net_ms = config.net_fault_ms.to_string();
    let instances = |name: ServiceName| -> Vec<&Arc<Supervisor>> {
        supervisors.iter().filter(|s| s.name() == name).collect()
    };
    match fault {
        Fault::PgCrash => stack_crash(&config.stack_script, "postgres", config.fault_down_ms)
            .await
            .map(|()| None),
        // They say which node was lost and which took over.
        Fault::PgFailover
        | Fault::PgLaggedFailover
        | Fault::PgSwitchover
        | Fault::PgStandbyLoss
        | Fault::PgPartition => {
            let down = config.fault_down_ms.to_string();
            let lag = config.pg_lag_ms.to_string();
            let cut = config.pg_partition_ms.to_string();
            let args: &[&str] = match fault {
                Fault::PgFailover => &["pg", "failover", &down],
                Fault::PgLaggedFailover => &["pg", "failover", &down, &lag],
                Fault::PgSwitchover => &["pg", "switchover"],
                Fault::PgPartition => &["pg", "partition", &cut],
                _ => &["pg", "standby-loss", &down],
            };
            stack_run(&config.stack_script, args)
                .await
                .map(|said| (!said.is_empty()).then_some(said))
        }
        Fault::BrokerKill => stack_crash(&config.stack_script, "broker", config.fault_down_ms)
            .await
            .map(|()| None),
        Fault::BrokerQuorumLoss => {
            stack_crash(&config.stack_script, "quorum", config.fault_down_ms)
                .await
                .map(|()| None)
        }
        Fault::BrokerPause => stack_run(
            &config.stack_script,
            &["pause", "broker", &config.broker_pause_ms.to_string()],
        )
        .await
        .map(|_| None),
        Fault::RelayPause => {
            // One relay, drawn among the instances; between two lives (a
            // crash point just fired) there is none to stop: wait for the next.
            let relays = instances(ServiceName::Relay);
            if relays.is_empty() {
                bail!("no relay in this run");
            }
            let relay = relays[rand::rng().random_range(0..relays.len())];
            let deadline = Instant::now() + Duration::from_secs(30);
            let pid = loop {
                if let Some(pid) = relay.signal(Signal::SIGSTOP) {
                    tracing::info!(relay = relay.label(), pid, "relay-pause: SIGSTOP");
                    break pid;
                }
                if Instant::now() > deadline {
                    bail!("no relay was running for 30 s");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            tokio::time::sleep(Duration::from_millis(config.relay_pause_ms)).await;
            // The same process (it may have been killed meanwhile: then the
            // supervisor has started another, which was never stopped).
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGCONT);
            Ok((relays.len() > 1).then(|| relay.label().to_owned()))
        }
        Fault::OffsetReset => {
            // The group must be empty for its offsets to be reset: every
            // payments instance stops.
            let payments = instances(ServiceName::Payments);
            stop_all(&payments, Fault::OffsetReset).await?;
            let reset = reset_offsets(&bin_dir.join(KAFKA_TOOL), &config.payments_group).await;
            release_all(&payments);
            reset.map(|()| None)
        }
        Fault::PaymentsScale => {
            let target = usize::from(config.payments_scale_step(round));
            scale_payments(
                &instances(ServiceName::Payments),
                target,
                f64::from(config.partitions),
            )
            .await
            .map(Some)
        }
        Fault::ReceiverDown => {
            let payments = instances(ServiceName::Payments);
            stop_all(&payments, Fault::ReceiverDown).await?;
            tokio::time::sleep(Duration::from_millis(config.fault_down_ms)).await;
            release_all(&payments);
            Ok(None)
        }
        Fault::ReceiverErrors | Fault::ReceiverSlow => {
            let proxy = levers
                .proxy
                .as_deref()
                .context("no webhook proxy (--transport http)")?;
            proxy.set(if fault == Fault::ReceiverErrors {
                ProxyMode::Errors
            } else {
                ProxyMode::Slow
            });
            tokio::time::sleep(Duration::from_millis(config.fault_down_ms)).await;
            proxy.set(ProxyMode::Pass);
            Ok(None)
        }
        // It says which node it cut off.
        Fault::BrokerPartition => stack_run(&config.stack_script, &["net", "partition", &net_ms])
            .await
            .map(|said| (!said.is_empty()).then_some(said)),
        Fault::NetLag => net_lag(config).await.map(Some),
        Fault::RelayCut | Fault::PaymentsDbCut => {
            let (service, target) = if fault == Fault::RelayCut {
                (ServiceName::Relay, "brokers")
            } else {
                (ServiceName::Payments, "postgres")
            };
            let groups = levers
                .groups
                .as_deref()
                .context("the instances run in no cgroup of their own")?;
            let victim = busy_one(&instances(service)).await?;
            let group = groups.path(victim.label());
            stack_run(
                &config.stack_script,
                &["net", "cut", &group, target, &net_ms],
            )
            .await?;
            Ok(Some(format!("{} cut off from {target}", victim.label())))
        }
    }
}

/// One of `instances` that worked in the last second (its work counter
/// moved: a relay holding shard leases, a consumer with partitions), drawn at
/// random; any running one when none did.
async fn busy_one<'a>(instances: &[&'a Arc<Supervisor>]) -> anyhow::Result<&'a Arc<Supervisor>> {
    if instances.is_empty() {
        bail!("no such service in this run");
    }
    let marks: Vec<(usize, f64)> = instances.iter().map(|s| s.progress_mark()).collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let busy: Vec<&Arc<Supervisor>> = instances
        .iter()
        .zip(&marks)
        .filter(|(s, mark)| s.moved_since(**mark))
        .map(|(s, _)| *s)
        .collect();
    let pool = if busy.is_empty() {
        instances.to_vec()
    } else {
        busy
    };
    Ok(pool[rand::rng().random_range(0..pool.len())])
}

/// net-lag: the delay line on `--net-queue`, the stack's rule that feeds it
/// for `--net-fault-ms`, then the rule off and the line stopped. Says the
/// draw and what the line did.
async fn net_lag(config: &Config) -> anyhow::Result<String> {
    let (rtt_ms, loss_pct) = {
        let mut rng = rand::rng();
        (
            rng.random_range(config.net_delay_ms.0..=config.net_delay_ms.1),
            rng.random_range(config.net_loss_pct.0..=config.net_loss_pct.1),
        )
    };
    let lag = Lag {
        one_way: Duration::from_millis(rtt_ms) / 2,
        loss: loss_pct as f64 / 100.0,
    };
    let queue = config.net_queue.to_string();
    let line = DelayLine::start(config.net_queue, lag)
        .with_context(|| format!("bind NFQUEUE {queue} (root only, one reader per queue)"))?;
    let script = &config.stack_script;
    let on = stack_run(script, &["net", "lag", "on", &queue]).await;
    if on.is_ok() {
        tokio::time::sleep(Duration::from_millis(config.net_fault_ms)).await;
    }
    let off = stack_run(script, &["net", "lag", "off", &queue]).await;
    let stats = tokio::task::spawn_blocking(move || line.stop())
        .await
        .context("the delay line's thread")?
        .context("the delay line")?;
    on?;
    off?;
    Ok(format!(
        "round trip +{rtt_ms} ms, loss {loss_pct}% each way: {} packets held and passed, {} \
         dropped, at most {} held at once",
        stats.passed, stats.dropped, stats.most_held
    ))
}

/// Waits until the group has settled (its running members own all
/// `partitions`, each its share: a member killed just before may still hold
/// some), runs the first `target` of the payments instances and stops the
/// rest (SIGTERM: each commits what it applied and leaves the group), then
/// waits until the group has settled again on the running members: the
/// step's outage, within which the moved partitions spent some time without
/// a consumer. Says `payments N -> M`.
async fn scale_payments(
    payments: &[&Arc<Supervisor>],
    target: usize,
    partitions: f64,
) -> anyhow::Result<String> {
    let (run, stop) = payments.split_at(target.min(payments.len()));
    // Settled: every member of `set` runs and has been scraped (not between
    // two lives: a member rejoining after a kill is a rebalance in progress),
    // together they own every partition, and each its share (one at least,
    // while there are no more members than partitions).
    let settled = |set: &[&Arc<Supervisor>]| {
        let owned: Vec<f64> = set.iter().filter_map(|s| s.owned_partitions()).collect();
        let total: f64 = owned.iter().sum();
        let shared = owned.len() as f64 > partitions || owned.iter().all(|&o| o >= 1.0);
        (
            owned.len() == set.len() && total >= partitions && shared,
            total,
        )
    };
    let live: Vec<&Arc<Supervisor>> = payments.iter().copied().filter(|s| !s.held()).collect();
    wait_for(|| settled(&live), "before the step").await?;
    let from = payments.iter().filter(|s| s.ready()).count();
    release_all(run);
    if !stop.is_empty() {
        stop_all(stop, Fault::PaymentsScale).await?;
    }
    let step = format!("payments {from} -> {}", run.len());
    wait_for(|| settled(run), &step).await?;
    Ok(step)
}

/// Polls `settled` (whether, and how many partitions the members own) until
/// it holds, at most [`RECOVERY_TIMEOUT`]; the error says `when`.
async fn wait_for(settled: impl Fn() -> (bool, f64), when: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + RECOVERY_TIMEOUT;
    loop {
        let (done, owned) = settled();
        if done {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{when}: the running payments members own {owned} partitions after {} s, not all \
                 (--partitions)",
                RECOVERY_TIMEOUT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether every service worked since a fault: `moved` holds, per instance,
/// its service and whether its work counter moved; a service moved when one
/// of its instances did.
fn every_service_moved(moved: impl IntoIterator<Item = (ServiceName, bool)>) -> bool {
    let moved: Vec<(ServiceName, bool)> = moved.into_iter().collect();
    ServiceName::ALL.iter().all(|&name| {
        let mut of = moved.iter().filter(|(s, _)| *s == name).peekable();
        of.peek().is_none() || of.any(|&(_, did)| did)
    })
}

/// Stops every one of `instances` for `fault` (SIGTERM, no next life until
/// [`release_all`]); on a failure releases them all again.
async fn stop_all(instances: &[&Arc<Supervisor>], fault: Fault) -> anyhow::Result<()> {
    if instances.is_empty() {
        bail!("no such service in this run");
    }
    let stopped = futures::future::join_all(
        instances
            .iter()
            .map(|s| s.stop_for(fault.as_str(), Duration::from_secs(30))),
    )
    .await;
    if let Some(late) = stopped.iter().position(|ok| !ok) {
        release_all(instances);
        bail!("{} did not stop within 30 s", instances[late].label());
    }
    Ok(())
}

fn release_all(instances: &[&Arc<Supervisor>]) {
    for s in instances {
        s.release();
    }
}

/// `SCRIPT crash WHAT DOWN_MS`: the stack's own way to crash and restart one
/// component.
async fn stack_crash(script: &Path, what: &str, down_ms: u64) -> anyhow::Result<()> {
    stack_run(script, &["crash", what, &down_ms.to_string()])
        .await
        .map(drop)
}

/// `SCRIPT ARGS…`: one of the stack's fault commands; what it printed on its
/// standard output, trimmed; an error carries its standard error.
async fn stack_run(script: &Path, args: &[&str]) -> anyhow::Result<String> {
    let command = args.join(" ");
    let output = Command::new(script)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("run {} {command}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{} {command}: {}: {}",
            script.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// `kafka-tool offsets committed-past --group GROUP` into OUT/committed-past.tsv:
/// every message of `KAFKA_TOPIC` the group has committed past, for `recon
/// --committed-past`. `None` (with a warning: recon then checks without it)
/// when the tool is not beside chaos or fails.
pub async fn committed_past(bin_dir: &Path, group: &str, out: &Path) -> Option<PathBuf> {
    let tool = bin_dir.join(KAFKA_TOOL);
    if !tool.is_file() {
        tracing::warn!(
            tool = %tool.display(),
            "no kafka-tool beside chaos: recon runs without the committed-offsets check"
        );
        return None;
    }
    let output = Command::new(&tool)
        .args([
            "offsets",
            "committed-past",
            "--group",
            group,
            "--timeout",
            "120s",
        ])
        .kill_on_drop(true)
        .output()
        .await;
    let path = out.join("committed-past.tsv");
    match output {
        Ok(o) if o.status.success() => match std::fs::write(&path, &o.stdout) {
            Ok(()) => Some(path),
            Err(error) => {
                tracing::warn!(error = %error, path = %path.display(), "write the committed-past list");
                None
            }
        },
        Ok(o) => {
            tracing::warn!(
                status = %o.status,
                stderr = %String::from_utf8_lossy(&o.stderr).trim(),
                "kafka-tool offsets committed-past failed: recon runs without the committed-offsets check"
            );
            None
        }
        Err(error) => {
            tracing::warn!(error = %error, "run kafka-tool offsets committed-past");
            None
        }
    }
}

/// `kafka-tool offsets reset --group GROUP --to earliest --wait 60s`: commits
/// the earliest offset of every partition of `KAFKA_TOPIC` as `group`'s, so
/// the group, empty now, redelivers everything when payments joins again. The
/// tool refuses a group with live members; a broker that still counts the
/// stopped member (until its session expires) gets up to a minute to let it
/// go. The tool takes the broker and topic from the environment
/// (`KAFKA_BOOTSTRAP_SERVERS`, `KAFKA_TOPIC`), as the services do.
async fn reset_offsets(kafka_tool: &Path, group: &str) -> anyhow::Result<()> {
    let output = Command::new(kafka_tool)
        .args(["offsets", "reset", "--group", group, "--to", "earliest"])
        .args(["--wait", "60s"])
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("run {}", kafka_tool.display()))?;
    if !output.status.success() {
        bail!(
            "reset the offsets of group {group}: {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_moved_when_one_of_its_instances_did() {
        use ServiceName::{Orders, Payments, Relay};
        assert!(every_service_moved([
            (Orders, true),
            (Relay, true),
            (Payments, true)
        ]));
        assert!(!every_service_moved([
            (Orders, true),
            (Relay, false),
            (Payments, true)
        ]));
        // Three payments instances, one with no partition of its own.
        let mut moved = vec![(Orders, true), (Relay, true)];
        moved.extend([(Payments, false), (Payments, true), (Payments, false)]);
        assert!(every_service_moved(moved.clone()));
        moved[3].1 = false;
        assert!(!every_service_moved(moved));
        // Two relays, neither moved.
        assert!(!every_service_moved([
            (Orders, true),
            (Relay, false),
            (Relay, false),
            (Payments, true)
        ]));
    }
}
