//! The Kafka transport's loop: batches filled from the consumer (the next
//! one fetched while the current one's transaction runs), handed to
//! [`crate::process`], their offsets committed only after it committed, held
//! partitions paused, injected duplicates planned.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use pipeline::contract::InjectedDuplicate;
use pipeline::crash::Crasher;
use pipeline::kafka::FatalState;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::{BorrowedMessage, Message, OwnedMessage};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, GroupProtocol};
use crate::kafka::{PaymentsConsumer, RebalanceContext, sample_lag};
use crate::metrics::{PaymentsMetrics, Stage};
use crate::process::{Apply, process};
use crate::{dup, hold};

/// Builds the consumer and subscribes it to the topic: manual offset commits, earliest reset, and
/// cooperative-sticky assignment: a rebalance revokes only the partitions
/// that change owner (KIP-429), so a member joining or leaving does not
/// stop the whole group. The in-flight batches of a revoked partition finish
/// their transactions (the inbox makes a second owner's re-read of them a
/// no-op) and their offsets are dropped, never committed over the new
/// owner's ([`Commits::take`]); the context is [`RebalanceContext`].
pub fn subscribe(config: &Config, context: RebalanceContext) -> anyhow::Result<PaymentsConsumer> {
    // The client config file (TLS, SASL) first; these override it.
    let mut client = config.kafka.client_config()?;
    if let Some(id) = &config.group_instance_id {
        client.set("group.instance.id", id);
    }
    client
        .set("group.id", &config.group_id)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", config.fetch_wait_max_ms.to_string())
        .set("enable.partition.eof", "false");
    match config.group_protocol {
        GroupProtocol::Classic => client
            .set("session.timeout.ms", config.session_timeout_ms.to_string())
            .set(
                "heartbeat.interval.ms",
                config.heartbeat_interval_ms().to_string(),
            )
            .set("partition.assignment.strategy", "cooperative-sticky"),
        // The coordinator's own assignor, session and heartbeat.
        GroupProtocol::Consumer => client.set("group.protocol", "consumer"),
    };
    let consumer: PaymentsConsumer = client
        .create_with_context(context)
        .context("create kafka consumer")?;
    consumer
        .subscribe(&[&config.kafka.kafka_topic])
        .context("subscribe")?;
    Ok(consumer)
}

/// How [`consume`] ended when the group's coordinator fenced this static
/// member (`FencedInstanceId`): it gave the member's `group.instance.id` to
/// another join. That join is either a second process started with the same
/// id, or this member's own client rejoining after the coordinator lost
/// track of it (seen when the coordinator was partitioned from the other
/// brokers: every static member was fenced once). The client is fatal
/// either way; [`crate::run`] tells the two apart by what happens after one
/// rejoin with a fresh client.
#[derive(Debug, thiserror::Error)]
#[error("kafka consumer fenced (FencedInstanceId): {0}")]
pub struct Fenced(pub String);

