//! `relay webhooks ...`: what an operator does with the destinations and
//! the deliveries.

use chrono::{DateTime, Utc};
use effectively::webhook;
use sqlx::PgPool;

use super::destination::{DESTINATIONS_REFRESH, Destination};
use super::sealed::{Keyring, Specs};
use super::store::{rekey, remove, upsert};

/// `relay webhooks ...`: what an operator does with the deliveries.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Admin {
    /// Sends failed deliveries again: each becomes pending with its attempts
    /// reset (its `replays` counts this). A replayed delivery goes after any
    /// later event of its key that was delivered meanwhile. Running relays
    /// take them within their poll interval.
    Replay {
        /// Replay the failed deliveries (required: the only selection so far).
        #[arg(long, required = true)]
        failed: bool,
        /// Only this destination's.
        #[arg(long)]
        destination: Option<String>,
        /// Only those that failed since: an RFC 3339 time
        /// (2026-11-24T08:00:00Z) or a duration ago (90m, 2h, 1d).
        #[arg(long, value_parser = parse_since)]
        since: Option<DateTime<Utc>>,
        #[command(flatten)]
        horizon: ReceiverHorizon,
    },
    /// Enables a destination a 410 Gone disabled; its waiting deliveries go.
    Enable {
        /// The destination.
        #[arg(long)]
        destination: String,
        #[command(flatten)]
        horizon: ReceiverHorizon,
    },
    /// Each destination's deliveries: pending, delivered, failed, and
    /// whether it is disabled or removed.
    Status,
    /// Adds a destination, or replaces one's settings: every relay fans the
    /// events committed from now on out to it too (within
    /// `DESTINATIONS_REFRESH`), and delivers them.
    Add {
        /// NAME=URL,secret=whsec_...[,secret=...][,timeout=10s][,concurrency=16][,max-attempts=8][,allow-http]
        destination: Destination,
    },
    /// Removes a destination: no later event is fanned out to it, and its
    /// pending deliveries are marked failed at once ("the destination was
    /// removed"); add it again and `replay --failed --destination NAME` to
    /// send them after all. To let them be delivered first, wait until
    /// `status` shows it has none pending.
    Remove {
        /// The destination's name.
        #[arg(long)]
        destination: String,
    },
    /// Seals every destination's spec again under the current key (the
    /// first of --webhook-secrets-key-file): after a new key was put first
    /// in the file, with the old one kept after it; the old line may go
    /// once this has run. A spec stored in plaintext (before sealing, or
    /// with --unsafe-plaintext-webhook-secrets) is sealed too.
    Rekey,
    /// Prints a new key line (`ID:BASE64`, 32 random bytes) for
    /// --webhook-secrets-key-file; touches nothing.
    Keygen {
        /// The key's id.
        #[arg(long, default_value = "k1")]
        id: String,
    },
}

/// How far back the receiver remembers, for the commands that send old
/// events again. Past its dedup horizon (payments' `--inbox-retention`, 16
/// days by default) a receiver refuses an event as `after_horizon` and
/// dead-letters it, because it can no longer tell a first delivery from a
/// duplicate; sending such events (or events whose retries could arrive
/// past it) is refused here unless told to skip them.
#[derive(Debug, Clone, clap::Args)]
pub struct ReceiverHorizon {
    /// The receiver's dedup horizon: its inbox retention (payments
    /// `--inbox-retention`). Events minted longer ago than this less the
    /// sender's retry span (about 28 h: a delivery sent again may be
    /// retried that long) are past it.
    #[arg(long = "receiver-horizon", value_parser = humantime::parse_duration, default_value = "16d")]
    pub receiver_horizon: std::time::Duration,
    /// Leave the deliveries of events past the receiver's horizon out (they
    /// stay failed, and `enable` marks its waiting ones failed) instead of
    /// refusing the whole command.
    #[arg(long)]
    pub skip_past_horizon: bool,
}

impl Default for ReceiverHorizon {
    fn default() -> Self {
        Self {
            receiver_horizon: std::time::Duration::from_secs(16 * 86_400),
            skip_past_horizon: false,
        }
    }
}

impl ReceiverHorizon {
    /// The oldest an event sent again may be: the horizon less the longest
    /// the sender's retries can take ([`webhook::max_retry_span`], about 28
    /// h). A delivery queued now may be tried for that long, and each try
    /// must reach the receiver while it still remembers the event's id;
    /// compared with the horizon alone, an event a little younger than it
    /// was sent, its retries arrived past it, and the receiver dead-lettered
    /// a first delivery as `after_horizon`. Zero when the horizon is
    /// shorter than the span: every event is past it.
    pub fn cutoff(&self) -> std::time::Duration {
        self.receiver_horizon
            .saturating_sub(webhook::max_retry_span())
    }

