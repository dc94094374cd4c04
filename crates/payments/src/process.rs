//! What a batch becomes, from either transport: decoded (or dead-lettered),
//! applied in one inbox transaction, retried while the database fails
//! transiently, split in halves when it refuses the data until the one
//! offending message is dead-lettered alone, and counted.

use std::collections::HashMap;
use std::time::Instant;

use chrono::{DateTime, Utc};
use effectively::retry::Backoff;
use pipeline::contract::SplitTxn;
use pipeline::crash::Crasher;
use pipeline::db::{ErrorClass, classify as classify_db_error};
use rdkafka::message::{Headers, Message, OwnedMessage};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::decode::InputFormat;
use crate::delivery::{Applied, ChargeIntent, Delivery, Held, Rules, Source};
use crate::inbox;
use crate::metrics::{PaymentsMetrics, Stage};
use crate::{decode, unsafe_split};

/// How a slice is applied: the consume transaction, or one of the UNSAFE
/// counter-examples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Apply {
    /// [`inbox::apply_batch`], with what it does with a msg_id outside the
    /// inbox's partitions.
    Inbox(Rules),
    /// [`unsafe_split::apply_batch`].
    Split(SplitTxn),
}

/// Decodes a batch of records shaped as `format`: each message with its
/// intent or its dead-letter reason.
pub fn classify(
    format: InputFormat,
    batch: &[OwnedMessage],
) -> (Vec<Delivery<'_>>, HashMap<Uuid, DateTime<Utc>>) {
    let mut deliveries = Vec::with_capacity(batch.len());
    let mut committed_at = HashMap::with_capacity(batch.len());
    for m in batch {
        let headers = m
            .headers()
            .into_iter()
            .flat_map(|h| h.iter().map(|h| (h.key, h.value)));
        let content = match decode::decode_record(format, m.key(), headers, m.payload()) {
            Ok((intent, created_at)) => {
                if let Some(at) = created_at {
                    committed_at.insert(intent.msg_id, at);
                }
                Ok(intent)
            }
            Err(reason) => {
                tracing::warn!(
                    partition = m.partition(),
                    offset = m.offset(),
                    reason = %effectively::text::storable(&reason),
                    "dead-lettering message"
                );
                Err(reason)
            }
        };
        deliveries.push(Delivery {
            source: Source::kafka(m.topic(), m.partition(), m.offset(), m.key(), m.payload()),
            content,
        });
    }
    (deliveries, committed_at)
}

/// How one attempt at a slice of the batch ended.
enum Attempt {
    Applied(Applied),
    /// The database refused the slice for its data (see [`ErrorClass`]).
    Refused(sqlx::Error),
    Cancelled,
}

/// Applies the batch. Transient database failures are retried with backoff
/// until the work commits. A deterministic failure (the data of some message
/// makes the transaction fail every time) is never retried as it is: the
/// slice is split in halves, each applied in a transaction of its own, until
/// the one offending message is alone; it is dead-lettered with the
/// database's reason and the rest is applied. So no message stops its
/// partition. Returns the deliveries held back (`Applied::held`), or `None`
/// when cancelled first (then the rest is not committed and will be
/// redelivered; what did commit is a no-op on redelivery).
///
/// Its span counts the batch's messages; a message handled alone (refused
/// by the database) gets a span of its own with its msg_id and order_id.
pub(crate) async fn process(
    pool: &sqlx::PgPool,
    apply: Apply,
    format: InputFormat,
    batch: &[OwnedMessage],
    crasher: &Crasher,
    metrics: &PaymentsMetrics,
    cancel: &CancellationToken,
) -> Option<Vec<Held>> {
    let (deliveries, committed_at) = classify(format, batch);
    process_deliveries(
        pool,
        apply,
        &deliveries,
        &committed_at,
        crasher,
        metrics,
        cancel,
    )
    .await
    .map(|left| left.held)
}

/// What applying a batch left undone.
#[derive(Debug, Default)]
pub(crate) struct Left {
    /// Webhooks left alone because another processor holds (or has just
    /// processed) their claim (`Applied::skipped`; always 0 for Kafka).
    pub(crate) skipped: u64,
    /// Deliveries held back: valid, but the inbox cannot record them yet.
    pub(crate) held: Vec<Held>,
}

