//! Publish and mark, the part both Kafka modes share: the producer, one
//! row produced and its outcome judged ([`Worker::publish`]), and a batch
//! ended by marking the acked rows published and recording the refused
//! ones in its transaction ([`Worker::mark_batch`]). The poll mode
//! ([`crate::poll`]) and the WAL mode ([`crate::wal`]) differ only in how
//! they find the rows and hold their order.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chrono::Utc;
use pipeline::contract::CrashPoint;
use pipeline::crash::Crasher;
use pipeline::envelope::{HEADER_EVENT_TYPE, HEADER_MSG_ID};
use pipeline::kafka::FatalState;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::util::Timeout;
use rdkafka::{ClientConfig, ClientContext};
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::Semaphore;

use crate::config::Config;
use crate::metrics::RelayMetrics;
use crate::outbox::{self, PendingRow};

/// The producer's callbacks: a fatal client error ends the relay with an
/// error (see [`FatalState`]); the rows in flight stay unmarked and the next
/// life publishes them.
#[derive(Clone, Default)]
pub struct RelayContext {
    /// Fired by a fatal producer error.
    pub fatal: FatalState,
}

impl ClientContext for RelayContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.fatal.on_error("producer", error, reason);
    }
}

/// The relay's producer type.
pub type RelayProducer = FutureProducer<RelayContext>;

/// Builds the idempotent, acks=all producer: every send waits for
/// `min.insync.replicas` of the partition's replicas (2 of 3 on the stack),
/// at most 5 requests in flight per broker (the most idempotence keeps in
/// order across retries), and a send gives up after `--message-timeout-ms`,
/// a term of the consumers' redelivery horizon. It never creates its topic
/// (librdkafka's producer would by default, with the broker's default
/// partition count and configs): a missing topic is an operator's mistake,
/// so its sends fail, the rows stay pending and the error is logged.
///
/// `max_message_bytes` (the topic's `max.message.bytes`) becomes the
/// producer's `message.max.bytes`, so that librdkafka refuses a row over
/// the topic's limit itself, alone, and keeps its batches under it: the
/// broker refuses a whole batch that is over the limit, every row in it.
pub fn producer(
    config: &Config,
    context: RelayContext,
    max_message_bytes: usize,
) -> anyhow::Result<RelayProducer> {
    ClientConfig::new()
        .set("message.max.bytes", max_message_bytes.to_string())
        .set("bootstrap.servers", &config.kafka.kafka_bootstrap_servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("linger.ms", config.linger_ms.to_string())
        .set("message.timeout.ms", config.message_timeout_ms.to_string())
        .set("queue.buffering.max.messages", "1000000")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4")
        .set("allow.auto.create.topics", "false")
        .create_with_context(context)
        .context("create kafka producer")
}

/// What the shard loops share: the clients, the settings, and the permits
/// that bound the shard transactions open at once (`--workers`).
pub struct Worker {
    pub(crate) pool: PgPool,
    pub(crate) producer: RelayProducer,
    pub(crate) topic: String,
    pub(crate) batch_size: i64,
    pub(crate) max_attempts: i32,
    /// The topic's `max.message.bytes`: a row larger than this is refused
    /// for itself; a smaller one refused as too large was refused for its
    /// batch (see [`Worker::publish`]).
    pub(crate) max_message_bytes: usize,
    pub(crate) metrics: Arc<RelayMetrics>,
    pub(crate) crasher: Arc<Crasher>,
    pub(crate) permits: Semaphore,
}

/// How publishing one row ended.
/// The stage of a batch's transaction that failed. A batch's rows stay
/// pending whatever the stage (its transaction rolls back), and the stage
/// names the error in the log and in `relay_errors_total{stage}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Beginning the transaction, locking the shard, claiming its rows.
    Claim,
    /// Marking the acked rows published and recording the refused ones.
    Mark,
    /// Committing the marks.
    Commit,
}

impl Stage {
    /// The stage's label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Mark => "mark",
            Self::Commit => "commit",
        }
    }
}

/// A batch's database error, with the stage it failed in.
#[derive(Debug, thiserror::Error)]
#[error("{} ({}): {source}", .stage.as_str(), .what)]
pub struct BatchError {
    /// Where it failed.
    pub stage: Stage,
    /// The statement that failed, for the log.
    pub what: &'static str,
    /// The database's error.
    #[source]
    pub source: sqlx::Error,
}

