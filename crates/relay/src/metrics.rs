//! The relay's Prometheus metrics.

use pipeline::contract::{
    RELAY_PUBLISHED_TOTAL, RELAY_WEBHOOK_ATTEMPTS_TOTAL, WEBHOOK_OUTCOME_LABEL,
};
use pipeline::metrics::LATENCY_BUCKETS;
use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

/// Everything the relay counts.
#[derive(Debug, Clone)]
pub struct RelayMetrics {
    /// The registry holding these metrics.
    pub registry: Registry,
    /// Outbox rows committed but not yet published, failed rows excluded
    /// (sampled).
    pub outbox_pending_rows: IntGauge,
    /// Outbox rows marked failed: never publishable, left for a human
    /// (sampled). Each holds back the later events of its own key.
    pub outbox_failed_rows: IntGauge,
    /// Rows this process marked failed after their last allowed attempt.
    pub relay_rows_failed_total: IntCounter,
    /// Age in seconds of the oldest pending outbox row (sampled; 0 when none).
    pub outbox_oldest_pending_age_seconds: Gauge,
    /// Outbox rows published and marked (re-publishes after a crash count again).
    pub relay_published_total: IntCounter,
    /// Rows per published batch.
    pub relay_batch_size: Histogram,
    /// Shard transactions (`--mode poll`) that published nothing: the
    /// shard's lock was taken, it had no row to claim, or no row was acked.
    /// Each cost a transaction.
    pub relay_empty_claims_total: IntCounter,
    /// Seconds from handing a batch to the producer to the last broker ack.
    pub relay_publish_duration_seconds: Histogram,
    /// Seconds from an outbox row's commit to its broker ack.
    pub relay_commit_to_publish_seconds: Histogram,
    /// Errors by stage. A poll relay batch's transaction: `claim`, `mark`,
    /// `commit` (rolled back, its rows stay pending; `publish::Stage`). A
    /// row: `produce` (the broker, transient: retried), `rejected` (the row
    /// itself: counted against its attempts), `encode` (payload not JSON:
    /// counted too). `listen`; `wal` (`--mode wal`: the stream ended and
    /// restarts from the slot's confirmed position). The webhook sink's
    /// database work: `destinations`, `fan_out`, `claim`, `record`.
    pub relay_errors_total: IntCounterVec,
    /// Published outbox rows deleted after the outbox retention
    /// (`orders.outbox_policy`).
    pub relay_outbox_expired_total: IntCounter,
    /// Shard transactions open now (claimed, publishing or marking), at most
    /// `--workers`.
    pub relay_shards_in_flight: IntGauge,
    /// `--mode wal`: WAL the slot holds back from removal, in bytes (the
    /// server's WAL position minus the slot's restart position). It grows
    /// while the relay is down or behind; past `max_slot_wal_keep_size` the
    /// server invalidates the slot.
    pub relay_wal_slot_retained_bytes: IntGauge,
    /// `--mode wal`: outbox rows read from the stream and not published
    /// because an earlier row of their key failed (left pending).
    pub relay_wal_held_back_total: IntCounter,
    /// `--mode wal`: outbox rows read from the stream that the start-up
    /// drain had published already (not sent again).
    pub relay_wal_drained_skipped_total: IntCounter,
    /// `--mode wal`: 1 while the stream's rows go through the busy
    /// producer (`--busy-linger-ms`), 0 otherwise.
    pub relay_wal_busy: IntGauge,
    /// `--mode wal`: rows sent through the busy producer.
    pub relay_wal_busy_rows_total: IntCounter,
    /// `--mode wal`: times the relay found a committed row the stream had
    /// not delivered, and restarted the stream to publish it.
    pub relay_wal_stream_gaps_total: IntCounter,
    /// `--mode wal`: marks that found a row read from the stream not yet
    /// visible to their snapshot (its commit flushed, not yet shown to other
    /// sessions) and waited for it.
    pub relay_wal_unseen_marks_total: IntCounter,
    /// `--sink http`: deliveries written by the fan-out (one per outbox row
    /// and destination).
    pub relay_webhook_fanned_out_total: IntCounter,
    /// `--sink http`: attempts by `destination` and `outcome` (`delivered`,
    /// `retry`, `failed`: given up, `gone`: 410, the destination disabled).
    pub relay_webhook_attempts_total: IntCounterVec,
    /// `--sink http`: deliveries given up (`failed`) by destination: the
    /// alert. `relay webhooks replay` sends them again.
    pub relay_webhook_failed_total: IntCounterVec,
    /// `--sink http`: the receivers' answers by `destination` and `status`:
    /// the HTTP status code (`200`, `401`, `503`, ...), or `none` when there
    /// was no answer (connection failed, timed out). Every non-2xx but 410
    /// is retried: a run of 401s says the receiver cannot verify the
    /// signatures (its clock, see `relay_webhook_clock_skew_seconds`, or a
    /// secret it does not hold).
    pub relay_webhook_responses_total: IntCounterVec,
    /// `--sink http`: the receiver's clock minus the sender's, in seconds,
    /// by destination, from the last answer's `Date` (whole seconds, so good
    /// to about 2 s; unset until an answer carries a `Date`). Past
    /// `webhooks::CLOCK_SKEW_WARN` either way the relay warns; past the
    /// receiver's signature tolerance (5 minutes) it refuses every attempt.
    pub relay_webhook_clock_skew_seconds: GaugeVec,
    /// `--sink http`: seconds per attempt (to the answer or the timeout), by
    /// destination.
    pub relay_webhook_attempt_duration_seconds: prometheus::HistogramVec,
    /// `--sink http`: seconds from an outbox row's commit to the receiver's
    /// 2xx, by destination.
    pub relay_webhook_commit_to_delivered_seconds: prometheus::HistogramVec,
    /// `--sink http`: deliveries neither delivered nor failed, by destination
    /// (sampled).
    pub relay_webhook_pending: prometheus::IntGaugeVec,
    /// `--sink http`: delivered deliveries deleted after the outbox
    /// retention.
    pub relay_webhook_expired_total: IntCounter,
}

