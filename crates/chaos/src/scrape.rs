//! Reading the services' counters from their `GET /metrics`.
//!
//! A counter restarts at 0 with every process life, so chaos keeps the last
//! value seen in each life and sums the lives. A life that is SIGKILLed loses
//! what it counted after the last scrape (at most one scrape interval), so
//! the sums are lower bounds; recon, not these counters, is the proof.

use std::collections::BTreeMap;

/// The counters chaos reports, by service: (series as exposed, summary name).
pub const COUNTERS: &[(&str, &str)] = &[
    ("orders_write_batch_size_count", "write_batches"),
    ("relay_published_total", "published"),
    ("payments_consumed_total", "consumed"),
    ("payments_dedup_hits_total", "inbox_hits"),
    ("payments_dedup_misses_total", "inbox_misses"),
    ("payments_charges_total", "charges"),
    ("payments_dead_letters_total", "dead_letters"),
    (
        "payments_injected_duplicates_total{kind=\"reprocess\"}",
        "injected_reprocess",
    ),
    (
        "payments_injected_duplicates_total{kind=\"redeliver\"}",
        "injected_redeliver",
    ),
];

/// The counter whose first increase in a new life counts as "working again".
pub fn progress_counter(service: &str) -> Option<&'static str> {
    match service {
        "orders" => Some("orders_write_batch_size_count"),
        "relay" => Some("relay_published_total"),
        "payments" => Some("payments_consumed_total"),
        _ => None,
    }
}

/// Values of the series named in [`COUNTERS`] (and the progress counters)
/// found in a Prometheus text exposition. Unparsable lines are skipped.
pub fn parse(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if !COUNTERS.iter().any(|(name, _)| *name == series) {
            continue;
        }
        if let Ok(v) = value.trim().parse::<f64>() {
            out.insert(series.to_owned(), v);
        }
    }
    out
}

/// Fetches and parses `url` (a short timeout: a dying process must not stall
/// the scraper).
pub async fn fetch(client: &reqwest::Client, url: &str) -> Option<BTreeMap<String, f64>> {
    let response = client.get(url).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    Some(parse(&response.text().await.ok()?))
}

/// Sums per-life counters into the summary names of [`COUNTERS`].
pub fn sum_lives<'a>(
    lives: impl IntoIterator<Item = &'a BTreeMap<String, f64>>,
) -> BTreeMap<&'static str, f64> {
    let mut totals = BTreeMap::new();
    for life in lives {
        for (series, name) in COUNTERS {
            if let Some(v) = life.get(*series) {
                *totals.entry(*name).or_insert(0.0) += v;
            }
        }
    }
    totals
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP payments_consumed_total x\n\
        # TYPE payments_consumed_total counter\n\
        payments_consumed_total 120\n\
        payments_dedup_hits_total 7\n\
        payments_injected_duplicates_total{kind=\"reprocess\"} 3\n\
        payments_injected_duplicates_total{kind=\"redeliver\"} 4\n\
        process_cpu_seconds_total 1.5\n\
        garbage line without number x\n";

    #[test]
    fn parses_the_named_series_only() {
        let m = parse(TEXT);
        assert_eq!(m.get("payments_consumed_total"), Some(&120.0));
        assert_eq!(
            m.get("payments_injected_duplicates_total{kind=\"redeliver\"}"),
            Some(&4.0)
        );
        assert!(!m.contains_key("process_cpu_seconds_total"));
        assert_eq!(m.len(), 4);
    }

    #[test]
    fn lives_are_summed() {
        let a = parse(TEXT);
        let b = parse("payments_consumed_total 30\npayments_dedup_hits_total 1\n");
        let t = sum_lives([&a, &b]);
        assert_eq!(t.get("consumed"), Some(&150.0));
        assert_eq!(t.get("inbox_hits"), Some(&8.0));
        assert_eq!(t.get("injected_reprocess"), Some(&3.0));
        assert_eq!(t.get("charges"), None);
    }
}
