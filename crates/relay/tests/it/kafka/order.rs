//! Per-key order and shards: every pending row published and marked once, in
//! per-key order, with relays racing, shard transactions in flight at once, a
//! group's transaction over all its shards, `--shard-depth`, a hot key's backlog.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use pipeline::testing::{TestDb, TestTopic, eventually};
use relay::Config;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{
    assert_each_event_once_in_order, assert_first_occurrences_in_order, config, fill_outbox,
    pending, per_key_sequences, spawn_relay,
};

#[tokio::test]
async fn publishes_every_pending_row_in_per_key_order_and_marks_it() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..60).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &keys, 3).await;

    let relay = spawn_relay(config(&db, &topic, 2, 50)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "relay drained the outbox"
    );
    let messages = topic.read_all(180, Duration::from_secs(30)).await;
    assert_eq!(messages.len(), 180);
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 60);
    for (key, seq) in &seqs {
        assert_eq!(seq, &vec![0, 1, 2], "key {key} in outbox order, each once");
    }
    let distinct: HashSet<Uuid> = msg_ids.iter().copied().collect();
    assert_eq!(distinct.len(), 180);

    // New rows after the drain are picked up by NOTIFY (or the poll).
    fill_outbox(&pool, &keys[..5], 1).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            pending(&pool).await == 0
        })
        .await
    );
    relay.stop().await;
}

#[tokio::test]
async fn two_relays_at_once_keep_every_key_in_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();

    let r1 = spawn_relay(config(&db, &topic, 2, 7)).await;
    let r2 = spawn_relay(config(&db, &topic, 3, 5)).await;
    // Write while both relays run, so they race for the same shards.
    fill_outbox(&pool, &keys, 8).await;
    assert!(
        eventually(Duration::from_secs(90), || async {
            pending(&pool).await == 0
        })
        .await
    );
    let messages = topic.read_all(320, Duration::from_secs(30)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 40);
    assert_first_occurrences_in_order(&seqs, 8);
    assert_eq!(
        msg_ids.iter().collect::<HashSet<_>>().len(),
        320,
        "every event published"
    );
    r1.stop().await;
    r2.stop().await;
}

/// Up to `--workers` shard transactions are open at once (one shard's acks
/// overlap another's claim and mark), and still each shard is published by
/// one transaction at a time: every key's events arrive in outbox order,
/// each exactly once. The gauge shows the overlap really happened.
#[tokio::test]
async fn shards_in_flight_at_once_keep_every_key_in_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..100).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &keys, 4).await;

    let relay = spawn_relay(config(&db, &topic, 8, 5)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut most_in_flight = 0.0f64;
    while pending(&pool).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "relay drained the outbox"
        );
        most_in_flight = most_in_flight.max(relay.metric("relay_shards_in_flight").await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        most_in_flight > 1.0,
        "more than one shard transaction was open at once (most seen: {most_in_flight})"
    );
    assert!(most_in_flight <= 8.0, "never more than --workers");
    assert_each_event_once_in_order(&topic, 100, 4).await;
    relay.stop().await;
}

/// `--shard-groups 1`: one transaction claims rows of every shard at once
/// (a mark's `published_at` is its transaction's start, so rows marked
/// together share it), and every key's events still arrive in outbox order,
/// each once. With a group per shard (`--shard-groups 16`) no transaction
/// spans two shards.
#[tokio::test]
async fn a_groups_transaction_claims_all_its_shards_at_once() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..64).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &keys, 2).await;
    let shards: i64 = sqlx::query_scalar("SELECT count(DISTINCT shard) FROM orders.outbox")
        .fetch_one(&pool)
        .await
        .expect("shards");

    let relay = spawn_relay(Config {
        shard_groups: 1,
        ..config(&db, &topic, 8, 1000)
    })
    .await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "relay drained the outbox"
    );
    let most: i64 = sqlx::query_scalar(
        "SELECT max(n) FROM (SELECT count(DISTINCT shard) AS n FROM orders.outbox GROUP BY published_at) t",
    )
    .fetch_one(&pool)
    .await
    .expect("shards per transaction");
    assert_eq!(most, shards, "one transaction marked rows of every shard");
    assert_each_event_once_in_order(&topic, 64, 2).await;
    relay.stop().await;
}

