//! The relay's side of the outbox: claim a shard's pending rows, mark them
//! published. All of it inside one transaction that holds the shard's lock.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

/// Number of shards; must match the `shard` expression of the outbox table
/// (migrations/*_relay_shards.sql).
pub const SHARDS: i16 = 16;

/// Base of the advisory-lock ids the relay uses, one per shard. An arbitrary
/// constant chosen to stay clear of other users of advisory locks.
const LOCK_BASE: i64 = 0x0e11_7e1a_0000;

/// A pending outbox row.
#[derive(Debug, Clone)]
pub struct PendingRow {
    /// Publish order.
    pub id: i64,
    /// Kafka key.
    pub aggregate_id: Uuid,
    /// Stable dedup identity.
    pub msg_id: Uuid,
    /// Event type.
    pub event_type: String,
    /// JSON body.
    pub payload: Vec<u8>,
    /// Commit time (roughly: insert time of the row).
    pub created_at: DateTime<Utc>,
    /// Publish attempts that failed for the row itself (not for the broker).
    pub attempts: i32,
}

impl PendingRow {
    /// The row as it goes on the wire (a Kafka message's value, a webhook's
    /// body): its envelope, encoded. `Err` when its payload is not JSON,
    /// which no retry changes.
    pub fn encode(&self) -> Result<Vec<u8>, pipeline::envelope::EnvelopeError> {
        pipeline::envelope::Envelope::new(
            self.msg_id,
            self.event_type.clone(),
            self.aggregate_id,
            self.created_at,
            &self.payload,
        )
        .and_then(|e| e.encode())
    }
}

/// Tries to take `shard`'s lock for the life of `tx`. `false`: another
/// relay worker holds it; skip it. The webhook fan-out's lock (`--sink
/// http`); the Kafka relay's passes take the library relay's
/// (`effectively::store::Relay`).
///
/// The lock is transaction-scoped: it is released by the same commit that
/// marks the batch published, or by the rollback when the relay dies. It
/// keeps one fan-out transaction per shard in flight, across every relay
/// process, and a hung one's shard until its session ends. Per-key order
/// rests on it: the fan-out reads its rows without locking them
/// ([`read_shards`]), so no other fan-out may read the shard until this
/// one's marks commit.
pub async fn try_lock_shard(tx: &mut Transaction<'_, Postgres>, shard: i16) -> sqlx::Result<bool> {
    // pg_try_advisory_xact_lock is never NULL, but PostgreSQL reports no
    // nullability for a function's result.
    sqlx::query_scalar!(
        r#"SELECT pg_try_advisory_xact_lock($1::int8) AS "locked!""#,
        LOCK_BASE + i64::from(shard)
    )
    .fetch_one(&mut **tx)
    .await
}

/// What [`read_shards`] read.
#[derive(Debug, Default)]
pub struct Claim {
    /// The rows, in id order.
    pub rows: Vec<PendingRow>,
    /// Some shard gave all its share of the limit: it may have more.
    pub full: bool,
}

