//! The inbox: a consumer's claim of a message, in the transaction of the
//! message's effect.

mod builder;
mod claim;
#[cfg(test)]
mod tests;
mod upkeep;

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::SchemaName;

pub use claim::Window;
pub use upkeep::Maintained;

/// How long an inbox keeps a message's row by default: eight days after it
/// was sent (minted, for a UUIDv7 id), a day more than Kafka's default
/// retention (seven days). See [`Inbox::retention`] for what it must cover.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(8 * 24 * 3600);

/// Longest message id accepted, in bytes.
const MAX_ID: usize = 255;

/// A message's id as its sender gave it: a UUID (a UUIDv7 carries its send
/// time) or any text.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MessageId {
    /// A UUID, stored in its hyphenated lowercase form.
    Uuid(Uuid),
    /// Text: 1 to 255 bytes, no NUL.
    Text(String),
}

impl MessageId {
    fn to_text(&self) -> String {
        match self {
            Self::Uuid(u) => u.hyphenated().to_string(),
            Self::Text(t) => t.clone(),
        }
    }
}

impl From<Uuid> for MessageId {
    fn from(id: Uuid) -> Self {
        Self::Uuid(id)
    }
}

impl From<&str> for MessageId {
    fn from(id: &str) -> Self {
        Self::Text(id.to_owned())
    }
}

impl From<String> for MessageId {
    fn from(id: String) -> Self {
        Self::Text(id)
    }
}

/// Why a [`Message`] could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("message id {id:?} is not accepted: {why}")]
pub struct MessageError {
    /// The id given (its first 300 characters).
    pub id: String,
    /// What is wrong.
    pub why: &'static str,
}

/// A message as the inbox sees it: its id, when it was sent (the inbox
/// keeps its row for the retention after that) and a hash of its payload (a
/// second message with the same id and another payload is a conflict, not a
/// duplicate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    id: String,
    sent_at: DateTime<Utc>,
    payload_hash: Vec<u8>,
    /// The id, when it is a UUID (what a partitioned inbox records).
    uuid: Option<Uuid>,
}

impl Message {
    /// A message with id `id`, sent at `sent_at` (for a Kafka record, its
    /// timestamp; for a webhook, its `webhook-timestamp`), carrying
    /// `payload`.
    ///
    /// Every copy of a message must be judged by one time: a copy sent
    /// again (re-published by a relay, re-signed for a webhook retry)
    /// carries a later timestamp of its own, and judged by that it would be
    /// claimed anew once the first copy's row had expired. So an id that is
    /// a UUIDv7 (as every [`super::Event`]'s msg_id is) is judged by the
    /// time it carries, its mint time, and `sent_at` is not used. For any
    /// other id the inbox has only `sent_at`: give the time the message was
    /// first sent when the sender carries one, and size the retention from
    /// the first send to the last copy that may arrive.
    pub fn new(
        id: impl Into<MessageId>,
        sent_at: DateTime<Utc>,
        payload: &[u8],
    ) -> Result<Self, MessageError> {
        let id = id.into().to_text();
        let refuse = |why| {
            Err(MessageError {
                id: id.chars().take(300).collect(),
                why,
            })
        };
        if id.is_empty() {
            return refuse("it is empty");
        }
        if id.len() > MAX_ID {
            return refuse("it is longer than 255 bytes");
        }
        if id.contains('\0') {
            return refuse("it holds a NUL character");
        }
        let uuid = Uuid::try_parse(&id).ok();
        Ok(Self {
            payload_hash: blake3::hash(payload).as_bytes().to_vec(),
            sent_at: uuid
                .filter(|u| u.get_version_num() == 7)
                .map_or(sent_at, crate::v7::mint_time),
            id,
            uuid,
        })
    }

    /// A message whose id is a UUIDv7 (an [`super::Event`]'s msg_id): sent
    /// at the time the id carries.
    pub fn v7(id: Uuid, payload: &[u8]) -> Self {
        Self {
            id: id.hyphenated().to_string(),
            sent_at: crate::v7::mint_time(id),
            payload_hash: blake3::hash(payload).as_bytes().to_vec(),
            uuid: Some(id),
        }
    }

