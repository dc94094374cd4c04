//! `model`: the protocol's model check at the full bounds, and the shortest
//! counter-example of each broken variant (`make model`).

use clap::Parser;
use model::{
    Bug, Config, PROPERTIES, Pipeline, check, check_acyclic, find, narrate_path, numbered,
};

/// Model-checks the pipeline's protocol (every interleaving of crashes,
/// retries and redeliveries at the bounds below), then finds the shortest
/// counter-example of each broken variant.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Clients, one idempotency key each.
    #[arg(long, default_value_t = Config::full().clients)]
    clients: u8,
    /// Retries per client.
    #[arg(long, default_value_t = Config::full().retries)]
    retries: u8,
    /// Relays racing for the shard's lease.
    #[arg(long, default_value_t = Config::full().relays)]
    relays: u8,
    /// Partitions of the topic.
    #[arg(long, default_value_t = Config::full().partitions)]
    partitions: u8,
    /// Crashes of each process (orders, relay, payments) per run.
    #[arg(long, default_value_t = Config::full().orders_crashes)]
    crashes: u8,
    /// Lease expiries per run.
    #[arg(long, default_value_t = Config::full().lease_expiries)]
    lease_expiries: u8,
    /// Redeliveries (seeks back) per run.
    #[arg(long, default_value_t = Config::full().redeliveries)]
    redeliveries: u8,
    /// No cancel (one event per key).
    #[arg(long)]
    no_cancel: bool,
    /// The test bounds (`cargo test -p model`) instead of the flags above.
    #[arg(long)]
    test_bounds: bool,
    /// Skip the acyclicity check (a second pass over every state).
    #[arg(long)]
    no_acyclic: bool,
    /// Skip the broken variants.
    #[arg(long)]
    no_bugs: bool,
}

impl Args {
    fn config(&self) -> Config {
        if self.test_bounds {
            return Config::test();
        }
        Config {
            clients: self.clients,
            cancel: !self.no_cancel,
            retries: self.retries,
            relays: self.relays,
            partitions: self.partitions,
            orders_crashes: self.crashes,
            relay_crashes: self.crashes,
            payments_crashes: self.crashes,
            lease_expiries: self.lease_expiries,
            redeliveries: self.redeliveries,
            ..Config::full()
        }
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let config = args.config();
    println!("bounds: {config:?}");
    let outcome = check(config.clone(), None, None);
    println!(
        "correct model: {} states generated, {} unique, max depth {}, {:.1} s",
        outcome.states,
        outcome.unique,
        outcome.max_depth,
        outcome.elapsed.as_secs_f64()
    );
    let mut ok = true;
    for name in PROPERTIES {
        let broken = outcome.discoveries.iter().find(|(n, _)| *n == name);
        match broken {
            None => println!("  holds: {name}"),
            Some((_, path)) => {
                ok = false;
                println!("  BROKEN: {name}");
                print!(
                    "{}",
                    numbered(&narrate_path(&Pipeline(config.clone()), path))
                );
            }
        }
    }
    if !args.no_acyclic {
        let start = std::time::Instant::now();
        match check_acyclic(config.clone()) {
            Ok(n) => println!(
                "acyclic: every path ends in a terminal state ({n} states, {:.1} s)",
                start.elapsed().as_secs_f64()
            ),
            Err(depth) => {
                ok = false;
                println!(
                    "CYCLE found at depth {depth}: the terminal-state liveness check does not cover every run"
                );
            }
        }
    }
    if !args.no_bugs {
        for bug in Bug::ALL {
            let (path, o) = find(bug, &config);
            match path {
                Some(path) => {
                    let lines = narrate_path(&Pipeline(bug.config(&config)), &path);
                    println!(
                        "\n{}: breaks \"{}\"; shortest counter-example, {} steps ({} states, {:.1} s):",
                        bug.name(),
                        bug.breaks(),
                        lines.len(),
                        o.unique,
                        o.elapsed.as_secs_f64()
                    );
                    print!("{}", numbered(&lines));
                }
                None => {
                    ok = false;
                    println!(
                        "\n{}: NO counter-example found ({} states)",
                        bug.name(),
                        o.unique
                    );
                }
            }
        }
    }
    if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
