use anyhow::Context;
use clap::Parser;
use payments::Config;
use tokio::net::TcpListener;

fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    let runtime = config
        .runtime
        .runtime()
        .context("start the async runtime")?;
    runtime.block_on(serve(config))
}

async fn serve(config: Config) -> anyhow::Result<()> {
    pipeline::telemetry::init();
    let metrics = TcpListener::bind(config.metrics_addr)
        .await
        .with_context(|| format!("bind metrics {}", config.metrics_addr))?;
    match payments::run(config, metrics, pipeline::shutdown::on_signal()).await {
        Err(error)
            if error.downcast_ref::<payments::HorizonRefusal>().is_some()
                || error
                    .downcast_ref::<pipeline::kafka::TopicRefusal>()
                    .is_some() =>
        {
            eprintln!("payments: refusing to start: {error}");
            std::process::exit(2);
        }
        other => other,
    }
}
