//! The library on a schema of the user's choosing (`effectively::store`),
//! against the real PostgreSQL, in a database the pipeline's migrations
//! never touched: the schema and its ledger, the outbox in the caller's
//! transaction, the inbox's claims and the idempotency keys, each with the
//! races a service meets.

mod inbox;
mod keys;
mod outbox;
mod schema;

use effectively::idempotency::IdempotencyKey;
use effectively::store::Effectively;
use pipeline::testing::TestDb;
use sqlx::PgPool;

/// A database of its own with the library migrated into `schema` (the
/// other `store_*` test files' set-up too).
pub(crate) async fn store(schema: &str) -> (TestDb, PgPool, Effectively) {
    let db = TestDb::empty().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let fx = Effectively::postgres(pool.clone())
        .schema(schema)
        .expect("schema name");
    fx.migrate().await.expect("migrate");
    (db, pool, fx)
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

pub(crate) fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::parse(k.as_bytes()).expect("test step")
}
