//! The relay binary on the library's engine (`effectively::store::Relay`):
//! what is this pipeline's own is here, and only that.
//!
//! - [`OrdersOutbox`]: `orders.outbox` as the engine's [`Source`]: the
//!   claim that reads each shard's oldest pending rows, every row of a key
//!   among them (`outbox::read_shards`), the settle that marks what was
//!   delivered and counts a refused row's attempts (`--max-attempts`), the
//!   `NOTIFY` that names its rows' shards;
//! - [`EventSink`]: a row as this pipeline's consumers read it (its JSON
//!   envelope) through the library's [`KafkaSink`], with the relay's
//!   per-row metrics;
//! - [`Hooks`]: the per-pass metrics and the crash point between the
//!   broker's acks and the marks' commit.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use effectively::store::{
    Claimed, KafkaSink, Outgoing, Pass, RelayHooks, SendError, Sent, Settled, Sink, Source, Stage,
};
use pipeline::contract::CrashPoint;
use pipeline::crash::Crasher;
use pipeline::outbox::{NOTIFY_CHANNEL, shards_of_payload};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::metrics::RelayMetrics;
use crate::outbox::{self, PendingRow};
use crate::publish::RelayContext;

/// The content type of an envelope.
const JSON: &str = "application/json";

/// `orders.outbox` as the library relay's source.
#[derive(Debug, Clone)]
pub struct OrdersOutbox {
    /// Every row's destination: the topic.
    pub topic: String,
    /// Refusals of a row before it is marked failed (`--max-attempts`).
    pub max_attempts: i32,
}

impl PendingRow {
    /// The row as the library's engine sends it, to `topic`: its payload
    /// as orders wrote it ([`EventSink`] wraps it in its envelope).
    pub fn into_outgoing(self, topic: &str) -> Outgoing {
        Outgoing {
            id: self.id,
            msg_id: self.msg_id,
            destination: topic.to_owned(),
            key: self.aggregate_id.to_string(),
            event_type: self.event_type,
            payload: self.payload,
            content_type: JSON.to_owned(),
            headers: Vec::new(),
            created_at: self.created_at,
        }
    }
}

impl Source for OrdersOutbox {
    fn name(&self) -> &str {
        "orders.outbox"
    }

    fn channel(&self) -> &str {
        NOTIFY_CHANNEL
    }

    fn shards_woken(&self, payload: &str) -> u16 {
        shards_of_payload(payload)
    }

    async fn claim(
        &self,
        conn: &mut PgConnection,
        shards: &[i16],
        share: i64,
    ) -> Result<Claimed, sqlx::Error> {
        let claim = outbox::read_shards(conn, shards, share).await?;
        Ok(Claimed {
            more: claim.full,
            rows: claim
                .rows
                .into_iter()
                .map(|row| row.into_outgoing(&self.topic))
                .collect(),
        })
    }

    async fn settle(&self, conn: &mut PgConnection, sent: &Sent) -> Result<Settled, sqlx::Error> {
        // What was not delivered stays pending (the claim marked nothing);
        // what was refused counts an attempt.
        let published = outbox::mark_published(&mut *conn, &sent.published).await?;
        let failed = if sent.refused.is_empty() {
            0
        } else {
            outbox::record_failures(&mut *conn, &sent.refused, self.max_attempts).await?
        };
        Ok(Settled { published, failed })
    }
}

/// The relay's sink: each row in its JSON envelope (`pipeline::envelope`),
/// produced by the library's [`KafkaSink`], with the relay's metrics per
/// row (commit→publish, errors by kind).
pub struct EventSink {
    kafka: KafkaSink<RelayContext>,
    metrics: Arc<RelayMetrics>,
}

impl EventSink {
    /// Rows through `kafka`, counted in `metrics`.
    pub fn new(kafka: KafkaSink<RelayContext>, metrics: Arc<RelayMetrics>) -> Self {
        Self { kafka, metrics }
    }

    /// The producer (to flush, and to watch for a fatal state).
    pub fn kafka(&self) -> &KafkaSink<RelayContext> {
        &self.kafka
    }

