//! Experiment 5's measurements of the inbox at scale (experiments/exp-5-dedup-store).
//!
//! On a fresh migrated database (the owner's `DATABASE_URL`), in one layout:
//! `partitioned` (the inbox as migrated, the library's `fx.partitioned_inbox`:
//! range partitions of msg_id, here one per day of the retention) or `single`
//! (the same columns in one plain table, the layout before issue 10). It grows the inbox to each checkpoint by bulk
//! load (msg_ids minted evenly over `--days`, oldest first, as a consumer at a
//! steady rate would have written them), and at each checkpoint measures the
//! real consume transaction (`payments::inbox::apply_batch`: window, inbox
//! claim, charge, ledger entry, one commit) on new msg_ids: latency per
//! transaction, messages per second, WAL bytes per message, table and index
//! size. Then it expires the oldest day's keys (`DROP` of its partition, or
//! `DELETE` and `VACUUM` of the single table) while a second connection keeps
//! consuming, and measures both. With `--bloom`, it also measures what a
//! Bloom filter in front of the inbox would cost and could save: the filter
//! built from every key (time, memory), its lookups (time, false positives),
//! and the consume transaction of new msg_ids beside that of redelivered
//! ones. One JSON document on `--out`.
//!
//! ```text
//! cargo run --release -p payments --example inbox_bench -- \
//!     --layout partitioned --checkpoints 0,1000000 --out partitioned.json
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use payments::delivery::{Applied, ChargeIntent, Delivery, Rules, Source};
use payments::inbox::apply_batch;
use pipeline::crash::{CrashArgs, Crasher};
use serde::Serialize;
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Layout {
    /// Range partitions of msg_id, one per day (the migrated inbox).
    Partitioned,
    /// One plain table with a primary key on msg_id.
    Single,
}

#[derive(Debug, Parser)]
#[command(about = "Experiment 5: the inbox's consume transaction, size and expiry at scale")]
struct Args {
    /// The owner's URL of a fresh, migrated database (it is rebuilt).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,
    /// The inbox's layout.
    #[arg(long, value_enum)]
    layout: Layout,
    /// Inbox sizes (keys) at which to measure, ascending.
    #[arg(long, value_delimiter = ',', default_value = "0,1000000")]
    checkpoints: Vec<u64>,
    /// The span of mint times of the loaded keys: the retention (days).
    #[arg(long, default_value_t = 16)]
    days: u32,
    /// Messages per measured transaction.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Measured transactions per checkpoint.
    #[arg(long, default_value_t = 300)]
    transactions: usize,
    /// Keys per bulk-load statement.
    #[arg(long, default_value_t = 1_000_000)]
    load_chunk: u64,
    /// Where to write the JSON results.
    #[arg(long)]
    out: PathBuf,
    /// Also measure a Bloom filter in front of the inbox, at the last
    /// checkpoint.
    #[arg(long)]
    bloom: bool,
}

