//! `Relay::run`: two relays at once keep each key in order; a commit's
//! `NOTIFY` wakes a relay before its poll.

use std::time::Duration;

use effectively::store::Relay;
use tokio_util::sync::CancellationToken;

use super::{Recorder, ascending, enqueue, pending, store};

#[tokio::test]
async fn two_relays_at_once_keep_each_key_in_order() {
    let (_db, pool, fx) = store().await;
    let sink = Recorder::default();
    let a = Relay::new(&fx, sink.clone())
        .batch_size(7)
        .poll_every(Duration::from_millis(20));
    let b = Relay::new(&fx, sink.clone())
        .batch_size(5)
        .poll_every(Duration::from_millis(20));
    let cancel = CancellationToken::new();
    let writer = async {
        for chunk in 0..20 {
            enqueue(&fx, 11, chunk * 50..(chunk + 1) * 50).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for _ in 0..200 {
            if pending(&pool).await == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cancel.cancel();
    };
    tokio::join!(a.run(cancel.clone()), b.run(cancel.clone()), writer);
    assert_eq!(pending(&pool).await, 0);
    let by_key = sink.by_key();
    let total: usize = by_key.values().map(Vec::len).sum();
    assert_eq!(total, 1000, "each row sent once (no pass was cut off)");
    for (key, ns) in &by_key {
        assert!(ascending(ns), "{key}: {ns:?}");
    }
    assert!(
        a.stats()
            .published
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
    assert!(
        b.stats()
            .published
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
    );
}

#[tokio::test]
async fn a_commit_wakes_the_relay_without_waiting_for_its_poll() {
    let (_db, pool, fx) = store().await;
    let sink = Recorder::default();
    let relay = Relay::new(&fx, sink.clone()).poll_every(Duration::from_secs(3600));
    let cancel = CancellationToken::new();
    let run = relay.run(cancel.clone());
    let check = async {
        // Its first pass finds nothing; then it waits on the NOTIFY.
        tokio::time::sleep(Duration::from_millis(500)).await;
        enqueue(&fx, 1, 0..3).await;
        let mut woke = false;
        for _ in 0..100 {
            if pending(&pool).await == 0 {
                woke = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cancel.cancel();
        woke
    };
    let ((), woke) = tokio::join!(run, check);
    assert!(
        woke,
        "the rows were published within 5 s, with the poll an hour away"
    );
}
