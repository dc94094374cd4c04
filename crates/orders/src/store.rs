//! The Orders tables: THE write (idempotency key, order and outbox row) and
//! the reads.
//!
//! This is one of the two places where correctness lives (the other is the
//! Payments inbox). One statement, so one transaction ([`Store::write_batch`]):
//! the keys, the orders and the events commit together or not at all. So
//! * a committed order always has its event in the outbox (no lost publish:
//!   nothing is published here, the relay reads the outbox after commit);
//! * a failed request leaves no key behind, and its retry can succeed;
//! * a retry finds the key and gets the first response, with nothing written.
//!
//! The statement takes a batch of requests with distinct keys (a key is a
//! caller's: [`ScopedKey`]); putting concurrent requests into batches is the
//! writer's job (`writer.rs`).

use chrono::{DateTime, Utc};
use effectively::store::{ClaimRow, KeyClaim};
use pipeline::contract::CrashPoint;
use pipeline::crash::Crasher;
use pipeline::idempotency::{self, ClaimStrategy, Fingerprint, IdempotencyKey, StoredResponse};
use pipeline::outbox::Notifier;
use serde::Serialize;
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::auth::Caller;
use crate::order::{NewOrder, ORDER_STATUS_CREATED};

/// A failure to inject inside the write transaction, for tests and chaos runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InjectFault {
    /// No fault.
    #[default]
    None,
    /// Fail after the write statement (key claims, orders and outbox rows),
    /// before the commit.
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
    /// A key conflicted, but its row was gone when read, on every attempt
    /// (only possible if rows are deleted concurrently, e.g. by expiry).
    #[error("idempotency key {0:?} conflicted but its row could not be read")]
    Vanished(String),
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
            Self::Db(error) => match error.as_database_error().and_then(|e| e.code()).as_deref() {
                Some("40P01") => WriteErrorKind::Deadlock,
                Some("40001") => WriteErrorKind::Serialization,
                Some("55P03") => WriteErrorKind::LockTimeout,
                Some("57014") => WriteErrorKind::StatementTimeout,
                _ => WriteErrorKind::Db,
            },
            _ => WriteErrorKind::Other,
        }
    }

    /// Whether the database went away or is refusing work for now
    /// ([`pipeline::db::is_unavailable`]): retrying later is the answer.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Db(error) => pipeline::db::is_unavailable(error),
            _ => false,
        }
    }
}

/// An idempotency key as the store claims it: the client's key in its
/// caller's scope (the same key from two callers is two keys).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ScopedKey {
    /// Whose key: its scope in `fx.idempotency_keys`.
    pub caller: Caller,
    /// The key the client sent.
    pub key: IdempotencyKey,
}

impl ScopedKey {
    /// The key the client sent, as text.
    pub fn as_str(&self) -> &str {
        self.key.as_str()
    }

    /// The scope of the key (the caller's).
    pub fn scope(&self) -> &str {
        self.caller.scope()
    }
}

