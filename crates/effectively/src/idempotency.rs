//! Idempotency keys for the synchronous edge.
//!
//! A client sends a key with each request; the first request with that key
//! claims it (an `INSERT … ON CONFLICT DO NOTHING` inside the caller's
//! transaction, together with the response it will get). Every later request
//! with the same key and the same request gets that stored response back,
//! verbatim; the same key with a different request is a [`Claim::Mismatch`].
//!
//! Concurrent requests with one key serialize in the database: the second
//! `INSERT` waits on the first transaction's row lock, then sees the committed
//! row (or, if the first rolled back, takes the key itself). No application
//! lock, no deadlock, no "in progress" state to expire.
//!
//! That is [`ClaimStrategy::OnConflict`], the default. Experiment 7 compares
//! it with [`ClaimStrategy::AdvisoryLock`]: a transaction-scoped advisory lock
//! on each key's hash first, then read the key, then insert it if absent.

use sqlx::PgConnection;
use sqlx::types::Json;
use uuid::Uuid;

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1..=255 visible ASCII characters (0x21..=0x7E).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a raw key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The key is absent.
    #[error("the Idempotency-Key header is required")]
    Missing,
    /// The key is the empty string.
    #[error("the idempotency key must not be empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error("the idempotency key is {0} bytes long; at most {MAX_KEY_LEN} are allowed")]
    TooLong(usize),
    /// The key holds a byte outside visible ASCII.
    #[error("the idempotency key must be visible ASCII (0x21..0x7E); byte {position} is not")]
    InvalidByte {
        /// Zero-based offset of the first offending byte.
        position: usize,
    },
}

impl IdempotencyKey {
    /// Validates a raw key.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        if raw.is_empty() {
            return Err(KeyError::Empty);
        }
        if raw.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(raw.len()));
        }
        if let Some(position) = raw.iter().position(|b| !(0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidByte { position });
        }
        // Every byte is ASCII, so this cannot fail; map instead of unwrap anyway.
        String::from_utf8(raw.to_vec())
            .map(Self)
            .map_err(|_| KeyError::InvalidByte { position: 0 })
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A BLAKE3 hash of the canonical form of a request, so that a key reused with
/// a different request is detected. Callers hash a canonical encoding (typed
/// fields, fixed order), never raw bytes, so two JSON texts that differ only in
/// whitespace or key order are the same request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Hashes `canonical` under `context` (e.g. `"orders.create v1"`), which
    /// separates operations and versions of the canonical form.
    pub fn new(context: &str, canonical: &[u8]) -> Self {
        let mut hasher = blake3::Hasher::new_derive_key(context);
        hasher.update(canonical);
        Self(*hasher.finalize().as_bytes())
    }

    /// The raw 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

/// A response stored with its key and replayed verbatim to every retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// Status code (HTTP semantics, whatever protocol carried the request).
    pub status: u16,
    /// Headers in order, names in lowercase.
    pub headers: Vec<(String, String)>,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// The value of header `name` (lowercase), if stored.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// What claiming a key found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key was free and is now held by the caller's transaction: go on
    /// with the work and commit (or roll back, which frees the key again).
    New,
    /// The key was used before with the same request: replay this response.
    /// The caller's transaction wrote nothing.
    Replay {
        /// The resource the first request created.
        order_id: Uuid,
        /// The first request's response.
        response: StoredResponse,
    },
    /// The key was used before with a different request. Nothing was written.
    Mismatch,
}

/// Errors from the idempotency store.
#[derive(Debug, thiserror::Error)]
pub enum IdempotencyError {
    /// The database failed.
    #[error("idempotency store: {0}")]
    Db(#[from] sqlx::Error),
    /// The key's row kept vanishing between the conflicting insert and the read
    /// (only possible if rows are deleted concurrently, e.g. by expiry).
    #[error("idempotency key {0:?} conflicted but its row could not be read")]
    Vanished(String),
}

/// How a batch's keys are claimed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ClaimStrategy {
    /// `INSERT … ON CONFLICT DO NOTHING` first; the keys it did not insert
    /// are read. A key whose first request is still in flight makes the
    /// insert wait on that transaction's row lock; a committed key is a read.
    #[default]
    OnConflict,
    /// `pg_advisory_xact_lock` on each key's hash first (in hash order, so
    /// two batches cannot deadlock), then read the keys, then insert those
    /// absent. Every request of a key waits for the lock, replays included.
    AdvisoryLock,
}

