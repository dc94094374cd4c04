use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use effectively::config::DbArgs;
use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::str::FromStr;

/// Recon: prove distinct effects == distinct intents with one SQL diff.
///
/// Read-only. Exit status 0 when clean (no missing, double or orphan effect,
/// amounts equal), 1 on drift, 2 on error.
#[derive(Debug, Parser)]
#[command(name = "recon", version)]
struct Args {
    #[command(flatten)]
    db: DbArgs,

    /// First wait (up to this many seconds) until no outbox row is pending and
    /// every event is in the inbox; report anyway when the time is up.
    #[arg(long, env = "RECON_WAIT_DRAINED", value_name = "SECONDS")]
    wait_drained: Option<f64>,

    /// Also check the client's ground truth: loadgen's `--intents` file
    /// (key<TAB>order_id of every key that got a success). Every such key must
    /// have exactly its order. Keys in `<FILE>.ambiguous` (timeouts) are
    /// reported separately: ambiguous by nature.
    #[arg(long, value_name = "FILE")]
    intents: Option<std::path::PathBuf>,

    /// Report failed outbox rows and dead letters without counting them as
    /// drift (for runs that feed bad input on purpose). Without it they are
    /// drift: each is an intent that did not reach its effect.
    #[arg(long, env = "RECON_ALLOW_DEAD_LETTERS")]
    allow_dead_letters: bool,

    /// Print the report as JSON.
    #[arg(long)]
    json: bool,

    /// Print the exact SQL of the diff (run it with psql to check by hand:
    /// `$1` and `$2` bound a range of ids; the nil and the max UUID cover
    /// all).
    #[arg(long)]
    show_sql: bool,

    /// Check the orders in this many id ranges side by side, one database
    /// connection each, all reading one snapshot (default: the number of
    /// CPUs). 1 runs the diff as one statement.
    #[arg(long, env = "RECON_JOBS", value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    jobs: Option<u16>,
}

#[tokio::main]
async fn main() -> ExitCode {
    effectively::telemetry::init();
    match run(Args::parse()).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(error) => {
            eprintln!("recon: error: {error:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    if args.show_sql {
        println!(
            "-- the diff of the ids $1 to $2 (the whole: $1 = '00000000-0000-0000-0000-000000000000', \
             $2 = 'ffffffff-ffff-ffff-ffff-ffffffffffff')\n{};\n\n-- dead letters\n{};\n\n-- drained?\n{};\n",
            recon::PART_SQL,
            recon::DEAD_LETTERS_SQL,
            recon::DRAINED_SQL
        );
    }
    // Read-only: never migrate, never write. The diff is one long statement
    // by design: sqlx's slow-statement warning would only repeat it.
    let options = PgConnectOptions::from_str(&args.db.database_url)
        .context("parse DATABASE_URL")?
        .disable_statement_logging();
    let jobs = args.jobs.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        usize::from,
    );
    let pool = PgPoolOptions::new()
        .max_connections(jobs.max(2) as u32)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET default_transaction_read_only = on")
                    .execute(conn)
                    .await?;
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .context("connect to postgres")?;
    let mut drained = None;
    if let Some(secs) = args.wait_drained {
        drained = Some(recon::wait_drained(&pool, Duration::from_secs_f64(secs.max(0.0))).await?);
        if drained == Some(false) {
            eprintln!("recon: pipeline not drained after {secs} s; reporting the current state");
        }
    }
    let policy = recon::Policy {
        allow_dead_letters: args.allow_dead_letters,
    };
    let started = std::time::Instant::now();
    let report = recon::reconcile_in_parts(&pool, jobs)
        .await
        .context("run the diff")?;
    let diff_seconds = started.elapsed().as_secs_f64();
    let intents = match &args.intents {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("read {}", path.display()))?;
            let mut ambiguous_path = path.clone().into_os_string();
            ambiguous_path.push(".ambiguous");
            let ambiguous = std::fs::read_to_string(&ambiguous_path).ok();
            let client = recon::ClientIntents::parse(&text, ambiguous.as_deref())
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            Some(
                recon::check_intents(&pool, &client)
                    .await
                    .context("check intents")?,
            )
        }
    };
    let clean = report.is_clean(policy) && intents.as_ref().is_none_or(|i| i.is_clean());
    if args.json {
        let value = serde_json::json!({
            "report": report,
            "deltas": report.deltas(policy),
            "drift": report.drift(policy),
            "diff_seconds": diff_seconds,
            "jobs": jobs,
            "drained": drained,
            "intents": intents,
            "clean": clean,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", report.table(policy));
        println!("(the diff took {diff_seconds:.2} s; --jobs {jobs})");
        if let Some(intents) = &intents {
            print!("{}", intents.table());
        }
    }
    Ok(clean)
}
