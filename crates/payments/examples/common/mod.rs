//! What the consumer benchmarks' examples share (raw_consumer,
//! minimal_consumer, receipts): a consumer as payments makes one for them.

use rdkafka::consumer::{Consumer, StreamConsumer};

/// A consumer of `topic` in a fresh group `<prefix>-<uuid>`, reading from the
/// beginning with manual commits: the cluster at `KAFKA_BOOTSTRAP_SERVERS`
/// (default 127.0.0.1:9092), TLS and SASL from `KAFKA_CLIENT_CONFIG` as
/// payments takes them, and payments' fetch wait (`PAYMENTS_FETCH_WAIT_MAX_MS`,
/// else its default), so each is timed on payments' terms.
pub(crate) fn fresh_consumer(topic: &str, prefix: &str) -> anyhow::Result<StreamConsumer> {
    let bootstrap =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let fetch_wait = std::env::var("PAYMENTS_FETCH_WAIT_MAX_MS")
        .unwrap_or_else(|_| payments::DEFAULT_FETCH_WAIT_MAX_MS.to_string());
    let client_file = std::env::var_os("KAFKA_CLIENT_CONFIG").map(std::path::PathBuf::from);
    let consumer: StreamConsumer =
        pipeline::kafka::client_config(&bootstrap, client_file.as_deref())?
            .set("fetch.wait.max.ms", &fetch_wait)
            .set(
                "group.id",
                format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            )
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()?;
    consumer.subscribe(&[topic])?;
    Ok(consumer)
}
