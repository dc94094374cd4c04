//! The relay's statements and sessions in PostgreSQL: the claim's and the
//! mark's plans after an empty outbox was analyzed, the sessions' own limits,
//! and the outbox retention.

use std::time::Duration;

use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, TestTopic};
use relay::{Mode, Sink};
use sqlx::PgPool;
use uuid::Uuid;

use super::{config, fill_outbox};

/// An outbox whose statistics say "nothing is pending" (5,000 rows, every
/// one published, then analyzed; autovacuum off, so they stay so), then a
/// burst of 4,000 pending rows, one per aggregate.
async fn analyzed_empty_then_a_backlog(owner: &PgPool) {
    for sql in [
        "ALTER TABLE orders.outbox SET (autovacuum_enabled = off)",
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, published_at) \
         SELECT gen_random_uuid(), gen_random_uuid(), 'test.event', '{}', now() \
         FROM generate_series(1, 5000)",
        "ANALYZE orders.outbox",
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
         SELECT gen_random_uuid(), gen_random_uuid(), 'test.event', '{}' \
         FROM generate_series(1, 4000)",
    ] {
        sqlx::query(sql).execute(owner).await.expect(sql);
    }
}

/// The rows of the outbox this transaction has read so far (fetched through
/// an index or read by a scan): a count, not a time.
async fn outbox_reads(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>) -> i64 {
    let (fetched, scanned): (i64, i64) = sqlx::query_as(
        "SELECT idx_tup_fetch, seq_tup_read FROM pg_stat_xact_user_tables \
         WHERE relid = 'orders.outbox'::regclass",
    )
    .fetch_one(&mut **tx)
    .await
    .expect("this transaction's reads");
    fetched + scanned
}

/// The claim's plan holds when the statistics were taken while nothing was
/// pending (a drained queue, analyzed) and a backlog arrived before the next
/// analyze: the claims read about one row of the table per row they return.
/// The anti-join the planner chose under such statistics read every pending
/// row per row returned (FINDINGS.md §16). The count is this transaction's
/// own reads (pg_stat_xact_user_tables), not a time.
#[tokio::test]
async fn a_claim_after_an_empty_outbox_was_analyzed_reads_each_row_once() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    const BACKLOG: usize = 4000;
    analyzed_empty_then_a_backlog(&owner).await;
    let mut tx = owner.begin().await.expect("begin");
    let mut claimed = 0;
    for shard in 0..relay::outbox::SHARDS {
        claimed += relay::outbox::read_shards(&mut tx, &[shard], 1000)
            .await
            .expect("claim")
            .rows
            .len();
    }
    let read = usize::try_from(outbox_reads(&mut tx).await).expect("a count");
    assert_eq!(claimed, BACKLOG, "every aggregate's only row, once");
    assert!(
        read <= 3 * BACKLOG,
        "the claims read {read} rows of the table to return {claimed}: a plan per row, not per claim"
    );
}

/// The WAL relay's mark after the same statistics: each mark reads its own
/// rows (by `outbox_pkey`), not every pending row (a scan of
/// `outbox_pending_by_aggregate` filtered by id, which its `published_at IS
/// NULL` let the planner choose).
#[tokio::test]
async fn a_mark_after_an_empty_outbox_was_analyzed_reads_only_its_rows() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    analyzed_empty_then_a_backlog(&owner).await;
    let pending: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM orders.outbox WHERE published_at IS NULL ORDER BY id LIMIT 100",
    )
    .fetch_all(&owner)
    .await
    .expect("pending ids");
    let mut tx = owner.begin().await.expect("begin");
    let mut marked = 0;
    for ids in pending.chunks(10) {
        marked += relay::outbox::mark_published(&mut tx, ids)
            .await
            .expect("mark");
    }
    // Marking them again marks nothing: a row keeps its first time.
    let again = relay::outbox::mark_published(&mut tx, &pending[..10])
        .await
        .expect("mark again");
    let read = outbox_reads(&mut tx).await;
    assert_eq!((marked, again), (100, 0), "each row marked once");
    assert!(
        read <= 3 * 110,
        "11 marks of 10 rows read {read} rows of the table: every pending row per mark"
    );
}

