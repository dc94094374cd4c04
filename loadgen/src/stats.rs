//! What the sends found, gathered in one place under one lock: outcome
//! counts, latency histograms, the per-second timeline and the per-key state
//! that replay verification and the ground-truth files are built from.

use std::collections::{BTreeMap, HashMap};

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::keys::KeyClass;
use crate::outcome::{Answer, Outcome, grpc_code_name};
use crate::verify::{KeyState, Verdict};

/// Mismatch and bad-response examples kept for the log and the report.
const MAX_EXAMPLES: usize = 10;
/// Latencies are recorded in microseconds, 1 µs to 1 h, 3 significant digits.
const HIST_MAX_US: u64 = 3_600_000_000;
/// The per-second histograms only feed a p99 column: 2 digits and a 60 s
/// ceiling keep each at a few KB, so hour-long runs stay small.
const SECOND_HIST_MAX_US: u64 = 60_000_000;

/// A first attempt or a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendKind {
    /// The send of a new intent at its scheduled instant.
    First,
    /// An extra send of the same key and body.
    Retry,
}

/// A latency histogram in microseconds.
pub(crate) fn new_histogram() -> Histogram<u64> {
    // Constant bounds that hdrhistogram accepts (low >= 1, high >= 2 * low,
    // sigfig <= 5); a unit test creates it.
    Histogram::new_with_bounds(1, HIST_MAX_US, 3).expect("constant histogram bounds are valid")
}

fn new_second_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, SECOND_HIST_MAX_US, 2)
        .expect("constant histogram bounds are valid")
}

/// How the sends ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct OutcomeCounts {
    /// Sends that finished one way or another.
    pub(crate) completed: u64,
    /// Sends the service answered (any status).
    pub(crate) responses: u64,
    /// Successes with a well-formed body.
    pub(crate) ok: u64,
    /// ...of which first attempts.
    pub(crate) ok_first_attempts: u64,
    /// ...of which retries.
    pub(crate) ok_retries: u64,
    /// HTTP 409 / gRPC ALREADY_EXISTS: key reused with another body.
    pub(crate) conflicts: u64,
    /// Other 4xx (and gRPC codes of that class).
    pub(crate) client_errors: u64,
    /// 5xx (and gRPC codes of that class), e.g. 503 unavailable.
    pub(crate) server_errors: u64,
    /// 1xx/3xx answers.
    pub(crate) other_status: u64,
    /// Success status with a body that is not a created order.
    pub(crate) bad_responses: u64,
    /// Could not connect (nothing sent).
    pub(crate) connect_errors: u64,
    /// Broke mid-exchange (ambiguous).
    pub(crate) transport_errors: u64,
    /// No answer within the timeout, hard-stop abandons included (ambiguous).
    pub(crate) timeouts: u64,
    /// ...of which abandoned at the hard stop.
    pub(crate) abandoned: u64,
    /// Requests that could not be built.
    pub(crate) not_sent: u64,
}

impl OutcomeCounts {
    /// Every send that did not end in `ok`.
    pub(crate) fn errors(&self) -> u64 {
        self.completed - self.ok
    }
}

/// Replay verification totals.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct ReplayCounts {
    /// Later successes compared with their key's first success.
    pub(crate) compared: u64,
    /// ...of which against a first success over the other protocol.
    pub(crate) cross_protocol: u64,
    /// Comparisons that differed (must be 0).
    pub(crate) mismatches: u64,
    /// The first few mismatches, described.
    pub(crate) examples: Vec<String>,
}

/// One second of the timeline (sends grouped by scheduled second).
#[derive(Debug, Clone)]
pub(crate) struct Second {
    /// Sends that went out.
    pub(crate) sent: u64,
    /// ...that succeeded.
    pub(crate) ok: u64,
    /// ...that did not.
    pub(crate) errors: u64,
    /// Latency of the answered ones.
    pub(crate) latency: Option<Histogram<u64>>,
}

/// Keys by what became of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct KeyCounts {
    /// Keys with at least one success (the --intents lines).
    pub(crate) succeeded: u64,
    /// Keys without a success but with a send that may have committed: no
    /// answer after it may have been received, or a 408/5xx (the
    /// --ambiguous lines). Each holds 0 or 1 order.
    pub(crate) ambiguous: u64,
    /// Keys whose every send definitely failed: refused (a 4xx other than
    /// 408) or never sent. Nothing of theirs was created.
    pub(crate) failed: u64,
    /// ...of which answered 409 / ALREADY_EXISTS (bound to another request);
    /// the others are the --failed lines and must hold no order.
    pub(crate) conflicted: u64,
}

