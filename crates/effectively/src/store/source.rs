//! Where a [`Relay`](super::Relay)'s rows come from: a [`Source`] claims a
//! pass's rows and settles them, inside the pass's transaction; the relay
//! holds the shards' locks, sends, counts and loops. The library's own
//! outbox is one source ([`OutboxSource`], what [`Relay::new`](super::Relay::new)
//! relays); an outbox table a service already has is another, written by
//! its user (the pipeline's relay binary relays `orders.outbox` so).

use std::future::Future;
use std::time::Duration;

use sqlx::{PgConnection, PgPool};

use super::relay::Outgoing;
use super::{Effectively, Outbox, SHARDS, shard_of};

/// What a [`Source`] claimed for a pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claimed {
    /// The rows, each key's in id order (the order the relay sends them in).
    pub rows: Vec<Outgoing>,
    /// More rows may be claimable right after this pass, with no `NOTIFY`
    /// to say so: a shard gave its whole share, or a later row of a claimed
    /// key was left for the next pass. The relay then passes again at once
    /// (when this pass delivered something).
    pub more: bool,
}

/// What a pass's sends did, for [`Source::settle`]: every claimed row is in
/// exactly one of its lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sent {
    /// Delivered: to be marked published (or deleted).
    pub published: Vec<i64>,
    /// Refused by the sink for themselves, with the reason.
    pub refused: Vec<(i64, String)>,
    /// Not delivered (a send to be tried again, or an earlier row of its
    /// key was not delivered): to stay pending.
    pub retried: Vec<i64>,
}

/// What [`Source::settle`] changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Rows it marked published (or deleted as delivered).
    pub published: u64,
    /// Rows it marked failed for good.
    pub failed: u64,
}

/// An outbox table a [`Relay`](super::Relay) can relay: how a pass claims
/// its rows and settles them, both in the pass's transaction (the one that
/// holds the shards' advisory locks, committed after the settle).
///
/// A source keeps the relay's promises with its SQL: a claim returns a key's
/// rows in id order and none of a key whose earlier row is pending and not
/// among them (or failed), so the key's events go out in order; a row the
/// settle leaves pending is claimed again by a later pass.
pub trait Source: Send + Sync + 'static {
    /// A name for the table, unique per database: the relays of one name
    /// share (and fence each other by) one set of shard locks.
    fn name(&self) -> &str;

    /// The channel a commit that wrote rows notifies: it wakes the relay.
    fn channel(&self) -> &str;

    /// Which shards a notification's payload names (bit `s`: shard `s`):
    /// only the loops of those shards wake. Default: every shard.
    fn shards_woken(&self, payload: &str) -> u16 {
        let _ = payload;
        u16::MAX
    }

    /// Whether passes over the same shard may overlap
    /// ([`Relay::shard_depth`](super::Relay::shard_depth) over 1): only when
    /// the claim locks the rows it takes and skips the rows (and keys)
    /// another pass has locked, so that two passes never take one row or
    /// one key. Default: no.
    fn overlapping_passes(&self) -> bool {
        false
    }

    /// Claims up to `share` rows of each shard of `shards` (each 0..16).
    fn claim(
        &self,
        conn: &mut PgConnection,
        shards: &[i16],
        share: i64,
    ) -> impl Future<Output = Result<Claimed, sqlx::Error>> + Send;

    /// Settles what the pass's sends did ([`Sent`]): marks the delivered
    /// rows, records the refused ones, leaves the retried ones claimable.
    fn settle(
        &self,
        conn: &mut PgConnection,
        sent: &Sent,
    ) -> impl Future<Output = Result<Settled, sqlx::Error>> + Send;

    /// Deletes published rows that are no longer kept; how many.
    /// [`Relay::run`](super::Relay::run) calls it once a minute. Default:
    /// none (the table's owner expires its rows).
    fn expire(&self, pool: &PgPool) -> impl Future<Output = Result<u64, sqlx::Error>> + Send {
        let _ = pool;
        async { Ok(0) }
    }
}

/// How long a relay keeps published rows of the library's outbox by
/// default: a week.
pub const DEFAULT_KEEP_PUBLISHED: Duration = Duration::from_secs(7 * 24 * 3600);

/// Rows an expiry statement deletes at most.
const EXPIRE_BATCH: u32 = 5_000;

/// The library's outbox in a schema ([`Effectively::outbox`]) as a
/// relay's [`Source`]: what [`Relay::new`](super::Relay::new) relays.
#[derive(Debug, Clone)]
pub struct OutboxSource {
    name: String,
    channel: String,
    claim: String,
    mark_published: String,
    delete_published: String,
    mark_failed: String,
    keep_published: Option<Duration>,
    outbox: Outbox,
}