    /// [`Self::cutoff`] as a PostgreSQL interval's seconds.
    fn seconds(&self) -> f64 {
        self.cutoff().as_secs_f64()
    }

    /// The refusal when `n` deliveries are past the cutoff and
    /// `--skip-past-horizon` was not given.
    fn refusal(&self, n: i64, what: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "{n} of the {what} carry events minted more than {} ago: the receiver's dedup \
             horizon (--receiver-horizon {}, its --inbox-retention) less the sender's retry span \
             ({}), so their retries could reach it after it forgot them; it would refuse them as \
             after_horizon and dead-letter them, so nothing was done. Give --skip-past-horizon \
             to send only the younger ones (the older stay failed); for each older one, check \
             at the receiver whether its effect exists (payments.charges by order id) and apply \
             the missing ones there by hand",
            humantime::format_duration(self.cutoff()),
            humantime::format_duration(self.receiver_horizon),
            humantime::format_duration(webhook::max_retry_span()),
        )
    }
}

/// `--since`: an RFC 3339 time, or a duration before now.
fn parse_since(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s.trim()) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = humantime::parse_duration(s.trim()).map_err(|_| {
        format!("{s:?}: an RFC 3339 time (2026-11-24T08:00:00Z) or a duration ago (90m, 2h, 1d)")
    })?;
    chrono::Duration::from_std(ago)
        .ok()
        .and_then(|d| Utc::now().checked_sub_signed(d))
        .ok_or_else(|| format!("{s:?}: too far back"))
}

impl Admin {
    /// Whether the command needs no database (`keygen`).
    pub fn offline(&self) -> Option<String> {
        match self {
            Admin::Keygen { id } => Some(format!("{}\n", Keyring::generate_line(id))),
            _ => None,
        }
    }

    /// Runs the command, the specs stored as `specs` says (`rekey` needs
    /// keys); returns what to print.
    pub async fn run(&self, pool: &PgPool, specs: &Specs) -> anyhow::Result<String> {
        match self {
            Admin::Keygen { .. } => Ok(self.offline().unwrap_or_default()),
            Admin::Rekey => {
                let Specs::Sealed(ring) = specs else {
                    anyhow::bail!(
                        "rekey needs the keys: --webhook-secrets-key-file or RELAY_WEBHOOK_SECRETS_KEY"
                    );
                };
                let done = rekey(pool, ring).await?;
                Ok(format!(
                    "{} destination specs sealed again under key {} ({}), {} already under it\n",
                    done.resealed.len(),
                    ring.current(),
                    done.resealed.join(", "),
                    done.current
                ))
            }
            Admin::Replay {
                failed: _,
                destination,
                since,
                horizon,
            } => {
                let (replayed, skipped) =
                    replay_failed(pool, destination.as_deref(), *since, horizon).await?;
                let mut out = format!("{replayed} failed deliveries queued again\n");
                if skipped > 0 {
                    out.push_str(&format!(
                        "{skipped} left failed: their events are past the receiver's horizon\n"
                    ));
                }
                Ok(out)
            }
            Admin::Enable {
                destination,
                horizon,
            } => enable(pool, destination, horizon).await,
            Admin::Add { destination } => {
                upsert(pool, specs, std::slice::from_ref(destination)).await?;
                Ok(format!(
                    "destination {} delivers to {}; running relays take it within {}\n",
                    destination.name,
                    destination.url,
                    humantime::format_duration(DESTINATIONS_REFRESH)
                ))
            }
            Admin::Remove { destination } => {
                let failed = remove(pool, destination).await?;
                Ok(format!(
                    "destination {destination} removed; {failed} pending deliveries marked failed\n"
                ))
            }
            Admin::Status => {
                let rows = sqlx::query!(
                    r#"SELECT w.destination AS "destination!", w.disabled_at, w.reason, w.removed_at,
                              count(d.outbox_id) FILTER (WHERE d.delivered_at IS NULL AND d.failed_at IS NULL) AS "pending!",
                              count(d.outbox_id) FILTER (WHERE d.delivered_at IS NOT NULL) AS "delivered!",
                              count(d.outbox_id) FILTER (WHERE d.failed_at IS NOT NULL) AS "failed!"
                       FROM orders.webhook_destinations w
                       LEFT JOIN orders.webhook_deliveries d ON d.destination = w.destination
                       GROUP BY w.destination, w.disabled_at, w.reason, w.removed_at ORDER BY w.destination"#
                )
                .fetch_all(pool)
                .await?;
                let mut out = format!(
                    "{:<24} {:>10} {:>12} {:>8}  state\n",
                    "destination", "pending", "delivered", "failed"
                );
                for r in rows {
                    let state = match (r.removed_at, r.disabled_at) {
                        (Some(at), _) => format!("removed since {at}"),
                        (None, Some(at)) => {
                            format!("disabled since {at}: {}", r.reason.unwrap_or_default())
                        }
                        (None, None) => "enabled".to_owned(),
                    };
                    out.push_str(&format!(
                        "{:<24} {:>10} {:>12} {:>8}  {state}\n",
                        r.destination, r.pending, r.delivered, r.failed
                    ));
                }
                Ok(out)
            }
        }
    }
}