/// The sends of one key class (see [`KeyClass`]).
#[derive(Debug, Clone)]
pub(crate) struct ClassStats {
    /// Sends of the class that finished one way or another (first attempts,
    /// retries and retries of errors).
    pub(crate) sends: u64,
    /// ...that succeeded.
    pub(crate) ok: u64,
    /// Extra sends of `--retry-on-error` (counted when sent, like
    /// `error_retries_sent` in the scheduler counts).
    pub(crate) error_retries_sent: u64,
    /// Distinct keys of the class with at least one success.
    pub(crate) keys_succeeded: u64,
    /// Latency of the answered sends, µs from their scheduled instant.
    pub(crate) latency: Histogram<u64>,
}

impl ClassStats {
    /// Nothing recorded yet.
    pub(crate) fn new() -> Self {
        Self {
            sends: 0,
            ok: 0,
            error_retries_sent: 0,
            keys_succeeded: 0,
            latency: new_histogram(),
        }
    }

    /// Sends that did not end in `ok`.
    pub(crate) fn errors(&self) -> u64 {
        self.sends - self.ok
    }
}

/// The sends split by key class.
#[derive(Debug, Clone)]
pub(crate) struct KeyClassStats {
    /// `--hot-keys`: indexes 1..=this are hot (0: no hot class).
    pub(crate) hot_keys: u64,
    /// The hot class; present exactly when `hot_keys` > 0.
    pub(crate) hot: Option<ClassStats>,
    /// The cold class (every send when there is no hot class).
    pub(crate) cold: ClassStats,
}

impl KeyClassStats {
    /// Empty classes for a hot class of 1..=`hot_keys` (none when 0).
    pub(crate) fn new(hot_keys: u64) -> Self {
        Self {
            hot_keys,
            hot: (hot_keys > 0).then(ClassStats::new),
            cold: ClassStats::new(),
        }
    }

    /// The class of key index `index`.
    pub(crate) fn of_mut(&mut self, index: u64) -> &mut ClassStats {
        match (&mut self.hot, KeyClass::of(index, self.hot_keys)) {
            (Some(hot), KeyClass::Hot) => hot,
            _ => &mut self.cold,
        }
    }
}

/// Live numbers for the progress display.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Live {
    /// Sends finished.
    pub(crate) completed: u64,
    /// Successes.
    pub(crate) ok: u64,
    /// Timeouts.
    pub(crate) timeouts: u64,
    /// Replay mismatches.
    pub(crate) mismatches: u64,
}

/// Everything recorded during a run.
#[derive(Debug)]
pub(crate) struct Collector {
    /// Outcome totals.
    pub(crate) counts: OutcomeCounts,
    /// Answers by status class.
    pub(crate) classes: BTreeMap<&'static str, u64>,
    /// HTTP answers by status code.
    pub(crate) http_status: BTreeMap<u16, u64>,
    /// gRPC answers by code name.
    pub(crate) grpc_codes: BTreeMap<&'static str, u64>,
    /// Latency of every answered send, µs from its scheduled instant.
    pub(crate) all: Histogram<u64>,
    /// ...of answered first attempts.
    pub(crate) first_attempts: Histogram<u64>,
    /// ...of answered retries.
    pub(crate) retries: Histogram<u64>,
    /// The timeline.
    pub(crate) seconds: Vec<Second>,
    /// Per-key state, by key index.
    pub(crate) keys: HashMap<u64, KeyState>,
    /// Replay verification.
    pub(crate) replay: ReplayCounts,
    /// The first few bad responses, described.
    pub(crate) bad_examples: Vec<String>,
    /// Sends, outcomes and latency by key class (hot / cold).
    pub(crate) key_classes: KeyClassStats,
}

impl Default for Collector {
    fn default() -> Self {
        Self::new()
    }
}

impl Collector {
    /// An empty collector without a hot key class.
    pub(crate) fn new() -> Self {
        Self::with_hot_keys(0)
    }

