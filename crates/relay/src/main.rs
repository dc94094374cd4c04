use anyhow::Context;
use clap::Parser;
use relay::Config;
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
    if let Some(relay::Command::Webhooks(admin)) = &config.command {
        if let Some(text) = admin.offline() {
            print!("{text}");
            return Ok(());
        }
        let specs = relay::webhooks::Specs::from_args(&config.webhook_secrets)?;
        let pool = pipeline::db::connect(&config.db, relay::session_limits(&config)).await?;
        let result = admin.run(&pool, &specs).await;
        pool.close().await;
        return result.map(|text| print!("{text}"));
    }
    let metrics = TcpListener::bind(config.metrics_addr)
        .await
        .with_context(|| format!("bind metrics {}", config.metrics_addr))?;
    match relay::run(config, metrics, pipeline::shutdown::on_signal()).await {
        // The topic cannot keep what acks=all acknowledges: as payments'
        // refusals, status 2.
        Err(error)
            if error
                .downcast_ref::<pipeline::kafka::TopicRefusal>()
                .is_some() =>
        {
            eprintln!("relay: refusing to run: {error}");
            std::process::exit(2);
        }
        other => other,
    }
}
