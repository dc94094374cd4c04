//! The outbox, write side: [`Event`]s enqueued in the caller's transaction;
//! and its upkeep: what waits ([`Outbox::backlog`]), what failed and its
//! release, the expiry of published rows.

use std::time::Duration;

use serde::Serialize;
use sqlx::types::Json;
use sqlx::{PgExecutor, PgPool};
use uuid::Uuid;

use super::SchemaName;

/// How many shards the outbox's rows are spread over ([`shard_of`]).
pub const SHARDS: u16 = 16;

/// The shard of an event's key: a relay leases a shard, so every event of a
/// key is published by one relay at a time, in order. The first two bytes
/// of the key's BLAKE3 hash, modulo [`SHARDS`]: the same in every process and
/// release.
pub fn shard_of(key: &str) -> i16 {
    let h = blake3::hash(key.as_bytes());
    let b = h.as_bytes();
    // < 16: fits.
    (u16::from_be_bytes([b[0], b[1]]) % SHARDS) as i16
}

/// Longest destination, event type or header name accepted, in bytes.
const MAX_NAME: usize = 255;

/// Longest key accepted, in bytes.
const MAX_KEY: usize = 1024;

/// How far ahead of this host's clock a caller's msg_id may have been
/// minted: a clock that fast would mint ids the inboxes downstream take for
/// the future.
const MINTED_AHEAD_AT_MOST: chrono::TimeDelta = chrono::TimeDelta::minutes(5);

/// Why an [`Event`] could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// A name (destination, event type, header name) is empty, too long or
    /// holds a byte outside visible ASCII.
    #[error("the event's {what} {value:?} is not accepted: 1 to 255 bytes of visible ASCII")]
    Name {
        /// Which name.
        what: &'static str,
        /// The value given.
        value: String,
    },
    /// The key or a header value holds a NUL (PostgreSQL's text cannot) or
    /// the key is longer than 1,024 bytes.
    #[error("the event's {what} is not accepted: {why}")]
    Text {
        /// Which text.
        what: &'static str,
        /// What is wrong.
        why: &'static str,
    },
    /// The payload could not be encoded as JSON.
    #[error("the event's payload is not JSON-encodable: {0}")]
    Json(String),
    /// A caller's msg_id is not a UUIDv7, or was minted ahead of this host's
    /// clock by more than five minutes.
    #[error("msg_id {id} is not accepted: {why}")]
    MsgId {
        /// The id given.
        id: Uuid,
        /// What is wrong.
        why: &'static str,
    },
}

/// An event's payload and how it is encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payload {
    /// The bytes as published.
    pub bytes: Vec<u8>,
    /// Their media type (`application/json` for [`Event::json`]).
    pub content_type: String,
}

/// One event to publish: where to (a Kafka topic, a webhook destination's
/// name), its key (the Kafka message key; one key's events are published in
/// order), its type, its payload and headers (trace context, say), and the
/// msg_id every consumer deduplicates it by.
///
/// The msg_id is a UUIDv7 the library mints, or one the caller supplies
/// ([`Event::with_msg_id`]), which must be a UUIDv7 too: inboxes expire by
/// the time it carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    msg_id: Uuid,
    destination: String,
    key: String,
    event_type: String,
    payload: Payload,
    headers: Vec<(String, String)>,
}

fn check_name(what: &'static str, value: &str) -> Result<(), EventError> {
    if value.is_empty()
        || value.len() > MAX_NAME
        || !value.bytes().all(|b| (0x21..=0x7e).contains(&b))
    {
        return Err(EventError::Name {
            what,
            value: value.chars().take(300).collect(),
        });
    }
    Ok(())
}

fn check_text(what: &'static str, value: &str) -> Result<(), EventError> {
    if value.contains('\0') {
        return Err(EventError::Text {
            what,
            why: "it holds a NUL character",
        });
    }
    Ok(())
}

