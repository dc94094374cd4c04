//! What runs beside the relay's work in every mode: the backlog gauges
//! sampled, the WAL slot's retained bytes sampled, published rows expired.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::metrics::RelayMetrics;
use crate::{outbox, wal};

/// Deletes published outbox rows older than the outbox retention, a batch
/// at a time, every [`pipeline::lifecycle::INTERVAL`], until `cancel`.
pub(crate) fn spawn_outbox_expiry(
    pool: &PgPool,
    metrics: &RelayMetrics,
    cancel: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let pool = pool.clone();
    tokio::spawn(pipeline::lifecycle::every(
        "outbox",
        pipeline::lifecycle::INTERVAL,
        pipeline::lifecycle::BATCH,
        metrics.relay_outbox_expired_total.clone(),
        cancel.clone(),
        move |batch| {
            let pool = pool.clone();
            async move { outbox::expire(&pool, batch).await }
        },
    ))
}

/// `--mode wal`: samples the WAL the slot retains.
pub(crate) async fn sample_slot(
    pool: PgPool,
    slot: String,
    metrics: Arc<RelayMetrics>,
    every: Duration,
    cancel: CancellationToken,
) {
    loop {
        match wal::slot_state(&pool, &slot).await {
            Ok(Some(state)) => metrics
                .relay_wal_slot_retained_bytes
                .set(state.retained_bytes),
            Ok(None) => metrics.relay_wal_slot_retained_bytes.set(0),
            Err(error) => tracing::debug!(%error, "sample the replication slot"),
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = cancel.cancelled() => return,
        }
    }
}

/// How many times its own duration the backlog sampler waits between two
/// samples, at least: the count reads every pending row, so over a large
/// backlog one sample costs a backend's second or more.
const LAG_SAMPLE_DUTY: u32 = 5;

/// The wait after a backlog sample that took `took`: `every`, or longer when
/// the sample was slow, so that sampling keeps to at most 1 /
/// (1 + [`LAG_SAMPLE_DUTY`]) of one database backend. Over a 1M-row backlog
/// a sample took 1.2–1.5 s; taken every second, it kept a backend busy
/// throughout the drain it was measuring (FINDINGS §15).
fn lag_sample_wait(every: Duration, took: Duration) -> Duration {
    every.max(took.saturating_mul(LAG_SAMPLE_DUTY))
}

/// Samples the backlog gauges, every `every` or more ([`lag_sample_wait`]).
pub(crate) async fn sample_lag(
    pool: PgPool,
    metrics: Arc<RelayMetrics>,
    every: Duration,
    cancel: CancellationToken,
) {
    loop {
        let start = Instant::now();
        let lag = match pool.acquire().await {
            Ok(mut conn) => outbox::lag(&mut conn).await,
            Err(error) => Err(error),
        };
        // Waiting for a connection counts too: the workers hold them while
        // the database is busy.
        let took = start.elapsed();
        match lag {
            Ok((pending, age, failed)) => {
                metrics.outbox_pending_rows.set(pending);
                metrics.outbox_failed_rows.set(failed);
                metrics.outbox_oldest_pending_age_seconds.set(age);
            }
            Err(error) => tracing::debug!(%error, "sample outbox lag"),
        }
        tokio::select! {
            () = tokio::time::sleep(lag_sample_wait(every, took)) => {}
            () = cancel.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_backlog_sample_stretches_the_wait_to_its_duty() {
        let every = Duration::from_secs(1);
        assert_eq!(lag_sample_wait(every, Duration::from_millis(3)), every);
        assert_eq!(lag_sample_wait(every, Duration::from_millis(200)), every);
        assert_eq!(
            lag_sample_wait(every, Duration::from_millis(1_300)),
            Duration::from_millis(6_500)
        );
        assert_eq!(
            lag_sample_wait(Duration::from_millis(200), Duration::from_millis(100)),
            Duration::from_millis(500)
        );
    }
}
