//! The run's seconds as CSV: one row a second (`--csv`), one a minute
//! (`--minute-csv`).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use hdrhistogram::Histogram;

use super::ms;
use crate::stats::Second;

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
