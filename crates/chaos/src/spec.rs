//! How chaos starts its children: each service's [`Spec`] (environment,
//! armed crash points, log and marker files) and loadgen's arguments.

use std::path::Path;
use std::time::Duration;

use pipeline::db::ServiceRole;

use pipeline::contract::{ServiceName, UNSAFE_SPLIT_TXN_ENV, WEBHOOK_PATH, env};

use crate::config::{Config, Instance, RelayKind, Transport};
use crate::fault::Fault;
use crate::supervisor::{Probe, Spec};

/// `DATABASE_URL` for a child running as `role`: the role's own URL
/// (`ORDERS_DATABASE_URL`, ...) when chaos was given one; else nothing, and
/// the child inherits chaos's DATABASE_URL.
pub fn role_database_url(role: ServiceRole) -> Option<(String, String)> {
    std::env::var(role.url_var())
        .ok()
        .map(|url| (env::DATABASE_URL.to_owned(), url))
}

/// `KAFKA_CLIENT_CONFIG` for a child running as `service`: its own
/// principal's client config file (`RELAY_KAFKA_CLIENT_CONFIG`,
/// `PAYMENTS_KAFKA_CLIENT_CONFIG`) when chaos was given one, as the stack's
/// env file gives them; else nothing, and the child inherits chaos's.
pub fn kafka_client_config(service: ServiceName) -> Option<(String, String)> {
    let own = match service {
        ServiceName::Orders => return None,
        ServiceName::Relay => "RELAY_KAFKA_CLIENT_CONFIG",
        ServiceName::Payments => "PAYMENTS_KAFKA_CLIENT_CONFIG",
    };
    std::env::var(own)
        .ok()
        .map(|file| ("KAFKA_CLIENT_CONFIG".to_owned(), file))
}

/// The connector chaos has scripts/debezium.sh register on its worker
/// (DEBEZIUM_CONNECTOR), whose status is the worker's readiness.
pub const DEBEZIUM_CONNECTOR: &str = "effectively-outbox";

