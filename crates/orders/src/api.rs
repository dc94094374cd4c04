//! The create-order operation, shared by the HTTP and gRPC front ends so both
//! have one semantics: validation, fingerprint, the stored response. The
//! store's and the writer's errors become [`ApiError`]s here.

use std::sync::Arc;

use effectively::store::KeyClaim;
use pipeline::idempotency::{IdempotencyKey, StoredResponse};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::auth::{Authenticator, Caller};
use crate::error::ApiError;
use crate::metrics::OrdersMetrics;
use crate::order::{CreateOrder, NewOrder};
use crate::store::{Create, OrderRow, ScopedKey, Store};
use crate::writer::WriteQueue;

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
/// whatever protocol carried the request. Built by the contract's
/// [`pipeline::contract::created_response`], which recon checks the
/// stored responses against.
pub fn created_response(order_id: Uuid) -> StoredResponse {
    pipeline::contract::created_response(order_id)
}

/// The operations both front ends call.
#[derive(Debug, Clone)]
pub struct OrdersApi {
    store: Arc<Store>,
    writes: WriteQueue,
    metrics: Arc<OrdersMetrics>,
    auth: Arc<Authenticator>,
}

impl OrdersApi {
    /// Wires the store (reads), the writers' queue (creates) and the
    /// metrics; every caller anonymous until [`Self::with_auth`].
    pub fn new(store: Arc<Store>, writes: WriteQueue, metrics: Arc<OrdersMetrics>) -> Self {
        Self {
            store,
            writes,
            metrics,
            auth: Arc::new(Authenticator::off()),
        }
    }

    /// Who may call: requests authenticate against `auth`.
    pub fn with_auth(mut self, auth: Arc<Authenticator>) -> Self {
        self.auth = auth;
        self
    }

    /// The caller of a request whose `Authorization` value (HTTP header,
    /// gRPC metadata) is `authorization`; a refusal is counted by reason.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Caller, ApiError> {
        self.auth.authenticate(authorization).map_err(|reason| {
            self.metrics
                .auth_refusals_total
                .with_label_values(&[reason.label()])
                .inc();
            ApiError::Unauthenticated(reason)
        })
    }

    /// The metrics.
    pub fn metrics(&self) -> &OrdersMetrics {
        &self.metrics
    }

    /// Creates an order idempotently for `caller` (its key in the caller's
    /// scope); returns the response to give (the new one, or the stored one
    /// on a replay).
    pub async fn create(
        &self,
        caller: &Caller,
        key: &IdempotencyKey,
        request: &CreateOrder,
    ) -> Result<StoredResponse, ApiError> {
        let order = NewOrder::new(request)?;
        let response = created_response(order.order_id());
        let create = Create {
            key: ScopedKey {
                caller: caller.clone(),
                key: key.clone(),
            },
            fingerprint: request.fingerprint(),
            order,
            response: response.clone(),
        };
        let claim = self.writes.create(create).await?;
        let outcome = match &claim {
            KeyClaim::New => "new",
            KeyClaim::Replay(_) => "replay",
            // Orders stores every key's response at its claim: a key without
            // one was claimed by something else; it is not this request's.
            KeyClaim::Mismatch | KeyClaim::Unfinished => "mismatch",
        };
        self.metrics
            .idempotency_outcomes_total
            .with_label_values(&[outcome])
            .inc();
        match claim {
            KeyClaim::New => Ok(response),
            KeyClaim::Replay(response) => Ok(response),
            KeyClaim::Mismatch | KeyClaim::Unfinished => Err(ApiError::KeyReused),
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
    use crate::order::ORDER_STATUS_CREATED;

    #[test]
    fn created_response_is_deterministic() {
        let id = Uuid::now_v7();
        let a = created_response(id);
        assert_eq!(a, created_response(id));
        assert_eq!(a.status, 201);
        assert_eq!(a.header("location"), Some(format!("/orders/{id}").as_str()));
        let body: CreatedBody = serde_json::from_slice(&a.body).expect("json");
        assert_eq!(body.order_id, id);
        // The bytes serde writes for the body type (those orders stored
        // before the contract built them), and the ETag over them.
        let serialized = serde_json::to_vec(&CreatedBody {
            order_id: id,
            status: ORDER_STATUS_CREATED.to_owned(),
        })
        .expect("json");
        assert_eq!(a.body, serialized);
        assert_eq!(
            a.header("etag"),
            Some(format!("\"{}\"", &blake3::hash(&serialized).to_hex()[..32]).as_str())
        );
    }
}