/// The advisory-lock class of idempotency keys: the first half of the
/// two-int4 lock id `(class, hashtext(key))` that
/// [`ClaimStrategy::AdvisoryLock`] takes. (The two-int4 ids never collide
/// with the single-bigint ids the relay and payments take.) Two keys whose
/// hashes collide share a lock: they serialize, nothing else.
pub const ADVISORY_LOCK_CLASS: i32 = 0x0e11;

/// The key table `orders.idempotency_keys` (columns in
/// `migrations/*_orders.sql`): claims keys inside the caller's transaction.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdempotencyStore {
    strategy: ClaimStrategy,
}

/// Inserts the keys not taken yet, in the order given (the caller sorts them),
/// and returns those it inserted.
/// One key to claim in a batch: see [`IdempotencyStore::claim_batch`].
#[derive(Debug, Clone, Copy)]
pub struct NewKey<'a> {
    /// The key.
    pub key: &'a IdempotencyKey,
    /// Its request's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// The resource the request creates if the key is new.
    pub order_id: Uuid,
    /// The response it answers if the key is new.
    pub response: &'a StoredResponse,
}

impl IdempotencyStore {
    /// A store claiming keys by `strategy`.
    pub fn new(strategy: ClaimStrategy) -> Self {
        Self { strategy }
    }

    /// How it claims keys.
    pub fn strategy(&self) -> ClaimStrategy {
        self.strategy
    }

    /// Claims many distinct keys in one statement (plus one read for those
    /// already taken), inside the caller's transaction, each for its
    /// request's fingerprint and storing the response the caller is about to
    /// give; one [`Claim`] per item, in order.
    ///
    /// Must run inside a transaction that also does the work: the key rows
    /// and the effects commit or roll back together, so a failed request
    /// leaves no key behind and its retry can succeed.
    ///
    /// Rows are inserted in key order, so two batches that share keys lock
    /// them in the same order and cannot deadlock.
    ///
    /// # Panics
    /// In debug builds, if two items carry the same key (the caller
    /// coalesces duplicates: one statement cannot both insert and see a key).
    pub async fn claim_batch(
        &self,
        conn: &mut PgConnection,
        items: &[NewKey<'_>],
    ) -> Result<Vec<Claim>, IdempotencyError> {
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by(|a, b| items[*a].key.as_str().cmp(items[*b].key.as_str()));
        debug_assert!(
            order.windows(2).all(|w| items[w[0]].key != items[w[1]].key),
            "duplicate keys in a batch"
        );
        let mut claims: Vec<Option<Claim>> = vec![None; items.len()];
        let mut pending = order;
        if self.strategy == ClaimStrategy::AdvisoryLock {
            let keys: Vec<&str> = pending.iter().map(|i| items[*i].key.as_str()).collect();
            // Locks in hash order (the aggregate takes its input sorted), so
            // two batches sharing keys wait for each other in one order.
            sqlx::query!(
                "SELECT count(pg_advisory_xact_lock($1::int4, h)) FROM                    (SELECT DISTINCT hashtext(k) AS h FROM unnest($2::text[]) AS k ORDER BY h) AS s",
                ADVISORY_LOCK_CLASS,
                &keys as &[&str],
            )
            .fetch_one(&mut *conn)
            .await?;
            // READ COMMITTED: this statement's snapshot is taken after the
            // locks are held, so it sees every key committed under them.
            let mut rows = read_rows(conn, &keys).await?;
            pending.retain(|i| match rows.remove(items[*i].key.as_str()) {
                Some(row) => {
                    claims[*i] = Some(row.into_claim(items[*i].fingerprint));
                    false
                }
                None => true,
            });
        }
        for _ in 0..2 {
            if pending.is_empty() {
                break;
            }
            let mut headers = Vec::with_capacity(pending.len());
            for i in &pending {
                headers.push(
                    serde_json::to_string(&items[*i].response.headers)
                        .map_err(|e| IdempotencyError::Db(sqlx::Error::Encode(Box::new(e))))?,
                );
            }
            let keys: Vec<&str> = pending.iter().map(|i| items[*i].key.as_str()).collect();
            let hashes: Vec<&[u8]> = pending
                .iter()
                .map(|i| items[*i].fingerprint.as_bytes().as_slice())
                .collect();
            let order_ids: Vec<Uuid> = pending.iter().map(|i| items[*i].order_id).collect();
            let codes: Vec<i32> = pending
                .iter()
                .map(|i| i32::from(items[*i].response.status))
                .collect();
            let bodies: Vec<&[u8]> = pending
                .iter()
                .map(|i| items[*i].response.body.as_slice())
                .collect();
            // The `as` casts name the element types the arrays are bound as
            // (the macro would otherwise ask for owned `String`s and `Vec<u8>`s).
            let inserted: Vec<String> = sqlx::query_scalar!(
                "INSERT INTO orders.idempotency_keys \
                   (idem_key, request_hash, order_id, response_code, response_headers, response_body) \
                 SELECT k, h, o, c, hd::jsonb, b \
                 FROM unnest($1::text[], $2::bytea[], $3::uuid[], $4::int4[], $5::text[], $6::bytea[]) \
                   AS u(k, h, o, c, hd, b) \
                 ON CONFLICT (idem_key) DO NOTHING RETURNING idem_key",
                &keys as &[&str],
                &hashes as &[&[u8]],
                &order_ids,
                &codes,
                &headers,
                &bodies as &[&[u8]],
            )
            .fetch_all(&mut *conn)
            .await?;
            let inserted: std::collections::HashSet<String> = inserted.into_iter().collect();
            let mut taken = Vec::new();
            for i in pending.drain(..) {
                if inserted.contains(items[i].key.as_str()) {
                    claims[i] = Some(Claim::New);
                } else {
                    taken.push(i);
                }
            }
            if taken.is_empty() {
                break;
            }
            // READ COMMITTED: a fresh snapshot sees rows committed while our
            // insert waited on them.
            let taken_keys: Vec<&str> = taken.iter().map(|i| items[*i].key.as_str()).collect();
            let mut rows = read_rows(conn, &taken_keys).await?;
            for i in taken {
                match rows.remove(items[i].key.as_str()) {
                    Some(row) => claims[i] = Some(row.into_claim(items[i].fingerprint)),
                    None => pending.push(i), // vanished meanwhile: try to take it
                }
            }
        }
        if let Some(i) = pending.first() {
            return Err(IdempotencyError::Vanished(
                items[*i].key.as_str().to_owned(),
            ));
        }
        Ok(claims
            .into_iter()
            .map(|c| c.unwrap_or(Claim::Mismatch))
            .collect())
    }
}

/// The stored rows of `keys`, by key.
async fn read_rows(
    conn: &mut PgConnection,
    keys: &[&str],
) -> Result<std::collections::HashMap<String, StoredRow>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"SELECT idem_key, request_hash, order_id, response_code,
                  response_headers AS "response_headers: Json<Vec<(String, String)>>",
                  response_body
           FROM orders.idempotency_keys WHERE idem_key = ANY($1)"#,
        keys as &[&str],
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let row = StoredRow {
                request_hash: r.request_hash,
                order_id: r.order_id,
                response_code: r.response_code,
                response_headers: r.response_headers,
                response_body: r.response_body,
            };
            (r.idem_key, row)
        })
        .collect())
}

