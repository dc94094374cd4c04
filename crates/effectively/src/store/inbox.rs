//! The inbox: a consumer's claim of a message, in the transaction of the
//! message's effect.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use sqlx::{Acquire, PgConnection, PgPool};
use uuid::Uuid;

use super::SchemaName;

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
    payload_hash: [u8; 32],
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
        let sent_at = match Uuid::try_parse(&id) {
            Ok(uuid) if uuid.get_version_num() == 7 => crate::v7::mint_time(uuid),
            _ => sent_at,
        };
        Ok(Self {
            payload_hash: *blake3::hash(payload).as_bytes(),
            id,
            sent_at,
        })
    }

    /// A message whose id is a UUIDv7 (an [`super::Event`]'s msg_id): sent
    /// at the time the id carries.
    pub fn v7(id: Uuid, payload: &[u8]) -> Self {
        Self {
            id: id.hyphenated().to_string(),
            sent_at: crate::v7::mint_time(id),
            payload_hash: *blake3::hash(payload).as_bytes(),
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
    /// Nothing was written; dead-letter it.
    TooOld,
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
}

/// A consumer's inbox in a schema ([`super::Effectively::inbox`]).
///
/// A message's row is kept for the retention ([`Inbox::retention`], at
/// least the sender's horizon: how long it may deliver a copy) after it was
/// sent, every copy judged by one time ([`Message::new`]: a UUIDv7 id's mint
/// time); [`Inbox::expire`] deletes older rows. A claim takes a message only
/// while it is younger than the retention less a margin (an eighth of it, at
/// most an hour): a claim and the delete of the same message's row then
/// never meet, so no copy is applied twice. A retention shorter than the
/// horizon does not apply a copy twice either: a copy that comes later is
/// [`InboxClaim::TooOld`], dead-lettered, not applied.
#[derive(Debug, Clone)]
pub struct Inbox {
    consumer: String,
    retention: Duration,
    insert_many: String,
    read_many: String,
    expire: String,
}

impl Inbox {
    pub(super) fn new(schema: &SchemaName, consumer: &str) -> Self {
        let q = schema.quoted();
        Self {
            consumer: consumer.to_owned(),
            retention: DEFAULT_RETENTION,
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

    /// The same inbox keeping rows for `retention` after their message was
    /// sent (default [`DEFAULT_RETENTION`]). It should cover the sender's
    /// horizon, the longest time from a message's mint time (for an id
    /// that is not a UUIDv7, its first send) to the last copy that may
    /// arrive: for events of this library's outbox over Kafka, how long the
    /// outbox keeps a row that may be published again (the relay's
    /// [`super::Relay::keep_published`], a week by default) + the producer's delivery
    /// timeout + the topic's `retention.ms` + its `segment.ms`; for
    /// webhooks, how long a row may wait before its first send + the
    /// sender's retry span. A shorter one never applies a copy twice; it
    /// dead-letters copies that come after it as too old.
    pub fn retention(self, retention: Duration) -> Self {
        Self { retention, ..self }
    }

    /// The consumer.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// How much younger than the retention a message must be to be taken.
    fn margin(&self) -> Duration {
        (self.retention / 8).min(Duration::from_secs(3600))
    }

    /// Claims `message` in the caller's transaction. On [`InboxClaim::New`]
    /// the caller applies the effect in the same transaction and commits; a
    /// copy claimed meanwhile by another transaction waits for that commit
    /// and is then a [`InboxClaim::Duplicate`].
    pub async fn claim(
        &self,
        conn: &mut PgConnection,
        message: &Message,
    ) -> Result<InboxClaim, sqlx::Error> {
        let mut claims = self
            .claim_batch(conn, std::slice::from_ref(message))
            .await?;
        Ok(claims.pop().expect("a batch of one has one claim"))
    }

    /// Claims `messages` in the caller's transaction in two statements
    /// (however many there are): what [`Inbox::claim`] answers for each, in
    /// order. A message whose id came earlier in the same slice is a
    /// [`InboxClaim::Duplicate`] of it (or a [`InboxClaim::Conflict`], with
    /// another payload), as if claimed one after the other.
    ///
    /// Rows are inserted in id order (the database's), so two batches
    /// claiming some of the same ids at once wait for each other in one
    /// order, never in a cycle.
    pub async fn claim_batch(
        &self,
        conn: &mut PgConnection,
        messages: &[Message],
    ) -> Result<Vec<InboxClaim>, sqlx::Error> {
        use std::collections::{HashMap, HashSet};
        // The first message of each id, in id order.
        let mut first: HashMap<&str, usize> = HashMap::with_capacity(messages.len());
        for (at, m) in messages.iter().enumerate() {
            first.entry(m.id.as_str()).or_insert(at);
        }
        let unique: Vec<usize> = first.values().copied().collect();
        let window = self.retention.saturating_sub(self.margin()).as_secs_f64();
        let inserted: Vec<String> = sqlx::query_scalar(&self.insert_many)
            .bind(&self.consumer)
            .bind(
                unique
                    .iter()
                    .map(|at| messages[*at].id.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(
                unique
                    .iter()
                    .map(|at| messages[*at].payload_hash.as_slice())
                    .collect::<Vec<_>>(),
            )
            .bind(
                unique
                    .iter()
                    .map(|at| messages[*at].sent_at)
                    .collect::<Vec<_>>(),
            )
            .bind(window)
            .fetch_all(&mut *conn)
            .await?;
        let inserted: HashSet<String> = inserted.into_iter().collect();
        let others: Vec<&str> = unique
            .iter()
            .map(|at| messages[*at].id.as_str())
            .filter(|id| !inserted.contains(*id))
            .collect();
        // A statement of its own: its snapshot sees rows committed while
        // the insert waited on them.
        let found: HashMap<String, Vec<u8>> = if others.is_empty() {
            HashMap::new()
        } else {
            sqlx::query_as::<_, (String, Vec<u8>)>(&self.read_many)
                .bind(&self.consumer)
                .bind(&others)
                .fetch_all(&mut *conn)
                .await?
                .into_iter()
                .collect()
        };
        Ok(messages
            .iter()
            .enumerate()
            .map(|(at, m)| {
                let head = first[m.id.as_str()];
                // An id this batch inserted is its first message's; a later
                // copy compares with that one.
                let stored = if inserted.contains(&m.id) {
                    if at == head {
                        return InboxClaim::New;
                    }
                    Some(messages[head].payload_hash.as_slice())
                } else {
                    found.get(&m.id).map(Vec::as_slice)
                };
                match stored {
                    Some(hash) if hash == m.payload_hash.as_slice() => InboxClaim::Duplicate,
                    Some(_) => InboxClaim::Conflict,
                    None => InboxClaim::TooOld,
                }
            })
            .collect())
    }

    /// Claims `message` and, when it is new, runs `effect` in the claim's
    /// transaction, then commits both; otherwise rolls back and says why the
    /// effect did not run. An error from `effect` rolls everything back (the
    /// message can be delivered again).
    ///
    /// ```no_run
    /// # use effectively::store::{Effectively, Message};
    /// # async fn run(fx: Effectively, msg: Message) -> Result<(), sqlx::Error> {
    /// let applied = fx
    ///     .inbox("billing")
    ///     .apply(fx.pool(), &msg, |tx| {
    ///         Box::pin(async move {
    ///             sqlx::query("INSERT INTO invoices (cart) VALUES (1)")
    ///                 .execute(&mut *tx)
    ///                 .await?;
    ///             Ok::<_, sqlx::Error>(())
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn apply<T, E, F>(
        &self,
        pool: &PgPool,
        message: &Message,
        effect: F,
    ) -> Result<Applied<T>, E>
    where
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, E>>,
        E: From<sqlx::Error>,
    {
        let mut conn = pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let claim = self.claim(&mut tx, message).await?;
        let applied = match claim {
            InboxClaim::New => Applied::New(effect(&mut tx).await?),
            InboxClaim::Duplicate => Applied::Duplicate,
            InboxClaim::Conflict => Applied::Conflict,
            InboxClaim::TooOld => Applied::TooOld,
        };
        match applied {
            Applied::New(_) => tx.commit().await?,
            _ => tx.rollback().await?,
        }
        Ok(applied)
    }

    /// Deletes this consumer's rows of messages sent longer ago than the
    /// retention, `batch` rows per transaction, until none is left. Returns
    /// how many it deleted.
    pub async fn expire(&self, pool: &PgPool, batch: u32) -> Result<u64, sqlx::Error> {
        let age = self.retention.as_secs_f64();
        super::delete_in_batches(pool, batch, |limit| {
            sqlx::query(&self.expire)
                .bind(&self.consumer)
                .bind(age)
                .bind(limit)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_are_bounded_text() {
        let now = Utc::now();
        assert!(Message::new("a", now, b"").is_ok());
        assert!(Message::new("x".repeat(255), now, b"").is_ok());
        assert!(Message::new("", now, b"").is_err());
        assert!(Message::new("x".repeat(256), now, b"").is_err());
        assert!(Message::new("a\0b", now, b"").is_err());
        let id = Uuid::now_v7();
        assert_eq!(
            Message::new(id, now, b"").expect("valid").id(),
            id.to_string()
        );
        assert_eq!(Message::v7(id, b"p").sent_at(), crate::v7::mint_time(id));
    }

    #[test]
    fn a_uuidv7_id_is_judged_by_its_mint_time_any_other_by_when_it_was_sent() {
        let minted = crate::v7::minted_ago(Duration::from_secs(86_400));
        let now = Utc::now();
        for id in [MessageId::Uuid(minted), MessageId::Text(minted.to_string())] {
            let m = Message::new(id, now, b"").expect("valid");
            assert_eq!(m.sent_at(), crate::v7::mint_time(minted));
        }
        let v4 = Uuid::from_u128(0x6f1c_0b6e_8a1d_4c5e_9d3f_2b7a_1e0c_4d5f);
        assert_eq!(v4.get_version_num(), 4);
        assert_eq!(Message::new(v4, now, b"").expect("valid").sent_at(), now);
        assert_eq!(
            Message::new("order-7", now, b"").expect("valid").sent_at(),
            now
        );
    }

    #[test]
    fn the_margin_is_an_eighth_of_the_retention_at_most_an_hour() {
        let schema = SchemaName::new("s").expect("valid");
        let inbox = Inbox::new(&schema, "c");
        assert_eq!(inbox.margin(), Duration::from_secs(3600));
        let short = inbox.retention(Duration::from_secs(80));
        assert_eq!(short.margin(), Duration::from_secs(10));
    }
}
