//! The shop's route: `POST /carts/{cart}/checkout` with an `Idempotency-Key`
//! and a JSON body `{"total": cents}`. The checkout row, its event and the
//! key's stored answer commit in one transaction.

use axum::extract::Path;
use axum::response::Response;
use effectively::store::{Effectively, Event, Idempotent, StoredResponse};
use serde::Deserialize;

#[derive(Deserialize)]
struct Checkout {
    total: i32,
}

/// The route's handler.
pub(crate) async fn checkout(
    axum::extract::State(shop): axum::extract::State<Shop>,
    Path(cart): Path<i32>,
    request: Idempotent,
) -> Response {
    request
        .run(|tx, body| {
            Box::pin(async move {
                let checkout: Checkout = serde_json::from_slice(body)
                    .ok()
                    .filter(|c: &Checkout| c.total >= 0)
                    .ok_or_else(|| {
                        Idempotent::error(
                            400,
                            "invalid_request",
                            "a body {\"total\": cents ≥ 0} is required",
                        )
                    })?;
                let unavailable =
                    |_| Idempotent::error(503, "unavailable", "try again with the same key");
                let id: i64 = sqlx::query_scalar(
                    "INSERT INTO shop.checkouts (cart, total) VALUES ($1, $2) RETURNING id",
                )
                .bind(cart)
                .bind(checkout.total)
                .fetch_one(&mut *tx)
                .await
                .map_err(unavailable)?;
                let body =
                    serde_json::json!({"checkout": id, "cart": cart, "total": checkout.total});
                let event = Event::json(
                    &shop.topic,
                    &format!("cart-{cart}"),
                    "checkout.completed",
                    &body,
                )
                .map_err(|e| Idempotent::error(500, "internal", &e.to_string()))?;
                shop.fx
                    .outbox()
                    .enqueue(&mut *tx, &event)
                    .await
                    .map_err(unavailable)?;
                Ok(StoredResponse {
                    status: 201,
                    headers: vec![("content-type".into(), "application/json".into())],
                    body: body.to_string().into_bytes(),
                })
            })
        })
        .await
}

/// The route's state: the library on the shop's schema, and the topic.
#[derive(Clone)]
pub(crate) struct Shop {
    /// The library on `shop_fx`.
    pub(crate) fx: Effectively,
    /// Where the events go.
    pub(crate) topic: String,
}

impl axum::extract::FromRef<Shop> for Effectively {
    fn from_ref(shop: &Shop) -> Self {
        shop.fx.clone()
    }
}