/// A key's stored row.
struct StoredRow {
    request_hash: Vec<u8>,
    order_id: Uuid,
    response_code: i32,
    response_headers: Json<Vec<(String, String)>>,
    response_body: Vec<u8>,
}

impl StoredRow {
    fn into_claim(self, fingerprint: &Fingerprint) -> Claim {
        if self.request_hash.as_slice() != fingerprint.as_bytes().as_slice() {
            return Claim::Mismatch;
        }
        Claim::Replay {
            order_id: self.order_id,
            response: StoredResponse {
                status: u16::try_from(self.response_code).unwrap_or(500),
                headers: self.response_headers.0,
                body: self.response_body,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_visible_ascii_of_bounded_length() {
        assert!(IdempotencyKey::parse(b"a").is_ok());
        assert!(IdempotencyKey::parse(&[b'k'; MAX_KEY_LEN]).is_ok());
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(
            IdempotencyKey::parse(&[b'k'; MAX_KEY_LEN + 1]),
            Err(KeyError::TooLong(256))
        );
        assert_eq!(
            IdempotencyKey::parse(b"ab c"),
            Err(KeyError::InvalidByte { position: 2 })
        );
        assert_eq!(
            IdempotencyKey::parse("é".as_bytes()),
            Err(KeyError::InvalidByte { position: 0 })
        );
        assert_eq!(
            IdempotencyKey::parse(b"x\x7f"),
            Err(KeyError::InvalidByte { position: 1 })
        );
    }

    #[test]
    fn fingerprints_separate_contexts_and_inputs() {
        let a = Fingerprint::new("ctx v1", b"abc");
        assert_eq!(a, Fingerprint::new("ctx v1", b"abc"));
        assert_ne!(a, Fingerprint::new("ctx v2", b"abc"));
        assert_ne!(a, Fingerprint::new("ctx v1", b"abd"));
    }
}
