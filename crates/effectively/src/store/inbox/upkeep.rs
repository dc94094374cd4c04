//! An inbox's upkeep: a row inbox's expiry, a partitioned inbox's partitions
//! made ahead and dropped, and the loop that runs them.

use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{Inbox, Kind};

/// What one [`Inbox::maintain_once`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Maintained {
    /// Partitions made (partitioned inbox).
    pub made: u32,
    /// Partitions dropped, by name (partitioned inbox).
    pub dropped: Vec<String>,
    /// Rows deleted (row inbox).
    pub deleted: u64,
}

/// Rows a row inbox's expiry deletes per transaction in
/// [`Inbox::maintain_once`].
const EXPIRE_BATCH: u32 = 10_000;

impl Inbox {
    /// Expires what is older than the retention. A row inbox deletes this
    /// consumer's rows of messages sent longer ago, `batch` rows per
    /// transaction, until none is left, and returns how many it deleted. A
    /// partitioned inbox records this consumer's retention and drops the
    /// partitions older than the longest retention recorded (`batch` is not
    /// used), and returns how many it dropped.
    pub async fn expire(&self, pool: &PgPool, batch: u32) -> Result<u64, sqlx::Error> {
        let age = self.retention.as_secs_f64();
        match &self.kind {
            Kind::Rows => {
                crate::store::delete_in_batches(pool, batch, |limit| {
                    sqlx::query(&self.expire)
                        .bind(&self.consumer)
                        .bind(age)
                        .bind(limit)
                })
                .await
            }
            Kind::Partitions(_) => Ok(self.drop_expired(pool).await?.len() as u64),
        }
    }

    /// Partitioned inbox: records this consumer's retention and drops the
    /// expired partitions, as [`Inbox::expire`], returning their names (a
    /// row inbox: none, and nothing is done).
    pub async fn drop_expired(&self, pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
        if !self.is_partitioned() {
            return Ok(Vec::new());
        }
        sqlx::query_scalar(&self.expire)
            .bind(&self.consumer)
            .bind(self.retention.as_secs_f64())
            .fetch_all(pool)
            .await
    }

    /// Partitioned inbox: makes the partitions missing up to the inbox's
    /// [`Inbox::ahead`] past the database's clock; returns how many it
    /// made (0 for a row inbox).
    pub async fn extend(&self, pool: &PgPool) -> Result<u32, sqlx::Error> {
        let Kind::Partitions(p) = &self.kind else {
            return Ok(0);
        };
        let ahead = p.ahead.unwrap_or(2 * p.granule + p.clock_skew);
        let made: i32 = sqlx::query_scalar(&p.extend)
            .bind(ahead.as_secs_f64())
            .bind(p.granule.as_secs_f64())
            .fetch_one(pool)
            .await?;
        Ok(u32::try_from(made).unwrap_or_default())
    }

    /// One round of upkeep: a partitioned inbox makes the partitions ahead
    /// ([`Inbox::extend`]) and drops the expired ones; a row inbox deletes
    /// its expired rows ([`Inbox::expire`]).
    pub async fn maintain_once(&self, pool: &PgPool) -> Result<Maintained, sqlx::Error> {
        match &self.kind {
            Kind::Rows => Ok(Maintained {
                deleted: self.expire(pool, EXPIRE_BATCH).await?,
                ..Maintained::default()
            }),
            Kind::Partitions(_) => {
                let made = self.extend(pool).await?;
                let dropped = self.drop_expired(pool).await?;
                Ok(Maintained {
                    made,
                    dropped,
                    deleted: 0,
                })
            }
        }
    }

    /// How often [`Inbox::maintain`] runs a round: a quarter of a
    /// partition, at most a minute (a row inbox: a minute).
    pub fn maintenance_interval(&self) -> Duration {
        match &self.kind {
            Kind::Rows => Duration::from_secs(60),
            Kind::Partitions(p) => {
                (p.granule / 4).clamp(Duration::from_millis(250), Duration::from_secs(60))
            }
        }
    }

    /// Runs [`Inbox::maintain_once`] every [`Inbox::maintenance_interval`]
    /// until `cancel` fires, the first round at once. A round that fails is
    /// logged and tried again at the next: a partitioned inbox keeps two
    /// partitions ahead by default, so a few failed rounds hold up no
    /// message. Spawn it beside the consumer (any number of consumers may
    /// maintain the same schema at once: they take turns).
    pub async fn maintain(&self, pool: &PgPool, cancel: &CancellationToken) {
        let mut every = tokio::time::interval(self.maintenance_interval());
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = every.tick() => {}
            }
            match self.maintain_once(pool).await {
                Ok(done) if done.made > 0 || !done.dropped.is_empty() || done.deleted > 0 => {
                    tracing::info!(consumer = %self.consumer, made = done.made, dropped = ?done.dropped, deleted = done.deleted, "effectively: inbox maintained");
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(consumer = %self.consumer, %error, "effectively: inbox upkeep failed; tried again next round");
                }
            }
        }
    }
}
