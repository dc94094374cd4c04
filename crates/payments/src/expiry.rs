//! The inbox's lifecycle: payments' inbox is the library's partitioned
//! inbox (`fx.partitioned_inbox`, consumer `payments`: partitions of msg_id
//! ranges created ahead and dropped when expired), the window a claim may
//! write, and the redelivery horizon's terms read from the database and the
//! broker.
//!
//! Expiry drops whole partitions: no delete storm, no bloat. A message older
//! than the oldest partition kept is refused ("after the dedup horizon"), one
//! minted beyond the newest is neither applied nor dropped until the
//! partitions reach it: over Kafka it is parked (`crate::park`; only its
//! order waits) unless minted further ahead than the clock skew (then a dead
//! letter `ahead_of_clock`), a webhook's claim stays unprocessed; see
//! [`judge`].

use std::sync::OnceLock;
use std::time::Duration;

use chrono::Utc;
use effectively::store::Inbox;
pub use effectively::store::Window;
use effectively::v7::mint_time;
use pipeline::config::KafkaArgs;
use sqlx::{PgPool, Postgres, Transaction};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::horizon::{Retention, Sources, TopicLifetime};
use crate::metrics::PaymentsMetrics;

/// Why a msg_id is outside the [`Window`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outside {
    /// Below the oldest partition kept: after the dedup horizon.
    AfterHorizon,
    /// At or beyond the end of the partitions created so far: a UUIDv7
    /// minted ahead of them, recordable once they reach it.
    Future,
    /// At or beyond the end of the partitions, and not a UUIDv7: it has no
    /// mint time, so no partition will ever be made for it.
    NeverRecordable,
}

/// The name payments claims under in the library's partitioned inbox.
pub const CONSUMER: &str = "payments";

/// Payments' inbox: the library's partitioned inbox in the pipeline's
/// library schema (`fx.partitioned_inbox`), consumer [`CONSUMER`]. Its
/// statements are built once; `pool` is not kept.
pub fn inbox(pool: &PgPool) -> &'static Inbox {
    static INBOX: OnceLock<Inbox> = OnceLock::new();
    INBOX.get_or_init(|| pipeline::db::library(pool.clone()).partitioned_inbox(CONSUMER))
}

/// Reads the inbox's window in `tx` and holds the shared window lock until
/// `tx` ends: no partition of it is dropped before then.
pub async fn read_window(
    pool: &PgPool,
    tx: &mut Transaction<'_, Postgres>,
) -> sqlx::Result<Window> {
    Ok(inbox(pool).window(tx).await?.unwrap_or(Window {
        floor: None,
        ceiling: None,
        clock: Utc::now(),
    }))
}

/// Where `msg_id` stands in `window`: `None` when it may be claimed;
/// otherwise where it lies and the dead-letter reason. As the library
/// judges ([`Window::judge_id`]), with payments' reasons and without the
/// clock skew (payments parks what is early, and dead-letters what is
/// ahead of the clock itself: `crate::park`).
pub fn judge(window: &Window, msg_id: Uuid) -> Option<(Outside, String)> {
    let (Some(floor), Some(ceiling)) = (window.floor, window.ceiling) else {
        return Some((
            Outside::Future,
            format!(
                "the inbox has no partitions, so msg_id {msg_id} cannot be recorded yet; held back until it has"
            ),
        ));
    };
    let version = msg_id.get_version_num();
    let not_v7 = if version == 7 {
        String::new()
    } else {
        format!(" (it is not a UUIDv7 but version {version}: its first 48 bits are no mint time)")
    };
    let minted = mint_time(msg_id).to_rfc3339();
    if msg_id < floor {
        return Some((
            Outside::AfterHorizon,
            format!(
                "arrived after the dedup horizon: msg_id {msg_id} was minted at {minted}{not_v7}, \
                 before the oldest inbox partition kept (from {}); its dedup record may have \
                 expired, so it is not applied. If its order has no charge, it is a first \
                 delivery that came too late: apply it by hand (docs/book/src/dedup-horizon.md)",
                mint_time(floor).to_rfc3339()
            ),
        ));
    }
    if msg_id >= ceiling {
        let end = mint_time(ceiling).to_rfc3339();
        if version != 7 {
            return Some((
                Outside::NeverRecordable,
                format!(
                    "msg_id {msg_id}{not_v7} lies at or after the end of the inbox partitions \
                     ({end}), and no partition will ever be made for it; not applied"
                ),
            ));
        }
        return Some((
            Outside::Future,
            format!(
                "msg_id {msg_id} was minted at {minted}, at or after the end of the inbox \
                 partitions created so far ({end}): a producer clock ahead, or partitions not \
                 created for a while (payments_inbox_extend_failures_total); held back until \
                 the partitions reach it"
            ),
        ));
    }
    None
}

/// How the inbox's partitions are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifecycle {
    /// How long a msg_id is remembered.
    pub retention: Retention,
    /// The span of one partition.
    pub granule: Duration,
    /// How far ahead of now partitions exist.
    pub ahead: Duration,
    /// `false` only with `--unsafe-inbox-retention`: drop partitions at the
    /// retention even when it is shorter than the horizon.
    pub hold_to_horizon: bool,
}

