//! The consume-side transaction: inbox claim + charge + ledger entry, and dead
//! letters, for one polled batch (or a slice of it), in ONE transaction.
//!
//! This is where effectively-once is earned on the consume side. A message
//! whose msg_id is already in the inbox is a no-op; one that is new gets its
//! inbox row, its charge and its ledger entry in the same commit. A crash
//! anywhere before the commit leaves none of them, and the redelivery (the
//! offset was not committed, it is only committed after this transaction)
//! does all of them.
//!
//! A redelivery that lies is recorded, not absorbed: the same msg_id with
//! another payload, or a new msg_id for an order that is already charged,
//! keeps the first effect and becomes a dead letter saying so, written in the
//! same transaction as the claim (so a crash cannot lose the record while the
//! claim survives).

use std::collections::{HashMap, HashSet};

use effectively::text::storable;
use pipeline::contract::CrashPoint;
use pipeline::crash::Crasher;
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::delivery::{
    AfterHorizon, Applied, ChargeIntent, DeadLetter, DeadLetterKind, Delivery, Held, Origin, Rules,
    Source,
};
use crate::expiry::{self, Outside, Window};
use crate::park;
use effectively::store::{InboxClaim, Message};

/// The intents of `deliveries` and the dead letters of those that did not
/// decode.
pub fn split<'d, 'a>(
    deliveries: &'d [Delivery<'a>],
) -> (Vec<(&'d ChargeIntent, Source<'a>)>, Vec<DeadLetter<'a>>) {
    let mut intents = Vec::with_capacity(deliveries.len());
    let mut dead = Vec::new();
    for d in deliveries {
        match &d.content {
            Ok(intent) => intents.push((intent, d.source)),
            Err(reason) => dead.push(DeadLetter {
                source: d.source,
                kind: DeadLetterKind::Undecodable,
                msg_id: None,
                order_id: None,
                reason: reason.clone(),
            }),
        }
    }
    (intents, dead)
}

