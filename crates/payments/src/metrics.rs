//! The Payments consumer's Prometheus metrics.

use pipeline::contract::{
    INJECTED_DUPLICATE_LABEL, InjectedDuplicate, PAYMENTS_AFTER_HORIZON_TOTAL,
    PAYMENTS_APPLIED_AFTER_HORIZON_TOTAL, PAYMENTS_CHARGES_TOTAL, PAYMENTS_CONSUMED_TOTAL,
    PAYMENTS_DEAD_LETTERS_TOTAL, PAYMENTS_DEDUP_HITS_TOTAL, PAYMENTS_DEDUP_MISSES_TOTAL,
    PAYMENTS_INJECTED_DUPLICATES_TOTAL, PAYMENTS_WEBHOOK_REQUESTS_TOTAL, WEBHOOK_OUTCOME_LABEL,
};
use pipeline::metrics::LATENCY_BUCKETS;
use prometheus::{
    Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry,
};

/// Everything the consumer counts.
#[derive(Debug, Clone)]
pub struct PaymentsMetrics {
    /// The registry holding these metrics.
    pub registry: Registry,
    /// Messages consumed from Kafka (including redeliveries).
    pub consumed_total: IntCounter,
    /// Messages whose msg_id was already in the inbox (no-ops).
    pub dedup_hits_total: IntCounter,
    /// Messages whose msg_id was new (claimed and charged).
    pub dedup_misses_total: IntCounter,
    /// Charges written.
    pub charges_total: IntCounter,
    /// New msg_ids whose order already had a charge (UNIQUE guard; should stay 0).
    pub charge_conflicts_total: IntCounter,
    /// Messages dead-lettered (every kind).
    pub dead_letters_total: IntCounter,
    /// Deliveries of an applied msg_id with another payload (dead-lettered;
    /// the first effect stands; should stay 0).
    pub msg_id_conflicts_total: IntCounter,
    /// Messages the database refused to apply, isolated from their batch and
    /// dead-lettered.
    pub rejected_total: IntCounter,
    /// Batches (or halves of them) split because the database refused them.
    pub bisections_total: IntCounter,
    /// Seconds to apply one polled batch (one transaction).
    pub processing_duration_seconds: Histogram,
    /// Seconds from the outbox row's commit to the charge's commit.
    pub commit_to_effect_seconds: Histogram,
    /// Errors by stage: `consume` (a Kafka receive), `apply` (the batch's
    /// transaction, transient: retried), `db_refused` (the data of the batch
    /// was refused: it is split), `dead_letter` (writing a dead letter,
    /// transient: retried), `scan` (the webhook processor reading its
    /// claims), `commit` (an offset commit refused at once),
    /// `commit_callback` (an asynchronous offset commit the broker did not
    /// take).
    pub consumer_errors_total: IntCounterVec,
    /// Duplicate deliveries injected on purpose (`--dup-rate`), by kind:
    /// `reprocess` (applied again after the commit, as if redelivered) and
    /// `redeliver` (the consumer seeks back and the broker delivers again).
    pub injected_duplicates_total: IntCounterVec,
    /// Deliveries refused because they arrived after the dedup horizon
    /// (older than the oldest inbox partition kept; dead-lettered).
    pub after_horizon_total: IntCounter,
    /// UNSAFE (`--unsafe-apply-after-horizon`, experiment 5 only): deliveries
    /// after the dedup horizon applied anyway.
    pub applied_after_horizon_total: IntCounter,
    /// Deliveries refused because their msg_id lies beyond the inbox
    /// partitions created so far (dead-lettered).
    pub future_msg_ids_total: IntCounter,
    /// Kafka events parked (`payments.parked`): beyond the inbox's
    /// partitions, or behind an earlier parked event of their order.
    pub parked_total: IntCounter,
    /// Parked events applied (charged, or found already applied) once the
    /// inbox could record them.
    pub parked_applied_total: IntCounter,
    /// Events parked now (sampled by the drain every `--hold-retry-ms`).
    pub parked_events: IntGauge,
    /// Kafka events dead-lettered as minted further ahead of the database's
    /// clock than `--clock-skew` (kind `ahead_of_clock`).
    pub ahead_of_clock_total: IntCounter,
    /// Inbox partitions kept.
    pub inbox_partitions: IntGauge,
    /// Inbox partitions dropped by expiry.
    pub inbox_partitions_dropped_total: IntCounter,
    /// How far back the inbox remembers: now minus the oldest partition's
    /// start, in seconds.
    pub inbox_floor_age_seconds: Gauge,
    /// How far ahead the inbox's partitions reach: the newest one's end
    /// minus now, in seconds (below 0: new events are held back).
    pub inbox_ahead_seconds: Gauge,
    /// Rounds whose creation of partitions ahead failed.
    pub inbox_extend_failures_total: IntCounter,
    /// Partitions paused on a held-back message (a msg_id beyond the
    /// inbox's partitions), now.
    pub held_partitions: IntGauge,
    /// The redelivery horizon derived from the settings (+Inf: unbounded).
    pub redelivery_horizon_seconds: Gauge,
    /// The configured inbox retention (+Inf: forever).
    pub inbox_retention_seconds: Gauge,
    /// Per assigned partition (`topic`, `partition`): the partition's high
    /// watermark minus this group's committed offset, asked of the broker
    /// every `--lag-sample-ms`. Messages in the partition that no committed
    /// batch covers yet.
    pub consumer_lag: IntGaugeVec,
    /// Per assigned partition, sampled with the lag: how long the oldest
    /// message no committed batch covers has waited, in seconds (0 without
    /// lag; see [`crate::kafka::lag_age_seconds`]). The broker deletes by
    /// time, consumed or not: held against the topic's `retention.ms`
    /// (alert `ConsumerLagAgeNearRetention`).
    pub consumer_lag_age_seconds: GaugeVec,
    /// Partitions that moved to (`event="assigned"`) or away from
    /// (`event="revoked"`) this member in rebalances. With cooperative-sticky
    /// assignment a member joining or leaving moves only the partitions that
    /// change owner; the others keep being consumed through the rebalance.
    pub partitions_moved_total: IntCounterVec,
    /// Times this process's consumer joined the group again with a fresh
    /// client after being fenced (`FencedInstanceId`), see
    /// [`crate::REJOIN_WINDOW`].
    pub consumer_rejoins_total: IntCounter,
    /// `--source http`: webhook requests by outcome (see
    /// [`WEBHOOK_OUTCOMES`]).
    pub webhook_requests_total: IntCounterVec,
    /// `--source http`: seconds from a request's arrival to its response.
    pub webhook_request_duration_seconds: Histogram,
    /// `--source http`: webhooks claimed but not processed yet (their charge
    /// is not applied), as the inbox processor last counted.
    pub webhook_backlog: IntGauge,
    /// `--source http`: processed webhook receipts deleted after
    /// `--webhook-receipts-kept`.
    pub webhook_receipts_pruned_total: IntCounter,
}

