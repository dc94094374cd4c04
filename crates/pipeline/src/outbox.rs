//! The transactional outbox, write side.
//!
//! The caller inserts its business row and calls [`Outbox::enqueue_batch`] in the
//! same transaction: the event exists if and only if the business change
//! committed. Nothing is published here; a relay reads pending rows after the
//! commit. A statement-level trigger on the table (see the migrations) issues
//! a `NOTIFY` on [`NOTIFY_CHANNEL`] that Postgres delivers on commit, so the
//! relay wakes without polling hard.
//!
//! A `NOTIFY` takes one lock per database from before the commit record is
//! written until the transaction ends, so the commits that notify run one at
//! a time, each with its WAL flush. A service that commits outbox rows from
//! many sessions at a high rate (Orders) turns the trigger's `NOTIFY` off in
//! its sessions ([`NOTIFY_SETTING`], `SessionLimits::defer_outbox_notify`)
//! and wakes the relay with a [`Notifier`] instead: one `NOTIFY` at a time,
//! in a transaction of its own, outside its write transactions (FINDINGS §14).

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The channel the outbox trigger notifies on commit.
pub const NOTIFY_CHANNEL: &str = "orders_outbox";

/// Every relay shard, as a [`Notifier`] payload's mask: bit `s` is shard `s`
/// (`orders.outbox.shard`, 0..16).
pub const ALL_SHARDS: u16 = u16::MAX;

/// A `NOTIFY` payload naming the shards that got rows: four hex digits of
/// their mask (`0028`: shards 3 and 5).
pub fn shards_payload(mask: u16) -> String {
    format!("{mask:04x}")
}

/// The shards a `NOTIFY` payload names. The trigger's empty payload, and
/// anything that is not a mask of [`shards_payload`]'s, name every shard:
/// a wake-up is a hint, and one too many costs a claim that finds nothing.
pub fn shards_of_payload(payload: &str) -> u16 {
    match u16::from_str_radix(payload, 16) {
        Ok(mask) if mask != 0 && payload.len() == 4 => mask,
        _ => ALL_SHARDS,
    }
}

/// The session setting that turns the outbox trigger's `NOTIFY` off for the
/// session's own inserts (`off`); anything else, or unset, leaves it on.
pub const NOTIFY_SETTING: &str = "effectively.outbox_notify";

/// Wakes the relay for outbox rows committed with the trigger's `NOTIFY` off
/// ([`NOTIFY_SETTING`]): after a commit, [`Notifier::wake`]; a task sends one
/// `NOTIFY` in its own transaction, then waits [`Notifier::SPACING`]. Wake-ups
/// meanwhile fold into the next `NOTIFY`: a busy relay needs no more than one
/// per pass, an idle one gets the first at once. A lost `NOTIFY` (the database
/// away, a crash after the commit) costs latency only: the relay polls too.
#[derive(Debug, Clone)]
pub struct Notifier {
    wake: Arc<Notify>,
    /// The shards of the rows committed since the last `NOTIFY`.
    shards: Arc<AtomicU16>,
}

impl Notifier {
    /// The shortest time between two `NOTIFY`s.
    pub const SPACING: Duration = Duration::from_millis(5);

    /// Starts the notifying task on `pool`; it ends when `cancel` fires.
    pub fn start(pool: PgPool, cancel: CancellationToken) -> (Self, JoinHandle<()>) {
        let wake = Arc::new(Notify::new());
        let shards = Arc::new(AtomicU16::new(0));
        let task = tokio::spawn(notify_loop(pool, wake.clone(), shards.clone(), cancel));
        (Self { wake, shards }, task)
    }

    /// Rows were committed, of which shards is not known: every shard of the
    /// relay is to be woken.
    pub fn wake(&self) {
        self.wake_shards(ALL_SHARDS);
    }

    /// Rows were committed in the shards of `mask` (bit `s`: shard `s`): the
    /// relay's loops of those shards are to be woken. The next `NOTIFY`
    /// names every shard woken since the last one.
    pub fn wake_shards(&self, mask: u16) {
        if mask != 0 {
            self.shards.fetch_or(mask, Ordering::AcqRel);
            self.wake.notify_one();
        }
    }
}

async fn notify_loop(
    pool: PgPool,
    wake: Arc<Notify>,
    shards: Arc<AtomicU16>,
    cancel: CancellationToken,
) {
    loop {
        // A wake-up before the cancel is still sent: the last commits'.
        tokio::select! {
            biased;
            () = wake.notified() => {}
            () = cancel.cancelled() => return,
        }
        // Nothing new: the previous NOTIFY took these shards already.
        let mask = shards.swap(0, Ordering::AcqRel);
        if mask == 0 {
            continue;
        }
        let sent = sqlx::query!(
            "SELECT pg_notify($1, $2)",
            NOTIFY_CHANNEL,
            shards_payload(mask)
        )
        .execute(&pool)
        .await;
        if let Err(error) = sent {
            tracing::warn!(%error, "NOTIFY of the outbox failed; the relay finds the rows when it polls");
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(Notifier::SPACING) => {}
        }
    }
}

/// One event to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// The entity the event is about; the Kafka message key, so one entity's
    /// events stay on one partition, in order.
    pub aggregate_id: Uuid,
    /// Stable identity of this event, carried to consumers for deduplication.
    /// A re-publish keeps it; a Kafka offset would not.
    pub msg_id: Uuid,
    /// Event type, e.g. `order.created`.
    pub event_type: String,
    /// Event body (JSON bytes for the events of this project).
    pub payload: Vec<u8>,
}

/// The outbox table `orders.outbox` (columns in `migrations/*_orders.sql`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Outbox;

impl Outbox {
    /// Appends many messages in one statement inside the caller's
    /// transaction, in slice order (their ids, the publish order, follow it).
    pub async fn enqueue_batch(
        &self,
        conn: &mut PgConnection,
        messages: &[OutboxMessage],
    ) -> Result<u64, sqlx::Error> {
        let aggregates: Vec<Uuid> = messages.iter().map(|m| m.aggregate_id).collect();
        let msg_ids: Vec<Uuid> = messages.iter().map(|m| m.msg_id).collect();
        let types: Vec<&str> = messages.iter().map(|m| m.event_type.as_str()).collect();
        let payloads: Vec<&[u8]> = messages.iter().map(|m| m.payload.as_slice()).collect();
        // Rows go in array order, so their ids (the publish order) follow it.
        Ok(sqlx::query!(
            "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::bytea[])",
            &aggregates,
            &msg_ids,
            &types as &[&str],
            &payloads as &[&[u8]],
        )
        .execute(conn)
        .await?
        .rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_names_its_shards_and_anything_else_names_every_shard() {
        assert_eq!(shards_payload(0x0028), "0028");
        assert_eq!(shards_of_payload(&shards_payload(0x0028)), 0x0028);
        assert_eq!(shards_of_payload(&shards_payload(1)), 1);
        assert_eq!(shards_of_payload(&shards_payload(ALL_SHARDS)), ALL_SHARDS);
        for other in ["", "0000", "28", "00028", "zz00", "-001", " 028"] {
            assert_eq!(shards_of_payload(other), ALL_SHARDS, "{other:?}");
        }
    }
}