/// Applies a batch in one transaction; see the module docs. `rules` say
/// what becomes of a msg_id outside the inbox's partitions: its
/// `after_horizon` is [`AfterHorizon::Refuse`] but in experiment 5's unsafe
/// run; a Kafka event beyond the partitions is parked (`crate::park`), or a
/// dead letter when minted further ahead than `clock_skew`.
pub async fn apply_batch(
    pool: &PgPool,
    deliveries: &[Delivery<'_>],
    rules: Rules,
    crasher: &Crasher,
) -> sqlx::Result<Applied> {
    let (mut intents, mut dead) = split(deliveries);
    let mut tx = pool.begin().await?;
    let mut applied = Applied::default();
    // Webhooks are applied from their rows in payments.webhook_inbox: only
    // those this transaction locks and finds unprocessed (another processor
    // may hold or have done the others), and they are marked processed in
    // this same transaction.
    let webhooks: Vec<Uuid> = deliveries
        .iter()
        .filter_map(|d| d.source.webhook_id())
        .collect();
    let mut mine = if webhooks.is_empty() {
        HashSet::new()
    } else {
        let mine = lock_webhooks(&mut tx, &webhooks).await?;
        let ours = |s: &Source<'_>| s.webhook_id().is_none_or(|id| mine.contains(&id));
        intents.retain(|(_, source)| ours(source));
        dead.retain(|d| ours(&d.source));
        applied.skipped = (webhooks.len() - mine.len()) as u64;
        mine
    };
    let mut late = Vec::new();
    let mut parking = Vec::new();
    let mut window = None;
    if !intents.is_empty() {
        // Only msg_ids inside the inbox's partitions can be claimed; the
        // window cannot shrink until this transaction ends.
        let read = expiry::read_window(pool, &mut tx).await?;
        let judged: Vec<_> = intents
            .iter()
            .map(|(intent, _)| expiry::judge(&read, intent.msg_id))
            .collect();
        window = Some(read);
        let is_kafka = |s: &Source<'_>| s.webhook_id().is_none();
        // Read only when a Kafka event lies beyond the partitions: the
        // database's clock plus the skew payments accepts.
        let ahead = if judged
            .iter()
            .zip(&intents)
            .any(|(j, (_, s))| matches!(j, Some((Outside::Future, _))) && is_kafka(s))
        {
            Some(park::ahead_bound(&mut tx, rules.clock_skew).await?)
        } else {
            None
        };
        // A Kafka event of an order with parked events waits behind them
        // (per-key order), checked in this transaction.
        let orders: Vec<Uuid> = intents
            .iter()
            .filter(|(_, s)| is_kafka(s))
            .map(|(i, _)| i.order_id)
            .collect();
        let mut parked_keys = if orders.is_empty() {
            HashSet::new()
        } else {
            park::parked_keys(&mut tx, &orders).await?
        };
        let mut claimable = Vec::with_capacity(intents.len());
        for ((intent, source), judged) in intents.into_iter().zip(judged) {
            match judged {
                None if is_kafka(&source) && parked_keys.contains(&intent.order_id) => {
                    parking.push(park::ToPark {
                        intent,
                        source,
                        reason: format!(
                            "order {} has an earlier event parked: applied after it",
                            intent.order_id
                        ),
                    });
                }
                None => claimable.push((intent, source)),
                Some((Outside::AfterHorizon, _))
                    if rules.after_horizon == AfterHorizon::UnsafeApply =>
                {
                    late.push((intent, source));
                }
                Some((Outside::Future, reason)) if is_kafka(&source) => {
                    if ahead.is_some_and(|bound| intent.msg_id >= bound) {
                        applied.ahead_of_clock += 1;
                        let reason = format!(
                            "msg_id {} was minted at {}, more than the clock skew payments accepts \
                             (--clock-skew {}s) ahead of the database's clock: a producer's clock far \
                             ahead, or a forged msg_id. Not applied, and not parked until the inbox \
                             partitions reach it (its order would wait that long); apply it by hand \
                             once checked, as any dead letter",
                            intent.msg_id,
                            effectively::v7::mint_time(intent.msg_id).to_rfc3339(),
                            rules.clock_skew.as_secs()
                        );
                        tracing::warn!(source = %source.origin, %reason, "dead-lettering an event minted ahead of every accepted clock");
                        dead.push(DeadLetter {
                            source,
                            kind: DeadLetterKind::AheadOfClock,
                            msg_id: Some(intent.msg_id),
                            order_id: Some(intent.order_id),
                            reason,
                        });
                    } else {
                        tracing::warn!(source = %source.origin, %reason, "parking an event the inbox cannot record yet; its order waits, the partition moves on");
                        applied.parked_future += 1;
                        parked_keys.insert(intent.order_id);
                        parking.push(park::ToPark {
                            intent,
                            source,
                            reason,
                        });
                    }
                }
                Some((Outside::Future, reason)) => {
                    tracing::warn!(source = %source.origin, %reason, "holding back a delivery the inbox cannot record yet");
                    applied.held.push(source.origin.into());
                }
                Some((outside, reason)) => {
                    dead.push(refuse_outside(
                        &mut applied,
                        intent,
                        source,
                        outside,
                        reason,
                    ));
                }
            }
        }
        intents = claimable;
        // A held webhook's claim stays unprocessed.
        for held in &applied.held {
            if let Held::Webhook { msg_id } = held {
                mine.remove(msg_id);
            }
        }
    }
    if !parking.is_empty() {
        let (new, conflicts) = park::park(&mut tx, &parking).await?;
        applied.parked = new;
        applied.msg_id_conflicts += conflicts.len() as u64;
        dead.extend(conflicts);
    }
    if let Some(window) = window.filter(|_| !intents.is_empty()) {
        let claim = claim_and_charge(pool, &mut tx, &window, &intents, crasher).await?;
        applied.charged = claim.new.len() as u64;
        applied.duplicates = claim.duplicates;
        applied.charge_conflicts = claim.order_conflicts.len() as u64;
        applied.msg_id_conflicts += claim.msg_id_conflicts.len() as u64;
        applied.new_msg_ids = claim.new;
        dead.extend(claim.msg_id_conflicts);
        dead.extend(claim.order_conflicts);
    }
    if !late.is_empty() {
        let charged = insert_effects_unguarded(&mut tx, &late).await?;
        applied.applied_after_horizon = late.len() as u64;
        applied.charged_after_horizon = charged.len() as u64;
    }
    if !dead.is_empty() {
        applied.dead_lettered = insert_dead_letters(&mut tx, &dead).await?;
    }
    // The charge is written, the inbox row too, nothing is committed: a crash
    // here must lose both together (and the redelivery redo both). Over HTTP
    // this is between the effect and the claims' processed mark, which the
    // same commit writes.
    crasher.point(CrashPoint::Effect);
    if !mine.is_empty() {
        let ids: Vec<Uuid> = mine.into_iter().collect();
        mark_webhooks(&mut tx, &ids).await?;
    }
    tx.commit().await?;
    Ok(applied)
}

/// What the claim found.
#[derive(Debug, Default)]
pub(crate) struct Claim<'a> {
    /// msg_ids claimed now.
    pub(crate) new: Vec<Uuid>,
    /// Deliveries of an already claimed msg_id with the same payload.
    pub(crate) duplicates: u64,
    /// Deliveries of a claimed msg_id with another payload.
    pub(crate) msg_id_conflicts: Vec<DeadLetter<'a>>,
    /// New msg_ids whose order was already charged.
    pub(crate) order_conflicts: Vec<DeadLetter<'a>>,
}

