//! The producer's linger chosen by load (`--busy-linger-ms`,
//! `--busy-rows-per-sec`).
//!
//! librdkafka's `linger.ms` is fixed for a producer's life, and no one
//! figure suits every load. A short linger keeps each event's wait short at
//! a low rate, where a batch would not fill anyway; at a high rate it sends
//! many small produce requests, and each costs the relay, the brokers and
//! their replicas' fetches. At 6,000 rows/s a 50 ms busy linger instead of
//! 10 ms throughout took the relay's own CPU per 1,000 events from 30.5 to
//! 23.1 ms and the brokers' from 76.5 to 33.6, and the p50 from 13.1 to
//! 31.6 ms (FINDINGS.md §29).
//!
//! So the WAL relay has two producers: the relay's (`--linger-ms`) and a
//! busy one (`--busy-linger-ms`). [`Pace`] counts the rows the stream reads
//! per second and sends through the busy producer from the first second at
//! or over `--busy-rows-per-sec` until a second under half of it (the
//! half keeps a load near the threshold from switching every second).
//!
//! Switching cannot reorder a key: the stream has at most one event of a
//! key in flight ([`super::settle`]), so the key's next event goes, on
//! either producer, only after the broker acked the one before.

use std::time::{Duration, Instant};

/// How long a count runs before it decides.
const SECOND: Duration = Duration::from_secs(1);

/// Which producer the stream's rows go through.
#[derive(Debug)]
pub(super) struct Pace {
    /// Rows a second from which the busy producer is taken; `None`: there
    /// is none.
    busy_from: Option<u64>,
    /// Rows read since `since`.
    rows: u64,
    since: Instant,
    busy: bool,
}

impl Pace {
    /// Calm, counting from `now`; `busy_from`: `--busy-rows-per-sec` when
    /// there is a busy producer.
    pub(super) fn new(busy_from: Option<u64>, now: Instant) -> Self {
        Self {
            busy_from,
            rows: 0,
            since: now,
            busy: false,
        }
    }

    /// A row read at `now`: whether it goes through the busy producer.
    pub(super) fn row(&mut self, now: Instant) -> bool {
        let busy = self.busy_at(now);
        self.rows += 1;
        busy
    }

    /// Whether the stream is busy at `now` (a count that ran its second
    /// decides, with no row read since).
    pub(super) fn busy_at(&mut self, now: Instant) -> bool {
        let Some(threshold) = self.busy_from else {
            return false;
        };
        let elapsed = now.saturating_duration_since(self.since);
        if elapsed >= SECOND {
            // Rows a second over the count's time (a quiet gap counts as
            // the time it took: a row after a minute's silence is calm).
            let rate = self.rows.saturating_mul(1_000) / (elapsed.as_millis().max(1) as u64);
            self.busy = if self.busy {
                rate >= threshold / 2
            } else {
                rate >= threshold
            };
            self.rows = 0;
            self.since = now;
        }
        self.busy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rate` rows a second for `seconds` seconds, from `at`; the decisions.
    fn feed(pace: &mut Pace, at: &mut Instant, rate: u64, seconds: u64) -> Vec<bool> {
        let step = Duration::from_secs(1) / u32::try_from(rate).expect("rate");
        let mut seen = Vec::new();
        for _ in 0..rate * seconds {
            seen.push(pace.row(*at));
            *at += step;
        }
        seen
    }

    #[test]
    fn without_a_busy_producer_every_row_is_calm() {
        let mut at = Instant::now();
        let mut pace = Pace::new(None, at);
        assert!(!feed(&mut pace, &mut at, 5_000, 3).contains(&true));
    }

    #[test]
    fn a_second_over_the_threshold_makes_it_busy_a_second_under_half_calm() {
        let mut at = Instant::now();
        let mut pace = Pace::new(Some(2_000), at);
        // The first second is counted before any decision.
        assert!(!feed(&mut pace, &mut at, 4_000, 1).contains(&true));
        assert!(
            feed(&mut pace, &mut at, 4_000, 2).iter().all(|&b| b),
            "busy from the second second on"
        );
        // Between half the threshold and the whole: stays busy.
        assert!(feed(&mut pace, &mut at, 1_250, 2).iter().all(|&b| b));
        // Under half: calm from the next count on.
        let calm = feed(&mut pace, &mut at, 500, 3);
        assert!(calm[..500].iter().all(|&b| b), "decided by the last count");
        assert!(calm[500..].iter().all(|&b| !b));
        assert!(!pace.busy_at(at));
    }

    #[test]
    fn under_the_threshold_it_never_turns_busy() {
        let mut at = Instant::now();
        let mut pace = Pace::new(Some(2_000), at);
        assert!(!feed(&mut pace, &mut at, 1_600, 4).contains(&true));
    }

    #[test]
    fn a_row_after_a_silence_is_calm() {
        let mut at = Instant::now();
        let mut pace = Pace::new(Some(2_000), at);
        feed(&mut pace, &mut at, 4_000, 2);
        assert!(pace.busy_at(at));
        at += Duration::from_secs(60);
        assert!(!pace.row(at), "4,000 rows over a minute is calm");
        feed(&mut pace, &mut at, 4_000, 2);
        at += Duration::from_secs(10);
        assert!(!pace.busy_at(at), "no row for a while: calm without one");
    }
}
