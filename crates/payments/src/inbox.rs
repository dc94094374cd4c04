//! The consume-side transaction: inbox claim + charge + ledger entry, and dead
//! letters, for one polled batch, in ONE transaction.
//!
//! This is where effectively-once is earned on the consume side. A message
//! whose msg_id is already in the inbox is a no-op; one that is new gets its
//! inbox row, its charge and its ledger entry in the same commit. A crash
//! anywhere before the commit leaves none of them, and the redelivery (the
//! offset was not committed, it is only committed after this transaction)
//! does all of them.

use std::collections::HashSet;

use effectively::crash::Crasher;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

/// A decoded `order.created` event ready to apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeIntent {
    /// Dedup identity.
    pub msg_id: Uuid,
    /// Order to charge.
    pub order_id: Uuid,
    /// Account charged.
    pub account_id: i64,
    /// Amount in cents.
    pub amount_cents: i64,
}

/// A message that cannot be applied, kept with its raw bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// Source topic.
    pub topic: String,
    /// Source partition.
    pub partition: i32,
    /// Source offset.
    pub offset: i64,
    /// Raw key.
    pub key: Option<Vec<u8>>,
    /// Raw value.
    pub payload: Option<Vec<u8>>,
    /// Why it was dead-lettered.
    pub reason: String,
}

/// What applying a batch did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Messages whose msg_id was new: charged now.
    pub charged: u64,
    /// Messages whose msg_id was already in the inbox: no-ops.
    pub duplicates: u64,
    /// New msg_ids whose order already had a charge (the UNIQUE guard caught
    /// a second event for one order; should stay 0).
    pub charge_conflicts: u64,
    /// Messages dead-lettered.
    pub dead_lettered: u64,
    /// The msg_ids charged by this batch.
    pub new_msg_ids: Vec<Uuid>,
}

/// Applies a batch in one transaction; see the module docs.
pub async fn apply_batch(
    pool: &PgPool,
    intents: &[ChargeIntent],
    dead: &[DeadLetter],
    crasher: &Crasher,
) -> sqlx::Result<Applied> {
    let mut tx = pool.begin().await?;
    let mut applied = Applied::default();
    if !intents.is_empty() {
        let (new, conflicts) = claim_and_charge(&mut tx, intents, crasher).await?;
        applied.charged = new.len() as u64;
        applied.duplicates = intents.len() as u64 - applied.charged;
        applied.charge_conflicts = conflicts;
        applied.new_msg_ids = new;
    }
    if !dead.is_empty() {
        applied.dead_lettered = insert_dead_letters(&mut tx, dead).await?;
    }
    // The charge is written, the inbox row too, nothing is committed: a crash
    // here must lose both together (and the redelivery redo both).
    crasher.point("effect");
    tx.commit().await?;
    Ok(applied)
}

/// Inbox claim, then charges and ledger entries for the msg_ids that were new.
/// Returns (the new msg_ids, charge conflicts).
pub(crate) async fn claim_and_charge(
    tx: &mut Transaction<'_, Postgres>,
    intents: &[ChargeIntent],
    crasher: &Crasher,
) -> sqlx::Result<(Vec<Uuid>, u64)> {
    let unique = unique_by_msg_id(intents);
    let msg_ids: Vec<Uuid> = unique.iter().map(|i| i.msg_id).collect();
    let new = claim_inbox(tx, &msg_ids).await?;
    // The inbox rows are claimed, no charge yet: a crash here must not lose
    // the charge (it cannot: neither is committed).
    crasher.point("claim");
    if new.is_empty() {
        return Ok((new, 0));
    }
    let claimed: HashSet<Uuid> = new.iter().copied().collect();
    let fresh: Vec<&ChargeIntent> = unique
        .into_iter()
        .filter(|i| claimed.contains(&i.msg_id))
        .collect();
    let charged = insert_effects(tx, &fresh).await?;
    Ok((new, fresh.len() as u64 - charged))
}