/// The outcomes of a webhook attempt (`relay_webhook_attempts_total`).
pub const WEBHOOK_ATTEMPT_OUTCOMES: [&str; 4] = ["delivered", "retry", "failed", "gone"];

impl RelayMetrics {
    /// Creates and registers the metrics in a fresh registry.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = pipeline::metrics::registry();
        let m = Self {
            outbox_pending_rows: IntGauge::new(
                "outbox_pending_rows",
                "Outbox rows committed but not yet published",
            )?,
            outbox_oldest_pending_age_seconds: Gauge::new(
                "outbox_oldest_pending_age_seconds",
                "Age in seconds of the oldest pending outbox row (0 when none)",
            )?,
            outbox_failed_rows: IntGauge::new(
                "outbox_failed_rows",
                "Outbox rows marked failed (never publishable); each holds back its own key",
            )?,
            relay_outbox_expired_total: IntCounter::new(
                "relay_outbox_expired_total",
                "Published outbox rows deleted after the outbox retention",
            )?,
            relay_rows_failed_total: IntCounter::new(
                "relay_rows_failed_total",
                "Outbox rows marked failed after their last allowed publish attempt",
            )?,
            relay_empty_claims_total: IntCounter::new(
                "relay_empty_claims_total",
                "Shard transactions that published nothing (the shard locked elsewhere, no row, or none acked)",
            )?,
            relay_published_total: IntCounter::new(
                RELAY_PUBLISHED_TOTAL,
                "Outbox rows published to Kafka and marked published",
            )?,
            relay_batch_size: Histogram::with_opts(
                HistogramOpts::new("relay_batch_size", "Rows per published batch").buckets(vec![
                    1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0,
                ]),
            )?,
            relay_publish_duration_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "relay_publish_duration_seconds",
                    "Seconds from handing a batch to the producer to the last broker ack",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
            )?,
            relay_commit_to_publish_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "relay_commit_to_publish_seconds",
                    "Seconds from an outbox row's commit to its broker ack",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
            )?,
            relay_errors_total: IntCounterVec::new(
                Opts::new(
                    "relay_errors_total",
                    "Relay errors by stage: claim, mark, commit (a batch), produce, rejected, \
                     encode, invalid_timestamp (a row: the broker refused this host's clock), \
                     listen, wal; destinations, fan_out, claim, record (webhooks)",
                ),
                &["stage"],
            )?,
            relay_shards_in_flight: IntGauge::new(
                "relay_shards_in_flight",
                "Relay transactions open now (a shard group's claim to its commit), at most --workers",
            )?,
            relay_wal_slot_retained_bytes: IntGauge::new(
                "relay_wal_slot_retained_bytes",
                "--mode wal: bytes of WAL the replication slot retains (0 in poll mode)",
            )?,
            relay_wal_held_back_total: IntCounter::new(
                "relay_wal_held_back_total",
                "--mode wal: outbox rows not published because an earlier row of their key failed",
            )?,
            relay_wal_drained_skipped_total: IntCounter::new(
                "relay_wal_drained_skipped_total",
                "--mode wal: outbox rows read from the stream that the start-up drain had published already (not sent again)",
            )?,
            relay_wal_busy: IntGauge::new(
                "relay_wal_busy",
                "--mode wal: 1 while the stream's rows go through the busy producer (--busy-linger-ms)",
            )?,
            relay_wal_busy_rows_total: IntCounter::new(
                "relay_wal_busy_rows_total",
                "--mode wal: outbox rows sent through the busy producer (--busy-linger-ms)",
            )?,
            relay_wal_stream_gaps_total: IntCounter::new(
                "relay_wal_stream_gaps_total",
                "--mode wal: committed outbox rows found that the stream had not delivered (the stream restarts)",
            )?,
            relay_wal_unseen_marks_total: IntCounter::new(
                "relay_wal_unseen_marks_total",
                "--mode wal: marks that waited for rows read from the stream to become visible",
            )?,
            relay_webhook_fanned_out_total: IntCounter::new(
                "relay_webhook_fanned_out_total",
                "--sink http: deliveries written by the fan-out (outbox rows x destinations)",
            )?,
            relay_webhook_attempts_total: IntCounterVec::new(
                Opts::new(
                    RELAY_WEBHOOK_ATTEMPTS_TOTAL,
                    "--sink http: delivery attempts by destination and outcome",
                ),
                &["destination", WEBHOOK_OUTCOME_LABEL],
            )?,
            relay_webhook_failed_total: IntCounterVec::new(
                Opts::new(
                    "relay_webhook_failed_total",
                    "--sink http: deliveries given up (failed) by destination",
                ),
                &["destination"],
            )?,
            relay_webhook_responses_total: IntCounterVec::new(
                Opts::new(
                    "relay_webhook_responses_total",
                    "--sink http: receivers' answers by destination and HTTP status (none: no answer)",
                ),
                &["destination", "status"],
            )?,
            relay_webhook_clock_skew_seconds: GaugeVec::new(
                Opts::new(
                    "relay_webhook_clock_skew_seconds",
                    "--sink http: the receiver's clock minus the sender's, seconds, from its last answer's Date",
                ),
                &["destination"],
            )?,
            relay_webhook_attempt_duration_seconds: prometheus::HistogramVec::new(
                HistogramOpts::new(
                    "relay_webhook_attempt_duration_seconds",
                    "--sink http: seconds per delivery attempt, by destination",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
                &["destination"],
            )?,
            relay_webhook_commit_to_delivered_seconds: prometheus::HistogramVec::new(
                HistogramOpts::new(
                    "relay_webhook_commit_to_delivered_seconds",
                    "--sink http: seconds from an outbox row's commit to the receiver's 2xx",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
                &["destination"],
            )?,
            relay_webhook_pending: prometheus::IntGaugeVec::new(
                Opts::new(
                    "relay_webhook_pending",
                    "--sink http: deliveries neither delivered nor failed, by destination",
                ),
                &["destination"],
            )?,
            relay_webhook_expired_total: IntCounter::new(
                "relay_webhook_expired_total",
                "--sink http: delivered deliveries deleted after the outbox retention",
            )?,
            registry,
        };
        m.registry
            .register(Box::new(m.relay_webhook_expired_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_webhook_fanned_out_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_webhook_attempts_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_webhook_failed_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_webhook_responses_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_webhook_clock_skew_seconds.clone()))?;
        m.registry
            .register(Box::new(m.relay_webhook_attempt_duration_seconds.clone()))?;
        m.registry.register(Box::new(
            m.relay_webhook_commit_to_delivered_seconds.clone(),
        ))?;
        m.registry
            .register(Box::new(m.relay_webhook_pending.clone()))?;
        m.registry
            .register(Box::new(m.outbox_pending_rows.clone()))?;
        m.registry
            .register(Box::new(m.outbox_oldest_pending_age_seconds.clone()))?;
        m.registry
            .register(Box::new(m.outbox_failed_rows.clone()))?;
        m.registry
            .register(Box::new(m.relay_rows_failed_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_published_total.clone()))?;
        m.registry.register(Box::new(m.relay_batch_size.clone()))?;
        m.registry
            .register(Box::new(m.relay_empty_claims_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_publish_duration_seconds.clone()))?;
        m.registry
            .register(Box::new(m.relay_commit_to_publish_seconds.clone()))?;
        m.registry
            .register(Box::new(m.relay_errors_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_outbox_expired_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_shards_in_flight.clone()))?;
        m.registry
            .register(Box::new(m.relay_wal_slot_retained_bytes.clone()))?;
        m.registry
            .register(Box::new(m.relay_wal_held_back_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_wal_drained_skipped_total.clone()))?;
        m.registry.register(Box::new(m.relay_wal_busy.clone()))?;
        m.registry
            .register(Box::new(m.relay_wal_busy_rows_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_wal_stream_gaps_total.clone()))?;
        m.registry
            .register(Box::new(m.relay_wal_unseen_marks_total.clone()))?;
        for stage in [
            "claim",
            "mark",
            "commit",
            "produce",
            "rejected",
            "encode",
            "invalid_timestamp",
            "listen",
            "wal",
            "destinations",
            "fan_out",
            "record",
        ] {
            m.relay_errors_total.with_label_values(&[stage]);
        }
        Ok(m)
    }
}
