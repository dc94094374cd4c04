//! One run: probe the target, drive the open-model schedule, let every send
//! report into the collector, drain, report.
//!
//! The scheduler is a single task that owns the RNG, so every draw (key,
//! retries, protocol) happens in schedule order and a seed reproduces the run.
//! Each send is its own task: a slow answer never delays the next send, which
//! is what makes the model open.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::config::{Protocol, Settings};
use crate::keys::{KeyPicker, KeySpace};
use crate::outcome::Outcome;
use crate::progress::Progress;
use crate::report::{self, Report, RunFacts, SendCounts};
use crate::schedule::{Due, RetryPlan, Schedule};
use crate::shared::Shared;
use crate::stats::{Collector, SendKind};
use crate::targets::{Spreader, Targets};
use crate::verify::Via;

/// Sends handed out in one go before the scheduler yields, so that on a
/// single thread the send tasks it spawned get to run while it catches up.
const BATCH: u32 = 64;
/// How long after the hard stop to wait for sends to notice it.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// One send, as the scheduler decided it.
#[derive(Debug, Clone, Copy)]
struct SendSpec {
    kind: SendKind,
    key_index: u64,
    /// Scheduled offset from the start: latency is measured from here.
    at_ns: u64,
    via: Via,
    /// Which of the protocol's instances it goes to.
    target: usize,
}

/// Gives the in-flight slot back however the send task ends.
struct Slot<'a>(&'a Shared);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_one();
        }
    }
}

/// Nanoseconds since `start`, saturating.
fn elapsed_ns(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Microseconds, saturating.
fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

async fn send_one(shared: Arc<Shared>, mut spec: SendSpec) {
    let _slot = Slot(&shared);
    let key = shared.keys.key(spec.key_index);
    let body = shared.keys.body(spec.key_index);
    let mut errors_retried = 0;
    loop {
        // The timeout runs from the real send, like any client's; the hard stop
        // bounds it so the run always ends.
        let by_timeout = Instant::now() + shared.timeout;
        let (deadline, hard) = if by_timeout < shared.hard_stop {
            (by_timeout, false)
        } else {
            (shared.hard_stop, true)
        };
        let call = shared.targets.create(spec.via, spec.target, &key, body);
        let outcome = match tokio::time::timeout_at(deadline, call).await {
            Ok(outcome) => outcome,
            Err(_) if hard => Outcome::Abandoned,
            Err(_) => Outcome::Timeout,
        };
        let scheduled = shared.start + Duration::from_nanos(spec.at_ns);
        let latency_us = micros(Instant::now().saturating_duration_since(scheduled));
        shared.lock().record(
            spec.key_index,
            &key,
            spec.kind,
            spec.at_ns,
            &outcome,
            latency_us,
        );
        // A client that retries errors sends the same key and body again
        // after a pause: the retry of a request whose outcome it cannot know.
        let resend_at = Instant::now() + shared.retry_on_error_delay;
        if errors_retried >= shared.retry_on_error
            || !outcome.worth_retrying()
            || resend_at + shared.timeout > shared.hard_stop
        {
            return;
        }
        errors_retried += 1;
        tokio::time::sleep_until(resend_at).await;
        shared.error_retries.fetch_add(1, Ordering::Relaxed);
        shared.lock().record_error_retry(spec.key_index);
        spec.kind = SendKind::Retry;
        spec.at_ns = elapsed_ns(shared.start);
        // No answer from this instance: the next one, as behind a balancer.
        spec.target = (spec.target + 1) % shared.targets.len(spec.via).max(1);
    }
}

/// The scheduler's own state and counts.
struct Scheduler {
    shared: Arc<Shared>,
    rng: StdRng,
    picker: KeyPicker,
    /// Indexes drawn so far (not the fresh sequential ones, which are all new).
    seen: HashSet<u64>,
    protocol: Protocol,
    spreader: Spreader,
    retry_rate: f64,
    retry_delay: Duration,
    max_in_flight: usize,
    counts: SendCounts,
}

impl Scheduler {
    fn dispatch(&mut self, due: Due, schedule: &mut Schedule) {
        match due {
            Due::First { at_ns, .. } => {
                let key_index = self.picker.next(&mut self.rng);
                if self.picker.is_fresh(key_index) || self.seen.insert(key_index) {
                    self.counts.new_intents += 1;
                } else {
                    self.counts.repeat_intents += 1;
                }
                let plan = RetryPlan::draw(&mut self.rng, self.retry_rate, self.retry_delay);
                for &offset in plan.offsets_ns() {
                    schedule.push_retry(at_ns.saturating_add(offset), key_index);
                    self.counts.retries_planned += 1;
                }
                self.shared.first_handed_out.fetch_add(1, Ordering::Relaxed);
                self.send(SendKind::First, key_index, at_ns);
            }
            Due::Retry { key_index, at_ns } => self.send(SendKind::Retry, key_index, at_ns),
        }
    }

    fn send(&mut self, kind: SendKind, key_index: u64, at_ns: u64) {
        // Drawn even for a send that ends up dropped, so the RNG sequence does
        // not depend on timing.
        let via = match self.protocol {
            Protocol::Http => Via::Http,
            Protocol::Grpc => Via::Grpc,
            Protocol::Mixed => {
                if self.rng.random_bool(0.5) {
                    Via::Http
                } else {
                    Via::Grpc
                }
            }
        };
        let target = self.spreader.pick(via, &mut self.rng);
        let in_flight = self.shared.in_flight.load(Ordering::Acquire);
        if in_flight >= self.max_in_flight {
            self.counts.dropped += 1;
            match kind {
                SendKind::First => self.counts.first_attempts_dropped += 1,
                SendKind::Retry => self.counts.retries_dropped += 1,
            }
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let now_in_flight = self.shared.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        self.counts.peak_in_flight = self.counts.peak_in_flight.max(now_in_flight as u64);
        self.counts.sent += 1;
        match kind {
            SendKind::First => self.counts.first_attempts_sent += 1,
            SendKind::Retry => self.counts.retries_sent += 1,
        }
        self.shared.sent.fetch_add(1, Ordering::Relaxed);
        let spec = SendSpec {
            kind,
            key_index,
            at_ns,
            via,
            target,
        };
        tokio::spawn(send_one(self.shared.clone(), spec));
    }
}

/// Sets `flag` and wakes `wake` on Ctrl-C; a second Ctrl-C exits at once.
fn watch_interrupt(flag: Arc<AtomicBool>, wake: Arc<Notify>) {
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_err() {
            return;
        }
        eprintln!("loadgen: interrupted; draining (Ctrl-C again to quit now)");
        flag.store(true, Ordering::Release);
        wake.notify_one();
        if tokio::signal::ctrl_c().await.is_ok() {
            std::process::exit(i32::from(report::EXIT_INTERRUPTED));
        }
    });
}

