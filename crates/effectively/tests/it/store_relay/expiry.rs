//! What the outbox keeps: a relay that keeps no published row, the backlog
//! and its failed rows released, published rows expired by hand and by run.

use std::sync::Arc;
use std::time::Duration;

use effectively::store::Relay;
use tokio_util::sync::CancellationToken;

use super::{Recorder, Script, enqueue, pending, store};

#[tokio::test]
async fn a_relay_that_keeps_no_published_row_deletes_what_it_delivered_and_keeps_the_rest() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 3, 0..12).await; // k0: 0 3 6 9, k1: 1 4 7 10, k2: 2 5 8 11
    let sink = Recorder::default();
    sink.set(4, Some(Script::Retry));
    sink.set(5, Some(Script::Reject));
    let relay = Relay::new(&fx, sink.clone()).keep_published(Some(Duration::ZERO));
    let pass = relay.relay_all().await.expect("relay");
    assert_eq!((pass.published, pass.failed), (6, 1), "{pass:?}");
    let left: Vec<(String, bool)> = sqlx::query_as(
        "SELECT convert_from(payload, 'UTF8'), failed_at IS NOT NULL FROM shop_fx.outbox ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("the rows left");
    // The delivered rows are gone; the retried one and its key's later
    // rows wait, the refused one is kept failed with its key's later rows.
    let left: Vec<(&str, bool)> = left.iter().map(|(p, f)| (p.as_str(), *f)).collect();
    assert_eq!(
        left,
        [
            ("4", false),
            ("5", true),
            ("7", false),
            ("8", false),
            ("10", false),
            ("11", false)
        ]
    );
    sink.set(4, None);
    assert_eq!(relay.relay_all().await.expect("relay").published, 3);
    assert_eq!(sink.by_key()["k1"], [1, 4, 7, 10]);
    assert_eq!(pending(&pool).await, 2, "k2's 8 and 11 wait behind 5");
}

#[tokio::test]
async fn the_backlog_shows_what_waits_a_released_row_goes_first_and_published_rows_expire() {
    let (_db, pool, fx) = store().await;
    let outbox = fx.outbox();
    let empty = outbox.backlog(&pool).await.expect("backlog");
    assert_eq!(
        (empty.pending, empty.failed, empty.oldest_pending),
        (0, 0, None)
    );
    enqueue(&fx, 2, 0..10).await; // k0: 0 2 4 6 8
    sqlx::query("UPDATE shop_fx.outbox SET created_at = created_at - interval '1 hour'")
        .execute(&pool)
        .await
        .expect("age the rows");
    let waiting = outbox.backlog(&pool).await.expect("backlog");
    assert_eq!((waiting.pending, waiting.failed), (10, 0));
    assert!(
        waiting.oldest_pending >= Some(Duration::from_secs(3600)),
        "{waiting:?}"
    );

    let sink = Recorder::default();
    sink.set(4, Some(Script::Reject));
    let relay = Relay::new(&fx, sink.clone());
    relay.relay_all().await.expect("relay");
    let after = outbox.backlog(&pool).await.expect("backlog");
    assert_eq!(
        (after.pending, after.failed),
        (2, 1),
        "k0's 6 and 8 behind 4"
    );
    let failed = outbox.failed(&pool, 10).await.expect("failed");
    assert_eq!(failed.len(), 1);
    assert_eq!(
        (failed[0].key.as_str(), failed[0].error.as_deref()),
        ("k0", Some("scripted refusal"))
    );

    // Published rows older than what is kept go; the failed and the pending
    // ones stay, whatever their age.
    assert_eq!(
        outbox
            .expire(&pool, Duration::from_secs(7200), 2)
            .await
            .expect("expire"),
        0
    );
    assert_eq!(
        outbox
            .expire(&pool, Duration::from_secs(60), 2)
            .await
            .expect("expire"),
        7
    );
    let left: Vec<String> =
        sqlx::query_scalar("SELECT convert_from(payload, 'UTF8') FROM shop_fx.outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("rows");
    assert_eq!(left, ["4", "6", "8"]);

    // Released (the destination was fixed), 4 goes, then its key's 6 and 8.
    sink.set(4, None);
    assert_eq!(
        outbox
            .release(&pool, &[failed[0].id, failed[0].id + 1000])
            .await
            .expect("release"),
        1
    );
    relay.relay_all().await.expect("relay");
    assert_eq!(sink.by_key()["k0"], [0, 2, 4, 6, 8]);
    let done = outbox.backlog(&pool).await.expect("backlog");
    assert_eq!(
        (done.pending, done.failed, done.oldest_pending),
        (0, 0, None)
    );
}

#[tokio::test]
async fn run_expires_published_rows_it_is_told_not_to_keep() {
    let (_db, pool, fx) = store().await;
    enqueue(&fx, 3, 0..6).await;
    sqlx::query("UPDATE shop_fx.outbox SET created_at = created_at - interval '2 days'")
        .execute(&pool)
        .await
        .expect("age the rows");
    let sink = Recorder::default();
    let relay = Arc::new(
        Relay::new(&fx, sink.clone()).keep_published(Some(Duration::from_secs(24 * 3600))),
    );
    let cancel = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, cancel) = (relay.clone(), cancel.clone());
        async move { relay.run(cancel).await }
    });
    // Published in its first pass, expired in its first expiry after it (a
    // minute later, or at once on a relay started on an old backlog) or,
    // as here, by the next run.
    let published =
        pipeline::testing::eventually(Duration::from_secs(10), || async { sink.sent().len() == 6 })
            .await;
    assert!(published);
    cancel.cancel();
    running.await.expect("run ends");
    let again = Arc::new(
        Relay::new(&fx, sink.clone()).keep_published(Some(Duration::from_secs(24 * 3600))),
    );
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let running = tokio::spawn({
        let again = again.clone();
        async move { again.run(cancel).await }
    });
    let gone = pipeline::testing::eventually(Duration::from_secs(10), || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM shop_fx.outbox")
            .fetch_one(&pool)
            .await
            .expect("count")
            == 0
    })
    .await;
    stop.cancel();
    running.await.expect("run ends");
    assert!(gone, "the published rows were expired");
    // Each row expired once: by the first run's expiry if its passes had
    // published it by then (they run side by side), else by the second's.
    let expired =
        |r: &Relay<Recorder>| r.stats().expired.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(expired(&relay) + expired(&again), 6);
}
