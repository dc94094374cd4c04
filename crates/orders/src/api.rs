//! The create-order operation, shared by the HTTP and gRPC front ends so both
//! have one semantics: validation, fingerprint, the stored response.

use std::sync::Arc;

use effectively::contract::OrderStatus;
use effectively::idempotency::{Claim, Fingerprint, IdempotencyKey, StoredResponse};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::ApiError;
use crate::metrics::OrdersMetrics;
use crate::store::{OrderRow, Store};

/// Largest accepted amount: 10,000,000,000 cents (100M in currency units).
pub const MAX_AMOUNT_CENTS: i64 = 10_000_000_000;
/// Status of a freshly created order.
pub const ORDER_STATUS_CREATED: &str = OrderStatus::Created.as_str();
/// Fingerprint context: bump the version if the canonical form changes.
const FINGERPRINT_CONTEXT: &str = "effectively orders.create v1";

/// A create-order request, whatever protocol carried it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateOrder {
    /// Account to charge (> 0).
    pub account_id: i64,
    /// Amount in cents (1..=[`MAX_AMOUNT_CENTS`]).
    pub amount_cents: i64,
}

impl CreateOrder {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), ApiError> {
        if self.account_id <= 0 {
            return Err(ApiError::InvalidRequest(
                "account_id must be a positive integer".into(),
            ));
        }
        if !(1..=MAX_AMOUNT_CENTS).contains(&self.amount_cents) {
            return Err(ApiError::InvalidRequest(format!(
                "amount_cents must be between 1 and {MAX_AMOUNT_CENTS}"
            )));
        }
        Ok(())
    }

    /// Hash of the canonical form: the typed fields in a fixed order. Two
    /// requests that differ only in JSON whitespace, key order or protocol
    /// have the same fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        let mut canonical = [0u8; 16];
        canonical[..8].copy_from_slice(&self.account_id.to_be_bytes());
        canonical[8..].copy_from_slice(&self.amount_cents.to_be_bytes());
        Fingerprint::new(FINGERPRINT_CONTEXT, &canonical)
    }
}

/// The JSON body of a created order (201).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatedBody {
    /// New order id.
    pub order_id: Uuid,
    /// Its status.
    pub status: String,
}

/// The response a first create gets, and every retry after it: status 201,
/// `Location`, an `ETag` over the body, and the body. Stored in the HTTP form
/// whatever protocol carried the request.
pub fn created_response(order_id: Uuid) -> Result<StoredResponse, ApiError> {
    let body = serde_json::to_vec(&CreatedBody {
        order_id,
        status: ORDER_STATUS_CREATED.to_owned(),
    })
    .map_err(|e| ApiError::Internal(e.into()))?;
    let etag = format!("\"{}\"", &blake3::hash(&body).to_hex()[..32]);
    Ok(StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), format!("/orders/{order_id}")),
            ("etag".into(), etag),
        ],
        body,
    })
}

/// The operations both front ends call.
#[derive(Debug, Clone)]
pub struct OrdersApi {
    store: Store,
    metrics: Arc<OrdersMetrics>,
}

impl OrdersApi {
    /// Wires the store and the metrics.
    pub fn new(store: Store, metrics: Arc<OrdersMetrics>) -> Self {
        Self { store, metrics }
    }

    /// The metrics.
    pub fn metrics(&self) -> &OrdersMetrics {
        &self.metrics
    }

    /// Creates an order idempotently; returns the response to give (the new
    /// one, or the stored one on a replay).
    pub async fn create(
        &self,
        key: &IdempotencyKey,
        request: &CreateOrder,
    ) -> Result<StoredResponse, ApiError> {
        request.validate()?;
        let order_id = Uuid::now_v7();
        let response = created_response(order_id)?;
        let claim = self
            .store
            .create(key, &request.fingerprint(), request, order_id, &response)
            .await?;
        let outcome = match &claim {
            Claim::New => "new",
            Claim::Replay { .. } => "replay",
            Claim::Mismatch => "mismatch",
        };
        self.metrics
            .idempotency_outcomes_total
            .with_label_values(&[outcome])
            .inc();
        match claim {
            Claim::New => Ok(response),
            Claim::Replay { response, .. } => Ok(response),
            Claim::Mismatch => Err(ApiError::KeyReused),
        }
    }

    /// Reads one order.
    pub async fn get(&self, order_id: Uuid) -> Result<OrderRow, ApiError> {
        self.store
            .get(order_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("no order {order_id}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_depends_on_every_field() {
        let a = CreateOrder {
            account_id: 1,
            amount_cents: 2,
        };
        let b = CreateOrder {
            account_id: 2,
            amount_cents: 1,
        };
        assert_eq!(a.fingerprint(), a.fingerprint());
        assert_ne!(a.fingerprint(), b.fingerprint());
    }

    #[test]
    fn validation_bounds() {
        let ok = |account_id, amount_cents| {
            CreateOrder {
                account_id,
                amount_cents,
            }
            .validate()
            .is_ok()
        };
        assert!(ok(1, 1));
        assert!(ok(1, MAX_AMOUNT_CENTS));
        assert!(!ok(0, 1));
        assert!(!ok(-1, 1));
        assert!(!ok(1, 0));
        assert!(!ok(1, MAX_AMOUNT_CENTS + 1));
    }

    #[test]
    fn created_response_is_deterministic() {
        let id = Uuid::now_v7();
        let a = created_response(id).expect("response");
        assert_eq!(a, created_response(id).expect("response"));
        assert_eq!(a.status, 201);
        assert_eq!(a.header("location"), Some(format!("/orders/{id}").as_str()));
        let body: CreatedBody = serde_json::from_slice(&a.body).expect("json");
        assert_eq!(body.order_id, id);
    }
}
