//! The inbox's claims: once per consumer, a reused id, a batch, a rolled-back
//! effect, a copy in flight, expiry, and a copy sent again after its row expired.

use std::time::Duration;

use chrono::Utc;
use effectively::store::{Applied, InboxClaim, Message};
use uuid::Uuid;

use super::{count, store};

#[tokio::test]
async fn a_message_is_applied_once_per_consumer_and_a_reused_id_is_a_conflict() {
    let (_db, pool, fx) = store("shop_fx").await;
    sqlx::query("CREATE TABLE invoices (msg text, consumer text)")
        .execute(&pool)
        .await
        .expect("test step");
    let msg =
        Message::new("order-7/created", Utc::now(), b"{\"total\":10}").expect("a valid message");
    let billing = fx.inbox("billing");
    let apply = |inbox: effectively::store::Inbox, msg: Message| {
        let pool = pool.clone();
        async move {
            let consumer = inbox.consumer().to_owned();
            inbox
                .apply(&pool, &msg, |tx| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO invoices VALUES ($1, $2)")
                            .bind("order-7")
                            .bind(consumer)
                            .execute(&mut *tx)
                            .await?;
                        Ok::<_, sqlx::Error>(7)
                    })
                })
                .await
                .expect("test step")
        }
    };
    assert_eq!(apply(billing.clone(), msg.clone()).await, Applied::New(7));
    assert_eq!(
        apply(billing.clone(), msg.clone()).await,
        Applied::Duplicate
    );
    // Another consumer applies it once too.
    assert_eq!(apply(fx.inbox("audit"), msg.clone()).await, Applied::New(7));
    // The same id with another payload.
    let reused =
        Message::new("order-7/created", Utc::now(), b"{\"total\":11}").expect("a valid message");
    assert_eq!(apply(billing.clone(), reused).await, Applied::Conflict);
    // Older than the retention less its margin: cannot be told; refused.
    let old = Message::new(
        "order-8/created",
        Utc::now() - chrono::TimeDelta::days(8),
        b"{}",
    )
    .expect("a valid message");
    assert_eq!(apply(billing.clone(), old).await, Applied::TooOld);
    assert_eq!(count(&pool, "SELECT count(*) FROM invoices").await, 2);
    assert_eq!(count(&pool, "SELECT count(*) FROM shop_fx.inbox").await, 2);
}

#[tokio::test]
async fn a_batch_claim_answers_as_claims_one_after_the_other_would() {
    let (_db, pool, fx) = store("shop_fx").await;
    let billing = fx.inbox("billing");
    let m = |id: &str, body: &[u8]| Message::new(id, Utc::now(), body).expect("a valid message");
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        billing
            .claim(&mut tx, &m("seen", b"1"))
            .await
            .expect("claim"),
        InboxClaim::New
    );
    tx.commit().await.expect("commit");
    let old = Message::new("old", Utc::now() - chrono::TimeDelta::days(8), b"0")
        .expect("a valid message");
    let batch = [
        m("b", b"2"),
        m("seen", b"1"), // committed before, same payload
        m("a", b"3"),
        m("seen", b"other"), // committed before, another payload
        m("b", b"2"),        // a copy of the first, in the batch
        m("a", b"x"),        // the batch's own id, another payload
        old,
    ];
    let mut tx = pool.begin().await.expect("begin");
    let claims = billing.claim_batch(&mut tx, &batch).await.expect("claim");
    assert_eq!(
        claims,
        [
            InboxClaim::New,
            InboxClaim::Duplicate,
            InboxClaim::New,
            InboxClaim::Conflict,
            InboxClaim::Duplicate,
            InboxClaim::Conflict,
            InboxClaim::TooOld,
        ]
    );
    tx.commit().await.expect("commit");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM shop_fx.inbox WHERE consumer = 'billing'"
        )
        .await,
        3
    );
    let empty = billing
        .claim_batch(&mut pool.acquire().await.expect("conn"), &[])
        .await;
    assert_eq!(empty.expect("an empty batch"), []);
}

#[tokio::test]
async fn an_effect_that_fails_rolls_its_claim_back() {
    let (_db, pool, fx) = store("shop_fx").await;
    let inbox = fx.inbox("billing");
    let msg = Message::v7(Uuid::now_v7(), b"p");
    let failed: Result<Applied<()>, sqlx::Error> = inbox
        .apply(&pool, &msg, |tx| {
            Box::pin(async move {
                sqlx::query("SELECT 1/0").execute(&mut *tx).await?;
                Ok(())
            })
        })
        .await;
    assert!(failed.is_err());
    assert_eq!(count(&pool, "SELECT count(*) FROM shop_fx.inbox").await, 0);
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        inbox.claim(&mut tx, &msg).await.expect("claim"),
        InboxClaim::New
    );
}