impl BatchError {
    /// A `map_err` for an error of `what` in `stage`.
    pub fn at(stage: Stage, what: &'static str) -> impl FnOnce(sqlx::Error) -> Self {
        move |source| Self {
            stage,
            what,
            source,
        }
    }
}

#[derive(Debug)]
pub enum Publish {
    /// The broker acked it.
    Delivered,
    /// The broker or the network failed; the row is retried, uncounted.
    Retry,
    /// The row itself cannot be published (the error says why); the attempt
    /// counts against `--max-attempts`.
    Rejected(String),
}

/// What a batch's commit changed: the WAL relay compares it with what it
/// meant to mark ([`crate::wal`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Marked {
    /// Rows this commit marked published: for [`Marks::Rows`], those its
    /// `UPDATE` changed (a row it could not see, or one already published,
    /// is not among them); for [`Marks::Claimed`], the delivered ones.
    pub(crate) published: u64,
    /// Rows this commit marked failed.
    pub(crate) failed: u64,
}

/// How a batch's delivered rows are marked published.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Marks<'a> {
    /// By this commit: mark these rows (the WAL relay's, read from the
    /// stream).
    Rows(&'a [i64]),
    /// By the claim, which marked every row it took (`outbox::claim`):
    /// `delivered` of them were acked; `undelivered` (the broker failed)
    /// are put back to pending. The rejected ones are unmarked by their
    /// failure's record.
    Claimed {
        delivered: usize,
        undelivered: &'a [i64],
    },
}

impl Worker {
    /// After the broker's acks: marks the delivered rows published (or puts
    /// back the claimed rows that were not, [`Marks`]) and records
    /// `rejected` (each row's own failure; marked failed at its
    /// `max_attempts`th), then commits `tx`. Both relay modes end a batch
    /// here.
    pub(crate) async fn mark_batch(
        &self,
        mut tx: Transaction<'_, Postgres>,
        marks: Marks<'_>,
        rejected: &[(i64, String)],
        max_attempts: i32,
    ) -> Result<Marked, BatchError> {
        // The broker has acked; the marks are not committed. A crash here
        // re-publishes the rows on restart: the at-least-once window.
        self.crasher.point(CrashPoint::Publish);
        let (delivered, published) = match marks {
            Marks::Rows(ids) => {
                let published = outbox::mark_published(&mut tx, ids)
                    .await
                    .map_err(BatchError::at(Stage::Mark, "mark published"))?;
                (ids.len(), published)
            }
            Marks::Claimed {
                delivered,
                undelivered,
            } => {
                if !undelivered.is_empty() {
                    outbox::release(&mut tx, undelivered)
                        .await
                        .map_err(BatchError::at(Stage::Mark, "put back undelivered rows"))?;
                }
                (delivered, delivered as u64)
            }
        };
        let failed = if rejected.is_empty() {
            0
        } else {
            outbox::record_failures(&mut tx, rejected, max_attempts)
                .await
                .map_err(BatchError::at(
                    Stage::Mark,
                    "record failed publish attempts",
                ))?
        };
        tx.commit()
            .await
            .map_err(BatchError::at(Stage::Commit, "commit published batch"))?;
        if failed > 0 {
            tracing::error!(
                failed,
                max_attempts,
                "outbox rows marked failed: they will not be published (see orders.outbox.last_error); \
                 later events of their keys are held back"
            );
        }
        self.metrics.relay_rows_failed_total.inc_by(failed);
        self.metrics.relay_published_total.inc_by(delivered as u64);
        self.metrics.relay_batch_size.observe(delivered as f64);
        Ok(Marked { published, failed })
    }

