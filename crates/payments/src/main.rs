use anyhow::Context;
use clap::Parser;
use payments::Config;
use tokio::net::TcpListener;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    effectively::telemetry::init();
    let metrics = TcpListener::bind(config.metrics_addr)
        .await
        .with_context(|| format!("bind metrics {}", config.metrics_addr))?;
    match payments::run(config, metrics, effectively::shutdown::on_signal()).await {
        Err(error) if error.downcast_ref::<payments::HorizonRefusal>().is_some() => {
            eprintln!("payments: refusing to start: {error}");
            std::process::exit(2);
        }
        other => other,
    }
}
