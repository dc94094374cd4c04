//! One chaos run: start the services, wait until they are ready, load with
//! faults, the calm drain, recon, then the summary.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use pipeline::db::ServiceRole;
use rand::Rng;
use serde_json::Value;
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use pipeline::contract::ServiceName;

use crate::cgroup::Groups;
use crate::config::{Config, Transport};
use crate::faults;
use crate::proxy::Proxy;
use crate::scrape;
use crate::spec;
use crate::summary::{self, Outcome};
use crate::supervisor::Supervisor;

/// Exit status for chaos's own errors (recon uses 0 clean, 1 drift, 2 error).
pub const EXIT_ERROR: u8 = 2;

const BINARIES: [&str; 5] = ["orders", "relay", "payments", "loadgen", "recon"];

/// Runs one chaos experiment; returns the exit status (recon's).
pub async fn run(mut config: Config, interrupt: CancellationToken) -> anyhow::Result<u8> {
    config.validate().map_err(anyhow::Error::msg)?;
    if config.transport == crate::config::Transport::Http && config.webhook_secret.is_none() {
        config.webhook_secret = Some(effectively::webhook::Secret::generate());
    }
    if std::env::var_os(pipeline::contract::env::DATABASE_URL).is_none() {
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
    let kafka_tool = config
        .fault
        .contains(&crate::fault::Fault::OffsetReset)
        .then_some(faults::KAFKA_TOOL);
    for b in BINARIES.into_iter().chain(kafka_tool) {
        let p = bin_dir.join(b);
        if !p.is_file() {
            bail!(
                "{} not found (build the workspace, or pass --bin-dir)",
                p.display()
            );
        }
    }
    if config.relay_kind == crate::config::RelayKind::Debezium && !config.debezium_script.is_file()
    {
        bail!(
            "--debezium-script {} not found (run chaos from the repository, or pass its path)",
            config.debezium_script.display()
        );
    }
    faults::preflight(&config).await?;
    std::fs::create_dir_all(&config.out)
        .with_context(|| format!("create {}", config.out.display()))?;
    let out = config.out.canonicalize().context("resolve --out")?;
    let instances = config.instances();
    for instance in &instances {
        // Every life appends to its instance's log; a new run starts it afresh.
        let _ = std::fs::remove_file(out.join(format!("{}.log", instance.label())));
    }

    // relay-cut, payments-db-cut: each instance in a cgroup of its own.
    let groups = if config.fault.iter().any(|f| f.cuts_one_instance()) {
        let labels: Vec<String> = instances.iter().map(|i| i.label()).collect();
        Some(Arc::new(Groups::create(&labels)?))
    } else {
        None
    };

    let t0 = Instant::now();
    let calm = Arc::new(AtomicBool::new(false));
    let stop = CancellationToken::new();
    let supervisors: Vec<Arc<Supervisor>> = instances
        .iter()
        .map(|&instance| {
            let mut spec = spec::service(&config, &bin_dir, &out, instance);
            if let Some(groups) = &groups {
                (spec.program, spec.args) = groups.wrap(&spec.label, &spec.program);
            }
            Arc::new(Supervisor::new(spec, calm.clone(), t0))
        })
        .collect();
    print_plan(&config, &out);

    let mut tasks = Vec::new();
    for s in &supervisors {
        tasks.push(tokio::spawn(s.clone().run(stop.clone())));
    }
    let scraper = tokio::spawn(scrape_loop(supervisors.clone(), stop.clone()));

    // --transport http: the proxy the relay delivers to, in front of payments.
    let proxy_stop = CancellationToken::new();
    let proxy = match config.transport {
        crate::config::Transport::Http => {
            let hold = Duration::from_millis(config.webhook_timeout_ms) + Duration::from_secs(1);
            let proxy = Proxy::new(config.webhook_addr, hold)?;
            let listener = tokio::net::TcpListener::bind(config.webhook_proxy_addr)
                .await
                .with_context(|| format!("bind the webhook proxy {}", config.webhook_proxy_addr))?;
            let task = proxy.spawn(listener, proxy_stop.clone());
            Some((proxy, task))
        }
        crate::config::Transport::Kafka => None,
    };

    let stage = Stage {
        bin_dir: &bin_dir,
        out: &out,
        supervisors: &supervisors,
        levers: faults::Levers {
            proxy: proxy.as_ref().map(|(p, _)| p.clone()),
            groups: groups.clone(),
        },
    };
    let outcome = drive(&config, &stage, &calm, &interrupt, t0).await;

    // Last counters, then stop every service gracefully.
    let client = scrape::http_client()?;
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
    proxy_stop.cancel();
    let proxied = match proxy {
        Some((proxy, task)) => {
            let _ = task.await;
            let n = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed) as f64;
            vec![
                ("proxy_passed", n(&proxy.passed)),
                ("proxy_errored", n(&proxy.errored)),
                ("proxy_held", n(&proxy.held)),
            ]
        }
        None => Vec::new(),
    };

    let outcome = outcome.unwrap_or_else(|error| {
        eprintln!("chaos: error: {error:#}");
        Outcome {
            recon_code: EXIT_ERROR,
            ..Outcome::default()
        }
    });
    let recon_code = outcome.recon_code;
    let lives: Vec<summary::InstanceLives> = supervisors
        .iter()
        .map(|s| summary::InstanceLives {
            service: s.name(),
            label: s.label().to_owned(),
            lives: s.lives(),
        })
        .collect();
    let recon = read_json(&out.join("recon.json"));
    let mut summary = summary::summarize(&config, &out, &lives, outcome, recon, t0);
    summary.totals.extend(proxied);
    let path = config
        .json
        .clone()
        .unwrap_or_else(|| out.join("chaos.json"));
    std::fs::write(&path, summary::to_json(&summary)?)
        .with_context(|| format!("write {}", path.display()))?;
    summary::print(&summary, &path);
    Ok(recon_code)
}

