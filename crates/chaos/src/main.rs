use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let config = chaos::Config::parse();
    pipeline::telemetry::init();
    match chaos::run(config, pipeline::shutdown::on_signal()).await {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            eprintln!("chaos: error: {error:#}");
            ExitCode::from(chaos::EXIT_ERROR)
        }
    }
}