impl Event {
    /// An event whose payload is `bytes` of media type `content_type`.
    pub fn bytes(
        destination: &str,
        key: &str,
        event_type: &str,
        content_type: &str,
        bytes: Vec<u8>,
    ) -> Result<Self, EventError> {
        check_name("destination", destination)?;
        check_name("event type", event_type)?;
        check_name("content type", content_type)?;
        check_text("key", key)?;
        if key.len() > MAX_KEY {
            return Err(EventError::Text {
                what: "key",
                why: "it is longer than 1,024 bytes",
            });
        }
        Ok(Self {
            msg_id: Uuid::now_v7(),
            destination: destination.to_owned(),
            key: key.to_owned(),
            event_type: event_type.to_owned(),
            payload: Payload {
                bytes,
                content_type: content_type.to_owned(),
            },
            headers: Vec::new(),
        })
    }

    /// An event whose payload is `value` as JSON (`application/json`).
    pub fn json<T: Serialize + ?Sized>(
        destination: &str,
        key: &str,
        event_type: &str,
        value: &T,
    ) -> Result<Self, EventError> {
        let bytes = serde_json::to_vec(value).map_err(|e| EventError::Json(e.to_string()))?;
        Self::bytes(destination, key, event_type, "application/json", bytes)
    }

    /// The same event with the caller's msg_id (a retried request that must
    /// enqueue the same event again, say): a UUIDv7, minted no more than five
    /// minutes ahead of this host's clock.
    pub fn with_msg_id(self, msg_id: Uuid) -> Result<Self, EventError> {
        if msg_id.get_version_num() != 7 {
            return Err(EventError::MsgId {
                id: msg_id,
                why: "it is not a UUIDv7 (the inboxes expire by the time a UUIDv7 carries)",
            });
        }
        if crate::v7::mint_time(msg_id) > chrono::Utc::now() + MINTED_AHEAD_AT_MOST {
            return Err(EventError::MsgId {
                id: msg_id,
                why: "it was minted more than five minutes ahead of this host's clock",
            });
        }
        Ok(Self { msg_id, ..self })
    }

    /// The same event with header `name: value` added (names: visible ASCII;
    /// a name may repeat).
    pub fn with_header(mut self, name: &str, value: &str) -> Result<Self, EventError> {
        check_name("header name", name)?;
        check_text("header value", value)?;
        self.headers.push((name.to_owned(), value.to_owned()));
        Ok(self)
    }

    /// Its msg_id.
    pub fn msg_id(&self) -> Uuid {
        self.msg_id
    }

    /// Where it goes.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// Its key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Its type.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// Its payload.
    pub fn payload(&self) -> &Payload {
        &self.payload
    }

    /// Its headers, in order.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }
}

/// The outbox of a schema ([`super::Effectively::outbox`]).
#[derive(Debug, Clone)]
pub struct Outbox {
    insert: String,
    expire: String,
    backlog: String,
    failed: String,
    release: String,
}

/// What is waiting in an outbox ([`Outbox::backlog`]): what a dashboard or
/// an alert watches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backlog {
    /// Rows not yet published (failed ones excluded).
    pub pending: i64,
    /// Rows a sink refused for good: each holds its key's later rows back
    /// until it is released ([`Outbox::release`]).
    pub failed: i64,
    /// How long the oldest pending row has waited, if any is pending.
    pub oldest_pending: Option<Duration>,
}

/// A row a sink refused for good ([`Outbox::failed`]).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Failed {
    /// Its row id (what [`Outbox::release`] takes).
    pub id: i64,
    /// Its event's msg_id.
    pub msg_id: Uuid,
    /// Its destination.
    pub destination: String,
    /// Its key (held back behind it).
    pub key: String,
    /// Why the sink refused it.
    pub error: Option<String>,
    /// When it was refused.
    pub failed_at: chrono::DateTime<chrono::Utc>,
}

