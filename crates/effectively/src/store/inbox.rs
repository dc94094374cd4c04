//! The inbox: a consumer's claim of a message, in the transaction of the
//! message's effect.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use sqlx::{Acquire, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
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

/// The window of a partitioned inbox: the ids its partitions hold,
/// `[floor, ceiling)`, and the database's clock when it was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// The oldest partition's lower bound (`None`: no partitions).
    pub floor: Option<Uuid>,
    /// The newest partition's upper bound.
    pub ceiling: Option<Uuid>,
    /// The database's clock.
    pub clock: DateTime<Utc>,
}

impl Window {
    /// Where `message` stands: `None` when it may be claimed (its id is a
    /// UUID inside the window), or the claim it gets without one
    /// ([`InboxClaim::TooOld`], [`InboxClaim::Early`] or
    /// [`InboxClaim::Unrecordable`]).
    pub fn judge(&self, message: &Message, clock_skew: Duration) -> Option<InboxClaim> {
        match message.uuid {
            Some(id) => self.judge_id(id, clock_skew),
            None => Some(InboxClaim::Unrecordable),
        }
    }

    /// [`Window::judge`] for a message whose id is `id`.
    pub fn judge_id(&self, id: Uuid, clock_skew: Duration) -> Option<InboxClaim> {
        let early =
            id.get_version_num() == 7 && crate::v7::mint_time(id) <= self.clock + clock_skew;
        match (self.floor, self.ceiling) {
            (Some(floor), _) if id < floor => Some(InboxClaim::TooOld),
            (Some(_), Some(ceiling)) if id < ceiling => None,
            _ if early => Some(InboxClaim::Early),
            _ => Some(InboxClaim::Unrecordable),
        }
    }
}

/// What one [`Inbox::maintain_once`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Maintained {
    /// Partitions made (partitioned inbox).
    pub made: u32,
    /// Partitions dropped, by name (partitioned inbox).
    pub dropped: Vec<String>,
    /// Rows deleted (row inbox).
    pub deleted: u64,
}

