//! [`KafkaSink`]: the relay's rows produced to Kafka (feature `kafka`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;

use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, ClientContext};

use super::relay::{Outgoing, SendError, Sink, one_at_a_time};
use super::{HEADER_EVENT_TYPE, HEADER_MSG_ID};

/// The header that carries a row's content type.
pub const HEADER_CONTENT_TYPE: &str = "content-type";

/// Produces each row to the topic its destination names, keyed by its key
/// (one key, one partition, in order), with headers `msg_id`, `event_type`,
/// `content-type` and the row's own. A send returns once the broker acked
/// the record: with `acks=all` and idempotence, both of which
/// [`KafkaSink::new`] sets unless the configuration says otherwise.
pub struct KafkaSink<C: ClientContext + 'static = DefaultClientContext> {
    producer: FutureProducer<C>,
    queue_timeout: Duration,
    /// `enable.idempotence=true`: a key's sends keep their order in flight.
    idempotent: bool,
    /// [`KafkaSink::batch_refusals_under`].
    batch_limit: Option<usize>,
    /// [`KafkaSink::on_error`].
    on_error: Option<Arc<ErrorObserver>>,
}

/// What [`KafkaSink::on_error`] takes.
type ErrorObserver = dyn Fn(&KafkaError, &Outgoing, &SendError) + Send + Sync;

impl<C: ClientContext + 'static> std::fmt::Debug for KafkaSink<C> {
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
        Self::with_context(config, DefaultClientContext)
    }
}

impl<C: ClientContext + 'static> KafkaSink<C> {
    /// [`KafkaSink::new`] with the producer's callbacks in `context` (its
    /// errors and statistics, as rdkafka's [`ClientContext`] takes them).
    pub fn with_context(config: &ClientConfig, context: C) -> KafkaResult<Self> {
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
            producer: config.create_with_context(context)?,
            queue_timeout: Duration::from_secs(10),
            idempotent: config.get("enable.idempotence") == Some("true"),
            batch_limit: None,
            on_error: None,
        })
    }

    /// Calls `observe` with each produce error, the row it was for, and
    /// how the sink took it (to be tried again, or refused for the row
    /// itself): for metrics and logs by the error's kind.
    pub fn on_error(
        self,
        observe: impl Fn(&KafkaError, &Outgoing, &SendError) + Send + Sync + 'static,
    ) -> Self {
        Self {
            on_error: Some(Arc::new(observe)),
            ..self
        }
    }

    /// The topics' `max.message.bytes`, when the sink should tell a record
    /// refused for itself from one refused for its batch: the broker
    /// refuses a whole batch over the topic's limit, every record in it
    /// (`MSG_SIZE_TOO_LARGE`), so a record of at most `bytes` (key, value
    /// and headers, with a record's overhead) refused so is sent again, in
    /// another batch, instead of refused for good. Without it, every
    /// record refused as too large is refused for good. Set the
    /// producer's `message.max.bytes` to the same limit, so that it keeps
    /// its batches under it.
    pub fn batch_refusals_under(self, bytes: usize) -> Self {
        Self {
            batch_limit: Some(bytes),
            ..self
        }
    }

    /// The producer, to flush or inspect.
    pub fn producer(&self) -> &FutureProducer<C> {
        &self.producer
    }
}

impl<C: ClientContext + 'static> Sink for KafkaSink<C> {
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

impl<C: ClientContext + 'static> KafkaSink<C> {
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
                        // Refused before it was sent: for itself.
                        refused = Some(self.judged(&error, row, None));
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
                Ok(Err((error, _))) => Err(self.judged(&error, row, self.batch_limit)),
                Err(_canceled) => Err(SendError::Retry("the producer was dropped".to_owned())),
            })
            .collect();
        answers.extend(refused.map(Err));
        answers
    }

    /// [`judge`], told to the error observer.
    fn judged(&self, error: &KafkaError, row: &Outgoing, batch_limit: Option<usize>) -> SendError {
        let judged = judge(error, row, batch_limit);
        if let Some(observe) = &self.on_error {
            observe(error, row, &judged);
        }
        judged
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

/// What a record adds to its key, value and headers in a batch (lengths,
/// attributes, offsets and timestamps as varints, the batch header), at most.
const RECORD_OVERHEAD_BYTES: usize = 128;

/// A row's record's size in a batch, at most.
fn record_bytes(row: &Outgoing) -> usize {
    let headers: usize = row.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
    row.key.len()
        + row.payload.len()
        + HEADER_MSG_ID.len()
        + 36
        + HEADER_EVENT_TYPE.len()
        + row.event_type.len()
        + HEADER_CONTENT_TYPE.len()
        + row.content_type.len()
        + headers
        + RECORD_OVERHEAD_BYTES
}

/// A produce error as the relay takes it: refused for the record itself,
/// or to be tried again. `batch_limit`: the broker's answer to a batch
/// ([`KafkaSink::batch_refusals_under`]), for a record sent.
fn judge(error: &KafkaError, row: &Outgoing, batch_limit: Option<usize>) -> SendError {
    let for_its_batch = error.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge)
        && batch_limit.is_some_and(|limit| record_bytes(row) <= limit);
    if for_its_batch {
        SendError::Retry(format!(
            "{error}: refused with a batch over the topic's limit; the record itself ({} bytes) is under it",
            record_bytes(row)
        ))
    } else if rejects_the_record(error) {
        SendError::Reject(format!("{error} ({} bytes)", row.payload.len()))
    } else {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::InvalidTimestamp) {
            tracing::error!(
                msg_id = %row.msg_id,
                %error,
                "the broker refused the record's timestamp (INVALID_TIMESTAMP): this host's clock \
                 is off from the brokers' by more than the topic allows \
                 (message.timestamp.after.max.ms, 1 h by default); every record is refused until \
                 the clock is fixed or the topic lets the brokers stamp records \
                 (message.timestamp.type=LogAppendTime). The row stays pending"
            );
        }
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
