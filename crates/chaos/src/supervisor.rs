//! One supervisor per service: start the process, wait until it serves
//! `/metrics`, wait for it to die, say how it died, start it again.
//!
//! Every process life is recorded: when it started, when it was ready, when
//! and how it ended, and its counters. Recovery time is measured from the
//! moment a death is seen to the next life being ready, and to its first
//! progress (its work counter moving), which is what an operator waits for.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use pipeline::contract::ServiceName;
use serde::Serialize;
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::scrape;

/// How to run one service.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Which service.
    pub name: ServiceName,
    /// Which instance of it, as logs and the summary name it
    /// (`config::Instance::label`: `relay`, or `relay-2` of several).
    pub label: String,
    /// The binary (or what starts it: a shell that joins the instance's
    /// cgroup first, see [`crate::cgroup`]).
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<std::ffi::OsString>,
    /// Environment of every life.
    pub env: Vec<(String, String)>,
    /// Extra environment while faults are on (the armed crash point).
    pub armed_env: Vec<(String, String)>,
    /// The armed crash points (comma list as `CRASH_POINT` takes it), if any.
    pub crash_point: Option<String>,
    /// Where an armed life writes the name of the crash point that fires.
    pub crash_marker: PathBuf,
    /// Its `GET /metrics`, scraped for its counters (and the readiness
    /// probe unless [`Self::probe`] says otherwise).
    pub metrics_url: String,
    /// How a life is found ready.
    pub probe: Probe,
    /// Log file (appended to by every life).
    pub log: PathBuf,
    /// How long a life may take to become ready before it is killed.
    pub ready_timeout: Duration,
}

/// How a life is found ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// `GET` of its metrics URL answers 2xx; its counters are scraped.
    Metrics,
    /// A Kafka Connect worker: `GET` of this connector status URL says the
    /// connector and each of its tasks (one at least) `RUNNING`. It serves
    /// no metrics: nothing is scraped.
    Connector(String),
}

impl Probe {
    /// Whether the life behind `metrics_url` is ready.
    async fn ready(&self, client: &reqwest::Client, metrics_url: &str) -> bool {
        match self {
            Probe::Metrics => client
                .get(metrics_url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success()),
            Probe::Connector(url) => match client.get(url).send().await {
                Ok(r) if r.status().is_success() => r
                    .json::<serde_json::Value>()
                    .await
                    .is_ok_and(|status| connector_running(&status)),
                _ => false,
            },
        }
    }
}

/// Whether a Kafka Connect connector status (`GET
/// /connectors/NAME/status`) says the connector and every task, of which
/// there is one at least, `RUNNING`.
pub fn connector_running(status: &serde_json::Value) -> bool {
    let running =
        |v: &serde_json::Value| v.get("state").and_then(|s| s.as_str()) == Some("RUNNING");
    let tasks = status.get("tasks").and_then(|t| t.as_array());
    status.get("connector").is_some_and(running)
        && tasks.is_some_and(|t| !t.is_empty() && t.iter().all(running))
}

/// How a process life ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum End {
    /// SIGKILLed itself at its armed crash point.
    CrashPoint {
        /// The point.
        point: String,
    },
    /// SIGKILLed by chaos from outside (`--random-kill`).
    RandomKill,
    /// Killed by a signal chaos did not send.
    Signal {
        /// The signal number.
        signal: i32,
    },
    /// Exited by itself.
    Exit {
        /// The exit code.
        code: i32,
    },
    /// Stopped by chaos at the end of the run (SIGTERM).
    Stopped,
    /// Stopped by chaos (SIGTERM) for an infrastructure fault, then started
    /// again by chaos (offset-reset).
    Fault {
        /// The fault.
        fault: String,
    },
}

impl End {
    /// The key this end is counted under in the summary.
    pub fn label(&self) -> String {
        match self {
            Self::CrashPoint { point } => format!("crash_point:{point}"),
            Self::RandomKill => "random_kill".into(),
            Self::Signal { signal } => format!("signal:{signal}"),
            Self::Exit { code } => format!("exit:{code}"),
            Self::Stopped => "stopped".into(),
            Self::Fault { fault } => format!("fault:{fault}"),
        }
    }
}

/// One process life.
#[derive(Debug, Clone, Serialize)]
pub struct Life {
    /// Milliseconds since the run started.
    pub started_ms: u64,
    /// When it first answered `/metrics`.
    pub ready_ms: Option<u64>,
    /// When its work counter first moved.
    pub progress_ms: Option<u64>,
    /// When its death was seen.
    pub ended_ms: Option<u64>,
    /// Whether faults were armed in it.
    pub armed: bool,
    /// How it ended.
    pub end: Option<End>,
    /// Its counters at the last scrape.
    #[serde(skip)]
    pub counters: BTreeMap<String, f64>,
}

