//! How fast the library's consumer loop applies records, by batch size, on
//! the stack of `make up`: `make bench-library` (or
//! `cargo run --release -p effectively --features kafka --example consume_rate -- [RECORDS] [BATCH ...]`).
//!
//! One topic of 6 partitions is filled with RECORDS events (each with its
//! msg_id header, as the library's relay publishes them) once; then, for
//! each BATCH (default: 1 16 256), a consumer group of its own reads the
//! whole topic through `consume_batches` into a fresh inbox, its handler
//! inserting one row per record, and the time from its start to the last
//! record applied is taken. Each batch size is run twice, alternating, and
//! the rates are printed as JSON lines, then their medians.

mod bench;

use std::time::{Duration, Instant};

use effectively::store::{Effectively, Handler, HandlerError, Record, consume_batches};
use pipeline::testing::{TestDb, TestTopic};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (records, batches) = bench::args(20_000, &[1, 16, 256])?;
    let topic = TestTopic::create(6).await;
    let producer: FutureProducer = topic.client().set("linger.ms", "5").create()?;
    let sends = (0..records).map(|n| {
        let id = Uuid::now_v7().to_string();
        let payload = format!("{{\"cart\": {n}, \"total\": {}}}", n % 1000);
        let key = format!("cart-{}", n % 997);
        let producer = &producer;
        let topic = &topic.name;
        async move {
            producer
                .send(
                    FutureRecord::to(topic).key(&key).payload(&payload).headers(
                        OwnedHeaders::new().insert(Header {
                            key: "msg_id",
                            value: Some(&id),
                        }),
                    ),
                    Duration::from_secs(30),
                )
                .await
                .map_err(|(e, _)| e)
        }
    });
    for result in futures::future::join_all(sends).await {
        result?;
    }
    eprintln!("consume_rate: {records} records on {}", topic.name);

    let mut rates: Vec<(usize, f64)> = Vec::new();
    for round in 0..2 {
        for &batch in &batches {
            let rate = run(&topic, records, batch).await?;
            println!("{{\"round\": {round}, \"batch\": {batch}, \"records_per_s\": {rate:.0}}}");
            rates.push((batch, rate));
        }
    }
    bench::print_medians("batch", "records_per_s", &batches, &rates);
    Ok(())
}

/// One group reads the whole topic with `batch`; its records per second.
async fn run(topic: &TestTopic, records: usize, batch: usize) -> anyhow::Result<f64> {
    let db = TestDb::empty().await;
    let pool = PgPool::connect(&db.url).await?;
    let fx = Effectively::postgres(pool.clone()).schema("bench_fx")?;
    fx.migrate().await?;
    sqlx::query("CREATE TABLE invoices (cart int NOT NULL, total int NOT NULL)")
        .execute(&pool)
        .await?;
    let consumer: StreamConsumer = topic
        .client()
        .set("group.id", format!("rate-{}", Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[&topic.name])?;
    let handler: &Handler = &|tx, record: &Record| {
        Box::pin(async move {
            let body: serde_json::Value = serde_json::from_slice(&record.payload)
                .map_err(|e| HandlerError::Reject(e.to_string()))?;
            sqlx::query("INSERT INTO invoices (cart, total) VALUES ($1, $2)")
                .bind(body["cart"].as_i64().unwrap_or_default() as i32)
                .bind(body["total"].as_i64().unwrap_or_default() as i32)
                .execute(&mut *tx)
                .await?;
            Ok(())
        })
    };
    let inbox = fx.inbox("billing");
    let cancel = CancellationToken::new();
    let started = Instant::now();
    let watch = async {
        let deadline = started + Duration::from_secs(600);
        loop {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM invoices")
                .fetch_one(&pool)
                .await
                .unwrap_or_default();
            if n as usize >= records || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let took = started.elapsed();
        cancel.cancel();
        took
    };
    let (result, took) = tokio::join!(
        consume_batches(&fx, &inbox, &consumer, handler, batch, &cancel),
        watch
    );
    result?;
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM invoices")
        .fetch_one(&pool)
        .await?;
    anyhow::ensure!(
        applied as usize == records,
        "batch {batch}: {applied} of {records} applied within 600 s"
    );
    pool.close().await;
    Ok(records as f64 / took.as_secs_f64())
}
