//! [`KafkaSink`]: the relay's rows produced to Kafka (feature `kafka`).

use std::time::{Duration, Instant};

use futures::future::join_all;

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;

use super::relay::{Outgoing, SendError, Sink, one_at_a_time};
use super::{HEADER_EVENT_TYPE, HEADER_MSG_ID};

/// The header that carries a row's content type.
pub const HEADER_CONTENT_TYPE: &str = "content-type";

/// Produces each row to the topic its destination names, keyed by its key
/// (one key, one partition, in order), with headers `msg_id`, `event_type`,
/// `content-type` and the row's own. A send returns once the broker acked
/// the record: with `acks=all` and idempotence, both of which
/// [`KafkaSink::new`] sets unless the configuration says otherwise.
pub struct KafkaSink {
    producer: FutureProducer,
    queue_timeout: Duration,
    /// `enable.idempotence=true`: a key's sends keep their order in flight.
    idempotent: bool,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink").finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// A producer from the user's client configuration (`bootstrap.servers`,
    /// TLS, SASL, whatever it needs), with `enable.idempotence=true`,
    /// `acks=all` and `allow.auto.create.topics=false` added where it does
    /// not set them.
    pub fn new(config: &ClientConfig) -> KafkaResult<Self> {
        let mut config = config.clone();
        for (key, value) in [
            ("enable.idempotence", "true"),
            ("acks", "all"),
            ("allow.auto.create.topics", "false"),
        ] {
            if config.get(key).is_none() {
                config.set(key, value);
            }
        }
        Ok(Self {
            producer: config.create()?,
            queue_timeout: Duration::from_secs(10),
            idempotent: config.get("enable.idempotence") == Some("true"),
        })
    }

    /// The producer, to flush or inspect.
    pub fn producer(&self) -> &FutureProducer {
        &self.producer
    }
}

impl Sink for KafkaSink {
    async fn send(&self, row: &Outgoing) -> Result<(), SendError> {
        self.produce(&[row])
            .await
            .pop()
            .unwrap_or_else(|| Err(SendError::Retry("not sent".to_owned())))
    }

    /// Every row of the key in flight at once: each is queued in the
    /// producer in id order (waiting, in order, while its queue is full),
    /// then every delivery is awaited. The idempotent producer keeps them
    /// in that order on the key's partition, retries included. A row the
    /// producer refuses before sending it (over `message.max.bytes`) stops
    /// the key there: the rows after it are not sent. One the broker
    /// refuses (over the topic's `max.message.bytes`) may have later rows
    /// delivered anyway (the relay counts them, [`super::RelayStats::reordered`]).
    ///
    /// With `enable.idempotence=false` in the configuration the producer
    /// may reorder a retried send, so the rows go one at a time.
    async fn send_in_order(&self, rows: &[&Outgoing]) -> Vec<Result<(), SendError>> {
        if self.idempotent {
            self.produce(rows).await
        } else {
            one_at_a_time(self, rows).await
        }
    }
}

impl KafkaSink {
    /// `rows` queued in order, then their deliveries awaited.
    async fn produce(&self, rows: &[&Outgoing]) -> Vec<Result<(), SendError>> {
        let msg_ids: Vec<String> = rows.iter().map(|row| row.msg_id.to_string()).collect();
        let mut deliveries = Vec::with_capacity(rows.len());
        let mut refused = None;
        for (row, msg_id) in rows.iter().zip(&msg_ids) {
            let mut record = record(row, msg_id);
            let give_up = Instant::now() + self.queue_timeout;
            loop {
                match self.producer.send_result(record) {
                    Ok(delivery) => {
                        deliveries.push(delivery);
                        break;
                    }
                    Err((error, again))
                        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull)
                            && Instant::now() < give_up =>
                    {
                        record = again;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err((error, _)) => {
                        refused = Some(judge(&error, row));
                        break;
                    }
                }
            }
            if refused.is_some() {
                break;
            }
        }
        let mut answers: Vec<Result<(), SendError>> = join_all(deliveries)
            .await
            .into_iter()
            .zip(rows)
            .map(|(delivery, row)| match delivery {
                Ok(Ok(_)) => Ok(()),
                Ok(Err((error, _))) => Err(judge(&error, row)),
                Err(_canceled) => Err(SendError::Retry("the producer was dropped".to_owned())),
            })
            .collect();
        answers.extend(refused.map(Err));
        answers
    }
}

/// A row as a Kafka record: to its destination's topic, under its key, with
/// the headers `msg_id`, `event_type`, `content-type` and its own.
fn record<'a>(row: &'a Outgoing, msg_id: &'a str) -> FutureRecord<'a, str, [u8]> {
    let mut headers = OwnedHeaders::new_with_capacity(3 + row.headers.len())
        .insert(Header {
            key: HEADER_MSG_ID,
            value: Some(msg_id.as_bytes()),
        })
        .insert(Header {
            key: HEADER_EVENT_TYPE,
            value: Some(row.event_type.as_bytes()),
        })
        .insert(Header {
            key: HEADER_CONTENT_TYPE,
            value: Some(row.content_type.as_bytes()),
        });
    for (name, value) in &row.headers {
        headers = headers.insert(Header {
            key: name,
            value: Some(value.as_bytes()),
        });
    }
    FutureRecord::to(&row.destination)
        .key(row.key.as_str())
        .payload(row.payload.as_slice())
        .headers(headers)
}

/// A produce error as the relay takes it: refused for the record itself,
/// or to be tried again.
fn judge(error: &KafkaError, row: &Outgoing) -> SendError {
    if rejects_the_record(error) {
        SendError::Reject(format!("{error} ({} bytes)", row.payload.len()))
    } else {
        SendError::Retry(error.to_string())
    }
}

/// Whether a produce error is about the record itself (the same record
/// fails again, whatever the brokers' health: over the size limit, or not a
/// valid record) rather than the brokers. `UNKNOWN_TOPIC_OR_PART` is not
/// one: a topic may be created later.
pub fn rejects_the_record(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidMessage
                | RDKafkaErrorCode::InvalidRecord
        )
    )
}
