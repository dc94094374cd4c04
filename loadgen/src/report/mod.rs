//! The end of a run: the report (human summary on stdout, the same as JSON),
//! the per-second and per-minute CSVs (`csv`) and the ground-truth key files
//! (`keys`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::Context;
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::config::Params;
use crate::stats::{ClassStats, Collector, KeyCounts, OutcomeCounts, ReplayCounts};
use crate::targets::TargetReport;

mod csv;
mod keys;
#[cfg(test)]
mod tests;

pub(crate) use csv::{write_csv, write_minute_csv};
pub(crate) use keys::{key_lines, write_lines};

/// Exit code of a run with replay mismatches.
pub(crate) const EXIT_MISMATCH: u8 = 3;
/// Exit code of a run stopped by Ctrl-C (without mismatches).
pub(crate) const EXIT_INTERRUPTED: u8 = 130;

/// Percentiles of a latency histogram, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct LatencySummary {
    /// Samples.
    pub(crate) count: u64,
    /// Mean.
    pub(crate) mean_ms: f64,
    /// Median.
    pub(crate) p50_ms: f64,
    /// 90th percentile.
    pub(crate) p90_ms: f64,
    /// 99th percentile.
    pub(crate) p99_ms: f64,
    /// 99.9th percentile.
    pub(crate) p999_ms: f64,
    /// Maximum.
    pub(crate) max_ms: f64,
}

/// µs → ms. Latencies are far below 2^52 µs, so the conversion is exact.
#[allow(clippy::cast_precision_loss)]
fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

impl LatencySummary {
    /// Summarises a histogram of microseconds (all zeros when it is empty).
    pub(crate) fn from_histogram(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self {
                count: 0,
                mean_ms: 0.0,
                p50_ms: 0.0,
                p90_ms: 0.0,
                p99_ms: 0.0,
                p999_ms: 0.0,
                max_ms: 0.0,
            };
        }
        Self {
            count: h.len(),
            mean_ms: h.mean() / 1000.0,
            p50_ms: ms(h.value_at_quantile(0.50)),
            p90_ms: ms(h.value_at_quantile(0.90)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            p999_ms: ms(h.value_at_quantile(0.999)),
            max_ms: ms(h.max()),
        }
    }
}

/// Latency of answered sends, from each send's scheduled instant.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct LatencyReport {
    /// Every answered send.
    pub(crate) all: LatencySummary,
    /// Answered first attempts.
    pub(crate) first_attempts: LatencySummary,
    /// Answered retries.
    pub(crate) retries: LatencySummary,
}

/// `a / b` as a ratio, 0 when `b` is 0.
fn ratio(a: u64, b: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let (a, b) = (a as f64, b as f64);
    if b > 0.0 { a / b } else { 0.0 }
}

/// The sends of one key class (hot: index <= --hot-keys; cold: the others).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct ClassReport {
    /// Sends that finished (first attempts, retries, retries of errors).
    pub(crate) sends: u64,
    /// ...that succeeded.
    pub(crate) ok: u64,
    /// ...that did not (`sends - ok`).
    pub(crate) errors: u64,
    /// Extra sends of `--retry-on-error`.
    pub(crate) error_retries_sent: u64,
    /// Distinct keys with at least one success.
    pub(crate) keys_succeeded: u64,
    /// `sends / keys_succeeded` (0 when no key succeeded).
    pub(crate) sends_per_key: f64,
    /// `error_retries_sent / ok` (0 when nothing succeeded).
    pub(crate) retries_per_success: f64,
    /// Latency of the answered sends, from each one's scheduled instant.
    pub(crate) latency_ms: LatencySummary,
}

impl ClassReport {
    /// Summarises one class.
    fn from_stats(stats: &ClassStats) -> Self {
        Self {
            sends: stats.sends,
            ok: stats.ok,
            errors: stats.errors(),
            error_retries_sent: stats.error_retries_sent,
            keys_succeeded: stats.keys_succeeded,
            sends_per_key: ratio(stats.sends, stats.keys_succeeded),
            retries_per_success: ratio(stats.error_retries_sent, stats.ok),
            latency_ms: LatencySummary::from_histogram(&stats.latency),
        }
    }
}

/// The sends by key class. The classes partition every send: their `sends`,
/// `ok` and `keys_succeeded` add up to the run's totals.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct KeyClassesReport {
    /// Keys 1..=--hot-keys; only when --hot-keys > 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) hot: Option<ClassReport>,
    /// Every other key (all of them when --hot-keys is 0).
    pub(crate) cold: ClassReport,
}