/// `--shard-depth` over 1 is not taken: the relay reads a key's rows and
/// marks them after the acks, so a second pass over the shard would send
/// them again. Two relays asking for depths 4 and 2, while the events are
/// written: every key arrives in outbox order, each event once, and no two
/// passes of one shard are ever in flight together (sessions holding a
/// lock of the shard, each idle in its transaction awaiting acks; the
/// library's lock of shard s in slot k is (class, s + 16 × k), in pg_locks
/// objid with objsubid 2).
#[tokio::test]
async fn a_shard_depth_over_one_is_not_taken_and_every_key_stays_in_order() {
    const SHARD: i16 = 5;
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let mut keys = Vec::new();
    while keys.len() < 40 {
        let key = Uuid::now_v7();
        let shard: i16 = sqlx::query_scalar("SELECT (abs(uuid_hash($1)::bigint) % 16)::smallint")
            .bind(key)
            .fetch_one(&pool)
            .await
            .expect("shard");
        if shard == SHARD {
            keys.push(key);
        }
    }

    let sampling = CancellationToken::new();
    let sampler = tokio::spawn({
        let (pool, sampling) = (pool.clone(), sampling.clone());
        async move {
            let awaiting = "SELECT count(DISTINCT a.pid) FROM pg_stat_activity a \
                 JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted \
                 WHERE a.datname = current_database() AND a.state = 'idle in transaction' \
                   AND l.objsubid = 2 AND l.objid::int8 % 16 = $1";
            let (mut most, mut seen) = (0i64, 0u64);
            while !sampling.is_cancelled() {
                let n: i64 = sqlx::query_scalar(awaiting)
                    .bind(i64::from(SHARD))
                    .fetch_one(&pool)
                    .await
                    .expect("sample");
                most = most.max(n);
                seen += u64::from(n > 0);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            (most, seen)
        }
    });
    let r1 = spawn_relay(Config {
        shard_depth: 4,
        ..config(&db, &topic, 8, 3)
    })
    .await;
    let r2 = spawn_relay(Config {
        shard_depth: 2,
        ..config(&db, &topic, 4, 5)
    })
    .await;
    fill_outbox(&pool, &keys, 8).await;
    assert!(
        eventually(Duration::from_secs(90), || async {
            pending(&pool).await == 0
        })
        .await,
        "the relays drained the outbox"
    );
    sampling.cancel();
    let (most_awaiting, seen) = sampler.await.expect("sampler");
    assert_each_event_once_in_order(&topic, 40, 8).await;
    assert!(
        seen > 0,
        "the sampler saw a pass of the shard await its acks"
    );
    assert_eq!(
        most_awaiting, 1,
        "one pass of a shard in flight at a time (most seen: {most_awaiting})"
    );
    r1.stop().await;
    r2.stop().await;
}

/// A hot key's backlog goes out a pass's share at a time, in order, not a
/// row per pass (a 10-key backlog drained at 93 rows/s when a claim took
/// each key's first pending row only: FINDINGS §26), and the other keys of
/// its shard follow in commit order (oldest first, as every shard's rows).
#[tokio::test]
async fn a_hot_key_backlog_goes_a_share_per_pass_and_its_shard_keeps_commit_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let hot = Uuid::now_v7();
    fill_outbox(&pool, &[hot], 300).await;
    let others: Vec<Uuid> = (0..50).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &others, 1).await;

    // Each shard's share of a pass is 20 rows (160 ÷ 8 shards a group).
    let relay = spawn_relay(config(&db, &topic, 1, 160)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "the outbox drains"
    );
    let passes = relay.metric("relay_batch_size_count").await;
    assert!(
        passes < 60.0,
        "{passes} passes published rows: the hot key's 300 went 20 a pass, not one"
    );
    // Marked by the pass that sent them, at its transaction's start.
    let (hot_last, others_first): (chrono::DateTime<chrono::Utc>, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as(
            "SELECT (SELECT max(published_at) FROM orders.outbox WHERE aggregate_id = $1), \
                    (SELECT min(o.published_at) FROM orders.outbox o \
                     WHERE o.aggregate_id <> $1 \
                       AND o.shard = (SELECT shard FROM orders.outbox WHERE aggregate_id = $1 LIMIT 1))",
        )
        .bind(hot)
        .fetch_one(&pool)
        .await
        .expect("published times");
    if let Some(first) = others_first {
        assert!(
            first >= hot_last,
            "the hot key's shard published its later keys after its older backlog"
        );
    }
    let messages = topic.read_all(350, Duration::from_secs(30)).await;
    let (seqs, _) = per_key_sequences(&messages);
    assert_first_occurrences_in_order(
        &HashMap::from([(hot.to_string(), seqs[&hot.to_string()].clone())]),
        300,
    );
    relay.stop().await;
}