/// The Kafka consumer, until `cancel` fires or the client is in a fatal
/// state ([`Fenced`] when it was fenced).
pub(crate) async fn consume(
    config: &Config,
    pool: &sqlx::PgPool,
    apply: Apply,
    crasher: &Crasher,
    shared_metrics: &Arc<PaymentsMetrics>,
    cancel: &CancellationToken,
) -> anyhow::Result<()> {
    let metrics: &PaymentsMetrics = shared_metrics;
    let format = config.input_format;
    let cfg = config.clone();
    let fatal = FatalState::new();
    let context = RebalanceContext::new(
        fatal.clone(),
        metrics
            .consumer_errors_total
            .with_label_values(&[Stage::CommitCallback.as_str()]),
        metrics.consumer_lag.clone(),
        metrics.consumer_lag_age_seconds.clone(),
        metrics.partitions_moved_total.clone(),
    );
    let consumer = Arc::new(
        tokio::task::spawn_blocking(move || subscribe(&cfg, context))
            .await
            .context("create consumer task")??,
    );
    let sampling = cancel.child_token();
    let lag_task = tokio::spawn(sample_lag(
        consumer.clone(),
        Duration::from_millis(config.lag_sample_ms),
        sampling.clone(),
    ));
    tracing::info!(group = %config.group_id, topic = %config.kafka.kafka_topic, "payments consuming");
    let mut injector = dup::Injector::new(config.dup.clone());
    if injector.enabled() {
        tracing::warn!(
            rate = config.dup.dup_rate,
            kind = ?config.dup.dup_kind,
            "chaos: injecting duplicate deliveries (--dup-rate)"
        );
    }
    let linger = Duration::from_millis(config.batch_linger_ms);
    let max = config.batch_size.max(1);
    let mut commits = Commits::new(Duration::from_millis(config.commit_interval_ms));
    let mut holds = hold::Holds::new(Duration::from_millis(config.hold_retry_ms));
    // The batch in hand: filled here, or fetched while the previous one's
    // transaction ran.
    let mut batch: Vec<OwnedMessage> = Vec::with_capacity(max);
    loop {
        // Looked at on every turn, not only when idle: under a steady load
        // the prefetch always has a batch in hand, and a SIGTERM waiting for
        // an empty one became the supervisor's SIGKILL (no final commit, no
        // leaving the group). The batch in hand is dropped uncommitted: the
        // partitions' next owner gets it again.
        if cancel.is_cancelled() {
            break;
        }
        if holds.any() {
            holds.resume_due(&consumer, metrics);
        }
        if batch.is_empty() {
            tokio::select! {
                () = fill_batch(&consumer, &mut batch, max, linger, metrics) => {}
                // Idle with offsets not yet committed: commit them when due.
                () = commits.due_in(), if commits.any() => {
                    commits.flush(&consumer, metrics, CommitMode::Async);
                }
                // A held partition's wait is over: resumed next turn.
                () = holds.next_due(), if holds.any() => {}
                () = cancel.cancelled() => break,
                () = fatal.fired() => break,
            }
        }
        // A fatal error reaches the error callback as its underlying code
        // (e.g. FencedInstanceId), and the receive as an error: ask the client.
        if fatal.check("consumer", consumer.client()) {
            break;
        }
        if batch.is_empty() {
            continue;
        }
        consumer.context().record_taken(&batch);
        // Pipelined: the next batch is fetched while this one's transaction
        // runs. The fetch stops when the transaction ends (a receive is
        // cancel-safe, and what it received is in `next`); its messages'
        // offsets are committed only after their own transaction, next turn.
        let mut next = Vec::with_capacity(max);
        let applied = {
            let fetch = fill_batch(&consumer, &mut next, max, linger, metrics);
            tokio::pin!(fetch);
            let work = process(pool, apply, format, &batch, crasher, metrics, cancel);
            tokio::pin!(work);
            let mut fetching = true;
            loop {
                tokio::select! {
                    biased;
                    applied = &mut work => break applied,
                    () = &mut fetch, if fetching => fetching = false,
                    // Earlier batches' offsets, while this one waits on a
                    // failing database: committed when due, so the lag
                    // shows only what is not applied yet.
                    () = commits.due_in(), if commits.any() => {
                        commits.flush(&consumer, metrics, CommitMode::Async);
                    }
                }
            }
        };
        let Some(held) = applied else {
            break; // cancelled while the database was failing; nothing committed
        };
        // A held message's partition goes back to it and waits; what came
        // after it in the batch was applied, but its offset is not
        // committed past the held one, and the copies prefetched are dropped.
        let firsts = hold::firsts(&held);
        if !firsts.is_empty() {
            holds.hold(&consumer, &firsts, metrics);
            next.retain(|m| !firsts.contains_key(&(m.topic().to_owned(), m.partition())));
        }
        commits.add(
            batch
                .iter()
                .filter(|m| hold::before_hold(&firsts, m.topic(), m.partition(), m.offset())),
        );
        if commits.due() {
            commits.flush(&consumer, metrics, CommitMode::Async);
        }
        // Injected duplicates come only now, after the originals committed
        // (none for a batch that held a message: its partition was sought).
        let plan = if firsts.is_empty() {
            injector.plan(&batch)
        } else {
            dup::Plan::default()
        };
        let rewound = dup::seek_back(&consumer, &plan, metrics);
        // A rewound partition's messages fetched before the seek come again
        // after it, in order: drop these copies.
        next.retain(|m| !rewound.contains(&(m.topic().to_owned(), m.partition())));
        if !plan.reprocess.is_empty() {
            // Applied again in a transaction of its own; offsets are already
            // committed, so nothing to commit for them.
            if process(
                pool,
                apply,
                format,
                &plan.reprocess,
                crasher,
                metrics,
                cancel,
            )
            .await
            .is_none()
            {
                break;
            }
            metrics
                .injected_duplicates_total
                .with_label_values(&[InjectedDuplicate::Reprocess.as_str()])
                .inc_by(plan.reprocess.len() as u64);
        }
        batch = next;
    }
    let fatal_reason = fatal.reason();
    if fatal_reason.is_none() {
        // What was applied since the last commit, so the next owner does
        // not redeliver it; then leaving the group hands the partitions
        // over at once instead of after the session timeout.
        let (c, m) = (consumer.clone(), shared_metrics.clone());
        let _ = tokio::task::spawn_blocking(move || {
            commits.flush(&c, &m, CommitMode::Sync);
            c.unsubscribe();
        })
        .await;
    }
    sampling.cancel();
    let _ = lag_task.await;
    let fenced = consumer
        .client()
        .fatal_error()
        .is_some_and(|(code, _)| code == RDKafkaErrorCode::FencedInstanceId);
    match fatal_reason {
        // Nothing of the batch in hand was committed: it is redelivered
        // to whoever takes the partitions.
        Some(reason) if fenced => Err(Fenced(reason).into()),
        Some(reason) => anyhow::bail!("kafka consumer in a fatal state: {reason}"),
        None => Ok(()),
    }
}

