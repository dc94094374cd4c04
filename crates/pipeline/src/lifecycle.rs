//! Expiry of a store that deletes in batches (the outbox's published rows,
//! the idempotency keys): a SQL function deletes at most `batch` expired rows
//! per call and moves the store's floor once none are left
//! (migrations/20261124000002_outbox_and_keys_expiry.sql). Small batches, each
//! its own short transaction, keep the deletes a trickle alongside the writes
//! instead of one long statement.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// Rows a call deletes at most.
pub const BATCH: i32 = 5_000;

/// How often a service expires its store.
pub const INTERVAL: Duration = Duration::from_secs(60);

/// The outbox's retention (`orders.outbox_policy`): the relay deletes
/// published rows by it, payments adds it to its redelivery horizon.
pub async fn outbox_retention(pool: &sqlx::PgPool) -> sqlx::Result<Duration> {
    let secs = sqlx::query_scalar!(
        r#"SELECT extract(epoch FROM retention)::float8 AS "secs!" FROM orders.outbox_policy"#
    )
    .fetch_one(pool)
    .await?;
    Ok(Duration::from_secs_f64(secs.max(0.0)))
}

/// Calls `expire(batch)` until it deletes fewer than `batch` rows (or
/// `cancel` fires); returns the rows deleted.
pub async fn drain<F, Fut>(
    batch: i32,
    cancel: &CancellationToken,
    mut expire: F,
) -> sqlx::Result<u64>
where
    F: FnMut(i32) -> Fut,
    Fut: Future<Output = sqlx::Result<i32>>,
{
    let mut total = 0u64;
    while !cancel.is_cancelled() {
        let n = expire(batch).await?;
        total += u64::try_from(n).unwrap_or(0);
        if n < batch {
            break;
        }
    }
    Ok(total)
}

/// Every `interval` until `cancel` fires, [`drain`]s `expire`; counts the
/// rows deleted in `expired`. A failure is logged and the next round tries
/// again.
pub async fn every<F, Fut>(
    what: &'static str,
    interval: Duration,
    batch: i32,
    expired: prometheus::IntCounter,
    cancel: CancellationToken,
    mut expire: F,
) where
    F: FnMut(i32) -> Fut,
    Fut: Future<Output = sqlx::Result<i32>>,
{
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = cancel.cancelled() => return,
        }
        match drain(batch, &cancel, &mut expire).await {
            Ok(0) => {}
            Ok(n) => {
                expired.inc_by(n);
                tracing::info!(rows = n, "{what}: expired rows deleted");
            }
            Err(error) => tracing::warn!(%error, "{what}: expiry failed; retrying next round"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicI32, Ordering};

    use super::*;

    #[tokio::test]
    async fn drain_calls_until_a_short_batch() {
        let left = AtomicI32::new(12);
        let calls = AtomicI32::new(0);
        let total = drain(5, &CancellationToken::new(), |batch| {
            calls.fetch_add(1, Ordering::SeqCst);
            let n = left.load(Ordering::SeqCst).min(batch);
            left.fetch_sub(n, Ordering::SeqCst);
            async move { Ok(n) }
        })
        .await
        .expect("drain");
        assert_eq!(total, 12);
        assert_eq!(calls.load(Ordering::SeqCst), 3, "5 + 5 + 2");
    }
}
