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

/// The idempotency keys of a schema ([`super::Effectively::keys`]). Keys are
/// scoped: the same key from two callers (principals, tenants) is two keys.
#[derive(Debug, Clone)]
pub struct Keys {
    insert: String,
    read: String,
    complete: String,
    expire: String,
}

/// A key row as a later request finds it.
#[derive(sqlx::FromRow)]
struct Row {
    request_hash: Vec<u8>,
    response_status: Option<i16>,
    response_headers: Option<Json<Vec<(String, String)>>>,
    response_body: Option<Vec<u8>>,
}

impl Keys {
    pub(super) fn new(schema: &SchemaName) -> Self {
        let q = schema.quoted();
        Self {
            insert: format!(
                "INSERT INTO {q}.idempotency_keys (scope, key, request_hash) VALUES ($1, $2, $3) \
                 ON CONFLICT (scope, key) DO NOTHING RETURNING true"
            ),
            read: format!(
                "SELECT request_hash, response_status, response_headers, response_body \
                 FROM {q}.idempotency_keys WHERE scope = $1 AND key = $2"
            ),
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

    /// Claims `key` of `scope` for the request `fingerprint` names, in the
    /// caller's transaction.
    pub async fn claim(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
    ) -> Result<KeyClaim, sqlx::Error> {
        let new: Option<bool> = sqlx::query_scalar(&self.insert)
            .bind(scope)
            .bind(key.as_str())
            .bind(fingerprint.as_bytes().as_slice())
            .fetch_optional(&mut *conn)
            .await?;
        if new.is_some() {
            return Ok(KeyClaim::New);
        }
        // A statement of its own: its snapshot sees the row of a first
        // request committed while the insert waited on it.
        let row: Option<Row> = sqlx::query_as(&self.read)
            .bind(scope)
            .bind(key.as_str())
            .fetch_optional(&mut *conn)
            .await?;
        let Some(row) = row else {
            // The row was there for the insert and is gone now: expired in
            // between. Claim again (it is free).
            return Box::pin(self.claim(conn, scope, key, fingerprint)).await;
        };
        if row.request_hash.as_slice() != fingerprint.as_bytes().as_slice() {
            return Ok(KeyClaim::Mismatch);
        }
        Ok(
            match (row.response_status, row.response_headers, row.response_body) {
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
        let status = i16::try_from(response.status).map_err(|_| {
            sqlx::Error::Encode(format!("status {} is not an HTTP status", response.status).into())
        })?;
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
