use std::process::ExitCode;

use clap::Parser;
use recon::cli::{self, Config};

#[tokio::main]
async fn main() -> ExitCode {
    let config = Config::parse();
    pipeline::telemetry::init();
    match cli::run(config).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(cli::EXIT_DRIFT),
        Err(error) => {
            eprintln!("recon: error: {error:#}");
            ExitCode::from(cli::EXIT_ERROR)
        }
    }
}
