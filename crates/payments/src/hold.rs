//! Kafka partitions held on a message the inbox cannot record yet: a valid
//! event whose msg_id lies at or beyond the end of the inbox's partitions
//! (a producer's clock ahead, or partitions not created for a while; see
//! `expiry::Window::judge`). Such a message must not be dropped and must not
//! be acknowledged: its partition is sought back to it and paused, its offset
//! is never committed past it, and after a while the partition is resumed
//! and the message tried again. The messages after it that were applied
//! meanwhile come again too, as inbox hits.
//!
//! Since `crate::park`, the consume transaction returns no Kafka message as
//! held (it parks it, or dead-letters it as `ahead_of_clock`), so no
//! partition is paused on one: the pause stays only as the consumer's answer
//! to a held message should an apply path return one again.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::consumer::Consumer;
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::Instant;

use crate::delivery::Held;
use crate::kafka::PaymentsConsumer;
use crate::metrics::PaymentsMetrics;

/// The first held offset of each partition of a batch, by (topic, partition).
pub(crate) type Firsts = HashMap<(String, i32), i64>;

/// The lowest held offset of each Kafka partition among `held` (webhooks
/// have no partition and are left out).
pub(crate) fn firsts(held: &[Held]) -> Firsts {
    let mut firsts = Firsts::new();
    for h in held {
        if let Held::Kafka {
            topic,
            partition,
            offset,
        } = h
        {
            let e = firsts.entry((topic.clone(), *partition)).or_insert(*offset);
            *e = (*e).min(*offset);
        }
    }
    firsts
}

/// Whether a message at `offset` of (`topic`, `partition`) lies before the
/// partition's held message (or its partition holds nothing): it may count
/// as done.
pub(crate) fn before_hold(firsts: &Firsts, topic: &str, partition: i32, offset: i64) -> bool {
    firsts
        .get(&(topic.to_owned(), partition))
        .is_none_or(|first| offset < *first)
}

/// The paused partitions and when each is tried again.
pub(crate) struct Holds {
    wait: Duration,
    until: HashMap<(String, i32), Instant>,
}

impl Holds {
    /// Holds that try a paused partition again after `wait`.
    pub(crate) fn new(wait: Duration) -> Self {
        Self {
            wait,
            until: HashMap::new(),
        }
    }

    /// Whether any partition is paused.
    pub(crate) fn any(&self) -> bool {
        !self.until.is_empty()
    }

    /// Seeks each partition of `firsts` back to its held message and pauses
    /// it for the wait. A seek or pause that fails is logged: the partition
    /// then goes on fetching after the message, but its offset is still not
    /// committed past it, so a restart or rebalance brings it back.
    pub(crate) fn hold(
        &mut self,
        consumer: &PaymentsConsumer,
        firsts: &Firsts,
        metrics: &PaymentsMetrics,
    ) {
        for ((topic, partition), offset) in firsts {
            if let Err(error) = consumer.seek(
                topic,
                *partition,
                Offset::Offset(*offset),
                Duration::from_secs(1),
            ) {
                tracing::warn!(%error, topic, partition, offset, "seeking back to a held message failed");
            }
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(topic, *partition);
            if let Err(error) = consumer.pause(&tpl) {
                tracing::warn!(%error, topic, partition, "pausing a held partition failed");
            }
            tracing::warn!(topic, partition, offset, wait = ?self.wait,
                "partition held on a message the inbox cannot record yet; trying it again after the wait");
            self.until
                .insert((topic.clone(), *partition), Instant::now() + self.wait);
        }
        metrics.held_partitions.set(self.until.len() as i64);
    }

    /// Resumes the partitions whose wait is over.
    pub(crate) fn resume_due(&mut self, consumer: &PaymentsConsumer, metrics: &PaymentsMetrics) {
        let now = Instant::now();
        let mut tpl = TopicPartitionList::new();
        self.until.retain(|(topic, partition), until| {
            let due = *until <= now;
            if due {
                tpl.add_partition(topic, *partition);
            }
            !due
        });
        if tpl.count() > 0 {
            // A partition revoked meanwhile is not ours to resume: harmless.
            if let Err(error) = consumer.resume(&tpl) {
                tracing::debug!(%error, "resuming held partitions");
            }
        }
        metrics.held_partitions.set(self.until.len() as i64);
    }

    /// Completes when the earliest paused partition is due (never while
    /// none is paused).
    pub(crate) async fn next_due(&self) {
        match self.until.values().min() {
            Some(at) => tokio::time::sleep_until(*at).await,
            None => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn a_partition_holds_from_its_first_held_message() {
        let kafka = |partition, offset| Held::Kafka {
            topic: "t".into(),
            partition,
            offset,
        };
        let held = [
            kafka(0, 9),
            kafka(0, 4),
            kafka(2, 7),
            Held::Webhook {
                msg_id: Uuid::nil(),
            },
        ];
        let f = firsts(&held);
        assert_eq!(f.len(), 2, "webhooks have no partition");
        assert_eq!(f[&("t".to_owned(), 0)], 4);
        assert!(before_hold(&f, "t", 0, 3));
        assert!(!before_hold(&f, "t", 0, 4), "the held message is not done");
        assert!(!before_hold(&f, "t", 0, 5), "nor what comes after it");
        assert!(
            before_hold(&f, "t", 1, 100),
            "another partition holds nothing"
        );
        assert!(before_hold(&f, "u", 0, 100), "another topic holds nothing");
    }
}
