//! [`handle`]: one message's effect and its inbox claim in one transaction,
//! or its dead letter; what the Kafka consumer loop ([`consume`]) and the
//! webhook receiver ([`WebhookReceiver`]) run for each message.
//!
//! [`consume`]: super::consume
//! [`WebhookReceiver`]: super::WebhookReceiver

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use sqlx::types::Json;
use sqlx::{Acquire, PgConnection};

use super::inbox::{Inbox, InboxClaim, Message};
use super::{Effectively, SchemaName};

/// A record as a handler gets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Where it came from, as its dead letter records it: `topic/partition/offset`
    /// for a Kafka record, `webhook` for a signed webhook.
    pub source: String,
    /// Its key, if any (a Kafka record's).
    pub key: Option<Vec<u8>>,
    /// Its payload (empty when it had none).
    pub payload: Vec<u8>,
    /// Its headers, in order (a header without a value has an empty one).
    pub headers: Vec<(String, Vec<u8>)>,
    /// The id the inbox deduplicates it by: a Kafka record's `msg_id`
    /// header, a webhook's `webhook-id`.
    pub msg_id: String,
    /// When this copy was sent: a Kafka record's timestamp (the broker's
    /// with `LogAppendTime`), a webhook's `webhook-timestamp`. The inbox
    /// judges a UUIDv7 `msg_id` by its mint time instead ([`Message::new`]).
    pub sent_at: DateTime<Utc>,
}

impl Record {
    /// The value of header `name`, if there.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }
}

/// Why a handler did not apply a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// Not now (the database, a service it calls): the transaction rolls
    /// back and the record is handled again after a backoff. The partition
    /// waits for it, so its order holds.
    #[error("try again: {0}")]
    Retry(String),
    /// Never (a payload it cannot read, a rule it breaks): the record is
    /// dead-lettered with the reason, and its claim is kept, so a copy of it
    /// is a duplicate.
    #[error("dead letter: {0}")]
    Reject(String),
}

impl From<sqlx::Error> for HandlerError {
    /// A database error is tried again.
    fn from(error: sqlx::Error) -> Self {
        Self::Retry(error.to_string())
    }
}

/// A handler: applies a record's effect on the connection of the claim's
/// transaction.
pub type Handler = dyn for<'c> Fn(&'c mut PgConnection, &'c Record) -> BoxFuture<'c, Result<(), HandlerError>>
    + Send
    + Sync;

/// What one record came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Handled {
    /// The effect was applied and committed with its claim.
    Applied,
    /// A copy of a record applied before: nothing done.
    Duplicate,
    /// Dead-lettered with this reason (the handler refused it, it had no
    /// usable msg_id, its id was reused with another payload, it was older
    /// than the inbox keeps rows, or a partitioned inbox cannot record it).
    DeadLettered(String),
}

/// The dead-letter statement of a schema.
fn dead_letter_sql(schema: &SchemaName) -> String {
    let q = schema.quoted();
    format!(
        "INSERT INTO {q}.dead_letters (consumer, msg_id, source, reason, payload, headers) \
         VALUES ($1, $2, $3, $4, $5, $6)"
    )
}

/// Handles one record: claim, effect, commit; a refusal is dead-lettered.
/// `Err` only when it must be tried again (the database, the handler's
/// [`HandlerError::Retry`]); nothing of it was committed then. A batch of
/// one ([`handle_batch`]).
pub async fn handle(
    fx: &Effectively,
    inbox: &Inbox,
    handler: &Handler,
    record: &Record,
) -> Result<Handled, HandlerError> {
    let mut handled = handle_batch(fx, inbox, handler, std::slice::from_ref(record)).await?;
    Ok(handled.pop().expect("a batch of one has one outcome"))
}

async fn dead_letter(
    fx: &Effectively,
    conn: &mut PgConnection,
    inbox: &Inbox,
    record: &Record,
    message: Option<&Message>,
    why: &str,
) -> Result<(), HandlerError> {
    tracing::warn!(consumer = inbox.consumer(), source = %record.source, msg_id = %record.msg_id, %why, "dead letter");
    let headers: Vec<(String, String)> = record
        .headers
        .iter()
        .map(|(n, v)| (crate::text::storable(n), crate::text::storable_bytes(v)))
        .collect();
    sqlx::query(&dead_letter_sql(fx.schema_name()))
        .bind(inbox.consumer())
        .bind(message.map(Message::id))
        .bind(crate::text::storable(&record.source))
        .bind(crate::text::storable(why))
        .bind(&record.payload)
        .bind(Json(headers))
        .execute(conn)
        .await?;
    Ok(())
}

