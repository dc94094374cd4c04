use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use effectively::config::DbArgs;
use sqlx::postgres::PgPoolOptions;

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

    /// Print the report as JSON.
    #[arg(long)]
    json: bool,

    /// Print the exact SQL of the diff (run it with psql to check by hand).
    #[arg(long)]
    show_sql: bool,
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
            "-- the diff\n{};\n\n-- drained?\n{};\n",
            recon::RECON_SQL,
            recon::DRAINED_SQL
        );
    }
    // Read-only: never migrate, never write.
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET default_transaction_read_only = on")
                    .execute(conn)
                    .await?;
                Ok(())
            })
        })
        .connect(&args.db.database_url)
        .await
        .context("connect to postgres")?;
    let mut drained = None;
    if let Some(secs) = args.wait_drained {
        drained = Some(recon::wait_drained(&pool, Duration::from_secs_f64(secs.max(0.0))).await?);
        if drained == Some(false) {
            eprintln!("recon: pipeline not drained after {secs} s; reporting the current state");
        }
    }
    let report = recon::reconcile(&pool).await.context("run the diff")?;
    if args.json {
        let value = serde_json::json!({
            "report": report,
            "deltas": report.deltas(),
            "drained": drained,
            "clean": report.is_clean(),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", report.table());
    }
    Ok(report.is_clean())
}