/// Reads up to `share` pending rows of each shard of `shards` in id order,
/// every row of a key among them (the library relay's claim: a pass sends a
/// key's rows in order, all in flight at once through the idempotent
/// producer), leaving out the rows of a key whose earlier row failed for
/// good. Marks nothing and locks nothing: the pass's shard locks keep
/// every other pass off these shards, and its settle marks what was
/// delivered ([`mark_published`]). `full`: some shard gave its whole share.
///
/// The plan must not depend on the statistics: a queue's statistics are
/// often taken while it is empty, and a burst arrives before the next
/// analyze. One ordered walk of `outbox_pending_by_shard` per shard (one
/// scan of `shard = ANY(..)` would sort every pending row of the shards
/// before its `LIMIT`), and `OFFSET 0` keeps the `NOT EXISTS` a subquery
/// run per candidate (PostgreSQL does not flatten a sublink with an OFFSET
/// into a join): one probe of `outbox_failed_by_aggregate` each. As an
/// anti-join, with statistics that said "no row pending", the claim before
/// it scanned every pending row per candidate: a 1,000-row claim took
/// minutes over a large backlog (FINDINGS.md §16; test
/// `a_claim_after_an_empty_outbox_was_analyzed_…`).
pub async fn read_shards(
    conn: &mut PgConnection,
    shards: &[i16],
    share: i64,
) -> sqlx::Result<Claim> {
    let share = share.max(1);
    let rows = sqlx::query!(
        r#"SELECT c.shard AS "shard!", c.id AS "id!", c.aggregate_id AS "aggregate_id!",
                  c.msg_id AS "msg_id!", c.event_type AS "event_type!", c.payload AS "payload!",
                  c.created_at AS "created_at!", c.attempts AS "attempts!"
           FROM unnest($1::int2[]) AS s(shard),
           LATERAL (
             SELECT o.shard, o.id, o.aggregate_id, o.msg_id, o.event_type, o.payload,
                    o.created_at, o.attempts
             FROM orders.outbox o
             WHERE o.shard = s.shard AND o.published_at IS NULL AND o.failed_at IS NULL
               AND NOT EXISTS (SELECT 1 FROM orders.outbox f
                               WHERE f.aggregate_id = o.aggregate_id AND f.id < o.id
                                 AND f.published_at IS NULL AND f.failed_at IS NOT NULL
                               OFFSET 0)
             ORDER BY o.id LIMIT $2) c
           ORDER BY c.id"#,
        shards,
        share
    )
    .fetch_all(conn)
    .await?;
    let mut per_shard = [0_i64; SHARDS as usize];
    let mut claim = Claim {
        rows: Vec::with_capacity(rows.len()),
        full: false,
    };
    for row in rows {
        if let Some(n) = usize::try_from(row.shard)
            .ok()
            .and_then(|s| per_shard.get_mut(s))
        {
            *n += 1;
            claim.full |= *n >= share;
        }
        claim.rows.push(PendingRow {
            id: row.id,
            aggregate_id: row.aggregate_id,
            msg_id: row.msg_id,
            event_type: row.event_type,
            payload: row.payload,
            created_at: row.created_at,
            attempts: row.attempts,
        });
    }
    Ok(claim)
}

/// How many of `rows` (`(id, msg_id)`, distinct) are settled as far as a
/// mark is concerned: seen by this statement's snapshot, or gone because
/// the outbox expiry deleted them (minted before the outbox retention; only
/// published rows are ever deleted, so such a row was published and marked
/// before). A row read from the WAL stream can be invisible for a moment:
/// the walsender may send a transaction once its commit record is flushed,
/// before the committing backend has made it visible to other snapshots
/// (FINDINGS.md §22). A row the stream reads again after a restart may have
/// been deleted meanwhile: a relay down past the retention, whose start-up
/// drain and expiry ran before its stream came back to the row.
pub async fn count_settled(conn: &mut PgConnection, rows: &[(i64, Uuid)]) -> sqlx::Result<i64> {
    let (ids, msg_ids): (Vec<i64>, Vec<Uuid>) = rows.iter().copied().unzip();
    sqlx::query_scalar(
        "SELECT count(*) FROM unnest($1::int8[], $2::uuid[]) AS r(id, msg_id) \
         WHERE EXISTS (SELECT 1 FROM orders.outbox o WHERE o.id = r.id) \
            OR r.msg_id < effectively.v7_floor(now() - (SELECT p.retention FROM orders.outbox_policy p))",
    )
    .bind(ids)
    .bind(msg_ids)
    .fetch_one(conn)
    .await
}

/// Of `rows` (`(id, msg_id)`) that a mark meant to settle (mark published,
/// or failed), the ids of those it did not: still pending, or not there and
/// younger than the outbox retention (so not deleted by the expiry, but a
/// commit this statement cannot see yet). Published or failed rows, and
/// rows the expiry deleted, are settled. The WAL relay asks after a mark
/// that changed fewer rows than it meant to: a row already published (read
/// again after a restart, or taken by a poll relay meanwhile) is fine, a
/// row left pending must not be confirmed past.
pub async fn unsettled(conn: &mut PgConnection, rows: &[(i64, Uuid)]) -> sqlx::Result<Vec<i64>> {
    let (ids, msg_ids): (Vec<i64>, Vec<Uuid>) = rows.iter().copied().unzip();
    // `coalesce(published_at, 'infinity') = 'infinity'` for "pending", as in
    // `mark_published`: each row by `outbox_pkey`.
    sqlx::query_scalar(
        "SELECT r.id FROM unnest($1::int8[], $2::uuid[]) AS r(id, msg_id) \
         LEFT JOIN orders.outbox o ON o.id = r.id \
         WHERE CASE WHEN o.id IS NULL \
                    THEN r.msg_id >= effectively.v7_floor(now() - (SELECT p.retention FROM orders.outbox_policy p)) \
                    ELSE coalesce(o.published_at, 'infinity') = 'infinity' AND o.failed_at IS NULL END \
         ORDER BY r.id",
    )
    .bind(ids)
    .bind(msg_ids)
    .fetch_all(conn)
    .await
}

