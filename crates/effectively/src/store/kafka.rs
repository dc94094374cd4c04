//! [`KafkaSink`]: the relay's rows produced to Kafka (feature `kafka`).

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::util::Timeout;

use super::relay::{Outgoing, SendError, Sink};
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
        })
    }

    /// The producer, to flush or inspect.
    pub fn producer(&self) -> &FutureProducer {
        &self.producer
    }
}

impl Sink for KafkaSink {
    async fn send(&self, row: &Outgoing) -> Result<(), SendError> {
        let msg_id = row.msg_id.to_string();
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
        let record = FutureRecord::to(&row.destination)
            .key(&row.key)
            .payload(&row.payload)
            .headers(headers);
        match self
            .producer
            .send(record, Timeout::After(self.queue_timeout))
            .await
        {
            Ok(_) => Ok(()),
            Err((error, _)) if rejects_the_record(&error) => Err(SendError::Reject(format!(
                "{error} ({} bytes)",
                row.payload.len()
            ))),
            Err((error, _)) => Err(SendError::Retry(error.to_string())),
        }
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
