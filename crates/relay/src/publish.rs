//! What both Kafka modes share: the producer and the library relay over
//! `orders.outbox` ([`Worker`]). The poll mode is that relay's own loop
//! ([`effectively::store::Relay::run`]); the WAL mode ([`crate::wal`])
//! drains the rows from before its slot with the relay's passes, produces
//! the stream's rows one by one through the relay's sink
//! ([`Worker::publish`]) and marks them itself ([`Worker::mark_batch`]).

use std::sync::Arc;

use anyhow::Context;

use effectively::store::{KafkaSink, Outgoing, Relay, SendError, Sink};
use pipeline::contract::CrashPoint;
use pipeline::crash::Crasher;
use pipeline::kafka::FatalState;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, ClientContext};
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::Semaphore;

use crate::config::Config;
use crate::engine::{EventSink, OrdersOutbox};
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

/// The idempotent, acks=all producer's settings: every send waits for
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
/// broker refuses a whole batch that is over the limit, every row in it
/// (the sink sends a row refused so again: `KafkaSink::batch_refusals_under`).
///
/// It starts from the client config file (`--kafka-client-config`: TLS,
/// SASL), whose properties these override.
///
/// # Errors
/// When the client config file is refused ([`pipeline::kafka::ClientProperties::load`]).
pub fn producer_config(config: &Config, max_message_bytes: usize) -> anyhow::Result<ClientConfig> {
    let mut client = config.kafka.client_config()?;
    client
        .set("message.max.bytes", max_message_bytes.to_string())
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("linger.ms", config.linger_ms.to_string())
        .set("message.timeout.ms", config.message_timeout_ms.to_string())
        .set("queue.buffering.max.messages", "1000000")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4")
        .set("allow.auto.create.topics", "false");
    Ok(client)
}

/// The relay's sink: [`producer_config`]'s producer with `context`, the
/// rows in their envelopes, counted in `metrics`.
pub fn sink(
    config: &Config,
    context: RelayContext,
    max_message_bytes: usize,
    metrics: Arc<RelayMetrics>,
) -> anyhow::Result<EventSink> {
    sink_lingering(
        config,
        config.linger_ms,
        context,
        max_message_bytes,
        metrics,
    )
}

/// [`sink`], its producer lingering `linger_ms` (the WAL relay's busy
/// producer: `--busy-linger-ms`).
pub(crate) fn sink_lingering(
    config: &Config,
    linger_ms: u64,
    context: RelayContext,
    max_message_bytes: usize,
    metrics: Arc<RelayMetrics>,
) -> anyhow::Result<EventSink> {
    let counted = metrics.clone();
    let mut client = producer_config(config, max_message_bytes)?;
    client.set("linger.ms", linger_ms.to_string());
    let kafka = KafkaSink::with_context(&client, context)
        .context("create kafka producer")?
        .batch_refusals_under(max_message_bytes)
        .on_error(move |error, row, judged| count_error(&counted, error, row, judged));
    Ok(EventSink::new(kafka, metrics))
}

/// One produce error counted by its kind in `relay_errors_total{stage}`,
/// and logged: `invalid_timestamp` (this host's clock, loudly), `rejected`
/// (the row's own), `produce` (the broker's, or a batch over the limit).
fn count_error(metrics: &RelayMetrics, error: &KafkaError, row: &Outgoing, judged: &SendError) {
    let kind = if error.rdkafka_error_code() == Some(RDKafkaErrorCode::InvalidTimestamp) {
        "invalid_timestamp"
    } else if matches!(judged, SendError::Reject(_)) {
        "rejected"
    } else {
        "produce"
    };
    metrics.relay_errors_total.with_label_values(&[kind]).inc();
    match judged {
        SendError::Reject(why) => {
            tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, %why, "the row cannot be published")
        }
        SendError::Retry(why) => {
            tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, %why, "publish failed; row stays pending")
        }
    }
}

/// What both modes share: the library relay over `orders.outbox` (its
/// passes, its sink), and the permits that bound the WAL relay's drain
/// (`--workers`).
pub struct Worker {
    pub(crate) pool: PgPool,
    pub(crate) relay: Arc<Relay<EventSink, OrdersOutbox>>,
    pub(crate) metrics: Arc<RelayMetrics>,
    pub(crate) crasher: Arc<Crasher>,
    pub(crate) permits: Semaphore,
    /// `--mode wal`: the producer lingering `--busy-linger-ms`, taken
    /// while the stream is busy ([`crate::wal`]'s `Pace`); `None`: none.
    pub(crate) busy: Option<EventSink>,
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
    /// Rows this commit marked published: those its `UPDATE` changed (a
    /// row it could not see, or one already published, is not among them).
    pub(crate) published: u64,
    /// Rows this commit marked failed.
    pub(crate) failed: u64,
}

impl Worker {
    /// The WAL relay's end of a batch, after the broker's acks: marks the
    /// delivered rows `ids` published and records `rejected` (each row's
    /// own failure; marked failed at its `max_attempts`th), then commits
    /// `tx`.
    pub(crate) async fn mark_batch(
        &self,
        mut tx: Transaction<'_, Postgres>,
        ids: &[i64],
        rejected: &[(i64, String)],
        max_attempts: i32,
    ) -> Result<Marked, BatchError> {
        // The broker has acked; the marks are not committed. A crash here
        // re-publishes the rows on restart: the at-least-once window.
        self.crasher.point(CrashPoint::Publish);
        let published = outbox::mark_published(&mut tx, ids)
            .await
            .map_err(BatchError::at(Stage::Mark, "mark published"))?;
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
        self.metrics.relay_published_total.inc_by(ids.len() as u64);
        self.metrics.relay_batch_size.observe(ids.len() as f64);
        Ok(Marked { published, failed })
    }

    /// Produces one row (the WAL relay's), through the relay's sink, or
    /// the busy one when `busy` and there is one.
    pub(crate) async fn publish(&self, row: &PendingRow, busy: bool) -> Publish {
        let row = row.clone().into_outgoing(&self.relay.source().topic);
        let sink = match &self.busy {
            Some(sink) if busy => sink,
            _ => self.relay.sink(),
        };
        match sink.send(&row).await {
            Ok(()) => Publish::Delivered,
            Err(SendError::Retry(_)) => Publish::Retry,
            Err(SendError::Reject(why)) => Publish::Rejected(why),
        }
    }
}

/// Kafka's default `max.message.bytes`, taken when the topic's cannot be read.
const KAFKA_DEFAULT_MAX_MESSAGE_BYTES: usize = 1_048_588;

/// The topic's `max.message.bytes`, read from the broker at start-up;
/// Kafka's default when it cannot be read (a topic not created yet: its
/// sends fail until it is, see [`producer`]).
pub(crate) async fn topic_max_message_bytes(kafka: &pipeline::config::KafkaArgs) -> usize {
    const KEY: &str = "max.message.bytes";
    let configs = match kafka.client_config() {
        Ok(client) => pipeline::kafka::topic_configs(&client, &kafka.kafka_topic, &[KEY]).await,
        Err(error) => Err(error.into()),
    };
    match configs.map(|configs| configs.get(KEY).and_then(|v| v.parse::<usize>().ok())) {
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
