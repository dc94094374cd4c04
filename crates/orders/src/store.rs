//! The Orders tables: THE write transaction (idempotency key, order and
//! outbox row) and the reads.
//!
//! This is one of the two places where correctness lives (the other is the
//! Payments inbox). One `begin`, one `commit` ([`Store::write_batch`]): the
//! keys, the orders and the events commit together or not at all. So
//! * a committed order always has its event in the outbox (no lost publish:
//!   nothing is published here, the relay reads the outbox after commit);
//! * a failed request leaves no key behind, and its retry can succeed;
//! * a retry finds the key and gets the first response, with nothing written.
//!
//! The transaction takes a batch of requests with distinct keys; putting
//! concurrent requests into batches is the writer's job (`writer.rs`).

use chrono::{DateTime, Utc};
use effectively::contract::CrashPoint;
use effectively::crash::Crasher;
use effectively::idempotency::{
    Claim, ClaimStrategy, Fingerprint, IdempotencyError, IdempotencyKey, IdempotencyStore, NewKey,
    StoredResponse,
};
use effectively::outbox::Outbox;
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::order::{NewOrder, ORDER_STATUS_CREATED};

/// A failure to inject inside the write transaction, for tests and chaos runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InjectFault {
    /// No fault.
    #[default]
    None,
    /// Fail after the order insert, before the outbox insert and the commit.
    AfterOrderInsert,
}

/// An order as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OrderRow {
    /// Order id.
    pub order_id: Uuid,
    /// Account charged.
    pub account_id: i64,
    /// Amount in cents.
    pub amount_cents: i64,
    /// Status.
    pub status: String,
    /// When the order was created.
    pub created_at: DateTime<Utc>,
}

/// Why a store operation failed. The front ends map it to their error
/// (`error.rs`); the store knows nothing of HTTP or gRPC.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A statement or the connection failed.
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    /// The idempotency-key claim failed.
    #[error(transparent)]
    Claim(#[from] IdempotencyError),
    /// An event payload could not be encoded.
    #[error("encode an order.created payload: {0}")]
    Encode(#[from] serde_json::Error),
    /// `--inject-fault after-order-insert` (tests only).
    #[error("injected fault after the order insert")]
    Injected,
}

/// What kind of failure ended a write transaction: the label of
/// `orders_write_errors_total{kind}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteErrorKind {
    /// The database went away or refuses work for now.
    Unavailable,
    /// SQLSTATE 40P01.
    Deadlock,
    /// SQLSTATE 40001.
    Serialization,
    /// SQLSTATE 55P03.
    LockTimeout,
    /// SQLSTATE 57014.
    StatementTimeout,
    /// Another database error.
    Db,
    /// Anything else (encoding, an injected fault).
    Other,
}

impl WriteErrorKind {
    /// Every kind, so the metric's series exist before the first failure.
    pub const ALL: [Self; 7] = [
        Self::Unavailable,
        Self::Deadlock,
        Self::Serialization,
        Self::LockTimeout,
        Self::StatementTimeout,
        Self::Db,
        Self::Other,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Unavailable => "unavailable",
            Self::Deadlock => "deadlock",
            Self::Serialization => "serialization",
            Self::LockTimeout => "lock_timeout",
            Self::StatementTimeout => "statement_timeout",
            Self::Db => "db",
            Self::Other => "other",
        }
    }
}

impl StoreError {
    /// What kind of failure, for `orders_write_errors_total{kind}`.
    pub fn kind(&self) -> WriteErrorKind {
        if self.is_unavailable() {
            return WriteErrorKind::Unavailable;
        }
        match self {
            Self::Db(error) | Self::Claim(IdempotencyError::Db(error)) => {
                match error.as_database_error().and_then(|e| e.code()).as_deref() {
                    Some("40P01") => WriteErrorKind::Deadlock,
                    Some("40001") => WriteErrorKind::Serialization,
                    Some("55P03") => WriteErrorKind::LockTimeout,
                    Some("57014") => WriteErrorKind::StatementTimeout,
                    _ => WriteErrorKind::Db,
                }
            }
            _ => WriteErrorKind::Other,
        }
    }

    /// Whether the database went away or is refusing work for now
    /// ([`effectively::db::is_unavailable`]): retrying later is the answer.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Db(error) | Self::Claim(IdempotencyError::Db(error)) => {
                effectively::db::is_unavailable(error)
            }
            _ => false,
        }
    }
}

/// One create request as the write transaction takes it.
#[derive(Debug, Clone)]
pub struct Create {
    /// The client's idempotency key.
    pub key: IdempotencyKey,
    /// The request's fingerprint, stored with the key.
    pub fingerprint: Fingerprint,
    /// The order to write if the key is new.
    pub order: NewOrder,
    /// The response the first request answers, stored with the key so that
    /// every replay returns exactly it.
    pub response: StoredResponse,
}

/// The Orders tables.
#[derive(Debug)]
pub struct Store {
    pool: PgPool,
    keys: IdempotencyStore,
    outbox: Outbox,
    fault: InjectFault,
    no_idempotency: bool,
    crasher: Crasher,
}