/// [`process`] of decoded deliveries, from either transport; `committed_at`
/// holds each event's outbox commit time (for the commit-to-effect latency).
/// Returns what it left undone, or `None` when `cancel` fired.
#[tracing::instrument(level = "info", skip_all, fields(messages = deliveries.len()))]
pub(crate) async fn process_deliveries(
    pool: &sqlx::PgPool,
    apply: Apply,
    deliveries: &[Delivery<'_>],
    committed_at: &HashMap<Uuid, DateTime<Utc>>,
    crasher: &Crasher,
    metrics: &PaymentsMetrics,
    cancel: &CancellationToken,
) -> Option<Left> {
    let mut left = Left::default();
    // Slices still to apply, the next one last; halves keep message order.
    let mut work: Vec<&[Delivery<'_>]> = vec![deliveries];
    while let Some(slice) = work.pop() {
        match apply_with_retry(pool, apply, slice, crasher, metrics, cancel).await {
            Attempt::Applied(mut applied) => {
                left.skipped += applied.skipped;
                record(metrics, &applied, committed_at);
                left.held.append(&mut applied.held);
            }
            Attempt::Cancelled => return None,
            Attempt::Refused(error) if slice.len() == 1 => {
                let reason = format!("{error}");
                let intent = slice[0].content.as_ref().ok();
                let span = tracing::info_span!(
                    "message",
                    msg_id = tracing::field::Empty,
                    order_id = tracing::field::Empty,
                );
                if let Some(intent) = intent {
                    span.record("msg_id", tracing::field::display(intent.msg_id));
                    span.record("order_id", tracing::field::display(intent.order_id));
                }
                let rejected = async {
                    tracing::warn!(
                        source = %slice[0].source.origin,
                        reason = %effectively::text::storable(&reason),
                        "the database refused a message; dead-lettering it alone"
                    );
                    reject_with_retry(pool, slice[0].source, intent, &reason, metrics, cancel).await
                }
                .instrument(span)
                .await;
                if !rejected {
                    return None;
                }
            }
            Attempt::Refused(error) => {
                metrics.bisections_total.inc();
                tracing::info!(size = slice.len(), %error, "the database refused a batch; splitting it to find the message");
                let (first, second) = slice.split_at(slice.len() / 2);
                work.push(second);
                work.push(first);
            }
        }
    }
    Some(left)
}

/// One slice in one transaction, retried with backoff while the failure is
/// transient.
async fn apply_with_retry(
    pool: &sqlx::PgPool,
    apply: Apply,
    slice: &[Delivery<'_>],
    crasher: &Crasher,
    metrics: &PaymentsMetrics,
    cancel: &CancellationToken,
) -> Attempt {
    let mut backoff = Backoff::new();
    loop {
        let start = Instant::now();
        let result = match apply {
            Apply::Inbox(rules) => inbox::apply_batch(pool, slice, rules, crasher).await,
            Apply::Split(mode) => unsafe_split::apply_batch(pool, mode, slice, crasher).await,
        };
        match result {
            Ok(applied) => {
                metrics
                    .processing_duration_seconds
                    .observe(start.elapsed().as_secs_f64());
                return Attempt::Applied(applied);
            }
            Err(error) if classify_db_error(&error) == ErrorClass::Deterministic => {
                metrics.error(Stage::Refused);
                return Attempt::Refused(error);
            }
            Err(error) => {
                metrics.error(Stage::Apply);
                tracing::warn!(%error, "applying batch failed; retrying");
                if !backoff.wait(cancel).await {
                    return Attempt::Cancelled;
                }
            }
        }
    }
}

/// Dead-letters a message the database refused, retrying transient failures.
/// Should the database refuse even the dead letter (it takes the raw bytes
/// as `bytea` and a storable reason, so it should not), the message is
/// recorded without its key and payload, which stay in the topic.
async fn reject_with_retry(
    pool: &sqlx::PgPool,
    source: Source<'_>,
    intent: Option<&ChargeIntent>,
    reason: &str,
    metrics: &PaymentsMetrics,
    cancel: &CancellationToken,
) -> bool {
    let mut source = source;
    let mut backoff = Backoff::new();
    loop {
        match inbox::reject(pool, source, intent, reason).await {
            Ok(written) => {
                metrics.rejected_total.inc();
                if written {
                    metrics.dead_letters_total.inc();
                }
                return true;
            }
            Err(error)
                if classify_db_error(&error) == ErrorClass::Deterministic
                    && (source.key.is_some() || source.payload.is_some()) =>
            {
                tracing::error!(%error, source = %source.origin,
                    "the dead letter itself was refused; recording it without key and payload");
                source.key = None;
                source.payload = None;
            }
            Err(error) => {
                metrics.error(Stage::DeadLetter);
                tracing::warn!(%error, "writing a dead letter failed; retrying");
                if !backoff.wait(cancel).await {
                    return false;
                }
            }
        }
    }
}

/// Counts what a committed slice (or a drain of parked events) did.
pub(crate) fn record(
    metrics: &PaymentsMetrics,
    applied: &Applied,
    committed_at: &HashMap<Uuid, DateTime<Utc>>,
) {
    metrics.dedup_misses_total.inc_by(applied.charged);
    metrics.dedup_hits_total.inc_by(applied.duplicates);
    metrics
        .charges_total
        .inc_by(applied.charged - applied.charge_conflicts);
    metrics
        .charge_conflicts_total
        .inc_by(applied.charge_conflicts);
    metrics
        .msg_id_conflicts_total
        .inc_by(applied.msg_id_conflicts);
    metrics.after_horizon_total.inc_by(applied.after_horizon);
    metrics
        .applied_after_horizon_total
        .inc_by(applied.applied_after_horizon);
    metrics.charges_total.inc_by(applied.charged_after_horizon);
    if applied.applied_after_horizon > 0 {
        tracing::warn!(
            applied = applied.applied_after_horizon,
            "UNSAFE: deliveries after the dedup horizon applied (--unsafe-apply-after-horizon)"
        );
    }
    metrics
        .future_msg_ids_total
        .inc_by(applied.held.len() as u64 + applied.parked_future);
    metrics.parked_total.inc_by(applied.parked);
    metrics.ahead_of_clock_total.inc_by(applied.ahead_of_clock);
    if applied.after_horizon + applied.never_recordable > 0 {
        tracing::warn!(
            after_horizon = applied.after_horizon,
            never_recordable = applied.never_recordable,
            "deliveries outside the inbox's partitions dead-lettered, not applied"
        );
    }
    metrics
        .dead_letters_total
        .inc_by(applied.dead_lettered.len() as u64);
    if applied.charge_conflicts + applied.msg_id_conflicts > 0 {
        tracing::warn!(
            order_conflicts = applied.charge_conflicts,
            msg_id_conflicts = applied.msg_id_conflicts,
            "conflicting redeliveries dead-lettered; the first effects stand"
        );
    }
    let now = Utc::now();
    for msg_id in &applied.new_msg_ids {
        if let Some(created) = committed_at.get(msg_id) {
            let secs = (now - *created).num_microseconds().unwrap_or(0) as f64 / 1e6;
            metrics.commit_to_effect_seconds.observe(secs.max(0.0));
        }
    }
}
