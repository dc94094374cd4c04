//! Baseline for the consumer benchmark: a raw rdkafka consumer reading N
//! messages of a topic from the beginning in a fresh group, doing nothing
//! with them (no decode, no database). Prints msgs/s.
//!
//! cargo run --release -p payments --example raw_consumer -- <topic> <count>

use std::time::{Duration, Instant};

mod common;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let topic = args.next().unwrap_or_else(|| "order.events".into());
    let count: usize = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(100_000);
    let consumer = common::fresh_consumer(&topic, "raw")?;
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
