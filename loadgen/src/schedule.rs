//! When each send happens: the open-model schedule of first attempts and the
//! retry storm on top of it. Pure arithmetic on nanosecond offsets from the
//! start, so it is testable without a clock.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use rand::Rng;

/// Most retries one first attempt gets.
const MAX_RETRIES: usize = 3;

/// Offset of first attempt `i` from the start: exactly `i / rate` seconds,
/// computed from `i` each time (never by adding up periods, which drifts).
pub(crate) fn first_attempt_offset_ns(i: u64, rate: f64) -> u64 {
    // f64 holds offsets of up to ~104 days exactly to the nanosecond; `as`
    // saturates beyond u64, which no validated run reaches.
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let ns = (i as f64 * 1e9 / rate).round() as u64;
    ns
}

/// Number of first attempts in a window: every `i` with `i / rate < duration`.
pub(crate) fn first_attempt_count(rate: f64, duration: Duration) -> u64 {
    // The epsilon keeps products such as 0.1 * 30 = 3.0000000000000004 from
    // rounding up to one request too many.
    let exact = rate * duration.as_secs_f64();
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let count = (exact - 1e-9).ceil().max(0.0) as u64;
    count
}

/// The retries of one first attempt, as offsets from its scheduled instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct RetryPlan {
    offsets_ns: [u64; MAX_RETRIES],
    len: usize,
}

impl RetryPlan {
    /// With probability `retry_rate`: 1..=3 retries, each concurrent with the
    /// original (offset 0, probability 1/2) or delayed uniformly in
    /// `0..max_delay`. A fixed array, so no allocation per request.
    pub(crate) fn draw<R: Rng + ?Sized>(rng: &mut R, retry_rate: f64, max_delay: Duration) -> Self {
        let mut plan = Self::default();
        if retry_rate <= 0.0 || !rng.random_bool(retry_rate.min(1.0)) {
            return plan;
        }
        plan.len = rng.random_range(1..=MAX_RETRIES);
        let max_ns = u64::try_from(max_delay.as_nanos()).unwrap_or(u64::MAX);
        for offset in &mut plan.offsets_ns[..plan.len] {
            *offset = if rng.random_bool(0.5) || max_ns == 0 {
                0
            } else {
                rng.random_range(0..max_ns)
            };
        }
        plan
    }

    /// The offsets, in draw order.
    pub(crate) fn offsets_ns(&self) -> &[u64] {
        &self.offsets_ns[..self.len]
    }
}

/// A send that is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Due {
    /// First attempt number `number` (0-based); its key is drawn when it is sent.
    First {
        /// Sequence number of the first attempt.
        number: u64,
        /// Scheduled offset from the start.
        at_ns: u64,
    },
    /// A retry of an intent whose key index is known.
    Retry {
        /// The intent's key index.
        key_index: u64,
        /// Scheduled offset from the start.
        at_ns: u64,
    },
}

/// The merged timeline of first attempts (computed on the fly) and pending
/// retries (a min-heap; only the few outstanding ones are held).
#[derive(Debug)]
pub(crate) struct Schedule {
    rate: f64,
    total: u64,
    next_first: u64,
    /// (at_ns, insertion order, key index): the insertion order keeps retries
    /// due at one instant in the order they were planned.
    retries: BinaryHeap<Reverse<(u64, u64, u64)>>,
    pushed: u64,
}

impl Schedule {
    /// `rate` first attempts per second for `duration`.
    pub(crate) fn new(rate: f64, duration: Duration) -> Self {
        Self {
            rate,
            total: first_attempt_count(rate, duration),
            next_first: 0,
            retries: BinaryHeap::new(),
            pushed: 0,
        }
    }

    /// First attempts in the whole run.
    pub(crate) fn total_first_attempts(&self) -> u64 {
        self.total
    }

    /// First attempts not handed out yet.
    pub(crate) fn remaining_first_attempts(&self) -> u64 {
        self.total - self.next_first
    }