/// What the scheduler did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct SendCounts {
    /// First attempts in the schedule (`rate * duration`).
    pub(crate) first_attempts_scheduled: u64,
    /// ...that were sent.
    pub(crate) first_attempts_sent: u64,
    /// ...that were dropped (in-flight bound reached).
    pub(crate) first_attempts_dropped: u64,
    /// Retries planned by the retry storm.
    pub(crate) retries_planned: u64,
    /// ...that were sent.
    pub(crate) retries_sent: u64,
    /// Extra sends of `--retry-on-error` (same key and body after an error);
    /// included in `sent`.
    pub(crate) error_retries_sent: u64,
    /// ...that were dropped (in-flight bound reached).
    pub(crate) retries_dropped: u64,
    /// All sends that went out.
    pub(crate) sent: u64,
    /// All sends dropped by the client (overload of the client, not the service).
    pub(crate) dropped: u64,
    /// Sends never due because the run was interrupted or hit the hard stop.
    pub(crate) unsent: u64,
    /// First attempts whose key index had not been drawn before.
    pub(crate) new_intents: u64,
    /// First attempts that re-drew an earlier index (Zipf hot keys).
    pub(crate) repeat_intents: u64,
    /// Most sends outstanding at once.
    pub(crate) peak_in_flight: u64,
}

/// Rates over the send window.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Rates {
    /// First attempts per second asked for (--rate).
    pub(crate) offered: f64,
    /// All sends (first attempts and retries, dropped included) per second.
    pub(crate) offered_sends: f64,
    /// Answered sends per second.
    pub(crate) achieved: f64,
    /// Successful sends per second.
    pub(crate) ok: f64,
}

/// Facts about the run that the collector does not know.
#[derive(Debug, Clone)]
pub(crate) struct RunFacts {
    /// Parameters.
    pub(crate) params: Params,
    /// Wall-clock start.
    pub(crate) started_at_unix_ms: u64,
    /// Stopped early by Ctrl-C.
    pub(crate) interrupted: bool,
    /// The schedule was ended before `--duration` by SIGUSR1 (a complete
    /// run, shorter; chaos ends its load this way).
    pub(crate) ended_early: bool,
    /// Seconds of sending (the duration, or less when interrupted or ended early).
    pub(crate) window_s: f64,
    /// Seconds from start to the end of the drain.
    pub(crate) elapsed_s: f64,
    /// Scheduler counts.
    pub(crate) sends: SendCounts,
    /// Sends still outstanding after the hard stop (should be 0).
    pub(crate) unfinished: u64,
    /// What each orders instance was sent.
    pub(crate) targets: Vec<TargetReport>,
}

/// The report: printed as a summary and written as JSON.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    /// Format id; bumped if fields change meaning.
    pub(crate) schema: &'static str,
    /// Parameters, the random defaults resolved.
    pub(crate) params: Params,
    /// Wall-clock start, ms since the Unix epoch.
    pub(crate) started_at_unix_ms: u64,
    /// Stopped early by Ctrl-C.
    pub(crate) interrupted: bool,
    /// The schedule was ended before `--duration` by SIGUSR1: a complete
    /// run over `window_s` seconds.
    pub(crate) ended_early: bool,
    /// Seconds of sending.
    pub(crate) window_s: f64,
    /// Seconds from start to the end of the drain.
    pub(crate) elapsed_s: f64,
    /// Rates.
    pub(crate) rates: Rates,
    /// Scheduler counts.
    pub(crate) sends: SendCounts,
    /// Sends and successes per orders instance.
    pub(crate) targets: Vec<TargetReport>,
    /// Outcome counts.
    pub(crate) outcomes: OutcomeCounts,
    /// Answers by status class (gRPC codes mapped to their HTTP class).
    pub(crate) status_classes: BTreeMap<&'static str, u64>,
    /// HTTP answers by status code.
    pub(crate) http_status: BTreeMap<String, u64>,
    /// gRPC answers by code.
    pub(crate) grpc_codes: BTreeMap<&'static str, u64>,
    /// Keys by fate.
    pub(crate) keys: KeyCounts,
    /// Replay verification.
    pub(crate) replay: ReplayCounts,
    /// The first few success answers whose body was not a created order.
    pub(crate) bad_response_examples: Vec<String>,
    /// Latency.
    pub(crate) latency_ms: LatencyReport,
    /// Sends, outcomes and latency by key class (hot / cold).
    pub(crate) key_classes: KeyClassesReport,
    /// Sends still outstanding when the report was made.
    pub(crate) unfinished: u64,
    /// The process exit code.
    pub(crate) exit_code: u8,
}