/// The dead letter of an event the inbox's window refuses for good
/// (`outside` is not [`Outside::Future`]: past the dedup horizon, or a
/// msg_id that can never have a partition), counted in `applied`. Shared by
/// the consume path and the parked events' drain.
pub(crate) fn refuse_outside<'a>(
    applied: &mut Applied,
    intent: &ChargeIntent,
    source: Source<'a>,
    outside: Outside,
    reason: String,
) -> DeadLetter<'a> {
    let kind = if outside == Outside::AfterHorizon {
        applied.after_horizon += 1;
        DeadLetterKind::AfterHorizon
    } else {
        applied.never_recordable += 1;
        DeadLetterKind::FutureMsgId
    };
    DeadLetter {
        source,
        kind,
        msg_id: Some(intent.msg_id),
        order_id: Some(intent.order_id),
        reason,
    }
}

/// The message the library's inbox claims for `intent`: its msg_id, and
/// payments' own fingerprint of its payload (`decode::payload_hash`, 8 bytes
/// big-endian, as the rows brought from payments' own inbox kept it).
pub(crate) fn message_of(intent: &ChargeIntent) -> Message {
    Message::v7_fingerprinted(intent.msg_id, &intent.payload_hash.to_be_bytes())
}

/// Inbox claim (the library's, in `window`, which `tx` has read), then
/// charges and ledger entries for the msg_ids that were new; every delivery
/// that was neither new nor a true duplicate is returned as a conflict.
pub(crate) async fn claim_and_charge<'a>(
    pool: &PgPool,
    tx: &mut Transaction<'_, Postgres>,
    window: &Window,
    intents: &[(&ChargeIntent, Source<'a>)],
    crasher: &Crasher,
) -> sqlx::Result<Claim<'a>> {
    let messages: Vec<Message> = intents.iter().map(|(i, _)| message_of(i)).collect();
    let claims = expiry::inbox(pool)
        .claim_in_window(tx, window, &messages)
        .await?;
    // The inbox rows are claimed, no charge yet: a crash here must not lose
    // the charge (it cannot: neither is committed).
    crasher.point(CrashPoint::Claim);
    let mut claim = Claim::default();
    let mut fresh = Vec::with_capacity(intents.len());
    for (&(intent, source), answer) in intents.iter().zip(claims) {
        let refused = |kind, reason| DeadLetter {
            source,
            kind,
            msg_id: Some(intent.msg_id),
            order_id: Some(intent.order_id),
            reason,
        };
        match answer {
            InboxClaim::New => fresh.push((intent, source)),
            InboxClaim::Duplicate => claim.duplicates += 1,
            InboxClaim::Conflict => claim.msg_id_conflicts.push(refused(
                DeadLetterKind::MsgIdConflict,
                format!(
                    "msg_id {} was already applied with another payload (this one's payload \
                     hash {:016x}); the first effect stands",
                    intent.msg_id, intent.payload_hash
                ),
            )),
            // The window was judged before the claim, under the lock that
            // keeps it: these do not come back from it. Refused, not lost.
            InboxClaim::TooOld => claim.msg_id_conflicts.push(refused(
                DeadLetterKind::AfterHorizon,
                format!("msg_id {} is below the inbox's partitions", intent.msg_id),
            )),
            InboxClaim::Early | InboxClaim::Unrecordable => claim.msg_id_conflicts.push(refused(
                DeadLetterKind::FutureMsgId,
                format!("msg_id {} is past the inbox's partitions", intent.msg_id),
            )),
        }
    }
    // Charges in msg_id order, as the claims were inserted.
    fresh.sort_by_key(|(i, _)| i.msg_id);
    claim.new = fresh.iter().map(|(i, _)| i.msg_id).collect();

    if !fresh.is_empty() {
        let inserted: HashSet<Uuid> = insert_effects(tx, &fresh).await?.into_iter().collect();
        let conflicting: Vec<(&ChargeIntent, Source<'a>)> = fresh
            .into_iter()
            .filter(|(i, _)| !inserted.contains(&i.msg_id))
            .collect();
        if !conflicting.is_empty() {
            let orders: Vec<Uuid> = conflicting.iter().map(|(i, _)| i.order_id).collect();
            let charged_by = charging_msg_ids(tx, &orders).await?;
            for (intent, source) in conflicting {
                let by = charged_by
                    .get(&intent.order_id)
                    .map_or_else(|| "another msg_id".to_owned(), Uuid::to_string);
                claim.order_conflicts.push(DeadLetter {
                    source,
                    kind: DeadLetterKind::OrderConflict,
                    msg_id: Some(intent.msg_id),
                    order_id: Some(intent.order_id),
                    reason: format!(
                        "order {} is already charged by msg_id {by}; this new msg_id {} \
                         (account {}, {} cents) is not applied",
                        intent.order_id, intent.msg_id, intent.account_id, intent.amount_cents
                    ),
                });
            }
        }
    }
    Ok(claim)
}

/// The first delivery of each msg_id, in msg_id order, and the later
/// deliveries of a msg_id already in the batch.
#[allow(clippy::type_complexity)]
pub(crate) fn unique_by_msg_id<'d, 'a>(
    intents: &[(&'d ChargeIntent, Source<'a>)],
) -> (
    Vec<(&'d ChargeIntent, Source<'a>)>,
    Vec<(&'d ChargeIntent, Source<'a>)>,
) {
    let mut unique = Vec::with_capacity(intents.len());
    let mut repeats = Vec::new();
    let mut seen = HashSet::with_capacity(intents.len());
    for &(intent, source) in intents {
        if seen.insert(intent.msg_id) {
            unique.push((intent, source));
        } else {
            repeats.push((intent, source));
        }
    }
    unique.sort_by_key(|(i, _)| i.msg_id);
    (unique, repeats)
}

/// Claims `unique` in the library's inbox in a transaction of their own
/// window; returns the msg_ids that were new. For the counter-example
/// (`crate::unsafe_split`), which claims apart from the effect.
pub(crate) async fn claim_inbox(
    pool: &PgPool,
    tx: &mut Transaction<'_, Postgres>,
    unique: &[(&ChargeIntent, Source<'_>)],
) -> sqlx::Result<Vec<Uuid>> {
    let messages: Vec<Message> = unique.iter().map(|(i, _)| message_of(i)).collect();
    let claims = expiry::inbox(pool).claim_batch(tx, &messages).await?;
    Ok(unique
        .iter()
        .zip(claims)
        .filter(|(_, c)| *c == InboxClaim::New)
        .map(|((i, _), _)| i.msg_id)
        .collect())
}

/// Which msg_id charged each of `orders`.
async fn charging_msg_ids(
    tx: &mut Transaction<'_, Postgres>,
    orders: &[Uuid],
) -> sqlx::Result<HashMap<Uuid, Uuid>> {
    let rows = sqlx::query!(
        "SELECT order_id, msg_id FROM payments.charges WHERE order_id = ANY($1)",
        orders
    )
    .fetch_all(&mut **tx)
    .await?;
    Ok(rows.into_iter().map(|r| (r.order_id, r.msg_id)).collect())
}

/// Writes the charge (guarded by UNIQUE(order_id)) and, for each charge
/// actually inserted, its ledger entry, in one statement; returns the msg_ids
/// whose charge was inserted.
pub async fn insert_effects(
    tx: &mut Transaction<'_, Postgres>,
    fresh: &[(&ChargeIntent, Source<'_>)],
) -> sqlx::Result<Vec<Uuid>> {
    let c = EffectColumns::of(fresh);
    sqlx::query_scalar!(
        "WITH c AS ( \
           INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents) \
           SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::int8[], $5::int8[]) \
           ON CONFLICT (order_id) DO NOTHING \
           RETURNING account_id, order_id, msg_id, amount_cents), \
         l AS ( \
           INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
           SELECT account_id, order_id, msg_id, amount_cents FROM c) \
         SELECT msg_id FROM c",
        &c.charge_ids,
        &c.order_ids,
        &c.msg_ids,
        &c.accounts,
        &c.amounts
    )
    .fetch_all(&mut **tx)
    .await
}

/// The charge keeps its UNIQUE guard; the ledger entry is written for every
/// intent regardless: the non-idempotent part of the effect. Only the
/// counter-examples write it: `--unsafe-split-txn`'s effect transaction
/// (`crate::unsafe_split`) and `--unsafe-apply-after-horizon` (see
/// [`AfterHorizon`]). It lives beside [`insert_effects`] so that the two
/// effect statements read side by side, and the counter-example depends on
/// the inbox, never the reverse.
pub(crate) async fn insert_effects_unguarded(
    tx: &mut Transaction<'_, Postgres>,
    fresh: &[(&ChargeIntent, Source<'_>)],
) -> sqlx::Result<Vec<Uuid>> {
    let c = EffectColumns::of(fresh);
    sqlx::query_scalar!(
        "WITH c AS ( \
           INSERT INTO payments.charges (charge_id, order_id, msg_id, account_id, amount_cents) \
           SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::int8[], $5::int8[]) \
           ON CONFLICT (order_id) DO NOTHING RETURNING msg_id), \
         l AS ( \
           INSERT INTO payments.ledger (account_id, order_id, msg_id, amount_cents) \
           SELECT * FROM unnest($4::int8[], $2::uuid[], $3::uuid[], $5::int8[])) \
         SELECT msg_id FROM c",
        &c.charge_ids,
        &c.order_ids,
        &c.msg_ids,
        &c.accounts,
        &c.amounts
    )
    .fetch_all(&mut **tx)
    .await
}

/// The columns of `fresh` as the effect statements bind them: $1 new charge
/// ids, $2 order ids, $3 msg ids, $4 accounts, $5 amounts.
pub(crate) struct EffectColumns {
    pub(crate) charge_ids: Vec<Uuid>,
    pub(crate) order_ids: Vec<Uuid>,
    pub(crate) msg_ids: Vec<Uuid>,
    pub(crate) accounts: Vec<i64>,
    pub(crate) amounts: Vec<i64>,
}

impl EffectColumns {
    /// The columns of `fresh`, each charge with a new id.
    pub(crate) fn of(fresh: &[(&ChargeIntent, Source<'_>)]) -> Self {
        Self {
            charge_ids: fresh.iter().map(|_| Uuid::now_v7()).collect(),
            order_ids: fresh.iter().map(|(i, _)| i.order_id).collect(),
            msg_ids: fresh.iter().map(|(i, _)| i.msg_id).collect(),
            accounts: fresh.iter().map(|(i, _)| i.account_id).collect(),
            amounts: fresh.iter().map(|(i, _)| i.amount_cents).collect(),
        }
    }
}

/// Locks the rows of `msg_ids` in `payments.webhook_inbox` that are not
/// processed yet, skipping rows another transaction holds; returns the
/// msg_ids locked.
async fn lock_webhooks(
    tx: &mut Transaction<'_, Postgres>,
    msg_ids: &[Uuid],
) -> sqlx::Result<HashSet<Uuid>> {
    let locked = sqlx::query_scalar!(
        "SELECT msg_id FROM payments.webhook_inbox \
         WHERE msg_id = ANY($1) AND processed_at IS NULL \
         ORDER BY msg_id FOR UPDATE SKIP LOCKED",
        msg_ids
    )
    .fetch_all(&mut **tx)
    .await?;
    Ok(locked.into_iter().collect())
}

/// Marks webhooks processed.
async fn mark_webhooks(tx: &mut Transaction<'_, Postgres>, msg_ids: &[Uuid]) -> sqlx::Result<()> {
    sqlx::query!(
        "UPDATE payments.webhook_inbox SET processed_at = now() \
         WHERE msg_id = ANY($1) AND processed_at IS NULL",
        msg_ids
    )
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Writes dead letters (a redelivered one, same topic/partition/offset or
/// same webhook and kind, is not written twice); returns the kinds of those
/// written. The reason is made storable here, the one place every reason
/// passes: a reason quoting a NUL or invalid UTF-8 must never make the write
/// that records it fail.
pub(crate) async fn insert_dead_letters(
    tx: &mut Transaction<'_, Postgres>,
    dead: &[DeadLetter<'_>],
) -> sqlx::Result<Vec<DeadLetterKind>> {
    let mut written = Vec::with_capacity(dead.len());
    for d in dead {
        let insert = match d.source.origin {
            Origin::Kafka {
                topic,
                partition,
                offset,
            } => sqlx::query!(
                "INSERT INTO payments.dead_letters \
                   (topic, partition, \"offset\", msg_key, payload, reason, kind, msg_id, order_id) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                 ON CONFLICT (topic, partition, \"offset\") DO NOTHING",
                storable(topic),
                partition,
                offset,
                d.source.key,
                d.source.payload,
                storable(&d.reason),
                d.kind.as_str(),
                d.msg_id,
                d.order_id
            )
            .execute(&mut **tx),
            Origin::Webhook { msg_id } => sqlx::query!(
                "INSERT INTO payments.dead_letters \
                   (transport, msg_key, payload, reason, kind, msg_id, order_id) \
                 VALUES ('http', $1, $2, $3, $4, $5, $6) \
                 ON CONFLICT (msg_id, kind) WHERE transport = 'http' DO NOTHING",
                d.source.key,
                d.source.payload,
                storable(&d.reason),
                d.kind.as_str(),
                msg_id,
                d.order_id
            )
            .execute(&mut **tx),
        };
        let inserted = insert.await?.rows_affected();
        if inserted > 0 {
            written.push(d.kind);
        }
    }
    Ok(written)
}

/// Dead-letters one message the database refused to apply, in a transaction
/// of its own. `intent` is what the message says, when it decoded; `error`
/// is the database's reason.
pub async fn reject(
    pool: &PgPool,
    source: Source<'_>,
    intent: Option<&ChargeIntent>,
    error: &str,
) -> sqlx::Result<bool> {
    let dead = DeadLetter {
        source,
        kind: DeadLetterKind::Rejected,
        msg_id: intent.map(|i| i.msg_id),
        order_id: intent.map(|i| i.order_id),
        reason: format!("the database refused to apply this message: {error}"),
    };
    let mut tx = pool.begin().await?;
    let written = insert_dead_letters(&mut tx, &[dead]).await?;
    if let Some(msg_id) = source.webhook_id() {
        mark_webhooks(&mut tx, &[msg_id]).await?;
    }
    tx.commit().await?;
    Ok(!written.is_empty())
}