impl Store {
    /// Deletes up to `batch` idempotency keys older than the key retention
    /// (`orders.key_policy`, 24 h unless the owner changed it), oldest
    /// first; returns how many. A retry of a deleted key is a new request.
    pub async fn expire_keys(&self, batch: i32) -> sqlx::Result<i32> {
        sqlx::query_scalar!(r#"SELECT orders.keys_expire($1) AS "n!""#, batch)
            .fetch_one(&self.pool)
            .await
    }

    /// The key retention (`orders.key_policy`), in seconds.
    pub async fn key_retention_secs(&self) -> sqlx::Result<f64> {
        sqlx::query_scalar!(
            r#"SELECT extract(epoch FROM retention)::float8 AS "secs!" FROM orders.key_policy"#
        )
        .fetch_one(&self.pool)
        .await
    }

    /// The tables behind `pool`. `no_idempotency` is the UNSAFE measurement
    /// baseline (`orders --no-idempotency`): no key claim, no stored
    /// response; every request writes a new order and event. `crasher` arms
    /// crash point `commit`.
    pub fn new(pool: PgPool, fault: InjectFault, no_idempotency: bool, crasher: Crasher) -> Self {
        Self {
            pool,
            keys: IdempotencyStore::default(),
            outbox: Outbox,
            fault,
            no_idempotency,
            crasher,
        }
    }

    /// Claims keys by `strategy` (`orders --claim-strategy`; the default is
    /// [`ClaimStrategy::OnConflict`]).
    pub fn with_claim_strategy(mut self, strategy: ClaimStrategy) -> Self {
        self.keys = IdempotencyStore::new(strategy);
        self
    }

    /// Whether the key claim is skipped (`--no-idempotency`).
    pub fn no_idempotency(&self) -> bool {
        self.no_idempotency
    }

    /// THE transaction: claim every key, insert the orders and the outbox
    /// events of the new ones, commit. Keys must be distinct within a batch
    /// (one statement cannot both insert and see a key). One [`Claim`] per
    /// request, in order.
    ///
    /// The claim inserts the batch's key rows in key order, so two
    /// overlapping batches wait for each other's key rows in one order and
    /// cannot deadlock.
    ///
    /// With `no_idempotency` (the unsafe measurement baseline) the claim is
    /// skipped and every request counts as new: the rest of the transaction is
    /// the same code, so the two modes differ by exactly the idempotency check.
    pub async fn write_batch(&self, batch: &[&Create]) -> Result<Vec<Claim>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let claims = if self.no_idempotency {
            vec![Claim::New; batch.len()]
        } else {
            let items: Vec<NewKey<'_>> = batch
                .iter()
                .map(|c| NewKey {
                    key: &c.key,
                    fingerprint: &c.fingerprint,
                    order_id: c.order.order_id(),
                    response: &c.response,
                })
                .collect();
            self.keys.claim_batch(&mut tx, &items).await?
        };
        let new: Vec<&NewOrder> = batch
            .iter()
            .zip(&claims)
            .filter(|(_, claim)| **claim == Claim::New)
            .map(|(create, _)| &create.order)
            .collect();
        if new.is_empty() {
            // Only replays and mismatches: nothing written, nothing to commit.
            return Ok(claims);
        }
        insert_orders(&mut tx, &new).await?;
        if self.fault == InjectFault::AfterOrderInsert {
            return Err(StoreError::Injected);
        }
        let events = new
            .iter()
            .map(|order| order.created_event())
            .collect::<Result<Vec<_>, _>>()?;
        self.outbox.enqueue_batch(&mut tx, &events).await?;
        tx.commit().await?;
        // Committed, nobody answered yet: a crash here leaves orders whose
        // clients saw an error. Their retries must get the stored responses.
        self.crasher.point(CrashPoint::Commit);
        Ok(claims)
    }

    /// Reads one order.
    pub async fn get(&self, order_id: Uuid) -> Result<Option<OrderRow>, StoreError> {
        Ok(sqlx::query_as!(
            OrderRow,
            "SELECT order_id, account_id, amount_cents, status, created_at \
             FROM orders.orders WHERE order_id = $1",
            order_id
        )
        .fetch_optional(&self.pool)
        .await?)
    }
}

async fn insert_orders(conn: &mut PgConnection, orders: &[&NewOrder]) -> Result<(), sqlx::Error> {
    let ids: Vec<Uuid> = orders.iter().map(|o| o.order_id()).collect();
    let accounts: Vec<i64> = orders.iter().map(|o| o.account_id()).collect();
    let amounts: Vec<i64> = orders.iter().map(|o| o.amount_cents()).collect();
    sqlx::query!(
        "INSERT INTO orders.orders (order_id, account_id, amount_cents, status) \
         SELECT o, a, m, $4 FROM unnest($1::uuid[], $2::int8[], $3::int8[]) AS u(o, a, m)",
        &ids,
        &accounts,
        &amounts,
        ORDER_STATUS_CREATED
    )
    .execute(conn)
    .await?;
    Ok(())
}
