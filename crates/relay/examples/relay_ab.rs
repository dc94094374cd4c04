//! The relay binary's engine beside the library's, on the same backlog:
//! `make bench-relay-ab` (or `cargo run --release -p relay --example
//! relay_ab -- [ROWS] [KEYS ...]`), on the stack of `make up`.
//!
//! For each KEYS (default: 20000 1000 10), ROWS events (default 20,000)
//! spread round-robin over that many keys (an order's id each) are
//! committed before a relay starts, each event an `order.created`
//! payload as orders writes it, then drained into a fresh 6-partition
//! topic and timed from the relay's start to its own count of every row
//! published:
//!
//! - `binary`: the relay binary (`relay::run`, its defaults: batches of
//!   1,000, 2 shard groups; `BENCH_AB_BINARY_BATCH` sets its batch) over
//!   `orders.outbox`, counted by its `relay_published_total`;
//! - `library`: the library's `Relay` (its defaults: batches of 2,000, 2
//!   shard groups) over the library's outbox (schema `fx`) through a
//!   `KafkaSink` on the binary's producer settings, counted by its stats.
//!
//! Each database is fresh. The binary sends each payload inside its JSON
//! envelope, the library as it is. Each KEYS is run twice, the two relays
//! alternating; every run is a JSON line, then each relay's median and the
//! ratio library/binary.

use std::time::{Duration, Instant};

use effectively::store::{Effectively, Event, KafkaSink, Relay};
use pipeline::config::DbArgs;
use pipeline::crash::CrashArgs;
use pipeline::db::ServiceRole;
use pipeline::outbox::{Outbox, OutboxMessage};
use pipeline::testing::{Service, TestDb, TestTopic};
use relay::{Config, Mode, Sink};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How long one drain may take.
const DRAIN_LIMIT: Duration = Duration::from_secs(600);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rows: usize = args.first().map_or(Ok(20_000), |a| a.parse())?;
    let key_counts: Vec<usize> = if args.len() > 1 {
        args[1..]
            .iter()
            .map(|a| a.parse())
            .collect::<Result<_, _>>()?
    } else {
        vec![20_000, 1000, 10]
    };
    let mut rates: Vec<(&str, usize, f64)> = Vec::new();
    for round in 0..2 {
        for &keys in &key_counts {
            for relay in ["binary", "library"] {
                let rate = match relay {
                    "binary" => binary(rows, keys).await?,
                    _ => library(rows, keys).await?,
                };
                println!(
                    "{{\"round\": {round}, \"relay\": \"{relay}\", \"rows\": {rows}, \"keys\": {keys}, \"rows_per_s\": {rate:.0}}}"
                );
                rates.push((relay, keys, rate));
            }
        }
    }
    for &keys in &key_counts {
        let median = |relay: &str| {
            let mut r: Vec<f64> = rates
                .iter()
                .filter(|(name, k, _)| *name == relay && *k == keys)
                .map(|(_, _, r)| *r)
                .collect();
            r.sort_by(f64::total_cmp);
            (r.first().copied().unwrap_or(0.0) + r.last().copied().unwrap_or(0.0)) / 2.0
        };
        let (b, l) = (median("binary"), median("library"));
        println!(
            "{{\"keys\": {keys}, \"median_binary\": {b:.0}, \"median_library\": {l:.0}, \"library_vs_binary\": {:.2}}}",
            l / b.max(1.0)
        );
    }
    Ok(())
}

/// The `i`th event's order id, of `keys` orders.
fn order_of(i: usize, keys: usize, orders: &[Uuid]) -> Uuid {
    orders[i % keys.max(1)]
}

/// An `order.created` payload as orders writes it.
fn payload(order_id: Uuid, i: usize) -> serde_json::Value {
    serde_json::json!({
        "order_id": order_id,
        "account_id": 1 + i % 1000,
        "amount_cents": 100 + i % 10_000,
    })
}

/// `keys` order ids.
fn orders(keys: usize) -> Vec<Uuid> {
    (0..keys.max(1)).map(|_| Uuid::now_v7()).collect()
}

