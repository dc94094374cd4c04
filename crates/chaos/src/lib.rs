//! Chaos: the pipeline under load, duplicate delivery and kill -9, then
//! recon's proof (DESIGN.md §6).
//!
//! Chaos runs orders, relay and payments as child processes (binaries never
//! depend on each other, so chaos talks to them only through processes,
//! environment, signals and `/metrics`), drives load with `loadgen`, and
//! injects three kinds of fault while the load runs:
//!
//! * crash points: the owning service is started with `CRASH_POINT=…` and
//!   SIGKILLs itself there (`publish`, `effect`, `claim`, `commit`, `split`);
//! * random kills: chaos SIGKILLs a named service at random moments;
//! * duplicate delivery: payments is started with `PAYMENTS_DUP_RATE`;
//! * infrastructure faults ([`faults`]): PostgreSQL crashed, the broker
//!   killed, the relay hung, the group's offsets reset — after which the
//!   services must recover by themselves.
//!
//! Every death is followed by a restart. When the load ends, the faults stop
//! (later lives start unarmed, random kills end), recon waits for the
//! pipeline to drain and runs the diff. Chaos's exit status is recon's.

pub mod config;
pub mod faults;
pub mod scrape;
pub mod supervisor;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use effectively::contract::{ServiceName, UNSAFE_SPLIT_TXN_ENV};
use effectively::db::ServiceRole;
use rand::Rng;
use serde_json::{Value, json};
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

pub use crate::config::Config;
use crate::supervisor::{Spec, Supervisor};

/// Exit status for chaos's own errors (recon uses 0 clean, 1 drift, 2 error).
pub const EXIT_ERROR: u8 = 2;

const BINARIES: [&str; 5] = ["orders", "relay", "payments", "loadgen", "recon"];

