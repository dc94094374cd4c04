//! The Kafka consumer client: built with cooperative-sticky assignment and
//! manual commits, and its context, which tracks this member's assignment
//! and committed offsets (so a revoked partition's offsets are never
//! committed), samples the lag of what it owns, counts failed commits and
//! turns a fatal client error into the end of the process.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pipeline::kafka::FatalState;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

/// The consumer's callbacks: tracks this member's assignment so that offsets
/// of revoked partitions are never committed (a late commit could move the
/// new owner's offset back) and their lag series go, counts failed offset
/// commits, and turns a fatal client error into the end of the process.
pub struct RebalanceContext {
    assigned: Mutex<HashSet<(String, i32)>>,
    /// The group's committed offset of each owned partition, as far as this
    /// member knows: read once from the broker after the assignment, then
    /// from its own commits.
    committed: Mutex<HashMap<(String, i32), i64>>,
    /// Per owned partition, the oldest message this member has taken into a
    /// batch at or past the committed offset: `(offset, timestamp in ms)`
    /// ([`RebalanceContext::record_taken`]), for the lag's age.
    taken: Mutex<HashMap<(String, i32), (i64, i64)>>,
    /// Fired by a fatal client error (e.g. this static member was fenced by
    /// another process with the same `group.instance.id`): see [`FatalState`].
    fatal: FatalState,
    commit_failures: prometheus::IntCounter,
    lag: prometheus::IntGaugeVec,
    lag_age: prometheus::GaugeVec,
    moved: prometheus::IntCounterVec,
}

impl RebalanceContext {
    /// A context that fires `fatal` on a fatal client error, counts failed
    /// asynchronous offset commits in `commit_failures`, and holds `lag`
    /// (labels `topic`, `partition`) and `lag_age` (the same labels, see
    /// [`lag_age_seconds`]): set by the lag sampler for the partitions this
    /// member owns, a revoked partition's series removed, and counts the
    /// partitions each rebalance moves in `moved` (label `event`:
    /// `assigned`, `revoked`).
    pub fn new(
        fatal: FatalState,
        commit_failures: prometheus::IntCounter,
        lag: prometheus::IntGaugeVec,
        lag_age: prometheus::GaugeVec,
        moved: prometheus::IntCounterVec,
    ) -> Self {
        Self {
            assigned: Mutex::default(),
            committed: Mutex::default(),
            taken: Mutex::default(),
            fatal,
            commit_failures,
            lag,
            lag_age,
            moved,
        }
    }

    /// Records a batch taken for processing: for each partition, its oldest
    /// message not yet covered by a commit, whose timestamp is the lag's
    /// age ([`lag_age_seconds`]). One lock per batch, no broker request.
    pub(crate) fn record_taken(&self, batch: &[OwnedMessage]) {
        let committed = self.known_commits();
        let Ok(mut taken) = self.taken.lock() else {
            return;
        };
        for m in batch {
            let Some(ts) = m.timestamp().to_millis() else {
                continue;
            };
            let key = (m.topic().to_owned(), m.partition());
            let covered = |offset: i64| committed.get(&key).is_some_and(|&c| offset < c);
            match taken.get(&key) {
                // An older message not yet committed stays the oldest, unless
                // this one is older still (a seek back).
                Some(&(offset, _)) if !covered(offset) && offset <= m.offset() => {}
                _ => {
                    taken.insert(key, (m.offset(), ts));
                }
            }
        }
    }

    pub(crate) fn owns(&self, topic: &str, partition: i32) -> bool {
        self.assigned
            .lock()
            .map(|a| a.contains(&(topic.to_owned(), partition)))
            .unwrap_or(false)
    }

    /// Records the offsets this member committed, for the lag of the
    /// partitions it still owns. Taken when the asynchronous commit is handed
    /// to the client: a commit the broker then refuses is counted
    /// (`commit_callback`) and the lag reads low until the next one.
    pub(crate) fn record_commit(&self, tpl: &TopicPartitionList) {
        if let Ok(mut committed) = self.committed.lock() {
            for e in tpl.elements() {
                if let Offset::Offset(o) = e.offset()
                    && self.owns(e.topic(), e.partition())
                {
                    committed.insert((e.topic().to_owned(), e.partition()), o);
                }
            }
        }
    }

