//! The report's, the CSVs' and the key files' tests.

use bytes::Bytes;
use http::HeaderValue;
use uuid::Uuid;

use super::csv::{csv_text, minute_csv_text};
use super::*;
use crate::config::{Protocol, Spread};
use crate::keys::KeySpace;
use crate::outcome::{Answer, HttpReply, Outcome, Success};
use crate::stats::{SendKind, new_histogram};

fn params() -> Params {
    Params {
        protocol: Protocol::Mixed,
        http_urls: vec!["http://h".into()],
        grpc_urls: vec!["http://g".into()],
        spread: Spread::RoundRobin,
        rate: 100.0,
        duration_s: 2,
        max_in_flight: 10,
        timeout_ms: 2000,
        drain_timeout_s: 10,
        zipf_s: 0.0,
        keys: 5,
        hot_keys: 0,
        hot_share: 0.5,
        key_prefix: "pfx".into(),
        seed: 1,
        retry_rate: 0.15,
        retry_delay_ms: 200,
        retry_on_error: 0,
        retry_on_error_delay_ms: 200,
        threads: 1,
    }
}

fn facts(interrupted: bool) -> RunFacts {
    RunFacts {
        params: params(),
        started_at_unix_ms: 0,
        interrupted,
        ended_early: false,
        window_s: 2.0,
        elapsed_s: 2.5,
        sends: SendCounts {
            first_attempts_scheduled: 200,
            first_attempts_sent: 200,
            sent: 230,
            ..SendCounts::default()
        },
        unfinished: 0,
        targets: vec![],
    }
}

