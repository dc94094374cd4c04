//! Running the diff: as one statement over the whole id space, or in
//! ranges side by side on connections that share one exported snapshot;
//! and waiting until the pipeline is drained.

use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::report::{DeadLetters, Floors, Part, Policy, Report, Responses};

/// Runs the diff as one statement over the whole id space on `conn` (a
/// pooled connection, or a transaction: tests corrupt a database inside one
/// and roll it back), then the stored responses' check.
pub async fn reconcile(conn: &mut PgConnection) -> sqlx::Result<Report> {
    let floors = Floors::read(conn).await?;
    let (part, responses) = run_part(conn, Uuid::nil(), Uuid::max(), floors).await?;
    let dead = DeadLetters::read(conn).await?;
    Ok(Report::from_parts(&[part], &[responses], dead, floors))
}

/// Runs the diff in `jobs` order-id ranges side by side, one connection
/// each, all reading one snapshot: the first connection exports it
/// (`pg_export_snapshot`) and the others import it before their first
/// query, so the parts add up to exactly what one statement would see.
/// The ranges split the orders' ids evenly between the smallest and the
/// largest (UUIDv7 ids: even slices of time); the first and the last reach
/// to the ends of the id space, so every row of every table is in exactly
/// one range. Each part runs without PostgreSQL's own parallel workers and
/// without JIT (the ranges are the parallelism; compiling the statement
/// costs more than it saves).
pub async fn reconcile_in_parts(pool: &PgPool, jobs: usize) -> sqlx::Result<Report> {
    let mut lead = begin_snapshot(pool, None).await?;
    // A function's result has no NOT NULL for PostgreSQL to report; this
    // one never returns NULL.
    let snapshot = sqlx::query_scalar!(r#"SELECT pg_export_snapshot() AS "snapshot!""#)
        .fetch_one(&mut *lead)
        .await?;
    let bounds = sqlx::query!(
        "SELECT (SELECT order_id FROM orders.orders ORDER BY order_id LIMIT 1) AS lo, \
                (SELECT order_id FROM orders.orders ORDER BY order_id DESC LIMIT 1) AS hi"
    )
    .fetch_one(&mut *lead)
    .await?;
    let ranges = id_ranges(bounds.lo.zip(bounds.hi), jobs);
    let floors = Floors::read(&mut lead).await?;
    let mut txs = vec![lead];
    for _ in 1..ranges.len() {
        txs.push(begin_snapshot(pool, Some(&snapshot)).await?);
    }
    let parts = futures::future::try_join_all(
        txs.iter_mut()
            .zip(&ranges)
            .map(|(tx, &(lo, hi))| run_part(tx, lo, hi, floors)),
    )
    .await?;
    let dead = DeadLetters::read(&mut txs[0]).await?;
    let (parts, responses): (Vec<Part>, Vec<Responses>) = parts.into_iter().unzip();
    Ok(Report::from_parts(&parts, &responses, dead, floors))
}

/// A read-only repeatable-read transaction, on `snapshot` if given, tuned
/// for one part of the diff.
async fn begin_snapshot(
    pool: &PgPool,
    snapshot: Option<&str>,
) -> sqlx::Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let mut tx = pool.begin().await?;
    sqlx::query!("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    if let Some(id) = snapshot {
        // A utility statement takes no parameters; the id is the server's
        // own (hex digits and dashes), checked before it is spliced in.
        if id.is_empty() || !id.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            return Err(sqlx::Error::Protocol(format!(
                "unexpected snapshot id from pg_export_snapshot: {id:?}"
            )));
        }
        // Dynamic (the id is spliced in), so checked at run time only.
        sqlx::query(&format!("SET TRANSACTION SNAPSHOT '{id}'"))
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query!("SET LOCAL jit = off")
        .execute(&mut *tx)
        .await?;
    sqlx::query!("SET LOCAL max_parallel_workers_per_gather = 0")
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}

/// One range: the diff ([`PART_SQL`](crate::PART_SQL)), then its keys' stored responses
/// ([`RESPONSES_SQL`](crate::RESPONSES_SQL)), on `conn`.
async fn run_part(
    conn: &mut PgConnection,
    lo: Uuid,
    hi: Uuid,
    floors: Floors,
) -> sqlx::Result<(Part, Responses)> {
    let part = sqlx::query_file_as!(
        Part,
        "src/sql/part.sql",
        lo,
        hi,
        floors.keys,
        floors.outbox,
        floors.msg()
    )
    .fetch_one(&mut *conn)
    .await?;
    let responses = Responses::read(conn, lo, hi).await?;
    Ok((part, responses))
}

/// At most `jobs` inclusive ranges that partition the whole UUID space,
/// cut evenly between the smallest and the largest order id (`bounds`).
pub fn id_ranges(bounds: Option<(Uuid, Uuid)>, jobs: usize) -> Vec<(Uuid, Uuid)> {
    let mut cuts: Vec<u128> = Vec::new();
    if let Some((lo, hi)) = bounds {
        let (lo, hi) = (lo.as_u128(), hi.as_u128());
        let jobs = jobs.max(1) as u128;
        let step = hi.saturating_sub(lo) / jobs;
        cuts = (1..jobs)
            .map(|i| lo + step * i)
            .filter(|&c| c > 0)
            .collect();
        cuts.dedup();
    }
    let mut ranges = Vec::with_capacity(cuts.len() + 1);
    let mut start = 0u128;
    for cut in cuts {
        ranges.push((Uuid::from_u128(start), Uuid::from_u128(cut - 1)));
        start = cut;
    }
    ranges.push((Uuid::from_u128(start), Uuid::max()));
    ranges
}

/// Waits until the pipeline is drained or `timeout` passes; `true` if
/// drained. Under [`Policy::unmarked_outbox`] an outbox row is done once its
/// event is in the inbox (or dead-lettered), whatever its `published_at`.
pub async fn wait_drained(pool: &PgPool, timeout: Duration, policy: Policy) -> sqlx::Result<bool> {
    let deadline = Instant::now() + timeout;
    loop {
        let drained = sqlx::query_file_scalar!("src/sql/drained.sql", policy.unmarked_outbox)
            .fetch_one(pool)
            .await?;
        if drained {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_ranges_partition_the_whole_id_space() {
        let lo = Uuid::from_u128(1000);
        let hi = Uuid::from_u128(1999);
        for jobs in [0, 1, 2, 3, 7, 1000, 5000] {
            let ranges = id_ranges(Some((lo, hi)), jobs);
            assert!(
                ranges.len() <= jobs.max(1),
                "{jobs}: {} ranges",
                ranges.len()
            );
            assert_eq!(ranges[0].0, Uuid::nil());
            assert_eq!(ranges.last().expect("one range at least").1, Uuid::max());
            for w in ranges.windows(2) {
                assert_eq!(w[0].1.as_u128() + 1, w[1].0.as_u128(), "{jobs}: contiguous");
            }
            for (a, b) in &ranges {
                assert!(a <= b);
            }
        }
        assert_eq!(id_ranges(Some((lo, hi)), 4).len(), 4);
        assert_eq!(id_ranges(None, 4), vec![(Uuid::nil(), Uuid::max())]);
        assert_eq!(
            id_ranges(Some((Uuid::nil(), Uuid::nil())), 4),
            vec![(Uuid::nil(), Uuid::max())]
        );
        let all = id_ranges(Some((Uuid::nil(), Uuid::max())), 2);
        assert_eq!(all.len(), 2);
    }
}