const DAY_MS: i64 = 86_400_000;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut checkpoints = args.checkpoints.clone();
    checkpoints.sort_unstable();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&args.database_url)
        .await
        .context("connect")?;
    let now_ms = chrono::Utc::now().timestamp_millis();
    // Keys are minted over [first_day, an hour ago): whole UTC days but the
    // last, one partition each, so the oldest day is 1/days of the keys.
    let first_day_ms = (now_ms - i64::from(args.days) * DAY_MS).div_euclid(DAY_MS) * DAY_MS;
    let start_ms = first_day_ms;
    let span_ms = now_ms - 3_600_000 - start_ms;
    layout(&pool, args.layout, first_day_ms).await?;
    let total = checkpoints.last().copied().unwrap_or(0);

    let mut points = Vec::new();
    let mut loaded = 0u64;
    for &keys in &checkpoints {
        let load_started = Instant::now();
        while loaded < keys {
            let upto = (loaded + args.load_chunk).min(keys);
            load(&pool, loaded, upto, total, start_ms, span_ms).await?;
            loaded = upto;
            eprintln!("inbox_bench: {:?} loaded {loaded} keys", args.layout);
        }
        let load_s = load_started.elapsed().as_secs_f64();
        sqlx::raw_sql("VACUUM ANALYZE fx.partitioned_inbox")
            .execute(&pool)
            .await
            .context("vacuum")?;
        let (table_bytes, index_bytes) = sizes(&pool).await?;
        // The measured messages are minted at the load's frontier: the
        // newest keys, as time would have it.
        let frontier = start_ms + (span_ms as f64 * keys as f64 / total.max(1) as f64) as i64;
        let m = measure(&pool, args.batch, args.transactions, &Minter::at(frontier)).await?;
        eprintln!(
            "inbox_bench: {:?} at {keys} keys: p99 {:.2} ms, {:.0} msgs/s",
            args.layout, m.p99_ms, m.msgs_per_s
        );
        points.push(json!({
            "layout": args.layout,
            "keys": keys,
            "load_seconds": load_s,
            "table_bytes": table_bytes,
            "index_bytes": index_bytes,
            "txn_p50_ms": m.p50_ms,
            "txn_p99_ms": m.p99_ms,
            "txn_p999_ms": m.p999_ms,
            "txn_max_ms": m.max_ms,
            "msgs_per_s": m.msgs_per_s,
            "wal_bytes_per_msg": m.wal_bytes_per_msg,
        }));
    }
    let minter = Minter::at(start_ms + span_ms);
    let bloom = if args.bloom {
        let b = bloom_front(&pool, args.batch, args.transactions, &minter).await?;
        eprintln!("inbox_bench: {:?} bloom: {b}", args.layout);
        Some(b)
    } else {
        None
    };
    // The oldest day alone (exact time, WAL and sizes), then the next day
    // while a second connection keeps consuming (its latency meanwhile).
    let quiet = expire_day(&pool, args.layout, first_day_ms + DAY_MS, None).await?;
    let loaded = expire_day(
        &pool,
        args.layout,
        first_day_ms + 2 * DAY_MS,
        Some((args.batch, minter)),
    )
    .await?;
    let expiry = json!([quiet, loaded]);
    let doc = json!({
        "layout": args.layout,
        "days": args.days,
        "batch": args.batch,
        "transactions": args.transactions,
        "points": points,
        "expiry": expiry,
        "bloom": bloom,
    });
    std::fs::write(&args.out, serde_json::to_vec_pretty(&doc)?)
        .with_context(|| format!("write {}", args.out.display()))?;
    Ok(())
}

/// Puts the inbox in `layout`: daily partitions from `first_day_ms` on (the
/// migration's first partition, empty in a fresh database, is replaced), or
/// one plain table.
async fn layout(pool: &PgPool, layout: Layout, first_day_ms: i64) -> anyhow::Result<()> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM fx.partitioned_inbox")
        .fetch_one(pool)
        .await?;
    anyhow::ensure!(n == 0, "the inbox is not empty: give a fresh database");
    let sql = match layout {
        Layout::Partitioned => format!(
            "DO $$
             DECLARE
                 top uuid;
                 d timestamptz := to_timestamp({first_day_ms} / 1000.0);
                 lo uuid;
                 hi uuid;
             BEGIN
                 -- The first partition: every msg_id minted before the
                 -- migration, [nil, then).
                 SELECT p.hi INTO top FROM fx.partitioned_inbox_parts p ORDER BY p.lo LIMIT 1;
                 EXECUTE format('DROP TABLE fx.%I',
                                (SELECT p.name FROM fx.partitioned_inbox_parts p ORDER BY p.lo LIMIT 1));
                 DELETE FROM fx.partitioned_inbox_parts p WHERE p.hi = top;
                 WHILE effectively.v7_floor(d) < top LOOP
                     lo := effectively.v7_floor(d);
                     hi := least(effectively.v7_floor(d + interval '1 day'), top);
                     EXECUTE format('CREATE TABLE fx.%I (LIKE fx.partitioned_inbox INCLUDING DEFAULTS)',
                                    'inbox_bench_' || to_char(d AT TIME ZONE 'UTC', 'YYYYMMDD'));
                     EXECUTE format('ALTER TABLE fx.partitioned_inbox ATTACH PARTITION fx.%I '
                                    'FOR VALUES FROM (%L) TO (%L)',
                                    'inbox_bench_' || to_char(d AT TIME ZONE 'UTC', 'YYYYMMDD'), lo, hi);
                     INSERT INTO fx.partitioned_inbox_parts (name, lo, hi)
                         VALUES ('inbox_bench_' || to_char(d AT TIME ZONE 'UTC', 'YYYYMMDD'), lo, hi);
                     d := d + interval '1 day';
                 END LOOP;
             END $$"
        ),
        Layout::Single => "ALTER TABLE fx.partitioned_inbox RENAME TO partitioned_inbox_as_migrated; \
             CREATE TABLE fx.partitioned_inbox (LIKE fx.partitioned_inbox_as_migrated INCLUDING ALL)"
            .to_owned(),
    };
    sqlx::raw_sql(&sql)
        .execute(pool)
        .await
        .with_context(|| format!("lay out the inbox as {layout:?}"))?;
    Ok(())
}

