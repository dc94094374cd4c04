//! The partitioned inbox (`Effectively::partitioned_inbox`) against the real
//! PostgreSQL: claims judged by the window of its partitions, upkeep that
//! makes and drops them, a drop that waits for the claims in flight, and
//! consumers that share the partitions.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use effectively::store::{
    Handled, Handler, HandlerError, Inbox, InboxClaim, Message, Record, handle, handle_batch,
};
use effectively::v7::{minted_ago, minted_ahead};
use futures::future::BoxFuture;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::store::store;

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

async fn claim(pool: &PgPool, inbox: &Inbox, msg: &Message) -> InboxClaim {
    let mut tx = pool.begin().await.expect("begin");
    let claim = inbox.claim(&mut tx, msg).await.expect("claim");
    tx.commit().await.expect("commit");
    claim
}

/// A partitioned inbox of one-second partitions, kept `ahead` past the
/// clock, rows kept `retention`.
fn seconds(inbox: Inbox, retention: u64, ahead: u64) -> Inbox {
    inbox
        .partition(Duration::from_secs(1))
        .retention(Duration::from_secs(retention))
        .ahead(Duration::from_secs(ahead))
}

#[tokio::test]
async fn a_partitioned_inbox_claims_uuidv7_ids_once_and_refuses_what_its_partitions_cannot_hold() {
    let (_db, pool, fx) = store("shop_fx").await;
    let billing = fx.partitioned_inbox("billing");
    let msg = Message::v7(Uuid::now_v7(), b"p");
    // No partitions before the first upkeep: not refused, early.
    assert_eq!(claim(&pool, &billing, &msg).await, InboxClaim::Early);
    let done = billing.maintain_once(&pool).await.expect("upkeep");
    // From the nil uuid to the next midnight, and two days and the skew on.
    assert!(done.made >= 3, "{done:?}");
    assert!(done.dropped.is_empty(), "{done:?}");
    assert_eq!(
        billing.maintain_once(&pool).await.expect("upkeep").made,
        0,
        "made once"
    );

    assert_eq!(claim(&pool, &billing, &msg).await, InboxClaim::New);
    assert_eq!(claim(&pool, &billing, &msg).await, InboxClaim::Duplicate);
    let reused = Message::v7(msg.uuid().expect("a uuid"), b"other");
    assert_eq!(claim(&pool, &billing, &reused).await, InboxClaim::Conflict);
    // Another consumer's rows are its own.
    assert_eq!(
        claim(&pool, &fx.partitioned_inbox("audit"), &msg).await,
        InboxClaim::New
    );
    // Minted before this build knew of partitions: in the first partition.
    let old = Message::v7(minted_ago(Duration::from_secs(30 * 86_400)), b"p");
    assert_eq!(claim(&pool, &billing, &old).await, InboxClaim::New);
    // Not a UUID, or a UUID that is no UUIDv7 past the partitions: no
    // partition is for it.
    let text = Message::new("order-7", Utc::now(), b"p").expect("a valid message");
    assert_eq!(
        claim(&pool, &billing, &text).await,
        InboxClaim::Unrecordable
    );
    let v4 = Uuid::from_u128(0x6f1c_0b6e_8a1d_4c5e_9d3f_2b7a_1e0c_4d5f);
    let v4 = Message::new(v4, Utc::now(), b"p").expect("a valid message");
    assert_eq!(claim(&pool, &billing, &v4).await, InboxClaim::Unrecordable);
    // A UUID of no version inside the window is recorded like any other.
    let unversioned = Uuid::from_u128(Uuid::now_v7().as_u128() & !(0xf << 76));
    assert_eq!(unversioned.get_version_num(), 0);
    let unversioned = Message::new(unversioned, Utc::now(), b"p").expect("a valid message");
    assert_eq!(claim(&pool, &billing, &unversioned).await, InboxClaim::New);
    // Within the partitions made ahead: claimed.
    let soon = Message::v7(minted_ahead(Duration::from_secs(3600)), b"p");
    assert_eq!(claim(&pool, &billing, &soon).await, InboxClaim::New);
    // Past them: further ahead than the clock skew is refused; within a
    // (wide) skew it waits for its partition.
    let far = Message::v7(minted_ahead(Duration::from_secs(10 * 86_400)), b"p");
    assert_eq!(claim(&pool, &billing, &far).await, InboxClaim::Unrecordable);
    let patient = billing.clone().clock_skew(Duration::from_secs(30 * 86_400));
    assert_eq!(claim(&pool, &patient, &far).await, InboxClaim::Early);

    // A caller's own fingerprints; a row brought without one (empty) takes
    // every copy as a duplicate.
    let own = Uuid::now_v7();
    let fingerprinted = Message::v7_fingerprinted(own, &7_i64.to_be_bytes());
    assert_eq!(
        claim(&pool, &billing, &fingerprinted).await,
        InboxClaim::New
    );
    let other = Message::v7_fingerprinted(own, &8_i64.to_be_bytes());
    assert_eq!(claim(&pool, &billing, &other).await, InboxClaim::Conflict);
    let brought = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO shop_fx.partitioned_inbox (consumer, msg_id, payload_hash) VALUES ('billing', $1, '')",
    )
    .bind(brought)
    .execute(&pool)
    .await
    .expect("test step");
    let copy = Message::v7_fingerprinted(brought, &9_i64.to_be_bytes());
    assert_eq!(claim(&pool, &billing, &copy).await, InboxClaim::Duplicate);

    // One batch: the claims one after the other would answer.
    let fresh = Message::v7(Uuid::now_v7(), b"q");
    let mut tx = pool.begin().await.expect("begin");
    let claims = billing
        .claim_batch(
            &mut tx,
            &[
                fresh.clone(),
                text.clone(),
                msg.clone(),
                fresh.clone(),
                far.clone(),
                reused.clone(),
            ],
        )
        .await
        .expect("claim");
    tx.commit().await.expect("commit");
    assert_eq!(
        claims,
        [
            InboxClaim::New,
            InboxClaim::Unrecordable,
            InboxClaim::Duplicate,
            InboxClaim::Duplicate,
            InboxClaim::Unrecordable,
            InboxClaim::Conflict,
        ]
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM shop_fx.partitioned_inbox WHERE consumer = 'billing'"
        )
        .await,
        7
    );
}

