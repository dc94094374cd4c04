//! The end of a run: the report (human summary on stdout, the same as JSON),
//! the per-second CSV and the ground-truth key files.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::Context;
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::config::Params;
use crate::keys::KeySpace;
use crate::stats::{ClassStats, Collector, KeyCounts, OutcomeCounts, ReplayCounts, Second};
use crate::targets::TargetReport;

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

/// A CSV cell in milliseconds: `value` of the histogram, empty when there is
/// no histogram or nothing in it.
fn ms_cell(h: Option<&Histogram<u64>>, value: impl Fn(&Histogram<u64>) -> u64) -> String {
    h.filter(|h| !h.is_empty())
        .map(|h| format!("{:.3}", ms(value(h))))
        .unwrap_or_default()
}

/// The per-second CSV rows: `second,sent,ok,errors,p99_ms` (p99 empty when
/// nothing in that second was answered).
pub(crate) fn csv_text(seconds: &[Second]) -> String {
    let mut out = String::from("second,sent,ok,errors,p99_ms\n");
    for (i, s) in seconds.iter().enumerate() {
        let p99 = ms_cell(s.latency.as_ref(), |h| h.value_at_quantile(0.99));
        let _ = writeln!(out, "{i},{},{},{},{p99}", s.sent, s.ok, s.errors);
    }
    out
}

/// Writes the per-second CSV.
pub(crate) fn write_csv(path: &Path, seconds: &[Second]) -> anyhow::Result<()> {
    std::fs::write(path, csv_text(seconds)).with_context(|| format!("write {}", path.display()))
}

/// The per-minute CSV rows: `minute,sent,ok,errors,sent_per_s,p50_ms,p99_ms,p999_ms,max_ms`,
/// the per-second rows of each minute merged (percentiles empty when nothing
/// in that minute was answered). The last minute's rate is over the seconds
/// it has.
pub(crate) fn minute_csv_text(seconds: &[Second]) -> String {
    let mut out = String::from("minute,sent,ok,errors,sent_per_s,p50_ms,p99_ms,p999_ms,max_ms\n");
    for (minute, chunk) in seconds.chunks(60).enumerate() {
        let (mut sent, mut ok, mut errors) = (0, 0, 0);
        let mut merged: Option<Histogram<u64>> = None;
        for s in chunk {
            sent += s.sent;
            ok += s.ok;
            errors += s.errors;
            if let Some(h) = &s.latency {
                match &mut merged {
                    Some(m) => {
                        // Same bounds and precision: adding cannot fail.
                        let _ = m.add(h);
                    }
                    None => merged = Some(h.clone()),
                }
            }
        }
        let q = |p: f64| ms_cell(merged.as_ref(), |h| h.value_at_quantile(p));
        let max = ms_cell(merged.as_ref(), Histogram::max);
        let rate = sent as f64 / chunk.len().max(1) as f64;
        let _ = writeln!(
            out,
            "{minute},{sent},{ok},{errors},{rate:.1},{},{},{},{max}",
            q(0.5),
            q(0.99),
            q(0.999)
        );
    }
    out
}

/// Writes the per-minute CSV.
pub(crate) fn write_minute_csv(path: &Path, seconds: &[Second]) -> anyhow::Result<()> {
    std::fs::write(path, minute_csv_text(seconds))
        .with_context(|| format!("write {}", path.display()))
}

/// The ground-truth files' lines, each sorted by key (byte order, like
/// `LC_ALL=C sort`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct KeyLines {
    /// `key\torder_id` of every key that got a success: exactly that order.
    pub(crate) intents: Vec<String>,
    /// Keys without a success with a send that may have committed: 0 or 1 order.
    pub(crate) ambiguous: Vec<String>,
    /// Keys refused before anything was written, or never sent: no order.
    pub(crate) failed: Vec<String>,
}

/// The ground truth of the run: every key in the file its fate puts it in
/// (a key answered 409 in none: it belongs to another request). With
/// `caller` (the token's), each line ends with a tab and it: the scope of
/// the keys.
pub(crate) fn key_lines(collector: &Collector, keys: &KeySpace, caller: Option<&str>) -> KeyLines {
    let mut lines = KeyLines::default();
    let scoped = |line: String| match caller {
        Some(caller) => format!("{line}\t{caller}"),
        None => line,
    };
    for (&index, state) in &collector.keys {
        if let Some(order_id) = state.order_id() {
            lines
                .intents
                .push(scoped(format!("{}\t{order_id}", keys.key(index))));
        } else if state.is_ambiguous() {
            lines.ambiguous.push(scoped(keys.key(index)));
        } else if state.is_refused() {
            lines.failed.push(scoped(keys.key(index)));
        }
    }
    lines.intents.sort_unstable();
    lines.ambiguous.sort_unstable();
    lines.failed.sort_unstable();
    lines
}