/// Rows a row inbox's expiry deletes per transaction in
/// [`Inbox::maintain_once`].
const EXPIRE_BATCH: u32 = 10_000;

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
    ///
    /// The partitions of a partitioned inbox are shared by the consumers of
    /// its schema: one is dropped once it is older than the longest
    /// retention any of them last maintained with.
    pub fn retention(self, retention: Duration) -> Self {
        Self { retention, ..self }
    }

    /// Partitioned inbox only (a row inbox ignores it): the span of one
    /// partition (default [`DEFAULT_PARTITION`], at least a second), aligned
    /// to the Unix epoch. Rows are dropped a partition at a time, so they
    /// stay up to a partition longer than the retention.
    pub fn partition(mut self, granule: Duration) -> Self {
        if let Kind::Partitions(p) = &mut self.kind {
            p.granule = granule.max(Duration::from_secs(1));
        }
        self
    }

    /// Partitioned inbox only: how far past the database's clock
    /// [`Inbox::maintain_once`] makes partitions (default two partitions
    /// and the clock skew). A message minted past them is
    /// [`InboxClaim::Early`] until they reach it.
    pub fn ahead(mut self, ahead: Duration) -> Self {
        if let Kind::Partitions(p) = &mut self.kind {
            p.ahead = Some(ahead);
        }
        self
    }

    /// Partitioned inbox only: how far ahead of the database's clock a
    /// sender's clock may be (default [`DEFAULT_CLOCK_SKEW`]). A message
    /// minted further ahead is [`InboxClaim::Unrecordable`], not
    /// [`InboxClaim::Early`]: it would otherwise hold up the messages behind
    /// it until the partitions reached it.
    pub fn clock_skew(mut self, skew: Duration) -> Self {
        if let Kind::Partitions(p) = &mut self.kind {
            p.clock_skew = skew;
        }
        self
    }

    /// The consumer.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Whether this is a partitioned inbox.
    pub fn is_partitioned(&self) -> bool {
        matches!(self.kind, Kind::Partitions(_))
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

    /// The window of a partitioned inbox, read in the caller's transaction
    /// under the shared lock that keeps its partitions until the
    /// transaction ends (`None` for a row inbox). [`Inbox::claim_batch`]
    /// reads it itself; a caller reads it first to route the messages it
    /// cannot claim before claiming the others in the same transaction.
    pub async fn window(&self, conn: &mut PgConnection) -> Result<Option<Window>, sqlx::Error> {
        let Kind::Partitions(p) = &self.kind else {
            return Ok(None);
        };
        let (floor, ceiling, clock): (Option<Uuid>, Option<Uuid>, DateTime<Utc>) =
            sqlx::query_as(&p.window).fetch_one(&mut *conn).await?;
        Ok(Some(Window {
            floor,
            ceiling,
            clock,
        }))
    }

    /// Claims `messages` in the caller's transaction in two statements
    /// (however many there are; a partitioned inbox reads its window
    /// first): what [`Inbox::claim`] answers for each, in order. A message
    /// whose id came earlier in the same slice is a
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
        let window = if messages.is_empty() {
            None
        } else {
            self.window(conn).await?
        };
        self.claim_judged(conn, window.as_ref(), messages).await
    }

    /// [`Inbox::claim_batch`] in a transaction that has read the partitioned
    /// inbox's `window` already ([`Inbox::window`]: its partitions are kept
    /// until the transaction ends), so that it is not read twice. A row
    /// inbox does not use it.
    pub async fn claim_in_window(
        &self,
        conn: &mut PgConnection,
        window: &Window,
        messages: &[Message],
    ) -> Result<Vec<InboxClaim>, sqlx::Error> {
        self.claim_judged(conn, Some(window), messages).await
    }

    async fn claim_judged(
        &self,
        conn: &mut PgConnection,
        window: Option<&Window>,
        messages: &[Message],
    ) -> Result<Vec<InboxClaim>, sqlx::Error> {
        use std::collections::{HashMap, HashSet};
        // What each message gets without a claim (a partitioned inbox's
        // window), `None` for those to claim.
        let mut outside: Vec<Option<InboxClaim>> = vec![None; messages.len()];
        if let Kind::Partitions(p) = &self.kind {
            for (verdict, m) in outside.iter_mut().zip(messages) {
                *verdict = match window {
                    Some(window) => window.judge(m, p.clock_skew),
                    // Not read: nothing is claimed.
                    None => Some(InboxClaim::Early),
                };
            }
        }
        // The first message of each id among those to claim.
        let mut first: HashMap<&str, usize> = HashMap::with_capacity(messages.len());
        for (at, m) in messages.iter().enumerate() {
            if outside[at].is_none() {
                first.entry(m.id.as_str()).or_insert(at);
            }
        }
        let unique: Vec<usize> = first.values().copied().collect();
        let hashes: Vec<&[u8]> = unique
            .iter()
            .map(|at| messages[*at].payload_hash.as_slice())
            .collect();
        // Which of `unique` were inserted, and the stored hash of the others,
        // by their first message.
        let stored = match &self.kind {
            Kind::Rows => {
                let window = self.retention.saturating_sub(self.margin()).as_secs_f64();
                let ids: Vec<String> = unique.iter().map(|at| messages[*at].id.clone()).collect();
                let sent_at: Vec<DateTime<Utc>> =
                    unique.iter().map(|at| messages[*at].sent_at).collect();
                let insert = sqlx::query_scalar(&self.insert_many)
                    .bind(&self.consumer)
                    .bind(ids.clone())
                    .bind(&hashes)
                    .bind(sent_at)
                    .bind(window);
                insert_then_read(conn, insert, &self.read_many, &self.consumer, ids).await?
            }
            Kind::Partitions(_) => {
                // Every message to claim has a UUID id (its window said so).
                let ids: Vec<Uuid> = unique
                    .iter()
                    .map(|at| messages[*at].uuid.unwrap_or_default())
                    .collect();
                let insert = sqlx::query_scalar(&self.insert_many)
                    .bind(&self.consumer)
                    .bind(ids.clone())
                    .bind(&hashes);
                insert_then_read(conn, insert, &self.read_many, &self.consumer, ids).await?
            }
        };
        let mut inserted: HashSet<usize> = HashSet::new();
        let mut found: HashMap<usize, Vec<u8>> = HashMap::new();
        for (at, row) in unique.iter().zip(stored) {
            match row {
                Stored::Inserted => {
                    inserted.insert(*at);
                }
                Stored::Found(hash) => {
                    found.insert(*at, hash);
                }
                Stored::Missing => {}
            }
        }
        Ok(messages
            .iter()
            .enumerate()
            .map(|(at, m)| {
                if let Some(verdict) = outside[at] {
                    return verdict;
                }
                let head = first[m.id.as_str()];
                // An id this batch inserted is its first message's; a later
                // copy compares with that one.
                let stored = if inserted.contains(&head) {
                    if at == head {
                        return InboxClaim::New;
                    }
                    Some(messages[head].payload_hash.as_slice())
                } else {
                    found.get(&head).map(Vec::as_slice)
                };
                match stored {
                    // An empty fingerprint: a row brought from another
                    // inbox without one (Message::v7_fingerprinted).
                    Some(hash) if hash.is_empty() || hash == m.payload_hash.as_slice() => {
                        InboxClaim::Duplicate
                    }
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
            InboxClaim::Early => Applied::Early,
            InboxClaim::Unrecordable => Applied::Unrecordable,
        };
        match applied {
            Applied::New(_) => tx.commit().await?,
            _ => tx.rollback().await?,
        }
        Ok(applied)
    }

    /// Expires what is older than the retention. A row inbox deletes this
    /// consumer's rows of messages sent longer ago, `batch` rows per
    /// transaction, until none is left, and returns how many it deleted. A
    /// partitioned inbox records this consumer's retention and drops the
    /// partitions older than the longest retention recorded (`batch` is not
    /// used), and returns how many it dropped.
    pub async fn expire(&self, pool: &PgPool, batch: u32) -> Result<u64, sqlx::Error> {
        let age = self.retention.as_secs_f64();
        match &self.kind {
            Kind::Rows => {
                super::delete_in_batches(pool, batch, |limit| {
                    sqlx::query(&self.expire)
                        .bind(&self.consumer)
                        .bind(age)
                        .bind(limit)
                })
                .await
            }
            Kind::Partitions(_) => Ok(self.drop_expired(pool).await?.len() as u64),
        }
    }

    /// Partitioned inbox: records this consumer's retention and drops the
    /// expired partitions, as [`Inbox::expire`], returning their names (a
    /// row inbox: none, and nothing is done).
    pub async fn drop_expired(&self, pool: &PgPool) -> Result<Vec<String>, sqlx::Error> {
        if !self.is_partitioned() {
            return Ok(Vec::new());
        }
        sqlx::query_scalar(&self.expire)
            .bind(&self.consumer)
            .bind(self.retention.as_secs_f64())
            .fetch_all(pool)
            .await
    }

    /// Partitioned inbox: makes the partitions missing up to the inbox's
    /// [`Inbox::ahead`] past the database's clock; returns how many it
    /// made (0 for a row inbox).
    pub async fn extend(&self, pool: &PgPool) -> Result<u32, sqlx::Error> {
        let Kind::Partitions(p) = &self.kind else {
            return Ok(0);
        };
        let ahead = p.ahead.unwrap_or(2 * p.granule + p.clock_skew);
        let made: i32 = sqlx::query_scalar(&p.extend)
            .bind(ahead.as_secs_f64())
            .bind(p.granule.as_secs_f64())
            .fetch_one(pool)
            .await?;
        Ok(u32::try_from(made).unwrap_or_default())
    }

    /// One round of upkeep: a partitioned inbox makes the partitions ahead
    /// ([`Inbox::extend`]) and drops the expired ones; a row inbox deletes
    /// its expired rows ([`Inbox::expire`]).
    pub async fn maintain_once(&self, pool: &PgPool) -> Result<Maintained, sqlx::Error> {
        match &self.kind {
            Kind::Rows => Ok(Maintained {
                deleted: self.expire(pool, EXPIRE_BATCH).await?,
                ..Maintained::default()
            }),
            Kind::Partitions(_) => {
                let made = self.extend(pool).await?;
                let dropped = self.drop_expired(pool).await?;
                Ok(Maintained {
                    made,
                    dropped,
                    deleted: 0,
                })
            }
        }
    }

    /// How often [`Inbox::maintain`] runs a round: a quarter of a
    /// partition, at most a minute (a row inbox: a minute).
    pub fn maintenance_interval(&self) -> Duration {
        match &self.kind {
            Kind::Rows => Duration::from_secs(60),
            Kind::Partitions(p) => {
                (p.granule / 4).clamp(Duration::from_millis(250), Duration::from_secs(60))
            }
        }
    }

    /// Runs [`Inbox::maintain_once`] every [`Inbox::maintenance_interval`]
    /// until `cancel` fires, the first round at once. A round that fails is
    /// logged and tried again at the next: a partitioned inbox keeps two
    /// partitions ahead by default, so a few failed rounds hold up no
    /// message. Spawn it beside the consumer (any number of consumers may
    /// maintain the same schema at once: they take turns).
    pub async fn maintain(&self, pool: &PgPool, cancel: &CancellationToken) {
        let mut every = tokio::time::interval(self.maintenance_interval());
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = every.tick() => {}
            }
            match self.maintain_once(pool).await {
                Ok(done) if done.made > 0 || !done.dropped.is_empty() || done.deleted > 0 => {
                    tracing::info!(consumer = %self.consumer, made = done.made, dropped = ?done.dropped, deleted = done.deleted, "effectively: inbox maintained");
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(consumer = %self.consumer, %error, "effectively: inbox upkeep failed; tried again next round");
                }
            }
        }
    }
}

