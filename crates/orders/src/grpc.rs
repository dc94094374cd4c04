//! gRPC front end (tonic): `orders.v1.Orders`, same semantics as HTTP.

use std::time::Instant;

use pipeline::contract::IDEMPOTENCY_KEY;
use pipeline::idempotency::{IdempotencyKey, KeyError};
use tonic::{Request, Response, Status};
use uuid::Uuid;

use crate::api::{CreatedBody, OrdersApi};
use crate::error::ApiError;
use crate::order::CreateOrder;
use crate::proto;
use crate::proto::orders_server::Orders;

/// The tonic service.
#[derive(Debug, Clone)]
pub struct OrdersGrpc {
    api: OrdersApi,
}

impl OrdersGrpc {
    /// Wraps the shared API.
    pub fn new(api: OrdersApi) -> Self {
        Self { api }
    }

    fn observe<T>(&self, method: &str, start: Instant, result: &Result<T, Status>) {
        let code = match result {
            Ok(_) => tonic::Code::Ok,
            Err(status) => status.code(),
        };
        let metrics = self.api.metrics();
        metrics
            .grpc_requests_total
            .with_label_values(&[method, &format!("{code:?}")])
            .inc();
        metrics
            .grpc_request_duration_seconds
            .with_label_values(&[method])
            .observe(start.elapsed().as_secs_f64());
    }

    /// The caller of a call, from its `authorization` metadata.
    fn authenticate(
        &self,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<crate::auth::Caller, ApiError> {
        self.api
            .authenticate(metadata.get("authorization").map(|v| v.as_bytes()))
    }

    async fn create_inner(
        &self,
        request: Request<proto::CreateOrderRequest>,
    ) -> Result<proto::CreateOrderResponse, ApiError> {
        let caller = self.authenticate(request.metadata())?;
        let key = request
            .metadata()
            .get(IDEMPOTENCY_KEY)
            .ok_or(ApiError::InvalidKey(KeyError::Missing))
            .and_then(|raw| Ok(IdempotencyKey::parse(raw.as_bytes())?))?;
        let message = request.into_inner();
        let create = CreateOrder {
            account_id: message.account_id,
            amount_cents: message.amount_cents,
        };
        let stored = self.api.create(&caller, &key, &create).await?;
        // Stored in the HTTP form (whichever protocol came first); the body
        // is the same JSON either way.
        let body: CreatedBody = serde_json::from_slice(&stored.body)
            .map_err(|e| ApiError::Internal(anyhow::Error::new(e).context("decode stored body")))?;
        Ok(proto::CreateOrderResponse {
            order_id: body.order_id.to_string(),
            status: body.status,
        })
    }
}

#[tonic::async_trait]
impl Orders for OrdersGrpc {
    async fn create(
        &self,
        request: Request<proto::CreateOrderRequest>,
    ) -> Result<Response<proto::CreateOrderResponse>, Status> {
        let start = Instant::now();
        let result = self
            .create_inner(request)
            .await
            .map(Response::new)
            .map_err(Status::from);
        self.observe("Create", start, &result);
        result
    }

    async fn get(
        &self,
        request: Request<proto::GetOrderRequest>,
    ) -> Result<Response<proto::Order>, Status> {
        let start = Instant::now();
        let caller = self.authenticate(request.metadata());
        let id = request.into_inner().order_id;
        let result = match (caller, Uuid::parse_str(&id)) {
            (Err(error), _) => Err(error),
            (Ok(_), Err(_)) => Err(ApiError::NotFound(format!("no order {id}"))),
            (Ok(_), Ok(order_id)) => self.api.get(order_id).await,
        }
        .map(|o| {
            Response::new(proto::Order {
                order_id: o.order_id.to_string(),
                account_id: o.account_id,
                amount_cents: o.amount_cents,
                status: o.status,
                created_at: o.created_at.to_rfc3339(),
            })
        })
        .map_err(Status::from);
        self.observe("Get", start, &result);
        result
    }
}
