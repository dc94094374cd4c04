//! Idempotency keys on any operation: the key row claimed in the caller's
//! transaction, the response stored in it before the commit.

use std::time::Duration;

use sqlx::types::Json;
use sqlx::{PgConnection, PgPool};

pub use crate::idempotency::StoredResponse;
use crate::idempotency::{Fingerprint, IdempotencyKey};

use super::SchemaName;

/// What claiming a key found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyClaim {
    /// The key was free and is now the caller's: do the work, store the
    /// response ([`Keys::complete`]) and commit, all in this transaction. A
    /// rollback frees the key. A request with the same key meanwhile waits
    /// for the commit, then gets the stored response.
    New,
    /// The key was used with the same request: send this response again,
    /// byte for byte. Nothing was written.
    Replay(StoredResponse),
    /// The key was used with another request. Nothing was written.
    Mismatch,
    /// The key's row was committed without a response (its transaction did
    /// not call [`Keys::complete`]): what it answered cannot be told.
    Unfinished,
}

/// One request of a batch claim ([`Keys::claim_batch`]): its key and
/// fingerprint, and what to store with the key when the caller knows it at
/// the claim.
#[derive(Debug, Clone, Copy)]
pub struct KeyRequest<'a> {
    /// The client's key.
    pub key: &'a IdempotencyKey,
    /// The request's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// The response every retry will get, when it is known before the work
    /// (the work's ids minted up front): stored by the claim itself, so the
    /// transaction needs no [`Keys::complete`]. `None`: complete it later
    /// in the same transaction.
    pub response: Option<&'a StoredResponse>,
    /// What the request creates (an order id, a charge id), stored with the
    /// key so that one can be found from the other: an audit, a
    /// reconciliation (the `reference` column).
    pub reference: Option<&'a str>,
}

impl<'a> KeyRequest<'a> {
    /// A request whose response is stored later ([`Keys::complete`]).
    pub fn new(key: &'a IdempotencyKey, fingerprint: &'a Fingerprint) -> Self {
        Self {
            key,
            fingerprint,
            response: None,
            reference: None,
        }
    }

    /// With the response to store at the claim.
    pub fn responding(mut self, response: &'a StoredResponse) -> Self {
        self.response = Some(response);
        self
    }

    /// With what the request creates.
    pub fn creating(mut self, reference: &'a str) -> Self {
        self.reference = Some(reference);
        self
    }
}

/// The idempotency keys of a schema ([`super::Effectively::keys`]). Keys are
/// scoped: the same key from two callers (principals, tenants) is two keys.
///
/// A claim is one round trip: the schema's function `claim_keys` inserts
/// the free keys and reads the rows of the others. A service that writes a
/// batch of requests in one statement of its own may call that function in
/// it ([`Keys::claim_function`]; its contract is in the library's SQL,
/// version 4), and so claim, write and commit in one round trip.
#[derive(Debug, Clone)]
pub struct Keys {
    function: String,
    claim: String,
    complete: String,
    expire: String,
}

/// One row of the schema's `claim_keys` for one request, as a caller that
/// composed the function into its own statement reads it back; [`judge`]
/// says what it means.
///
/// [`judge`]: ClaimRow::judge
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ClaimRow {
    /// The key was free and is now the caller's transaction's.
    pub claimed: bool,
    /// Not claimed: the fingerprint stored with the key.
    pub request_hash: Option<Vec<u8>>,
    /// Not claimed: the stored response's status.
    pub response_status: Option<i16>,
    /// Not claimed: its headers.
    pub response_headers: Option<Json<Vec<(String, String)>>>,
    /// Not claimed: its body.
    pub response_body: Option<Vec<u8>>,
}

impl ClaimRow {
    /// What the row says of the request with `fingerprint`; `None` when the
    /// key's row vanished between the function's insert and its read (an
    /// expiry in between): claim that key again.
    pub fn judge(self, fingerprint: &Fingerprint) -> Option<KeyClaim> {
        if self.claimed {
            return Some(KeyClaim::New);
        }
        let hash = self.request_hash?;
        if hash.as_slice() != fingerprint.as_bytes().as_slice() {
            return Some(KeyClaim::Mismatch);
        }
        Some(
            match (
                self.response_status,
                self.response_headers,
                self.response_body,
            ) {
                (Some(status), Some(Json(headers)), Some(body)) => {
                    KeyClaim::Replay(StoredResponse {
                        status: u16::try_from(status).unwrap_or(500),
                        headers,
                        body,
                    })
                }
                _ => KeyClaim::Unfinished,
            },
        )
    }
}

/// How many times a batch claim reads again a key whose row vanished
/// between its insert and its read (an expiry in between) before it gives
/// up with `RowNotFound`.
const CLAIM_ATTEMPTS: usize = 5;

impl Keys {
    pub(super) fn new(schema: &SchemaName) -> Self {
        let q = schema.quoted();
        let function = format!("{q}.claim_keys");
        Self {
            claim: format!(
                "SELECT claimed, request_hash, response_status, response_headers, response_body \
                 FROM {function}($1, $2, $3, $4, $5, $6, $7) ORDER BY n"
            ),
            function,
            complete: format!(
                "UPDATE {q}.idempotency_keys \
                 SET response_status = $4, response_headers = $5, response_body = $6 \
                 WHERE scope = $1 AND key = $2 AND request_hash = $3 AND response_status IS NULL"
            ),
            expire: format!(
                "DELETE FROM {q}.idempotency_keys WHERE ctid = ANY(ARRAY( \
                   SELECT ctid FROM {q}.idempotency_keys \
                   WHERE created_at < clock_timestamp() - make_interval(secs => $1) LIMIT $2))"
            ),
        }
    }

