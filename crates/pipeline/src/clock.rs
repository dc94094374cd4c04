//! Whose clock is it: a service's clock against the database's.
//!
//! Times cross processes in this pipeline. The orders service mints every
//! order id and msg_id as a UUIDv7 with **its own** clock; the stores expire
//! by comparing those ids with **the database's** `now()`, and payments files
//! a msg_id into the inbox partition of its mint time. A service whose clock
//! is far from the database's shifts every one of those comparisons: a slow
//! orders clock made ids look older than they were (keys expired early, a
//! retry became a second order). The stores now keep each record its full
//! retention by the database's clock alone; this module makes the remaining
//! dependence visible and bounded:
//!
//! - [`measure`] reads the database's clock once and returns the skew
//!   (database minus local, the round trip's midpoint taken as the moment
//!   the database read it; the error is at most half the round trip);
//! - [`Bounds::judge`] says whether a skew is fine, worth a warning, or past
//!   the refusal bound: a service refuses to start past it and warns while
//!   running past the warning bound;
//! - [`watch`] measures on an interval, sets a gauge and logs.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// The default warning bound: a host synchronised by NTP stays within
/// milliseconds of its database; a second means its time service is off.
pub const DEFAULT_WARN: Duration = Duration::from_secs(1);

/// The default refusal bound: a minute. It must stay below payments'
/// `--clock-skew` allowance (5 minutes), the term of the redelivery horizon
/// that covers mint times taken by another host's clock.
pub const DEFAULT_REFUSE: Duration = Duration::from_secs(60);

/// How often [`watch`] measures.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(60);

/// A measured skew: the database's clock minus this process's, in seconds
/// (positive: the database is ahead, this clock is slow).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Skew {
    /// Database minus local, seconds.
    pub seconds: f64,
    /// The round trip of the measurement, seconds: the error is at most half.
    pub round_trip: f64,
}

/// What a skew means against [`Bounds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within the warning bound.
    Fine,
    /// Past the warning bound, within the refusal bound: log it.
    Warn,
    /// Past the refusal bound: a starting service refuses to run.
    Refuse,
}

/// The two bounds of a skew.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Past this: a warning.
    pub warn: Duration,
    /// Past this: refused at start-up.
    pub refuse: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            warn: DEFAULT_WARN,
            refuse: DEFAULT_REFUSE,
        }
    }
}

impl Bounds {
    /// Judges `skew` (its size, either sign). The measurement's own error
    /// (half the round trip) is given to the clock: only a skew past a bound
    /// by more than that counts.
    pub fn judge(&self, skew: Skew) -> Verdict {
        let size = (skew.seconds.abs() - skew.round_trip / 2.0).max(0.0);
        if size > self.refuse.as_secs_f64() {
            Verdict::Refuse
        } else if size > self.warn.as_secs_f64() {
            Verdict::Warn
        } else {
            Verdict::Fine
        }
    }

    /// The refusal message for `service` at `skew`.
    pub fn refusal(&self, service: &str, skew: Skew) -> String {
        format!(
            "{service}'s clock differs from the database's by {:+.1} s (database minus {service}), \
             more than the {} s this service accepts: the ids it mints carry its clock's time, \
             and the stores expire them by the database's. Fix the host's time synchronisation \
             (chrony, systemd-timesyncd), or raise the bound if this skew is known and intended",
            skew.seconds,
            self.refuse.as_secs()
        )
    }
}

/// Reads the database's clock once and returns the skew against `local`
/// (this process's clock; a parameter so that tests can shift it).
pub async fn measure(pool: &PgPool, local: impl Fn() -> SystemTime) -> sqlx::Result<Skew> {
    let before = local();
    let db: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(pool)
        .await?;
    let after = local();
    let secs = |t: SystemTime| {
        t.duration_since(UNIX_EPOCH)
            .map_or_else(|e| -e.duration().as_secs_f64(), |d| d.as_secs_f64())
    };
    let (b, a) = (secs(before), secs(after));
    Ok(Skew {
        seconds: db - (b + a) / 2.0,
        round_trip: (a - b).max(0.0),
    })
}

/// Measures at start-up: refuses (an error) past `bounds.refuse`, warns past
/// `bounds.warn`; sets `gauge` to the skew in seconds. A database that is
/// unavailable (a failover, a crash just after the service connected) is
/// waited for up to `patience`, as at connect ([`crate::db::patiently`]);
/// a measurement that still fails is an error.
pub async fn check_at_start(
    service: &str,
    pool: &PgPool,
    bounds: Bounds,
    patience: Duration,
    gauge: &prometheus::Gauge,
    local: impl Fn() -> SystemTime,
) -> anyhow::Result<Skew> {
    let skew = crate::db::patiently(patience, || measure(pool, &local))
        .await
        .context("measure the database's clock")?;
    gauge.set(skew.seconds);
    match report(bounds, skew) {
        Verdict::Refuse => anyhow::bail!(bounds.refusal(service, skew)),
        Verdict::Fine => {
            tracing::info!(
                skew_seconds = skew.seconds,
                "clock agrees with the database's"
            )
        }
        Verdict::Warn => {}
    }
    Ok(skew)
}

/// Judges `skew` and logs a warning past the warning bound; the caller
/// decides what a refusal means (at start-up, not to run).
fn report(bounds: Bounds, skew: Skew) -> Verdict {
    let verdict = bounds.judge(skew);
    if verdict != Verdict::Fine {
        tracing::warn!(
            skew_seconds = skew.seconds,
            warn_secs = bounds.warn.as_secs_f64(),
            refuse_secs = bounds.refuse.as_secs_f64(),
            "clock differs from the database's (database minus this host); ids minted here carry this clock's time"
        );
    }
    verdict
}

/// Measures every [`WATCH_INTERVAL`] until `cancel`: sets `gauge`, warns past
/// `bounds.warn`, logs an error past `bounds.refuse` (a running service
/// goes on: stopping would not make its clock right, and the stores keep
/// every record its full retention by the database's clock).
pub async fn watch(
    bounds: Bounds,
    pool: PgPool,
    gauge: prometheus::Gauge,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(WATCH_INTERVAL) => {}
            () = cancel.cancelled() => return,
        }
        match measure(&pool, SystemTime::now).await {
            Ok(skew) => {
                gauge.set(skew.seconds);
                if report(bounds, skew) == Verdict::Refuse {
                    tracing::error!(
                        skew_seconds = skew.seconds,
                        "clock differs from the database's past the bound this service refuses at start-up"
                    );
                }
            }
            Err(error) => tracing::debug!(%error, "measure the clock skew"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skew(seconds: f64, round_trip: f64) -> Skew {
        Skew {
            seconds,
            round_trip,
        }
    }

    #[test]
    fn a_skew_is_judged_by_its_size_less_the_measurements_error() {
        let b = Bounds::default();
        assert_eq!(b.judge(skew(0.002, 0.001)), Verdict::Fine);
        assert_eq!(b.judge(skew(-1.5, 0.001)), Verdict::Warn);
        assert_eq!(b.judge(skew(1.5, 0.001)), Verdict::Warn);
        // 1.2 s measured over a 1 s round trip may be 0.7 s: not a warning.
        assert_eq!(b.judge(skew(1.2, 1.0)), Verdict::Fine);
        assert_eq!(b.judge(skew(-660.0, 0.001)), Verdict::Refuse);
        assert_eq!(b.judge(skew(61.0, 0.001)), Verdict::Refuse);
        assert!(b.refusal("orders", skew(-660.0, 0.0)).contains("-660.0 s"));
    }
}
