//! `model`: the protocol's model check at the full bounds, the shortest
//! counter-example of each broken variant, and of per-key order on the log
//! in today's relay, which the `fenced-publish` variant keeps (`make model`).

use clap::Parser;
use model::{
    Bug, Config, Fence, LOG_IN_KEY_ORDER, NOT_CLAIMED, PROPERTIES, Pipeline, check, check_acyclic,
    find, find_broken, log_order_scope, narrate_path, numbered,
};

/// Model-checks the pipeline's protocol (every interleaving of crashes,
/// retries, redeliveries and expiries at the bounds), then finds the
/// shortest counter-example of each broken variant at the test bounds, and
/// the shortest stale publish that breaks per-key order on the log in
/// today's relay (which fences only its mark), checked again with the
/// publish fenced.
///
/// Without bound flags it checks the full bounds: two scopes, "two keys" and
/// "two relays". With any bound flag it checks one scope: the test bounds
/// with those flags changed.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Clients, one idempotency key each.
    #[arg(long)]
    clients: Option<u8>,
    /// Retries per client.
    #[arg(long)]
    retries: Option<u8>,
    /// Relays racing for the shard's lease.
    #[arg(long)]
    relays: Option<u8>,
    /// Partitions of the topic.
    #[arg(long)]
    partitions: Option<u8>,
    /// Crashes of each process (orders, relay, payments) per run.
    #[arg(long)]
    crashes: Option<u8>,
    /// Lease expiries per run.
    #[arg(long)]
    lease_expiries: Option<u8>,
    /// Redeliveries (seeks back) per run.
    #[arg(long)]
    redeliveries: Option<u8>,
    /// Whether the first client cancels its order (a second event of its key).
    #[arg(long)]
    cancel: Option<bool>,
    /// The test bounds (`cargo test -p model`) alone.
    #[arg(long)]
    test_bounds: bool,
    /// Skip the acyclicity check (a second pass over every state).
    #[arg(long)]
    no_acyclic: bool,
    /// Skip the broken variants and the log-order comparison.
    #[arg(long)]
    no_bugs: bool,
    /// What the lease fences in the scopes checked: today's relay
    /// (`mark-only`) or `fenced-publish` (a transactional producer per shard).
    #[arg(long, default_value = "mark-only", value_parser = parse_fence)]
    fence: Fence,
}

fn parse_fence(s: &str) -> Result<Fence, String> {
    [Fence::Mark, Fence::Publish]
        .into_iter()
        .find(|f| f.name() == s)
        .ok_or_else(|| format!("expected mark-only or fenced-publish, got {s:?}"))
}

impl Args {
    fn scopes(&self) -> Vec<(&'static str, Config)> {
        let t = Config {
            fence: self.fence,
            ..Config::test()
        };
        let custom = Config {
            clients: self.clients.unwrap_or(t.clients),
            retries: self.retries.unwrap_or(t.retries),
            relays: self.relays.unwrap_or(t.relays),
            partitions: self.partitions.unwrap_or(t.partitions),
            orders_crashes: self.crashes.unwrap_or(t.orders_crashes),
            relay_crashes: self.crashes.unwrap_or(t.relay_crashes),
            payments_crashes: self.crashes.unwrap_or(t.payments_crashes),
            lease_expiries: self.lease_expiries.unwrap_or(t.lease_expiries),
            redeliveries: self.redeliveries.unwrap_or(t.redeliveries),
            cancel: self.cancel.unwrap_or(t.cancel),
            ..t.clone()
        };
        if self.test_bounds {
            vec![("test bounds", t)]
        } else if custom != t {
            vec![("custom", custom)]
        } else {
            Config::full()
                .into_iter()
                .map(|(name, c)| {
                    (
                        name,
                        Config {
                            fence: self.fence,
                            ..c
                        },
                    )
                })
                .collect()
        }
    }
}