/// What a run's drive works on: the binaries, the output directory, the
/// services, and what the faults act on besides them.
struct Stage<'a> {
    bin_dir: &'a Path,
    out: &'a Path,
    supervisors: &'a [Arc<Supervisor>],
    levers: faults::Levers,
}

/// Start-up, load with faults, calm drain, recon.
async fn drive(
    config: &Config,
    stage: &Stage<'_>,
    calm: &AtomicBool,
    interrupt: &CancellationToken,
    t0: Instant,
) -> anyhow::Result<Outcome> {
    let Stage {
        bin_dir,
        out,
        supervisors,
        ref levers,
    } = *stage;
    let deadline = Instant::now() + Duration::from_secs(config.ready_timeout);
    while !supervisors.iter().all(|s| s.ready()) {
        if Instant::now() > deadline {
            let late: Vec<&str> = supervisors
                .iter()
                .filter(|s| !s.ready())
                .map(|s| s.label())
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
    let mut injector = tokio::spawn(faults::run(
        config.clone(),
        bin_dir.to_path_buf(),
        supervisors.to_vec(),
        levers.clone(),
        t0,
        faults.clone(),
    ));

    let mut load = Command::new(bin_dir.join("loadgen"));
    load.args(spec::loadgen_args(config, out))
        .kill_on_drop(true);
    let mut child = load.spawn().context("start loadgen")?;
    // With --max-duration loadgen's schedule is that long, and chaos ends it
    // early (SIGUSR1) once the injector has done its --fault-count faults
    // and --duration has passed.
    let floor = tokio::time::Instant::now() + Duration::from_secs(config.duration);
    let wait_for_faults = config.max_duration.is_some();
    let mut done_faults: Option<Vec<faults::FaultRecord>> = None;
    let mut ended = false;
    let status = loop {
        tokio::select! {
            s = child.wait() => break Some(s.context("wait for loadgen")?),
            () = interrupt.cancelled() => break None,
            r = &mut injector, if wait_for_faults && done_faults.is_none() => {
                let records = r.unwrap_or_default();
                eprintln!(
                    "chaos: {} faults done after {:.0} s",
                    records.len(),
                    t0.elapsed().as_secs_f64()
                );
                done_faults = Some(records);
            }
            () = tokio::time::sleep_until(floor), if done_faults.is_some() && !ended => {
                ended = true;
                end_load(&child);
            }
        }
    };
    calm.store(true, Ordering::SeqCst);
    faults.cancel();
    if let Some(k) = killer {
        let _ = k.await;
    }
    // A fault in progress finishes (PostgreSQL or the broker back up, the
    // relay continued, payments released) before anything else.
    let fault_records = match done_faults {
        Some(records) => records,
        None => injector.await.unwrap_or_default(),
    };
    let Some(status) = status else {
        let _ = child.kill().await;
        eprintln!("chaos: interrupted; stopping the services");
        return Ok(Outcome {
            load: read_json(&out.join("loadgen.json")),
            recon_code: EXIT_ERROR,
            interrupted: true,
            faults: fault_records,
        });
    };
    eprintln!(
        "chaos: load done (loadgen exit {}); faults off, waiting up to {} s for the pipeline to drain",
        status.code().unwrap_or(-1),
        config.drain_timeout
    );

    let recon = bin_dir.join("recon");
    let intents = out.join("intents.txt");
    let recon_url = spec::role_database_url(ServiceRole::Recon);
    // Over Kafka, recon also checks what payments' group committed past:
    // listed once the pipeline has drained (or the wait is over), so that
    // it covers everything consumed.
    let over_kafka = config.transport == Transport::Kafka;
    let mut committed = None;
    if over_kafka {
        let mut wait = Command::new(&recon);
        wait.envs(recon_url.clone())
            .arg("--drain-only")
            .arg("--wait-drained")
            .arg(config.drain_timeout.to_string())
            .kill_on_drop(true);
        tokio::select! {
            s = wait.status() => { s.context("run recon --drain-only")?; }
            () = interrupt.cancelled() => return Ok(Outcome {
                load: read_json(&out.join("loadgen.json")),
                recon_code: EXIT_ERROR,
                interrupted: true,
                faults: fault_records,
            }),
        }
        committed = faults::committed_past(bin_dir, &config.payments_group, out).await;
    }
    // Waited already over Kafka: the table only says whether it drained.
    let table_wait = if over_kafka { 0 } else { config.drain_timeout };
    let committed_args: Vec<&std::ffi::OsStr> = committed
        .iter()
        .flat_map(|f| [std::ffi::OsStr::new("--committed-past"), f.as_os_str()])
        .collect();
    let mut table = Command::new(&recon);
    table
        .envs(recon_url.clone())
        .arg("--wait-drained")
        .arg(table_wait.to_string())
        .arg("--intents")
        .arg(&intents)
        .args(&committed_args)
        .kill_on_drop(true);
    let code = tokio::select! {
        s = table.status() => s.context("run recon")?.code().unwrap_or(i32::from(EXIT_ERROR)),
        () = interrupt.cancelled() => return Ok(Outcome {
            load: read_json(&out.join("loadgen.json")),
            recon_code: EXIT_ERROR,
            interrupted: true,
            faults: fault_records,
        }),
    };
    // The same diff as JSON for the summary (read-only; drained already).
    let json_out = Command::new(&recon)
        .envs(recon_url)
        .arg("--json")
        .arg("--intents")
        .arg(&intents)
        .args(&committed_args)
        .output()
        .await
        .context("run recon --json")?;
    std::fs::write(out.join("recon.json"), &json_out.stdout).context("write recon.json")?;
    Ok(Outcome {
        load: read_json(&out.join("loadgen.json")),
        recon_code: u8::try_from(code).unwrap_or(EXIT_ERROR),
        interrupted: false,
        faults: fault_records,
    })
}

/// Ends loadgen's schedule where it is (SIGUSR1): the sends in flight and
/// the retries planned finish, and its report is of a complete, shorter run.
fn end_load(child: &tokio::process::Child) {
    let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok()) else {
        return; // it has exited; its wait() reports that
    };
    eprintln!("chaos: faults done and --duration passed; ending the load");
    if let Err(e) = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGUSR1,
    ) {
        tracing::warn!(error = %e, "could not end loadgen's schedule; it runs to --max-duration");
    }
}

