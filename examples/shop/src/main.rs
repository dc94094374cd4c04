//! `shop`: a small service that is not this project's pipeline, written
//! only against the `effectively` library's public API, to show what
//! adopting it takes. Four commands:
//!
//! - `shop migrate`: its own tables (sqlx's migrations) and the library's
//!   schemas (`shop_fx` for the outbox and the keys, `billing_fx` for the
//!   inbox), each with its own ledger;
//! - `shop serve`: `POST /carts/{cart}/checkout`, idempotency-keyed; the
//!   checkout and its `checkout.completed` event commit together;
//! - `shop relay`: the library's relay, `shop_fx`'s outbox to Kafka;
//! - `shop billing`: the library's consumer loop; an invoice per event, once.

mod billing;
mod checkout;

use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use effectively::kafka_config;
use effectively::store::{Effectively, KafkaSink, Relay, consume};
use rdkafka::consumer::{Consumer, StreamConsumer};
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(about = "A shop on the effectively library: checkouts, their events, billing")]
struct Cli {
    /// PostgreSQL.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// Kafka's bootstrap servers.
    #[arg(
        long,
        env = "KAFKA_BOOTSTRAP_SERVERS",
        default_value = "127.0.0.1:9092"
    )]
    kafka: String,
    /// A file of librdkafka properties for the Kafka clients (`key=value`
    /// lines): TLS and SASL, e.g. `security.protocol=sasl_ssl`,
    /// `sasl.mechanism=SCRAM-SHA-512`, `sasl.username`, `sasl.password`,
    /// `ssl.ca.location`. Refused when other users may read it.
    #[arg(long, env = "KAFKA_CLIENT_CONFIG", value_name = "FILE")]
    kafka_client_config: Option<std::path::PathBuf>,
    /// The topic of the checkouts' events (created beforehand).
    #[arg(long, env = "SHOP_TOPIC", default_value = "shop.checkouts")]
    topic: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Installs or upgrades the shop's tables and the library's schemas.
    Migrate,
    /// Serves the checkout route.
    Serve {
        /// Where to listen.
        #[arg(long, env = "SHOP_ADDR", default_value = "127.0.0.1:8088")]
        addr: std::net::SocketAddr,
    },
    /// Relays the outbox to Kafka.
    Relay,
    /// Invoices each checkout event once.
    Billing {
        /// The consumer group.
        #[arg(long, env = "BILLING_GROUP", default_value = "billing")]
        group: String,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let cli = Cli::parse();
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&cli.database_url)
        .await
        .context("connect to PostgreSQL")?;
    let shop_fx = Effectively::postgres(pool.clone()).schema("shop_fx")?;
    let billing_fx = Effectively::postgres(pool.clone()).schema("billing_fx")?;
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    let kafka = kafka_config::client_config(&cli.kafka, cli.kafka_client_config.as_deref())?;
    match cli.command {
        Command::Migrate => {
            sqlx::migrate!("./migrations").run(&pool).await?;
            shop_fx.migrate().await?;
            billing_fx.migrate().await?;
        }
        Command::Serve { addr } => {
            let app = axum::Router::new()
                .route(
                    "/carts/{cart}/checkout",
                    axum::routing::post(checkout::checkout),
                )
                .with_state(checkout::Shop {
                    fx: shop_fx,
                    topic: cli.topic,
                });
            let listener = tokio::net::TcpListener::bind(addr).await?;
            axum::serve(listener, app)
                .with_graceful_shutdown(cancel.cancelled_owned())
                .await?;
        }
        Command::Relay => {
            let relay = Relay::new(&shop_fx, KafkaSink::new(&kafka)?)
                .poll_every(Duration::from_millis(500));
            relay.run(cancel).await;
        }
        Command::Billing { group } => {
            let consumer: StreamConsumer = kafka
                .clone()
                .set("group.id", group)
                .set("enable.auto.commit", "false")
                .set("auto.offset.reset", "earliest")
                // A consumer killed without leaving keeps its partitions
                // until its session times out (45 s by default): 6 s, the
                // brokers' least, hands them over sooner.
                .set("session.timeout.ms", "6000")
                .set("heartbeat.interval.ms", "1000")
                .create()?;
            consumer.subscribe(&[&cli.topic])?;
            // Partitioned by the events' mint time: its upkeep makes the
            // partitions ahead and drops the expired ones, beside the loop.
            let inbox = billing_fx.partitioned_inbox("billing");
            let upkeep = {
                let (inbox, pool, cancel) = (inbox.clone(), pool.clone(), cancel.clone());
                tokio::spawn(async move { inbox.maintain(&pool, &cancel).await })
            };
            inbox.maintain_once(&pool).await?;
            consume(&billing_fx, &inbox, &consumer, billing::handler(), &cancel).await?;
            cancel.cancel();
            upkeep.await?;
        }
    }
    Ok(())
}