#[derive(Debug, Default)]
struct State {
    lives: Vec<Life>,
    pid: Option<u32>,
    kill_pending: bool,
    /// Set by [`Supervisor::stop_for`]: the current life is being stopped for
    /// this fault and no next life starts until [`Supervisor::release`].
    hold: Option<&'static str>,
}

/// Supervises one service; see the module docs.
#[derive(Debug)]
pub struct Supervisor {
    spec: Spec,
    state: Mutex<State>,
    /// Set when the load is over: lives started from now on are unarmed.
    calm: Arc<AtomicBool>,
    t0: Instant,
}

impl Supervisor {
    /// A supervisor for `spec`; `calm` disarms later lives; times are
    /// measured from `t0`.
    pub fn new(spec: Spec, calm: Arc<AtomicBool>, t0: Instant) -> Self {
        Self {
            spec,
            state: Mutex::new(State::default()),
            calm,
            t0,
        }
    }

    /// The service.
    pub fn name(&self) -> ServiceName {
        self.spec.name
    }

    /// The instance's name (`relay`, or `relay-2` of several).
    pub fn label(&self) -> &str {
        &self.spec.label
    }

    fn now_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock is a bug in chaos, not input; the
        // data is still usable for the report.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the current life is ready.
    pub fn ready(&self) -> bool {
        let s = self.state();
        s.pid.is_some() && s.lives.last().is_some_and(|l| l.ready_ms.is_some())
    }

    /// A copy of every life so far.
    pub fn lives(&self) -> Vec<Life> {
        self.state().lives.clone()
    }

    /// SIGKILLs the current life if it is ready; true if a signal was sent.
    pub fn kill_now(&self) -> bool {
        let mut s = self.state();
        let ready = s.lives.last().is_some_and(|l| l.ready_ms.is_some());
        let Some(pid) = s.pid.filter(|_| ready && !s.kill_pending) else {
            return false;
        };
        s.kill_pending = true;
        kill(Pid::from_raw(pid as i32), Signal::SIGKILL).is_ok()
    }

    /// Sends `signal` to the current life; its pid if one was sent.
    pub fn signal(&self, signal: Signal) -> Option<u32> {
        let pid = self.state().pid?;
        kill(Pid::from_raw(pid as i32), signal).ok().map(|()| pid)
    }

    /// Stops the current life with SIGTERM for `fault` and keeps the next
    /// one from starting until [`Self::release`]; returns once no life runs
    /// (false if that took longer than `timeout`).
    pub async fn stop_for(&self, fault: &'static str, timeout: Duration) -> bool {
        let pid = {
            let mut s = self.state();
            s.hold = Some(fault);
            s.pid
        };
        if let Some(pid) = pid {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        }
        let deadline = Instant::now() + timeout;
        while self.state().pid.is_some() {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Whether it is held by [`Self::stop_for`] (no life until released).
    pub fn held(&self) -> bool {
        self.state().hold.is_some()
    }

    /// Lets the next life start after [`Self::stop_for`].
    pub fn release(&self) {
        self.state().hold = None;
    }

    /// Where the work counter stands: (lives so far, the current life's
    /// value), for [`Self::moved_since`].
    pub fn progress_mark(&self) -> (usize, f64) {
        let s = self.state();
        let counter = scrape::progress_counter(self.spec.name);
        let value = s
            .lives
            .last()
            .and_then(|l| l.counters.get(&counter))
            .copied()
            .unwrap_or(0.0);
        (s.lives.len(), value)
    }

    /// Whether the work counter moved since `mark`: it grew in the same
    /// life, or a later life has done some work.
    pub fn moved_since(&self, mark: (usize, f64)) -> bool {
        let now = self.progress_mark();
        if now.0 == mark.0 {
            now.1 > mark.1
        } else {
            now.1 > 0.0
        }
    }

    /// The partitions the current life owns (payments), when it is running
    /// and was scraped since it was ready.
    pub fn owned_partitions(&self) -> Option<f64> {
        let s = self.state();
        s.pid?;
        let life = s.lives.last().filter(|l| l.ready_ms.is_some())?;
        scrape::owned_partitions(&life.counters)
    }

    /// `counter` (a summary name of [`scrape::COUNTERS`]) summed over every
    /// life so far.
    pub fn total(&self, counter: &str) -> f64 {
        let s = self.state();
        scrape::sum_lives(s.lives.iter().map(|l| &l.counters))
            .get(counter)
            .copied()
            .unwrap_or(0.0)
    }

    /// Scrapes the current life once and keeps its counters.
    pub async fn scrape(&self, client: &reqwest::Client) {
        if self.spec.probe != Probe::Metrics {
            return;
        }
        let life = {
            let s = self.state();
            if s.pid.is_none() {
                return;
            }
            s.lives.len()
        };
        let Some(counters) = scrape::fetch(client, &self.spec.metrics_url).await else {
            return;
        };
        let now = self.now_ms();
        let progress = counters
            .get(&scrape::progress_counter(self.spec.name))
            .is_some_and(|v| *v > 0.0);
        let mut s = self.state();
        // Only if the life scraped is still the current one.
        if s.lives.len() != life || s.pid.is_none() {
            return;
        }
        if let Some(l) = s.lives.last_mut() {
            l.counters = counters;
            if progress && l.progress_ms.is_none() {
                l.progress_ms = Some(now);
            }
        }
    }

    /// Runs lives until `stop` fires, then stops the current one with
    /// SIGTERM (SIGKILL after 15 s).
    pub async fn run(self: Arc<Self>, stop: CancellationToken) -> anyhow::Result<()> {
        let client = scrape::http_client()?;
        let mut quick_deaths: u32 = 0;
        while !stop.is_cancelled() {
            let was_ready = self.one_life(&client, &stop).await?;
            if stop.is_cancelled() {
                break;
            }
            // Held for a fault (stop_for): no next life until it is released.
            while self.state().hold.is_some() {
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                    () = stop.cancelled() => return Ok(()),
                }
            }
            // A service that dies before it is ready, again and again (a bad
            // flag, the database down), is restarted with a growing pause, not
            // in a hot loop. A life that was ready is restarted at once, however
            // short it was: a crash point may well fire within a second.
            quick_deaths = if was_ready { 0 } else { quick_deaths + 1 };
            let pause = Duration::from_millis(20 * 2u64.pow(quick_deaths.min(7)));
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = stop.cancelled() => break,
            }
        }
        Ok(())
    }