    /// An empty collector whose hot key class is 1..=`hot_keys` (none when 0).
    pub(crate) fn with_hot_keys(hot_keys: u64) -> Self {
        Self {
            counts: OutcomeCounts::default(),
            classes: BTreeMap::new(),
            http_status: BTreeMap::new(),
            grpc_codes: BTreeMap::new(),
            all: new_histogram(),
            first_attempts: new_histogram(),
            retries: new_histogram(),
            seconds: Vec::new(),
            keys: HashMap::new(),
            replay: ReplayCounts::default(),
            bad_examples: Vec::new(),
            key_classes: KeyClassStats::new(hot_keys),
        }
    }

    /// Counts one `--retry-on-error` resend of key index `key_index`, when it
    /// is sent (its outcome is recorded later, like any send's).
    pub(crate) fn record_error_retry(&mut self, key_index: u64) {
        self.key_classes.of_mut(key_index).error_retries_sent += 1;
    }

    /// Records one finished send of `key` (index `key_index`), scheduled
    /// `at_ns` after the start, that took `latency_us` from its scheduled
    /// instant to the end.
    pub(crate) fn record(
        &mut self,
        key_index: u64,
        key: &str,
        kind: SendKind,
        at_ns: u64,
        outcome: &Outcome,
        latency_us: u64,
    ) {
        let c = &mut self.counts;
        c.completed += 1;
        let class = self.key_classes.of_mut(key_index);
        class.sends += 1;
        let answer = outcome.answer();
        if let Some(answer) = answer {
            c.responses += 1;
            *self.classes.entry(answer.class()).or_default() += 1;
            match answer {
                Answer::Http(status) => *self.http_status.entry(status).or_default() += 1,
                Answer::Grpc(code) => {
                    *self.grpc_codes.entry(grpc_code_name(code)).or_default() += 1
                }
            }
            self.all.saturating_record(latency_us);
            class.latency.saturating_record(latency_us);
            match kind {
                SendKind::First => self.first_attempts.saturating_record(latency_us),
                SendKind::Retry => self.retries.saturating_record(latency_us),
            }
        }
        let state = self.keys.entry(key_index).or_default();
        let ok = matches!(outcome, Outcome::Ok(_));
        match outcome {
            Outcome::Ok(success) => {
                c.ok += 1;
                class.ok += 1;
                match kind {
                    SendKind::First => c.ok_first_attempts += 1,
                    SendKind::Retry => c.ok_retries += 1,
                }
                match state.check(success) {
                    Verdict::First => class.keys_succeeded += 1,
                    Verdict::Match { cross_protocol } => {
                        self.replay.compared += 1;
                        self.replay.cross_protocol += u64::from(cross_protocol);
                    }
                    Verdict::Mismatch {
                        reason,
                        cross_protocol,
                    } => {
                        self.replay.compared += 1;
                        self.replay.cross_protocol += u64::from(cross_protocol);
                        self.replay.mismatches += 1;
                        if self.replay.examples.len() < MAX_EXAMPLES {
                            self.replay
                                .examples
                                .push(format!("key {key}: {reason}; got {}", success.describe()));
                        }
                    }
                }
            }
            Outcome::Failed(answer) => {
                if answer.is_conflict() {
                    c.conflicts += 1;
                    state.mark_conflicted();
                } else {
                    match answer.class() {
                        "4xx" => c.client_errors += 1,
                        "5xx" => c.server_errors += 1,
                        _ => c.other_status += 1,
                    }
                }
            }
            Outcome::BadResponse(_, why) => {
                c.bad_responses += 1;
                if self.bad_examples.len() < MAX_EXAMPLES {
                    self.bad_examples.push(format!("key {key}: {why}"));
                }
            }
            Outcome::ConnectError => c.connect_errors += 1,
            Outcome::TransportError => c.transport_errors += 1,
            Outcome::Timeout => c.timeouts += 1,
            Outcome::Abandoned => {
                c.timeouts += 1;
                c.abandoned += 1;
            }
            Outcome::NotSent => c.not_sent += 1,
        }
        if outcome.is_ambiguous() {
            state.mark_ambiguous();
        }

        // Sends are scheduled within the run (plus retry delays), so the
        // timeline stays as long as the run in seconds.
        if let Ok(second) = usize::try_from(at_ns / 1_000_000_000) {
            if self.seconds.len() <= second {
                self.seconds.resize_with(second + 1, || Second {
                    sent: 0,
                    ok: 0,
                    errors: 0,
                    latency: None,
                });
            }
            let bucket = &mut self.seconds[second];
            bucket.sent += 1;
            if ok {
                bucket.ok += 1;
            } else {
                bucket.errors += 1;
            }
            if answer.is_some() {
                bucket
                    .latency
                    .get_or_insert_with(new_second_histogram)
                    .saturating_record(latency_us);
            }
        }
    }