/// How to run `instance` of the binaries in `bin_dir`, its files in `out`
/// (named by [`Instance::label`]).
pub fn service(config: &Config, bin_dir: &Path, out: &Path, instance: Instance) -> Spec {
    let name = instance.service;
    let label = instance.label();
    let rust_log = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    let mut env = vec![("RUST_LOG".to_owned(), rust_log)];
    env.extend(role_database_url(match name {
        ServiceName::Orders => ServiceRole::Orders,
        ServiceName::Relay => ServiceRole::Relay,
        ServiceName::Payments => ServiceRole::Payments,
    }));
    env.extend(kafka_client_config(name));
    let mut armed_env = Vec::new();
    let s = |a: &dyn ToString| a.to_string();
    match name {
        ServiceName::Orders => {
            let (http, grpc) = config.orders_addr(instance);
            env.push((env::ORDERS_HTTP_ADDR.into(), s(&http)));
            env.push((env::ORDERS_GRPC_ADDR.into(), s(&grpc)));
            env.push((
                env::ORDERS_METRICS_ADDR.into(),
                s(&config.metrics_addr(instance)),
            ));
        }
        ServiceName::Relay => {
            env.push((
                env::RELAY_METRICS_ADDR.into(),
                s(&config.metrics_addr(instance)),
            ));
            if config.transport == Transport::Http {
                env.push((env::RELAY_SINK.into(), "http".into()));
                if let Some(secret) = &config.webhook_secret {
                    env.push((
                        env::RELAY_WEBHOOK_DESTINATIONS.into(),
                        format!(
                            "payments=http://{}{WEBHOOK_PATH},secret={},timeout={}ms,max-attempts={},allow-http",
                            config.webhook_proxy_addr,
                            secret.to_whsec(),
                            config.webhook_timeout_ms,
                            config.webhook_max_attempts
                        ),
                    ));
                }
                // Chaos's own proxy in front of the receiver: on this
                // host, which the relay's webhooks may not reach unless
                // allowed.
                env.push((
                    env::RELAY_WEBHOOK_ALLOW_ADDRESSES.into(),
                    config.webhook_proxy_addr.ip().to_string(),
                ));
                env.push((
                    env::RELAY_WEBHOOK_SCHEDULE_SCALE.into(),
                    s(&config.webhook_schedule_scale),
                ));
            }
            if config.fault.contains(&Fault::RelayPause) {
                // The pause must outlast the relay's session limits.
                env.push((
                    env::DB_IDLE_IN_TRANSACTION_TIMEOUT_MS.into(),
                    s(&(config.relay_pause_ms / 2)),
                ));
                env.push((
                    env::RELAY_MESSAGE_TIMEOUT_MS.into(),
                    s(&(config.relay_pause_ms / 4)),
                ));
            }
        }
        ServiceName::Payments => {
            env.push((
                env::PAYMENTS_METRICS_ADDR.into(),
                s(&config.metrics_addr(instance)),
            ));
            if config.static_membership {
                // One id for every life of this instance, unique to this
                // run and instance.
                env.push((
                    env::PAYMENTS_GROUP_INSTANCE_ID.into(),
                    format!("chaos-{label}-{}", std::process::id()),
                ));
            }
            if config.transport == Transport::Http {
                env.push((env::PAYMENTS_SOURCE.into(), "http".into()));
                env.push((env::PAYMENTS_WEBHOOK_ADDR.into(), s(&config.webhook_addr)));
                if let Some(secret) = &config.webhook_secret {
                    env.push((env::PAYMENTS_WEBHOOK_SECRET.into(), secret.to_whsec()));
                }
            }
            if let Some(split) = config.unsafe_split_txn {
                env.push((UNSAFE_SPLIT_TXN_ENV.into(), split.as_str().into()));
            }
            if config.dup_rate > 0.0 {
                armed_env.push((env::PAYMENTS_DUP_RATE.into(), s(&config.dup_rate)));
                armed_env.push((env::PAYMENTS_DUP_KIND.into(), config.dup_kind.clone()));
            }
        }
    }
    let crash_point = config.crash_points_of(name);
    if let Some(points) = &crash_point {
        armed_env.push((env::CRASH_POINT.into(), points.clone()));
        if let Some(every) = config.crash_every {
            armed_env.push((env::CRASH_EVERY.into(), s(&every)));
        }
        armed_env.push((env::CRASH_PROBABILITY.into(), s(&config.crash_probability)));
    }
    let (program, args, probe) =
        if name == ServiceName::Relay && config.relay_kind == RelayKind::Debezium {
            // Debezium's worker in the foreground, its REST port and its
            // connector's name chaos's, so the probe asks what it registers.
            env.push(("DEBEZIUM_PORT".into(), s(&config.debezium_rest.port())));
            env.push(("DEBEZIUM_CONNECTOR".into(), DEBEZIUM_CONNECTOR.into()));
            (
                config.debezium_script.clone(),
                vec!["run".into()],
                Probe::Connector(format!(
                    "http://{}/connectors/{DEBEZIUM_CONNECTOR}/status",
                    config.debezium_rest
                )),
            )
        } else {
            (bin_dir.join(name.as_str()), Vec::new(), Probe::Metrics)
        };
    Spec {
        name,
        program,
        args,
        env,
        armed_env,
        crash_point,
        crash_marker: out.join(format!("{label}.crash-point")),
        metrics_url: config.metrics_url(instance),
        probe,
        log: out.join(format!("{label}.log")),
        label,
        ready_timeout: Duration::from_secs(config.ready_timeout),
    }
}