impl Lifecycle {
    /// The retention that expiry applies given the current `horizon`
    /// (`None`: unbounded): the configured one, raised to the horizon unless
    /// unsafe. `None`: drop nothing.
    pub fn effective(&self, horizon: Option<Option<Duration>>) -> Option<Duration> {
        let Retention::For(retention) = self.retention else {
            return None;
        };
        if !self.hold_to_horizon {
            return Some(retention);
        }
        match horizon {
            // The horizon could not be read this time: keep everything.
            None => None,
            Some(None) => None,
            Some(Some(h)) => Some(retention.max(h)),
        }
    }

    /// How often the maintenance runs: a quarter of a partition, at most a
    /// minute.
    pub fn interval(&self) -> Duration {
        (self.granule / 4).min(Duration::from_secs(60))
    }
}

/// Creates partitions until `ahead` from now; returns how many it created.
pub async fn extend(pool: &PgPool, ahead: Duration, granule: Duration) -> sqlx::Result<u32> {
    inbox(pool)
        .clone()
        .ahead(ahead)
        .partition(granule)
        .extend(pool)
        .await
}

/// Drops the partitions whose msg_ids are all older than `retention` (and
/// than every other consumer's of the library's inbox); returns their names.
pub async fn expire(pool: &PgPool, retention: Duration) -> sqlx::Result<Vec<String>> {
    inbox(pool)
        .clone()
        .retention(retention)
        .drop_expired(pool)
        .await
}

/// The partitions kept: how many, and the bounds of the window.
pub async fn partitions(pool: &PgPool) -> sqlx::Result<(i64, Option<Uuid>, Option<Uuid>)> {
    let row = sqlx::query!(
        r#"SELECT count(*) AS "n!",
                  (SELECT lo FROM fx.partitioned_inbox_parts ORDER BY lo LIMIT 1) AS floor,
                  (SELECT hi FROM fx.partitioned_inbox_parts ORDER BY hi DESC LIMIT 1) AS ceiling
           FROM fx.partitioned_inbox_parts"#
    )
    .fetch_one(pool)
    .await?;
    Ok((row.n, row.floor, row.ceiling))
}

/// Where the hop's terms of the horizon come from.
#[derive(Debug, Clone)]
pub enum HopSource {
    /// The topic's configs, asked of the broker.
    Kafka(KafkaArgs),
    /// The webhook sender's retry schedule (the contract's).
    Webhook,
}

/// The horizon's terms: the outbox's retention from the database; over
/// Kafka the topic's retention and segment span from the broker, over HTTP
/// the sender's retry span.
pub async fn read_sources(
    pool: &PgPool,
    hop: &HopSource,
    clock_skew: Duration,
) -> anyhow::Result<Sources> {
    use anyhow::Context;
    let outbox = pipeline::lifecycle::outbox_retention(pool)
        .await
        .context("read the outbox retention (orders.outbox_policy)")?;
    let kafka = match hop {
        HopSource::Kafka(kafka) => kafka,
        HopSource::Webhook => return Ok(Sources::webhook(outbox, clock_skew)),
    };
    let configs = pipeline::kafka::topic_configs(
        &kafka.client_config()?,
        &kafka.kafka_topic,
        &["retention.ms", "segment.ms"],
    )
    .await?;
    let topic = TopicLifetime::from_configs(&configs).map_err(anyhow::Error::msg)?;
    Ok(Sources::new(outbox, topic, clock_skew))
}

/// Sets the horizon gauge (`None`: unbounded, +Inf).
pub fn record_horizon(metrics: &PaymentsMetrics, horizon: Option<Duration>) {
    metrics
        .redelivery_horizon_seconds
        .set(horizon.map_or(f64::INFINITY, |h| h.as_secs_f64()));
}

/// Keeps the partitions until `cancel` fires: every [`Lifecycle::interval`],
/// creates the partitions ahead, re-reads the horizon and drops what expired.
/// Failures are logged and retried at the next round (a lock timeout while
/// the claims are busy is one). The first round, at once, takes the horizon
/// start-up derived (`started_with`), which also created the partitions
/// ahead, and only expires.
pub async fn maintain(
    pool: PgPool,
    hop: HopSource,
    clock_skew: Duration,
    lifecycle: Lifecycle,
    started_with: Option<Duration>,
    metrics: std::sync::Arc<PaymentsMetrics>,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval(lifecycle.interval());
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut from_start_up = Some(started_with);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = cancel.cancelled() => return,
        }
        let horizon = match from_start_up.take() {
            Some(h) => Some(h),
            None => next_horizon(&pool, &hop, clock_skew, &lifecycle, &metrics).await,
        };
        if let Some(retention) = lifecycle.effective(horizon) {
            match expire(&pool, retention).await {
                Ok(dropped) if !dropped.is_empty() => {
                    metrics
                        .inbox_partitions_dropped_total
                        .inc_by(dropped.len() as u64);
                    tracing::info!(?dropped, "inbox partitions expired");
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%error, "expiring inbox partitions failed; retrying next round")
                }
            }
        }
        record_partitions(&pool, &metrics).await;
    }
}

