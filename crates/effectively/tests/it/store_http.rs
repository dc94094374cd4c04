//! `effectively::store::Idempotent` on an axum route served over a real
//! socket, against the real PostgreSQL: a retry replays the first answer
//! byte for byte, another request under the key is refused, keys are scoped
//! by the caller, concurrent retries make one effect.

use axum::Router;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::post;
use effectively::store::{Idempotent, Principal, StoredResponse};
use pipeline::testing::TestDb;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// The user's own authentication, standing in: the caller named by
/// `x-user`.
async fn authenticate(mut request: Request, next: Next) -> Response {
    if let Some(user) = request
        .headers()
        .get("x-user")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    {
        request.extensions_mut().insert(Principal(user));
    }
    next.run(request).await
}

/// `POST /carts/{id}/checkout`: body = the total; one row per checkout.
async fn checkout(request: Idempotent) -> Response {
    request
        .run(|tx, body| {
            Box::pin(async move {
                let total: i32 = std::str::from_utf8(body)
                    .ok()
                    .and_then(|b| b.trim().parse().ok())
                    .ok_or_else(|| {
                        Idempotent::error(400, "invalid_request", "the body is a total")
                    })?;
                let id: i64 =
                    sqlx::query_scalar("INSERT INTO checkouts (total) VALUES ($1) RETURNING id")
                        .bind(total)
                        .fetch_one(&mut *tx)
                        .await
                        .map_err(|_| Idempotent::error(503, "unavailable", "try again"))?;
                Ok(StoredResponse {
                    status: 201,
                    headers: vec![
                        ("content-type".into(), "application/json".into()),
                        ("location".into(), format!("/checkouts/{id}")),
                    ],
                    body: format!("{{\"checkout\":{id},\"total\":{total}}}").into_bytes(),
                })
            })
        })
        .await
}

async fn serve() -> (TestDb, PgPool, String, CancellationToken) {
    let (db, pool, fx) = super::store::store("shop_fx").await;
    sqlx::query("CREATE TABLE checkouts (id bigserial PRIMARY KEY, total int NOT NULL)")
        .execute(&pool)
        .await
        .expect("the service's table");
    let app = Router::new()
        .route("/carts/{id}/checkout", post(checkout))
        .layer(axum::middleware::from_fn(authenticate))
        .with_state(fx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let cancel = CancellationToken::new();
    pipeline::metrics::spawn_router("shop", listener, app, cancel.clone());
    (db, pool, base, cancel)
}

/// Status, the headers that matter, and the body.
async fn post_checkout(
    base: &str,
    cart: i32,
    key: Option<&str>,
    user: Option<&str>,
    body: &str,
) -> (u16, Option<String>, String) {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/carts/{cart}/checkout"))
        .body(body.to_owned());
    if let Some(k) = key {
        request = request.header("idempotency-key", k);
    }
    if let Some(u) = user {
        request = request.header("x-user", u);
    }
    let response = request.send().await.expect("an answer");
    let status = response.status().as_u16();
    let location = response
        .headers()
        .get("location")
        .map(|v| v.to_str().expect("ascii").to_owned());
    (status, location, response.text().await.expect("a body"))
}

async fn count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM checkouts")
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::test]
async fn a_retry_replays_the_first_answer_and_another_request_under_the_key_is_refused() {
    let (_db, pool, base, stop) = serve().await;
    let first = post_checkout(&base, 1, Some("k-1"), Some("alice"), "100").await;
    assert_eq!(first.0, 201);
    assert_eq!(first.1.as_deref(), Some("/checkouts/1"));
    for _ in 0..3 {
        assert_eq!(
            post_checkout(&base, 1, Some("k-1"), Some("alice"), "100").await,
            first
        );
    }
    assert_eq!(count(&pool).await, 1);

    // Another body, or another path, under the same key.
    let (status, _, body) = post_checkout(&base, 1, Some("k-1"), Some("alice"), "101").await;
    assert_eq!(status, 409);
    assert!(body.contains("idempotency_key_reused"), "{body}");
    assert_eq!(
        post_checkout(&base, 2, Some("k-1"), Some("alice"), "100")
            .await
            .0,
        409
    );

    // Another caller's key of the same name is its own.
    let bob = post_checkout(&base, 1, Some("k-1"), Some("bob"), "100").await;
    assert_eq!((bob.0, bob.1.as_deref()), (201, Some("/checkouts/2")));
    assert_eq!(count(&pool).await, 2);

    // Refused before any work.
    let (status, _, body) = post_checkout(&base, 1, None, Some("alice"), "100").await;
    assert_eq!(status, 400);
    assert!(body.contains("missing_idempotency_key"), "{body}");
    let (status, _, body) = post_checkout(&base, 1, Some("a key"), Some("alice"), "100").await;
    assert_eq!(status, 400);
    assert!(body.contains("invalid_idempotency_key"), "{body}");

    // The work's own error is answered and not stored: the key is free.
    let (status, _, body) = post_checkout(&base, 3, Some("k-3"), None, "lots").await;
    assert_eq!(status, 400);
    assert!(body.contains("invalid_request"), "{body}");
    assert_eq!(
        post_checkout(&base, 3, Some("k-3"), None, "lots").await.0,
        400
    );
    assert_eq!(count(&pool).await, 2);
    stop.cancel();
}

#[tokio::test]
async fn concurrent_retries_of_one_key_make_one_effect_and_one_answer() {
    let (_db, pool, base, stop) = serve().await;
    let answers = futures::future::join_all(
        (0..16).map(|_| post_checkout(&base, 7, Some("k-storm"), Some("alice"), "70")),
    )
    .await;
    assert_eq!(count(&pool).await, 1);
    assert!(answers.iter().all(|a| a == &answers[0]), "{answers:?}");
    assert_eq!(answers[0].0, 201);
    stop.cancel();
}
