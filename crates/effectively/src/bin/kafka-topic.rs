//! Creates a Kafka topic explicitly unless it exists (used by `make up`).

use clap::Parser;
use effectively::kafka::{TopicState, ensure_topic};

/// Create a Kafka topic unless it exists.
#[derive(Debug, Parser)]
#[command(name = "kafka-topic", version)]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(
        long,
        env = "KAFKA_BOOTSTRAP_SERVERS",
        default_value = "127.0.0.1:9092"
    )]
    bootstrap_servers: String,

    /// Topic name.
    #[arg(long, env = "KAFKA_TOPIC", default_value = "order.events")]
    topic: String,

    /// Partitions of a new topic.
    #[arg(long, env = "KAFKA_TOPIC_PARTITIONS", default_value_t = 6)]
    partitions: i32,

    /// Replicas of each partition (1 on the embedded single broker).
    #[arg(long, env = "KAFKA_TOPIC_REPLICATION", default_value_t = 1)]
    replication: i32,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match ensure_topic(
        &args.bootstrap_servers,
        &args.topic,
        args.partitions,
        args.replication,
    )
    .await?
    {
        TopicState::Created => eprintln!(
            "kafka-topic: created {} with {} partitions",
            args.topic, args.partitions
        ),
        TopicState::Existed => eprintln!("kafka-topic: {} exists", args.topic),
    }
    Ok(())
}
