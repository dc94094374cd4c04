//! The summary's shape (`chaos.json`, pinned) and its figures.

use super::*;
use serde_json::json;

#[test]
fn percentiles_of_small_samples() {
    assert_eq!(percentile(&[], 0.5), None);
    assert_eq!(percentile(&[7], 0.99), Some(7));
    assert_eq!(percentile(&[1, 2, 3, 4], 0.5), Some(2));
    assert_eq!(percentile(&[1, 2, 3, 4], 0.99), Some(4));
}

#[test]
fn the_table_shows_numbers_as_before() {
    assert_eq!(show(None::<u64>), "-");
    assert_eq!(show(Some(42u64)), "42");
    assert_eq!(show(120.0), "120");
    assert_eq!(show(2.5), "2.5");
    assert_eq!(show(f64::NAN), "-");
}

/// The summary the experiment scripts read, field by field: a rename, a
/// type change or a new nesting fails here before it breaks them.
#[test]
fn the_json_shape_is_pinned() {
    use clap::Parser;
    let config = Config::try_parse_from([
        "chaos",
        "--crash-point",
        "publish",
        "--crash-every",
        "7",
        "--fault",
        "pg-crash",
        "--seed",
        "3",
    ])
    .expect("parses");
    let life = |started_ms, end, counters: &[(&str, f64)]| Life {
        started_ms,
        ready_ms: Some(started_ms + 100),
        progress_ms: Some(started_ms + 300),
        ended_ms: Some(started_ms + 1_000),
        armed: true,
        end: Some(end),
        counters: counters
            .iter()
            .map(|(k, v)| ((*k).to_owned(), *v))
            .collect(),
    };
    let relay = vec![
        life(
            0,
            End::CrashPoint {
                point: "publish".into(),
            },
            &[("relay_published_total", 40.0)],
        ),
        life(1_020, End::Stopped, &[("relay_published_total", 60.0)]),
    ];
    let payments = vec![life(
        0,
        End::Stopped,
        &[
            ("payments_consumed_total", 100.0),
            (
                "payments_injected_duplicates_total{kind=\"reprocess\"}",
                3.0,
            ),
        ],
    )];
    let outcome = Outcome {
        load: json!({"exit_code": 0}),
        recon_code: 0,
        interrupted: false,
        faults: vec![FaultRecord {
            fault: Fault::PgCrash,
            injected_ms: 5_000,
            outage_ms: Some(2_000),
            recovery_ms: Some(3_500),
            error: None,
            note: None,
            inbox_hits: Some(12),
            whole_ms: None,
        }],
    };
    let mut summary = summarize(
        &config,
        Path::new("/tmp/chaos"),
        &[
            InstanceLives {
                service: ServiceName::Relay,
                label: "relay".into(),
                lives: relay,
            },
            InstanceLives {
                service: ServiceName::Payments,
                label: "payments".into(),
                lives: payments,
            },
        ],
        outcome,
        json!({"clean": true}),
        Instant::now(),
    );
    summary.elapsed_s = 12.5;
    assert!(
        summary.started_at_unix_ms > 1_700_000_000_000,
        "a wall-clock start"
    );
    summary.started_at_unix_ms = 1_800_000_000_000;
    let got = serde_json::to_value(&summary).expect("serializes");
    let want = json!({
        "schema": "effectively.chaos.v1",
        "interrupted": false,
        "elapsed_s": 12.5,
        "started_at_unix_ms": 1_800_000_000_000_u64,
        "params": {
            "rate": config.rate,
            "duration_s": config.duration,
            "max_duration_s": null,
            "retry_rate": config.retry_rate,
            "protocol": config.protocol,
            "zipf_s": config.zipf_s,
            "orders": 1,
            "relays": 1,
            "payments": 1,
            "seed": 3,
            "crash_point": ["publish"],
            "crash_every": 7,
            "crash_probability": config.crash_probability,
            "random_kill": [],
            "kill_interval_ms": [config.kill_interval_ms.0, config.kill_interval_ms.1],
            "fault": ["pg-crash"],
            "fault_interval_ms": [config.fault_interval_ms.0, config.fault_interval_ms.1],
            "fault_count": null,
            "fault_down_ms": config.fault_down_ms,
            "pg_lag_ms": config.pg_lag_ms,
            "pg_partition_ms": config.pg_partition_ms,
            "relay_pause_ms": config.relay_pause_ms,
            "dup_rate": 0.0,
            "dup_kind": config.dup_kind,
            "unsafe_split_txn": null,
            "static_membership": config.static_membership,
            "drain_timeout_s": config.drain_timeout,
            "transport": "kafka",
            "relay_kind": "relay",
            "webhook_schedule_scale": 1.0,
            "webhook_timeout_ms": 10000,
            "webhook_max_attempts": 8,
        },
        "kills_total": 1,
        "faults": {
            "pg-crash": {
                "injected": 1,
                "failed_to_inject": 0,
                "recovered": 1,
                "outage_ms": {"count": 1, "p50": 2000, "p99": 2000, "max": 2000},
                "recovery_ms": {"count": 1, "p50": 3500, "p99": 3500, "max": 3500},
                "inbox_hits": {"count": 1, "p50": 12, "p99": 12, "max": 12},
                "whole_ms": {"count": 0, "p50": null, "p99": null, "max": null},
            },
        },
        "fault_log": [{
            "fault": "pg-crash",
            "injected_ms": 5000,
            "outage_ms": 2000,
            "recovery_ms": 3500,
            "error": null,
            "note": null,
            "inbox_hits": 12,
            "whole_ms": null,
        }],
        "services": {
            "payments": {
                "lives": 1,
                "restarts": 0,
                "deaths": {},
                "recovery_ms": {
                    "to_ready": {"count": 0, "p50": null, "p99": null, "max": null},
                    "to_progress": {"count": 0, "p50": null, "p99": null, "max": null},
                },
                "counters": {"consumed": 100.0, "injected_reprocess": 3.0},
                "life_log": [{
                    "started_ms": 0,
                    "ready_ms": 100,
                    "progress_ms": 300,
                    "ended_ms": 1000,
                    "armed": true,
                    "end": {"kind": "stopped"},
                }],
                "instances": [{"label": "payments", "lives": 1, "deaths": {}}],
            },
            "relay": {
                "lives": 2,
                "restarts": 1,
                "deaths": {"crash_point:publish": 1},
                "recovery_ms": {
                    "to_ready": {"count": 1, "p50": 120, "p99": 120, "max": 120},
                    "to_progress": {"count": 1, "p50": 320, "p99": 320, "max": 320},
                },
                "counters": {"published": 100.0},
                "life_log": [
                    {
                        "started_ms": 0,
                        "ready_ms": 100,
                        "progress_ms": 300,
                        "ended_ms": 1000,
                        "armed": true,
                        "end": {"kind": "crash_point", "point": "publish"},
                    },
                    {
                        "started_ms": 1020,
                        "ready_ms": 1120,
                        "progress_ms": 1320,
                        "ended_ms": 2020,
                        "armed": true,
                        "end": {"kind": "stopped"},
                    },
                ],
                "instances": [
                    {"label": "relay", "lives": 2, "deaths": {"crash_point:publish": 1}},
                ],
            },
        },
        "totals": {"consumed": 100.0, "injected_reprocess": 3.0, "published": 100.0},
        "injected_duplicates": 3.0,
        "load": {"exit_code": 0},
        "recon": {"clean": true},
        "recon_exit": 0,
        "result": "CLEAN",
        "out_dir": "/tmp/chaos",
    });
    assert_eq!(got, want);
}