/// Writes lines to `path`.
pub(crate) fn write_lines(path: &Path, lines: &[String]) -> anyhow::Result<()> {
    let mut w = BufWriter::new(create(path)?);
    for line in lines {
        w.write_all(line.as_bytes())
            .and_then(|()| w.write_all(b"\n"))
            .with_context(|| format!("write {}", path.display()))?;
    }
    w.flush()
        .with_context(|| format!("write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::HeaderValue;
    use uuid::Uuid;

    use super::*;
    use crate::config::{Protocol, Spread};
    use crate::outcome::{Answer, HttpReply, Outcome, Success};
    use crate::stats::{SendKind, new_histogram};

    fn params() -> Params {
        Params {
            protocol: Protocol::Mixed,
            http_urls: vec!["http://h".into()],
            grpc_urls: vec!["http://g".into()],
            spread: Spread::RoundRobin,
            rate: 100.0,
            duration_s: 2,
            max_in_flight: 10,
            timeout_ms: 2000,
            drain_timeout_s: 10,
            zipf_s: 0.0,
            keys: 5,
            hot_keys: 0,
            hot_share: 0.5,
            key_prefix: "pfx".into(),
            seed: 1,
            retry_rate: 0.15,
            retry_delay_ms: 200,
            retry_on_error: 0,
            retry_on_error_delay_ms: 200,
            threads: 1,
        }
    }

    fn facts(interrupted: bool) -> RunFacts {
        RunFacts {
            params: params(),
            started_at_unix_ms: 0,
            interrupted,
            ended_early: false,
            window_s: 2.0,
            elapsed_s: 2.5,
            sends: SendCounts {
                first_attempts_scheduled: 200,
                first_attempts_sent: 200,
                sent: 230,
                ..SendCounts::default()
            },
            unfinished: 0,
            targets: vec![],
        }
    }

    fn ok(id: Uuid) -> Outcome {
        Outcome::Ok(Success {
            order_id: id,
            status: "created".into(),
            http: Some(HttpReply {
                status: 201,
                body: Bytes::from(format!(r#"{{"order_id":"{id}","status":"created"}}"#)),
                location: None,
                etag: Some(HeaderValue::from_static("\"e\"")),
            }),
        })
    }

    #[test]
    fn percentiles_in_milliseconds() {
        let mut h = new_histogram();
        for us in 1..=1000 {
            h.saturating_record(us * 1000); // 1..=1000 ms
        }
        let s = LatencySummary::from_histogram(&h);
        assert_eq!(s.count, 1000);
        let close = |a: f64, b: f64| (a - b).abs() <= b * 0.002;
        assert!(close(s.p50_ms, 500.0), "{s:?}");
        assert!(close(s.p90_ms, 900.0), "{s:?}");
        assert!(close(s.p99_ms, 990.0), "{s:?}");
        assert!(close(s.p999_ms, 999.0), "{s:?}");
        assert!(close(s.max_ms, 1000.0), "{s:?}");
        assert!(close(s.mean_ms, 500.5), "{s:?}");
        let empty = LatencySummary::from_histogram(&new_histogram());
        assert_eq!(empty.count, 0);
        assert!(empty.max_ms.abs() < f64::EPSILON);
    }

    #[test]
    fn report_assembles_rates_and_exit_codes() {
        let mut c = Collector::new();
        let id = Uuid::now_v7();
        c.record(1, "pfx-1", SendKind::First, 0, &ok(id), 2_000);
        c.record(1, "pfx-1", SendKind::Retry, 0, &ok(id), 3_000);
        c.record(
            2,
            "pfx-2",
            SendKind::First,
            0,
            &Outcome::Failed(Answer::Http(503)),
            1_000,
        );
        let report = Report::assemble(facts(false), &c);
        assert_eq!(report.exit_code, 0);
        assert!((report.rates.achieved - 1.5).abs() < 1e-9);
        assert!((report.rates.ok - 1.0).abs() < 1e-9);
        assert!((report.rates.offered_sends - 115.0).abs() < 1e-9);
        assert_eq!(report.http_status.get("201"), Some(&2));
        assert_eq!(report.latency_ms.all.count, 3);
        assert_eq!(report.latency_ms.first_attempts.count, 2);
        assert_eq!(report.keys.succeeded, 1);
        let json = serde_json::to_value(&report).expect("json");
        assert_eq!(json["schema"], "loadgen.report.v1");
        assert_eq!(json["params"]["protocol"], "mixed");
        assert_eq!(json["replay"]["mismatches"], 0);
        assert_eq!(json["outcomes"]["server_errors"], 1);
        assert!(json["latency_ms"]["all"]["p99_ms"].is_f64());
        let text = report.summary();
        assert!(text.contains("0 MISMATCHES"), "{text}");
        assert!(text.contains("prefix pfx"), "{text}");
        // Without --hot-keys every send is cold and there is no hot class.
        assert!(json["key_classes"].get("hot").is_none(), "{json}");
        assert_eq!(json["key_classes"]["cold"]["sends"], 3);
        assert_eq!(json["key_classes"]["cold"]["keys_succeeded"], 1);
        assert_eq!(json["params"]["hot_keys"], 0);
        assert!(!text.contains("  hot "), "{text}");
        assert!(!text.contains("  cold "), "{text}");
        assert!(!text.contains("instances"), "one instance: {text}");

        // Several orders instances: each one's sends, in the JSON and the text.
        let mut spread = facts(false);
        spread.targets = ["http://a:1", "http://b:2"]
            .iter()
            .enumerate()
            .map(|(i, url)| TargetReport {
                protocol: "http",
                url: (*url).to_owned(),
                sent: 10 + i as u64,
                ok: 9,
            })
            .collect();
        let mut one_each = spread.clone();
        one_each.targets[1].protocol = "grpc";
        let report = Report::assemble(spread, &c);
        let json = serde_json::to_value(&report).expect("json");
        assert_eq!(json["targets"][1]["url"], "http://b:2");
        assert_eq!(json["targets"][1]["sent"], 11);
        let text = report.summary();
        assert!(
            text.contains(
                "instances   http://a:1 (http) 10 sent 9 ok; http://b:2 (http) 11 sent 9 ok (--spread round-robin)"
            ),
            "{text}"
        );
        // One instance per protocol is not a spread: no line.
        let text = Report::assemble(one_each, &c).summary();
        assert!(!text.contains("instances"), "{text}");

        assert_eq!(
            Report::assemble(facts(true), &c).exit_code,
            EXIT_INTERRUPTED
        );
        c.record(1, "pfx-1", SendKind::Retry, 0, &ok(Uuid::now_v7()), 1);
        let report = Report::assemble(facts(true), &c);
        assert_eq!(
            report.exit_code, EXIT_MISMATCH,
            "mismatches win over interrupt"
        );
        assert!(report.summary().contains("mismatch: key pfx-1"));
    }

    #[test]
    fn report_splits_hot_and_cold_keys() {
        let mut c = Collector::with_hot_keys(10);
        let (a, b, d) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        // Hot key 3: four sends of one intent (one a 503, resent), 1..4 ms.
        c.record(3, "pfx-3", SendKind::First, 0, &ok(a), 1_000);
        c.record(3, "pfx-3", SendKind::First, 0, &ok(a), 2_000);
        c.record(
            3,
            "pfx-3",
            SendKind::First,
            0,
            &Outcome::Failed(Answer::Http(503)),
            3_000,
        );
        c.record_error_retry(3);
        c.record(3, "pfx-3", SendKind::Retry, 0, &ok(a), 4_000);
        // Hot key 10, the last hot one: one success.
        c.record(10, "pfx-10", SendKind::First, 0, &ok(b), 8_000);
        // Cold key 11: one success; cold key 12: a timeout, no latency.
        c.record(11, "pfx-11", SendKind::First, 0, &ok(d), 500);
        c.record(
            12,
            "pfx-12",
            SendKind::First,
            0,
            &Outcome::Timeout,
            2_000_000,
        );
        let mut facts = facts(false);
        facts.params.hot_keys = 10;
        facts.params.hot_share = 0.8;
        let report = Report::assemble(facts, &c);

        let hot = report.key_classes.hot.expect("hot class");
        assert_eq!((hot.sends, hot.ok, hot.errors), (5, 4, 1));
        assert_eq!((hot.error_retries_sent, hot.keys_succeeded), (1, 2));
        assert!((hot.sends_per_key - 2.5).abs() < 1e-9);
        assert!((hot.retries_per_success - 0.25).abs() < 1e-9);
        assert_eq!(hot.latency_ms.count, 5);
        assert!((hot.latency_ms.max_ms - 8.0).abs() < 0.01);
        let cold = report.key_classes.cold;
        assert_eq!((cold.sends, cold.ok, cold.errors), (2, 1, 1));
        assert_eq!((cold.error_retries_sent, cold.keys_succeeded), (0, 1));
        assert!((cold.sends_per_key - 2.0).abs() < 1e-9);
        assert!(cold.retries_per_success.abs() < f64::EPSILON);
        assert_eq!(cold.latency_ms.count, 1);
        assert_eq!(hot.sends + cold.sends, report.outcomes.completed);

        let json = serde_json::to_value(&report).expect("json");
        assert_eq!(json["schema"], "loadgen.report.v1");
        assert_eq!(json["params"]["hot_keys"], 10);
        assert_eq!(json["params"]["hot_share"], 0.8);
        let classes = &json["key_classes"];
        for field in [
            "sends",
            "ok",
            "errors",
            "error_retries_sent",
            "keys_succeeded",
            "sends_per_key",
            "retries_per_success",
        ] {
            assert!(classes["hot"][field].is_number(), "hot {field}: {json}");
            assert!(classes["cold"][field].is_number(), "cold {field}: {json}");
        }
        assert_eq!(classes["hot"]["sends_per_key"], 2.5);
        assert_eq!(classes["cold"]["retries_per_success"], 0.0);
        for field in ["count", "p50_ms", "p99_ms", "p999_ms", "max_ms"] {
            assert!(classes["hot"]["latency_ms"][field].is_number(), "{json}");
            assert!(classes["cold"]["latency_ms"][field].is_number(), "{json}");
        }
        // The same shape as the overall latency summaries.
        let keys = |v: &serde_json::Value| {
            v.as_object()
                .map(|o| o.keys().cloned().collect::<Vec<_>>())
                .unwrap_or_default()
        };
        assert_eq!(
            keys(&classes["hot"]["latency_ms"]),
            keys(&json["latency_ms"]["all"])
        );

        let text = report.summary();
        assert!(
            text.contains("hot 1..=10 (uniform) for a share 0.8"),
            "{text}"
        );
        let hot_line = text
            .lines()
            .find(|l| l.starts_with("  hot "))
            .expect("a hot line");
        assert!(hot_line.contains("n=5 "), "{hot_line}");
        assert!(
            hot_line.contains("sends 5, ok 4, errors 1, error retries 1, keys 2 (2.50 sends/key, 0.250 error retries/ok)"),
            "{hot_line}"
        );
        let cold_line = text
            .lines()
            .find(|l| l.starts_with("  cold "))
            .expect("a cold line");
        assert!(cold_line.contains("sends 2, ok 1, errors 1"), "{cold_line}");
    }

    #[test]
    fn csv_has_the_fixed_columns() {
        let mut c = Collector::new();
        c.record(1, "p-1", SendKind::First, 0, &ok(Uuid::now_v7()), 4_000);
        c.record(
            2,
            "p-2",
            SendKind::First,
            2_100_000_000,
            &Outcome::Timeout,
            2_000_000,
        );
        let text = csv_text(&c.seconds);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "second,sent,ok,errors,p99_ms");
        // The per-second histograms keep 2 significant digits: within 1%.
        let row0: Vec<&str> = lines[1].split(',').collect();
        assert_eq!(row0[..4], ["0", "1", "1", "0"]);
        let p99: f64 = row0[4].parse().expect("p99 number");
        assert!((p99 - 4.0).abs() <= 0.04, "{p99}");
        assert_eq!(lines[2], "1,0,0,0,", "an empty second has no p99");
        assert_eq!(lines[3], "2,1,0,1,", "a timeout has no latency");
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn minute_csv_merges_the_seconds_of_each_minute() {
        let mut c = Collector::new();
        // Minute 0: 4 ms at second 0, 40 ms at second 59; minute 1: a
        // timeout at second 61 and 1 ms at second 62.
        c.record(1, "p-1", SendKind::First, 0, &ok(Uuid::now_v7()), 4_000);
        c.record(
            2,
            "p-2",
            SendKind::First,
            59_000_000_000,
            &ok(Uuid::now_v7()),
            40_000,
        );
        c.record(
            3,
            "p-3",
            SendKind::First,
            61_000_000_000,
            &Outcome::Timeout,
            2_000_000,
        );
        c.record(
            4,
            "p-4",
            SendKind::First,
            62_000_000_000,
            &ok(Uuid::now_v7()),
            1_000,
        );
        let text = minute_csv_text(&c.seconds);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "minute,sent,ok,errors,sent_per_s,p50_ms,p99_ms,p999_ms,max_ms"
        );
        let row0: Vec<&str> = lines[1].split(',').collect();
        assert_eq!(row0[..5], ["0", "2", "2", "0", "0.0"]);
        let num = |v: &str| v.parse::<f64>().expect("a number");
        assert!((num(row0[5]) - 4.0).abs() <= 0.04, "{}", lines[1]);
        assert!((num(row0[6]) - 40.0).abs() <= 0.4, "{}", lines[1]);
        let row1: Vec<&str> = lines[2].split(',').collect();
        // Seconds 60..=62 exist: 2 sends over 3 seconds.
        assert_eq!(row1[..5], ["1", "2", "1", "1", "0.7"]);
        assert!((num(row1[6]) - 1.0).abs() <= 0.01, "{}", lines[2]);
        assert_eq!(lines.len(), 3);
    }

    #[test]
    fn key_files_are_sorted_and_split() {
        let space = KeySpace::new("p".into(), 1);
        let mut c = Collector::new();
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        c.record(10, "p-10", SendKind::First, 0, &ok(a), 1);
        c.record(9, "p-9", SendKind::First, 0, &ok(b), 1);
        c.record(3, "p-3", SendKind::First, 0, &Outcome::Timeout, 1);
        c.record(4, "p-4", SendKind::First, 0, &Outcome::ConnectError, 1);
        // The route timed out with the create already in a batch: 408, and
        // the key may hold its order.
        let timed_out = Outcome::Failed(Answer::Http(408));
        c.record(5, "p-5", SendKind::First, 0, &timed_out, 1);
        // A 503 then a connection refused: the 503 may hide a commit.
        c.record(
            6,
            "p-6",
            SendKind::First,
            0,
            &Outcome::Failed(Answer::Http(503)),
            1,
        );
        c.record(6, "p-6", SendKind::Retry, 0, &Outcome::ConnectError, 1);
        // A 503 resolved by its retry's success.
        c.record(
            7,
            "p-7",
            SendKind::First,
            0,
            &Outcome::Failed(Answer::Http(500)),
            1,
        );
        c.record(7, "p-7", SendKind::Retry, 0, &ok(a), 1);
        // Refused for good: nothing written.
        c.record(
            8,
            "p-8",
            SendKind::First,
            0,
            &Outcome::Failed(Answer::Http(400)),
            1,
        );
        // Bound to another request: in no file.
        c.record(
            11,
            "p-11",
            SendKind::First,
            0,
            &Outcome::Failed(Answer::Http(409)),
            1,
        );
        let lines = key_lines(&c, &space, None);
        assert_eq!(
            lines.intents,
            vec![
                format!("p-10\t{a}"),
                format!("p-7\t{a}"),
                format!("p-9\t{b}")
            ]
        );
        assert_eq!(lines.ambiguous, vec!["p-3", "p-5", "p-6"]);
        assert_eq!(lines.failed, vec!["p-4", "p-8"]);
        // With a token, every line names its caller: the keys' scope.
        let scoped = key_lines(&c, &space, Some("shop"));
        assert_eq!(scoped.intents[0], format!("p-10\t{a}\tshop"));
        assert_eq!(scoped.ambiguous[0], "p-3\tshop");
        assert_eq!(scoped.failed, vec!["p-4\tshop", "p-8\tshop"]);
        let counts = c.key_counts();
        assert_eq!(
            (
                counts.succeeded,
                counts.ambiguous,
                counts.failed,
                counts.conflicted
            ),
            (3, 3, 3, 1)
        );
    }
}