#[tokio::test]
async fn a_copy_claimed_while_the_first_is_in_flight_waits_and_is_a_duplicate() {
    let (_db, pool, fx) = store("shop_fx").await;
    let inbox = fx.inbox("billing");
    let msg = Message::v7(Uuid::now_v7(), b"p");
    let mut first = pool.begin().await.expect("begin");
    assert_eq!(
        inbox.claim(&mut first, &msg).await.expect("claim"),
        InboxClaim::New
    );
    let second = {
        let (pool, inbox, msg) = (pool.clone(), inbox.clone(), msg.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.expect("begin");
            inbox.claim(&mut tx, &msg).await.expect("claim")
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the copy must wait for the first claim's transaction"
    );
    first.commit().await.expect("commit");
    assert_eq!(second.await.expect("the statement"), InboxClaim::Duplicate);
}

#[tokio::test]
async fn expiry_deletes_only_rows_past_the_retention() {
    let (_db, pool, fx) = store("shop_fx").await;
    let inbox = fx.inbox("billing").retention(Duration::from_secs(3600));
    let mut tx = pool.begin().await.expect("begin");
    for i in 0..30 {
        let m = Message::new(
            format!("m{i}"),
            Utc::now() - chrono::TimeDelta::minutes(30),
            b"",
        )
        .expect("a valid message");
        assert_eq!(
            inbox.claim(&mut tx, &m).await.expect("claim"),
            InboxClaim::New
        );
    }
    tx.commit().await.expect("commit");
    // Rows past an hour, as a claim an hour ago would have left them.
    sqlx::query(
        "UPDATE shop_fx.inbox SET sent_at = sent_at - interval '1 hour' WHERE msg_id < 'm2'",
    )
    .execute(&pool)
    .await
    .expect("test step");
    let old = count(
        &pool,
        "SELECT count(*) FROM shop_fx.inbox WHERE msg_id < 'm2'",
    )
    .await;
    assert_eq!(inbox.expire(&pool, 4).await.expect("expire"), old as u64);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM shop_fx.inbox").await,
        30 - old
    );
    // Another consumer's rows are its own to expire.
    assert_eq!(fx.inbox("audit").expire(&pool, 4).await.expect("expire"), 0);
}

/// Every copy of a message is judged by one time, the one its id carries:
/// a copy re-published (or re-signed) later carries a later timestamp of
/// its own, and judged by that it would be claimed again once the first
/// copy's row had expired.
#[tokio::test]
async fn a_copy_sent_again_after_the_first_copys_row_expired_is_not_applied_again() {
    use effectively::store::{Handled, Handler, HandlerError, Record, handle};
    use futures::future::BoxFuture;
    let (_db, pool, fx) = store("shop_fx").await;
    sqlx::query("CREATE TABLE invoices (msg text)")
        .execute(&pool)
        .await
        .expect("test step");
    let retention = Duration::from_secs(16);
    let inbox = fx.inbox("billing").retention(retention);
    let handler: Box<Handler> = Box::new(|tx, record| {
        let work: BoxFuture<'_, Result<(), HandlerError>> = Box::pin(async move {
            sqlx::query("INSERT INTO invoices VALUES ($1)")
                .bind(&record.msg_id)
                .execute(&mut *tx)
                .await?;
            Ok(())
        });
        work
    });
    // Minted (and first sent) 10 s ago: inside the retention less its
    // margin (14 s), so the first copy is applied.
    let id = effectively::v7::minted_ago(Duration::from_secs(10));
    let copy = |sent_at| Record {
        source: "test".to_owned(),
        key: None,
        payload: b"{}".to_vec(),
        headers: Vec::new(),
        msg_id: id.hyphenated().to_string(),
        sent_at,
    };
    let first = copy(Utc::now() - chrono::TimeDelta::seconds(10));
    assert_eq!(
        handle(&fx, &inbox, handler.as_ref(), &first)
            .await
            .expect("handled"),
        Handled::Applied
    );
    // Past the retention since it was minted: its row expires.
    tokio::time::sleep(Duration::from_millis(6_500)).await;
    assert_eq!(inbox.expire(&pool, 10).await.expect("expire"), 1);
    // A copy sent again now (a relay that re-published it, a webhook
    // re-signed for a retry) is not a new message.
    let again = copy(Utc::now());
    let outcome = handle(&fx, &inbox, handler.as_ref(), &again)
        .await
        .expect("handled");
    assert!(
        matches!(outcome, Handled::DeadLettered(ref why) if why.contains("longer ago")),
        "{outcome:?}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM invoices").await, 1);
}
