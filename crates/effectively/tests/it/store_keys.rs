//! Idempotency keys claimed a batch at a time (`Keys::claim_batch`, the
//! schema's `claim_keys`): each request's answer, the response and the
//! reference stored at the claim, concurrent batches that share keys, and
//! the claim composed into a statement of the caller's own.

use effectively::idempotency::{Fingerprint, IdempotencyKey, StoredResponse};
use effectively::store::{KeyClaim, KeyRequest};
use rand::seq::SliceRandom;

use crate::store::{key, store};

fn response(body: &str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), format!("/carts/{body}")),
        ],
        body: body.as_bytes().to_vec(),
    }
}

#[tokio::test]
async fn a_batch_claim_answers_each_request_and_stores_what_it_is_given() {
    let (_db, pool, fx) = store("shop_fx").await;
    let keys = fx.keys();
    let (a, b, c) = (key("a"), key("b"), key("c"));
    let fp = |s: &str| Fingerprint::new("shop.checkout v1", s.as_bytes());
    let (fa, fb, fc, other) = (fp("a"), fp("b"), fp("c"), fp("other"));
    let (ra, rb) = (response("1"), response("2"));

    let mut tx = pool.begin().await.expect("begin");
    let first = keys
        .claim_batch(
            &mut tx,
            "alice",
            &[
                KeyRequest::new(&b, &fb).responding(&rb),
                KeyRequest::new(&a, &fa).responding(&ra).creating("cart-1"),
                // The same key again in the batch: judged against its first copy.
                KeyRequest::new(&a, &fa).responding(&ra).creating("cart-1"),
                KeyRequest::new(&b, &other),
                // No response at the claim: stored later, or never.
                KeyRequest::new(&c, &fc),
            ],
        )
        .await
        .expect("claim");
    assert_eq!(
        first,
        [
            KeyClaim::New,
            KeyClaim::New,
            KeyClaim::Replay(ra.clone()),
            KeyClaim::Mismatch,
            KeyClaim::New
        ]
    );
    tx.commit().await.expect("commit");
    let reference: Option<String> = sqlx::query_scalar(
        "SELECT reference FROM shop_fx.idempotency_keys WHERE scope = 'alice' AND key = 'a'",
    )
    .fetch_one(&pool)
    .await
    .expect("read");
    assert_eq!(reference.as_deref(), Some("cart-1"));

    let d = key("d");
    let fd = fp("d");
    let mut tx = pool.begin().await.expect("begin");
    let again = keys
        .claim_batch(
            &mut tx,
            "alice",
            &[
                KeyRequest::new(&a, &fa),
                KeyRequest::new(&b, &other),
                KeyRequest::new(&c, &fc),
                KeyRequest::new(&d, &fd),
            ],
        )
        .await
        .expect("claim");
    assert_eq!(
        again,
        [
            KeyClaim::Replay(ra.clone()),
            KeyClaim::Mismatch,
            KeyClaim::Unfinished,
            KeyClaim::New
        ]
    );
    // A rollback frees what the batch claimed, and only that.
    tx.rollback().await.expect("rollback");
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "alice", &d, &fd).await.expect("claim"),
        KeyClaim::New
    );
    // Another scope's key of the same name is another key.
    assert_eq!(
        keys.claim_batch(&mut tx, "bob", &[KeyRequest::new(&a, &other)])
            .await
            .expect("claim"),
        [KeyClaim::New]
    );
    assert_eq!(
        keys.claim_batch(&mut tx, "alice", &[])
            .await
            .expect("claim"),
        []
    );
    tx.commit().await.expect("commit");
}

