//! Duplicate delivery injected on purpose (chaos `--dup-rate`), so that the
//! experiments do not have to wait for the broker and the relay to produce
//! duplicates by accident. Off unless `--dup-rate` is above 0.
//!
//! Two kinds, both only after a batch's transaction and offset commit, so
//! every injected duplicate arrives after its original took effect, which is
//! exactly what a real redelivery looks like:
//!
//! * `reprocess`: the partition's messages of the batch are applied again in
//!   a transaction of their own (what a consumer that crashed after the DB
//!   commit and before the offset commit does on restart);
//! * `redeliver`: the consumer seeks the partition back to the first offset of
//!   the batch, and the broker delivers those messages again (offsets already
//!   committed are consumed a second time and committed again).
//!
//! Either way the inbox must turn every injected duplicate into a no-op: the
//! `payments_injected_duplicates_total` counter is a lower bound for
//! `payments_dedup_hits_total`, and recon proves that no effect doubled.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use clap::{Args, ValueEnum};
use pipeline::contract::InjectedDuplicate;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::Offset;
use rdkafka::consumer::Consumer;
use rdkafka::message::{Message, OwnedMessage};

use crate::kafka::PaymentsConsumer;
use crate::metrics::PaymentsMetrics;

/// Which duplicates `--dup-rate` injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DupKind {
    /// Apply the messages again in a second transaction.
    Reprocess,
    /// Seek back: the broker delivers the messages again.
    Redeliver,
    /// Each duplicated slice is one of the two, chosen at random.
    Both,
}

/// Duplicate-delivery injection settings (chaos testing only).
#[derive(Debug, Clone, Args)]
pub struct DupArgs {
    /// Chaos testing: the probability that a consumed batch's messages of one
    /// partition are delivered a second time after they were committed, so
    /// about this fraction of all messages arrives twice. 0 = off.
    #[arg(long, env = pipeline::contract::env::PAYMENTS_DUP_RATE, default_value_t = 0.0, value_parser = fraction)]
    pub dup_rate: f64,

    /// How the duplicates arrive: re-processed in a second transaction, really
    /// redelivered by the broker after a seek back, or both (half each).
    #[arg(long, env = pipeline::contract::env::PAYMENTS_DUP_KIND, value_enum, default_value_t = DupKind::Both)]
    pub dup_kind: DupKind,
}

impl Default for DupArgs {
    fn default() -> Self {
        Self {
            dup_rate: 0.0,
            dup_kind: DupKind::Both,
        }
    }
}

fn fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a probability in [0, 1]"))
    }
}

/// The duplicates planned for one committed batch.
#[derive(Debug, Default)]
pub struct Plan {
    /// Messages to apply again, in a transaction of their own.
    pub reprocess: Vec<OwnedMessage>,
    /// (topic, partition, offset, messages): seek there, the broker redelivers.
    pub redeliver: Vec<(String, i32, i64, usize)>,
}

/// Decides which slices of a committed batch arrive a second time.
#[derive(Debug)]
pub struct Injector {
    args: DupArgs,
    rng: StdRng,
    /// Per partition, the highest offset already duplicated: a message is
    /// duplicated at most once, so a redelivered slice is not redelivered
    /// again (at rate 1 that would never end).
    horizon: HashMap<(String, i32), i64>,
}

impl Injector {
    /// An injector for `args` (does nothing when the rate is 0).
    pub fn new(args: DupArgs) -> Self {
        Self {
            args,
            rng: StdRng::from_os_rng(),
            horizon: HashMap::new(),
        }
    }

    /// Whether any duplicate will ever be injected.
    pub fn enabled(&self) -> bool {
        self.args.dup_rate > 0.0
    }

    /// Plans the duplicates of `batch`: per partition, with probability
    /// `dup_rate`, the partition's messages of the batch arrive again.
    pub fn plan(&mut self, batch: &[OwnedMessage]) -> Plan {
        let mut plan = Plan::default();
        if !self.enabled() {
            return plan;
        }
        let mut slices: BTreeMap<(&str, i32), Vec<&OwnedMessage>> = BTreeMap::new();
        for m in batch {
            let done = self
                .horizon
                .get(&(m.topic().to_owned(), m.partition()))
                .copied()
                .unwrap_or(-1);
            if m.offset() > done {
                slices
                    .entry((m.topic(), m.partition()))
                    .or_default()
                    .push(m);
            }
        }
        for ((topic, partition), messages) in slices {
            if !self.rng.random_bool(self.args.dup_rate) {
                continue;
            }
            let last = messages.iter().map(|m| m.offset()).max().unwrap_or(0);
            self.horizon.insert((topic.to_owned(), partition), last);
            let redeliver = match self.args.dup_kind {
                DupKind::Reprocess => false,
                DupKind::Redeliver => true,
                DupKind::Both => self.rng.random_bool(0.5),
            };
            if redeliver {
                let first = messages.iter().map(|m| m.offset()).min().unwrap_or(0);
                plan.redeliver
                    .push((topic.to_owned(), partition, first, messages.len()));
            } else {
                plan.reprocess
                    .extend(messages.into_iter().map(|m| (*m).clone()));
            }
        }
        plan
    }
}

