//! DELIBERATELY WRONG, for the counter-example only (`--unsafe-split-txn`):
//! the inbox row and the effect in TWO transactions, the dual-write bug the
//! safe consumer (inbox.rs) exists to avoid. A crash between the two
//! transactions (crash point `split`) then breaks the invariant, reproducibly:
//!
//! * `inbox-first`: the inbox row commits, the crash loses the effect, and the
//!   redelivery finds the msg_id in the inbox and skips it: a LOST effect.
//! * `effect-first`: the charge and its ledger entry commit, the crash loses
//!   the inbox row, and the redelivery applies the effect again: the UNIQUE on
//!   charges refuses a second charge row, but the ledger entry (a
//!   non-idempotent effect, like a balance update) is written twice: a DOUBLE
//!   effect, which recon counts.

use pipeline::contract::{CrashPoint, SplitTxn};
use pipeline::crash::Crasher;
use sqlx::PgPool;
use uuid::Uuid;

use crate::delivery::{Applied, ChargeIntent, Delivery, Source};
use crate::inbox::{
    claim_inbox, insert_dead_letters, insert_effects, insert_effects_unguarded, split,
    unique_by_msg_id,
};

/// Applies a batch the wrong way; see the module docs. (Conflicting
/// redeliveries are counted as duplicates here: this path exists to show
/// the split, nothing else.)
pub async fn apply_batch(
    pool: &PgPool,
    mode: SplitTxn,
    deliveries: &[Delivery<'_>],
    crasher: &Crasher,
) -> sqlx::Result<Applied> {
    let (intents, dead) = split(deliveries);
    let (unique, _) = unique_by_msg_id(&intents);
    let mut applied = Applied::default();
    match mode {
        SplitTxn::InboxFirst => {
            let mut tx = pool.begin().await?;
            let new = claim_inbox(pool, &mut tx, &unique).await?;
            tx.commit().await?;
            crasher.point(CrashPoint::Split);
            let fresh: Vec<(&ChargeIntent, Source<'_>)> = unique
                .into_iter()
                .filter(|(i, _)| new.contains(&i.msg_id))
                .collect();
            let mut tx = pool.begin().await?;
            let charged = insert_effects(&mut tx, &fresh).await?;
            applied.dead_lettered = insert_dead_letters(&mut tx, &dead).await?;
            tx.commit().await?;
            applied.charged = fresh.len() as u64;
            applied.charge_conflicts = applied.charged - charged.len() as u64;
            applied.new_msg_ids = new;
        }
        SplitTxn::EffectFirst => {
            let msg_ids: Vec<Uuid> = unique.iter().map(|(i, _)| i.msg_id).collect();
            let mut tx = pool.begin().await?;
            let seen: Vec<Uuid> = sqlx::query_scalar!(
                "SELECT msg_id FROM fx.partitioned_inbox WHERE consumer = $1 AND msg_id = ANY($2)",
                crate::expiry::CONSUMER,
                &msg_ids
            )
            .fetch_all(&mut *tx)
            .await?;
            let fresh: Vec<(&ChargeIntent, Source<'_>)> = unique
                .into_iter()
                .filter(|(i, _)| !seen.contains(&i.msg_id))
                .collect();
            let charged = insert_effects_unguarded(&mut tx, &fresh).await?;
            applied.dead_lettered = insert_dead_letters(&mut tx, &dead).await?;
            tx.commit().await?;
            crasher.point(CrashPoint::Split);
            let mut tx = pool.begin().await?;
            let new = claim_inbox(pool, &mut tx, &fresh).await?;
            tx.commit().await?;
            applied.charged = fresh.len() as u64;
            applied.charge_conflicts = applied.charged - charged.len() as u64;
            applied.new_msg_ids = new;
        }
    }
    applied.duplicates = intents.len() as u64 - applied.charged;
    Ok(applied)
}
