//! Reading the services' counters from their `GET /metrics`.
//!
//! A counter restarts at 0 with every process life, so chaos keeps the last
//! value seen in each life and sums the lives. A life that is SIGKILLed loses
//! what it counted after the last scrape (at most one scrape interval), so
//! the sums are lower bounds; recon, not these counters, is the proof.

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use anyhow::Context;

use pipeline::contract::{
    INJECTED_DUPLICATE_LABEL, InjectedDuplicate, ORDERS_WRITE_BATCH_SIZE, ORDERS_WRITE_ERROR_LABEL,
    ORDERS_WRITE_ERRORS_TOTAL, PAYMENTS_AFTER_HORIZON_TOTAL, PAYMENTS_APPLIED_AFTER_HORIZON_TOTAL,
    PAYMENTS_CHARGES_TOTAL, PAYMENTS_CONSUMED_TOTAL, PAYMENTS_DEAD_LETTERS_TOTAL,
    PAYMENTS_DEDUP_HITS_TOTAL, PAYMENTS_DEDUP_MISSES_TOTAL, PAYMENTS_INJECTED_DUPLICATES_TOTAL,
    PAYMENTS_PARTITIONS_MOVED_TOTAL, PAYMENTS_WEBHOOK_REQUESTS_TOTAL, RELAY_PUBLISHED_TOTAL,
    RELAY_WEBHOOK_ATTEMPTS_TOTAL, ServiceName, WEBHOOK_OUTCOME_LABEL,
};

/// The counters chaos reports: (series as exposed, summary name). The names
/// are the services' contract ([`pipeline::contract`]), so a renamed metric
/// fails to compile here rather than reading as zero.
pub static COUNTERS: LazyLock<Vec<(String, &'static str)>> = LazyLock::new(|| {
    let injected = |kind: InjectedDuplicate| {
        format!(
            "{PAYMENTS_INJECTED_DUPLICATES_TOTAL}{{{INJECTED_DUPLICATE_LABEL}=\"{}\"}}",
            kind.as_str()
        )
    };
    let write_errors = |kind: &str| {
        format!("{ORDERS_WRITE_ERRORS_TOTAL}{{{ORDERS_WRITE_ERROR_LABEL}=\"{kind}\"}}")
    };
    let webhook_requests = |outcome: &str| {
        format!("{PAYMENTS_WEBHOOK_REQUESTS_TOTAL}{{{WEBHOOK_OUTCOME_LABEL}=\"{outcome}\"}}")
    };
    let webhook_attempts = |outcome: &str| {
        format!(
            "{RELAY_WEBHOOK_ATTEMPTS_TOTAL}{{destination=\"payments\",{WEBHOOK_OUTCOME_LABEL}=\"{outcome}\"}}"
        )
    };
    vec![
        (progress_counter(ServiceName::Orders), "write_batches"),
        (write_errors("deadlock"), "write_deadlocks"),
        (
            write_errors("serialization"),
            "write_serialization_failures",
        ),
        (write_errors("lock_timeout"), "write_lock_timeouts"),
        (progress_counter(ServiceName::Relay), "published"),
        (progress_counter(ServiceName::Payments), "consumed"),
        (PAYMENTS_DEDUP_HITS_TOTAL.to_owned(), "inbox_hits"),
        (PAYMENTS_DEDUP_MISSES_TOTAL.to_owned(), "inbox_misses"),
        (PAYMENTS_CHARGES_TOTAL.to_owned(), "charges"),
        (PAYMENTS_DEAD_LETTERS_TOTAL.to_owned(), "dead_letters"),
        (PAYMENTS_AFTER_HORIZON_TOTAL.to_owned(), "after_horizon"),
        (
            PAYMENTS_APPLIED_AFTER_HORIZON_TOTAL.to_owned(),
            "applied_after_horizon",
        ),
        (moved_series("assigned"), "partitions_assigned"),
        (moved_series("revoked"), "partitions_revoked"),
        (injected(InjectedDuplicate::Reprocess), "injected_reprocess"),
        (injected(InjectedDuplicate::Redeliver), "injected_redeliver"),
        // --transport http: retries the receiver answered as duplicates, and
        // the sender's attempts (its one destination is `payments`).
        (webhook_requests("duplicate"), "webhook_duplicates"),
        (webhook_requests("accepted"), "webhook_accepted"),
        (webhook_attempts("retry"), "webhook_retries"),
        (webhook_attempts("failed"), "webhook_failed"),
    ]
});

/// The counter whose first increase in a new life counts as "working again".
pub fn progress_counter(service: ServiceName) -> String {
    match service {
        ServiceName::Orders => format!("{ORDERS_WRITE_BATCH_SIZE}_count"),
        ServiceName::Relay => RELAY_PUBLISHED_TOTAL.to_owned(),
        ServiceName::Payments => PAYMENTS_CONSUMED_TOTAL.to_owned(),
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

/// The client for the services' `/metrics` (readiness and scrapes): a short
/// timeout, so a dying process never stalls a supervisor or the scraper.
pub fn http_client() -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .context("http client")
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

/// The partitions a payments life owns now, from its counters: assigned
/// minus revoked (each life starts owning none).
pub fn owned_partitions(life: &BTreeMap<String, f64>) -> Option<f64> {
    let get = |event| life.get(&moved_series(event));
    Some(get("assigned")? - get("revoked").copied().unwrap_or(0.0))
}

/// The series of [`PAYMENTS_PARTITIONS_MOVED_TOTAL`] for `event`
/// (`assigned`, `revoked`).
fn moved_series(event: &str) -> String {
    format!("{PAYMENTS_PARTITIONS_MOVED_TOTAL}{{event=\"{event}\"}}")
}

/// Sums per-life counters into the summary names of [`COUNTERS`].
pub fn sum_lives<'a>(
    lives: impl IntoIterator<Item = &'a BTreeMap<String, f64>>,
) -> BTreeMap<&'static str, f64> {
    let mut totals = BTreeMap::new();
    for life in lives {
        for (series, name) in COUNTERS.iter() {
            if let Some(v) = life.get(series) {
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

    #[test]
    fn a_life_owns_what_was_assigned_and_not_revoked() {
        let m = parse(
            "payments_partitions_moved_total{event=\"assigned\"} 8\n\
             payments_partitions_moved_total{event=\"revoked\"} 6\n",
        );
        assert_eq!(owned_partitions(&m), Some(2.0));
        assert_eq!(
            owned_partitions(&parse("payments_consumed_total 1\n")),
            None
        );
    }
}
