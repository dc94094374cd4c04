//! Delivery: every row signed to every destination in per-key order (and
//! delivered deliveries expiring), a sender killed after the 2xx delivering
//! again, a row that is not JSON holding back only its key.

use std::process::Stdio;
use std::time::Duration;

use pipeline::db::ServiceRole;
use pipeline::outbox::{Outbox, OutboxMessage};
use pipeline::testing::{TestDb, eventually};
use sqlx::PgPool;
use uuid::Uuid;

use super::{OPEN, Receiver, Reply, config, count, delivered_order, enqueue, spawn_relay};

#[tokio::test]
async fn every_row_is_delivered_signed_to_every_destination_in_per_key_order() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (a, a_url) = Receiver::start(|_| Reply::OK).await;
    let (b, b_url) = Receiver::start(|_| Reply::OK).await;
    let keys: Vec<Uuid> = (0..6).map(|_| Uuid::now_v7()).collect();
    for seq in 0..10 {
        for key in &keys {
            enqueue(&pool, *key, seq).await;
        }
    }
    let relay = spawn_relay(config(
        &db,
        vec![
            a.destination("a", &a_url, ",concurrency=8"),
            b.destination("b", &b_url, ",concurrency=3"),
        ],
        1.0,
    ))
    .await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            a.hits().len() >= 60 && b.hits().len() >= 60 && count(&pool, OPEN).await == 0
        })
        .await,
        "delivered: a {}, b {}",
        a.hits().len(),
        b.hits().len()
    );
    for (name, r) in [("a", &a), ("b", &b)] {
        let hits = r.hits();
        assert_eq!(hits.len(), 60, "{name}: each event once (none failed)");
        assert!(
            hits.iter().all(|h| h.authentic),
            "{name}: every request signed"
        );
        for (key, seqs) in delivered_order(&hits) {
            assert_eq!(
                seqs,
                (0..10).collect::<Vec<_>>(),
                "{name}: key {key} in order"
            );
        }
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.outbox WHERE published_at IS NULL"
        )
        .await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders.webhook_deliveries WHERE delivered_at IS NOT NULL AND attempts = 1 AND last_status = 200").await,
        120
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.webhook_attempts WHERE outcome = 'delivered'"
        )
        .await,
        120
    );
    assert_eq!(relay.metric("relay_webhook_fanned_out_total").await, 120.0);
    assert_eq!(
        relay
            .metric(r#"relay_webhook_attempts_total{destination="b",outcome="delivered"}"#)
            .await,
        60.0
    );
    relay.stop().await;

    // Delivered deliveries expire with their attempts after the outbox
    // retention (here a millisecond), as the relay's role; an open one stays.
    enqueue(&pool, keys[0], 10).await;
    sqlx::query(
        "INSERT INTO orders.webhook_deliveries (destination, outbox_id, aggregate_id, msg_id, body) \
         SELECT 'a', id, aggregate_id, msg_id, payload FROM orders.outbox WHERE published_at IS NULL",
    )
    .execute(&pool)
    .await
    .expect("an open delivery");
    sqlx::query("UPDATE orders.outbox_policy SET retention = interval '1 millisecond'")
        .execute(&pool)
        .await
        .expect("retention");
    let as_relay = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as relay");
    let mut expired = 0;
    loop {
        let n = relay::webhooks::expire(&as_relay, 50)
            .await
            .expect("expire");
        expired += n;
        if n < 50 {
            break;
        }
    }
    assert_eq!(expired, 120);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders.webhook_attempts").await,
        0
    );
    assert_eq!(count(&pool, OPEN).await, 1, "the open delivery stays");
}