    /// Runs one life to its end; whether it became ready.
    async fn one_life(
        &self,
        client: &reqwest::Client,
        stop: &CancellationToken,
    ) -> anyhow::Result<bool> {
        let armed = !self.calm.load(Ordering::SeqCst) && !self.spec.armed_env.is_empty();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.spec.log)
            .with_context(|| format!("open {}", self.spec.log.display()))?;
        let mut cmd = Command::new(&self.spec.program);
        cmd.args(&self.spec.args)
            .envs(self.spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().context("log file")?)
            .stderr(log)
            .kill_on_drop(true);
        if armed {
            cmd.envs(self.spec.armed_env.iter().map(|(k, v)| (k, v)));
            let _ = std::fs::remove_file(&self.spec.crash_marker);
            cmd.env(
                pipeline::contract::env::CRASH_MARKER_FILE,
                &self.spec.crash_marker,
            );
        }
        // Spawned under the state lock, so `stop_for` sees either no life
        // and a hold that keeps this one from starting, or this life's pid.
        let mut child = {
            let mut s = self.state();
            if s.hold.is_some() {
                return Ok(false);
            }
            let child = cmd
                .spawn()
                .with_context(|| format!("start {}", self.spec.program.display()))?;
            s.pid = child.id();
            s.kill_pending = false;
            s.lives.push(Life {
                started_ms: self.now_ms(),
                ready_ms: None,
                progress_ms: None,
                ended_ms: None,
                armed,
                end: None,
                counters: BTreeMap::new(),
            });
            child
        };
        let started = Instant::now();
        tracing::info!(service = self.spec.label.as_str(), pid = ?child.id(), armed, "started");

