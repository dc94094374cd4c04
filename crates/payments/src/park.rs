//! Parked events (`payments.parked`,
//! migrations/20261202000031_inbox_parked_events.sql): a valid Kafka event
//! whose msg_id lies beyond the inbox's partitions cannot be recorded yet.
//! Holding its Kafka partition on it (as payments once did) stalled every key
//! of the partition until the partitions reached its mint time, weeks for a
//! producer clock that far ahead. Now:
//!
//! - Minted further ahead of the database's clock than `--clock-skew`, it is
//!   a dead letter `ahead_of_clock` at once (in `inbox::apply_batch`): no
//!   clock the pipeline accepts mints it, so it waits for no one.
//! - Within the skew (the partitions' maintenance is behind), it is parked
//!   here in the batch's transaction, and the offset is committed past it as
//!   past any other message: the park is durable. Only its own key (the
//!   order) waits: a later event of a key with parked events is parked behind
//!   them, in the transaction that checks. [`drain`] applies each key's
//!   parked events in order once the inbox can record them: claim, charge
//!   and the delete from here in one transaction.
//!
//! At least once throughout: a crash between the park and the offset commit
//! redelivers the message, and parking it again is a no-op (msg_id is the
//! key; another payload under it is a `msg_id_conflict` dead letter); an
//! event applied twice is an inbox hit as always.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use pipeline::crash::Crasher;
use sqlx::{PgPool, Postgres, Transaction};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::delivery::{Applied, ChargeIntent, DeadLetter, DeadLetterKind, Origin, Source};
use crate::expiry;
use crate::inbox;
use crate::metrics::PaymentsMetrics;

/// A Kafka event to park, and why.
#[derive(Debug)]
pub(crate) struct ToPark<'d, 'a> {
    /// What it says.
    pub(crate) intent: &'d ChargeIntent,
    /// Where it came from (a Kafka message).
    pub(crate) source: Source<'a>,
    /// Why it waits.
    pub(crate) reason: String,
}

/// The smallest msg_id minted more than `clock_skew` after the database's
/// clock: a msg_id at or above it is ahead of every clock payments accepts.
pub(crate) async fn ahead_bound(
    tx: &mut Transaction<'_, Postgres>,
    clock_skew: Duration,
) -> sqlx::Result<Uuid> {
    sqlx::query_scalar("SELECT effectively.v7_floor(now() + $1 * interval '1 second')")
        .bind(clock_skew.as_secs_f64())
        .fetch_one(&mut **tx)
        .await
}

/// Which of `orders` have parked events: their later events wait behind.
pub(crate) async fn parked_keys(
    tx: &mut Transaction<'_, Postgres>,
    orders: &[Uuid],
) -> sqlx::Result<HashSet<Uuid>> {
    let keys: Vec<Uuid> = sqlx::query_scalar(
        "SELECT DISTINCT order_id FROM payments.parked WHERE order_id = ANY($1)",
    )
    .bind(orders)
    .fetch_all(&mut **tx)
    .await?;
    Ok(keys.into_iter().collect())
}

/// Parks `events` in order; returns how many were new, and a
/// `msg_id_conflict` dead letter for each whose msg_id is parked with
/// another payload (the first stays parked). A redelivery of a parked event
/// parks nothing.
pub(crate) async fn park<'a>(
    tx: &mut Transaction<'_, Postgres>,
    events: &[ToPark<'_, 'a>],
) -> sqlx::Result<(u64, Vec<DeadLetter<'a>>)> {
    let mut new = 0;
    let mut conflicts = Vec::new();
    for e in events {
        let Origin::Kafka {
            topic,
            partition,
            offset,
        } = e.source.origin
        else {
            continue; // only Kafka events are parked
        };
        let i = e.intent;
        let stored: Option<i64> = sqlx::query_scalar(
            "WITH p AS ( \
               INSERT INTO payments.parked (msg_id, order_id, account_id, amount_cents, payload_hash, \
                                            topic, partition, \"offset\", msg_key, payload, reason) \
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) \
               ON CONFLICT (msg_id) DO NOTHING RETURNING payload_hash) \
             SELECT payload_hash FROM p",
        )
        .bind(i.msg_id)
        .bind(i.order_id)
        .bind(i.account_id)
        .bind(i.amount_cents)
        .bind(i.payload_hash)
        .bind(effectively::text::storable(topic))
        .bind(partition)
        .bind(offset)
        .bind(e.source.key)
        .bind(e.source.payload)
        .bind(effectively::text::storable(&e.reason))
        .fetch_optional(&mut **tx)
        .await?;
        if stored.is_some() {
            new += 1;
            continue;
        }
        let first: Option<i64> =
            sqlx::query_scalar("SELECT payload_hash FROM payments.parked WHERE msg_id = $1")
                .bind(i.msg_id)
                .fetch_optional(&mut **tx)
                .await?;
        if let Some(first) = first.filter(|f| *f != i.payload_hash) {
            conflicts.push(DeadLetter {
                source: e.source,
                kind: DeadLetterKind::MsgIdConflict,
                msg_id: Some(i.msg_id),
                order_id: Some(i.order_id),
                reason: format!(
                    "msg_id {} is parked with another payload (first payload hash {first:016x}, \
                     this one {:016x}); the first stays parked",
                    i.msg_id, i.payload_hash
                ),
            });
        }
    }
    Ok((new, conflicts))
}

