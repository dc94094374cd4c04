//! The relay's side of the outbox: claim a shard's pending rows, mark them
//! published. All of it inside one transaction that holds the shard's lock.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Postgres, Transaction};
use uuid::Uuid;

/// Number of shards; must match the `shard` expression of the outbox table
/// (migrations/*_relay_shards.sql).
pub const SHARDS: i16 = 16;

/// Base of the advisory-lock ids the relay uses, one per shard. An arbitrary
/// constant chosen to stay clear of other users of advisory locks.
const LOCK_BASE: i64 = 0x0e11_7e1a_0000;

/// A pending outbox row.
#[derive(Debug, Clone, sqlx::FromRow)]
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
}

/// Tries to take `shard`'s lock for the life of `tx`. `false`: another relay
/// worker holds it; skip the shard.
///
/// The lock is transaction-scoped: it is released by the same commit that
/// marks the batch published, or by the rollback when the relay dies. That is
/// the fence: a worker can only mark rows while it still holds the lease.
pub async fn try_lock_shard(tx: &mut Transaction<'_, Postgres>, shard: i16) -> sqlx::Result<bool> {
    sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
        .bind(LOCK_BASE + i64::from(shard))
        .fetch_one(&mut **tx)
        .await
}

/// Claims up to `limit` pending rows of `shard` in id order.
///
/// `FOR UPDATE SKIP LOCKED`: rows locked by anyone else (a manual fix-up, a
/// relay of an older version) are skipped rather than waited for.
pub async fn claim(
    conn: &mut PgConnection,
    shard: i16,
    limit: i64,
) -> sqlx::Result<Vec<PendingRow>> {
    sqlx::query_as(
        "SELECT id, aggregate_id, msg_id, event_type, payload, created_at \
         FROM orders.outbox \
         WHERE shard = $1 AND published_at IS NULL \
         ORDER BY id LIMIT $2 \
         FOR UPDATE SKIP LOCKED",
    )
    .bind(shard)
    .bind(limit)
    .fetch_all(conn)
    .await
}

/// Marks rows published.
pub async fn mark_published(conn: &mut PgConnection, ids: &[i64]) -> sqlx::Result<u64> {
    Ok(
        sqlx::query("UPDATE orders.outbox SET published_at = now() WHERE id = ANY($1)")
            .bind(ids)
            .execute(conn)
            .await?
            .rows_affected(),
    )
}

/// Keeps only the first (lowest id) row of each aggregate, so that one key
/// is never in flight twice in a batch: if its first event failed to deliver
/// and a later one succeeded, the retry would land after the later one.
pub fn first_per_aggregate(rows: Vec<PendingRow>) -> Vec<PendingRow> {
    let mut seen = std::collections::HashSet::with_capacity(rows.len());
    rows.into_iter()
        .filter(|row| seen.insert(row.aggregate_id))
        .collect()
}

/// Backlog size and the age of the oldest pending row, in seconds.
pub async fn lag(conn: &mut PgConnection) -> sqlx::Result<(i64, f64)> {
    sqlx::query_as(
        "SELECT count(*), \
                COALESCE(EXTRACT(EPOCH FROM now() - min(created_at))::float8, 0) \
         FROM orders.outbox WHERE published_at IS NULL",
    )
    .fetch_one(conn)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, aggregate: u128) -> PendingRow {
        PendingRow {
            id,
            aggregate_id: Uuid::from_u128(aggregate),
            msg_id: Uuid::now_v7(),
            event_type: "t".into(),
            payload: b"{}".to_vec(),
            created_at: Utc::now(),
        }
    }

    #[test]
    fn one_row_per_aggregate_the_earliest() {
        let rows = vec![row(1, 7), row(2, 8), row(3, 7), row(4, 9), row(5, 8)];
        let ids: Vec<i64> = first_per_aggregate(rows).iter().map(|r| r.id).collect();
        assert_eq!(ids, vec![1, 2, 4]);
    }
}