/// Loads keys `from..upto` of `total`, key i minted at start + i·span/total,
/// in mint order (a UUIDv7-like id: the time, then hash bits).
async fn load(
    pool: &PgPool,
    from: u64,
    upto: u64,
    total: u64,
    start_ms: i64,
    span_ms: i64,
) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) \
         SELECT 'payments', (lpad(to_hex($3::int8 + (i::numeric * $4 / $5)::int8), 12, '0') \
                 || substr(md5(i::text), 1, 20))::uuid, int8send(i) \
         FROM generate_series($1::int8, $2::int8 - 1) AS i \
         ON CONFLICT DO NOTHING",
    )
    .bind(i64::try_from(from)?)
    .bind(i64::try_from(upto)?)
    .bind(start_ms)
    .bind(span_ms)
    .bind(i64::try_from(total.max(1))?)
    .execute(pool)
    .await
    .context("bulk load")?;
    Ok(())
}

/// Table and index bytes of the inbox (every partition).
async fn sizes(pool: &PgPool) -> anyhow::Result<(i64, i64)> {
    let row: (i64, i64) = sqlx::query_as(
        "WITH t AS (SELECT relid FROM pg_partition_tree('fx.partitioned_inbox') WHERE isleaf \
                    UNION SELECT 'fx.partitioned_inbox'::regclass) \
         SELECT COALESCE(sum(pg_relation_size(relid)), 0)::int8, \
                COALESCE(sum(pg_indexes_size(relid)), 0)::int8 FROM t",
    )
    .fetch_one(pool)
    .await?;
    Ok(row)
}

async fn wal_lsn(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8")
            .fetch_one(pool)
            .await?,
    )
}

/// Mints UUIDv7s from a simulated clock, one millisecond apart, so the
/// measured messages are the newest keys of the inbox whatever its size.
#[derive(Clone)]
struct Minter(Arc<std::sync::atomic::AtomicI64>);

impl Minter {
    fn at(ms: i64) -> Self {
        Self(Arc::new(std::sync::atomic::AtomicI64::new(ms)))
    }

    fn next(&self) -> Uuid {
        let ms = u64::try_from(self.0.fetch_add(1, Ordering::Relaxed)).unwrap_or(0);
        Uuid::new_v7(uuid::Timestamp::from_unix(
            uuid::NoContext,
            ms / 1000,
            u32::try_from(ms % 1000).unwrap_or(0) * 1_000_000,
        ))
    }
}

struct Measured {
    p50_ms: f64,
    p99_ms: f64,
    p999_ms: f64,
    max_ms: f64,
    msgs_per_s: f64,
    wal_bytes_per_msg: f64,
}