fn per_second(count: u64, window_s: f64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let count = count as f64;
    if window_s > 0.0 {
        count / window_s
    } else {
        0.0
    }
}

impl Report {
    /// Puts the report together.
    pub(crate) fn assemble(facts: RunFacts, collector: &Collector) -> Self {
        let exit_code = if collector.replay.mismatches > 0 {
            EXIT_MISMATCH
        } else if facts.interrupted {
            EXIT_INTERRUPTED
        } else {
            0
        };
        let offered_sends = facts.sends.sent + facts.sends.dropped;
        Self {
            schema: "loadgen.report.v1",
            rates: Rates {
                offered: facts.params.rate,
                offered_sends: per_second(offered_sends, facts.window_s),
                achieved: per_second(collector.counts.responses, facts.window_s),
                ok: per_second(collector.counts.ok, facts.window_s),
            },
            params: facts.params,
            started_at_unix_ms: facts.started_at_unix_ms,
            interrupted: facts.interrupted,
            ended_early: facts.ended_early,
            window_s: facts.window_s,
            elapsed_s: facts.elapsed_s,
            sends: facts.sends,
            targets: facts.targets,
            outcomes: collector.counts.clone(),
            status_classes: collector.classes.clone(),
            http_status: collector
                .http_status
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            grpc_codes: collector.grpc_codes.clone(),
            keys: collector.key_counts(),
            replay: collector.replay.clone(),
            bad_response_examples: collector.bad_examples.clone(),
            latency_ms: LatencyReport {
                all: LatencySummary::from_histogram(&collector.all),
                first_attempts: LatencySummary::from_histogram(&collector.first_attempts),
                retries: LatencySummary::from_histogram(&collector.retries),
            },
            key_classes: KeyClassesReport {
                hot: collector
                    .key_classes
                    .hot
                    .as_ref()
                    .map(ClassReport::from_stats),
                cold: ClassReport::from_stats(&collector.key_classes.cold),
            },
            unfinished: facts.unfinished,
            exit_code,
        }
    }

