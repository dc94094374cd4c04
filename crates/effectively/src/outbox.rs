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
use std::time::Duration;

use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The channel the outbox trigger notifies on commit.
pub const NOTIFY_CHANNEL: &str = "orders_outbox";

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
}

impl Notifier {
    /// The shortest time between two `NOTIFY`s.
    pub const SPACING: Duration = Duration::from_millis(5);

    /// Starts the notifying task on `pool`; it ends when `cancel` fires.
    pub fn start(pool: PgPool, cancel: CancellationToken) -> (Self, JoinHandle<()>) {
        let wake = Arc::new(Notify::new());
        let task = tokio::spawn(notify_loop(pool, wake.clone(), cancel));
        (Self { wake }, task)
    }

    /// Rows were committed: the relay is to be woken.
    pub fn wake(&self) {
        self.wake.notify_one();
    }
}

async fn notify_loop(pool: PgPool, wake: Arc<Notify>, cancel: CancellationToken) {
    loop {
        // A wake-up before the cancel is still sent: the last commits'.
        tokio::select! {
            biased;
            () = wake.notified() => {}
            () = cancel.cancelled() => return,
        }
        let sent = sqlx::query!("SELECT pg_notify($1, '')", NOTIFY_CHANNEL)
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