/// One intent per msg_id, in msg_id order: a consistent lock order between
/// concurrent consumers (no deadlocks).
pub(crate) fn unique_by_msg_id(intents: &[ChargeIntent]) -> Vec<&ChargeIntent> {
    let mut unique: Vec<&ChargeIntent> = Vec::with_capacity(intents.len());
    let mut seen = HashSet::with_capacity(intents.len());
    for intent in intents {
        if seen.insert(intent.msg_id) {
            unique.push(intent);
        }
    }
    unique.sort_by_key(|i| i.msg_id);
    unique
}

/// Inserts inbox rows; returns the msg_ids that were new.
pub(crate) async fn claim_inbox(
    tx: &mut Transaction<'_, Postgres>,
    msg_ids: &[Uuid],
) -> sqlx::Result<Vec<Uuid>> {
    sqlx::query_scalar(
        "INSERT INTO payments.inbox (msg_id) SELECT * FROM unnest($1::uuid[]) \
         ON CONFLICT (msg_id) DO NOTHING RETURNING msg_id",
    )
    .bind(msg_ids)
    .fetch_all(&mut **tx)
    .await
}

/// Writes the charge (guarded by UNIQUE(order_id)) and, for each charge
/// actually inserted, its ledger entry, in one statement; returns how many
/// charges were inserted.
pub async fn insert_effects(
    tx: &mut Transaction<'_, Postgres>,
    fresh: &[&ChargeIntent],
) -> sqlx::Result<u64> {
    write_effects(
        tx,
        fresh,
        "WITH c AS ( \
           INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents) \
           SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::int8[], $5::int8[]) \
           ON CONFLICT (order_id) DO NOTHING \
           RETURNING account_id, order_id, msg_id, amount_cents), \
         l AS ( \
           INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
           SELECT account_id, order_id, msg_id, amount_cents FROM c) \
         SELECT count(*) FROM c",
    )
    .await
}

/// Runs an effect statement over the columns of `fresh`: $1 charge ids,
/// $2 order ids, $3 msg ids, $4 accounts, $5 amounts. The statement returns
/// the number of charges inserted.
pub(crate) async fn write_effects(
    tx: &mut Transaction<'_, Postgres>,
    fresh: &[&ChargeIntent],
    sql: &'static str,
) -> sqlx::Result<u64> {
    let charge_ids: Vec<Uuid> = fresh.iter().map(|_| Uuid::now_v7()).collect();
    let order_ids: Vec<Uuid> = fresh.iter().map(|i| i.order_id).collect();
    let msg_ids: Vec<Uuid> = fresh.iter().map(|i| i.msg_id).collect();
    let accounts: Vec<i64> = fresh.iter().map(|i| i.account_id).collect();
    let amounts: Vec<i64> = fresh.iter().map(|i| i.amount_cents).collect();
    let charged: i64 = sqlx::query_scalar(sql)
        .bind(&charge_ids)
        .bind(&order_ids)
        .bind(&msg_ids)
        .bind(&accounts)
        .bind(&amounts)
        .fetch_one(&mut **tx)
        .await?;
    Ok(u64::try_from(charged).unwrap_or(0))
}

pub(crate) async fn insert_dead_letters(
    tx: &mut Transaction<'_, Postgres>,
    dead: &[DeadLetter],
) -> sqlx::Result<u64> {
    let mut n = 0;
    for d in dead {
        n += sqlx::query(
            "INSERT INTO payments.dead_letters (topic, partition, \"offset\", msg_key, payload, reason) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (topic, partition, \"offset\") DO NOTHING",
        )
        .bind(&d.topic)
        .bind(d.partition)
        .bind(d.offset)
        .bind(&d.key)
        .bind(&d.payload)
        .bind(&d.reason)
        .execute(&mut **tx)
        .await?
        .rows_affected();
    }
    Ok(n)
}