/// `transactions` consume transactions of `batch` new msg_ids, one after
/// the other.
async fn measure(
    pool: &PgPool,
    batch: usize,
    transactions: usize,
    minter: &Minter,
) -> anyhow::Result<Measured> {
    let crasher = Crasher::new(CrashArgs::default());
    let mut hist = Histogram::<u64>::new(3)?;
    let wal_before = wal_lsn(pool).await?;
    let started = Instant::now();
    for t in 0..transactions {
        let took = consume_one(pool, &crasher, batch, t, minter).await?;
        hist.record(took.as_micros().try_into().unwrap_or(u64::MAX))?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let wal = wal_lsn(pool).await? - wal_before;
    let msgs = (batch * transactions) as f64;
    Ok(Measured {
        p50_ms: hist.value_at_quantile(0.5) as f64 / 1e3,
        p99_ms: hist.value_at_quantile(0.99) as f64 / 1e3,
        p999_ms: hist.value_at_quantile(0.999) as f64 / 1e3,
        max_ms: hist.max() as f64 / 1e3,
        msgs_per_s: msgs / elapsed,
        wal_bytes_per_msg: wal as f64 / msgs,
    })
}

/// One consume transaction of `batch` new events; how long it took.
async fn consume_one(
    pool: &PgPool,
    crasher: &Crasher,
    batch: usize,
    t: usize,
    minter: &Minter,
) -> anyhow::Result<Duration> {
    let intents = new_intents(batch, minter);
    let (took, applied) = consume(pool, crasher, &intents, t).await?;
    anyhow::ensure!(
        applied.charged == batch as u64,
        "every new msg_id charged: {applied:?}"
    );
    Ok(took)
}

/// `batch` events never delivered before.
fn new_intents(batch: usize, minter: &Minter) -> Vec<ChargeIntent> {
    (0..batch)
        .map(|i| ChargeIntent {
            msg_id: minter.next(),
            order_id: Uuid::now_v7(),
            account_id: 1 + (i as i64 % 1000),
            amount_cents: 100,
            payload_hash: i as i64,
        })
        .collect()
}

/// One consume transaction of `intents` (the `t`-th); how long it took and
/// what it did.
async fn consume(
    pool: &PgPool,
    crasher: &Crasher,
    intents: &[ChargeIntent],
    t: usize,
) -> anyhow::Result<(Duration, Applied)> {
    let batch = intents.len();
    let deliveries: Vec<Delivery<'_>> = intents
        .iter()
        .enumerate()
        .map(|(i, intent)| Delivery {
            source: Source::kafka("bench", 0, (t * batch + i) as i64, None, None),
            content: Ok(intent.clone()),
        })
        .collect();
    let started = Instant::now();
    let applied = apply_batch(pool, &deliveries, Rules::refusing(), crasher).await?;
    Ok((started.elapsed(), applied))
}

/// What a Bloom filter in front of the inbox costs and could save.
///
/// A filter answers "certainly never seen" or "maybe seen". The consume
/// transaction writes the inbox row of a new msg_id in the effect's
/// transaction whatever the filter says (the row is the dedup record), and
/// for "maybe seen" it must ask the database anyway (a false positive is a
/// new message). So the filter could only save work if duplicates were
/// expensive: this measures the filter (built from every key: time, bytes;
/// lookups: time, false-positive rate on new msg_ids) and, side by side,
/// `transactions` consume transactions of new msg_ids and the same batches
/// delivered again.
async fn bloom_front(
    pool: &PgPool,
    batch: usize,
    transactions: usize,
    minter: &Minter,
) -> anyhow::Result<serde_json::Value> {
    use futures::TryStreamExt;
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM fx.partitioned_inbox")
        .fetch_one(pool)
        .await?;
    let started = Instant::now();
    let mut filter = fastbloom::BloomFilter::with_false_pos(0.01)
        .expected_items(usize::try_from(keys.max(1)).unwrap_or(usize::MAX));
    let mut rows =
        sqlx::query_scalar::<_, Uuid>("SELECT msg_id FROM fx.partitioned_inbox").fetch(pool);
    let mut inserted = 0u64;
    while let Some(id) = rows.try_next().await? {
        filter.insert(&id);
        inserted += 1;
    }
    drop(rows);
    let build_seconds = started.elapsed().as_secs_f64();

    // Lookups of msg_ids never seen: each "maybe" is a false positive.
    let probes: Vec<Uuid> = (0..1_000_000).map(|_| minter.next()).collect();
    let started = Instant::now();
    let positives = probes.iter().filter(|id| filter.contains(*id)).count();
    let lookup_ns = started.elapsed().as_nanos() as f64 / probes.len() as f64;

    let crasher = Crasher::new(CrashArgs::default());
    let mut new_hist = Histogram::<u64>::new(3)?;
    let mut dup_hist = Histogram::<u64>::new(3)?;
    for t in 0..transactions {
        let intents = new_intents(batch, minter);
        let (took, applied) = consume(pool, &crasher, &intents, 2_000_000 + 2 * t).await?;
        anyhow::ensure!(applied.charged == batch as u64, "new: {applied:?}");
        new_hist.record(took.as_micros().try_into().unwrap_or(u64::MAX))?;
        let (took, applied) = consume(pool, &crasher, &intents, 2_000_000 + 2 * t + 1).await?;
        anyhow::ensure!(
            applied.duplicates == batch as u64 && applied.charged == 0,
            "the redelivery is a no-op: {applied:?}"
        );
        dup_hist.record(took.as_micros().try_into().unwrap_or(u64::MAX))?;
    }
    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1e3;
    Ok(json!({
        "keys": inserted,
        "build_seconds": build_seconds,
        "bits": filter.num_bits(),
        "bytes": filter.num_bits() / 8,
        "hashes": filter.num_hashes(),
        "target_false_positive_rate": 0.01,
        "probes": probes.len(),
        "false_positives": positives,
        "lookup_ns": lookup_ns,
        "transactions": transactions,
        "new_txn_p50_ms": ms(&new_hist, 0.5),
        "new_txn_p99_ms": ms(&new_hist, 0.99),
        "duplicate_txn_p50_ms": ms(&dup_hist, 0.5),
        "duplicate_txn_p99_ms": ms(&dup_hist, 0.99),
    }))
}

/// Removes the keys minted before `cut_ms` (drop the partitions below it,
/// or delete them and vacuum); with `consume`, while another connection
/// keeps consuming batches of that size.
async fn expire_day(
    pool: &PgPool,
    layout: Layout,
    cut_ms: i64,
    consume: Option<(usize, Minter)>,
) -> anyhow::Result<serde_json::Value> {
    let (table_before, index_before) = sizes(pool).await?;
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM fx.partitioned_inbox \
         WHERE msg_id < effectively.v7_floor(to_timestamp($1::int8 / 1000.0))",
    )
    .bind(cut_ms)
    .fetch_one(pool)
    .await?;

    // The concurrent consumer, recording its transactions until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let during = consume.map(|(batch, minter)| {
        let pool = pool.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let crasher = Crasher::new(CrashArgs::default());
            let mut hist = Histogram::<u64>::new(3)?;
            let mut t = 1_000_000;
            while !stop.load(Ordering::Relaxed) {
                let took = consume_one(&pool, &crasher, batch, t, &minter).await?;
                hist.record(took.as_micros().try_into().unwrap_or(u64::MAX))?;
                t += 1;
            }
            anyhow::Ok((hist, batch))
        })
    });
    if during.is_some() {
        // A second of consumption first, so the operation starts under load.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let wal_before = wal_lsn(pool).await?;
    let started = Instant::now();
    let (op, seconds, wal, vacuum_seconds, vacuum_wal) = match layout {
        Layout::Partitioned => {
            let retention_s = (chrono::Utc::now().timestamp_millis() - cut_ms) as f64 / 1e3;
            let dropped: Vec<String> = sqlx::query_scalar(
                "SELECT fx.partitioned_inbox_expire('payments', $1 * interval '1 second')",
            )
            .bind(retention_s)
            .fetch_all(pool)
            .await
            .context("drop the oldest partition")?;
            anyhow::ensure!(dropped.len() == 1, "one partition dropped: {dropped:?}");
            let seconds = started.elapsed().as_secs_f64();
            (
                "drop partition",
                seconds,
                wal_lsn(pool).await? - wal_before,
                0.0,
                0,
            )
        }
        Layout::Single => {
            sqlx::query(
                "DELETE FROM fx.partitioned_inbox \
                 WHERE msg_id < effectively.v7_floor(to_timestamp($1::int8 / 1000.0))",
            )
            .bind(cut_ms)
            .execute(pool)
            .await
            .context("delete the oldest day")?;
            let seconds = started.elapsed().as_secs_f64();
            let wal_at = wal_lsn(pool).await?;
            let vacuum_started = Instant::now();
            sqlx::raw_sql("VACUUM fx.partitioned_inbox")
                .execute(pool)
                .await?;
            (
                "delete + vacuum",
                seconds,
                wal_at - wal_before,
                vacuum_started.elapsed().as_secs_f64(),
                wal_lsn(pool).await? - wal_at,
            )
        }
    };
    let mut doc = json!({
        "layout": layout,
        "op": op,
        "concurrent": during.is_some(),
        "rows_removed": rows,
        "seconds": seconds,
        "wal_bytes": wal,
        "vacuum_seconds": vacuum_seconds,
        "vacuum_wal_bytes": vacuum_wal,
    });
    if let Some(during) = during {
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.store(true, Ordering::Relaxed);
        let (hist, batch) = during.await.context("join the consumer")??;
        doc["concurrent_txns"] = json!(hist.len());
        doc["rows_inserted_meanwhile"] = json!(hist.len() * batch as u64);
        doc["concurrent_p50_ms"] = json!(hist.value_at_quantile(0.5) as f64 / 1e3);
        doc["concurrent_p99_ms"] = json!(hist.value_at_quantile(0.99) as f64 / 1e3);
        doc["concurrent_max_ms"] = json!(hist.max() as f64 / 1e3);
    }
    let (table_after, index_after) = sizes(pool).await?;
    doc["table_bytes_before"] = json!(table_before);
    doc["index_bytes_before"] = json!(index_before);
    doc["table_bytes_after"] = json!(table_after);
    doc["index_bytes_after"] = json!(index_after);
    Ok(doc)
}