    /// Retries planned but not handed out yet.
    pub(crate) fn pending_retries(&self) -> u64 {
        self.retries.len() as u64
    }

    /// Ends the first attempts here: the ones handed out are the run's
    /// whole schedule; the retries planned so far stay due.
    pub(crate) fn end_first_attempts(&mut self) {
        self.total = self.next_first;
    }

    /// Plans a retry of `key_index` at `at_ns`.
    pub(crate) fn push_retry(&mut self, at_ns: u64, key_index: u64) {
        self.retries.push(Reverse((at_ns, self.pushed, key_index)));
        self.pushed += 1;
    }

    /// Offset of the earliest pending send, if any.
    pub(crate) fn next_at_ns(&self) -> Option<u64> {
        let first = (self.next_first < self.total)
            .then(|| first_attempt_offset_ns(self.next_first, self.rate));
        let retry = self.retries.peek().map(|Reverse((at, _, _))| *at);
        match (first, retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The earliest send due at or before `now_ns`. On a tie the retry goes
    /// first: it was planned earlier.
    pub(crate) fn pop_due(&mut self, now_ns: u64) -> Option<Due> {
        let first = (self.next_first < self.total)
            .then(|| first_attempt_offset_ns(self.next_first, self.rate));
        let retry = self.retries.peek().map(|Reverse((at, _, _))| *at);
        let take_retry = match (first, retry) {
            (_, Some(r)) if r > now_ns => false,
            (Some(f), Some(r)) => r <= f,
            (None, Some(_)) => true,
            (_, None) => false,
        };
        if take_retry {
            return self
                .retries
                .pop()
                .map(|Reverse((at_ns, _, key_index))| Due::Retry { key_index, at_ns });
        }
        match first {
            Some(at_ns) if at_ns <= now_ns => {
                let number = self.next_first;
                self.next_first += 1;
                Some(Due::First { number, at_ns })
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn offsets_are_i_over_rate() {
        assert_eq!(first_attempt_offset_ns(0, 1000.0), 0);
        assert_eq!(first_attempt_offset_ns(1, 1000.0), 1_000_000);
        assert_eq!(first_attempt_offset_ns(999, 1000.0), 999_000_000);
        assert_eq!(first_attempt_offset_ns(1, 3.0), 333_333_333);
        assert_eq!(first_attempt_offset_ns(3, 3.0), 1_000_000_000);
        // No drift after a day at 6k/s.
        let i = 6_000 * 86_400;
        assert_eq!(first_attempt_offset_ns(i, 6000.0), 86_400 * 1_000_000_000);
    }

    #[test]
    fn counts_cover_the_window_exactly() {
        assert_eq!(first_attempt_count(1000.0, Duration::from_secs(10)), 10_000);
        assert_eq!(first_attempt_count(0.1, Duration::from_secs(30)), 3);
        assert_eq!(first_attempt_count(0.5, Duration::from_secs(3)), 2);
        assert_eq!(first_attempt_count(3.0, Duration::from_secs(1)), 3);
    }

    #[test]
    fn retry_plans_follow_the_rate() {
        let mut rng = StdRng::seed_from_u64(9);
        let delay = Duration::from_millis(200);
        let plans: Vec<_> = (0..20_000)
            .map(|_| RetryPlan::draw(&mut rng, 0.15, delay))
            .collect();
        let retried = plans.iter().filter(|p| !p.offsets_ns().is_empty()).count();
        assert!((2_700..=3_300).contains(&retried), "{retried}");
        let offsets: Vec<u64> = plans.iter().flat_map(|p| p.offsets_ns().to_vec()).collect();
        assert!(offsets.iter().all(|&o| o < 200_000_000));
        let concurrent = offsets.iter().filter(|&&o| o == 0).count();
        let share = concurrent as f64 / offsets.len() as f64;
        assert!((0.45..=0.55).contains(&share), "{share}");
        // 1..=3 retries uniformly: mean 2.
        let mean = offsets.len() as f64 / retried as f64;
        assert!((1.9..=2.1).contains(&mean), "{mean}");
        assert!(
            RetryPlan::draw(&mut rng, 0.0, delay)
                .offsets_ns()
                .is_empty()
        );
        assert!((0..100).all(|_| {
            !RetryPlan::draw(&mut rng, 1.0, delay)
                .offsets_ns()
                .is_empty()
        }));
    }

    #[test]
    fn retry_plans_are_deterministic() {
        let draw = || {
            let mut rng = StdRng::seed_from_u64(3);
            (0..1000)
                .map(|_| RetryPlan::draw(&mut rng, 0.5, Duration::from_millis(50)))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(), draw());
    }

    #[test]
    fn an_ended_schedule_hands_out_only_its_planned_retries() {
        let mut s = Schedule::new(10.0, Duration::from_secs(100));
        assert!(matches!(s.pop_due(0), Some(Due::First { number: 0, .. })));
        assert!(matches!(
            s.pop_due(100_000_000),
            Some(Due::First { number: 1, .. })
        ));
        s.push_retry(500_000_000, 7);
        s.end_first_attempts();
        assert_eq!(s.total_first_attempts(), 2);
        assert_eq!(s.remaining_first_attempts(), 0);
        assert_eq!(s.next_at_ns(), Some(500_000_000));
        assert_eq!(
            s.pop_due(10_000_000_000),
            Some(Due::Retry {
                key_index: 7,
                at_ns: 500_000_000
            })
        );
        assert_eq!(s.next_at_ns(), None);
        assert_eq!(s.pop_due(u64::MAX), None);
    }

    #[test]
    fn schedule_merges_first_attempts_and_retries() {
        let mut s = Schedule::new(10.0, Duration::from_secs(1));
        assert_eq!(s.total_first_attempts(), 10);
        assert_eq!(s.next_at_ns(), Some(0));
        assert_eq!(
            s.pop_due(0),
            Some(Due::First {
                number: 0,
                at_ns: 0
            })
        );
        // A concurrent retry at the same instant, and a delayed one.
        s.push_retry(0, 77);
        s.push_retry(150_000_000, 77);
        assert_eq!(
            s.pop_due(0),
            Some(Due::Retry {
                key_index: 77,
                at_ns: 0
            })
        );
        assert_eq!(s.pop_due(0), None, "nothing else is due at 0");
        assert_eq!(s.next_at_ns(), Some(100_000_000));
        // Behind schedule: everything due comes out in time order.
        let due: Vec<_> = std::iter::from_fn(|| s.pop_due(250_000_000)).collect();
        assert_eq!(
            due,
            vec![
                Due::First {
                    number: 1,
                    at_ns: 100_000_000
                },
                Due::Retry {
                    key_index: 77,
                    at_ns: 150_000_000
                },
                Due::First {
                    number: 2,
                    at_ns: 200_000_000
                },
            ]
        );
        assert_eq!(s.remaining_first_attempts(), 7);
        // Retries may outlive the window.
        let rest: Vec<_> = std::iter::from_fn(|| s.pop_due(u64::MAX)).collect();
        assert_eq!(rest.len(), 7);
        s.push_retry(2_000_000_000, 5);
        assert_eq!(s.pending_retries(), 1);
        assert_eq!(s.next_at_ns(), Some(2_000_000_000));
        assert_eq!(s.pop_due(1_999_999_999), None);
        assert!(s.pop_due(2_000_000_000).is_some());
        assert_eq!(s.next_at_ns(), None);
    }

    #[test]
    fn ties_keep_retry_insertion_order() {
        let mut s = Schedule::new(1.0, Duration::from_secs(1));
        s.push_retry(5, 1);
        s.push_retry(5, 2);
        s.push_retry(5, 3);
        let _first = s.pop_due(10);
        let order: Vec<_> = std::iter::from_fn(|| s.pop_due(10))
            .map(|d| match d {
                Due::Retry { key_index, .. } => key_index,
                Due::First { .. } => 0,
            })
            .collect();
        assert_eq!(order, vec![1, 2, 3]);
    }
}
