//! The write path: idempotency key, order and outbox row in ONE transaction.
//!
//! This is one of the two places where correctness lives (the other is the
//! Payments inbox). One `begin`, one `commit`: the key, the order and the
//! event commit together or not at all. So
//! * a committed order always has its event in the outbox (no lost publish:
//!   nothing is published here, the relay reads the outbox after commit);
//! * a failed request leaves no key behind, and its retry can succeed;
//! * a retry finds the key and gets the first response, with nothing written.

use chrono::{DateTime, Utc};
use effectively::idempotency::{Claim, Fingerprint, IdempotencyKey, IdempotencyStore};
use effectively::outbox::{Outbox, OutboxMessage};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::api::{CreateOrder, ORDER_CREATED_EVENT, ORDER_STATUS_CREATED};
use crate::error::ApiError;

/// A failure to inject inside the write transaction, for tests and chaos runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InjectFault {
    /// No fault.
    #[default]
    None,
    /// Fail after the order insert, before the outbox insert and the commit.
    AfterOrderInsert,
}

/// An order as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct OrderRow {
    /// Order id.
    pub order_id: Uuid,
    /// Account charged.
    pub account_id: i64,
    /// Amount in cents.
    pub amount_cents: i64,
    /// Status.
    pub status: String,
    /// When the order was created.
    pub created_at: DateTime<Utc>,
}

/// The body of an `order.created` event.
#[derive(Debug, Serialize)]
struct OrderCreatedPayload<'a> {
    order_id: Uuid,
    account_id: i64,
    amount_cents: i64,
    status: &'a str,
}

/// The Orders tables.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    keys: IdempotencyStore,
    outbox: Outbox,
    fault: InjectFault,
}

impl Store {
    /// A store on `pool`, failing at `fault` when asked.
    pub fn new(pool: PgPool, fault: InjectFault) -> Self {
        Self {
            pool,
            keys: IdempotencyStore::default(),
            outbox: Outbox::default(),
            fault,
        }
    }

    /// Creates the order for `key` unless the key was used before.
    ///
    /// `response` is what the first request answers; it is stored with the key
    /// in the same transaction, so every replay returns exactly it.
    pub async fn create(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        request: &CreateOrder,
        order_id: Uuid,
        response: &effectively::idempotency::StoredResponse,
    ) -> Result<Claim, ApiError> {
        let mut tx = self.pool.begin().await?;
        let claim = self
            .keys
            .claim(&mut tx, key, fingerprint, order_id, response)
            .await?;
        if claim != Claim::New {
            // Nothing was written; dropping the transaction rolls it back.
            return Ok(claim);
        }
        insert_order(&mut tx, order_id, request).await?;
        if self.fault == InjectFault::AfterOrderInsert {
            return Err(ApiError::Internal(anyhow::anyhow!(
                "injected fault after the order insert"
            )));
        }
        let payload = serde_json::to_vec(&OrderCreatedPayload {
            order_id,
            account_id: request.account_id,
            amount_cents: request.amount_cents,
            status: ORDER_STATUS_CREATED,
        })
        .map_err(|e| ApiError::Internal(e.into()))?;
        let event = OutboxMessage {
            aggregate_id: order_id,
            msg_id: Uuid::now_v7(),
            event_type: ORDER_CREATED_EVENT.to_owned(),
            payload,
        };
        self.outbox.enqueue(&mut tx, &event).await?;
        tx.commit().await?;
        Ok(Claim::New)
    }

    /// Reads one order.
    pub async fn get(&self, order_id: Uuid) -> Result<Option<OrderRow>, ApiError> {
        Ok(sqlx::query_as(
            "SELECT order_id, account_id, amount_cents, status, created_at \
             FROM orders.orders WHERE order_id = $1",
        )
        .bind(order_id)
        .fetch_optional(&self.pool)
        .await?)
    }
}

async fn insert_order(
    conn: &mut PgConnection,
    order_id: Uuid,
    request: &CreateOrder,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO orders.orders (order_id, account_id, amount_cents, status) \
         VALUES ($1, $2, $3, $4)",
    )
    .bind(order_id)
    .bind(request.account_id)
    .bind(request.amount_cents)
    .bind(ORDER_STATUS_CREATED)
    .execute(conn)
    .await?;
    Ok(())
}