/// Makes failed deliveries pending again (of `destination`, failed since
/// `since`, when given), but none whose event is past the receiver's
/// `horizon`: with any of those selected the command is refused, or with
/// `--skip-past-horizon` they stay failed. Returns (replayed, left failed).
pub async fn replay_failed(
    pool: &PgPool,
    destination: Option<&str>,
    since: Option<DateTime<Utc>>,
    horizon: &ReceiverHorizon,
) -> anyhow::Result<(u64, i64)> {
    // One statement: the selection, which of it is past the horizon, and
    // the replay of the rest, unless something is past it and not skipped
    // (then nothing changes and the command is refused).
    let (replayed, past): (i64, i64) = sqlx::query_as(
        "WITH sel AS ( \
           SELECT destination, outbox_id, \
                  msg_id < effectively.v7_floor(now() - make_interval(secs => $3)) AS past \
           FROM orders.webhook_deliveries \
           WHERE failed_at IS NOT NULL \
             AND ($1::text IS NULL OR destination = $1) \
             AND ($2::timestamptz IS NULL OR failed_at >= $2)), \
         go AS ( \
           UPDATE orders.webhook_deliveries d SET failed_at = NULL, attempts = 0, \
             next_attempt_at = now(), replays = d.replays + 1 \
           FROM sel \
           WHERE d.destination = sel.destination AND d.outbox_id = sel.outbox_id AND NOT sel.past \
             AND ($4 OR NOT EXISTS (SELECT 1 FROM sel WHERE sel.past)) \
           RETURNING 1) \
         SELECT (SELECT count(*) FROM go), (SELECT count(*) FROM sel WHERE sel.past)",
    )
    .bind(destination)
    .bind(since)
    .bind(horizon.seconds())
    .bind(horizon.skip_past_horizon)
    .fetch_one(pool)
    .await?;
    if past > 0 && !horizon.skip_past_horizon {
        return Err(horizon.refusal(past, "failed deliveries selected"));
    }
    Ok((u64::try_from(replayed).unwrap_or(0), past))
}

/// Enables `destination` (disabled by a 410); its waiting deliveries go,
/// but none whose event is past the receiver's horizon: with any of those
/// waiting the command is refused, or with `--skip-past-horizon` they are
/// marked failed (with the reason) first.
async fn enable(
    pool: &PgPool,
    destination: &str,
    horizon: &ReceiverHorizon,
) -> anyhow::Result<String> {
    let mut tx = pool.begin().await?;
    // The waiting deliveries past the horizon, marked failed only with
    // --skip-past-horizon (otherwise the command is refused, unchanged).
    let past: i64 = sqlx::query_scalar(
        "WITH past AS ( \
           SELECT outbox_id FROM orders.webhook_deliveries \
           WHERE destination = $1 AND delivered_at IS NULL AND failed_at IS NULL \
             AND msg_id < effectively.v7_floor(now() - make_interval(secs => $2))), \
         failed AS ( \
           UPDATE orders.webhook_deliveries d SET failed_at = now(), \
             last_error = 'past the receiver''s dedup horizon when the destination was enabled' \
           FROM past WHERE $3 AND d.destination = $1 AND d.outbox_id = past.outbox_id \
           RETURNING 1) \
         SELECT count(*) FROM past",
    )
    .bind(destination)
    .bind(horizon.seconds())
    .bind(horizon.skip_past_horizon)
    .fetch_one(&mut *tx)
    .await?;
    if past > 0 && !horizon.skip_past_horizon {
        return Err(horizon.refusal(past, "deliveries waiting for this destination"));
    }
    let was = sqlx::query_scalar!(
        "UPDATE orders.webhook_destinations SET disabled_at = NULL, reason = NULL \
         WHERE destination = $1 RETURNING destination",
        destination
    )
    .fetch_optional(&mut *tx)
    .await?;
    if was.is_none() {
        anyhow::bail!("no destination {destination:?} (relay webhooks status lists them)");
    }
    tx.commit().await?;
    let mut out = format!("destination {destination} enabled\n");
    if past > 0 {
        out.push_str(&format!(
            "{past} waiting deliveries marked failed: their events are past the receiver's horizon\n"
        ));
    }
    Ok(out)
}
