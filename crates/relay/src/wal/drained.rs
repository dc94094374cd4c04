//! The rows the start-up drain published, so the stream does not publish
//! them again.
//!
//! When the slot was there before the relay started (a restart, a slot made
//! ahead of the relay), the rows committed while the relay was away are in
//! the stream and pending in the table alike, so the drain
//! ([`super::drain`]) publishes them and then the stream reads them again.
//! Publishing them twice was correct (the inbox absorbs it) but doubled the
//! work of a backlog: 200,000 rows drained at 35,000 rows/s were sent again
//! by the stream, a stall of 3.5–5 s before new rows went out (FINDINGS.md
//! §29). A row marked published had its broker's ack, so the stream may
//! leave it; the mark stays the drain's.
//!
//! [`Drained::read`] takes the ids the drain marked (published since it
//! began, within the ids pending then and the last id before the stream) as
//! runs of consecutive ids, and the WAL position after it: a row the drain
//! published committed before that, so once the stream has read a commit
//! past it, the set is dropped.

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use pg_walstream::parse_lsn;
use sqlx::PgPool;

use crate::outbox::SHARDS;

/// Where the drain starts: the database's clock, and the lowest id the
/// drain can publish (`None`: nothing, so nothing to drain).
pub(super) struct DrainStart {
    at: DateTime<Utc>,
    lowest_pending: Option<i64>,
}

impl DrainStart {
    /// Read just before the drain. The lowest id is taken as the drain's
    /// count of what is left takes its rows (`pending_before`): pending, not
    /// failed, not held back by a failed row of its key. A row held back
    /// for days would otherwise keep the bound, and [`Drained::read`]'s
    /// scan, that old.
    ///
    /// It is read shard by shard, each the first row of its pending index
    /// (`outbox_pending_by_shard`). A plain `min(id)` over the pending rows
    /// was planned as a walk of `outbox_pkey` from its lowest id, past
    /// every published row the retention keeps: 88.7 ms over 599,000 rows,
    /// against 0.36 ms this way (`bench/results/marks-20261207/marks.sh`),
    /// and a week's rows at start-up.
    pub(super) async fn read(pool: &PgPool) -> sqlx::Result<Self> {
        let (at, lowest_pending) = sqlx::query_as(
            "SELECT clock_timestamp(), \
                    (SELECT min(p.id) FROM generate_series(0, $1 - 1) AS s(shard), \
                     LATERAL (SELECT o.id FROM orders.outbox o \
                              WHERE o.shard = s.shard AND o.published_at IS NULL AND o.failed_at IS NULL \
                                AND NOT EXISTS (SELECT 1 FROM orders.outbox f \
                                                WHERE f.aggregate_id = o.aggregate_id AND f.id < o.id \
                                                  AND f.published_at IS NULL AND f.failed_at IS NOT NULL) \
                              ORDER BY o.id LIMIT 1) p)",
        )
        .bind(i32::from(SHARDS))
        .fetch_one(pool)
        .await?;
        Ok(Self { at, lowest_pending })
    }
}

/// Runs of consecutive outbox ids the drain published, until the stream
/// reads a commit past [`Drained::until_lsn`].
#[derive(Debug, Default)]
pub(super) struct Drained {
    /// Sorted, disjoint, inclusive.
    runs: Vec<(i64, i64)>,
    /// The WAL position after the drain.
    until_lsn: u64,
}

impl Drained {
    /// The rows marked published since `start`, up to `last_id` (the last
    /// id before the stream), and the WAL position now.
    pub(super) async fn read(
        pool: &PgPool,
        start: &DrainStart,
        last_id: i64,
    ) -> anyhow::Result<Self> {
        let Some(lowest) = start.lowest_pending else {
            return Ok(Self::default());
        };
        let mut ids = sqlx::query_scalar::<_, i64>(
            "SELECT id FROM orders.outbox \
             WHERE id BETWEEN $1 AND $2 AND published_at >= $3 ORDER BY id",
        )
        .bind(lowest)
        .bind(last_id)
        .bind(start.at)
        .fetch(pool);
        let mut drained = Self::default();
        while let Some(id) = ids.try_next().await? {
            drained.push(id);
        }
        drop(ids);
        let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(pool)
            .await?;
        drained.until_lsn = parse_lsn(&lsn)?;
        Ok(drained)
    }