impl OutboxSource {
    /// The outbox of `fx`'s schema, its published rows kept
    /// [`DEFAULT_KEEP_PUBLISHED`].
    pub fn new(fx: &Effectively) -> Self {
        let q = fx.schema_name().quoted();
        Self {
            name: fx.schema_name().as_str().to_owned(),
            channel: format!("{}.outbox", fx.schema_name()),
            // Each shard's oldest pending rows, one ordered walk of
            // `outbox_pending` per shard (a scan of `shard = ANY(..)` would
            // sort every pending row of the shards before its LIMIT). The
            // shard is bounded as a range of (shard, id), not `o.shard =
            // s.shard`: under an equality the primary key gives the same
            // order, and statistics taken while the backlog was all
            // pending made the planner walk it, reading every row
            // published before the claim's (FINDINGS.md §26). The claim
            // also turns bitmap scans off: statistics of an empty outbox
            // made a bitmap scan and a sort of every pending row of the
            // shard look cheaper than the walk.
            claim: format!(
                "SELECT c.* FROM unnest($1::int2[]) AS s(shard), LATERAL ( \
                   SELECT o.id, o.msg_id, o.destination, o.key, o.event_type, o.payload, \
                          o.content_type, o.headers, o.created_at \
                   FROM {q}.outbox o \
                   WHERE (o.shard, o.id) > (s.shard, 0) AND (o.shard, o.id) < (s.shard + 1, 0) \
                     AND o.published_at IS NULL AND o.failed_at IS NULL \
                     AND NOT EXISTS (SELECT 1 FROM {q}.outbox f \
                                     WHERE f.key = o.key AND f.id < o.id \
                                       AND f.published_at IS NULL AND f.failed_at IS NOT NULL) \
                   ORDER BY o.shard, o.id LIMIT $2) c \
                 ORDER BY c.id"
            ),
            mark_published: format!(
                "UPDATE {q}.outbox SET published_at = now() \
                 WHERE id = ANY($1) AND published_at IS NULL"
            ),
            delete_published: format!(
                "DELETE FROM {q}.outbox WHERE id = ANY($1) AND published_at IS NULL"
            ),
            mark_failed: format!(
                "UPDATE {q}.outbox o SET failed_at = now(), error = r.error \
                 FROM unnest($1::int8[], $2::text[]) AS r(id, error) \
                 WHERE o.id = r.id AND o.published_at IS NULL"
            ),
            keep_published: Some(DEFAULT_KEEP_PUBLISHED),
            outbox: fx.outbox(),
        }
    }

    /// See [`Relay::keep_published`](super::Relay::keep_published).
    pub fn keep_published(self, keep: Option<Duration>) -> Self {
        Self {
            keep_published: keep,
            ..self
        }
    }
}

impl Source for OutboxSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn channel(&self) -> &str {
        &self.channel
    }

    async fn claim(
        &self,
        conn: &mut PgConnection,
        shards: &[i16],
        share: i64,
    ) -> Result<Claimed, sqlx::Error> {
        sqlx::query("SET LOCAL enable_bitmapscan = off")
            .execute(&mut *conn)
            .await?;
        let rows: Vec<Outgoing> = sqlx::query_as(&self.claim)
            .bind(shards)
            .bind(share)
            .fetch_all(&mut *conn)
            .await?;
        // A shard that gave its whole share may have more.
        let mut per_shard = [0_i64; SHARDS as usize];
        for row in &rows {
            per_shard[shard_of(&row.key) as usize] += 1;
        }
        let more = per_shard.iter().any(|n| *n >= share);
        Ok(Claimed { rows, more })
    }

    async fn settle(&self, conn: &mut PgConnection, sent: &Sent) -> Result<Settled, sqlx::Error> {
        let mark = if self.keep_published == Some(Duration::ZERO) {
            &self.delete_published
        } else {
            &self.mark_published
        };
        let published = sqlx::query(mark)
            .bind(&sent.published)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        let failed = if sent.refused.is_empty() {
            0
        } else {
            let (ids, why): (Vec<i64>, Vec<&str>) = sent
                .refused
                .iter()
                .map(|(id, why)| (*id, why.as_str()))
                .unzip();
            sqlx::query(&self.mark_failed)
                .bind(ids)
                .bind(why)
                .execute(&mut *conn)
                .await?
                .rows_affected()
        };
        Ok(Settled { published, failed })
    }

    async fn expire(&self, pool: &PgPool) -> Result<u64, sqlx::Error> {
        match self.keep_published {
            Some(keep) => self.outbox.expire(pool, keep, EXPIRE_BATCH).await,
            None => Ok(0),
        }
    }
}
