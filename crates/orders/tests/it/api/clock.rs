//! The start-up clock check: a clock past the bound is refused, and an
//! unavailable database is waited out.

use std::time::Duration;

use pipeline::testing::TestDb;
use sqlx::PgPool;

/// Orders measures its clock against the database's at start-up and refuses
/// to run past `--max-clock-skew-secs` (the measurement, with a shifted local
/// clock, is `pipeline::clock`'s; the service's refusal is checked here).
#[tokio::test]
async fn a_clock_past_the_bound_is_refused_and_a_small_skew_is_measured() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let gauge = prometheus::Gauge::new("skew", "skew").expect("gauge");
    let bounds = pipeline::clock::Bounds::default();
    let slow = || std::time::SystemTime::now() - Duration::from_secs(11 * 60);
    let patience = Duration::from_secs(5);
    let refused = pipeline::clock::check_at_start("orders", &pool, bounds, patience, &gauge, slow)
        .await
        .expect_err("11 minutes slow is refused");
    assert!(
        format!("{refused}").contains("clock differs from the database's by +66"),
        "{refused}"
    );
    assert!(
        (gauge.get() - 660.0).abs() < 5.0,
        "the gauge shows it: {}",
        gauge.get()
    );
    let skew = pipeline::clock::check_at_start(
        "orders",
        &pool,
        bounds,
        patience,
        &gauge,
        std::time::SystemTime::now,
    )
    .await
    .expect("the same host's clock is accepted");
    assert!(skew.seconds.abs() < 1.0, "{skew:?}");
}

/// A database that goes away between orders' connect and its clock check (a
/// primary crashed in that instant: experiment 10's long run saw it end an
/// instance) is waited for, as at connect: the check fails only once the
/// connect patience is spent, not at the first refusal.
#[tokio::test]
async fn the_clock_check_waits_out_an_unavailable_database() {
    // Nothing listens there: every connection is refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(200))
        .connect_lazy(&format!("postgres://nobody@127.0.0.1:{port}/none"))
        .expect("a lazy pool");
    let gauge = prometheus::Gauge::new("skew", "skew").expect("gauge");
    let patience = Duration::from_millis(1500);
    let started = std::time::Instant::now();
    let error = pipeline::clock::check_at_start(
        "orders",
        &pool,
        pipeline::clock::Bounds::default(),
        patience,
        &gauge,
        std::time::SystemTime::now,
    )
    .await
    .expect_err("no database, no measurement");
    assert!(
        started.elapsed() >= patience,
        "it gave up after {:?}, before its patience: {error:#}",
        started.elapsed()
    );
    assert!(
        format!("{error:#}").contains("measure the database's clock"),
        "{error:#}"
    );
}