/// The relay binary SIGKILLs itself after a 2xx and before marking the
/// delivery (crash point `deliver`): the next life delivers it again, so the
/// receiver sees it twice (its inbox makes that a no-op), and nothing is
/// lost.
#[tokio::test]
async fn a_sender_killed_after_the_2xx_delivers_again() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let key = Uuid::now_v7();
    for seq in 0..3 {
        enqueue(&pool, key, seq).await;
    }
    let (r, url) = Receiver::start(|_| Reply::OK).await;
    let spawn = |crash: bool| {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_relay"));
        child
            .env("DATABASE_URL", db.url_as(ServiceRole::Relay))
            .env("RELAY_SINK", "http")
            .env(
                "RELAY_WEBHOOK_DESTINATIONS",
                format!(
                    "r={url},secret={},timeout=1s,allow-http",
                    r.secret.to_whsec()
                ),
            )
            .env("RELAY_WEBHOOK_ALLOW_ADDRESSES", "127.0.0.1")
            .env("RELAY_METRICS_ADDR", "127.0.0.1:0")
            .env("RELAY_POLL_INTERVAL_MS", "100")
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        if crash {
            child.env("CRASH_POINT", "deliver").env("CRASH_EVERY", "1");
        }
        child.spawn().expect("spawn relay")
    };
    let mut dying = spawn(true);
    let status = tokio::time::timeout(Duration::from_secs(30), dying.wait())
        .await
        .expect("dies at its crash point")
        .expect("wait");
    assert!(!status.success());
    assert_eq!(r.hits().len(), 1, "the first event reached the receiver");
    // The lease (timeout 1 s + 5 s) runs out, then the next life sends it again.
    let mut next = spawn(false);
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, OPEN).await == 0
        })
        .await
    );
    next.kill().await.expect("kill");
    let hits = r.hits();
    assert_eq!(hits.len(), 4, "the first event twice, then the others");
    assert_eq!(hits[0].msg_id, hits[1].msg_id);
    assert_eq!(delivered_order(&hits)[&key], vec![0, 1, 2]);
}

/// A key's backlog moves to the deliveries in one pass (every row of a key
/// the shard's read holds), but a row that is not JSON fails at once
/// (`--sink http` gives it one attempt: no retry makes it JSON) and holds
/// back its key's later rows, pending and never delivered; the rows before
/// it and every other key's are delivered in order.
#[tokio::test]
async fn a_row_that_is_not_json_fails_and_holds_back_only_its_key() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (bad, good) = (Uuid::now_v7(), Uuid::now_v7());
    for seq in 0..3 {
        enqueue(&pool, bad, seq).await;
    }
    let mut conn = pool.acquire().await.expect("acquire");
    Outbox
        .enqueue_batch(
            &mut conn,
            &[OutboxMessage {
                aggregate_id: bad,
                msg_id: Uuid::now_v7(),
                event_type: "test.event".into(),
                payload: b"\xff{ not json".to_vec(),
            }],
        )
        .await
        .expect("enqueue");
    drop(conn);
    for seq in 4..6 {
        enqueue(&pool, bad, seq).await;
    }
    for seq in 0..20 {
        enqueue(&pool, good, seq).await;
    }
    let (r, url) = Receiver::start(|_| Reply::OK).await;
    let relay = spawn_relay(config(&db, vec![r.destination("r", &url, "")], 1.0)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            r.hits().len() >= 23 && count(&pool, OPEN).await == 0
        })
        .await,
        "delivered {}",
        r.hits().len()
    );
    let order = delivered_order(&r.hits());
    assert_eq!(order[&bad], vec![0, 1, 2], "up to the row that is not JSON");
    assert_eq!(order[&good], (0..20).collect::<Vec<_>>());
    let rows: Vec<(i32, Option<String>, bool)> = sqlx::query_as(
        "SELECT attempts, last_error, failed_at IS NOT NULL FROM orders.outbox \
         WHERE published_at IS NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("rows");
    assert_eq!(rows.len(), 3, "the bad row and the two behind it");
    assert_eq!(
        (rows[0].0, rows[0].2),
        (1, true),
        "failed on its one attempt"
    );
    assert!(
        rows[0].1.as_deref().unwrap_or("").contains("not JSON"),
        "{:?}",
        rows[0].1
    );
    assert!(
        rows[1..].iter().all(|row| (row.0, row.2) == (0, false)),
        "held back, never tried: {rows:?}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders.webhook_deliveries").await,
        23
    );
    assert_eq!(relay.metric("relay_rows_failed_total").await, 1.0);
    assert_eq!(relay.metric("relay_published_total").await, 23.0);
    relay.stop().await;
}