fn ok(id: Uuid) -> Outcome {
    Outcome::Ok(Success {
        order_id: id,
        status: "created".into(),
        http: Some(HttpReply {
            status: 201,
            body: Bytes::from(format!(r#"{{"order_id":"{id}","status":"created"}}"#)),
            location: None,
            etag: Some(HeaderValue::from_static("\"e\"")),
        }),
    })
}

#[test]
fn percentiles_in_milliseconds() {
    let mut h = new_histogram();
    for us in 1..=1000 {
        h.saturating_record(us * 1000); // 1..=1000 ms
    }
    let s = LatencySummary::from_histogram(&h);
    assert_eq!(s.count, 1000);
    let close = |a: f64, b: f64| (a - b).abs() <= b * 0.002;
    assert!(close(s.p50_ms, 500.0), "{s:?}");
    assert!(close(s.p90_ms, 900.0), "{s:?}");
    assert!(close(s.p99_ms, 990.0), "{s:?}");
    assert!(close(s.p999_ms, 999.0), "{s:?}");
    assert!(close(s.max_ms, 1000.0), "{s:?}");
    assert!(close(s.mean_ms, 500.5), "{s:?}");
    let empty = LatencySummary::from_histogram(&new_histogram());
    assert_eq!(empty.count, 0);
    assert!(empty.max_ms.abs() < f64::EPSILON);
}

#[test]
fn report_assembles_rates_and_exit_codes() {
    let mut c = Collector::new();
    let id = Uuid::now_v7();
    c.record(1, "pfx-1", SendKind::First, 0, &ok(id), 2_000);
    c.record(1, "pfx-1", SendKind::Retry, 0, &ok(id), 3_000);
    c.record(
        2,
        "pfx-2",
        SendKind::First,
        0,
        &Outcome::Failed(Answer::Http(503)),
        1_000,
    );
    let report = Report::assemble(facts(false), &c);
    assert_eq!(report.exit_code, 0);
    assert!((report.rates.achieved - 1.5).abs() < 1e-9);
    assert!((report.rates.ok - 1.0).abs() < 1e-9);
    assert!((report.rates.offered_sends - 115.0).abs() < 1e-9);
    assert_eq!(report.http_status.get("201"), Some(&2));
    assert_eq!(report.latency_ms.all.count, 3);
    assert_eq!(report.latency_ms.first_attempts.count, 2);
    assert_eq!(report.keys.succeeded, 1);
    let json = serde_json::to_value(&report).expect("json");
    assert_eq!(json["schema"], "loadgen.report.v1");
    assert_eq!(json["params"]["protocol"], "mixed");
    assert_eq!(json["replay"]["mismatches"], 0);
    assert_eq!(json["outcomes"]["server_errors"], 1);
    assert!(json["latency_ms"]["all"]["p99_ms"].is_f64());
    let text = report.summary();
    assert!(text.contains("0 MISMATCHES"), "{text}");
    assert!(text.contains("prefix pfx"), "{text}");
    // Without --hot-keys every send is cold and there is no hot class.
    assert!(json["key_classes"].get("hot").is_none(), "{json}");
    assert_eq!(json["key_classes"]["cold"]["sends"], 3);
    assert_eq!(json["key_classes"]["cold"]["keys_succeeded"], 1);
    assert_eq!(json["params"]["hot_keys"], 0);
    assert!(!text.contains("  hot "), "{text}");
    assert!(!text.contains("  cold "), "{text}");
    assert!(!text.contains("instances"), "one instance: {text}");

    // Several orders instances: each one's sends, in the JSON and the text.
    let mut spread = facts(false);
    spread.targets = ["http://a:1", "http://b:2"]
        .iter()
        .enumerate()
        .map(|(i, url)| TargetReport {
            protocol: "http",
            url: (*url).to_owned(),
            sent: 10 + i as u64,
            ok: 9,
        })
        .collect();
    let mut one_each = spread.clone();
    one_each.targets[1].protocol = "grpc";
    let report = Report::assemble(spread, &c);
    let json = serde_json::to_value(&report).expect("json");
    assert_eq!(json["targets"][1]["url"], "http://b:2");
    assert_eq!(json["targets"][1]["sent"], 11);
    let text = report.summary();
    assert!(
        text.contains(
            "instances   http://a:1 (http) 10 sent 9 ok; http://b:2 (http) 11 sent 9 ok (--spread round-robin)"
        ),
        "{text}"
    );
    // One instance per protocol is not a spread: no line.
    let text = Report::assemble(one_each, &c).summary();
    assert!(!text.contains("instances"), "{text}");

    assert_eq!(
        Report::assemble(facts(true), &c).exit_code,
        EXIT_INTERRUPTED
    );
    c.record(1, "pfx-1", SendKind::Retry, 0, &ok(Uuid::now_v7()), 1);
    let report = Report::assemble(facts(true), &c);
    assert_eq!(
        report.exit_code, EXIT_MISMATCH,
        "mismatches win over interrupt"
    );
    assert!(report.summary().contains("mismatch: key pfx-1"));
}

#[test]
fn report_splits_hot_and_cold_keys() {
    let mut c = Collector::with_hot_keys(10);
    let (a, b, d) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    // Hot key 3: four sends of one intent (one a 503, resent), 1..4 ms.
    c.record(3, "pfx-3", SendKind::First, 0, &ok(a), 1_000);
    c.record(3, "pfx-3", SendKind::First, 0, &ok(a), 2_000);
    c.record(
        3,
        "pfx-3",
        SendKind::First,
        0,
        &Outcome::Failed(Answer::Http(503)),
        3_000,
    );
    c.record_error_retry(3);
    c.record(3, "pfx-3", SendKind::Retry, 0, &ok(a), 4_000);
    // Hot key 10, the last hot one: one success.
    c.record(10, "pfx-10", SendKind::First, 0, &ok(b), 8_000);
    // Cold key 11: one success; cold key 12: a timeout, no latency.
    c.record(11, "pfx-11", SendKind::First, 0, &ok(d), 500);
    c.record(
        12,
        "pfx-12",
        SendKind::First,
        0,
        &Outcome::Timeout,
        2_000_000,
    );
    let mut facts = facts(false);
    facts.params.hot_keys = 10;
    facts.params.hot_share = 0.8;
    let report = Report::assemble(facts, &c);

    let hot = report.key_classes.hot.expect("hot class");
    assert_eq!((hot.sends, hot.ok, hot.errors), (5, 4, 1));
    assert_eq!((hot.error_retries_sent, hot.keys_succeeded), (1, 2));
    assert!((hot.sends_per_key - 2.5).abs() < 1e-9);
    assert!((hot.retries_per_success - 0.25).abs() < 1e-9);
    assert_eq!(hot.latency_ms.count, 5);
    assert!((hot.latency_ms.max_ms - 8.0).abs() < 0.01);
    let cold = report.key_classes.cold;
    assert_eq!((cold.sends, cold.ok, cold.errors), (2, 1, 1));
    assert_eq!((cold.error_retries_sent, cold.keys_succeeded), (0, 1));
    assert!((cold.sends_per_key - 2.0).abs() < 1e-9);
    assert!(cold.retries_per_success.abs() < f64::EPSILON);
    assert_eq!(cold.latency_ms.count, 1);
    assert_eq!(hot.sends + cold.sends, report.outcomes.completed);

    let json = serde_json::to_value(&report).expect("json");
    assert_eq!(json["schema"], "loadgen.report.v1");
    assert_eq!(json["params"]["hot_keys"], 10);
    assert_eq!(json["params"]["hot_share"], 0.8);
    let classes = &json["key_classes"];
    for field in [
        "sends",
        "ok",
        "errors",
        "error_retries_sent",
        "keys_succeeded",
        "sends_per_key",
        "retries_per_success",
    ] {
        assert!(classes["hot"][field].is_number(), "hot {field}: {json}");
        assert!(classes["cold"][field].is_number(), "cold {field}: {json}");
    }
    assert_eq!(classes["hot"]["sends_per_key"], 2.5);
    assert_eq!(classes["cold"]["retries_per_success"], 0.0);
    for field in ["count", "p50_ms", "p99_ms", "p999_ms", "max_ms"] {
        assert!(classes["hot"]["latency_ms"][field].is_number(), "{json}");
        assert!(classes["cold"]["latency_ms"][field].is_number(), "{json}");
    }
    // The same shape as the overall latency summaries.
    let keys = |v: &serde_json::Value| {
        v.as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>())
            .unwrap_or_default()
    };
    assert_eq!(
        keys(&classes["hot"]["latency_ms"]),
        keys(&json["latency_ms"]["all"])
    );

    let text = report.summary();
    assert!(
        text.contains("hot 1..=10 (uniform) for a share 0.8"),
        "{text}"
    );
    let hot_line = text
        .lines()
        .find(|l| l.starts_with("  hot "))
        .expect("a hot line");
    assert!(hot_line.contains("n=5 "), "{hot_line}");
    assert!(
        hot_line.contains("sends 5, ok 4, errors 1, error retries 1, keys 2 (2.50 sends/key, 0.250 error retries/ok)"),
        "{hot_line}"
    );
    let cold_line = text
        .lines()
        .find(|l| l.starts_with("  cold "))
        .expect("a cold line");
    assert!(cold_line.contains("sends 2, ok 1, errors 1"), "{cold_line}");
}

#[test]
fn csv_has_the_fixed_columns() {
    let mut c = Collector::new();
    c.record(1, "p-1", SendKind::First, 0, &ok(Uuid::now_v7()), 4_000);
    c.record(
        2,
        "p-2",
        SendKind::First,
        2_100_000_000,
        &Outcome::Timeout,
        2_000_000,
    );
    let text = csv_text(&c.seconds);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "second,sent,ok,errors,p99_ms");
    // The per-second histograms keep 2 significant digits: within 1%.
    let row0: Vec<&str> = lines[1].split(',').collect();
    assert_eq!(row0[..4], ["0", "1", "1", "0"]);
    let p99: f64 = row0[4].parse().expect("p99 number");
    assert!((p99 - 4.0).abs() <= 0.04, "{p99}");
    assert_eq!(lines[2], "1,0,0,0,", "an empty second has no p99");
    assert_eq!(lines[3], "2,1,0,1,", "a timeout has no latency");
    assert_eq!(lines.len(), 4);
}