/// What a claim's insert found for one id.
enum Stored {
    /// The insert wrote its row: the claim is the caller's.
    Inserted,
    /// A row was there, with this payload hash.
    Found(Vec<u8>),
    /// Neither (a row inbox's message too old to insert).
    Missing,
}

/// Runs `insert` (the free `ids` inserted, their ids returned), then reads
/// the stored hash of the others with `read` (`$1` the consumer, `$2` the
/// ids): a statement of its own, whose snapshot sees rows committed while
/// the insert waited on them. Answers for each of `ids`, in order; runs
/// nothing for none.
async fn insert_then_read<'q, K>(
    conn: &mut PgConnection,
    insert: sqlx::query::QueryScalar<'q, sqlx::Postgres, K, sqlx::postgres::PgArguments>,
    read: &'q str,
    consumer: &'q str,
    ids: Vec<K>,
) -> Result<Vec<Stored>, sqlx::Error>
where
    K: for<'r> sqlx::Decode<'r, sqlx::Postgres>
        + sqlx::Type<sqlx::Postgres>
        + Eq
        + std::hash::Hash
        + Clone
        + Send
        + Unpin
        + 'q,
    Vec<K>: for<'e> sqlx::Encode<'e, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    use std::collections::{HashMap, HashSet};
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let new: HashSet<K> = insert.fetch_all(&mut *conn).await?.into_iter().collect();
    let others: Vec<K> = ids
        .iter()
        .filter(|id| !new.contains(*id))
        .cloned()
        .collect();
    let stored: HashMap<K, Vec<u8>> = if others.is_empty() {
        HashMap::new()
    } else {
        sqlx::query_as::<_, (K, Vec<u8>)>(read)
            .bind(consumer)
            .bind(others)
            .fetch_all(&mut *conn)
            .await?
            .into_iter()
            .collect()
    };
    Ok(ids
        .into_iter()
        .map(|id| {
            if new.contains(&id) {
                Stored::Inserted
            } else {
                stored
                    .get(&id)
                    .cloned()
                    .map_or(Stored::Missing, Stored::Found)
            }
        })
        .collect())
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