fn read_json(path: &Path) -> Value {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null)
}

async fn scrape_loop(supervisors: Vec<Arc<Supervisor>>, stop: CancellationToken) {
    let Ok(client) = scrape::http_client() else {
        return;
    };
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
            tracing::info!(service = target.label(), "random kill: SIGKILL");
        }
    }
}

fn print_plan(config: &Config, out: &Path) {
    let mut faults = Vec::new();
    if config.relay_kind == crate::config::RelayKind::Debezium {
        faults.push(format!(
            "relay: Debezium ({} run, REST on {})",
            config.debezium_script.display(),
            config.debezium_rest
        ));
    }
    if config.transport == crate::config::Transport::Http {
        faults.push(format!(
            "transport http: relay --sink http -> payments --source http on {} (retry schedule x{})",
            config.webhook_addr, config.webhook_schedule_scale
        ));
    }
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
    let length = match config.max_duration {
        Some(max) => format!(
            "{}..{max} s (until {} faults are done)",
            config.duration,
            config.fault_count.unwrap_or(0)
        ),
        None => format!("{} s", config.duration),
    };
    let instances = if config.instances().len() > ServiceName::ALL.len() {
        format!(
            "; instances: orders x{}, relay x{}, payments x{}",
            config.orders, config.relays, config.payments
        )
    } else {
        String::new()
    };
    eprintln!(
        "chaos: {} intents/s for {length} ({} retried, {}); faults: {}{instances}; out: {}",
        config.rate,
        config.retry_rate,
        config.protocol,
        faults.join(", "),
        out.display()
    );
}