/// Runs one chaos experiment; returns the exit status (recon's).
pub async fn run(config: Config, interrupt: CancellationToken) -> anyhow::Result<u8> {
    config.validate().map_err(anyhow::Error::msg)?;
    if std::env::var_os("DATABASE_URL").is_none() {
        bail!(
            "DATABASE_URL is not set (the services and recon need it; `. .stack/env` after `make up`)"
        );
    }
    let bin_dir = match &config.bin_dir {
        Some(dir) => dir.clone(),
        None => std::env::current_exe()
            .context("find this executable")?
            .parent()
            .map(Path::to_path_buf)
            .context("executable has no directory")?,
    };
    for b in BINARIES {
        let p = bin_dir.join(b);
        if !p.is_file() {
            bail!(
                "{} not found (build the workspace, or pass --bin-dir)",
                p.display()
            );
        }
    }
    std::fs::create_dir_all(&config.out)
        .with_context(|| format!("create {}", config.out.display()))?;
    let out = config.out.canonicalize().context("resolve --out")?;
    for name in ServiceName::ALL {
        // Every life appends to its service's log; a new run starts it afresh.
        let _ = std::fs::remove_file(out.join(format!("{}.log", name.as_str())));
    }

    let t0 = Instant::now();
    let calm = Arc::new(AtomicBool::new(false));
    let stop = CancellationToken::new();
    let supervisors: Vec<Arc<Supervisor>> = ServiceName::ALL
        .iter()
        .map(|&name| {
            Arc::new(Supervisor::new(
                spec(&config, &bin_dir, &out, name),
                calm.clone(),
                t0,
            ))
        })
        .collect();
    print_plan(&config, &out);

    let mut tasks = Vec::new();
    for s in &supervisors {
        tasks.push(tokio::spawn(s.clone().run(stop.clone())));
    }
    let scraper = tokio::spawn(scrape_loop(supervisors.clone(), stop.clone()));

    let outcome = drive(&config, &bin_dir, &out, &supervisors, &calm, &interrupt, t0).await;

    // Last counters, then stop every service gracefully.
    let client = http_client()?;
    for s in &supervisors {
        s.scrape(&client).await;
    }
    stop.cancel();
    for t in tasks {
        match t.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::error!(%error, "supervisor failed"),
            Err(error) => tracing::error!(%error, "supervisor panicked"),
        }
    }
    let _ = scraper.await;

    let (recon_code, load, interrupted, fault_records) = match outcome {
        Ok(o) => o,
        Err(error) => {
            eprintln!("chaos: error: {error:#}");
            (EXIT_ERROR, Value::Null, false, Vec::new())
        }
    };
    let summary = summarize(
        &config,
        &out,
        &supervisors,
        Run {
            load,
            recon_code,
            interrupted,
            faults: fault_records,
        },
        t0,
    );
    let path = config
        .json
        .clone()
        .unwrap_or_else(|| out.join("chaos.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("write {}", path.display()))?;
    print_summary(&summary, &path);
    Ok(recon_code)
}

/// What [`drive`] returns: recon's exit status, loadgen's JSON report,
/// whether the run was interrupted, the infrastructure faults injected.
type Outcome = (u8, Value, bool, Vec<faults::FaultRecord>);

/// Start-up, load with faults, calm drain, recon.
async fn drive(
    config: &Config,
    bin_dir: &Path,
    out: &Path,
    supervisors: &[Arc<Supervisor>],
    calm: &AtomicBool,
    interrupt: &CancellationToken,
    t0: Instant,
) -> anyhow::Result<Outcome> {
    let deadline = Instant::now() + Duration::from_secs(config.ready_timeout);
    while !supervisors.iter().all(|s| s.ready()) {
        if Instant::now() > deadline {
            let late: Vec<&str> = supervisors
                .iter()
                .filter(|s| !s.ready())
                .map(|s| s.name().as_str())
                .collect();
            bail!(
                "not ready within {} s: {late:?}; see their logs in {}",
                config.ready_timeout,
                out.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("chaos: services ready; load and faults on");

    let faults = CancellationToken::new();
    let killer = (!config.random_kill.is_empty()).then(|| {
        let targets: Vec<Arc<Supervisor>> = supervisors
            .iter()
            .filter(|s| config.random_kill.contains(&s.name()))
            .cloned()
            .collect();
        tokio::spawn(random_kills(
            targets,
            config.kill_interval_ms,
            faults.clone(),
        ))
    });
    let injector = tokio::spawn(faults::run(
        config.clone(),
        supervisors.to_vec(),
        t0,
        faults.clone(),
    ));

    let mut load = Command::new(bin_dir.join("loadgen"));
    load.args(loadgen_args(config, out)).kill_on_drop(true);
    let mut child = load.spawn().context("start loadgen")?;
    let status = tokio::select! {
        s = child.wait() => Some(s.context("wait for loadgen")?),
        () = interrupt.cancelled() => None,
    };
    calm.store(true, Ordering::SeqCst);
    faults.cancel();
    if let Some(k) = killer {
        let _ = k.await;
    }
    // A fault in progress finishes (PostgreSQL or the broker back up, the
    // relay continued, payments released) before anything else.
    let fault_records = injector.await.unwrap_or_default();
    let Some(status) = status else {
        let _ = child.kill().await;
        eprintln!("chaos: interrupted; stopping the services");
        return Ok((
            EXIT_ERROR,
            read_json(&out.join("loadgen.json")),
            true,
            fault_records,
        ));
    };
    eprintln!(
        "chaos: load done (loadgen exit {}); faults off, waiting up to {} s for the pipeline to drain",
        status.code().unwrap_or(-1),
        config.drain_timeout
    );

    let recon = bin_dir.join("recon");
    let intents = out.join("intents.txt");
    let recon_url = role_database_url(ServiceRole::Recon);
    let mut table = Command::new(&recon);
    table
        .envs(recon_url.clone())
        .arg("--wait-drained")
        .arg(config.drain_timeout.to_string())
        .arg("--intents")
        .arg(&intents)
        .kill_on_drop(true);
    let code = tokio::select! {
        s = table.status() => s.context("run recon")?.code().unwrap_or(i32::from(EXIT_ERROR)),
        () = interrupt.cancelled() => return Ok((EXIT_ERROR, read_json(&out.join("loadgen.json")), true, fault_records)),
    };
    // The same diff as JSON for the summary (read-only; drained already).
    let json_out = Command::new(&recon)
        .envs(recon_url)
        .arg("--json")
        .arg("--intents")
        .arg(&intents)
        .output()
        .await
        .context("run recon --json")?;
    std::fs::write(out.join("recon.json"), &json_out.stdout).context("write recon.json")?;
    Ok((
        u8::try_from(code).unwrap_or(EXIT_ERROR),
        read_json(&out.join("loadgen.json")),
        false,
        fault_records,
    ))
}

fn read_json(path: &Path) -> Value {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null)
}

/// The client for the services' `/metrics` (readiness and scrapes): a short
/// timeout, so a dying process never stalls a supervisor or the scraper.
fn http_client() -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .context("http client")
}

/// `DATABASE_URL` for a child running as `role`: the role's own URL
/// (`ORDERS_DATABASE_URL`, ...) when chaos was given one; else nothing, and
/// the child inherits chaos's DATABASE_URL.
fn role_database_url(role: ServiceRole) -> Option<(String, String)> {
    std::env::var(role.url_var())
        .ok()
        .map(|url| ("DATABASE_URL".to_owned(), url))
}

fn spec(config: &Config, bin_dir: &Path, out: &Path, name: ServiceName) -> Spec {
    let rust_log = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    let mut env = vec![("RUST_LOG".to_owned(), rust_log)];
    env.extend(role_database_url(match name {
        ServiceName::Orders => ServiceRole::Orders,
        ServiceName::Relay => ServiceRole::Relay,
        ServiceName::Payments => ServiceRole::Payments,
    }));
    let mut armed_env = Vec::new();
    let s = |a: &dyn ToString| a.to_string();
    match name {
        ServiceName::Orders => {
            env.push(("ORDERS_HTTP_ADDR".into(), s(&config.http_addr)));
            env.push(("ORDERS_GRPC_ADDR".into(), s(&config.grpc_addr)));
        }
        ServiceName::Relay => {
            env.push(("RELAY_METRICS_ADDR".into(), s(&config.relay_metrics_addr)));
            if config.fault.contains(&config::Fault::RelayPause) {
                // The pause must outlast the relay's session limits.
                env.push((
                    "DB_IDLE_IN_TRANSACTION_TIMEOUT_MS".into(),
                    s(&(config.relay_pause_ms / 2)),
                ));
                env.push((
                    "RELAY_MESSAGE_TIMEOUT_MS".into(),
                    s(&(config.relay_pause_ms / 4)),
                ));
            }
        }
        ServiceName::Payments => {
            env.push((
                "PAYMENTS_METRICS_ADDR".into(),
                s(&config.payments_metrics_addr),
            ));
            if config.static_membership {
                // One id for every life of this run, unique to this run.
                env.push((
                    "PAYMENTS_GROUP_INSTANCE_ID".into(),
                    format!("chaos-payments-{}", std::process::id()),
                ));
            }
            if let Some(split) = config.unsafe_split_txn {
                env.push((UNSAFE_SPLIT_TXN_ENV.into(), split.as_str().into()));
            }
            if config.dup_rate > 0.0 {
                armed_env.push(("PAYMENTS_DUP_RATE".into(), s(&config.dup_rate)));
                armed_env.push(("PAYMENTS_DUP_KIND".into(), config.dup_kind.clone()));
            }
        }
    }
    let crash_point = config.crash_points_of(name);
    if let Some(points) = &crash_point {
        armed_env.push(("CRASH_POINT".into(), points.clone()));
        if let Some(every) = config.crash_every {
            armed_env.push(("CRASH_EVERY".into(), s(&every)));
        }
        armed_env.push(("CRASH_PROBABILITY".into(), s(&config.crash_probability)));
    }
    Spec {
        name,
        program: bin_dir.join(name.as_str()),
        env,
        armed_env,
        crash_point,
        crash_marker: out.join(format!("{}.crash-point", name.as_str())),
        metrics_url: config.metrics_url(name),
        log: out.join(format!("{}.log", name.as_str())),
        ready_timeout: Duration::from_secs(config.ready_timeout),
    }
}

fn loadgen_args(config: &Config, out: &Path) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "--http-url".into(),
        format!("http://{}", config.http_addr),
        "--grpc-url".into(),
        format!("http://{}", config.grpc_addr),
        "--rate".into(),
        config.rate.to_string(),
        "--duration".into(),
        config.duration.to_string(),
        "--retry-rate".into(),
        config.retry_rate.to_string(),
        "--protocol".into(),
        config.protocol.clone(),
        "--zipf-s".into(),
        config.zipf_s.to_string(),
        "--json".into(),
        path_arg(&out.join("loadgen.json")),
        "--csv".into(),
        path_arg(&out.join("loadgen.csv")),
        "--intents".into(),
        path_arg(&out.join("intents.txt")),
    ];
    if let Some(seed) = config.seed {
        args.push("--seed".into());
        args.push(seed.to_string());
    }
    args.extend(config.loadgen_args.iter().cloned());
    args
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

async fn scrape_loop(supervisors: Vec<Arc<Supervisor>>, stop: CancellationToken) {
    let Ok(client) = http_client() else { return };
    loop {
        for s in &supervisors {
            s.scrape(&client).await;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
            () = stop.cancelled() => return,
        }
    }
}

/// SIGKILLs one of `targets` (chosen uniformly) after each pause drawn from
/// `interval_ms`, until `faults` is cancelled.
async fn random_kills(
    targets: Vec<Arc<Supervisor>>,
    interval_ms: (u64, u64),
    faults: CancellationToken,
) {
    loop {
        let (pause, pick) = {
            let mut rng = rand::rng();
            (
                rng.random_range(interval_ms.0..=interval_ms.1),
                rng.random_range(0..targets.len()),
            )
        };
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(pause)) => {}
            () = faults.cancelled() => return,
        }
        let target = &targets[pick];
        if target.kill_now() {
            tracing::info!(service = target.name().as_str(), "random kill: SIGKILL");
        }
    }
}