/// One create request as the write transaction takes it.
#[derive(Debug, Clone)]
pub struct Create {
    /// The client's idempotency key, in its caller's scope.
    pub key: ScopedKey,
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
    strategy: ClaimStrategy,
    fault: InjectFault,
    no_idempotency: bool,
    crasher: Crasher,
    notifier: Option<Notifier>,
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
            strategy: ClaimStrategy::default(),
            notifier: None,
            fault,
            no_idempotency,
            crasher,
        }
    }

    /// Claims keys by `strategy` (`orders --claim-strategy`; the default is
    /// [`ClaimStrategy::OnConflict`]).
    pub fn with_claim_strategy(mut self, strategy: ClaimStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Wakes the relay through `notifier` after each write that committed
    /// outbox rows (the pool's sessions have the trigger's NOTIFY off:
    /// `SessionLimits::defer_outbox_notify`).
    pub fn with_notifier(mut self, notifier: Notifier) -> Self {
        self.notifier = Some(notifier);
        self
    }

    /// Whether the key claim is skipped (`--no-idempotency`).
    pub fn no_idempotency(&self) -> bool {
        self.no_idempotency
    }

    /// THE write: claim every key, insert the orders and the outbox events
    /// of the new ones, commit, in one statement ([`write_statement`]). Keys
    /// must be distinct within a batch (one statement cannot both insert and
    /// see a key). One [`KeyClaim`] per request, in order.
    ///
    /// One statement is one transaction and one round trip to PostgreSQL:
    /// the session is never idle inside a transaction, waiting for the
    /// service's next statement. With [`ClaimStrategy::AdvisoryLock`] the
    /// statement runs in a transaction after the keys' locks; with an
    /// injected fault, in a transaction that fails before its commit.
    ///
    /// A key that conflicted with a row committed after the statement's
    /// snapshot is neither claimed nor read; it goes into another statement,
    /// whose snapshot sees the row (up to [`ATTEMPTS`] in all).
    ///
    /// With `no_idempotency` (the unsafe measurement baseline) the claim is
    /// skipped and every request counts as new: the rest of the statement is
    /// the same, so the two modes differ by exactly the idempotency check.
    pub async fn write_batch(&self, batch: &[&Create]) -> Result<Vec<KeyClaim>, StoreError> {
        let locked = self.strategy == ClaimStrategy::AdvisoryLock && !self.no_idempotency;
        let (claims, shards) = if locked || self.fault != InjectFault::None {
            let mut tx = self.pool.begin().await?;
            if locked {
                // By the key alone: one key of two callers waits for the
                // other's lock, which costs time and nothing else.
                let keys: Vec<&str> = batch.iter().map(|c| c.key.as_str()).collect();
                idempotency::lock_keys(&mut tx, &keys).await?;
            }
            let written = self.write(&mut tx, batch).await?;
            if self.fault == InjectFault::AfterOrderInsert {
                return Err(StoreError::Injected);
            }
            tx.commit().await?;
            written
        } else {
            let mut conn = self.pool.acquire().await?;
            self.write(&mut conn, batch).await?
        };
        if claims.contains(&KeyClaim::New) {
            if let Some(notifier) = &self.notifier {
                // Only the loops of these shards have anything to claim.
                notifier.wake_shards(shards);
            }
            // Committed, nobody answered yet: a crash here leaves orders whose
            // clients saw an error. Their retries must get the stored responses.
            self.crasher.point(CrashPoint::Commit);
        }
        Ok(claims)
    }

    /// Runs [`write_statement`] until every request of `batch` has its claim;
    /// the claims, and the relay shards of the outbox rows written.
    async fn write(
        &self,
        conn: &mut PgConnection,
        batch: &[&Create],
    ) -> Result<(Vec<KeyClaim>, u16), StoreError> {
        let mut claims: Vec<Option<KeyClaim>> = vec![None; batch.len()];
        let mut pending: Vec<usize> = (0..batch.len()).collect();
        let mut shards = 0;
        for _ in 0..ATTEMPTS {
            if pending.is_empty() {
                break;
            }
            let creates: Vec<&Create> = pending.iter().map(|i| batch[*i]).collect();
            let (found, written) = write_statement(conn, &creates, self.no_idempotency).await?;
            shards |= written;
            pending = pending
                .into_iter()
                .zip(found)
                .filter_map(|(i, found)| match found {
                    Some(claim) => {
                        claims[i] = Some(claim);
                        None
                    }
                    None => Some(i),
                })
                .collect();
        }
        match pending.first() {
            Some(i) => Err(StoreError::Vanished(batch[*i].key.as_str().to_owned())),
            None => Ok((claims.into_iter().flatten().collect(), shards)),
        }
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

/// How many statements [`Store::write_batch`] runs at most for one batch.
const ATTEMPTS: usize = 3;

/// The write statement: in one statement, claim the keys in the library's
/// table (`fx.idempotency_keys`, scope [`KEY_SCOPE`]: the rows not taken
/// yet are inserted in key order, so two overlapping batches wait for each
/// other's rows in one order and cannot deadlock, each with the response it
/// will replay and the order id as its reference), read the rows of the keys
/// it did not insert, then insert the orders and the outbox events of
/// exactly the keys it claimed. One answer per create, in order: `Some(New)`
/// (claimed and written), `Some(Replay | Mismatch)` (taken before; nothing
/// written, judged by the library's [`ClaimRow::judge`]), or `None`: the
/// key's row was not visible to the read (committed by another transaction
/// while the insert waited on it, or deleted by an expiry in between); a
/// later statement claims it again, with a fresh snapshot.
///
/// This is the claim of the library's `fx.claim_keys`, written into the
/// statement rather than called: with the call (a plan of its own and a
/// second read) orders reached 0.73–0.91 of its rate before, with the claim
/// written in 0.97–1.12 (FINDINGS §26). The outbox rows go in request
/// order, so their ids (the publish order) follow it. With `no_idempotency`
/// no key is claimed or read.
async fn write_statement(
    conn: &mut PgConnection,
    batch: &[&Create],
    no_idempotency: bool,
) -> Result<(Vec<Option<KeyClaim>>, u16), StoreError> {
    let mut scopes = Vec::with_capacity(batch.len());
    let mut keys = Vec::with_capacity(batch.len());
    let mut hashes = Vec::with_capacity(batch.len());
    let mut order_ids = Vec::with_capacity(batch.len());
    let mut codes = Vec::with_capacity(batch.len());
    let mut headers = Vec::with_capacity(batch.len());
    let mut bodies = Vec::with_capacity(batch.len());
    let mut accounts = Vec::with_capacity(batch.len());
    let mut amounts = Vec::with_capacity(batch.len());
    let mut msg_ids = Vec::with_capacity(batch.len());
    let mut types = Vec::with_capacity(batch.len());
    let mut payloads = Vec::with_capacity(batch.len());
    for create in batch {
        let event = create.order.created_event()?;
        scopes.push(create.key.scope());
        keys.push(create.key.as_str());
        hashes.push(create.fingerprint.as_bytes().as_slice());
        order_ids.push(create.order.order_id());
        codes.push(i32::from(create.response.status));
        headers.push(serde_json::to_string(&create.response.headers)?);
        bodies.push(create.response.body.as_slice());
        accounts.push(create.order.account_id());
        amounts.push(create.order.amount_cents());
        msg_ids.push(event.msg_id);
        types.push(event.event_type);
        payloads.push(event.payload);
    }
    // The `as` casts name the element types the arrays are bound as (the
    // macro would otherwise ask for owned `String`s and `Vec<u8>`s).
    let rows = sqlx::query!(
        r#"WITH input AS (
               SELECT * FROM unnest($1::text[], $2::bytea[], $3::uuid[], $4::int4[], $5::text[],
                                    $6::bytea[], $7::int8[], $8::int8[], $9::uuid[], $10::text[],
                                    $11::bytea[], $14::text[])
                   WITH ORDINALITY AS u(k, h, o, c, hd, b, a, m, msg, typ, p, sc, n)
           ), taken AS (
               INSERT INTO fx.idempotency_keys AS t
                   (scope, key, request_hash, response_status, response_headers, response_body,
                    reference)
               SELECT sc, k, h, c::int2, hd::jsonb, b, o::text FROM input WHERE NOT $12
               ORDER BY sc, k
               ON CONFLICT (scope, key) DO NOTHING
               RETURNING t.scope, t.key
           ), fresh AS (
               SELECT * FROM input WHERE $12 OR (sc, k) IN (SELECT scope, key FROM taken)
           ), placed AS (
               INSERT INTO orders.orders (order_id, account_id, amount_cents, status)
               SELECT o, a, m, $13 FROM fresh
           ), queued AS (
               INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload)
               SELECT o, msg, typ, p FROM fresh ORDER BY n
               RETURNING shard
           )
           SELECT i.n IN (SELECT n FROM fresh) AS "new!",
                  (SELECT coalesce(bit_or(1 << shard), 0) FROM queued) AS "shards!",
                  s.request_hash AS "request_hash?",
                  s.response_status AS "response_status?",
                  s.response_headers AS "response_headers?: Json<Vec<(String, String)>>",
                  s.response_body AS "response_body?"
           FROM input AS i
           LEFT JOIN LATERAL (
               SELECT * FROM fx.idempotency_keys AS t
               WHERE NOT $12 AND (i.sc, i.k) NOT IN (SELECT scope, key FROM taken)
                 AND t.scope = i.sc AND t.key = i.k
               LIMIT 1
           ) AS s ON true
           ORDER BY i.n"#,
        &keys as &[&str],
        &hashes as &[&[u8]],
        &order_ids,
        &codes,
        &headers,
        &bodies as &[&[u8]],
        &accounts,
        &amounts,
        &msg_ids,
        &types,
        &payloads,
        no_idempotency,
        ORDER_STATUS_CREATED,
        &scopes as &[&str],
    )
    .fetch_all(&mut *conn)
    .await?;
    if rows.len() != batch.len() {
        return Err(StoreError::Db(sqlx::Error::Protocol(format!(
            "the write statement answered {} rows for {} requests",
            rows.len(),
            batch.len()
        ))));
    }
    // The relay shards of the outbox rows written (bit s: shard s, 0..16).
    let shards = rows.first().map_or(0, |row| {
        u16::try_from(row.shards & 0xffff).unwrap_or(u16::MAX)
    });
    let claims = rows
        .into_iter()
        .zip(batch)
        .map(|(row, create)| {
            ClaimRow {
                claimed: row.new,
                request_hash: row.request_hash,
                response_status: row.response_status,
                response_headers: row.response_headers,
                response_body: row.response_body,
            }
            .judge(&create.fingerprint)
        })
        .collect();
    Ok((claims, shards))
}
