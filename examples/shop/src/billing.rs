//! Billing: consumes the checkouts' events and invoices each one once.

use effectively::store::{Handler, HandlerError, Record};
use serde::Deserialize;

#[derive(Deserialize)]
struct Completed {
    checkout: i64,
    total: i32,
}

/// Writes the invoice in the inbox claim's transaction.
pub(crate) fn handler() -> &'static Handler {
    &|tx, record: &Record| {
        Box::pin(async move {
            let event: Completed = serde_json::from_slice(&record.payload)
                .map_err(|e| HandlerError::Reject(format!("not a checkout.completed: {e}")))?;
            sqlx::query("INSERT INTO billing.invoices (checkout_id, total) VALUES ($1, $2)")
                .bind(event.checkout)
                .bind(event.total)
                .execute(&mut *tx)
                .await?;
            Ok(())
        })
    }
}
