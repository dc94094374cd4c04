//! `orders.outbox_pending` (migrations/20261202000001_outbox_pending_table.sql)
//! against the real PostgreSQL: the outbox's triggers keep it equal to the
//! outbox's unpublished rows whatever statement changes the outbox, and the
//! relay's mark is a HOT update of the outbox.

use effectively::testing::TestDb;
use sqlx::PgPool;

/// The pending table as the triggers keep it, and as the outbox says it
/// must be: `(id, shard, aggregate, failed)`, in id order.
async fn both(pool: &PgPool) -> (Vec<(i64, i16, String, bool)>, Vec<(i64, i16, String, bool)>) {
    let kept = sqlx::query_as(
        "SELECT id, shard, aggregate_id::text, failed FROM orders.outbox_pending ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .expect("read the pending table");
    let truth = sqlx::query_as(
        "SELECT id, shard, aggregate_id::text, failed_at IS NOT NULL FROM orders.outbox \
         WHERE published_at IS NULL ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .expect("read the outbox");
    (kept, truth)
}

/// Every kind of statement that changes the outbox, in turn: the pending
/// table follows each one.
#[tokio::test]
async fn the_pending_table_follows_every_change_of_the_outbox() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let steps = [
        // orders' write: several rows in one statement
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
         SELECT gen_random_uuid(), gen_random_uuid(), 'order.created', '{}' FROM generate_series(1, 40)",
        // rows inserted published, and failed (recon's seed, tests)
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, published_at) \
         SELECT gen_random_uuid(), gen_random_uuid(), 'order.created', '{}', now() FROM generate_series(1, 5)",
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, failed_at) \
         SELECT gen_random_uuid(), gen_random_uuid(), 'order.created', '{}', now() FROM generate_series(1, 3)",
        // the relay's mark, a second mark of the same rows (the WAL relay's
        // restart), its failures, and a failure that fails the row
        "UPDATE orders.outbox SET published_at = now() WHERE id % 3 = 0 AND published_at IS NULL",
        "UPDATE orders.outbox SET published_at = now() WHERE id % 3 = 0 AND published_at IS NULL",
        "UPDATE orders.outbox SET attempts = attempts + 1, last_error = 'boom' WHERE id % 5 = 1",
        "UPDATE orders.outbox SET failed_at = now() WHERE id % 7 = 2",
        // an operator's retry of failed rows, and a bench's republish
        "UPDATE orders.outbox SET failed_at = NULL, attempts = 0 WHERE id % 2 = 0",
        "UPDATE orders.outbox SET published_at = NULL WHERE id % 4 = 0",
        // a pending row deleted by hand; the expiry's delete of published rows
        "DELETE FROM orders.outbox WHERE id = 1",
        "DELETE FROM orders.outbox WHERE published_at IS NOT NULL AND id % 2 = 1",
        // an update that changes no pending state
        "UPDATE orders.outbox SET last_error = NULL",
    ];
    for step in steps {
        sqlx::query(step).execute(&pool).await.expect(step);
        let (kept, truth) = both(&pool).await;
        assert_eq!(kept, truth, "after {step}");
    }
    let (kept, _) = both(&pool).await;
    assert!(
        kept.iter().any(|r| r.3) && kept.iter().any(|r| !r.3),
        "the steps leave pending rows both failed and not: {kept:?}"
    );
    sqlx::query("TRUNCATE orders.outbox")
        .execute(&pool)
        .await
        .expect("truncate");
    assert_eq!(both(&pool).await, (vec![], vec![]), "after TRUNCATE");
}

/// The relay's mark (crates/relay/src/outbox.rs `mark_published`) writes
/// no index entry: a row it marks gets a HOT update, its new version on the
/// same page, in the room the outbox's fillfactor keeps and the earlier
/// marks' pruned versions free. Marked as the relay marks, a shard's batch a
/// transaction (so one transaction's rows are spread over the pages); the
/// server counts the updates (`pg_stat_user_tables`).
/// Before the pending table, the partial indexes named published_at and no
/// mark was HOT.
#[tokio::test]
async fn the_relays_mark_is_a_hot_update() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    sqlx::query(
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
         SELECT gen_random_uuid(), gen_random_uuid(), 'order.created', \
                convert_to(repeat('x', 200), 'UTF8') FROM generate_series(1, 4000)",
    )
    .execute(&pool)
    .await
    .expect("fill the outbox");
    let rows: Vec<(i16, i64)> =
        sqlx::query_as("SELECT shard, id FROM orders.outbox ORDER BY shard, id")
            .fetch_all(&pool)
            .await
            .expect("ids");
    // One session marks, so its counts are the server's whole count: a
    // session's counts reach pg_stat_user_tables when it goes idle, at most
    // once a second unless forced.
    let mut conn = pool.acquire().await.expect("a session");
    let mut marked = 0;
    for shard in rows.chunk_by(|a, b| a.0 == b.0) {
        let ids: Vec<i64> = shard.iter().map(|r| r.1).collect();
        for batch in ids.chunks(50) {
            marked += sqlx::query(
                "UPDATE orders.outbox SET published_at = now() \
                 WHERE id = ANY($1) AND published_at IS NULL",
            )
            .bind(batch)
            .execute(&mut *conn)
            .await
            .expect("mark")
            .rows_affected();
        }
    }
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&mut *conn)
        .await
        .expect("flush the session's counts");
    let (updated, hot): (i64, i64) = sqlx::query_as(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables \
         WHERE relid = 'orders.outbox'::regclass",
    )
    .fetch_one(&mut *conn)
    .await
    .expect("the outbox's updates");
    assert_eq!(marked, 4000);
    assert_eq!(updated, 4000);
    // Not every one: a page whose earlier versions some snapshot still
    // sees cannot be pruned yet (an analyze of the table running meanwhile).
    assert!(
        hot * 100 >= updated * 95,
        "{hot} of {updated} marks were HOT updates"
    );
    let (kept, truth) = both(&pool).await;
    assert!(kept.is_empty() && truth.is_empty(), "nothing left pending");
}