    /// The human summary.
    pub(crate) fn summary(&self) -> String {
        let p = &self.params;
        let s = &self.sends;
        let o = &self.outcomes;
        let k = &self.keys;
        let r = &self.replay;
        let mut out = String::new();
        let mut keys = if p.zipf_s == 0.0 {
            "unique (zipf-s 0)".to_owned()
        } else {
            format!("zipf s={} over {}", p.zipf_s, p.keys)
        };
        if p.hot_keys > 0 {
            let draw = if p.zipf_s == 0.0 { "uniform" } else { "zipf" };
            keys = format!(
                "hot 1..={n} ({draw}) for a share {} of intents, cold {keys} past {n}",
                p.hot_share,
                n = p.hot_keys
            );
        }
        let _ = writeln!(
            out,
            "loadgen {}: protocol {}, keys {keys}, retry-rate {}, prefix {}, seed {}",
            if self.interrupted {
                "(INTERRUPTED)"
            } else if self.ended_early {
                "done (schedule ended early by SIGUSR1)"
            } else {
                "done"
            },
            serde_json::to_value(p.protocol)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            p.retry_rate,
            p.key_prefix,
            p.seed,
        );
        let _ = writeln!(
            out,
            "  rate        offered {:.1}/s ({:.1} sends/s with retries), achieved {:.1}/s answered, {:.1}/s ok over {:.1}s (elapsed {:.1}s)",
            self.rates.offered,
            self.rates.offered_sends,
            self.rates.achieved,
            self.rates.ok,
            self.window_s,
            self.elapsed_s
        );
        let _ = writeln!(
            out,
            "  sends       {} sent = {} first attempts + {} retries + {} retries of errors; {} dropped (client over --max-in-flight: {} first, {} retries); {} unsent; peak in flight {}",
            s.sent,
            s.first_attempts_sent,
            s.retries_sent,
            s.error_retries_sent,
            s.dropped,
            s.first_attempts_dropped,
            s.retries_dropped,
            s.unsent,
            s.peak_in_flight
        );
        let several = |protocol| {
            self.targets
                .iter()
                .filter(|t| t.protocol == protocol)
                .count()
                > 1
        };
        if several("http") || several("grpc") {
            let targets = self
                .targets
                .iter()
                .map(|t| format!("{} ({}) {} sent {} ok", t.url, t.protocol, t.sent, t.ok))
                .collect::<Vec<_>>()
                .join("; ");
            let _ = writeln!(
                out,
                "  instances   {targets} (--spread {})",
                p.spread.name()
            );
        }
        let _ = writeln!(
            out,
            "  intents     {} scheduled: {} new keys, {} re-drawn",
            s.first_attempts_scheduled, s.new_intents, s.repeat_intents
        );
        let classes = self
            .status_classes
            .iter()
            .map(|(class, n)| format!("{class} {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            out,
            "  outcomes    ok {} ({} first, {} retries); errors {}: 409/ALREADY_EXISTS {}, other 4xx {}, 5xx {}, bad bodies {}, connect {}, transport {}, timeouts {} (abandoned {})",
            o.ok,
            o.ok_first_attempts,
            o.ok_retries,
            o.errors(),
            o.conflicts,
            o.client_errors,
            o.server_errors,
            o.bad_responses,
            o.connect_errors,
            o.transport_errors,
            o.timeouts,
            o.abandoned
        );
        let _ = writeln!(out, "  classes     {classes}");
        if !self.http_status.is_empty() || !self.grpc_codes.is_empty() {
            let http = self
                .http_status
                .iter()
                .map(|(c, n)| format!("{c} {n}"))
                .collect::<Vec<_>>()
                .join(", ");
            let grpc = self
                .grpc_codes
                .iter()
                .map(|(c, n)| format!("{c} {n}"))
                .collect::<Vec<_>>()
                .join(", ");
            let _ = writeln!(out, "  codes       http [{http}] grpc [{grpc}]");
        }
        let _ = writeln!(
            out,
            "  keys        {} succeeded, {} ambiguous (no success, a send that may have committed: no answer, 408, 5xx), {} failed ({} of them 409)",
            k.succeeded, k.ambiguous, k.failed, k.conflicted
        );
        let _ = writeln!(
            out,
            "  replay      {} later successes compared ({} across protocols): {} MISMATCHES",
            r.compared, r.cross_protocol, r.mismatches
        );
        for example in &r.examples {
            let _ = writeln!(out, "    mismatch: {example}");
        }
        for example in &self.bad_response_examples {
            let _ = writeln!(out, "    bad response: {example}");
        }
        let latency = |l: &LatencySummary| {
            format!(
                "n={} p50 {:.2} p90 {:.2} p99 {:.2} p99.9 {:.2} max {:.2} mean {:.2}",
                l.count, l.p50_ms, l.p90_ms, l.p99_ms, l.p999_ms, l.max_ms, l.mean_ms
            )
        };
        let line = |name: &str, l: &LatencySummary| format!("  {name:<11} {}\n", latency(l));
        out.push_str("  latency ms from the scheduled send instant (answered sends):\n");
        out.push_str(&line("all", &self.latency_ms.all));
        out.push_str(&line("first", &self.latency_ms.first_attempts));
        out.push_str(&line("retries", &self.latency_ms.retries));
        if let Some(hot) = &self.key_classes.hot {
            for (name, c) in [("hot", hot), ("cold", &self.key_classes.cold)] {
                let _ = writeln!(
                    out,
                    "  {name:<11} {}; sends {}, ok {}, errors {}, error retries {}, keys {} ({:.2} sends/key, {:.3} error retries/ok)",
                    latency(&c.latency_ms),
                    c.sends,
                    c.ok,
                    c.errors,
                    c.error_retries_sent,
                    c.keys_succeeded,
                    c.sends_per_key,
                    c.retries_per_success
                );
            }
        }
        if o.timeouts > 0 {
            let _ = writeln!(
                out,
                "  note        {} timed-out sends are not in the percentiles (each took >= --timeout-ms)",
                o.timeouts
            );
        }
        if o.conflicts > 0 {
            let _ = writeln!(
                out,
                "  warning     {} conflicts: bodies are deterministic, so a reused --key-prefix with another --seed (or a service bug)",
                o.conflicts
            );
        }
        if self.unfinished > 0 {
            let _ = writeln!(
                out,
                "  warning     {} sends still outstanding after the hard stop; not counted",
                self.unfinished
            );
        }
        out
    }

    /// Writes the report as pretty JSON.
    pub(crate) fn write_json(&self, path: &Path) -> anyhow::Result<()> {
        let file = create(path)?;
        let mut w = BufWriter::new(file);
        serde_json::to_writer_pretty(&mut w, self)
            .with_context(|| format!("write {}", path.display()))?;
        w.write_all(b"\n")
            .and_then(|()| w.flush())
            .with_context(|| format!("write {}", path.display()))
    }
}

fn create(path: &Path) -> anyhow::Result<File> {
    File::create(path).with_context(|| format!("create {}", path.display()))
}
