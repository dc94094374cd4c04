//! Baseline for the relay benchmark: a raw rdkafka producer with the relay's
//! settings (idempotent, acks=all, lz4, same linger) sending N messages of a
//! given size, keyed like the relay, with no database and no batch barrier:
//! up to `in_flight` messages (10,000) are awaited at any time, each
//! replaced as soon as its ack arrives, so this is the broker's speed for
//! the client. Prints msgs/s.
//!
//! cargo run --release -p relay --example raw_producer -- <topic> <count> <bytes> [in_flight]

use std::time::{Duration, Instant};

use effectively::contract::ORDER_CREATED;
use effectively::envelope::{HEADER_EVENT_TYPE, HEADER_MSG_ID};
use futures::StreamExt;
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
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
    let in_flight: usize = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(10_000);
    // The relay's two headers on every message, as it sends them (RAW_HEADERS=0: none).
    let headers = std::env::var("RAW_HEADERS").map_or(true, |v| v != "0");
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
    let results: Vec<bool> = futures::stream::iter(0..count)
        .map(|i| {
            let key = uuid::Uuid::from_u128(i as u128).to_string();
            let producer = &producer;
            let value = &value;
            let topic = &topic;
            async move {
                let msg_id = uuid::Uuid::now_v7().to_string();
                let record = FutureRecord::to(topic).key(&key).payload(value);
                let record = if headers {
                    record.headers(
                        OwnedHeaders::new()
                            .insert(Header {
                                key: HEADER_MSG_ID,
                                value: Some(msg_id.as_bytes()),
                            })
                            .insert(Header {
                                key: HEADER_EVENT_TYPE,
                                value: Some(ORDER_CREATED.as_bytes()),
                            }),
                    )
                } else {
                    record
                };
                producer.send(record, Duration::from_secs(10)).await.is_ok()
            }
        })
        .buffer_unordered(in_flight.max(1))
        .collect()
        .await;
    let failed = results.iter().filter(|ok| !**ok).count();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"messages\": {count}, \"bytes\": {size}, \"in_flight\": {in_flight}, \"seconds\": {secs:.3}, \"msgs_per_sec\": {:.0}, \"failed\": {failed}}}",
        count as f64 / secs
    );
    Ok(())
}