    /// Live numbers for the progress display.
    pub(crate) fn live(&self) -> Live {
        Live {
            completed: self.counts.completed,
            ok: self.counts.ok,
            timeouts: self.counts.timeouts,
            mismatches: self.replay.mismatches,
        }
    }

    /// Keys by what became of them.
    pub(crate) fn key_counts(&self) -> KeyCounts {
        let mut counts = KeyCounts::default();
        for state in self.keys.values() {
            if state.succeeded() {
                counts.succeeded += 1;
            } else if state.is_ambiguous() {
                counts.ambiguous += 1;
            } else {
                counts.failed += 1;
                counts.conflicted += u64::from(!state.is_refused());
            }
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::HeaderValue;
    use tonic::Code;
    use uuid::Uuid;

    use super::*;
    use crate::outcome::{HttpReply, Success};

    fn ok_http(id: Uuid) -> Outcome {
        Outcome::Ok(Success {
            order_id: id,
            status: "created".into(),
            http: Some(HttpReply {
                status: 201,
                body: Bytes::from(format!(r#"{{"order_id":"{id}","status":"created"}}"#)),
                location: HeaderValue::from_str(&format!("/orders/{id}")).ok(),
                etag: Some(HeaderValue::from_static("\"e\"")),
            }),
        })
    }

    fn ok_grpc(id: Uuid) -> Outcome {
        Outcome::Ok(Success {
            order_id: id,
            status: "created".into(),
            http: None,
        })
    }

    #[test]
    fn outcomes_keys_and_timeline_add_up() {
        let mut c = Collector::new();
        let a = Uuid::now_v7();
        c.record(1, "p-1", SendKind::First, 0, &ok_http(a), 1_000);
        c.record(1, "p-1", SendKind::Retry, 10, &ok_grpc(a), 2_000);
        c.record(1, "p-1", SendKind::Retry, 20, &ok_http(a), 3_000);
        c.record(
            2,
            "p-2",
            SendKind::First,
            1_500_000_000,
            &Outcome::Timeout,
            2_000_000,
        );
        c.record(
            3,
            "p-3",
            SendKind::First,
            1_600_000_000,
            &Outcome::Failed(Answer::Http(503)),
            5_000,
        );
        c.record(
            4,
            "p-4",
            SendKind::First,
            1_700_000_000,
            &Outcome::Failed(Answer::Grpc(Code::AlreadyExists)),
            5_000,
        );
        c.record(
            5,
            "p-5",
            SendKind::First,
            1_800_000_000,
            &Outcome::Abandoned,
            9_000_000,
        );
        c.record(
            5,
            "p-5",
            SendKind::Retry,
            1_800_000_000,
            &Outcome::ConnectError,
            1,
        );

        assert_eq!(c.counts.completed, 8);
        assert_eq!(c.counts.responses, 5);
        assert_eq!(c.counts.ok, 3);
        assert_eq!(c.counts.ok_first_attempts, 1);
        assert_eq!(c.counts.ok_retries, 2);
        assert_eq!(c.counts.timeouts, 2);
        assert_eq!(c.counts.abandoned, 1);
        assert_eq!(c.counts.server_errors, 1);
        assert_eq!(c.counts.conflicts, 1);
        assert_eq!(c.counts.connect_errors, 1);
        assert_eq!(c.counts.errors(), 5);
        assert_eq!(c.replay.compared, 2);
        assert_eq!(c.replay.cross_protocol, 1);
        assert_eq!(c.replay.mismatches, 0);
        assert_eq!(c.classes.get("2xx"), Some(&3));
        assert_eq!(c.classes.get("4xx"), Some(&1));
        assert_eq!(c.classes.get("5xx"), Some(&1));
        assert_eq!(c.http_status.get(&201), Some(&2));
        assert_eq!(c.grpc_codes.get("ALREADY_EXISTS"), Some(&1));
        assert_eq!(c.all.len(), 5, "only answered sends have a latency");
        assert_eq!(c.first_attempts.len(), 3);
        assert_eq!(c.retries.len(), 2);
        assert_eq!(
            c.key_counts(),
            KeyCounts {
                succeeded: 1,
                // p-2 timed out, p-3 got a 503 (which may hide a commit),
                // p-5 was abandoned (its connect error later does not undo that).
                ambiguous: 3,
                failed: 1,
                conflicted: 1
            }
        );
        assert_eq!(c.seconds.len(), 2);
        assert_eq!(
            (c.seconds[0].sent, c.seconds[0].ok, c.seconds[0].errors),
            (3, 3, 0)
        );
        assert_eq!(
            (c.seconds[1].sent, c.seconds[1].ok, c.seconds[1].errors),
            (5, 0, 5)
        );
    }

    #[test]
    fn sends_are_split_by_key_class() {
        let mut c = Collector::with_hot_keys(2);
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        // Hot key 1: four sends of one intent: two answers, a 503 and its resend.
        c.record(1, "p-1", SendKind::First, 0, &ok_http(a), 1_000);
        c.record(1, "p-1", SendKind::First, 0, &ok_grpc(a), 3_000);
        c.record(
            1,
            "p-1",
            SendKind::First,
            0,
            &Outcome::Failed(Answer::Http(503)),
            5_000,
        );
        c.record_error_retry(1);
        c.record(1, "p-1", SendKind::Retry, 0, &ok_http(a), 7_000);
        // Hot key 2: no success, and no latency for the timeout.
        c.record(2, "p-2", SendKind::First, 0, &Outcome::Timeout, 2_000_000);
        // Cold keys 3 and 4.
        c.record(3, "p-3", SendKind::First, 0, &ok_http(b), 2_000);
        c.record(4, "p-4", SendKind::First, 0, &Outcome::ConnectError, 1);
        c.record_error_retry(4);
        c.record(4, "p-4", SendKind::Retry, 0, &Outcome::ConnectError, 1);

        let hot = c.key_classes.hot.as_ref().expect("hot class");
        let cold = &c.key_classes.cold;
        assert_eq!((hot.sends, hot.ok, hot.errors()), (5, 3, 2));
        assert_eq!((hot.error_retries_sent, hot.keys_succeeded), (1, 1));
        assert_eq!(hot.latency.len(), 4, "the timeout has no latency");
        assert_eq!((cold.sends, cold.ok, cold.errors()), (3, 1, 2));
        assert_eq!((cold.error_retries_sent, cold.keys_succeeded), (1, 1));
        assert_eq!(cold.latency.len(), 1);
        // The classes partition the totals.
        assert_eq!(hot.sends + cold.sends, c.counts.completed);
        assert_eq!(hot.ok + cold.ok, c.counts.ok);
        assert_eq!(
            hot.keys_succeeded + cold.keys_succeeded,
            c.key_counts().succeeded
        );
        assert_eq!(hot.latency.len() + cold.latency.len(), c.all.len());

        // Without a hot class everything is cold.
        let mut c = Collector::new();
        c.record(1, "p-1", SendKind::First, 0, &ok_http(a), 1_000);
        assert!(c.key_classes.hot.is_none());
        assert_eq!(c.key_classes.cold.sends, 1);
        assert_eq!(c.key_classes.cold.keys_succeeded, 1);
    }

    #[test]
    fn mismatches_are_counted_and_described() {
        let mut c = Collector::new();
        c.record(7, "p-7", SendKind::First, 0, &ok_http(Uuid::now_v7()), 1);
        for _ in 0..15 {
            c.record(7, "p-7", SendKind::Retry, 0, &ok_grpc(Uuid::now_v7()), 1);
        }
        assert_eq!(c.replay.mismatches, 15);
        assert_eq!(c.replay.examples.len(), MAX_EXAMPLES);
        assert!(c.replay.examples[0].starts_with("key p-7: order_id"));
        assert_eq!(c.live().mismatches, 15);
    }

    #[test]
    fn bad_responses_are_not_ok() {
        let mut c = Collector::new();
        let bad = Outcome::BadResponse(Answer::Http(201), "HTTP 201: nope".into());
        c.record(1, "p-1", SendKind::First, 0, &bad, 1);
        assert_eq!(c.counts.ok, 0);
        assert_eq!(c.counts.bad_responses, 1);
        assert_eq!(c.bad_examples, vec!["key p-1: HTTP 201: nope".to_owned()]);
        // The service said it created the order: the key may hold it.
        assert_eq!(c.key_counts().ambiguous, 1);
    }
}