/// Marks rows published. A row already published keeps its first time: the
/// WAL relay reads rows again after a restart, and re-marking them made
/// experiment 6's commit→publish show the restart, not the first publish
/// (FINDINGS.md §22).
///
/// "Not yet published" is written `coalesce(published_at, 'infinity') =
/// 'infinity'` (no row is published at infinity) rather than `published_at
/// IS NULL`, so the planner cannot prove the pending partial indexes'
/// predicate from it: the rows are found by `outbox_pkey`, one probe per id.
/// With `IS NULL`, after statistics taken while nothing was pending, the
/// planner believed `outbox_pending_by_aggregate` held one row and scanned it
/// whole for the ids: every pending row read for every mark, about 100 µs
/// per row marked with 2,000 pending (test
/// a_mark_after_an_empty_outbox_was_analyzed_reads_only_its_rows; FINDINGS.md
/// §15).
pub async fn mark_published(conn: &mut PgConnection, ids: &[i64]) -> sqlx::Result<u64> {
    Ok(sqlx::query!(
        "UPDATE orders.outbox SET published_at = now() \
         WHERE id = ANY($1) AND coalesce(published_at, 'infinity') = 'infinity'",
        ids
    )
    .execute(conn)
    .await?
    .rows_affected())
}

/// Records a failed publish attempt of each row (`(id, error)`): counts it,
/// keeps the error, and marks the row failed once it has failed
/// `max_attempts` times. The row is unpublished again (the claim marked
/// it). Returns how many rows this marked failed.
pub async fn record_failures(
    conn: &mut PgConnection,
    failures: &[(i64, String)],
    max_attempts: i32,
) -> sqlx::Result<u64> {
    let ids: Vec<i64> = failures.iter().map(|(id, _)| *id).collect();
    let errors: Vec<String> = failures
        .iter()
        .map(|(_, e)| effectively::text::storable(e))
        .collect();
    // count(*) is never NULL, but PostgreSQL reports no nullability for an
    // aggregate.
    let failed: i64 = sqlx::query_scalar!(
        r#"WITH u AS (
             UPDATE orders.outbox o SET attempts = o.attempts + 1, last_error = f.error,
                    failed_at = CASE WHEN o.attempts + 1 >= $3 THEN now() END,
                    published_at = NULL
             FROM unnest($1::int8[], $2::text[]) AS f(id, error)
             WHERE o.id = f.id
             RETURNING o.failed_at)
           SELECT count(*) AS "failed!" FROM u WHERE failed_at IS NOT NULL"#,
        &ids,
        &errors,
        max_attempts
    )
    .fetch_one(conn)
    .await?;
    Ok(u64::try_from(failed).unwrap_or(0))
}

/// The backlog: rows pending (not failed), the age of the oldest of them in
/// seconds, and rows marked failed.
pub async fn lag(conn: &mut PgConnection) -> sqlx::Result<(i64, f64, i64)> {
    // Aggregates and COALESCE: never NULL here, but PostgreSQL reports no
    // nullability for them.
    let row = sqlx::query!(
        r#"SELECT count(*) FILTER (WHERE failed_at IS NULL) AS "pending!",
                  COALESCE(EXTRACT(EPOCH FROM now() - min(created_at) FILTER (WHERE failed_at IS NULL))::float8, 0) AS "oldest_seconds!",
                  count(*) FILTER (WHERE failed_at IS NOT NULL) AS "failed!"
           FROM orders.outbox WHERE published_at IS NULL"#
    )
    .fetch_one(conn)
    .await?;
    Ok((row.pending, row.oldest_seconds, row.failed))
}

/// Deletes up to `batch` published rows older than the outbox retention
/// (`orders.outbox_policy`), oldest first; returns how many. Pending and
/// failed rows are never deleted. The retention bounds how long a row can be
/// re-published, one term of payments' redelivery horizon.
pub async fn expire(pool: &PgPool, batch: i32) -> sqlx::Result<i32> {
    sqlx::query_scalar!(r#"SELECT orders.outbox_expire($1) AS "n!""#, batch)
        .fetch_one(pool)
        .await
}