    /// Adds `id`, at least every id added before.
    fn push(&mut self, id: i64) {
        match self.runs.last_mut() {
            Some((_, end)) if id <= *end => {}
            Some((_, end)) if id == *end + 1 => *end = id,
            _ => self.runs.push((id, id)),
        }
    }

    /// Rows in the set.
    pub(super) fn rows(&self) -> u64 {
        self.runs.iter().map(|(a, b)| (b - a + 1) as u64).sum()
    }

    /// Whether the drain published `id`.
    pub(super) fn contains(&self, id: i64) -> bool {
        let at = self.runs.partition_point(|&(_, end)| end < id);
        self.runs.get(at).is_some_and(|&(start, _)| start <= id)
    }

    /// The stream read a commit ending at `lsn`: past the drain, no later
    /// row is one of its rows, so the set goes.
    pub(super) fn passed(&mut self, lsn: u64) {
        if lsn > self.until_lsn && !self.runs.is_empty() {
            self.runs = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(ids: &[i64]) -> Drained {
        let mut d = Drained::default();
        for &id in ids {
            d.push(id);
        }
        d
    }

    #[test]
    fn consecutive_ids_make_one_run() {
        let d = of(&[3, 4, 5, 6, 9, 10, 12]);
        assert_eq!(d.runs, vec![(3, 6), (9, 10), (12, 12)]);
        assert_eq!(d.rows(), 7);
        for id in [3, 4, 5, 6, 9, 10, 12] {
            assert!(d.contains(id), "{id}");
        }
        for id in [i64::MIN, 0, 2, 7, 8, 11, 13, i64::MAX] {
            assert!(!d.contains(id), "{id}");
        }
    }

    #[test]
    fn a_repeated_id_is_one_row() {
        let d = of(&[1, 1, 2, 2, 2, 5]);
        assert_eq!(d.runs, vec![(1, 2), (5, 5)]);
        assert_eq!(d.rows(), 3);
    }

    #[test]
    fn the_set_goes_once_a_commit_passes_the_drain() {
        let mut d = of(&[1, 2]);
        d.until_lsn = 100;
        d.passed(100);
        assert!(d.contains(1), "a commit at the drain's end may be its");
        d.passed(101);
        assert!(d.runs.is_empty());
        assert!(!d.contains(1));
    }

    /// The drain's lowest id is the lowest it can publish: not a row held
    /// back behind a failed row of its key, nor a published or failed one.
    #[tokio::test]
    async fn the_drains_lowest_id_leaves_out_rows_held_back() {
        let db = pipeline::testing::TestDb::create().await;
        let pool = PgPool::connect(&db.url).await.expect("pool");
        let start = DrainStart::read(&pool).await.expect("read");
        assert_eq!(start.lowest_pending, None, "nothing pending");
        let row = |published: &str, failed: &str, key: &str| {
            format!(
                "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, published_at, failed_at) \
                 VALUES ('{key}', gen_random_uuid(), 'order.created', '{{}}', {published}, {failed}) RETURNING id"
            )
        };
        let held = "00000000-0000-0000-0000-00000000000a";
        let mut ids = Vec::new();
        for sql in [
            row("now()", "NULL", "00000000-0000-0000-0000-00000000000b"),
            row("NULL", "now()", held),
            row("NULL", "NULL", held),
            row("NULL", "NULL", "00000000-0000-0000-0000-00000000000c"),
            row("NULL", "NULL", "00000000-0000-0000-0000-00000000000d"),
        ] {
            let id: i64 = sqlx::query_scalar(&sql)
                .fetch_one(&pool)
                .await
                .expect("insert");
            ids.push(id);
        }
        let start = DrainStart::read(&pool).await.expect("read");
        assert_eq!(start.lowest_pending, Some(ids[3]));
    }

    #[test]
    fn nothing_drained_skips_nothing() {
        let d = Drained::default();
        assert!(d.runs.is_empty());
        assert!(!d.contains(0));
        assert_eq!(d.rows(), 0);
    }
}