fn percentile(sorted: &[u64], q: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

pub(crate) fn stats(mut v: Vec<u64>) -> Value {
    v.sort_unstable();
    json!({
        "count": v.len(),
        "p50": percentile(&v, 0.5),
        "p99": percentile(&v, 0.99),
        "max": v.last(),
    })
}

/// What a run produced besides the services' lives.
struct Run {
    load: Value,
    recon_code: u8,
    interrupted: bool,
    faults: Vec<faults::FaultRecord>,
}

fn summarize(
    config: &Config,
    out: &Path,
    supervisors: &[Arc<Supervisor>],
    run: Run,
    t0: Instant,
) -> Value {
    let Run {
        load,
        recon_code,
        interrupted,
        faults: fault_records,
    } = run;
    let mut services = serde_json::Map::new();
    let mut all_counters: BTreeMap<&'static str, f64> = BTreeMap::new();
    let mut total_kills = 0u64;
    for s in supervisors {
        let lives = s.lives();
        let mut kills: BTreeMap<String, u64> = BTreeMap::new();
        for end in lives.iter().filter_map(|l| l.end.as_ref()) {
            if !matches!(
                end,
                supervisor::End::Stopped | supervisor::End::Fault { .. }
            ) {
                *kills.entry(end.label()).or_insert(0) += 1;
            }
        }
        total_kills += kills
            .iter()
            .filter(|(k, _)| k.starts_with("crash_point") || *k == "random_kill")
            .map(|(_, v)| v)
            .sum::<u64>();
        let counters = scrape::sum_lives(lives.iter().map(|l| &l.counters));
        for (k, v) in &counters {
            *all_counters.entry(k).or_insert(0.0) += v;
        }
        let recovery = supervisor::recoveries(&lives);
        services.insert(
            s.name().as_str().to_owned(),
            json!({
                "lives": lives.len(),
                "restarts": lives.len().saturating_sub(1),
                "deaths": kills,
                "recovery_ms": {
                    "to_ready": stats(recovery.ready_ms),
                    "to_progress": stats(recovery.progress_ms),
                },
                "counters": counters,
                "life_log": lives,
            }),
        );
    }
    let recon = read_json(&out.join("recon.json"));
    json!({
        "schema": "effectively.chaos.v1",
        "interrupted": interrupted,
        "elapsed_s": t0.elapsed().as_secs_f64(),
        "params": {
            "rate": config.rate,
            "duration_s": config.duration,
            "retry_rate": config.retry_rate,
            "protocol": config.protocol,
            "zipf_s": config.zipf_s,
            "seed": config.seed,
            "crash_point": config.crash_point,
            "crash_every": config.crash_every,
            "crash_probability": config.crash_probability,
            "random_kill": config.random_kill,
            "kill_interval_ms": [config.kill_interval_ms.0, config.kill_interval_ms.1],
            "fault": config.fault,
            "fault_interval_ms": [config.fault_interval_ms.0, config.fault_interval_ms.1],
            "fault_count": config.fault_count,
            "fault_down_ms": config.fault_down_ms,
            "relay_pause_ms": config.relay_pause_ms,
            "dup_rate": config.dup_rate,
            "dup_kind": config.dup_kind,
            "unsafe_split_txn": config.unsafe_split_txn,
            "static_membership": config.static_membership,
            "drain_timeout_s": config.drain_timeout,
        },
        "kills_total": total_kills,
        "faults": faults::summary(&fault_records),
        "fault_log": fault_records,
        "services": services,
        "totals": all_counters,
        "injected_duplicates": all_counters.get("injected_reprocess").copied().unwrap_or(0.0)
            + all_counters.get("injected_redeliver").copied().unwrap_or(0.0),
        "load": load,
        "recon": recon,
        "recon_exit": recon_code,
        "result": match recon_code { 0 => "CLEAN", 1 => "DRIFT", _ => "ERROR" },
        "out_dir": path_arg(out),
    })
}

fn print_plan(config: &Config, out: &Path) {
    let mut faults = Vec::new();
    if !config.crash_point.is_empty() {
        let how = match config.crash_every {
            Some(n) if n > 0 => format!("every {n} passes"),
            _ => format!("with p={}", config.crash_probability),
        };
        let points: Vec<String> = config
            .crash_point
            .iter()
            .map(|p| format!("{} ({})", p.as_str(), p.service().as_str()))
            .collect();
        faults.push(format!("crash points {} {how}", points.join(", ")));
    }
    if !config.fault.is_empty() {
        let names: Vec<&str> = config.fault.iter().map(|f| f.as_str()).collect();
        faults.push(format!(
            "infrastructure faults {} in turn every {}..{} ms{}",
            names.join("/"),
            config.fault_interval_ms.0,
            config.fault_interval_ms.1,
            config
                .fault_count
                .map(|n| format!(" (at most {n})"))
                .unwrap_or_default()
        ));
    }
    if !config.random_kill.is_empty() {
        let names: Vec<&str> = config.random_kill.iter().map(|s| s.as_str()).collect();
        faults.push(format!(
            "SIGKILL {} every {}..{} ms",
            names.join("/"),
            config.kill_interval_ms.0,
            config.kill_interval_ms.1
        ));
    }
    if config.dup_rate > 0.0 {
        faults.push(format!(
            "dup-rate {} ({})",
            config.dup_rate, config.dup_kind
        ));
    }
    if let Some(split) = config.unsafe_split_txn {
        faults.push(format!(
            "UNSAFE payments --unsafe-split-txn={}",
            split.as_str()
        ));
    }
    if faults.is_empty() {
        faults.push("none".into());
    }
    eprintln!(
        "chaos: {} intents/s for {} s ({} retried, {}); faults: {}; out: {}",
        config.rate,
        config.duration,
        config.retry_rate,
        config.protocol,
        faults.join(", "),
        out.display()
    );
}

fn print_summary(summary: &Value, path: &Path) {
    println!("\n== chaos summary");
    println!(
        "{:<9} {:>5} {:<44} {:>22} {:>22}",
        "service", "lives", "deaths", "death→ready p50/max ms", "death→work p50/max ms"
    );
    if let Some(services) = summary["services"].as_object() {
        for (name, s) in services {
            let deaths = s["deaths"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .filter(|d| !d.is_empty())
                .unwrap_or_else(|| "-".into());
            let pair = |v: &Value| format!("{}/{}", show(&v["p50"]), show(&v["max"]));
            println!(
                "{:<9} {:>5} {:<44} {:>22} {:>22}",
                name,
                s["lives"],
                deaths,
                pair(&s["recovery_ms"]["to_ready"]),
                pair(&s["recovery_ms"]["to_progress"])
            );
        }
    }
    let t = &summary["totals"];
    println!(
        "injected duplicates: {} (reprocess {}, redeliver {}); inbox hits {}, misses {}; published {}, consumed {}",
        show(&summary["injected_duplicates"]),
        show(&t["injected_reprocess"]),
        show(&t["injected_redeliver"]),
        show(&t["inbox_hits"]),
        show(&t["inbox_misses"]),
        show(&t["published"]),
        show(&t["consumed"]),
    );
    if let Some(faults) = summary["faults"].as_object().filter(|f| !f.is_empty()) {
        println!(
            "{:<13} {:>8} {:>10} {:>24} {:>24}",
            "fault", "injected", "recovered", "outage p50/max ms", "recovery p50/max ms"
        );
        for (name, f) in faults {
            let pair = |v: &Value| format!("{}/{}", show(&v["p50"]), show(&v["max"]));
            println!(
                "{:<13} {:>8} {:>10} {:>24} {:>24}",
                name,
                show(&f["injected"]),
                show(&f["recovered"]),
                pair(&f["outage_ms"]),
                pair(&f["recovery_ms"])
            );
        }
    }
    println!(
        "(counters are summed over process lives from 250 ms scrapes: lower bounds; recon is the proof)"
    );
    println!(
        "result: {} (recon exit {}); summary: {}",
        summary["result"].as_str().unwrap_or("?"),
        summary["recon_exit"],
        path.display()
    );
}

fn show(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::Number(n) => n
            .as_f64()
            .filter(|f| f.fract() == 0.0)
            .map(|f| format!("{f:.0}"))
            .unwrap_or_else(|| n.to_string()),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_small_samples() {
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[7], 0.99), Some(7));
        assert_eq!(percentile(&[1, 2, 3, 4], 0.5), Some(2));
        assert_eq!(percentile(&[1, 2, 3, 4], 0.99), Some(4));
    }

    #[test]
    fn crash_env_goes_to_the_owning_service_only() {
        use clap::Parser;
        let config = Config::try_parse_from([
            "chaos",
            "--crash-point",
            "publish",
            "--crash-every",
            "7",
            "--dup-rate",
            "0.3",
        ])
        .expect("parses");
        let dir = Path::new("/bin");
        let relay = spec(&config, dir, dir, ServiceName::Relay);
        assert!(
            relay
                .armed_env
                .contains(&("CRASH_POINT".into(), "publish".into()))
        );
        assert!(
            relay
                .armed_env
                .contains(&("CRASH_EVERY".into(), "7".into()))
        );
        let payments = spec(&config, dir, dir, ServiceName::Payments);
        assert!(!payments.armed_env.iter().any(|(k, _)| k == "CRASH_POINT"));
        assert!(
            payments
                .armed_env
                .contains(&("PAYMENTS_DUP_RATE".into(), "0.3".into()))
        );
        let orders = spec(&config, dir, dir, ServiceName::Orders);
        assert!(orders.armed_env.is_empty());
    }
}
