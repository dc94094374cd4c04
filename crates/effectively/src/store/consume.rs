//! [`consume`]: a Kafka consumer loop over an [`Inbox`] (feature `kafka`):
//! each record's effect and its inbox claim in one transaction, its offset
//! committed only after that transaction.

use chrono::{DateTime, Utc};
use rdkafka::Message as _;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers};
use tokio_util::sync::CancellationToken;

use super::Effectively;
use super::HEADER_MSG_ID;
use super::handle::{Handler, Record, handle};
use super::inbox::Inbox;
use crate::retry::Backoff;

/// A record read from Kafka as the handler gets it: its `msg_id` header
/// (UTF-8; empty when missing, which dead-letters it) and its timestamp
/// (now, when it has none).
pub fn record_of(message: &BorrowedMessage<'_>) -> Record {
    let headers: Vec<(String, Vec<u8>)> = message
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                .collect()
        })
        .unwrap_or_default();
    let msg_id = headers
        .iter()
        .find(|(n, _)| n == HEADER_MSG_ID)
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
        .unwrap_or_default()
        .to_owned();
    let sent_at = message
        .timestamp()
        .to_millis()
        .and_then(DateTime::from_timestamp_millis)
        .unwrap_or_else(Utc::now);
    Record {
        source: format!(
            "{}/{}/{}",
            message.topic(),
            message.partition(),
            message.offset()
        ),
        key: message.key().map(<[u8]>::to_vec),
        payload: message.payload().unwrap_or_default().to_vec(),
        headers,
        msg_id,
        sent_at,
    }
}

/// Consumes `consumer`'s subscription until `cancel` fires: each record
/// [`handle`]d (its effect and claim in one transaction, or a dead letter),
/// then its offset committed; a record to try again is tried again after a
/// backoff (50 ms doubling to 5 s) before anything after it. The offset of
/// a record is committed only after its transaction: a crash in between
/// hands it over again, and the inbox makes it a duplicate.
///
/// `consumer` is the user's (its group, its security settings); it must be
/// made with `enable.auto.commit=false`, and is subscribed already.
pub async fn consume(
    fx: &Effectively,
    inbox: &Inbox,
    consumer: &StreamConsumer,
    handler: &Handler,
    cancel: &CancellationToken,
) -> Result<(), rdkafka::error::KafkaError> {
    let mut backoff = Backoff::new();
    loop {
        let message = tokio::select! {
            () = cancel.cancelled() => return Ok(()),
            m = consumer.recv() => m,
        };
        let message = match message {
            Ok(m) => m,
            Err(error) => {
                tracing::warn!(%error, "receive");
                if !backoff.wait(cancel).await {
                    return Ok(());
                }
                continue;
            }
        };
        let record = record_of(&message);
        loop {
            match handle(fx, inbox, handler, &record).await {
                Ok(_) => break,
                Err(error) => {
                    tracing::warn!(source = %record.source, %error, "record not applied; trying again");
                    if !backoff.wait(cancel).await {
                        return Ok(());
                    }
                }
            }
        }
        backoff.reset();
        if let Err(error) = consumer.commit_message(&message, CommitMode::Async) {
            // The next commit covers it; a crash meanwhile hands it over again.
            tracing::debug!(%error, "commit offset");
        }
    }
}