/// Fills `batch` up to `max`: waits for a first message if it has none,
/// then takes whatever else arrives within `linger`. Cancel-safe: dropped at
/// any point, `batch` holds every message received (a receive hands over a
/// message only when it completes).
async fn fill_batch(
    consumer: &PaymentsConsumer,
    batch: &mut Vec<OwnedMessage>,
    max: usize,
    linger: Duration,
    metrics: &PaymentsMetrics,
) {
    if batch.is_empty() && !keep(batch, consumer.recv().await, metrics) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        return;
    }
    let deadline = tokio::time::Instant::now() + linger;
    while batch.len() < max {
        let Ok(received) = tokio::time::timeout_at(deadline, consumer.recv()).await else {
            break; // lingered long enough
        };
        if !keep(batch, received, metrics) {
            break;
        }
    }
}

/// Adds a received message to `batch` (true), or counts and logs the
/// receive's error (false).
fn keep(
    batch: &mut Vec<OwnedMessage>,
    received: KafkaResult<BorrowedMessage<'_>>,
    metrics: &PaymentsMetrics,
) -> bool {
    match received {
        Ok(m) => {
            batch.push(m.detach());
            metrics.consumed_total.inc();
            true
        }
        Err(error) => {
            metrics.error(Stage::Consume);
            tracing::warn!(%error, "kafka receive failed");
            false
        }
    }
}

/// The offsets to commit: after each batch's transaction its partitions'
/// next offsets are added, and they go to the broker in one commit at most
/// every `interval` (every batch when it is zero). Offsets never go back: an
/// offset at or below the partition's committed one as the consumer context
/// knows it (e.g. re-added after an injected redelivery rewound the
/// partition) is left out.
struct Commits {
    interval: Duration,
    pending: BTreeMap<(String, i32), i64>,
    last: tokio::time::Instant,
}

impl Commits {
    /// The first batch's offsets are due at once: a life killed within
    /// the interval still moves its partitions on by a batch (a consumer
    /// killed every few batches would otherwise commit nothing, ever).
    fn new(interval: Duration) -> Self {
        let now = tokio::time::Instant::now();
        Self {
            interval,
            pending: BTreeMap::new(),
            last: now.checked_sub(interval).unwrap_or(now),
        }
    }