impl Outbox {
    pub(super) fn new(schema: &SchemaName) -> Self {
        let q = schema.quoted();
        Self {
            // Rows go in array order, so their ids (the publish order) follow it.
            insert: format!(
                "INSERT INTO {q}.outbox \
                   (msg_id, destination, key, event_type, payload, content_type, headers, shard) \
                 SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::bytea[], \
                                      $6::text[], $7::jsonb[], $8::int2[])"
            ),
            // Oldest first, by the index of published rows only.
            expire: format!(
                "DELETE FROM {q}.outbox WHERE id IN \
                   (SELECT id FROM {q}.outbox \
                    WHERE published_at IS NOT NULL \
                      AND created_at < now() - make_interval(secs => $1) \
                    ORDER BY created_at LIMIT $2)"
            ),
            backlog: format!(
                "SELECT count(*) FILTER (WHERE failed_at IS NULL), \
                        count(*) FILTER (WHERE failed_at IS NOT NULL), \
                        extract(epoch FROM now() - min(created_at) FILTER (WHERE failed_at IS NULL))::float8 \
                 FROM {q}.outbox WHERE published_at IS NULL"
            ),
            failed: format!(
                "SELECT id, msg_id, destination, key, error, failed_at FROM {q}.outbox \
                 WHERE published_at IS NULL AND failed_at IS NOT NULL ORDER BY id LIMIT $1"
            ),
            release: format!(
                "UPDATE {q}.outbox SET failed_at = NULL, error = NULL \
                 WHERE id = ANY($1) AND published_at IS NULL AND failed_at IS NOT NULL"
            ),
        }
    }

    /// Deletes the published rows written longer than `keep` ago, `batch`
    /// rows per statement (each its own transaction, so the expiry holds no
    /// lock for long); how many. Pending and failed rows are never deleted.
    /// [`Relay::run`](super::Relay::run) calls it once a minute with
    /// [`Relay::keep_published`](super::Relay::keep_published)'s duration.
    ///
    /// A published row is not needed for correctness (a copy a sink
    /// receives again is its consumer's inbox's business); it is kept for
    /// whoever looks into what was sent.
    pub async fn expire(
        &self,
        pool: &PgPool,
        keep: Duration,
        batch: u32,
    ) -> Result<u64, sqlx::Error> {
        let keep = keep.as_secs_f64();
        super::delete_in_batches(pool, batch, |limit| {
            sqlx::query(&self.expire).bind(keep).bind(limit)
        })
        .await
    }