/// The binary's engine draining `rows` rows of `orders.outbox`: rows/s.
async fn binary(rows: usize, keys: usize) -> anyhow::Result<f64> {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await?;
    let ids = orders(keys);
    let messages: Vec<OutboxMessage> = (0..rows)
        .map(|i| {
            let order_id = order_of(i, keys, &ids);
            OutboxMessage {
                aggregate_id: order_id,
                msg_id: Uuid::now_v7(),
                event_type: "order.created".into(),
                payload: payload(order_id, i).to_string().into_bytes(),
            }
        })
        .collect();
    for chunk in messages.chunks(1000) {
        let mut tx = pool.begin().await?;
        Outbox.enqueue_batch(&mut tx, chunk).await?;
        tx.commit().await?;
    }
    sqlx::query("ANALYZE orders.outbox").execute(&pool).await?;
    let topic = TestTopic::create(6).await;
    let config = Config {
        command: None,
        db: DbArgs::for_url(db.url_as(ServiceRole::Relay)),
        runtime: pipeline::config::RuntimeArgs { worker_threads: 0 },
        kafka: topic.kafka_args(),
        crash: CrashArgs::default(),
        batch_size: std::env::var("BENCH_AB_BINARY_BATCH").map_or(Ok(1000), |b| b.parse())?,
        workers: 8,
        shard_groups: 2,
        shard_depth: 1,
        poll_interval_ms: 500,
        lag_sample_ms: 1000,
        synchronous_commit: false,
        metrics_addr: "127.0.0.1:0".parse()?,
        linger_ms: 10,
        busy_linger_ms: 0,
        busy_rows_per_sec: 2_000,
        message_timeout_ms: 30_000,
        max_attempts: 5,
        mode: Mode::Poll,
        wal_slot: None,
        wal_heartbeat_ms: 10_000,
        sink: Sink::Kafka,
        webhook_destination: Vec::new(),
        webhook_allow_addresses: Vec::new(),
        webhook_schedule_scale: 1.0,
        webhook_secrets: Default::default(),
    };
    let started = Instant::now();
    let service = Service::spawn("relay", |metrics, cancel| {
        relay::run(config, metrics, cancel)
    })
    .await;
    while service.metric("relay_published_total").await < rows as f64 {
        anyhow::ensure!(
            started.elapsed() < DRAIN_LIMIT && !service.is_finished(),
            "the binary's relay did not drain {rows} rows"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = started.elapsed();
    service.stop().await;
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM orders.outbox WHERE published_at IS NULL")
            .fetch_one(&pool)
            .await?;
    anyhow::ensure!(pending == 0, "{pending} rows pending after the drain");
    pool.close().await;
    Ok(rows as f64 / took.as_secs_f64())
}

/// The library's relay draining `rows` rows of its outbox: rows/s.
async fn library(rows: usize, keys: usize) -> anyhow::Result<f64> {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await?;
    let fx = Effectively::postgres(pool.clone()).schema("fx")?;
    let topic = TestTopic::create(6).await;
    let ids = orders(keys);
    let events: Vec<Event> = (0..rows)
        .map(|i| {
            let order_id = order_of(i, keys, &ids);
            Event::json(
                &topic.name,
                &order_id.to_string(),
                "order.created",
                &payload(order_id, i),
            )
        })
        .collect::<Result<_, _>>()?;
    for chunk in events.chunks(1000) {
        fx.outbox().enqueue_batch(&pool, chunk).await?;
    }
    sqlx::query("ANALYZE fx.outbox").execute(&pool).await?;
    // The binary's producer settings (`relay::producer`).
    let mut config = topic.client();
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "10")
        .set("queue.buffering.max.messages", "1000000")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4");
    let relay = Relay::new(&fx, KafkaSink::new(&config)?);
    let stats = relay.stats();
    let cancel = CancellationToken::new();
    let started = Instant::now();
    let watch = async {
        while stats.published.load(std::sync::atomic::Ordering::Relaxed) < rows as u64
            && started.elapsed() < DRAIN_LIMIT
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = started.elapsed();
        cancel.cancel();
        took
    };
    let ((), took) = tokio::join!(relay.run(cancel.clone()), watch);
    let backlog = fx.outbox().backlog(&pool).await?;
    anyhow::ensure!(
        backlog.pending == 0 && backlog.failed == 0,
        "{keys} keys: {backlog:?} after the drain"
    );
    pool.close().await;
    Ok(rows as f64 / took.as_secs_f64())
}