/// One parked row, as [`drain_once`] reads it.
type Row = (
    Uuid,
    Uuid,
    i64,
    i64,
    i64,
    String,
    i32,
    i64,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
);

/// At most this many parked events are applied per transaction.
const DRAIN_BATCH: i64 = 500;

/// Applies, in one transaction, the first parked event of each key (up to
/// [`DRAIN_BATCH`]) that the inbox can record now: inbox claim, charge,
/// ledger entry and the delete from `payments.parked` commit together. A
/// key's later events wait until its earlier ones are gone, so they are
/// applied in the order they were parked. Rows another drain holds are
/// skipped. Returns what it did, `None` when nothing could be applied.
pub async fn drain_once(pool: &PgPool, crasher: &Crasher) -> sqlx::Result<Option<Applied>> {
    let mut tx = pool.begin().await?;
    // Under the shared window lock: no partition of it is dropped before
    // the claims commit.
    let window = expiry::read_window(pool, &mut tx).await?;
    let Some(ceiling) = window.ceiling else {
        return Ok(None);
    };
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT p.msg_id, p.order_id, p.account_id, p.amount_cents, p.payload_hash, \
                p.topic, p.partition, p.\"offset\", p.msg_key, p.payload \
         FROM payments.parked p \
         WHERE p.msg_id < $1 \
           AND NOT EXISTS (SELECT 1 FROM payments.parked q \
                           WHERE q.order_id = p.order_id AND q.seq < p.seq) \
         ORDER BY p.seq LIMIT $2 FOR UPDATE OF p SKIP LOCKED",
    )
    .bind(ceiling)
    .bind(DRAIN_BATCH)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        return Ok(None);
    }
    let intents: Vec<ChargeIntent> = rows
        .iter()
        .map(|r| ChargeIntent {
            msg_id: r.0,
            order_id: r.1,
            account_id: r.2,
            amount_cents: r.3,
            payload_hash: r.4,
        })
        .collect();
    let mut applied = Applied::default();
    let mut claimable = Vec::with_capacity(rows.len());
    let mut dead = Vec::new();
    for (intent, r) in intents.iter().zip(&rows) {
        let source = Source::kafka(&r.5, r.6, r.7, r.8.as_deref(), r.9.as_deref());
        match expiry::judge(&window, intent.msg_id) {
            None => claimable.push((intent, source)),
            // Parked so long that the dedup horizon passed it: refused as
            // any delivery that late.
            Some((outside, reason)) => {
                dead.push(inbox::refuse_outside(
                    &mut applied,
                    intent,
                    source,
                    outside,
                    reason,
                ));
            }
        }
    }
    if !claimable.is_empty() {
        let claim = inbox::claim_and_charge(pool, &mut tx, &window, &claimable, crasher).await?;
        applied.charged = claim.new.len() as u64;
        applied.duplicates = claim.duplicates;
        applied.charge_conflicts = claim.order_conflicts.len() as u64;
        applied.msg_id_conflicts = claim.msg_id_conflicts.len() as u64;
        applied.new_msg_ids = claim.new;
        dead.extend(claim.msg_id_conflicts);
        dead.extend(claim.order_conflicts);
    }
    if !dead.is_empty() {
        applied.dead_lettered = inbox::insert_dead_letters(&mut tx, &dead).await?;
    }
    let done: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
    sqlx::query("DELETE FROM payments.parked WHERE msg_id = ANY($1)")
        .bind(&done)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Some(applied))
}

/// How many events are parked.
pub async fn count(pool: &PgPool) -> sqlx::Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM payments.parked")
        .fetch_one(pool)
        .await
}

/// Applies parked events every `every` until `cancel` fires: [`drain_once`]
/// until nothing more can be applied, then the gauge of what is still
/// parked. Failures are logged and tried again next round.
pub async fn drain(
    pool: PgPool,
    every: Duration,
    crasher: Arc<Crasher>,
    metrics: Arc<PaymentsMetrics>,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = cancel.cancelled() => return,
        }
        loop {
            match drain_once(&pool, &crasher).await {
                Ok(Some(applied)) => {
                    tracing::info!(
                        charged = applied.charged,
                        duplicates = applied.duplicates,
                        dead_lettered = applied.dead_lettered.len(),
                        "parked events applied"
                    );
                    metrics
                        .parked_applied_total
                        .inc_by(applied.charged + applied.duplicates);
                    crate::process::record(&metrics, &applied, &HashMap::new());
                }
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(%error, "applying parked events failed; retrying next round");
                    break;
                }
            }
            if cancel.is_cancelled() {
                return;
            }
        }
        match count(&pool).await {
            Ok(n) => metrics.parked_events.set(n),
            Err(error) => tracing::warn!(%error, "counting parked events failed"),
        }
    }
}
