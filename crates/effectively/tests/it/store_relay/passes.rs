//! A pass through a scripted sink: each key in order, its stats, a retried
//! row, rows delivered past a failed one, a refused row, a pass cut off
//! mid-send, and what a pass's claim reads.

use std::time::Duration;

use effectively::store::{Effectively, Outgoing, Relay, SendError, Sink};
use sqlx::PgPool;

use super::{Recorder, Script, ascending, enqueue, pending, store};

#[tokio::test]
async fn every_row_is_sent_once_each_key_in_order_and_marked() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 7, 0..300).await;
    let sink = Recorder::default();
    let relay = Relay::new(&fx, sink.clone()).batch_size(20);
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!(pass.published, 300);
    assert_eq!(pending(&pool).await, 0);
    let by_key = sink.by_key();
    assert_eq!(by_key.len(), 7);
    for (key, ns) in &by_key {
        assert!(ascending(ns), "{key}: {ns:?}");
    }
    assert_eq!(sink.sent().len(), 300);
    // Nothing left: a second pass sends nothing.
    assert_eq!(relay.relay_all().await.expect("relay").published, 0);
    assert_eq!(sink.sent().len(), 300);
}

/// A sink that takes 30 ms for each row.
#[derive(Clone, Default)]
struct Slow;

impl Sink for Slow {
    async fn send(&self, _row: &Outgoing) -> Result<(), SendError> {
        tokio::time::sleep(Duration::from_millis(30)).await;
        Ok(())
    }
}

#[tokio::test]
async fn the_stats_count_passes_that_claimed_and_time_each_phase() {
    let (_db, _pool, fx) = store().await;
    enqueue(&fx, 1, 0..3).await;
    let relay = Relay::new(&fx, Slow);
    let stats = relay.stats();
    let load = |n: &std::sync::atomic::AtomicU64| n.load(std::sync::atomic::Ordering::Relaxed);
    // One key: its 3 rows one after the other, 90 ms of sending.
    assert_eq!(relay.relay_all().await.expect("relay").published, 3);
    assert_eq!(relay.relay_all().await.expect("relay").published, 0);
    assert_eq!(
        load(&stats.passes),
        1,
        "a pass that claimed nothing is not counted"
    );
    assert!(load(&stats.send_micros) >= 90_000, "{stats:?}");
    assert!(load(&stats.claim_micros) > 0, "{stats:?}");
    assert!(load(&stats.mark_micros) > 0, "{stats:?}");
}

#[tokio::test]
async fn a_retried_row_holds_only_its_key_and_goes_first_next_time() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 3, 0..30).await; // k0: 0, 3, 6, ...
    let sink = Recorder::default();
    sink.set(6, Some(Script::Retry));
    let relay = Relay::new(&fx, sink.clone());
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!(pass.retried, 8, "6 and k0's 7 later rows stay");
    assert_eq!(sink.by_key()["k0"], [0, 3]);
    assert_eq!(sink.by_key()["k1"].len(), 10);
    assert_eq!(pending(&pool).await, 8);
    sink.set(6, None);
    relay.relay_all().await.expect("relay");
    assert_eq!(pending(&pool).await, 0);
    assert_eq!(sink.by_key()["k0"], (0..30).step_by(3).collect::<Vec<_>>());
}

/// A sink with a key's rows all in flight at once that answers for every
/// one, a failure or not (as a Kafka broker may deliver a key's later
/// records after refusing one).
#[derive(Clone, Default)]
struct AllInFlight(Recorder);

impl Sink for AllInFlight {
    async fn send(&self, row: &Outgoing) -> Result<(), SendError> {
        self.0.send(row).await
    }
    async fn send_in_order(&self, rows: &[&Outgoing]) -> Vec<Result<(), SendError>> {
        futures::future::join_all(rows.iter().map(|row| self.0.send(row))).await
    }
}

#[tokio::test]
async fn rows_delivered_after_their_keys_failed_row_are_published_and_counted_as_reordered() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 3, 0..30).await; // k0: 0, 3, 6, ..., 27; k1: 1, 4, ..., 28
    let sink = AllInFlight::default();
    sink.0.set(6, Some(Script::Retry));
    sink.0.set(7, Some(Script::Reject));
    let relay = Relay::new(&fx, sink.clone());
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed, pass.retried), (28, 1, 1));
    // k0's 7 rows after 6, and k1's 7 after 7, went ahead of them.
    assert_eq!(
        relay
            .stats()
            .reordered
            .load(std::sync::atomic::Ordering::Relaxed),
        14
    );
    assert_eq!(pending(&pool).await, 1);
    sink.0.set(6, None);
    relay.relay_all().await.expect("relay");
    assert_eq!(pending(&pool).await, 0);
    assert_eq!(sink.0.by_key()["k0"].last(), Some(&6));
}