    /// The schema-qualified name of the claim function (`"<schema>".claim_keys`),
    /// for a caller that composes the claim into a statement of its own.
    pub fn claim_function(&self) -> &str {
        &self.function
    }

    /// Claims `key` of `scope` for the request `fingerprint` names, in the
    /// caller's transaction: a [`claim_batch`](Self::claim_batch) of one.
    pub async fn claim(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> Result<KeyClaim, sqlx::Error> {
        let mut claims = self
            .claim_batch(conn, scope, &[KeyRequest::new(key, fingerprint)])
            .await?;
        claims.pop().ok_or(sqlx::Error::RowNotFound)
    }

    /// Claims the keys of `scope` for a batch of requests in one round trip,
    /// in the caller's transaction; one answer per request, in order. A key
    /// given twice is claimed by its first copy; the later copies are judged
    /// against it (a [`KeyClaim::Replay`] when its response is stored at the
    /// claim, else [`KeyClaim::Unfinished`], or a [`KeyClaim::Mismatch`]).
    ///
    /// The free keys are inserted in key order, so concurrent batches that
    /// share keys never deadlock; a key taken by a transaction in flight
    /// waits for it to end.
    pub async fn claim_batch(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        requests: &[KeyRequest<'_>],
    ) -> Result<Vec<KeyClaim>, sqlx::Error> {
        let mut claims: Vec<Option<KeyClaim>> = vec![None; requests.len()];
        let mut pending: Vec<usize> = (0..requests.len()).collect();
        for _ in 0..CLAIM_ATTEMPTS {
            if pending.is_empty() {
                break;
            }
            let batch: Vec<&KeyRequest<'_>> = pending.iter().map(|i| &requests[*i]).collect();
            let rows = self.claim_statement(conn, scope, &batch).await?;
            pending = pending
                .into_iter()
                .zip(rows)
                .filter_map(|(i, row)| match row.judge(requests[i].fingerprint) {
                    Some(claim) => {
                        claims[i] = Some(claim);
                        None
                    }
                    None => Some(i),
                })
                .collect();
        }
        if !pending.is_empty() {
            return Err(sqlx::Error::RowNotFound);
        }
        Ok(claims.into_iter().flatten().collect())
    }

    /// One call of `claim_keys`: a row per request, in order.
    async fn claim_statement(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        batch: &[&KeyRequest<'_>],
    ) -> Result<Vec<ClaimRow>, sqlx::Error> {
        let mut keys = Vec::with_capacity(batch.len());
        let mut hashes = Vec::with_capacity(batch.len());
        let mut statuses = Vec::with_capacity(batch.len());
        let mut headers = Vec::with_capacity(batch.len());
        let mut bodies = Vec::with_capacity(batch.len());
        let mut references = Vec::with_capacity(batch.len());
        for request in batch {
            keys.push(request.key.as_str());
            hashes.push(request.fingerprint.as_bytes().as_slice());
            let response = request.response;
            statuses.push(response.map(|r| status_of(r.status)).transpose()?);
            headers.push(response.map(|r| Json(&r.headers)));
            bodies.push(response.map(|r| r.body.as_slice()));
            references.push(request.reference);
        }
        let rows: Vec<ClaimRow> = sqlx::query_as(&self.claim)
            .bind(scope)
            .bind(&keys)
            .bind(&hashes)
            .bind(&statuses)
            .bind(&headers)
            .bind(&bodies)
            .bind(&references)
            .fetch_all(&mut *conn)
            .await?;
        if rows.len() != batch.len() {
            return Err(sqlx::Error::Protocol(format!(
                "claim_keys answered {} rows for {} requests",
                rows.len(),
                batch.len()
            )));
        }
        Ok(rows)
    }

    /// Stores the response of a key claimed [`KeyClaim::New`] in this
    /// transaction, before its commit. `RowNotFound` if the key is not this
    /// transaction's new claim for that request.
    pub async fn complete(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
    ) -> Result<(), sqlx::Error> {
        let status = status_of(response.status)?;
        let done = sqlx::query(&self.complete)
            .bind(scope)
            .bind(key.as_str())
            .bind(fingerprint.as_bytes().as_slice())
            .bind(status)
            .bind(Json(&response.headers))
            .bind(&response.body)
            .execute(conn)
            .await?
            .rows_affected();
        if done == 1 {
            Ok(())
        } else {
            Err(sqlx::Error::RowNotFound)
        }
    }

    /// Deletes the keys claimed longer ago than `retention`, `batch` per
    /// transaction, until none is left. A retry after that is a new request.
    pub async fn expire(
        &self,
        pool: &PgPool,
        retention: Duration,
        batch: u32,
    ) -> Result<u64, sqlx::Error> {
        let age = retention.as_secs_f64();
        super::delete_in_batches(pool, batch, |limit| {
            sqlx::query(&self.expire).bind(age).bind(limit)
        })
        .await
    }
}

/// A status as the table holds it.
fn status_of(status: u16) -> Result<i16, sqlx::Error> {
    i16::try_from(status)
        .map_err(|_| sqlx::Error::Encode(format!("status {status} is not an HTTP status").into()))
}
