//! End to end: the real orders, relay and payments binaries as processes on
//! the stack of `make up` (a fresh database and topic), load with retries,
//! then recon's diff. The binaries are the workspace's own, built by the same
//! `cargo nextest run --workspace` / `cargo build` as this test.
//! Here the helpers the files share (a seeded database, the client's keys).

use pipeline::testing::TestDb;
use recon::ClientKey;
use sqlx::PgPool;

// Each per-order check and the stored responses' checks, the binary's exit,
// the ranges against the whole.
mod checks;
// When the pipeline counts as drained.
mod drained;
// What recon checks once keys, events and inbox partitions expired.
mod expiry;
// The whole pipeline as processes, with retries and a re-publish.
mod processes;

/// The client's successes, each key in the shared scope (no caller).
fn shared(seen: &[(String, uuid::Uuid)]) -> Vec<(ClientKey, uuid::Uuid)> {
    seen.iter()
        .map(|(key, id)| (ClientKey::shared(key), *id))
        .collect()
}

/// A database holding a consistent pipeline of `n` orders (the seed recon's
/// scale benchmark uses).
async fn seeded(n: u64) -> (TestDb, PgPool) {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    recon::seed::seed(&pool, n).await.expect("seed");
    (db, pool)
}