    /// A message whose id is a UUIDv7, as [`Message::v7`], fingerprinted
    /// by the caller: `fingerprint` stands for its payload (a copy with
    /// another one is a [`InboxClaim::Conflict`]). For a consumer that
    /// fingerprints what a payload says rather than its bytes, or that
    /// brings the rows of an inbox of its own with their fingerprints (a
    /// row brought without one, an empty fingerprint, takes every copy as a
    /// duplicate).
    pub fn v7_fingerprinted(id: Uuid, fingerprint: &[u8]) -> Self {
        Self {
            id: id.hyphenated().to_string(),
            sent_at: crate::v7::mint_time(id),
            payload_hash: fingerprint.to_vec(),
            uuid: Some(id),
        }
    }

    /// Its id as stored.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// When it was sent.
    pub fn sent_at(&self) -> DateTime<Utc> {
        self.sent_at
    }

    /// Its id, when that is a UUID.
    pub fn uuid(&self) -> Option<Uuid> {
        self.uuid
    }
}

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxClaim {
    /// First delivery: the row is the caller's until its transaction ends.
    /// Apply the effect and commit (a rollback frees the claim again).
    New,
    /// Applied before, with the same payload: do nothing.
    Duplicate,
    /// Applied before with another payload under the same id: the sender
    /// reused an id. Nothing was written; dead-letter it.
    Conflict,
    /// Sent (for a UUIDv7 id: minted) longer ago than the inbox keeps rows
    /// (less its margin): whether it was applied cannot be told any more.
    /// Nothing was written; dead-letter it. In a partitioned inbox: minted
    /// before its oldest partition kept.
    TooOld,
    /// Partitioned inbox only: minted at or after the end of the partitions
    /// made so far (not more than the inbox's clock skew ahead of the
    /// database's clock). Nothing was written: claim it again once
    /// [`Inbox::maintain`] has made its partition (the messages behind it
    /// should wait, to keep their order).
    Early,
    /// Partitioned inbox only: its id is not a UUID; or it lies past the
    /// partitions and is no UUIDv7 (its first bits are no mint time) or was
    /// minted further ahead of the database's clock than the inbox's clock
    /// skew (a sender's clock far ahead, or a forged id): no partition is
    /// made for it now. Nothing was written; dead-letter it.
    Unrecordable,
}

/// What [`Inbox::apply`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied<T> {
    /// The effect ran and committed with the claim; its result.
    New(T),
    /// [`InboxClaim::Duplicate`]: the effect did not run.
    Duplicate,
    /// [`InboxClaim::Conflict`]: the effect did not run.
    Conflict,
    /// [`InboxClaim::TooOld`]: the effect did not run.
    TooOld,
    /// [`InboxClaim::Early`]: the effect did not run; apply it again later.
    Early,
    /// [`InboxClaim::Unrecordable`]: the effect did not run.
    Unrecordable,
}

/// A consumer's inbox in a schema: [`super::Effectively::inbox`] (a row per
/// message, any id) or [`super::Effectively::partitioned_inbox`] (UUIDv7
/// ids, partitioned by mint time).
///
/// A message's row is kept for the retention ([`Inbox::retention`], at
/// least the sender's horizon: how long it may deliver a copy) after it was
/// sent, every copy judged by one time ([`Message::new`]: a UUIDv7 id's mint
/// time).
///
/// - In the row inbox, [`Inbox::expire`] deletes older rows. A claim takes
///   a message only while it is younger than the retention less a margin
///   (an eighth of it, at most an hour): a claim and the delete of the same
///   message's row then never meet, so no copy is applied twice.
/// - In the partitioned inbox, [`Inbox::maintain`] makes partitions ahead
///   and drops those older than the retention, whole: no delete and no
///   vacuum, whatever the volume. A claim reads the partitions' window under
///   a shared lock that a drop waits for, so the two never meet either.
///
/// A retention shorter than the horizon does not apply a copy twice: a copy
/// that comes later is [`InboxClaim::TooOld`], dead-lettered, not applied.
#[derive(Debug, Clone)]
pub struct Inbox {
    consumer: String,
    retention: Duration,
    kind: Kind,
    insert_many: String,
    read_many: String,
    expire: String,
}

