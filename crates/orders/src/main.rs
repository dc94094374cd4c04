use anyhow::Context;
use clap::Parser;
use orders::config::Config;
use tokio::net::TcpListener;

/// mimalloc, not glibc's malloc: every request allocates its headers, body,
/// response and futures, and glibc spent about a quarter of the service's CPU
/// on them at 20,000 req/s (FINDINGS §14).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    if std::env::args_os().nth(1).is_some_and(|a| a == "new-token") {
        return new_token(orders::config::NewToken::parse_from(
            std::env::args_os().skip(1),
        ));
    }
    let config = Config::parse();
    let runtime = config
        .runtime
        .runtime()
        .context("start the async runtime")?;
    runtime.block_on(serve(config))
}

async fn serve(config: Config) -> anyhow::Result<()> {
    pipeline::telemetry::init();
    if config.migrate_only {
        // Whatever DB_MIGRATE says: migrating is the whole point here.
        let mut db = config.db.clone();
        db.db_migrate = true;
        pipeline::db::connect(&db, orders::config::SESSION_LIMITS).await?;
        tracing::info!("migrations applied");
        return Ok(());
    }
    let http = TcpListener::bind(config.http_addr)
        .await
        .with_context(|| format!("bind http {}", config.http_addr))?;
    let grpc = TcpListener::bind(config.grpc_addr)
        .await
        .with_context(|| format!("bind grpc {}", config.grpc_addr))?;
    let metrics = TcpListener::bind(config.metrics_addr)
        .await
        .with_context(|| format!("bind metrics {}", config.metrics_addr))?;
    tracing::info!(
        http = %config.http_addr,
        grpc = %config.grpc_addr,
        metrics = %config.metrics_addr,
        "orders listening"
    );
    let listeners = orders::Listeners {
        http,
        grpc,
        metrics,
    };
    orders::run(config, listeners, pipeline::shutdown::on_signal()).await
}

/// `orders new-token CALLER [--append-to FILE]`.
fn new_token(args: orders::config::NewToken) -> anyhow::Result<()> {
    use std::io::Write as _;
    let (token, line) = orders::auth::new_token(&args.caller).map_err(anyhow::Error::msg)?;
    match &args.append_to {
        Some(path) => {
            let mut options = std::fs::OpenOptions::new();
            options.create(true).append(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            let mut file = options
                .open(path)
                .with_context(|| format!("open {}", path.display()))?;
            writeln!(file, "{line}").with_context(|| format!("append to {}", path.display()))?;
        }
        None => eprintln!("{line}"),
    }
    println!("{token}");
    Ok(())
}