    /// Produces one row.
    pub(crate) async fn publish(&self, row: &PendingRow) -> Publish {
        let value = match row.encode() {
            Ok(value) => value,
            Err(error) => {
                self.metrics
                    .relay_errors_total
                    .with_label_values(&["encode"])
                    .inc();
                tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, attempts = row.attempts + 1, %error, "outbox payload is not JSON");
                return Publish::Rejected(format!("payload is not JSON: {error}"));
            }
        };
        let key = row.aggregate_id.to_string();
        let msg_id = row.msg_id.to_string();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: HEADER_MSG_ID,
                value: Some(msg_id.as_bytes()),
            })
            .insert(Header {
                key: HEADER_EVENT_TYPE,
                value: Some(row.event_type.as_bytes()),
            });
        let record = FutureRecord::to(&self.topic)
            .key(&key)
            .payload(&value)
            .headers(headers);
        match self
            .producer
            .send(record, Timeout::After(Duration::from_secs(10)))
            .await
        {
            Ok(_) => {
                let age = (Utc::now() - row.created_at)
                    .num_microseconds()
                    .unwrap_or(0) as f64
                    / 1e6;
                self.metrics
                    .relay_commit_to_publish_seconds
                    .observe(age.max(0.0));
                Publish::Delivered
            }
            Err((error, _))
                if error.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge)
                    && record_bytes(&key, &value, &msg_id, &row.event_type)
                        <= self.max_message_bytes =>
            {
                // The broker refused the batch this row was in, over the
                // topic's limit because of another row: this row is fine
                // and goes again, in another batch.
                self.metrics
                    .relay_errors_total
                    .with_label_values(&["produce"])
                    .inc();
                tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, bytes = value.len(), %error, "refused with a batch over the topic's limit; the row itself is under it and stays pending");
                Publish::Retry
            }
            Err((error, _))
                if error.rdkafka_error_code() == Some(RDKafkaErrorCode::InvalidTimestamp) =>
            {
                // The broker refused the timestamp this host's clock put on
                // the record (a CreateTime topic, a clock past the topic's
                // message.timestamp.after/before.max.ms). Not the row's
                // fault, so not counted against --max-attempts: the row stays
                // pending and goes once the clock is right, but every row
                // would be refused meanwhile, so it is an error of its own.
                self.metrics
                    .relay_errors_total
                    .with_label_values(&["invalid_timestamp"])
                    .inc();
                tracing::error!(
                    outbox_id = row.id,
                    msg_id = %row.msg_id,
                    %error,
                    "the broker refused the record's timestamp (INVALID_TIMESTAMP): this host's clock \
                     is off from the brokers' by more than the topic allows \
                     (message.timestamp.after.max.ms, 1 h by default). Publishing is stopped until \
                     the host's time synchronisation is fixed or the topic lets the brokers stamp \
                     records (message.timestamp.type=LogAppendTime); the row stays pending"
                );
                Publish::Retry
            }
            Err((error, _)) if pipeline::kafka::rejects_the_record(&error) => {
                self.metrics
                    .relay_errors_total
                    .with_label_values(&["rejected"])
                    .inc();
                tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, attempts = row.attempts + 1, bytes = value.len(), %error, "the row cannot be published");
                Publish::Rejected(format!("{error} ({} bytes)", value.len()))
            }
            Err((error, _)) => {
                self.metrics
                    .relay_errors_total
                    .with_label_values(&["produce"])
                    .inc();
                tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, %error, "publish failed; row stays pending");
                Publish::Retry
            }
        }
    }
}

/// Kafka's default `max.message.bytes`, taken when the topic's cannot be read.
const KAFKA_DEFAULT_MAX_MESSAGE_BYTES: usize = 1_048_588;

/// What a record adds to its key, value and headers in a batch (lengths,
/// attributes, offsets and timestamps as varints, the batch header), at most.
const RECORD_OVERHEAD_BYTES: usize = 128;

/// A record's size in a batch, at most.
fn record_bytes(key: &str, value: &[u8], msg_id: &str, event_type: &str) -> usize {
    key.len()
        + value.len()
        + HEADER_MSG_ID.len()
        + msg_id.len()
        + HEADER_EVENT_TYPE.len()
        + event_type.len()
        + RECORD_OVERHEAD_BYTES
}

/// The topic's `max.message.bytes`, read from the broker at start-up;
/// Kafka's default when it cannot be read (a topic not created yet: its
/// sends fail until it is, see [`producer`]).
pub(crate) async fn topic_max_message_bytes(kafka: &pipeline::config::KafkaArgs) -> usize {
    const KEY: &str = "max.message.bytes";
    match pipeline::kafka::topic_configs(&kafka.kafka_bootstrap_servers, &kafka.kafka_topic, &[KEY])
        .await
        .map(|configs| configs.get(KEY).and_then(|v| v.parse::<usize>().ok()))
    {
        Ok(Some(bytes)) => {
            tracing::info!(bytes, topic = %kafka.kafka_topic, "the topic's max.message.bytes");
            bytes
        }
        Ok(None) => KAFKA_DEFAULT_MAX_MESSAGE_BYTES,
        Err(error) => {
            tracing::warn!(%error, topic = %kafka.kafka_topic, default = KAFKA_DEFAULT_MAX_MESSAGE_BYTES, "could not read the topic's max.message.bytes; using Kafka's default");
            KAFKA_DEFAULT_MAX_MESSAGE_BYTES
        }
    }
}