/// Every pooled session of the relay sets its own limits, whatever the
/// server's defaults: READ COMMITTED, the statement and idle-in-transaction
/// timeouts (flags over the relay's defaults), TCP keepalives, and a custom
/// plan for every statement (a generic claim plan made on an empty outbox is
/// quadratic in the backlog).
#[tokio::test]
async fn database_sessions_set_their_own_limits() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let mut cfg = config(&db, &topic, 1, 10);
    cfg.db.db_idle_in_transaction_timeout_ms = Some(4_000);
    let pool = pipeline::db::connect(&cfg.db, relay::session_limits(&cfg))
        .await
        .expect("connect");
    for (setting, want) in [
        ("default_transaction_isolation", "read committed"),
        ("statement_timeout", "30s"),
        ("idle_in_transaction_session_timeout", "4s"),
        ("tcp_keepalives_idle", "30"),
        ("plan_cache_mode", "force_custom_plan"),
        // its marks: a crash of the server undoes at most the last ones
        ("synchronous_commit", "off"),
    ] {
        let got: String = sqlx::query_scalar(&format!("SHOW {setting}"))
            .fetch_one(&pool)
            .await
            .expect(setting);
        assert_eq!(got, want, "{setting}");
    }
    // Asked for, and for everything but polling for Kafka, its commits wait.
    let mut durable = vec![cfg.clone(), cfg.clone(), cfg.clone()];
    durable[0].synchronous_commit = true;
    durable[1].mode = Mode::Wal;
    durable[2].sink = Sink::Http;
    for cfg in durable {
        assert!(!relay::session_limits(&cfg).asynchronous_commit, "{cfg:?}");
    }
}

/// Published rows older than the outbox retention are deleted in batches,
/// oldest first; a pending or failed row never is (an intent still on its
/// way); the floor moves up once nothing expired is left.
#[tokio::test]
async fn published_rows_expire_after_the_retention_and_unpublished_ones_stay() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    let relay_pool = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as relay");
    let keys: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&owner, &keys, 2).await;
    // 7 published, 2 pending, 1 failed.
    sqlx::query(
        "UPDATE orders.outbox SET published_at = now() \
         WHERE id IN (SELECT id FROM orders.outbox ORDER BY id LIMIT 7)",
    )
    .execute(&owner)
    .await
    .expect("publish");
    sqlx::query(
        "UPDATE orders.outbox SET failed_at = now(), attempts = 5, last_error = 'x' \
         WHERE id = (SELECT max(id) FROM orders.outbox)",
    )
    .execute(&owner)
    .await
    .expect("fail one");

    // Under the default retention (7 days) nothing is old enough.
    assert_eq!(
        relay::outbox::expire(&relay_pool, 100)
            .await
            .expect("expire"),
        0
    );
    sqlx::query("UPDATE orders.outbox_policy SET retention = interval '1 millisecond'")
        .execute(&owner)
        .await
        .expect("shorten");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut batches = Vec::new();
    loop {
        let n = relay::outbox::expire(&relay_pool, 3).await.expect("expire");
        batches.push(n);
        if n < 3 {
            break;
        }
    }
    assert_eq!(batches, [3, 3, 1], "the 7 published rows, at most 3 a call");
    let left: Vec<bool> =
        sqlx::query_scalar("SELECT published_at IS NULL FROM orders.outbox ORDER BY id")
            .fetch_all(&owner)
            .await
            .expect("left");
    assert_eq!(
        left,
        [true, true, true],
        "the pending and the failed rows stay"
    );
    let floor: Uuid = sqlx::query_scalar("SELECT floor FROM orders.outbox_policy")
        .fetch_one(&owner)
        .await
        .expect("floor");
    let newest: Uuid = sqlx::query_scalar("SELECT max(msg_id::text)::uuid FROM orders.outbox")
        .fetch_one(&owner)
        .await
        .expect("newest");
    assert!(
        floor > newest,
        "the floor moved past every row minted before the cut"
    );
}