/// Checks one scope; false if a property broke or a cycle was found.
fn check_scope(name: &str, config: &Config, acyclic: bool) -> bool {
    println!("== {name}: {config:?}");
    let outcome = check(config.clone(), None, None);
    println!(
        "correct model: {} states generated, {} unique, max depth {}, {:.1} s",
        outcome.states,
        outcome.unique,
        outcome.max_depth,
        outcome.elapsed.as_secs_f64()
    );
    let mut ok = true;
    for property in PROPERTIES {
        match outcome.discoveries.iter().find(|(n, _)| *n == property) {
            None => println!("  holds: {property}"),
            Some((_, path)) => {
                ok = false;
                println!("  BROKEN: {property}");
                print!(
                    "{}",
                    numbered(&narrate_path(&Pipeline(config.clone()), path))
                );
            }
        }
    }
    // Not claimed of today's relay: reported, never a failure (its shortest
    // counter-example is printed after the broken variants).
    for property in NOT_CLAIMED {
        if outcome.breaks(property) {
            println!("  does not hold (not claimed): {property}");
        } else {
            println!("  holds at these bounds (not claimed): {property}");
        }
    }
    let unreached = outcome.unreached(config);
    for situation in model::REACHED {
        if unreached.contains(&situation) {
            ok = false;
            println!("  NOT REACHED (a fault the bounds never exercise): {situation}");
        } else if outcome.discoveries.iter().any(|(n, _)| *n == situation) {
            println!("  reached: {situation}");
        } else {
            println!("  not possible at these bounds: {situation}");
        }
    }
    if acyclic {
        let start = std::time::Instant::now();
        match check_acyclic(config.clone()) {
            Ok(n) => println!(
                "acyclic: every path ends in a terminal state ({n} states, {:.1} s)",
                start.elapsed().as_secs_f64()
            ),
            Err(depth) => {
                ok = false;
                println!(
                    "CYCLE at depth {depth}: the terminal-state liveness check does not cover every run"
                );
            }
        }
    }
    ok
}

/// Per-key order on the log: broken in today's relay (its shortest
/// counter-example printed), kept by `fenced-publish`; false if either is not
/// so.
fn log_order(base: &Config) -> bool {
    let today = log_order_scope(base);
    println!(
        "\n== per-key order on the log, at the test bounds with two relays ({} relays, cancel {})",
        today.relays, today.cancel
    );
    let mut ok = true;
    let (path, o) = find_broken(&today, LOG_IN_KEY_ORDER);
    match path {
        Some(path) => {
            let lines = narrate_path(&Pipeline(today.clone()), &path);
            println!(
                "\n{} (today's relay): breaks \"{LOG_IN_KEY_ORDER}\"; shortest counter-example, {} steps ({} states in the first search, {:.1} s in all):",
                Fence::Mark.name(),
                lines.len(),
                o.unique,
                o.elapsed.as_secs_f64()
            );
            print!("{}", numbered(&lines));
        }
        None => {
            ok = false;
            println!(
                "\n{} (today's relay): NO counter-example found ({} states): the model no longer matches the relay",
                Fence::Mark.name(),
                o.unique
            );
        }
    }
    let fenced = Config {
        fence: Fence::Publish,
        ..today
    };
    let o = check(fenced.clone(), None, None);
    let broken: Vec<_> = PROPERTIES
        .into_iter()
        .chain(NOT_CLAIMED)
        .filter(|p| o.breaks(p))
        .collect();
    if broken.is_empty() {
        println!(
            "\n{}: every property holds, \"{LOG_IN_KEY_ORDER}\" too ({} states, {:.1} s)",
            Fence::Publish.name(),
            o.unique,
            o.elapsed.as_secs_f64()
        );
    } else {
        ok = false;
        println!("\n{}: BROKEN: {broken:?}", Fence::Publish.name());
    }
    ok
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let start = std::time::Instant::now();
    let mut ok = true;
    for (name, config) in args.scopes() {
        ok &= check_scope(name, &config, !args.no_acyclic);
    }
    if !args.no_bugs {
        let base = Config::test();
        println!("\n== broken variants, each at the test bounds ({base:?}) with its one flag");
        for bug in Bug::ALL {
            let (path, o) = find(bug, &base);
            match path {
                Some(path) => {
                    let lines = narrate_path(&Pipeline(bug.config(&base)), &path);
                    println!(
                        "\n{}: breaks \"{}\"; shortest counter-example, {} steps ({} states in the first search, {:.1} s in all):",
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
        ok &= log_order(&base);
    }
    println!("\ntotal: {:.1} s", start.elapsed().as_secs_f64());
    if ok {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
