//! Baseline for the relay benchmark: a raw rdkafka producer with the relay's
//! settings (idempotent, acks=all, lz4, same linger) sending N messages,
//! keyed like the relay, with no database and no batch barrier: up to
//! `in_flight` messages (10,000) are awaited at any time, each replaced as
//! soon as its ack arrives, so this is the broker's speed for the client.
//! Prints msgs/s.
//!
//! Each message is the relay's: an `order.created` envelope for a fresh
//! order, with its two headers. `RAW_PAYLOAD=filler` sends `<bytes>` bytes of
//! one repeated letter instead (what this baseline sent before FINDINGS §15:
//! lz4 shrinks it to almost nothing on the wire); `RAW_HEADERS=0` drops the
//! headers. Create the topic first with the relay topic's partition count:
//! the producer does not create it (a broker's default count differs).
//!
//! `RAW_RATE=N` paces the sends at N messages a second instead of as fast
//! as the acks allow (the relay's steady state, not its drain), and
//! `RAW_SET="key=value,..."` adds librdkafka settings over the relay's. The
//! output then says what the producer cost: its process's CPU seconds, and
//! CPU-µs per message.
//!
//! cargo run --release -p relay --example raw_producer -- <topic> <count> <bytes> [in_flight]

use std::time::{Duration, Instant};

use futures::StreamExt;
use pipeline::contract::ORDER_CREATED;
use pipeline::envelope::{Envelope, HEADER_EVENT_TYPE, HEADER_MSG_ID};
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
    let filler = match std::env::var("RAW_PAYLOAD").as_deref() {
        Err(_) | Ok("envelope") => false,
        Ok("filler") => true,
        Ok(other) => anyhow::bail!("RAW_PAYLOAD={other}: expected envelope or filler"),
    };
    let bootstrap =
        std::env::var("KAFKA_BOOTSTRAP_SERVERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let rate: Option<f64> = match std::env::var("RAW_RATE") {
        Ok(v) => Some(
            v.parse()
                .map_err(|e| anyhow::anyhow!("RAW_RATE={v}: {e}"))?,
        ),
        Err(_) => None,
    };
    // KAFKA_CLIENT_CONFIG: TLS and SASL, as the relay takes them.
    let client_file = std::env::var_os("KAFKA_CLIENT_CONFIG").map(std::path::PathBuf::from);
    let mut config = pipeline::kafka::client_config(&bootstrap, client_file.as_deref())?;
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "10") // the relay's default --linger-ms
        .set("queue.buffering.max.messages", "1000000")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4")
        .set("allow.auto.create.topics", "false");
    let extra = std::env::var("RAW_SET").unwrap_or_default();
    for set in extra.split(',').filter(|s| !s.is_empty()) {
        let (key, value) = set
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("RAW_SET: '{set}' is not key=value"))?;
        config.set(key, value);
    }
    let producer: FutureProducer = config.create()?;
    let filler_value = vec![b'x'; size];
    // The bytes of a message's value (an envelope's, of the first order).
    let size = if filler {
        size
    } else {
        order_created(uuid::Uuid::now_v7(), uuid::Uuid::new_v4(), 0)?.len()
    };
    let cpu_before = cpu_seconds();
    let start = Instant::now();
    let t0 = tokio::time::Instant::now();
    let results: Vec<bool> = futures::stream::iter(0..count)
        .map(|i| {
            let order = uuid::Uuid::new_v4();
            let key = order.to_string();
            let producer = &producer;
            let filler_value = &filler_value;
            let topic = &topic;
            async move {
                if let Some(rate) = rate {
                    tokio::time::sleep_until(t0 + Duration::from_secs_f64(i as f64 / rate)).await;
                }
                let msg_id = uuid::Uuid::now_v7();
                let value = if filler {
                    filler_value.clone()
                } else {
                    order_created(msg_id, order, i)?
                };
                let msg_id = msg_id.to_string();
                let record = FutureRecord::to(topic).key(&key).payload(&value);
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
                anyhow::Ok(producer.send(record, Duration::from_secs(10)).await.is_ok())
            }
        })
        .buffer_unordered(in_flight.max(1))
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<anyhow::Result<_>>()?;
    let failed = results.iter().filter(|ok| !**ok).count();
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_before;
    let payload = if filler { "filler" } else { "envelope" };
    let rate = rate.map_or("null".to_string(), |r| r.to_string());
    println!(
        "{{\"messages\": {count}, \"payload\": \"{payload}\", \"bytes\": {size}, \"in_flight\": {in_flight}, \"rate\": {rate}, \"set\": {extra:?}, \"seconds\": {secs:.3}, \"msgs_per_sec\": {:.0}, \"failed\": {failed}, \"cpu_seconds\": {cpu:.2}, \"cpu_us_per_msg\": {:.1}}}",
        count as f64 / secs,
        cpu * 1e6 / count as f64
    );
    Ok(())
}

/// The relay's message for a new order, as it sends the outbox row that
/// `scripts/lib/pipeline.sh`'s `pipeline_outbox_rows_sql` writes.
fn order_created(msg_id: uuid::Uuid, order: uuid::Uuid, i: usize) -> anyhow::Result<Vec<u8>> {
    let n = i % 100_000 + 1;
    let payload = serde_json::json!({
        "order_id": order, "account_id": n, "amount_cents": n, "status": "created",
    });
    let envelope = Envelope::new(
        msg_id,
        ORDER_CREATED.to_string(),
        order,
        chrono::Utc::now(),
        payload.to_string().as_bytes(),
    )?;
    Ok(envelope.encode()?)
}

/// This process's CPU time (user + system, every thread), from
/// `/proc/self/stat`, in seconds; 0 where there is no such file.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // The fields after the command name, which is in parentheses and may
    // hold spaces: utime and stime are the 12th and 13th of them.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let ticks: f64 = after
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|t| t.parse::<f64>().ok())
        .sum();
    ticks / 100.0 // USER_HZ, 100 on Linux
}