/// How an inbox keeps its rows.
#[derive(Debug, Clone)]
enum Kind {
    /// A row per message, deleted after the retention.
    Rows,
    /// Partitions of mint time, dropped after the retention.
    Partitions(Partitioning),
}

/// The partitioned inbox's terms and statements.
#[derive(Debug, Clone)]
struct Partitioning {
    granule: Duration,
    ahead: Option<Duration>,
    clock_skew: Duration,
    window: String,
    extend: String,
}

/// How long one partition of a partitioned inbox spans by default: a day.
pub const DEFAULT_PARTITION: Duration = Duration::from_secs(24 * 3600);

/// How far ahead of the database's clock a partitioned inbox takes a
/// message's mint time to be by default: five minutes. A message minted
/// further ahead is [`InboxClaim::Unrecordable`].
pub const DEFAULT_CLOCK_SKEW: Duration = Duration::from_secs(300);

impl Inbox {
    pub(super) fn new(schema: &SchemaName, consumer: &str) -> Self {
        let q = schema.quoted();
        Self {
            consumer: consumer.to_owned(),
            retention: DEFAULT_RETENTION,
            kind: Kind::Rows,
            insert_many: format!(
                "INSERT INTO {q}.inbox (consumer, msg_id, payload_hash, sent_at) \
                 SELECT $1, m.id, m.hash, m.sent_at \
                 FROM unnest($2::text[], $3::bytea[], $4::timestamptz[]) AS m(id, hash, sent_at) \
                 WHERE m.sent_at >= clock_timestamp() - make_interval(secs => $5) \
                 ORDER BY m.id \
                 ON CONFLICT (consumer, msg_id) DO NOTHING RETURNING msg_id"
            ),
            read_many: format!(
                "SELECT msg_id, payload_hash FROM {q}.inbox WHERE consumer = $1 AND msg_id = ANY($2)"
            ),
            expire: format!(
                "DELETE FROM {q}.inbox WHERE ctid = ANY(ARRAY( \
                   SELECT ctid FROM {q}.inbox \
                   WHERE consumer = $1 AND sent_at < clock_timestamp() - make_interval(secs => $2) \
                   LIMIT $3))"
            ),
        }
    }

    pub(super) fn partitioned(schema: &SchemaName, consumer: &str) -> Self {
        let q = schema.quoted();
        Self {
            consumer: consumer.to_owned(),
            retention: DEFAULT_RETENTION,
            kind: Kind::Partitions(Partitioning {
                granule: DEFAULT_PARTITION,
                ahead: None,
                clock_skew: DEFAULT_CLOCK_SKEW,
                window: format!("SELECT floor, ceiling, clock FROM {q}.partitioned_inbox_window()"),
                extend: format!(
                    "SELECT {q}.partitioned_inbox_extend( \
                       now() + make_interval(secs => $1), make_interval(secs => $2))"
                ),
            }),
            insert_many: format!(
                "INSERT INTO {q}.partitioned_inbox (consumer, msg_id, payload_hash) \
                 SELECT $1, m.id, m.hash FROM unnest($2::uuid[], $3::bytea[]) AS m(id, hash) \
                 ORDER BY m.id \
                 ON CONFLICT (msg_id, consumer) DO NOTHING RETURNING msg_id"
            ),
            read_many: format!(
                "SELECT msg_id, payload_hash FROM {q}.partitioned_inbox \
                 WHERE consumer = $1 AND msg_id = ANY($2)"
            ),
            expire: format!(
                "SELECT {q}.partitioned_inbox_expire($1, make_interval(secs => $2)) AS name"
            ),
        }
    }

    /// How much younger than the retention a message must be to be taken.
    fn margin(&self) -> Duration {
        (self.retention / 8).min(Duration::from_secs(3600))
    }
}