    /// The committed offset of each owned partition, as far as this member
    /// knows (a copy).
    pub(crate) fn known_commits(&self) -> HashMap<(String, i32), i64> {
        self.committed.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Partitions currently assigned to this member.
    pub fn assignment(&self) -> Vec<(String, i32)> {
        self.assigned
            .lock()
            .map(|a| a.iter().cloned().collect())
            .unwrap_or_default()
    }
}

impl ClientContext for RebalanceContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.fatal.on_error("consumer", error, reason);
    }
}

/// The age of a partition's lag, in seconds: how long its oldest message
/// not covered by the committed offset has waited, the figure to hold
/// against the topic's `retention.ms` (the broker deletes by time, consumed
/// or not).
///
/// Zero without lag. With lag, `now_ms` minus the timestamp of `taken` (the
/// oldest message this member took into a batch, `(offset, timestamp in
/// ms)`) when it is at or past `committed`: that message is the one at the
/// committed offset, or after it when this member skipped nothing it knows
/// of. Otherwise this member has not taken the partition's next message yet
/// (just assigned, or stuck on another batch): `waiting`, the seconds since
/// the sampler first saw that, a lower bound that still grows with a stall.
pub fn lag_age_seconds(
    lag: i64,
    committed: i64,
    taken: Option<(i64, i64)>,
    now_ms: i64,
    waiting: f64,
) -> f64 {
    if lag <= 0 {
        return 0.0;
    }
    match taken {
        Some((offset, ts)) if offset >= committed => {
            ((now_ms - ts).max(0) as f64 / 1e3).max(waiting)
        }
        _ => waiting,
    }
}

/// Every `every`: the lag of each partition this member owns, as the
/// partition's high watermark minus the group's committed offset. It runs
/// beside the consumer loop, so a consumer stuck on its database still shows
/// its lag growing. The watermarks are asked of the partition's leader; the
/// committed offset is the one this member last committed, and
/// only a partition new to this member has its committed offset read from
/// the group coordinator, once: no request of the sampler's queues ahead of
/// the group's heartbeats on the coordinator's connection in the steady
/// state (a bench run saw sessions time out on an overloaded broker while
/// an earlier version asked the coordinator every second). A revoked
/// partition loses its series in `pre_rebalance`.
pub(crate) async fn sample_lag(
    consumer: Arc<PaymentsConsumer>,
    every: Duration,
    cancel: CancellationToken,
) {
    // Partitions with lag whose next message this member has not taken, and
    // since when.
    let mut waiting: HashMap<(String, i32), Instant> = HashMap::new();
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = cancel.cancelled() => return,
        }
        let c = consumer.clone();
        match tokio::task::spawn_blocking(move || read_lag(&c)).await {
            Ok(lags) => {
                let context = consumer.context();
                let committed = context.known_commits();
                let taken = context.taken.lock().map(|t| t.clone()).unwrap_or_default();
                let now_ms = chrono::Utc::now().timestamp_millis();
                for (key, value) in lags {
                    // Re-checked: a revoke may have come meanwhile.
                    if !context.owns(&key.0, key.1) {
                        continue;
                    }
                    let (topic, partition) = (key.0.as_str(), key.1.to_string());
                    context
                        .lag
                        .with_label_values(&[topic, &partition])
                        .set(value);
                    let from = committed.get(&key).copied().unwrap_or(-1);
                    let next = taken.get(&key).copied().filter(|&(o, _)| o >= from);
                    let since = if value > 0 && next.is_none() {
                        waiting
                            .entry(key.clone())
                            .or_insert_with(Instant::now)
                            .elapsed()
                    } else {
                        waiting.remove(&key);
                        Duration::ZERO
                    };
                    context
                        .lag_age
                        .with_label_values(&[topic, &partition])
                        .set(lag_age_seconds(
                            value,
                            from,
                            next,
                            now_ms,
                            since.as_secs_f64(),
                        ));
                }
                waiting.retain(|(t, p), _| context.owns(t, *p));
            }
            Err(error) => tracing::debug!(%error, "consumer lag task"),
        }
    }
}