/// Handles `records` in ONE transaction, in order: their claims in two
/// statements ([`Inbox::claim_batch`]), then each new one's effect, or its
/// dead letter, and one commit for all of them (one flush of the WAL
/// instead of one per record: what a consumer at volume needs).
/// Answers what each record came to, in order.
///
/// A record the handler refuses ([`HandlerError::Reject`]) is taken out: the
/// transaction rolls back and the batch is done again with that record
/// claimed and dead-lettered without its handler (so a handler's refusal
/// must not depend on the other records of the batch). A copy of a record
/// earlier in the same batch is a duplicate. `Err` when the batch must be
/// tried again (the database, a [`HandlerError::Retry`]): nothing of it was
/// committed.
pub async fn handle_batch(
    fx: &Effectively,
    inbox: &Inbox,
    handler: &Handler,
    records: &[Record],
) -> Result<Vec<Handled>, HandlerError> {
    let mut refused: Vec<Option<String>> = vec![None; records.len()];
    // The records that carry a usable id, as inbox messages.
    let messages: Vec<Result<Message, String>> = records
        .iter()
        .map(|r| Message::new(r.msg_id.as_str(), r.sent_at, &r.payload).map_err(|e| e.to_string()))
        .collect();
    let usable: Vec<Message> = messages
        .iter()
        .filter_map(|m| m.as_ref().ok().cloned())
        .collect();
    let mut conn = fx.pool().acquire().await?;
    'attempt: loop {
        let mut tx = conn.begin().await?;
        let mut claims = inbox.claim_batch(&mut tx, &usable).await?.into_iter();
        let mut handled = Vec::with_capacity(records.len());
        for (at, (record, message)) in records.iter().zip(&messages).enumerate() {
            let message = match message {
                Ok(m) => m,
                Err(why) => {
                    dead_letter(fx, &mut tx, inbox, record, None, why).await?;
                    handled.push(Handled::DeadLettered(why.clone()));
                    continue;
                }
            };
            let claim = claims.next().expect("claim_batch answers once per message");
            let why = match claim {
                InboxClaim::Duplicate => {
                    handled.push(Handled::Duplicate);
                    continue;
                }
                // Claimed and refused by the handler before: the claim
                // stays, with the dead letter.
                InboxClaim::New if refused[at].is_some() => refused[at].clone().unwrap_or_default(),
                InboxClaim::New => match handler(&mut tx, record).await {
                    Ok(()) => {
                        handled.push(Handled::Applied);
                        continue;
                    }
                    Err(HandlerError::Retry(why)) => return Err(HandlerError::Retry(why)),
                    Err(HandlerError::Reject(why)) => {
                        // Its statements may have half run: the whole
                        // transaction goes, and the batch again without it.
                        tx.rollback().await?;
                        refused[at] = Some(why);
                        continue 'attempt;
                    }
                },
                InboxClaim::Conflict => format!(
                    "msg_id {} was applied before with another payload",
                    record.msg_id
                ),
                InboxClaim::TooOld => format!(
                    "sent at {}, longer ago than the inbox keeps rows: whether it was applied cannot be told",
                    message.sent_at()
                ),
                // Nothing of the batch commits: it waits for its partition.
                InboxClaim::Early => {
                    return Err(HandlerError::Retry(format!(
                        "msg_id {} was minted at {}, at or after the end of the inbox's partitions \
                         made so far: waiting for Inbox::maintain to make its partition",
                        record.msg_id,
                        message.sent_at()
                    )));
                }
                InboxClaim::Unrecordable if message.uuid().is_none() => format!(
                    "msg_id {:?} is not a UUID, which a partitioned inbox needs",
                    record.msg_id
                ),
                InboxClaim::Unrecordable
                    if message.uuid().is_some_and(|u| u.get_version_num() != 7) =>
                {
                    format!(
                        "msg_id {} is not a UUIDv7 and lies past the inbox's partitions: \
                         none will ever be made for it",
                        record.msg_id
                    )
                }
                InboxClaim::Unrecordable => format!(
                    "msg_id {} was minted at {}, further ahead of the database's clock than the \
                     inbox's clock skew: a sender's clock far ahead, or a forged id; not applied \
                     (apply it by hand once checked)",
                    record.msg_id,
                    message.sent_at()
                ),
            };
            // A conflict's or a stale record's claim did not change the
            // inbox; a refused record's claim stays with its dead letter.
            dead_letter(fx, &mut tx, inbox, record, Some(message), &why).await?;
            handled.push(Handled::DeadLettered(why));
        }
        tx.commit().await?;
        return Ok(handled);
    }
}
