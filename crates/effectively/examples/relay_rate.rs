//! How fast the library's relay drains a backlog into Kafka, on the stack
//! of `make up`: `make bench-library-relay` (or
//! `cargo run --release -p effectively --features kafka --example relay_rate -- [ROWS] [KEYS ...]`).
//!
//! For each KEYS (default: 20000 1000 10), a fresh schema's outbox gets ROWS
//! events (default 20,000) spread round-robin over that many keys, committed
//! before the relay starts; then one `Relay` (its defaults, a `KafkaSink`
//! with the producer's defaults and `linger.ms` 5) runs until it has
//! published every row (its own count), and the time from its start to
//! then is taken; the backlog is checked empty after. Each KEYS is run
//! twice, alternating, and the rates (with the passes' count and a pass's
//! mean claim, send and mark) are printed as JSON lines, then their
//! medians.
//!
//! The relay's defaults can be changed: `BENCH_RELAY_BATCH` (its batch
//! size), `BENCH_RELAY_GROUPS` (its shard groups),
//! `BENCH_RELAY_KEEP_PUBLISHED_S` (how long it keeps published rows; 0:
//! none, each deleted by the pass that sent it).

mod bench;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use effectively::store::{Effectively, Event, KafkaSink, Relay};
use pipeline::testing::{TestDb, TestTopic};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let (rows, key_counts) = bench::args(20_000, &[20_000, 1000, 10])?;
    let mut rates: Vec<(usize, f64)> = Vec::new();
    for round in 0..2 {
        for &keys in &key_counts {
            let (rate, passes) = run(rows, keys).await?;
            println!(
                "{{\"round\": {round}, \"keys\": {keys}, \"rows_per_s\": {rate:.0}, {passes}}}"
            );
            rates.push((keys, rate));
        }
    }
    bench::print_medians("keys", "rows_per_s", &key_counts, &rates);
    Ok(())
}

/// One backlog of `rows` events over `keys` keys drained: its rows per
/// second, and its passes as JSON fields (how many, and a pass's mean
/// claim, send and mark in ms).
async fn run(rows: usize, keys: usize) -> anyhow::Result<(f64, String)> {
    let db = TestDb::empty().await;
    let pool = PgPool::connect(&db.url).await?;
    let fx = Effectively::postgres(pool.clone()).schema("bench_fx")?;
    fx.migrate().await?;
    let topic = TestTopic::create(6).await;
    let events: Vec<Event> = (0..rows)
        .map(|n| {
            Event::json(
                &topic.name,
                &format!("cart-{}", n % keys.max(1)),
                "cart.checked_out",
                &serde_json::json!({"cart": n, "total": n % 1000}),
            )
        })
        .collect::<Result<_, _>>()?;
    for chunk in events.chunks(1000) {
        fx.outbox().enqueue_batch(&pool, chunk).await?;
    }
    sqlx::query("ANALYZE bench_fx.outbox")
        .execute(&pool)
        .await?;
    let mut config = topic.client();
    config.set("linger.ms", "5");
    let mut relay = Relay::new(&fx, KafkaSink::new(&config)?);
    if let Ok(rows) = std::env::var("BENCH_RELAY_BATCH") {
        relay = relay.batch_size(rows.parse()?);
    }
    if let Ok(groups) = std::env::var("BENCH_RELAY_GROUPS") {
        relay = relay.shard_groups(groups.parse()?);
    }
    if let Ok(secs) = std::env::var("BENCH_RELAY_KEEP_PUBLISHED_S") {
        relay = relay.keep_published(Some(Duration::from_secs(secs.parse()?)));
    }
    let stats = relay.stats();
    let cancel = CancellationToken::new();
    let started = Instant::now();
    // The relay's own count says when every row is published: a count of
    // the backlog every few milliseconds took a core of PostgreSQL's two.
    let watch = async {
        let deadline = started + Duration::from_secs(600);
        while stats.published.load(Ordering::Relaxed) < rows as u64 && Instant::now() < deadline {
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
        "{keys} keys: {backlog:?} after 600 s"
    );
    pool.close().await;
    let passes = stats.passes.load(Ordering::Relaxed);
    let mean_ms = |micros: &std::sync::atomic::AtomicU64| {
        micros.load(Ordering::Relaxed) as f64 / passes.max(1) as f64 / 1000.0
    };
    let passes_json = format!(
        "\"passes\": {passes}, \"claim_ms\": {:.1}, \"send_ms\": {:.1}, \"mark_ms\": {:.1}",
        mean_ms(&stats.claim_micros),
        mean_ms(&stats.send_micros),
        mean_ms(&stats.mark_micros)
    );
    Ok((rows as f64 / took.as_secs_f64(), passes_json))
}