/// The lag of every partition this member owns whose offsets are known (see
/// [`partition_lag`]).
fn read_lag(consumer: &PaymentsConsumer) -> Vec<((String, i32), i64)> {
    let context = consumer.context();
    let owned = context.assignment();
    let unknown: Vec<&(String, i32)> = {
        let committed = context.known_commits();
        owned
            .iter()
            .filter(|k| !committed.contains_key(*k))
            .collect()
    };
    if !unknown.is_empty() {
        let mut tpl = TopicPartitionList::new();
        for (topic, partition) in &unknown {
            tpl.add_partition(topic, *partition);
        }
        match consumer.committed_offsets(tpl, Duration::from_secs(5)) {
            Ok(read) => {
                if let Ok(mut committed) = context.committed.lock() {
                    for e in read.elements() {
                        let offset = match e.offset() {
                            Offset::Offset(o) => o,
                            _ => -1, // nothing committed yet
                        };
                        // A commit of this member's may have landed meanwhile.
                        committed
                            .entry((e.topic().to_owned(), e.partition()))
                            .or_insert(offset);
                    }
                }
            }
            Err(error) => tracing::debug!(%error, "reading committed offsets for the lag"),
        }
    }
    let committed = context.known_commits();
    owned
        .into_iter()
        .filter_map(|key| {
            let offset = *committed.get(&key)?;
            let (low, high) = consumer
                .fetch_watermarks(&key.0, key.1, Duration::from_secs(5))
                .ok()?;
            partition_lag(high, offset, low).map(|lag| (key, lag))
        })
        .collect()
}

/// A partition's lag: its high watermark minus the committed offset. Before
/// the group has committed anything there, the consumer starts from the
/// earliest offset (`auto.offset.reset`), so the lag is the watermark minus
/// the partition's low watermark. `None` while the offsets it needs are
/// unknown (negative). Never negative:
/// a watermark older than the commit counts as zero lag.
pub fn partition_lag(high_watermark: i64, committed: i64, low_watermark: i64) -> Option<i64> {
    let from = if committed >= 0 {
        committed
    } else {
        low_watermark
    };
    (high_watermark >= 0 && from >= 0).then(|| (high_watermark - from).max(0))
}

impl ConsumerContext for RebalanceContext {
    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        if let Err(error) = result {
            // Harmless for correctness (the batch is redelivered and is a
            // no-op), but a consumer whose commits keep failing redoes its
            // work after every restart: count it.
            self.commit_failures.inc();
            tracing::warn!(%error, "offset commit failed; the batch will be redelivered (no-op)");
        }
    }

    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance
            && let Ok(mut assigned) = self.assigned.lock()
        {
            for e in tpl.elements() {
                assigned.remove(&(e.topic().to_owned(), e.partition()));
                if let Ok(mut committed) = self.committed.lock() {
                    committed.remove(&(e.topic().to_owned(), e.partition()));
                }
                if let Ok(mut taken) = self.taken.lock() {
                    taken.remove(&(e.topic().to_owned(), e.partition()));
                }
                let _ = self
                    .lag
                    .remove_label_values(&[e.topic(), &e.partition().to_string()]);
                let _ = self
                    .lag_age
                    .remove_label_values(&[e.topic(), &e.partition().to_string()]);
            }
            self.moved
                .with_label_values(&["revoked"])
                .inc_by(tpl.count() as u64);
            tracing::info!(
                revoked = tpl.count(),
                owned = assigned.len(),
                "partitions revoked"
            );
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance
            && let Ok(mut assigned) = self.assigned.lock()
        {
            for e in tpl.elements() {
                assigned.insert((e.topic().to_owned(), e.partition()));
            }
            self.moved
                .with_label_values(&["assigned"])
                .inc_by(tpl.count() as u64);
            tracing::info!(
                assigned = tpl.count(),
                owned = assigned.len(),
                "partitions assigned"
            );
        }
    }
}