#[tokio::test]
async fn upkeep_drops_whole_partitions_past_the_retention_and_a_later_copy_is_too_old() {
    let (_db, pool, fx) = store("shop_fx").await;
    let billing = seconds(fx.partitioned_inbox("billing"), 1, 4);
    billing.maintain_once(&pool).await.expect("upkeep");
    let msgs: Vec<Message> = (0..20)
        .map(|i| Message::v7(Uuid::now_v7(), format!("{i}").as_bytes()))
        .collect();
    let mut tx = pool.begin().await.expect("begin");
    let claims = billing.claim_batch(&mut tx, &msgs).await.expect("claim");
    tx.commit().await.expect("commit");
    assert!(claims.iter().all(|c| *c == InboxClaim::New), "{claims:?}");
    let parts = count(
        &pool,
        "SELECT count(*) FROM shop_fx.partitioned_inbox_parts",
    )
    .await;
    assert!(parts >= 4, "{parts} partitions");

    // Their partition (the first, up to the next second) is older than the
    // retention in two seconds and a bit.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let done = billing.maintain_once(&pool).await.expect("upkeep");
    assert!(!done.dropped.is_empty(), "{done:?}");
    assert!(done.made >= 2, "kept ahead: {done:?}");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM shop_fx.partitioned_inbox").await,
        0,
        "the rows went with their partitions"
    );
    // The tables went too, not only the list.
    let tables = count(
        &pool,
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'shop_fx.partitioned_inbox'::regclass",
    )
    .await;
    assert_eq!(
        tables,
        count(
            &pool,
            "SELECT count(*) FROM shop_fx.partitioned_inbox_parts"
        )
        .await
    );
    // Whether a copy was applied cannot be told: too old, not new.
    assert_eq!(claim(&pool, &billing, &msgs[0]).await, InboxClaim::TooOld);
    // A new message is claimed as ever.
    let now = Message::v7(Uuid::now_v7(), b"n");
    assert_eq!(claim(&pool, &billing, &now).await, InboxClaim::New);
}