#[tokio::test]
async fn a_refused_row_is_marked_failed_and_holds_its_key_back() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 2, 0..10).await; // k0: 0 2 4 6 8
    let sink = Recorder::default();
    sink.set(4, Some(Script::Reject));
    let relay = Relay::new(&fx, sink.clone());
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed), (7, 1));
    let (error,): (String,) = sqlx::query_as(
        "SELECT error FROM shop_fx.outbox WHERE failed_at IS NOT NULL AND payload = '4'",
    )
    .fetch_one(&pool)
    .await
    .expect("the failed row");
    assert_eq!(error, "scripted refusal");
    // k0's 6 and 8 wait behind it, pass after pass; k1 is done.
    relay.relay_all().await.expect("relay");
    assert_eq!(sink.by_key()["k0"], [0, 2]);
    assert_eq!(sink.by_key()["k1"], [1, 3, 5, 7, 9]);
    assert_eq!(pending(&pool).await, 2);
}

#[tokio::test]
async fn a_pass_cut_off_mid_send_publishes_nothing_and_blocks_no_other_relay_after() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 1, 0..5).await; // one key, one shard
    let shard = effectively::store::shard_of("k0");
    let stuck = Recorder::default();
    stuck.set(2, Some(Script::Hang));
    let first = Relay::new(&fx, stuck.clone());
    let other_sink = Recorder::default();
    let other = Relay::new(&fx, other_sink.clone());
    // While the first pass hangs on row 2 it holds the shard: the other
    // relay's pass is turned away.
    let cut = tokio::time::timeout(Duration::from_millis(1500), async {
        tokio::join!(first.relay_shard(shard), async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let pass = other.relay_shard(shard).await.expect("pass");
            assert!(pass.busy, "the shard is held by the hung pass");
        })
    })
    .await;
    assert!(cut.is_err(), "the hung pass was cut off");
    assert_eq!(stuck.sent(), [("k0".into(), 0), ("k0".into(), 1)]);
    // Nothing was marked; once the cut-off pass's session is gone the
    // other relay sends them all again, in order (at least once).
    assert_eq!(pending(&pool).await, 5);
    let mut published = 0;
    for _ in 0..50 {
        published += other.relay_shard(shard).await.expect("pass").published;
        if published == 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(published, 5);
    assert_eq!(other_sink.by_key()["k0"], [0, 1, 2, 3, 4]);
}

/// Rows of `shop_fx.outbox` read so far by this session (live rows fetched
/// through an index, rows a sequential scan read), its own counts flushed
/// first. `pool` has one connection, so the relay's passes are this
/// session's.
async fn outbox_reads(pool: &PgPool) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(pool)
        .await
        .expect("flush");
    sqlx::query_scalar(
        "SELECT coalesce(idx_tup_fetch, 0) + seq_tup_read FROM pg_stat_user_tables \
         WHERE relid = 'shop_fx.outbox'::regclass",
    )
    .fetch_one(pool)
    .await
    .expect("this session's reads")
}

/// A pass's claim walks each shard's pending rows by the pending index,
/// whatever the statistics say: taken while the backlog was all pending
/// (a relay back after a stop), or while the outbox was empty (a burst
/// after a quiet hour). Under the first, the claim walked the primary key
/// and read every row published before it, of every shard, per shard: a
/// 2,000-row claim on a 20,000-row backlog half published took 132 ms
/// instead of 5 (FINDINGS.md §26). The count is the session's reads, not a
/// time.
#[tokio::test]
async fn a_pass_reads_about_the_rows_it_claims_after_a_backlog_was_analyzed() {
    for analyzed_empty in [false, true] {
        let (db, _pool, _) = store().await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&db.url)
            .await
            .expect("connect");
        let fx = Effectively::postgres(pool.clone())
            .schema("shop_fx")
            .expect("schema name");
        if analyzed_empty {
            sqlx::query("ANALYZE shop_fx.outbox")
                .execute(&pool)
                .await
                .expect("analyze");
        }
        enqueue(&fx, 16_000, 0..16_000).await;
        if !analyzed_empty {
            sqlx::query("ANALYZE shop_fx.outbox")
                .execute(&pool)
                .await
                .expect("analyze");
        }
        let all: Vec<i16> = (0..16).collect();
        let relay = Relay::new(&fx, Recorder::default()).batch_size(2000);
        for _ in 0..3 {
            relay.relay_shards(&all).await.expect("a pass");
        }
        let before = outbox_reads(&pool).await;
        let pass = relay.relay_shards(&all).await.expect("a pass");
        let read = outbox_reads(&pool).await - before;
        let published = i64::try_from(pass.published).expect("a count");
        assert!(published > 1500, "{pass:?}");
        // At most the table once (the mark may scan it rather than probe
        // 2,000 ids of 16,000) and the claim's rows a few times over (each
        // shard's walk steps over the index entries of its rows published
        // since the last vacuum). Walking the primary key read, per shard,
        // every row published before and its share of the rest: 144,046.
        assert!(
            read <= 16_000 + 3 * published,
            "analyzed {}: a pass of {published} rows read {read} rows of the outbox",
            if analyzed_empty { "empty" } else { "full" }
        );
    }
}