/// The outcomes of a webhook request (`payments_webhook_requests_total`'s
/// `outcome`): `accepted` (claimed now, 200), `duplicate` (claimed before,
/// 200), `conflict` (claimed before with another body, 422, dead-lettered),
/// `unauthorized` (signature or timestamp refused, 401), `bad_request` (not
/// an event, or its id is not the webhook-id, 400), `unavailable` (the
/// database failed, 503), `error` (the database refused the claim, 500),
/// `overloaded` (every handling slot taken, 503 with `Retry-After: 1`),
/// `request_timeout` (not complete within the request timeout, 408).
pub const WEBHOOK_OUTCOMES: [&str; 9] = [
    "accepted",
    "duplicate",
    "conflict",
    "unauthorized",
    "bad_request",
    "unavailable",
    "error",
    "overloaded",
    "request_timeout",
];

impl PaymentsMetrics {
    /// Creates and registers the metrics in a fresh registry.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = pipeline::metrics::registry();
        let counter = |name: &str, help: &str| IntCounter::new(name, help);
        let m = Self {
            consumed_total: counter(
                PAYMENTS_CONSUMED_TOTAL,
                "Messages consumed from Kafka, redeliveries included",
            )?,
            dedup_hits_total: counter(
                PAYMENTS_DEDUP_HITS_TOTAL,
                "Messages whose msg_id was already in the inbox (no-ops)",
            )?,
            dedup_misses_total: counter(
                PAYMENTS_DEDUP_MISSES_TOTAL,
                "Messages whose msg_id was new (claimed and charged)",
            )?,
            charges_total: counter(PAYMENTS_CHARGES_TOTAL, "Charges written")?,
            charge_conflicts_total: counter(
                "payments_charge_conflicts_total",
                "New msg_ids whose order already had a charge (the UNIQUE guard fired)",
            )?,
            dead_letters_total: counter(
                PAYMENTS_DEAD_LETTERS_TOTAL,
                "Messages dead-lettered, every kind",
            )?,
            msg_id_conflicts_total: counter(
                "payments_msg_id_conflicts_total",
                "Deliveries of an applied msg_id with another payload (dead-lettered)",
            )?,
            rejected_total: counter(
                "payments_rejected_total",
                "Messages the database refused, isolated from their batch and dead-lettered",
            )?,
            bisections_total: counter(
                "payments_bisections_total",
                "Batches split in halves because the database refused them",
            )?,
            processing_duration_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "payments_processing_duration_seconds",
                    "Seconds to apply one polled batch in one transaction",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
            )?,
            commit_to_effect_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "payments_commit_to_effect_seconds",
                    "Seconds from the outbox row's commit to the charge's commit",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
            )?,
            consumer_errors_total: IntCounterVec::new(
                Opts::new("payments_consumer_errors_total", "Consumer errors by stage"),
                &["stage"],
            )?,
            injected_duplicates_total: IntCounterVec::new(
                Opts::new(
                    PAYMENTS_INJECTED_DUPLICATES_TOTAL,
                    "Duplicate deliveries injected on purpose by --dup-rate, by kind",
                ),
                &[INJECTED_DUPLICATE_LABEL],
            )?,
            after_horizon_total: counter(
                PAYMENTS_AFTER_HORIZON_TOTAL,
                "Deliveries refused: arrived after the dedup horizon (dead-lettered, not applied)",
            )?,
            applied_after_horizon_total: counter(
                PAYMENTS_APPLIED_AFTER_HORIZON_TOTAL,
                "UNSAFE (--unsafe-apply-after-horizon): deliveries after the dedup horizon applied anyway",
            )?,
            future_msg_ids_total: counter(
                "payments_future_msg_ids_total",
                "Deliveries held back (not applied, not acknowledged, tried again): msg_id at or beyond the end of the inbox partitions created so far",
            )?,
            parked_total: counter(
                "payments_parked_total",
                "Kafka events parked (payments.parked): the inbox cannot record them yet, or an earlier event of their order is parked; their offsets move on, their order waits",
            )?,
            parked_applied_total: counter(
                "payments_parked_applied_total",
                "Parked events applied (or found applied) once the inbox could record them",
            )?,
            parked_events: IntGauge::new(
                "payments_parked_events",
                "Events parked now, waiting for the inbox's partitions to reach them",
            )?,
            ahead_of_clock_total: counter(
                "payments_ahead_of_clock_total",
                "Kafka events dead-lettered (kind ahead_of_clock): msg_id minted further ahead of the database's clock than --clock-skew",
            )?,
            inbox_partitions: IntGauge::new("payments_inbox_partitions", "Inbox partitions kept")?,
            inbox_partitions_dropped_total: counter(
                "payments_inbox_partitions_dropped_total",
                "Inbox partitions dropped by expiry",
            )?,
            inbox_ahead_seconds: Gauge::new(
                "payments_inbox_ahead_seconds",
                "How far ahead the inbox's partitions reach: the newest one's end minus now (below 0: new events are held back)",
            )?,
            inbox_extend_failures_total: counter(
                "payments_inbox_extend_failures_total",
                "Rounds whose creation of inbox partitions ahead failed",
            )?,
            held_partitions: IntGauge::new(
                "payments_held_partitions",
                "Kafka partitions paused on a message whose msg_id the inbox cannot record yet",
            )?,
            inbox_floor_age_seconds: Gauge::new(
                "payments_inbox_floor_age_seconds",
                "How far back the inbox remembers msg_ids: now minus the oldest partition's start",
            )?,
            redelivery_horizon_seconds: Gauge::new(
                "payments_redelivery_horizon_seconds",
                "The redelivery horizon derived from the pipeline's settings (+Inf: unbounded)",
            )?,
            inbox_retention_seconds: Gauge::new(
                "payments_inbox_retention_seconds",
                "The configured inbox retention (+Inf: forever)",
            )?,
            consumer_lag: IntGaugeVec::new(
                Opts::new(
                    "payments_consumer_lag",
                    "Per assigned partition: high watermark minus the group's committed offset",
                ),
                &["topic", "partition"],
            )?,
            consumer_lag_age_seconds: GaugeVec::new(
                Opts::new(
                    "payments_consumer_lag_age_seconds",
                    "Per assigned partition: seconds the oldest message no committed batch covers has waited (0 without lag)",
                ),
                &["topic", "partition"],
            )?,
            partitions_moved_total: IntCounterVec::new(
                Opts::new(
                    pipeline::contract::PAYMENTS_PARTITIONS_MOVED_TOTAL,
                    "Partitions assigned to or revoked from this member in rebalances",
                ),
                &["event"],
            )?,
            consumer_rejoins_total: counter(
                "payments_consumer_rejoins_total",
                "Joins of the group again with a fresh client after this member was fenced",
            )?,
            webhook_requests_total: IntCounterVec::new(
                Opts::new(
                    PAYMENTS_WEBHOOK_REQUESTS_TOTAL,
                    "Webhook requests (--source http) by outcome",
                ),
                &[WEBHOOK_OUTCOME_LABEL],
            )?,
            webhook_request_duration_seconds: Histogram::with_opts(
                HistogramOpts::new(
                    "payments_webhook_request_duration_seconds",
                    "Seconds from a webhook request's arrival to its response",
                )
                .buckets(LATENCY_BUCKETS.to_vec()),
            )?,
            webhook_backlog: IntGauge::new(
                "payments_webhook_backlog",
                "Webhooks claimed but not yet processed (charge not applied)",
            )?,
            webhook_receipts_pruned_total: counter(
                "payments_webhook_receipts_pruned_total",
                "Processed webhook receipts deleted after --webhook-receipts-kept",
            )?,
            registry,
        };
        m.registry
            .register(Box::new(m.webhook_requests_total.clone()))?;
        m.registry
            .register(Box::new(m.webhook_request_duration_seconds.clone()))?;
        m.registry.register(Box::new(m.webhook_backlog.clone()))?;
        m.registry
            .register(Box::new(m.webhook_receipts_pruned_total.clone()))?;
        for outcome in WEBHOOK_OUTCOMES {
            m.webhook_requests_total.with_label_values(&[outcome]);
        }
        m.registry.register(Box::new(m.consumer_lag.clone()))?;
        m.registry
            .register(Box::new(m.consumer_lag_age_seconds.clone()))?;
        m.registry
            .register(Box::new(m.consumer_rejoins_total.clone()))?;
        m.registry
            .register(Box::new(m.partitions_moved_total.clone()))?;
        for event in ["assigned", "revoked"] {
            m.partitions_moved_total.with_label_values(&[event]);
        }
        for gauge in [
            &m.inbox_ahead_seconds,
            &m.inbox_floor_age_seconds,
            &m.redelivery_horizon_seconds,
            &m.inbox_retention_seconds,
        ] {
            m.registry.register(Box::new(gauge.clone()))?;
        }
        for counter in [
            &m.after_horizon_total,
            &m.applied_after_horizon_total,
            &m.future_msg_ids_total,
            &m.parked_total,
            &m.parked_applied_total,
            &m.ahead_of_clock_total,
            &m.inbox_partitions_dropped_total,
            &m.inbox_extend_failures_total,
        ] {
            m.registry.register(Box::new(counter.clone()))?;
        }
        m.registry.register(Box::new(m.inbox_partitions.clone()))?;
        m.registry.register(Box::new(m.held_partitions.clone()))?;
        m.registry.register(Box::new(m.parked_events.clone()))?;
        m.registry.register(Box::new(m.consumed_total.clone()))?;
        m.registry.register(Box::new(m.dedup_hits_total.clone()))?;
        m.registry
            .register(Box::new(m.dedup_misses_total.clone()))?;
        m.registry.register(Box::new(m.charges_total.clone()))?;
        m.registry
            .register(Box::new(m.charge_conflicts_total.clone()))?;
        m.registry
            .register(Box::new(m.dead_letters_total.clone()))?;
        m.registry
            .register(Box::new(m.msg_id_conflicts_total.clone()))?;
        m.registry.register(Box::new(m.rejected_total.clone()))?;
        m.registry.register(Box::new(m.bisections_total.clone()))?;
        m.registry
            .register(Box::new(m.processing_duration_seconds.clone()))?;
        m.registry
            .register(Box::new(m.commit_to_effect_seconds.clone()))?;
        m.registry
            .register(Box::new(m.consumer_errors_total.clone()))?;
        m.registry
            .register(Box::new(m.injected_duplicates_total.clone()))?;
        for kind in InjectedDuplicate::ALL {
            m.injected_duplicates_total
                .with_label_values(&[kind.as_str()]);
        }
        for stage in Stage::ALL {
            m.consumer_errors_total.with_label_values(&[stage.as_str()]);
        }
        Ok(m)
    }
}