#[tokio::test]
async fn concurrent_batches_sharing_keys_in_opposite_orders_claim_each_key_once() {
    let (_db, pool, fx) = store("shop_fx").await;
    let keys = fx.keys();
    let fp = Fingerprint::new("shop.checkout v1", b"same");
    let done = response("done");
    for round in 0..10 {
        let names: Vec<IdempotencyKey> = (0..100).map(|i| key(&format!("r{round}-{i}"))).collect();
        let mut forward: Vec<usize> = (0..names.len()).collect();
        forward.shuffle(&mut rand::rng());
        let backward: Vec<usize> = forward.iter().rev().copied().collect();
        let run = |order: Vec<usize>| {
            let (pool, keys, names, done) =
                (pool.clone(), keys.clone(), names.clone(), done.clone());
            tokio::spawn(async move {
                let requests: Vec<KeyRequest<'_>> = order
                    .iter()
                    .map(|i| KeyRequest::new(&names[*i], &fp).responding(&done))
                    .collect();
                let mut tx = pool.begin().await.expect("begin");
                let claims = keys
                    .claim_batch(&mut tx, "alice", &requests)
                    .await
                    .expect("no deadlock, no error");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                tx.commit().await.expect("commit");
                order.into_iter().zip(claims).collect::<Vec<_>>()
            })
        };
        let (one, two) = tokio::join!(run(forward), run(backward));
        let mut news = vec![0; names.len()];
        for (i, claim) in one.expect("task").into_iter().chain(two.expect("task")) {
            match claim {
                KeyClaim::New => news[i] += 1,
                KeyClaim::Replay(r) => assert_eq!(r, done),
                other => panic!("key {i}: {other:?}"),
            }
        }
        assert!(news.iter().all(|n| *n == 1), "round {round}: {news:?}");
    }
}

#[tokio::test]
async fn the_claim_composes_into_the_callers_own_statement() {
    let (_db, pool, fx) = store("shop_fx").await;
    sqlx::query("CREATE TABLE carts (id text PRIMARY KEY, idem_key text NOT NULL)")
        .execute(&pool)
        .await
        .expect("the caller's table");
    // Claim, write the new ones and answer, in one statement: one round
    // trip, one transaction.
    let sql = format!(
        "WITH c AS (SELECT * FROM {}('alice', $1, $2, $3, $4, $5, $1)), \
              made AS (INSERT INTO carts (id, idem_key) \
                       SELECT 'cart-' || k, k FROM unnest($1) WITH ORDINALITY AS u(k, n) \
                       JOIN c USING (n) WHERE c.claimed) \
         SELECT claimed, request_hash IS NOT NULL AS found FROM c ORDER BY n",
        fx.keys().claim_function()
    );
    let write = |batch: &[&str]| {
        let keys: Vec<String> = batch.iter().map(|k| (*k).to_owned()).collect();
        let hashes: Vec<Vec<u8>> = batch
            .iter()
            .map(|k| Fingerprint::new("c", k.as_bytes()).as_bytes().to_vec())
            .collect();
        let statuses: Vec<i16> = vec![201; batch.len()];
        let headers: Vec<serde_json::Value> = vec![serde_json::json!([]); batch.len()];
        let bodies: Vec<Vec<u8>> = batch.iter().map(|k| k.as_bytes().to_vec()).collect();
        let (pool, sql) = (pool.clone(), sql.clone());
        async move {
            sqlx::query_as::<_, (bool, bool)>(&sql)
                .bind(keys)
                .bind(hashes)
                .bind(statuses)
                .bind(headers)
                .bind(bodies)
                .fetch_all(&pool)
                .await
                .expect("the statement")
        }
    };
    assert_eq!(write(&["x", "y"]).await, [(true, false), (true, false)]);
    assert_eq!(
        write(&["y", "z", "x"]).await,
        [(false, true), (true, false), (false, true)]
    );
    let carts: Vec<String> = sqlx::query_scalar("SELECT id FROM carts ORDER BY id")
        .fetch_all(&pool)
        .await
        .expect("read");
    assert_eq!(carts, ["cart-x", "cart-y", "cart-z"]);
    // Arrays of different lengths are refused, never half-claimed.
    let err = sqlx::query(&format!(
        "SELECT * FROM {}('alice', '{{q}}', '{{}}', '{{}}', '{{}}', '{{}}', '{{}}')",
        fx.keys().claim_function()
    ))
    .execute(&pool)
    .await
    .expect_err("refused");
    assert!(err.to_string().contains("differ in length"), "{err}");
}