    /// `row` with its envelope as the payload; refused when its payload is
    /// not JSON (or its key not an order id), which no retry changes.
    fn envelope(&self, row: &Outgoing) -> Result<Outgoing, SendError> {
        let value = Uuid::parse_str(&row.key)
            .map_err(|error| format!("key is not an order id: {error}"))
            .and_then(|aggregate_id| {
                pipeline::envelope::Envelope::new(
                    row.msg_id,
                    row.event_type.clone(),
                    aggregate_id,
                    row.created_at,
                    &row.payload,
                )
                .and_then(|e| e.encode())
                .map_err(|error| format!("payload is not JSON: {error}"))
            });
        match value {
            Ok(payload) => Ok(Outgoing {
                id: row.id,
                msg_id: row.msg_id,
                destination: row.destination.clone(),
                key: row.key.clone(),
                event_type: row.event_type.clone(),
                payload,
                content_type: row.content_type.clone(),
                headers: row.headers.clone(),
                created_at: row.created_at,
            }),
            Err(why) => {
                self.metrics
                    .relay_errors_total
                    .with_label_values(&["encode"])
                    .inc();
                tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, %why, "the outbox row cannot be enveloped");
                Err(SendError::Reject(why))
            }
        }
    }

    /// Counts a delivered row's commit→publish (a failed send is counted
    /// by its error, `publish::sink`).
    fn count(&self, row: &Outgoing, answer: &Result<(), SendError>) {
        if answer.is_ok() {
            let age = (Utc::now() - row.created_at)
                .num_microseconds()
                .unwrap_or(0) as f64
                / 1e6;
            self.metrics
                .relay_commit_to_publish_seconds
                .observe(age.max(0.0));
        }
    }
}

impl Sink for EventSink {
    async fn send(&self, row: &Outgoing) -> Result<(), SendError> {
        self.send_in_order(&[row])
            .await
            .pop()
            .unwrap_or_else(|| Err(SendError::Retry("not sent".to_owned())))
    }

    /// The key's rows enveloped, up to the first that cannot be (refused;
    /// the rows after it are not sent), then sent as the [`KafkaSink`]
    /// sends a key's rows.
    async fn send_in_order(&self, rows: &[&Outgoing]) -> Vec<Result<(), SendError>> {
        let mut enveloped = Vec::with_capacity(rows.len());
        let mut refused = None;
        for row in rows {
            match self.envelope(row) {
                Ok(row) => enveloped.push(row),
                Err(why) => {
                    refused = Some(why);
                    break;
                }
            }
        }
        let mut answers = if enveloped.is_empty() {
            Vec::new()
        } else {
            let refs: Vec<&Outgoing> = enveloped.iter().collect();
            self.kafka.send_in_order(&refs).await
        };
        for (row, answer) in enveloped.iter().zip(&answers) {
            self.count(row, answer);
        }
        if answers.len() == enveloped.len() {
            answers.extend(refused.map(Err));
        }
        answers
    }
}

/// The relay's metrics per pass, and the crash point between the broker's
/// acks and the commit of the marks.
pub struct Hooks {
    /// The metrics.
    pub metrics: Arc<RelayMetrics>,
    /// The crash points (`--crash-at publish`).
    pub crasher: Arc<Crasher>,
    /// `--max-attempts`, for the log of a row marked failed.
    pub max_attempts: i32,
}

impl RelayHooks for Hooks {
    fn pass_begins(&self) {
        self.metrics.relay_shards_in_flight.inc();
    }

    fn answered(&self, _sent: &Sent, took: Duration) {
        self.metrics
            .relay_publish_duration_seconds
            .observe(took.as_secs_f64());
        // The broker has acked; the marks are not committed. A crash here
        // re-publishes the rows on restart: the at-least-once window.
        self.crasher.point(CrashPoint::Publish);
    }

    fn pass_ended(&self, pass: &Pass) {
        let m = &self.metrics;
        m.relay_shards_in_flight.dec();
        if pass.published == 0 && !pass.more {
            m.relay_empty_claims_total.inc();
        }
        if pass.published + pass.failed + pass.retried > 0 {
            m.relay_published_total.inc_by(pass.published);
            m.relay_batch_size.observe(pass.published as f64);
        }
        if pass.failed > 0 {
            m.relay_rows_failed_total.inc_by(pass.failed);
            tracing::error!(
                failed = pass.failed,
                max_attempts = self.max_attempts,
                "outbox rows marked failed: they will not be published (see orders.outbox.last_error); \
                 later events of their keys are held back"
            );
        }
    }

    /// Counted by stage (the library's relay logs the error).
    fn pass_failed(&self, stage: Stage, _error: &sqlx::Error) {
        self.metrics.relay_shards_in_flight.dec();
        // The stages as the dashboards have always named them.
        let stage = match stage {
            Stage::Claim => "claim",
            Stage::Settle => "mark",
            Stage::Commit => "commit",
        };
        self.metrics
            .relay_errors_total
            .with_label_values(&[stage])
            .inc();
    }

    fn listen_lost(&self, _error: &sqlx::Error) {
        self.metrics
            .relay_errors_total
            .with_label_values(&["listen"])
            .inc();
    }
}
