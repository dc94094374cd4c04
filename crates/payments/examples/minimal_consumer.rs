//! Yardstick for the consumer benchmark: the least code that does payments'
//! work per message. It reads N messages of a topic from the beginning in a
//! fresh group and, per batch, writes the rows payments writes for a new
//! event in one transaction: the inbox claim (`fx.partitioned_inbox`, ON
//! CONFLICT DO NOTHING), and for each claim that was new the charge and its
//! ledger entry (one statement, as payments' `insert_effects`); then, as
//! payments does, the batch's offsets are committed only after its
//! transaction, at most every `PAYMENTS_COMMIT_INTERVAL_MS`. Batches are
//! filled as payments fills them (up to `PAYMENTS_BATCH_SIZE`, waiting up to
//! `PAYMENTS_BATCH_LINGER_MS` for more) and the next one is fetched while the
//! current one's transaction runs. What it leaves out is what payments adds
//! on top of those writes: the inbox window and horizon checks, parked and
//! dead-lettered events, duplicate payloads compared, crash points, metrics.
//! So payments' rate over this one is what the rest of its code costs.
//!
//! cargo run --release -p payments --example minimal_consumer -- <topic> <count>
//!
//! DATABASE_URL: a database migrated by orders (payments' role is enough);
//! KAFKA_CLIENT_CONFIG: payments' (its group is `payments-minimal-<uuid>`, inside
//! the groups payments' principal may use).
//! Prints `{"messages": N, "seconds": S, "msgs_per_sec": R, "charged": C}`,
//! timed from the first message received to the last transaction committed.

use std::time::{Duration, Instant};

use rdkafka::Message as _;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::OwnedMessage;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use sqlx::PgPool;
use uuid::Uuid;

mod common;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("{name}={v} is not a number")),
        Err(_) => Ok(default),
    }
}

/// Up to `max` messages: the first waited for, then what arrives within `linger`.
async fn fill(
    consumer: &StreamConsumer,
    max: usize,
    linger: Duration,
) -> anyhow::Result<Vec<OwnedMessage>> {
    let mut batch = vec![consumer.recv().await?.detach()];
    let deadline = tokio::time::Instant::now() + linger;
    while batch.len() < max {
        match tokio::time::timeout_at(deadline, consumer.recv()).await {
            Ok(m) => batch.push(m?.detach()),
            Err(_) => break,
        }
    }
    Ok(batch)
}

/// The batch's rows in one transaction; how many charges it inserted.
async fn apply(pool: &PgPool, batch: &[OwnedMessage]) -> anyhow::Result<u64> {
    let (mut msg_ids, mut hashes, mut orders, mut accounts, mut amounts) =
        (vec![], vec![], vec![], vec![], vec![]);
    for m in batch {
        let (intent, _) = payments::decode::decode(m.payload())
            .map_err(|why| anyhow::anyhow!("offset {}: {why}", m.offset()))?;
        msg_ids.push(intent.msg_id);
        hashes.push(intent.payload_hash.to_be_bytes().to_vec());
        orders.push(intent.order_id);
        accounts.push(intent.account_id);
        amounts.push(intent.amount_cents);
    }
    let mut tx = pool.begin().await?;
    let fresh: Vec<Uuid> = sqlx::query_scalar(
        "INSERT INTO fx.partitioned_inbox (consumer, msg_id, payload_hash) \
         SELECT 'payments', m.id, m.hash FROM unnest($1::uuid[], $2::bytea[]) AS m(id, hash) \
         ORDER BY m.id ON CONFLICT (msg_id, consumer) DO NOTHING RETURNING msg_id",
    )
    .bind(&msg_ids)
    .bind(&hashes)
    .fetch_all(&mut *tx)
    .await?;
    let fresh: std::collections::HashSet<Uuid> = fresh.into_iter().collect();
    let keep: Vec<usize> = (0..msg_ids.len())
        .filter(|i| fresh.contains(&msg_ids[*i]))
        .collect();
    let pick = |v: &Vec<Uuid>| keep.iter().map(|i| v[*i]).collect::<Vec<_>>();
    let pick_i64 = |v: &Vec<i64>| keep.iter().map(|i| v[*i]).collect::<Vec<_>>();
    let charge_ids: Vec<Uuid> = keep.iter().map(|_| Uuid::now_v7()).collect();
    let charged = sqlx::query(
        "WITH c AS ( \
           INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents) \
           SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::int8[], $5::int8[]) \
           ON CONFLICT (order_id) DO NOTHING \
           RETURNING account_id, order_id, msg_id, amount_cents) \
         INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
         SELECT account_id, order_id, msg_id, amount_cents FROM c",
    )
    .bind(&charge_ids)
    .bind(pick(&orders))
    .bind(pick(&msg_ids))
    .bind(pick_i64(&accounts))
    .bind(pick_i64(&amounts))
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(charged)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(topic), Some(count)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: minimal_consumer <topic> <count>");
    };
    let count: usize = count.parse()?;
    let url = std::env::var("DATABASE_URL").map_err(|_| anyhow::anyhow!("DATABASE_URL unset"))?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await?;
    let max = env_or("PAYMENTS_BATCH_SIZE", 500usize)?.max(1);
    let linger = Duration::from_millis(env_or("PAYMENTS_BATCH_LINGER_MS", 5u64)?);
    let commit_every = Duration::from_millis(env_or("PAYMENTS_COMMIT_INTERVAL_MS", 1000u64)?);
    let consumer = common::fresh_consumer(&topic, "payments-minimal")?;

    let mut batch = fill(&consumer, max, linger).await?;
    let start = Instant::now();
    let (mut done, mut charged) = (0usize, 0u64);
    // The next offset of each partition whose batches have committed.
    let mut offsets: std::collections::BTreeMap<(String, i32), i64> = Default::default();
    let mut committed_at = Instant::now();
    loop {
        // The next batch is fetched while this one's transaction runs.
        let last = done + batch.len() >= count;
        let (applied, next) = if last {
            (apply(&pool, &batch).await, None)
        } else {
            let (a, n) = tokio::join!(apply(&pool, &batch), fill(&consumer, max, linger));
            (a, Some(n?))
        };
        charged += applied?;
        done += batch.len();
        for m in &batch {
            let next = offsets
                .entry((m.topic().to_owned(), m.partition()))
                .or_default();
            *next = (*next).max(m.offset() + 1);
        }
        if last || committed_at.elapsed() >= commit_every {
            let mut list = TopicPartitionList::new();
            for ((topic, partition), offset) in std::mem::take(&mut offsets) {
                list.add_partition_offset(&topic, partition, Offset::Offset(offset))?;
            }
            consumer.commit(&list, CommitMode::Async)?;
            committed_at = Instant::now();
        }
        match next {
            Some(n) => batch = n,
            None => break,
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{{\"messages\": {done}, \"seconds\": {secs:.3}, \"msgs_per_sec\": {:.0}, \"charged\": {charged}}}",
        done as f64 / secs
    );
    Ok(())
}