/// Where payments' work failed, the `stage` of
/// `payments_consumer_errors_total`; the logs of each say it too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// A Kafka receive.
    Consume,
    /// A batch's transaction, transiently (retried).
    Apply,
    /// A batch the database refused for its data (it is split).
    Refused,
    /// Writing a dead letter, transiently (retried).
    DeadLetter,
    /// The webhook processor reading its claims.
    Scan,
    /// An offset commit refused at once.
    Commit,
    /// An asynchronous offset commit the broker did not take.
    CommitCallback,
}

impl Stage {
    /// Every stage, for the series shown before the first error.
    pub const ALL: [Self; 7] = [
        Self::Consume,
        Self::Apply,
        Self::Refused,
        Self::DeadLetter,
        Self::Scan,
        Self::Commit,
        Self::CommitCallback,
    ];

    /// The stage's label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Consume => "consume",
            Self::Apply => "apply",
            Self::Refused => "db_refused",
            Self::DeadLetter => "dead_letter",
            Self::Scan => "scan",
            Self::Commit => "commit",
            Self::CommitCallback => "commit_callback",
        }
    }
}

impl PaymentsMetrics {
    /// Counts an error of `stage`.
    pub fn error(&self, stage: Stage) {
        self.consumer_errors_total
            .with_label_values(&[stage.as_str()])
            .inc();
    }
}
