//! Idempotency keys: a stored response replayed, another request refused, a
//! retry while the first is in flight, expiry.

use std::time::Duration;

use effectively::idempotency::{Fingerprint, StoredResponse};
use effectively::store::KeyClaim;

use super::{key, store};

#[tokio::test]
async fn a_key_replays_its_stored_response_and_refuses_another_request() {
    let (_db, pool, fx) = store("shop_fx").await;
    let keys = fx.keys();
    let k = key("checkout-1");
    let fp = Fingerprint::new("shop.checkout v1", b"cart=1");
    let response = StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/carts/1".into()),
        ],
        body: b"{\"cart\":1}".to_vec(),
    };
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "alice", &k, &fp).await.expect("claim"),
        KeyClaim::New
    );
    keys.complete(&mut tx, "alice", &k, &fp, &response)
        .await
        .expect("complete");
    tx.commit().await.expect("commit");

    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "alice", &k, &fp).await.expect("claim"),
        KeyClaim::Replay(response.clone())
    );
    let other = Fingerprint::new("shop.checkout v1", b"cart=2");
    assert_eq!(
        keys.claim(&mut tx, "alice", &k, &other)
            .await
            .expect("claim"),
        KeyClaim::Mismatch
    );
    // Another caller's key of the same name is its own.
    assert_eq!(
        keys.claim(&mut tx, "bob", &k, &other).await.expect("claim"),
        KeyClaim::New
    );
    tx.rollback().await.expect("rollback");
    // A rollback freed bob's.
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "bob", &k, &fp).await.expect("claim"),
        KeyClaim::New
    );
    // Completing a key that is not this request's claim is refused.
    assert!(matches!(
        keys.complete(&mut tx, "alice", &k, &fp, &response).await,
        Err(sqlx::Error::RowNotFound)
    ));
    tx.rollback().await.expect("rollback");
    // A key committed without its response cannot be replayed.
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "carol", &k, &fp).await.expect("claim"),
        KeyClaim::New
    );
    tx.commit().await.expect("commit");
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "carol", &k, &fp).await.expect("claim"),
        KeyClaim::Unfinished
    );
}

#[tokio::test]
async fn a_retry_while_the_first_request_is_in_flight_waits_and_replays_it() {
    let (_db, pool, fx) = store("shop_fx").await;
    let keys = fx.keys();
    let k = key("checkout-2");
    let fp = Fingerprint::new("shop.checkout v1", b"cart=2");
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: b"made".to_vec(),
    };
    let mut first = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut first, "alice", &k, &fp)
            .await
            .expect("claim"),
        KeyClaim::New
    );
    let retry = {
        let (pool, keys, k) = (pool.clone(), keys.clone(), k.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.expect("begin");
            keys.claim(&mut tx, "alice", &k, &fp).await.expect("claim")
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !retry.is_finished(),
        "the retry must wait for the first request's transaction"
    );
    keys.complete(&mut first, "alice", &k, &fp, &response)
        .await
        .expect("complete");
    first.commit().await.expect("commit");
    assert_eq!(
        retry.await.expect("the statement"),
        KeyClaim::Replay(response)
    );
    // Expiry: nothing is past a day yet; past a second, the key goes.
    assert_eq!(
        keys.expire(&pool, Duration::from_secs(86_400), 10)
            .await
            .expect("expire"),
        0
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        keys.expire(&pool, Duration::from_secs(1), 10)
            .await
            .expect("expire"),
        1
    );
}