#[test]
fn minute_csv_merges_the_seconds_of_each_minute() {
    let mut c = Collector::new();
    // Minute 0: 4 ms at second 0, 40 ms at second 59; minute 1: a
    // timeout at second 61 and 1 ms at second 62.
    c.record(1, "p-1", SendKind::First, 0, &ok(Uuid::now_v7()), 4_000);
    c.record(
        2,
        "p-2",
        SendKind::First,
        59_000_000_000,
        &ok(Uuid::now_v7()),
        40_000,
    );
    c.record(
        3,
        "p-3",
        SendKind::First,
        61_000_000_000,
        &Outcome::Timeout,
        2_000_000,
    );
    c.record(
        4,
        "p-4",
        SendKind::First,
        62_000_000_000,
        &ok(Uuid::now_v7()),
        1_000,
    );
    let text = minute_csv_text(&c.seconds);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        "minute,sent,ok,errors,sent_per_s,p50_ms,p99_ms,p999_ms,max_ms"
    );
    let row0: Vec<&str> = lines[1].split(',').collect();
    assert_eq!(row0[..5], ["0", "2", "2", "0", "0.0"]);
    let num = |v: &str| v.parse::<f64>().expect("a number");
    assert!((num(row0[5]) - 4.0).abs() <= 0.04, "{}", lines[1]);
    assert!((num(row0[6]) - 40.0).abs() <= 0.4, "{}", lines[1]);
    let row1: Vec<&str> = lines[2].split(',').collect();
    // Seconds 60..=62 exist: 2 sends over 3 seconds.
    assert_eq!(row1[..5], ["1", "2", "1", "1", "0.7"]);
    assert!((num(row1[6]) - 1.0).abs() <= 0.01, "{}", lines[2]);
    assert_eq!(lines.len(), 3);
}

