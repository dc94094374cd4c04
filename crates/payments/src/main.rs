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
    payments::run(config, metrics, effectively::shutdown::on_signal()).await
}
