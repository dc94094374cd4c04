//! The metrics, off the public port: requests and idempotency outcomes counted.

use orders::store::InjectFault;
use pipeline::testing::TestDb;
use reqwest::StatusCode;

use super::{BODY, TestApp};

#[tokio::test]
async fn metrics_count_requests_and_idempotency_outcomes() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;
    app.create("m1", BODY).await;
    app.create("m1", BODY).await;
    app.create("m1", r#"{"account_id": 1, "amount_cents": 1}"#)
        .await;
    let public = app
        .client
        .get(format!("{}/metrics", app.http))
        .send()
        .await
        .expect("public /metrics");
    assert_eq!(
        public.status(),
        StatusCode::NOT_FOUND,
        "the metrics are off the public port"
    );
    let text = app.scrape().await;
    for line in [
        r#"idempotency_outcomes_total{outcome="new"} 1"#,
        r#"idempotency_outcomes_total{outcome="replay"} 1"#,
        r#"idempotency_outcomes_total{outcome="mismatch"} 1"#,
        r#"http_requests_total{method="POST",route="/orders",status="201"} 2"#,
        r#"http_requests_total{method="POST",route="/orders",status="409"} 1"#,
        r#"http_request_duration_seconds_count{method="POST",route="/orders"} 3"#,
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
    app.stop().await;
}