#[tokio::test]
async fn a_drop_waits_for_the_claims_in_flight_so_no_copy_is_applied_twice() {
    let (_db, pool, fx) = store("shop_fx").await;
    let billing = seconds(fx.partitioned_inbox("billing"), 1, 4);
    billing.maintain_once(&pool).await.expect("upkeep");
    let msg = Message::v7(Uuid::now_v7(), b"p");
    tokio::time::sleep(Duration::from_millis(3200)).await;
    // A claim's transaction that has read the window, and not yet written,
    // when the message's partition expires (a caller routing its messages
    // before it claims them).
    let mut tx = pool.begin().await.expect("begin");
    let window = billing
        .window(&mut tx)
        .await
        .expect("window")
        .expect("partitioned");
    assert_eq!(window.judge(&msg, Duration::from_secs(300)), None);
    let drop = {
        let (pool, billing) = (pool.clone(), billing.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let done = billing.maintain_once(&pool).await.expect("upkeep");
            (done, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!drop.is_finished(), "the drop waits for the claim");
    assert_eq!(
        billing.claim(&mut tx, &msg).await.expect("claim"),
        InboxClaim::New
    );
    tx.commit().await.expect("commit");
    let (done, waited) = drop.await.expect("upkeep task");
    assert!(!done.dropped.is_empty(), "{done:?}");
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
    // The copy finds no row (dropped) and is refused, not applied again.
    assert_eq!(claim(&pool, &billing, &msg).await, InboxClaim::TooOld);
}

#[tokio::test]
async fn consumers_share_the_partitions_so_the_longest_retention_holds() {
    let (_db, pool, fx) = store("shop_fx").await;
    let brief = seconds(fx.partitioned_inbox("brief"), 1, 4);
    let patient = seconds(fx.partitioned_inbox("patient"), 3600, 4);
    brief.maintain_once(&pool).await.expect("upkeep");
    let msg = Message::v7(Uuid::now_v7(), b"p");
    assert_eq!(claim(&pool, &patient, &msg).await, InboxClaim::New);
    // The patient consumer records its retention at its upkeep.
    assert!(
        patient
            .maintain_once(&pool)
            .await
            .expect("upkeep")
            .dropped
            .is_empty()
    );
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let done = brief.maintain_once(&pool).await.expect("upkeep");
    assert!(
        done.dropped.is_empty(),
        "the patient one's hour holds: {done:?}"
    );
    assert_eq!(claim(&pool, &patient, &msg).await, InboxClaim::Duplicate);
}

/// A handler that records each record it applies.
fn recorder() -> Arc<Handler> {
    Arc::new(|tx: &mut PgConnection, record: &Record| {
        let work: BoxFuture<'_, Result<(), HandlerError>> = Box::pin(async move {
            sqlx::query("INSERT INTO effects (msg_id) VALUES ($1)")
                .bind(&record.msg_id)
                .execute(&mut *tx)
                .await?;
            Ok(())
        });
        work
    })
}

fn record(msg_id: String) -> Record {
    Record {
        source: "t/0/0".into(),
        key: None,
        payload: b"{}".to_vec(),
        headers: vec![],
        msg_id,
        sent_at: Utc::now(),
    }
}

#[tokio::test]
async fn the_handler_waits_for_a_partition_and_dead_letters_what_none_will_hold() {
    let (_db, pool, fx) = store("shop_fx").await;
    sqlx::query("CREATE TABLE effects (msg_id text)")
        .execute(&pool)
        .await
        .expect("test step");
    let billing = fx.partitioned_inbox("billing");
    let handler = recorder();
    let first = record(Uuid::now_v7().to_string());
    // No partitions yet: the batch is tried again later, nothing written.
    let early = handle(&fx, &billing, handler.as_ref(), &first).await;
    assert!(
        matches!(&early, Err(HandlerError::Retry(why)) if why.contains("Inbox::maintain")),
        "{early:?}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM effects").await, 0);
    billing.maintain_once(&pool).await.expect("upkeep");
    let batch = [
        first.clone(),
        record("order-7".into()),
        record(minted_ahead(Duration::from_secs(10 * 86_400)).to_string()),
        first.clone(),
    ];
    let handled = handle_batch(&fx, &billing, handler.as_ref(), &batch)
        .await
        .expect("handled");
    assert_eq!(handled[0], Handled::Applied);
    assert!(
        matches!(&handled[1], Handled::DeadLettered(why) if why.contains("not a UUID")),
        "{handled:?}"
    );
    assert!(
        matches!(&handled[2], Handled::DeadLettered(why) if why.contains("clock skew")),
        "{handled:?}"
    );
    assert_eq!(handled[3], Handled::Duplicate);
    assert_eq!(count(&pool, "SELECT count(*) FROM effects").await, 1);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM shop_fx.dead_letters").await,
        2
    );
}