        let mut ready = false;
        let status = loop {
            tokio::select! {
                status = child.wait() => break Some(status.context("wait for child")?),
                () = stop.cancelled() => break None,
                () = tokio::time::sleep(Duration::from_millis(50)), if !ready => {
                    if self.spec.probe.ready(client, &self.spec.metrics_url).await {
                        ready = true;
                        let now = self.now_ms();
                        if let Some(l) = self.state().lives.last_mut() {
                            l.ready_ms = Some(now);
                        }
                    } else if started.elapsed() > self.spec.ready_timeout {
                        tracing::warn!(service = self.spec.label.as_str(), "not ready in time; killing it");
                        let _ = child.start_kill();
                    }
                }
            }
        };
        let end = match status {
            None => {
                self.terminate(&mut child).await;
                End::Stopped
            }
            Some(status) => {
                let (kill_pending, hold) = {
                    let s = self.state();
                    (s.kill_pending, s.hold)
                };
                match (status.signal(), status.code()) {
                    (Some(9), _) if kill_pending => End::RandomKill,
                    (Some(9), _) if armed && self.spec.crash_point.is_some() => End::CrashPoint {
                        point: std::fs::read_to_string(&self.spec.crash_marker)
                            .ok()
                            .filter(|p| !p.is_empty())
                            .or_else(|| self.spec.crash_point.clone())
                            .unwrap_or_default(),
                    },
                    _ if hold.is_some() => End::Fault {
                        fault: hold.unwrap_or_default().to_owned(),
                    },
                    (Some(signal), _) => End::Signal { signal },
                    (None, code) => End::Exit {
                        code: code.unwrap_or(-1),
                    },
                }
            }
        };
        let now = self.now_ms();
        if !matches!(
            end,
            End::Stopped | End::CrashPoint { .. } | End::RandomKill | End::Fault { .. }
        ) {
            tracing::warn!(service = self.spec.label.as_str(), end = %end.label(), "died unexpectedly; see its log");
        }
        let mut s = self.state();
        s.pid = None;
        if let Some(l) = s.lives.last_mut() {
            l.ended_ms = Some(now);
            l.end = Some(end);
        }
        Ok(ready)
    }

    async fn terminate(&self, child: &mut tokio::process::Child) {
        if let Some(pid) = child.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        }
        if tokio::time::timeout(Duration::from_secs(15), child.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                service = self.spec.label.as_str(),
                "no exit 15 s after SIGTERM; SIGKILL"
            );
            let _ = child.kill().await;
        }
    }
}

/// Recovery of one service: per death that was followed by another life,
/// milliseconds from the death to the next life being ready and to its first
/// progress.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Recovery {
    /// Death → next life answers `/metrics`.
    pub ready_ms: Vec<u64>,
    /// Death → next life's work counter moved (absent when there was no work).
    pub progress_ms: Vec<u64>,
}

/// The recoveries in `lives`.
pub fn recoveries(lives: &[Life]) -> Recovery {
    let mut r = Recovery::default();
    for pair in lives.windows(2) {
        let (dead, next) = (&pair[0], &pair[1]);
        let Some(died) = dead.ended_ms else { continue };
        if matches!(dead.end, Some(End::Stopped)) {
            continue;
        }
        if let Some(ready) = next.ready_ms {
            r.ready_ms.push(ready.saturating_sub(died));
        }
        if let Some(progress) = next.progress_ms {
            r.progress_ms.push(progress.saturating_sub(died));
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn life(
        started: u64,
        ready: Option<u64>,
        progress: Option<u64>,
        ended: Option<u64>,
        end: Option<End>,
    ) -> Life {
        Life {
            started_ms: started,
            ready_ms: ready,
            progress_ms: progress,
            ended_ms: ended,
            armed: true,
            end,
            counters: BTreeMap::new(),
        }
    }

    #[test]
    fn recovery_is_measured_from_the_death_to_the_next_life() {
        let lives = vec![
            life(0, Some(100), Some(300), Some(1_000), Some(End::RandomKill)),
            life(
                1_020,
                Some(1_250),
                Some(1_900),
                Some(5_000),
                Some(End::CrashPoint {
                    point: "publish".into(),
                }),
            ),
            life(5_010, Some(5_100), None, Some(9_000), Some(End::Stopped)),
        ];
        let r = recoveries(&lives);
        assert_eq!(r.ready_ms, vec![250, 100]);
        assert_eq!(r.progress_ms, vec![900]);
    }

    #[test]
    fn ends_have_stable_labels() {
        assert_eq!(
            End::CrashPoint {
                point: "effect".into()
            }
            .label(),
            "crash_point:effect"
        );
        assert_eq!(End::RandomKill.label(), "random_kill");
        assert_eq!(End::Exit { code: 1 }.label(), "exit:1");
    }

    #[test]
    fn a_connector_is_ready_only_with_every_task_running() {
        let status = |connector: &str, tasks: &[&str]| {
            serde_json::json!({
                "name": "effectively-outbox",
                "connector": {"state": connector, "worker_id": "127.0.0.1:28083"},
                "tasks": tasks.iter().enumerate()
                    .map(|(id, state)| serde_json::json!({"id": id, "state": state}))
                    .collect::<Vec<_>>(),
                "type": "source",
            })
        };
        assert!(connector_running(&status("RUNNING", &["RUNNING"])));
        // Registered, its task not started yet: what a fresh worker says first.
        assert!(!connector_running(&status("RUNNING", &[])));
        assert!(!connector_running(&status(
            "RUNNING",
            &["RUNNING", "FAILED"]
        )));
        assert!(!connector_running(&status("UNASSIGNED", &["RUNNING"])));
        assert!(!connector_running(&serde_json::json!({"error_code": 404})));
    }
}