/// loadgen's command line: the load of `config`, its outputs in `out`.
pub fn loadgen_args(config: &Config, out: &Path) -> Vec<String> {
    let urls = |pick: fn(&(std::net::SocketAddr, std::net::SocketAddr)) -> std::net::SocketAddr| {
        config
            .orders_addrs()
            .iter()
            .map(|a| format!("http://{}", pick(a)))
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut args: Vec<String> = vec![
        "--http-url".into(),
        urls(|a| a.0),
        "--grpc-url".into(),
        urls(|a| a.1),
        "--rate".into(),
        config.rate.to_string(),
        "--duration".into(),
        // With --max-duration chaos ends the schedule (SIGUSR1) once its
        // faults are done and --duration has passed.
        config.max_duration.unwrap_or(config.duration).to_string(),
        "--retry-rate".into(),
        config.retry_rate.to_string(),
        "--protocol".into(),
        config.protocol.clone(),
        "--zipf-s".into(),
        config.zipf_s.to_string(),
        "--json".into(),
        path_arg(&out.join("loadgen.json")),
        "--csv".into(),
        path_arg(&out.join("loadgen.csv")),
        "--intents".into(),
        path_arg(&out.join("intents.txt")),
    ];
    if let Some(seed) = config.seed {
        args.push("--seed".into());
        args.push(seed.to_string());
    }
    args.extend(config.loadgen_args.iter().cloned());
    args
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The only instance of `service`.
    fn alone(service: ServiceName) -> Instance {
        Instance {
            service,
            index: 0,
            of: 1,
        }
    }

    fn get(spec: &Spec, key: &str) -> Option<String> {
        spec.env
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    #[test]
    fn each_instance_has_its_own_ports_files_and_group_member_id() {
        use clap::Parser;
        let config =
            Config::try_parse_from(["chaos", "--orders", "2", "--relays", "3", "--payments", "2"])
                .expect("parses");
        config.validate().expect("valid");
        let dir = Path::new("/out");
        let specs: Vec<Spec> = config
            .instances()
            .into_iter()
            .map(|i| service(&config, dir, dir, i))
            .collect();
        let labels: Vec<&str> = specs.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "orders-1",
                "orders-2",
                "relay-1",
                "relay-2",
                "relay-3",
                "payments-1",
                "payments-2"
            ]
        );
        assert_eq!(
            get(&specs[1], env::ORDERS_HTTP_ADDR).as_deref(),
            Some("127.0.0.1:18580")
        );
        assert_eq!(
            get(&specs[1], env::ORDERS_GRPC_ADDR).as_deref(),
            Some("127.0.0.1:18551")
        );
        assert_eq!(
            get(&specs[1], env::ORDERS_METRICS_ADDR).as_deref(),
            Some("127.0.0.1:18500")
        );
        assert_eq!(specs[1].metrics_url, "http://127.0.0.1:18500/metrics");
        assert_eq!(
            get(&specs[4], env::RELAY_METRICS_ADDR).as_deref(),
            Some("127.0.0.1:18601")
        );
        assert_eq!(specs[6].metrics_url, "http://127.0.0.1:18502/metrics");
        assert_eq!(specs[6].log, dir.join("payments-2.log"));
        assert_eq!(specs[6].crash_marker, dir.join("payments-2.crash-point"));
        let members: Vec<String> = specs[5..]
            .iter()
            .filter_map(|s| get(s, env::PAYMENTS_GROUP_INSTANCE_ID))
            .collect();
        assert_eq!(members.len(), 2);
        assert_ne!(members[0], members[1], "one static member id per instance");
        let mut urls: Vec<&String> = specs.iter().map(|s| &s.metrics_url).collect();
        urls.sort();
        urls.dedup();
        assert_eq!(urls.len(), specs.len(), "no two share a metrics address");

        let args = loadgen_args(&config, dir);
        let at = |flag: &str| &args[args.iter().position(|a| a == flag).expect(flag) + 1];
        assert_eq!(
            at("--http-url"),
            "http://127.0.0.1:18480,http://127.0.0.1:18580"
        );
        assert_eq!(
            at("--grpc-url"),
            "http://127.0.0.1:18451,http://127.0.0.1:18551"
        );
    }

    #[test]
    fn one_instance_keeps_the_plain_names_and_addresses() {
        use clap::Parser;
        let config = Config::try_parse_from(["chaos"]).expect("parses");
        let dir = Path::new("/out");
        let orders = service(&config, dir, dir, alone(ServiceName::Orders));
        assert_eq!(orders.label, "orders");
        assert_eq!(orders.log, dir.join("orders.log"));
        assert_eq!(
            get(&orders, env::ORDERS_HTTP_ADDR).as_deref(),
            Some("127.0.0.1:18480")
        );
        let args = loadgen_args(&config, dir);
        assert!(
            args.contains(&"http://127.0.0.1:18480".to_owned()),
            "{args:?}"
        );
    }

    #[test]
    fn crash_env_goes_to_the_owning_service_only() {
        use clap::Parser;
        let config = Config::try_parse_from([
            "chaos",
            "--crash-point",
            "publish",
            "--crash-every",
            "7",
            "--dup-rate",
            "0.3",
        ])
        .expect("parses");
        let dir = Path::new("/bin");
        let relay = service(&config, dir, dir, alone(ServiceName::Relay));
        assert!(
            relay
                .armed_env
                .contains(&(env::CRASH_POINT.into(), "publish".into()))
        );
        assert!(
            relay
                .armed_env
                .contains(&(env::CRASH_EVERY.into(), "7".into()))
        );
        let payments = service(&config, dir, dir, alone(ServiceName::Payments));
        assert!(!payments.armed_env.iter().any(|(k, _)| k == "CRASH_POINT"));
        assert!(
            payments
                .armed_env
                .contains(&(env::PAYMENTS_DUP_RATE.into(), "0.3".into()))
        );
        let orders = service(&config, dir, dir, alone(ServiceName::Orders));
        assert!(orders.armed_env.is_empty());
    }

    #[test]
    fn over_http_relay_and_payments_share_one_secret_and_the_address() {
        use clap::Parser;
        let mut config = Config::try_parse_from(["chaos", "--transport", "http"]).expect("parses");
        let secret = effectively::webhook::Secret::generate();
        config.webhook_secret = Some(secret.clone());
        let dir = Path::new("/bin");
        let relay = service(&config, dir, dir, alone(ServiceName::Relay));
        let payments = service(&config, dir, dir, alone(ServiceName::Payments));
        assert_eq!(get(&relay, env::RELAY_SINK).as_deref(), Some("http"));
        assert_eq!(
            get(&relay, env::RELAY_WEBHOOK_DESTINATIONS),
            Some(format!(
                "payments=http://127.0.0.1:18404/webhooks/orders,secret={},timeout=10000ms,max-attempts=8,allow-http",
                secret.to_whsec()
            ))
        );
        assert_eq!(
            get(&relay, env::RELAY_WEBHOOK_ALLOW_ADDRESSES).as_deref(),
            Some("127.0.0.1")
        );
        assert_eq!(
            get(&payments, env::PAYMENTS_SOURCE).as_deref(),
            Some("http")
        );
        assert_eq!(
            get(&payments, env::PAYMENTS_WEBHOOK_SECRET),
            Some(secret.to_whsec())
        );
        assert_eq!(
            get(&payments, env::PAYMENTS_WEBHOOK_ADDR).as_deref(),
            Some("127.0.0.1:18403")
        );
    }

    #[test]
    fn debezium_runs_its_script_in_place_of_the_relay_ready_by_its_connector() {
        use clap::Parser;
        let config = Config::try_parse_from([
            "chaos",
            "--relay-kind",
            "debezium",
            "--debezium-script",
            "/repo/scripts/debezium.sh",
            "--debezium-rest",
            "127.0.0.1:28090",
        ])
        .expect("parses");
        let dir = Path::new("/bin");
        let relay = service(&config, dir, dir, alone(ServiceName::Relay));
        assert_eq!(relay.program, Path::new("/repo/scripts/debezium.sh"));
        assert_eq!(relay.args, vec![std::ffi::OsString::from("run")]);
        assert_eq!(get(&relay, "DEBEZIUM_PORT").as_deref(), Some("28090"));
        assert_eq!(
            get(&relay, "DEBEZIUM_CONNECTOR").as_deref(),
            Some("effectively-outbox")
        );
        assert_eq!(
            relay.probe,
            Probe::Connector("http://127.0.0.1:28090/connectors/effectively-outbox/status".into())
        );
        // The others stay the project's binaries, ready by their metrics.
        let payments = service(&config, dir, dir, alone(ServiceName::Payments));
        assert_eq!(payments.program, Path::new("/bin/payments"));
        assert_eq!(payments.probe, Probe::Metrics);
    }
}
