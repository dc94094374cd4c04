//! [`consume`]: a Kafka consumer loop over an [`Inbox`] (feature `kafka`):
//! each record's effect and its inbox claim in one transaction, its offset
//! committed only after that transaction.

use chrono::{DateTime, Utc};
use futures::FutureExt;
use rdkafka::Message as _;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers};
use tokio_util::sync::CancellationToken;

use super::Effectively;
use super::handle::{Handler, Record, handle_batch};
use super::inbox::Inbox;
use super::{HEADER_MSG_ID, HEADER_ROUTER_ID};
use crate::retry::Backoff;

/// A record read from Kafka as the handler gets it: its message id from its
/// headers ([`msg_id_of`]) and its timestamp (now, when it has none).
pub fn record_of(message: &BorrowedMessage<'_>) -> Record {
    let headers: Vec<(String, Vec<u8>)> = message
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                .collect()
        })
        .unwrap_or_default();
    let msg_id = msg_id_of(&headers);
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

/// A record's message id: its [`HEADER_MSG_ID`] header (the library's
/// relay's), else its [`HEADER_ROUTER_ID`] header (Debezium's Outbox Event
/// Router's), as UTF-8; empty when it has neither, which dead-letters it.
pub fn msg_id_of(headers: &[(String, Vec<u8>)]) -> String {
    let first = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v);
    first(HEADER_MSG_ID)
        .or_else(|| first(HEADER_ROUTER_ID))
        .and_then(|v| std::str::from_utf8(v).ok())
        .unwrap_or_default()
        .to_owned()
}

/// The most records [`consume`] handles in one transaction.
pub const DEFAULT_BATCH: usize = 256;

/// Consumes `consumer`'s subscription until `cancel` fires, in batches of up
/// to [`DEFAULT_BATCH`] records: [`consume_batches`] with that bound.
pub async fn consume(
    fx: &Effectively,
    inbox: &Inbox,
    consumer: &StreamConsumer,
    handler: &Handler,
    cancel: &CancellationToken,
) -> Result<(), rdkafka::error::KafkaError> {
    consume_batches(fx, inbox, consumer, handler, DEFAULT_BATCH, cancel).await
}

/// Consumes `consumer`'s subscription until `cancel` fires: the records
/// that have arrived (the first waited for, then up to `batch` in all of
/// those already received, never waiting for more) are handled in one
/// transaction ([`handle_batch`]: each effect with its claim, or a dead
/// letter), then each partition's offset is committed past them; a batch
/// to try again is tried again after a backoff (50 ms doubling to 5 s)
/// before anything after it. Offsets are committed only after the
/// transaction: a crash in between hands the records over again, and the
/// inbox makes them duplicates. `batch` 1 is a transaction per record.
///
/// `consumer` is the user's (its group, its security settings); it must be
/// made with `enable.auto.commit=false`, and is subscribed already.
pub async fn consume_batches(
    fx: &Effectively,
    inbox: &Inbox,
    consumer: &StreamConsumer,
    handler: &Handler,
    batch: usize,
    cancel: &CancellationToken,
) -> Result<(), rdkafka::error::KafkaError> {
    let batch = batch.max(1);
    let mut backoff = Backoff::new();
    loop {
        let first = tokio::select! {
            () = cancel.cancelled() => return Ok(()),
            m = consumer.recv() => m,
        };
        let first = match first {
            Ok(m) => m,
            Err(error) => {
                tracing::warn!(%error, "receive");
                if !backoff.wait(cancel).await {
                    return Ok(());
                }
                continue;
            }
        };
        let mut messages = vec![first];
        while messages.len() < batch {
            // What has arrived already, without waiting.
            match consumer.recv().now_or_never() {
                Some(Ok(m)) => messages.push(m),
                Some(Err(error)) => {
                    tracing::debug!(%error, "receive");
                    break;
                }
                None => break,
            }
        }
        let records: Vec<Record> = messages.iter().map(record_of).collect();
        loop {
            match handle_batch(fx, inbox, handler, &records).await {
                Ok(_) => break,
                Err(error) => {
                    tracing::warn!(records = records.len(), first = %records[0].source, %error, "batch not applied; trying again");
                    if !backoff.wait(cancel).await {
                        return Ok(());
                    }
                }
            }
        }
        backoff.reset();
        // Each partition's last record: committing it commits the ones
        // before it.
        let mut last: Vec<&BorrowedMessage<'_>> = Vec::new();
        for m in messages.iter().rev() {
            if !last
                .iter()
                .any(|l| l.topic() == m.topic() && l.partition() == m.partition())
            {
                last.push(m);
            }
        }
        for m in last {
            if let Err(error) = consumer.commit_message(m, CommitMode::Async) {
                // The next commit covers it; a crash meanwhile hands it over again.
                tracing::debug!(%error, "commit offset");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn the_msg_id_header_first_then_the_outbox_routers_id() {
        assert_eq!(msg_id_of(&headers(&[("msg_id", "a"), ("id", "b")])), "a");
        assert_eq!(msg_id_of(&headers(&[("id", "b"), ("msg_id", "a")])), "a");
        assert_eq!(
            msg_id_of(&headers(&[("event_type", "x"), ("id", "b")])),
            "b"
        );
        assert_eq!(msg_id_of(&headers(&[("event_type", "x")])), "");
        let not_utf8 = vec![("msg_id".to_owned(), vec![0xff])];
        assert_eq!(msg_id_of(&not_utf8), "");
    }
}
