//! Idempotency keys at orders' write path: how a batch's keys are claimed.
//!
//! A client sends a key with each request; the first request with that key
//! claims it in the library's table (`fx.idempotency_keys`, by the library's
//! rules: an `INSERT … ON CONFLICT DO NOTHING` of the key's row,
//! with the response it will get, in the same statement as the work: orders'
//! write statement, `crates/orders/src/store.rs`). Every later request with
//! the same key and the same request gets that stored response back,
//! verbatim; the same key with a different request is a mismatch
//! ([`effectively::store::KeyClaim`]).
//!
//! Concurrent requests with one key serialize in the database: the second
//! `INSERT` waits on the first transaction's row lock, then sees the committed
//! row (or, if the first rolled back, takes the key itself). No application
//! lock, no deadlock, no "in progress" state to expire.
//!
//! That is [`ClaimStrategy::OnConflict`], the default. Experiment 7 compares
//! it with [`ClaimStrategy::AdvisoryLock`]: a transaction-scoped advisory lock
//! on each key's hash first ([`lock_keys`]), then the same claim.
//!
//! The key, fingerprint and stored response are the library's
//! ([`effectively::idempotency`]), re-exported here.

pub use effectively::idempotency::{
    Fingerprint, IdempotencyKey, KeyError, MAX_KEY_LEN, StoredResponse,
};
use sqlx::PgConnection;

/// How a batch's keys are claimed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ClaimStrategy {
    /// `INSERT … ON CONFLICT DO NOTHING`; the keys it did not insert are
    /// read. A key whose first request is still in flight makes the insert
    /// wait on that transaction's row lock; a committed key is a read.
    #[default]
    OnConflict,
    /// `pg_advisory_xact_lock` on each key's hash first (in hash order, so
    /// two batches cannot deadlock), then the same claim, which then never
    /// waits on a row. Every request of a key waits for the lock, replays
    /// included.
    AdvisoryLock,
}

/// The advisory-lock class of idempotency keys: the first half of the
/// two-int4 lock id `(class, hashtext(key))` that
/// [`ClaimStrategy::AdvisoryLock`] takes. (The two-int4 ids never collide
/// with the single-bigint ids the relay and payments take.) Two keys whose
/// hashes collide share a lock: they serialize, nothing else.
pub const ADVISORY_LOCK_CLASS: i32 = 0x0e11;

/// Takes the advisory locks of `keys` ([`ClaimStrategy::AdvisoryLock`]) for
/// the rest of the caller's transaction, in hash order (the aggregate takes its
/// input sorted), so two batches sharing keys wait for each other in one order.
/// In READ COMMITTED, the caller's next statement takes its snapshot after the
/// locks are held, so it sees every key committed under them.
pub async fn lock_keys(conn: &mut PgConnection, keys: &[&str]) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "SELECT count(pg_advisory_xact_lock($1::int4, h)) FROM \
           (SELECT DISTINCT hashtext(k) AS h FROM unnest($2::text[]) AS k ORDER BY h) AS s",
        ADVISORY_LOCK_CLASS,
        keys as &[&str],
    )
    .fetch_one(conn)
    .await?;
    Ok(())
}