#[test]
fn a_services_instances_add_up_and_recover_each_from_its_own_deaths() {
    use clap::Parser;
    let config = Config::try_parse_from(["chaos", "--payments", "2"]).expect("parses");
    let life = |started_ms: u64, end: End, consumed: f64| Life {
        started_ms,
        ready_ms: Some(started_ms + 100),
        progress_ms: Some(started_ms + 200),
        ended_ms: Some(started_ms + 1_000),
        armed: true,
        end: Some(end),
        counters: [("payments_consumed_total".to_owned(), consumed)].into(),
    };
    // payments-1 killed once (restarted 50 ms later); payments-2 never.
    let one = vec![
        life(0, End::RandomKill, 10.0),
        life(1_050, End::Stopped, 5.0),
    ];
    let two = vec![life(0, End::Stopped, 20.0)];
    let summary = summarize(
        &config,
        Path::new("/tmp/chaos"),
        &[
            InstanceLives {
                service: ServiceName::Payments,
                label: "payments-1".into(),
                lives: one,
            },
            InstanceLives {
                service: ServiceName::Payments,
                label: "payments-2".into(),
                lives: two,
            },
        ],
        Outcome::default(),
        Value::Null,
        Instant::now(),
    );
    let p = &summary.services["payments"];
    assert_eq!((p.lives, p.restarts), (3, 1), "one restart, not two");
    assert_eq!(p.deaths.get("random_kill"), Some(&1));
    assert_eq!(summary.kills_total, 1);
    assert_eq!(p.counters.get("consumed"), Some(&35.0));
    assert_eq!(p.recovery_ms.to_ready.count, 1);
    assert_eq!(p.recovery_ms.to_ready.max, Some(150));
    let labels: Vec<(&str, usize)> = p
        .instances
        .iter()
        .map(|i| (i.label.as_str(), i.lives))
        .collect();
    assert_eq!(labels, [("payments-1", 2), ("payments-2", 1)]);
    assert!(p.instances[1].deaths.is_empty());
    assert_eq!(summary.params.payments, 2);
}
