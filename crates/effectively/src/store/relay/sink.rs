//! Where a relay sends rows: the [`Sink`] a user implements, the
//! [`Outgoing`] row it gets and the [`SendError`] it answers with.

use std::future::Future;

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// An outbox row as a [`Sink`] gets it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Outgoing {
    /// The row's id (its place in the publish order).
    pub id: i64,
    /// The id every consumer deduplicates it by.
    pub msg_id: Uuid,
    /// Where it goes: a topic, a webhook destination's name.
    pub destination: String,
    /// Its key (a Kafka message key).
    pub key: String,
    /// Its type.
    pub event_type: String,
    /// Its payload.
    pub payload: Vec<u8>,
    /// The payload's media type.
    pub content_type: String,
    /// Its headers, in order.
    #[sqlx(json)]
    pub headers: Vec<(String, String)>,
    /// When its transaction wrote it.
    pub created_at: DateTime<Utc>,
}

/// Why a send did not deliver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// Not now (the broker or the receiver is away, a timeout): the row
    /// stays pending and is sent again.
    #[error("try again: {0}")]
    Retry(String),
    /// Never: the row itself is refused (too large, a destination that does
    /// not exist, a receiver's 4xx). It is marked failed with the reason,
    /// and its key's later rows are held back.
    #[error("refused: {0}")]
    Reject(String),
}

/// Where a relay sends rows. A send returns once the destination has the
/// row durably (a Kafka ack with `acks=all`, a webhook's 2xx); the relay
/// then marks it published.
pub trait Sink: Send + Sync + 'static {
    /// Sends one row.
    fn send(&self, row: &Outgoing) -> impl Future<Output = Result<(), SendError>> + Send;

    /// Sends one key's rows of a pass, in id order, and answers for each
    /// row it sent, in that order; the rows after its answers were not
    /// sent and stay pending.
    ///
    /// By default one row at a time, each once the last was delivered,
    /// stopping at the first that was not: the key's rows reach the
    /// destination in order whatever fails. A sink that keeps the order of
    /// a key's sends while several are in flight (Kafka's idempotent
    /// producer: a key's partition, a sequence number per partition, the
    /// sends retried in order) may put them all in flight at once, which
    /// takes one round trip for the key instead of one per row. Then a row
    /// after one that failed may have been delivered anyway: the sink
    /// answers for it too, and the relay marks it published (counted in
    /// [`RelayStats::reordered`]).
    ///
    /// [`RelayStats::reordered`]: super::RelayStats::reordered
    fn send_in_order(
        &self,
        rows: &[&Outgoing],
    ) -> impl Future<Output = Vec<Result<(), SendError>>> + Send {
        one_at_a_time(self, rows)
    }
}

/// [`Sink::send_in_order`]'s default: each row once the last was
/// delivered, stopping at the first that was not.
pub(crate) async fn one_at_a_time<S: Sink + ?Sized>(
    sink: &S,
    rows: &[&Outgoing],
) -> Vec<Result<(), SendError>> {
    let mut answers = Vec::with_capacity(rows.len());
    for row in rows {
        let answer = sink.send(row).await;
        let stop = answer.is_err();
        answers.push(answer);
        if stop {
            break;
        }
    }
    answers
}
