//! The transactional outbox, write side.
//!
//! The caller inserts its business row and calls [`Outbox::enqueue_batch`] in the
//! same transaction: the event exists if and only if the business change
//! committed. Nothing is published here; a relay reads pending rows after the
//! commit. A statement-level trigger on the table (see the migration) issues a
//! `NOTIFY` on [`NOTIFY_CHANNEL`] that Postgres delivers on commit, so the
//! relay wakes without polling hard.

use sqlx::PgConnection;
use uuid::Uuid;

/// The channel the outbox trigger notifies on commit.
pub const NOTIFY_CHANNEL: &str = "orders_outbox";

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