/// Sets `flag` and wakes `wake` on each SIGUSR1: the schedule ends there,
/// as if `--duration` had been reached (chaos ends the load this way once
/// its faults are done; `chaos --max-duration`).
fn watch_end(flag: Arc<AtomicBool>, wake: Arc<Notify>) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut usr1 = match signal(SignalKind::user_defined1()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "loadgen: cannot watch SIGUSR1 ({e}); the schedule runs its whole --duration"
            );
            return;
        }
    };
    tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            flag.store(true, Ordering::Release);
            wake.notify_one();
        }
    });
}

/// Runs the whole thing and returns the exit code.
pub(crate) async fn run(settings: Settings) -> anyhow::Result<u8> {
    let targets = Targets::connect(&settings).await?;
    let spreader = Spreader::new(
        settings.spread,
        targets.len(Via::Http),
        targets.len(Via::Grpc),
    );
    let picker = KeyPicker::new(
        settings.zipf_s,
        settings.keys,
        settings.hot_keys,
        settings.hot_share,
    )?;
    let mut schedule = Schedule::new(settings.rate, settings.duration);
    let total = schedule.total_first_attempts();

    let started_at_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0);
    let start = Instant::now();
    let hard_stop = start + settings.duration + settings.drain_timeout;
    let shared = Arc::new(Shared {
        keys: KeySpace::new(settings.key_prefix.clone(), settings.seed),
        targets,
        timeout: settings.timeout,
        start,
        hard_stop,
        in_flight: AtomicUsize::new(0),
        idle: Notify::new(),
        first_handed_out: AtomicU64::new(0),
        sent: AtomicU64::new(0),
        dropped: AtomicU64::new(0),
        retry_on_error: settings.retry_on_error,
        retry_on_error_delay: settings.retry_on_error_delay,
        error_retries: AtomicU64::new(0),
        collector: Mutex::new(Collector::with_hot_keys(settings.hot_keys)),
    });
    let interrupted = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(Notify::new());
    watch_interrupt(interrupted.clone(), wake.clone());
    let end = Arc::new(AtomicBool::new(false));
    watch_end(end.clone(), wake.clone());
    let progress = Progress::start(shared.clone(), settings.progress, total, settings.duration);

    let mut scheduler = Scheduler {
        shared: shared.clone(),
        rng: StdRng::seed_from_u64(settings.seed),
        picker,
        seen: HashSet::new(),
        protocol: settings.protocol,
        spreader,
        retry_rate: settings.retry_rate,
        retry_delay: settings.retry_delay,
        max_in_flight: settings.max_in_flight,
        counts: SendCounts {
            first_attempts_scheduled: total,
            ..SendCounts::default()
        },
    };
    let hard_stop_ns =
        u64::try_from((settings.duration + settings.drain_timeout).as_nanos()).unwrap_or(u64::MAX);
    let mut window = settings.duration;
    let mut ended_early = false;
    while let Some(next_ns) = schedule.next_at_ns() {
        if interrupted.load(Ordering::Acquire) {
            window = start.elapsed();
            break;
        }
        if !ended_early && end.load(Ordering::Acquire) {
            // No more first attempts; the retries already planned go on.
            ended_early = true;
            window = start.elapsed();
            schedule.end_first_attempts();
            scheduler.counts.first_attempts_scheduled = schedule.total_first_attempts();
            eprintln!(
                "loadgen: SIGUSR1: schedule ended after {:.1} s",
                window.as_secs_f64()
            );
            continue;
        }
        if next_ns >= hard_stop_ns {
            break;
        }
        if next_ns > elapsed_ns(start) {
            tokio::select! {
                () = tokio::time::sleep_until(start + Duration::from_nanos(next_ns)) => {}
                () = wake.notified() => continue,
            }
        }
        // Hand out everything that is due now. When behind (a stall, or more
        // due than one thread can spawn), this catches up in one pass instead
        // of one timer per send; latency still counts from each send's
        // scheduled instant.
        let now_ns = elapsed_ns(start);
        let mut batch = 0;
        while let Some(due) = schedule.pop_due(now_ns) {
            scheduler.dispatch(due, &mut schedule);
            batch += 1;
            if batch == BATCH {
                batch = 0;
                tokio::task::yield_now().await;
            }
        }
    }
    scheduler.counts.unsent = schedule.remaining_first_attempts() + schedule.pending_retries();

    // Drain: every send ends by its timeout or the hard stop.
    let give_up = hard_stop + STOP_GRACE;
    while shared.in_flight.load(Ordering::Acquire) > 0 {
        tokio::select! {
            () = shared.idle.notified() => {}
            () = tokio::time::sleep_until(give_up) => break,
        }
    }
    let elapsed = start.elapsed();
    progress.finish().await;

    let unfinished = shared.in_flight.load(Ordering::Acquire) as u64;
    let error_retries = shared.error_retries.load(Ordering::Acquire);
    scheduler.counts.error_retries_sent = error_retries;
    scheduler.counts.sent += error_retries;
    let collector = std::mem::take(&mut *shared.lock());
    let facts = RunFacts {
        params: settings.params(),
        started_at_unix_ms,
        interrupted: interrupted.load(Ordering::Acquire),
        ended_early,
        window_s: window.as_secs_f64(),
        elapsed_s: elapsed.as_secs_f64(),
        sends: scheduler.counts,
        unfinished,
        targets: shared.targets.report(),
    };
    let report = Report::assemble(facts, &collector);
    print!("{}", report.summary());

    write_outputs(&settings, &report, &collector, &shared.keys)?;
    Ok(report.exit_code)
}

/// Writes every requested file, even if one fails; returns the first failure.
fn write_outputs(
    settings: &Settings,
    report: &Report,
    collector: &Collector,
    keys: &KeySpace,
) -> anyhow::Result<()> {
    let mut failure = None;
    if let Some(path) = &settings.json {
        failure = failure.or(report.write_json(path).err());
    }
    if let Some(path) = &settings.csv {
        failure = failure.or(report::write_csv(path, &collector.seconds).err());
    }
    if let Some(path) = &settings.minute_csv {
        failure = failure.or(report::write_minute_csv(path, &collector.seconds).err());
    }
    if settings.intents.is_some() || settings.ambiguous.is_some() || settings.failed.is_some() {
        let caller = settings.token.as_ref().map(|t| t.caller.as_str());
        let lines = report::key_lines(collector, keys, caller);
        for (path, lines) in [
            (&settings.intents, &lines.intents),
            (&settings.ambiguous, &lines.ambiguous),
            (&settings.failed, &lines.failed),
        ] {
            if let Some(path) = path {
                failure = failure.or(report::write_lines(path, lines).err());
            }
        }
    }
    failure.map_or(Ok(()), Err)
}