    /// What is waiting: pending rows, failed rows, the oldest pending row's
    /// wait. Reads the pending and failed rows only (a partial index's worth).
    pub async fn backlog<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
    ) -> Result<Backlog, sqlx::Error> {
        let (pending, failed, oldest): (i64, i64, Option<f64>) =
            sqlx::query_as(&self.backlog).fetch_one(executor).await?;
        Ok(Backlog {
            pending,
            failed,
            oldest_pending: oldest.map(|secs| Duration::from_secs_f64(secs.max(0.0))),
        })
    }

    /// The first `limit` rows a sink refused for good, oldest first.
    pub async fn failed<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        limit: u32,
    ) -> Result<Vec<Failed>, sqlx::Error> {
        sqlx::query_as(&self.failed)
            .bind(i64::from(limit))
            .fetch_all(executor)
            .await
    }

    /// Makes failed rows `ids` pending again (the destination was fixed, the
    /// topic created): the relay publishes them, then their keys' later
    /// rows, in order. Rows that are not failed are left alone; how many were
    /// released.
    pub async fn release<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        ids: &[i64],
    ) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(&self.release)
            .bind(ids)
            .execute(executor)
            .await?
            .rows_affected())
    }

    /// Appends `event` in the caller's transaction (or, given a pool, in a
    /// transaction of its own): it is published if and only if that
    /// transaction commits. A msg_id already in the outbox is a unique
    /// violation: nothing is written.
    pub async fn enqueue<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        event: &Event,
    ) -> Result<(), sqlx::Error> {
        self.enqueue_batch(executor, std::slice::from_ref(event))
            .await
            .map(|_| ())
    }

    /// Appends `events` in one statement, in slice order (the order they are
    /// published in, for events of one key). Returns how many were written
    /// (all of them, or an error and none).
    pub async fn enqueue_batch<'e, E: PgExecutor<'e>>(
        &self,
        executor: E,
        events: &[Event],
    ) -> Result<u64, sqlx::Error> {
        let mut msg_ids = Vec::with_capacity(events.len());
        let mut destinations = Vec::with_capacity(events.len());
        let mut keys = Vec::with_capacity(events.len());
        let mut types = Vec::with_capacity(events.len());
        let mut payloads = Vec::with_capacity(events.len());
        let mut content_types = Vec::with_capacity(events.len());
        let mut headers = Vec::with_capacity(events.len());
        let mut shards = Vec::with_capacity(events.len());
        for e in events {
            msg_ids.push(e.msg_id);
            destinations.push(e.destination.as_str());
            keys.push(e.key.as_str());
            types.push(e.event_type.as_str());
            payloads.push(e.payload.bytes.as_slice());
            content_types.push(e.payload.content_type.as_str());
            headers.push(Json(&e.headers));
            shards.push(shard_of(&e.key));
        }
        Ok(sqlx::query(&self.insert)
            .bind(msg_ids)
            .bind(destinations)
            .bind(keys)
            .bind(types)
            .bind(payloads)
            .bind(content_types)
            .bind(headers)
            .bind(shards)
            .execute(executor)
            .await?
            .rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_has_one_shard_everywhere() {
        // Pinned: a change would move keys between relays mid-flight.
        assert_eq!(shard_of("cart-1"), shard_of("cart-1"));
        let spread: std::collections::HashSet<i16> =
            (0..1000).map(|i| shard_of(&format!("k{i}"))).collect();
        assert_eq!(spread.len(), SHARDS as usize);
        assert!(spread.iter().all(|s| (0..16).contains(s)));
    }

    #[test]
    fn events_refuse_what_the_table_or_a_consumer_cannot_take() {
        assert!(Event::json("cart.events", "c1", "cart.created", &1).is_ok());
        assert!(matches!(
            Event::json("", "c1", "t", &1),
            Err(EventError::Name {
                what: "destination",
                ..
            })
        ));
        assert!(matches!(
            Event::json("d", "c1", "a type", &1),
            Err(EventError::Name {
                what: "event type",
                ..
            })
        ));
        assert!(matches!(
            Event::json("d", "c\0 1", "t", &1),
            Err(EventError::Text { what: "key", .. })
        ));
        assert!(Event::json("d", &"k".repeat(1025), "t", &1).is_err());
        let e = Event::json("d", "k", "t", &1).expect("valid");
        assert!(e.clone().with_header("traceparent", "00-ab-cd-01").is_ok());
        assert!(e.clone().with_header("bad name", "v").is_err());
        assert!(e.clone().with_header("n", "v\0").is_err());
        assert!(e.clone().with_msg_id(Uuid::new_v4()).is_err());
        let ahead = crate::v7::minted_ahead(std::time::Duration::from_secs(3600));
        assert!(e.clone().with_msg_id(ahead).is_err());
        let id = Uuid::now_v7();
        assert_eq!(e.with_msg_id(id).expect("valid").msg_id(), id);
    }

    #[test]
    fn each_event_gets_its_own_v7_msg_id() {
        let a = Event::json("d", "k", "t", &1).expect("valid");
        let b = Event::json("d", "k", "t", &1).expect("valid");
        assert_ne!(a.msg_id(), b.msg_id());
        assert_eq!(a.msg_id().get_version_num(), 7);
    }
}