    /// Adds a batch whose transaction committed.
    fn add<'m>(&mut self, batch: impl IntoIterator<Item = &'m OwnedMessage>) {
        for m in batch {
            let next = m.offset() + 1;
            let e = self
                .pending
                .entry((m.topic().to_owned(), m.partition()))
                .or_insert(next);
            *e = (*e).max(next);
        }
    }

    fn any(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether the pending offsets are due.
    fn due(&self) -> bool {
        self.any() && self.last.elapsed() >= self.interval
    }

    /// Completes when the pending offsets are due.
    async fn due_in(&self) {
        tokio::time::sleep_until(self.last + self.interval).await;
    }

    /// Takes the pending offsets to commit: of the partitions `owns` says
    /// this member still owns, above what `committed` says each has (a
    /// revoked partition's are dropped: a late commit could move the new
    /// owner's offset back; it redelivers them instead, as no-ops). Restarts
    /// the interval.
    fn take(
        &mut self,
        owns: impl Fn(&str, i32) -> bool,
        committed: &HashMap<(String, i32), i64>,
    ) -> Vec<((String, i32), i64)> {
        self.last = tokio::time::Instant::now();
        std::mem::take(&mut self.pending)
            .into_iter()
            .filter(|(key, offset)| {
                owns(&key.0, key.1) && committed.get(key).is_none_or(|c| offset > c)
            })
            .collect()
    }

    /// Commits what [`Commits::take`] takes, against the consumer context's
    /// assignment and known commits, and records it there.
    fn flush(&mut self, consumer: &PaymentsConsumer, metrics: &PaymentsMetrics, mode: CommitMode) {
        let context = consumer.context();
        let mut tpl = TopicPartitionList::new();
        for ((topic, partition), offset) in
            self.take(|t, p| context.owns(t, p), &context.known_commits())
        {
            if let Err(error) = tpl.add_partition_offset(&topic, partition, Offset::Offset(offset))
            {
                tracing::warn!(%error, "build offset list");
            }
        }
        if tpl.count() == 0 {
            return;
        }
        match consumer.commit(&tpl, mode) {
            Ok(()) => context.record_commit(&tpl),
            Err(error) => {
                metrics.error(Stage::Commit);
                tracing::warn!(%error, "offset commit failed; the batches will be redelivered (no-ops)");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dup::tests::msg;

    #[tokio::test]
    async fn commits_coalesce_to_each_partitions_latest_offset_and_never_go_back() {
        let mut c = Commits::new(Duration::from_secs(3600));
        assert!(!c.any() && !c.due());
        let all = |_: &str, _: i32| true;
        let mut known = HashMap::new();
        c.add(&[msg(2, 0)]);
        assert!(c.due(), "a life's first batch is due at once");
        assert_eq!(c.take(all, &known), vec![(("t".to_owned(), 2), 1)]);
        c.add(&[msg(0, 10), msg(1, 5), msg(0, 11)]);
        c.add(&[msg(0, 12), msg(1, 4)]);
        assert!(c.any());
        assert!(!c.due(), "then not before the interval");
        assert_eq!(
            c.take(all, &known),
            vec![(("t".to_owned(), 0), 13), (("t".to_owned(), 1), 6)]
        );
        assert!(!c.any());
        // What the flush records in the consumer context.
        known.insert(("t".to_owned(), 0), 13);
        known.insert(("t".to_owned(), 1), 6);
        // An injected redelivery of partition 0 re-adds offsets already
        // committed: nothing to commit for them.
        c.add(&[msg(0, 10), msg(0, 12)]);
        assert!(
            c.take(all, &known).is_empty(),
            "an offset at or below the committed one is left out"
        );
        c.add(&[msg(0, 13)]);
        assert_eq!(c.take(all, &known), vec![(("t".to_owned(), 0), 14)]);
    }

    #[tokio::test]
    async fn a_revoked_partitions_offsets_are_dropped_and_it_comes_back_clean() {
        let mut c = Commits::new(Duration::ZERO);
        let all = |_: &str, _: i32| true;
        let mut known = HashMap::new();
        c.add(&[msg(0, 100), msg(1, 100)]);
        assert!(c.due(), "an interval of 0 commits after every batch");
        assert_eq!(
            c.take(|_, p| p == 1, &known),
            vec![(("t".to_owned(), 1), 101)]
        );
        c.add(&[msg(1, 200)]);
        assert_eq!(c.take(all, &known), vec![(("t".to_owned(), 1), 201)]);
        known.insert(("t".to_owned(), 1), 201);
        // Partition 1 revoked (the context forgets its committed offset),
        // then assigned again with the group's offset moved back (another
        // member's reset): its offsets count again.
        known.remove(&("t".to_owned(), 1));
        c.add(&[msg(1, 50)]);
        assert_eq!(c.take(all, &known), vec![(("t".to_owned(), 1), 51)]);
    }
}
