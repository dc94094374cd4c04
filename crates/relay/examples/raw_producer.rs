//! Baseline for the relay benchmark: a raw rdkafka producer with the relay's
//! settings (idempotent, acks=all, lz4, same linger) sending N messages of a
//! given size, keyed like the relay, with no database. Prints msgs/s.
//!
//! cargo run --release -p relay --example raw_producer -- <topic> <count> <bytes>

use std::time::{Duration, Instant};

use futures::StreamExt;
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let topic = args.next().unwrap_or_else(|| "bench.raw".into());
    let count: usize = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(100_000);
    let size: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(300);
    let bootstrap =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4")
        .create()?;
    let value = vec![b'x'; size];
    let start = Instant::now();
    // Same shape as the relay: up to 500 in flight per batch awaited together.
    let mut failed = 0usize;
    for chunk in (0..count).collect::<Vec<_>>().chunks(500) {
        let results: Vec<_> = futures::stream::iter(chunk.iter().map(|i| {
            let key = uuid::Uuid::from_u128(*i as u128).to_string();
            let producer = &producer;
            let value = &value;
            let topic = &topic;
            async move {
                producer
                    .send(
                        FutureRecord::to(topic).key(&key).payload(value),
                        Duration::from_secs(10),
                    )
                    .await
                    .is_ok()
            }
        }))
        .buffer_unordered(500)
        .collect()
        .await;
        failed += results.iter().filter(|ok| !**ok).count();
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"messages\": {count}, \"bytes\": {size}, \"seconds\": {secs:.3}, \"msgs_per_sec\": {:.0}, \"failed\": {failed}}}",
        count as f64 / secs
    );
    Ok(())
}
