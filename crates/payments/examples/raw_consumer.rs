//! Baseline for the consumer benchmark: a raw rdkafka consumer reading N
//! messages of a topic from the beginning in a fresh group, doing nothing
//! with them (no decode, no database). Prints msgs/s.
//!
//! cargo run --release -p payments --example raw_consumer -- <topic> <count>

use std::time::{Duration, Instant};

use rdkafka::consumer::{Consumer, StreamConsumer};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let topic = args.next().unwrap_or_else(|| "order.events".into());
    let count: usize = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(100_000);
    let bootstrap =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    // The same fetch wait as payments (its --fetch-wait-max-ms), so the two
    // are timed on equal terms.
    let fetch_wait = std::env::var("PAYMENTS_FETCH_WAIT_MAX_MS")
        .unwrap_or_else(|_| payments::DEFAULT_FETCH_WAIT_MAX_MS.to_string());
    // KAFKA_CLIENT_CONFIG: TLS and SASL, as payments takes them.
    let client_file = std::env::var_os("KAFKA_CLIENT_CONFIG").map(std::path::PathBuf::from);
    let consumer: StreamConsumer =
        pipeline::kafka::client_config(&bootstrap, client_file.as_deref())?
            .set("fetch.wait.max.ms", &fetch_wait)
            .set("group.id", format!("raw-{}", uuid::Uuid::new_v4().simple()))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()?;
    consumer.subscribe(&[&topic])?;
    // The clock starts at the first message: group assignment is not throughput.
    let first = consumer.recv().await?;
    drop(first);
    let start = Instant::now();
    let mut n = 1usize;
    while n < count {
        match tokio::time::timeout(Duration::from_secs(30), consumer.recv()).await {
            Ok(Ok(_)) => n += 1,
            Ok(Err(e)) => anyhow::bail!("consume: {e}"),
            Err(_) => break,
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"messages\": {n}, \"seconds\": {secs:.3}, \"msgs_per_sec\": {:.0}}}",
        n as f64 / secs
    );
    Ok(())
}