/// The consumer type.
pub type PaymentsConsumer = StreamConsumer<RebalanceContext>;

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::types::RDKafkaErrorCode;

    #[test]
    fn the_lags_age_is_its_oldest_uncommitted_messages_or_the_wait_for_it() {
        let now = 1_000_000;
        assert_eq!(
            lag_age_seconds(0, 100, Some((100, 0)), now, 50.0),
            0.0,
            "no lag, no age"
        );
        assert_eq!(
            lag_age_seconds(20, 100, Some((100, now - 90_000)), now, 0.0),
            90.0,
            "the message at the committed offset"
        );
        assert_eq!(
            lag_age_seconds(20, 100, Some((99, now - 90_000)), now, 7.0),
            7.0,
            "a message the commit covers is not the lag's: the wait since"
        );
        assert_eq!(
            lag_age_seconds(20, 100, None, now, 7.0),
            7.0,
            "nothing taken yet"
        );
        assert_eq!(
            lag_age_seconds(20, 100, Some((100, now + 5_000)), now, 0.0),
            0.0,
            "a producer's clock ahead: never negative"
        );
        assert_eq!(
            lag_age_seconds(20, -1, Some((0, now - 1_000)), now, 0.0),
            1.0,
            "nothing committed yet: the first message taken"
        );
    }

    #[test]
    fn lag_is_the_watermark_minus_the_committed_offset_or_the_earliest() {
        assert_eq!(partition_lag(120, 100, 0), Some(20));
        assert_eq!(partition_lag(100, 100, 0), Some(0));
        assert_eq!(partition_lag(99, 100, 0), Some(0), "never negative");
        assert_eq!(
            partition_lag(120, -1001, 20),
            Some(100),
            "nothing committed yet: from the earliest offset"
        );
        assert_eq!(partition_lag(120, -1001, -1), None, "neither known");
        assert_eq!(partition_lag(-1, 100, 0), None, "no watermark fetched yet");
    }

    // The broker side of fencing (a second process with the same
    // group.instance.id) is tested against the stack's Kafka in
    // tests/it/kafka/group.rs. The mapping of a fatal error to
    // the end of the process is `pipeline::kafka::FatalState`'s, tested
    // there; this checks the consumer's own callbacks.
    #[test]
    fn a_fatal_error_fires_the_state_and_failed_commits_are_counted() {
        let fatal = FatalState::new();
        let commits = prometheus::IntCounter::new("c", "c").expect("counter");
        let lag =
            prometheus::IntGaugeVec::new(prometheus::Opts::new("l", "l"), &["topic", "partition"])
                .expect("gauge");
        let moved = prometheus::IntCounterVec::new(prometheus::Opts::new("m", "m"), &["event"])
            .expect("counter");
        let age =
            prometheus::GaugeVec::new(prometheus::Opts::new("a", "a"), &["topic", "partition"])
                .expect("gauge");
        let context = RebalanceContext::new(fatal.clone(), commits.clone(), lag, age, moved);
        context.error(
            KafkaError::Global(RDKafkaErrorCode::Fatal),
            "static consumer fenced by other consumer with same group.instance.id",
        );
        assert!(fatal.reason().is_some_and(|r| r.contains("fenced")));

        context.commit_callback(Ok(()), &TopicPartitionList::new());
        assert_eq!(commits.get(), 0);
        context.commit_callback(
            Err(KafkaError::ConsumerCommit(
                RDKafkaErrorCode::RebalanceInProgress,
            )),
            &TopicPartitionList::new(),
        );
        assert_eq!(commits.get(), 1, "a failed async commit is counted");
    }
}
