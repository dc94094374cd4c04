//! Claiming messages: a partitioned inbox's [`Window`], a claim, a batch of
//! them in two statements, and an effect applied with its claim.

use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use sqlx::{Acquire, PgConnection, PgPool};
use uuid::Uuid;

use super::{Applied, Inbox, InboxClaim, Kind, Message};

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

impl Inbox {
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
