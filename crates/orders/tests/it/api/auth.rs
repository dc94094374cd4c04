//! Authentication: bearer tokens over HTTP and gRPC, refusals counted by
//! reason, and each caller's keys in a scope of its own.

use orders::proto::CreateOrderRequest;
use orders::store::InjectFault;
use pipeline::testing::TestDb;
use reqwest::StatusCode;
use sqlx::PgPool;

use super::{BODY, Reply, TestApp, counts, n};

/// An HTTP create as `token`'s caller (no `Authorization` when `None`).
async fn create_as(app: &TestApp, token: Option<&str>, key: &str, body: &str) -> Reply {
    let mut request = app
        .client
        .post(format!("{}/orders", app.http))
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body.to_owned());
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    Reply::from(request.send().await.expect("send")).await
}

#[tokio::test]
async fn callers_authenticate_and_each_has_its_own_keys() {
    let db = TestDb::create().await;
    let dir = std::env::temp_dir().join(format!("orders-auth-{}", db.name));
    std::fs::create_dir_all(&dir).expect("dir");
    let tokens = dir.join("tokens");
    let (shop, shop_line) = orders::auth::new_token("shop").expect("token");
    let (billing, billing_line) = orders::auth::new_token("billing").expect("token");
    std::fs::write(&tokens, format!("{shop_line}\n{billing_line}\n")).expect("write");
    let path = tokens.clone();
    let app = TestApp::spawn_tuned(&db, InjectFault::None, 4, 4096, false, move |c| {
        c.auth_tokens_file = Some(path);
    })
    .await;

    // No token, a token not in the file, another scheme: 401, nothing written.
    let (forged, _) = orders::auth::new_token("shop").expect("token");
    for token in [None, Some(forged.as_str()), Some("shop")] {
        let reply = create_as(&app, token, "k", BODY).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{token:?}");
        assert_eq!(reply.error_code(), "unauthenticated");
    }
    let basic = app
        .client
        .post(format!("{}/orders", app.http))
        .basic_auth("shop", Some(&shop))
        .send()
        .await
        .expect("send");
    assert_eq!(basic.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        basic
            .headers()
            .get("www-authenticate")
            .map(|v| v.as_bytes()),
        Some(b"Bearer".as_slice())
    );
    assert_eq!(counts(&db).await, n(0));

    // One key from two callers: two intents, two orders; a retry of each
    // replays its own; each caller's key still refuses another request.
    let first = create_as(&app, Some(&shop), "k", BODY).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = create_as(&app, Some(&billing), "k", BODY).await;
    assert_eq!(other.status, StatusCode::CREATED);
    assert_ne!(first.json()["order_id"], other.json()["order_id"]);
    assert_eq!(create_as(&app, Some(&shop), "k", BODY).await, first);
    assert_eq!(create_as(&app, Some(&billing), "k", BODY).await, other);
    let changed = r#"{"account_id": 42, "amount_cents": 2}"#;
    for token in [&shop, &billing] {
        let reply = create_as(&app, Some(token), "k", changed).await;
        assert_eq!(reply.status, StatusCode::CONFLICT);
    }
    assert_eq!(counts(&db).await, n(2));
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let scopes: Vec<String> =
        sqlx::query_scalar("SELECT scope FROM fx.idempotency_keys WHERE key = 'k' ORDER BY 1")
            .fetch_all(&pool)
            .await
            .expect("scopes");
    assert_eq!(scopes, ["billing", "shop"]);

    // Reads need a token too.
    let id = first.json()["order_id"].as_str().expect("id").to_owned();
    let read = |token: Option<String>| {
        let mut request = app.client.get(format!("{}/orders/{id}", app.http));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };
    assert_eq!(
        read(None).await.expect("get").status(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        read(Some(billing.clone())).await.expect("get").status(),
        StatusCode::OK
    );

    // gRPC: the same callers, the same scopes.
    let mut grpc = app.grpc().await;
    let call = |token: Option<&str>| {
        let mut request = tonic::Request::new(CreateOrderRequest {
            account_id: 42,
            amount_cents: 1999,
        });
        request
            .metadata_mut()
            .insert("idempotency-key", "k".parse().expect("metadata"));
        if let Some(token) = token {
            request.metadata_mut().insert(
                "authorization",
                format!("Bearer {token}").parse().expect("metadata"),
            );
        }
        request
    };
    let refused = grpc.create(call(None)).await.expect_err("no token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let refused = grpc.create(call(Some(&forged))).await.expect_err("forged");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    let replay = grpc
        .create(call(Some(&shop)))
        .await
        .expect("replay")
        .into_inner();
    assert_eq!(
        replay.order_id,
        first.json()["order_id"].as_str().expect("id")
    );
    let get = tonic::Request::new(orders::proto::GetOrderRequest { order_id: id });
    let refused = grpc.get(get).await.expect_err("a read without a token");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert_eq!(counts(&db).await, n(2));

    // Counted by reason; the answers never said which.
    let text = app.scrape().await;
    let refusals = |reason: &str| {
        pipeline::testing::series_value(
            &text,
            &format!("orders_auth_refusals_total{{reason=\"{reason}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert_eq!(refusals("missing"), 4.0, "{text}");
    assert_eq!(refusals("unknown"), 2.0);
    assert_eq!(refusals("malformed"), 2.0);
    app.stop().await;
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
