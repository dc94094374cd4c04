//! Chaos's settings: what is refused and what is taken.

use super::*;

fn parse(args: &[&str]) -> Config {
    Config::try_parse_from(std::iter::once("chaos").chain(args.iter().copied())).expect("parses")
}

#[test]
fn a_crash_point_without_a_schedule_is_refused() {
    let c = parse(&["--crash-point", "publish"]);
    assert!(c.validate().expect_err("refused").contains("--crash-every"));
    assert!(
        parse(&["--crash-point", "publish", "--crash-every", "5"])
            .validate()
            .is_ok()
    );
    let c = parse(&["--crash-point", "split", "--crash-every", "5"]);
    assert!(
        c.validate()
            .expect_err("refused")
            .contains("--unsafe-split-txn")
    );
}

#[test]
fn a_max_duration_needs_a_fault_count_and_the_floor_under_it() {
    let err = |args: &[&str]| parse(args).validate().expect_err("refused");
    assert!(err(&["--max-duration", "60"]).contains("--fault-count"));
    assert!(err(&["--max-duration", "60", "--fault", "pg-crash"]).contains("--fault-count"));
    let c = [
        "--fault",
        "pg-crash",
        "--fault-count",
        "3",
        "--duration",
        "30",
    ];
    assert!(err(&[&c[..], &["--max-duration", "20"]].concat()).contains("shorter"));
    let ok = parse(&[&c[..], &["--max-duration", "90"]].concat());
    assert!(ok.validate().is_ok());
    let args = crate::spec::loadgen_args(&ok, std::path::Path::new("/tmp"));
    let at = args
        .iter()
        .position(|a| a == "--duration")
        .expect("--duration");
    assert_eq!(
        args[at + 1],
        "90",
        "loadgen's schedule is the longest the load may last"
    );
}

#[test]
fn instances_need_free_distinct_addresses_and_one_receiver_over_http() {
    let err = |args: &[&str]| parse(args).validate().expect_err("refused");
    assert!(
        parse(&["--orders", "16", "--relays", "16", "--payments", "16"])
            .validate()
            .is_ok()
    );
    assert!(err(&["--transport", "http", "--payments", "2"]).contains("--transport kafka"));
    assert!(
        parse(&["--transport", "http", "--orders", "3", "--relays", "2"])
            .validate()
            .is_ok()
    );
    // Orders' second gRPC port lands on the relay's first metrics port.
    let e = err(&["--orders", "2", "--grpc-addr", "127.0.0.1:18301"]);
    assert!(
        e.contains("--grpc-addr of orders-2") && e.contains("--relay-metrics-addr"),
        "{e}"
    );
    let e = err(&["--relays", "3", "--relay-metrics-addr", "127.0.0.1:65400"]);
    assert!(e.contains("past 65535"), "{e}");
    assert!(
        Config::try_parse_from(["chaos", "--payments", "17"]).is_err(),
        "at most {MAX_INSTANCES}"
    );
    assert!(Config::try_parse_from(["chaos", "--orders", "0"]).is_err());
}

#[test]
fn payments_scale_needs_instances_and_steps_within_them() {
    let err = |args: &[&str]| parse(args).validate().expect_err("refused");
    assert!(err(&["--fault", "payments-scale"]).contains("--payments 2"));
    let e = err(&[
        "--fault",
        "payments-scale",
        "--payments",
        "3",
        "--payments-scale",
        "1,4",
    ]);
    assert!(e.contains("--payments-scale 4"), "{e}");
    let c = parse(&[
        "--fault",
        "payments-scale",
        "--payments",
        "6",
        "--payments-scale",
        "1,6,2",
    ]);
    assert!(c.validate().is_ok());
    let steps: Vec<u16> = (0..5).map(|r| c.payments_scale_step(r)).collect();
    assert_eq!(steps, [1, 6, 2, 1, 6]);
    let c = parse(&["--fault", "payments-scale", "--payments", "4"]);
    assert_eq!((c.payments_scale_step(0), c.payments_scale_step(1)), (1, 4));
}

#[test]
fn rates_and_ranges_are_checked() {
    assert!(parse(&["--dup-rate", "1.5"]).validate().is_err());
    assert!(parse(&["--rate", "0"]).validate().is_err());
    assert_eq!(parse_range("100..200"), Ok((100, 200)));
    assert!(parse_range("200..100").is_err());
    assert!(parse_range("0..10").is_err());
    assert!(parse_range("5").is_err());
    let c = parse(&[
        "--random-kill",
        "relay,payments",
        "--kill-interval-ms",
        "500..900",
    ]);
    assert_eq!(
        c.random_kill,
        vec![ServiceName::Relay, ServiceName::Payments]
    );
    assert_eq!(c.kill_interval_ms, (500, 900));
}

#[test]
fn several_crash_points_and_faults_are_taken() {
    let c = parse(&[
        "--crash-point",
        "commit,publish,claim,effect",
        "--crash-every",
        "50",
        "--fault",
        "pg-crash,broker-kill,relay-pause,offset-reset",
    ]);
    assert!(c.validate().is_ok());
    assert_eq!(
        c.crash_points_of(ServiceName::Payments).as_deref(),
        Some("claim,effect")
    );
    assert_eq!(
        c.crash_points_of(ServiceName::Relay).as_deref(),
        Some("publish")
    );
    assert_eq!(c.fault.len(), 4);
    let http = parse(&[
        "--transport",
        "http",
        "--crash-point",
        "deliver,respond,commit",
        "--crash-every",
        "9",
        "--fault",
        "pg-crash,relay-pause",
    ]);
    assert!(http.validate().is_ok());
    assert_eq!(
        http.crash_points_of(ServiceName::Relay).as_deref(),
        Some("deliver")
    );
    for (args, wanted) in [
        (
            &["--crash-point", "deliver", "--crash-every", "3"][..],
            "--transport http",
        ),
        (
            &[
                "--transport",
                "http",
                "--crash-point",
                "publish",
                "--crash-every",
                "3",
            ],
            "deliver",
        ),
        (&["--transport", "http", "--dup-rate", "0.1"], "--dup-rate"),
        (
            &["--transport", "http", "--fault", "broker-kill"],
            "no broker",
        ),
        (
            &["--transport", "http", "--webhook-schedule-scale", "2"],
            "at most 1",
        ),
    ] {
        let error = parse(args).validate().expect_err("refused");
        assert!(error.contains(wanted), "{args:?}: {error}");
    }
    let short = parse(&["--fault", "relay-pause", "--relay-pause-ms", "500"]);
    assert!(
        short
            .validate()
            .expect_err("refused")
            .contains("--relay-pause-ms")
    );
}

#[test]
fn debezium_runs_one_worker_over_kafka_with_kills_and_duplicates_only() {
    let ok = parse(&[
        "--relay-kind",
        "debezium",
        "--random-kill",
        "relay",
        "--dup-rate",
        "0.05",
    ]);
    assert_eq!(ok.validate(), Ok(()));
    for (args, says) in [
        (
            &["--relay-kind", "debezium", "--relays", "2"][..],
            "--relays 1",
        ),
        (
            &["--relay-kind", "debezium", "--transport", "http"][..],
            "publishes to Kafka",
        ),
        (
            &[
                "--relay-kind",
                "debezium",
                "--crash-point",
                "publish",
                "--crash-every",
                "5",
            ][..],
            "--random-kill relay",
        ),
        (
            &["--relay-kind", "debezium", "--fault", "broker-kill"][..],
            "--fault broker-kill",
        ),
    ] {
        let err = parse(args).validate().expect_err("refused");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