/// Seeks back for the planned redeliveries and counts what was injected;
/// returns the partitions it rewound (their messages fetched before the seek
/// arrive again after it). A failed seek injects nothing (logged); it never
/// affects correctness.
pub fn seek_back(
    consumer: &PaymentsConsumer,
    plan: &Plan,
    metrics: &PaymentsMetrics,
) -> HashSet<(String, i32)> {
    let mut rewound = HashSet::new();
    for (topic, partition, offset, count) in &plan.redeliver {
        match consumer.seek(
            topic,
            *partition,
            Offset::Offset(*offset),
            Duration::from_secs(1),
        ) {
            Ok(()) => {
                rewound.insert((topic.clone(), *partition));
                metrics
                    .injected_duplicates_total
                    .with_label_values(&[InjectedDuplicate::Redeliver.as_str()])
                    .inc_by(*count as u64);
            }
            Err(error) => {
                tracing::debug!(%error, topic, partition, offset, "dup-rate: seek back failed")
            }
        }
    }
    rewound
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rdkafka::Timestamp;

    /// A message of topic `t` (payload `{}`), for the crate's tests.
    pub(crate) fn msg(partition: i32, offset: i64) -> OwnedMessage {
        OwnedMessage::new(
            Some(b"{}".to_vec()),
            None,
            "t".into(),
            Timestamp::NotAvailable,
            partition,
            offset,
            None,
        )
    }

    fn batch() -> Vec<OwnedMessage> {
        (0..6)
            .flat_map(|p| (0..10).map(move |o| msg(p, 100 + o)))
            .collect()
    }

    #[test]
    fn rate_zero_plans_nothing() {
        let mut inj = Injector::new(DupArgs::default());
        let plan = inj.plan(&batch());
        assert!(plan.reprocess.is_empty() && plan.redeliver.is_empty());
    }

    #[test]
    fn rate_one_duplicates_every_partition_slice_by_the_chosen_kind() {
        let mut inj = Injector::new(DupArgs {
            dup_rate: 1.0,
            dup_kind: DupKind::Reprocess,
        });
        assert_eq!(inj.plan(&batch()).reprocess.len(), 60);
        let mut inj = Injector::new(DupArgs {
            dup_rate: 1.0,
            dup_kind: DupKind::Redeliver,
        });
        let plan = inj.plan(&batch());
        assert!(plan.reprocess.is_empty());
        assert_eq!(plan.redeliver.len(), 6);
        assert!(
            plan.redeliver
                .iter()
                .all(|(_, _, o, n)| *o == 100 && *n == 10)
        );
    }

    #[test]
    fn a_message_is_duplicated_at_most_once() {
        let mut inj = Injector::new(DupArgs {
            dup_rate: 1.0,
            dup_kind: DupKind::Redeliver,
        });
        assert_eq!(inj.plan(&batch()).redeliver.len(), 6);
        // The broker redelivers the same offsets: not duplicated again.
        let again = inj.plan(&batch());
        assert!(again.redeliver.is_empty() && again.reprocess.is_empty());
        // A batch straddling the horizon: only the new offsets count.
        let mixed: Vec<_> = (105..115).map(|o| msg(0, o)).collect();
        let plan = inj.plan(&mixed);
        assert_eq!(plan.redeliver, vec![("t".to_owned(), 0, 110, 5)]);
    }

    #[test]
    fn both_kinds_share_the_rate() {
        let mut inj = Injector::new(DupArgs {
            dup_rate: 0.3,
            dup_kind: DupKind::Both,
        });
        let (mut reprocessed, mut redelivered) = (0usize, 0usize);
        for i in 0..1000 {
            // Fresh offsets each time, as a consumer moving forward sees them.
            let batch: Vec<_> = (0..6)
                .flat_map(|p| (0..10).map(move |o| msg(p, i * 10 + o)))
                .collect();
            let plan = inj.plan(&batch);
            reprocessed += plan.reprocess.len();
            redelivered += plan.redeliver.iter().map(|r| r.3).sum::<usize>();
        }
        // 60,000 messages at 30%: about 9,000 each way; far from 0 and 18,000.
        assert!((6_000..12_000).contains(&reprocessed), "{reprocessed}");
        assert!((6_000..12_000).contains(&redelivered), "{redelivered}");
    }

    #[test]
    fn a_rate_outside_zero_to_one_is_refused() {
        assert!(fraction("1.5").is_err());
        assert!(fraction("-0.1").is_err());
        assert!(fraction("x").is_err());
        assert_eq!(fraction("0.05"), Ok(0.05));
    }
}