/// A round's start: creates the partitions ahead and re-derives the horizon
/// (`Some(None)`: unbounded; `None`: it could not be read this round).
async fn next_horizon(
    pool: &PgPool,
    hop: &HopSource,
    clock_skew: Duration,
    lifecycle: &Lifecycle,
    metrics: &PaymentsMetrics,
) -> Option<Option<Duration>> {
    if let Err(error) = extend(pool, lifecycle.ahead, lifecycle.granule).await {
        // Partitions run out after `ahead`: then every new event is held back.
        metrics.inbox_extend_failures_total.inc();
        tracing::error!(%error, ahead = ?lifecycle.ahead,
            "creating inbox partitions failed; retrying next round (once the partitions run out, new events are held back, not applied)");
    }
    match read_sources(pool, hop, clock_skew).await {
        Ok(sources) => {
            let h = sources.horizon();
            record_horizon(metrics, h);
            if !lifecycle.retention.covers(h) && lifecycle.hold_to_horizon {
                tracing::error!(retention = %lifecycle.retention, derivation = %sources,
                    "the redelivery horizon grew past the inbox retention; partitions are kept until the horizon");
            }
            Some(h)
        }
        Err(error) => {
            tracing::warn!(error = %format!("{error:#}"), "reading the redelivery horizon failed; expiring nothing this round");
            None
        }
    }
}

/// Sets the partition gauges: how many, and how far back the oldest starts.
async fn record_partitions(pool: &PgPool, metrics: &PaymentsMetrics) {
    match partitions(pool).await {
        Ok((n, floor, ceiling)) => {
            metrics.inbox_partitions.set(n);
            let now = Utc::now();
            if let Some(floor) = floor {
                let age = (now - mint_time(floor)).num_milliseconds() as f64 / 1e3;
                metrics.inbox_floor_age_seconds.set(age.max(0.0));
            }
            let ahead = ceiling.map_or(0.0, |c| {
                (mint_time(c) - now).num_milliseconds() as f64 / 1e3
            });
            metrics.inbox_ahead_seconds.set(ahead);
        }
        Err(error) => tracing::warn!(%error, "reading the inbox partitions failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_ms(ms: u64) -> Uuid {
        let mut b = [0u8; 16];
        b[..6].copy_from_slice(&ms.to_be_bytes()[2..]);
        b[6] = 0x70;
        b[8] = 0x80;
        Uuid::from_bytes(b)
    }

    #[test]
    fn the_window_refuses_below_the_floor_and_at_or_above_the_ceiling() {
        let w = Window {
            floor: Some(at_ms(1_000)),
            ceiling: Some(at_ms(2_000)),
            clock: Utc::now(),
        };
        assert_eq!(judge(&w, at_ms(1_000)), None, "the floor is inside");
        assert_eq!(judge(&w, at_ms(1_999)), None);
        let (kind, reason) = judge(&w, at_ms(999)).expect("below the floor");
        assert_eq!(kind, Outside::AfterHorizon);
        assert!(
            reason.starts_with("arrived after the dedup horizon"),
            "{reason}"
        );
        let (kind, _) = judge(&w, at_ms(2_000)).expect("the ceiling is outside");
        assert_eq!(kind, Outside::Future);
        let v4 = Uuid::from_u128(0xffff_ffff_ffff_4fff_8fff_ffff_ffff_ffff);
        let (kind, reason) = judge(&w, v4).expect("far ahead");
        assert_eq!(kind, Outside::NeverRecordable, "no mint time to wait for");
        assert!(reason.contains("not a UUIDv7 but version 4"), "{reason}");
        assert!(
            reason.contains("no partition will ever be made"),
            "{reason}"
        );
        let empty = Window {
            floor: None,
            ceiling: None,
            clock: Utc::now(),
        };
        assert!(judge(&empty, at_ms(1_500)).is_some());
    }

    #[test]
    fn expiry_holds_to_the_horizon_unless_unsafe() {
        let day = Duration::from_secs(86_400);
        let mut l = Lifecycle {
            retention: Retention::For(2 * day),
            granule: day,
            ahead: 2 * day,
            hold_to_horizon: true,
        };
        assert_eq!(l.effective(Some(Some(3 * day))), Some(3 * day));
        assert_eq!(l.effective(Some(Some(day))), Some(2 * day));
        assert_eq!(l.effective(Some(None)), None, "unbounded: keep all");
        assert_eq!(l.effective(None), None, "unknown: keep all");
        l.hold_to_horizon = false;
        assert_eq!(l.effective(Some(Some(3 * day))), Some(2 * day));
        l.retention = Retention::Forever;
        assert_eq!(l.effective(Some(Some(day))), None);
        assert_eq!(l.interval(), Duration::from_secs(60));
    }
}
