//! Payments' inbox moving into the library's partitioned inbox
//! (migrations/20261205000001_payments_inbox_in_the_library.sql) on a
//! database that was in use: every dedup record kept with its fingerprint,
//! and the window's floor where payments' expiry had left it, so that no
//! event is applied twice across the move.

use std::path::{Path, PathBuf};
use std::time::Duration;

use effectively::store::{InboxClaim, Message};
use effectively::v7::minted_ago;
use pipeline::db::{MIGRATOR, library};
use pipeline::testing::TestDb;
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use uuid::Uuid;

const MOVE: i64 = 20261205000001;

/// A directory holding the pipeline's migrations before the move.
fn migrations_before_the_move() -> PathBuf {
    let all = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../migrations");
    let dir = std::env::temp_dir().join(format!("before-move-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for entry in std::fs::read_dir(&all).expect("migrations") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let version: i64 = name
            .split('_')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(i64::MAX);
        if version < MOVE {
            std::fs::copy(&path, dir.join(name)).expect("copy");
        }
    }
    dir
}

async fn claim(pool: &PgPool, msg: &Message) -> InboxClaim {
    let inbox = library(pool.clone()).partitioned_inbox("payments");
    let mut tx = pool.begin().await.expect("begin");
    let claim = inbox.claim(&mut tx, msg).await.expect("claim");
    tx.rollback().await.expect("rollback");
    claim
}

#[tokio::test]
async fn the_move_keeps_every_dedup_record_and_the_floor_payments_expiry_had_reached() {
    let db = TestDb::empty().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    library(pool.clone()).migrate().await.expect("the library");
    let before = migrations_before_the_move();
    Migrator::new(before.as_path())
        .await
        .expect("read the migrations")
        .run(&pool)
        .await
        .expect("migrate to before the move");
    let _ = std::fs::remove_dir_all(&before);

    // Payments' inbox in use: a record an hour old (in its first partition,
    // which its expiry then drops), one with a fingerprint, one from before
    // fingerprints.
    let expired = minted_ago(Duration::from_secs(3600));
    sqlx::query("INSERT INTO payments.inbox (msg_id, payload_hash) VALUES ($1, 1)")
        .bind(expired)
        .execute(&pool)
        .await
        .expect("an old record");
    let dropped: Vec<String> = sqlx::query_scalar("SELECT payments.inbox_expire('0s')")
        .fetch_all(&pool)
        .await
        .expect("payments' expiry");
    assert_eq!(dropped, ["inbox_legacy"]);
    let (floor, ceiling): (Uuid, Uuid) = sqlx::query_as(
        "SELECT (SELECT lo FROM payments.inbox_partitions ORDER BY lo LIMIT 1), \
                (SELECT hi FROM payments.inbox_partitions ORDER BY hi DESC LIMIT 1)",
    )
    .fetch_one(&pool)
    .await
    .expect("payments' window");
    let (fingerprinted, bare) = (Uuid::now_v7(), Uuid::now_v7());
    for (id, hash) in [(fingerprinted, Some(7_i64)), (bare, None)] {
        sqlx::query("INSERT INTO payments.inbox (msg_id, payload_hash) VALUES ($1, $2)")
            .bind(id)
            .bind(hash)
            .execute(&pool)
            .await
            .expect("a record");
    }

    MIGRATOR.run(&pool).await.expect("the move");

    let gone: Option<String> = sqlx::query_scalar("SELECT to_regclass('payments.inbox')::text")
        .fetch_one(&pool)
        .await
        .expect("payments.inbox");
    assert_eq!(gone, None, "payments' own inbox is gone");
    let window = library(pool.clone())
        .partitioned_inbox("payments")
        .window(&mut pool.acquire().await.expect("conn"))
        .await
        .expect("window")
        .expect("partitioned");
    assert_eq!(window.floor, Some(floor), "the floor stays where it was");
    assert!(window.ceiling >= Some(ceiling), "as far ahead as before");
    let fingerprint = |n: i64| n.to_be_bytes();
    // Each record kept: a copy is a duplicate, another payload a conflict.
    assert_eq!(
        claim(
            &pool,
            &Message::v7_fingerprinted(fingerprinted, &fingerprint(7))
        )
        .await,
        InboxClaim::Duplicate
    );
    assert_eq!(
        claim(
            &pool,
            &Message::v7_fingerprinted(fingerprinted, &fingerprint(8))
        )
        .await,
        InboxClaim::Conflict
    );
    assert_eq!(
        claim(&pool, &Message::v7_fingerprinted(bare, &fingerprint(9))).await,
        InboxClaim::Duplicate,
        "a record from before fingerprints takes every copy as a duplicate"
    );
    // Below the floor: refused as before the move, not claimed anew.
    assert_eq!(
        claim(&pool, &Message::v7_fingerprinted(expired, &fingerprint(1))).await,
        InboxClaim::TooOld
    );
    assert_eq!(
        claim(
            &pool,
            &Message::v7_fingerprinted(Uuid::now_v7(), &fingerprint(1))
        )
        .await,
        InboxClaim::New
    );
}