#[test]
fn key_files_are_sorted_and_split() {
    let space = KeySpace::new("p".into(), 1);
    let mut c = Collector::new();
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    c.record(10, "p-10", SendKind::First, 0, &ok(a), 1);
    c.record(9, "p-9", SendKind::First, 0, &ok(b), 1);
    c.record(3, "p-3", SendKind::First, 0, &Outcome::Timeout, 1);
    c.record(4, "p-4", SendKind::First, 0, &Outcome::ConnectError, 1);
    // The route timed out with the create already in a batch: 408, and
    // the key may hold its order.
    let timed_out = Outcome::Failed(Answer::Http(408));
    c.record(5, "p-5", SendKind::First, 0, &timed_out, 1);
    // A 503 then a connection refused: the 503 may hide a commit.
    c.record(
        6,
        "p-6",
        SendKind::First,
        0,
        &Outcome::Failed(Answer::Http(503)),
        1,
    );
    c.record(6, "p-6", SendKind::Retry, 0, &Outcome::ConnectError, 1);
    // A 503 resolved by its retry's success.
    c.record(
        7,
        "p-7",
        SendKind::First,
        0,
        &Outcome::Failed(Answer::Http(500)),
        1,
    );
    c.record(7, "p-7", SendKind::Retry, 0, &ok(a), 1);
    // Refused for good: nothing written.
    c.record(
        8,
        "p-8",
        SendKind::First,
        0,
        &Outcome::Failed(Answer::Http(400)),
        1,
    );
    // Bound to another request: in no file.
    c.record(
        11,
        "p-11",
        SendKind::First,
        0,
        &Outcome::Failed(Answer::Http(409)),
        1,
    );
    let lines = key_lines(&c, &space, None);
    assert_eq!(
        lines.intents,
        vec![
            format!("p-10\t{a}"),
            format!("p-7\t{a}"),
            format!("p-9\t{b}")
        ]
    );
    assert_eq!(lines.ambiguous, vec!["p-3", "p-5", "p-6"]);
    assert_eq!(lines.failed, vec!["p-4", "p-8"]);
    // With a token, every line names its caller: the keys' scope.
    let scoped = key_lines(&c, &space, Some("shop"));
    assert_eq!(scoped.intents[0], format!("p-10\t{a}\tshop"));
    assert_eq!(scoped.ambiguous[0], "p-3\tshop");
    assert_eq!(scoped.failed, vec!["p-4\tshop", "p-8\tshop"]);
    let counts = c.key_counts();
    assert_eq!(
        (
            counts.succeeded,
            counts.ambiguous,
            counts.failed,
            counts.conflicted
        ),
        (3, 3, 3, 1)
    );
}
