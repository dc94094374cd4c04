//! The outbox's NOTIFY: a new order wakes the relay, a replay does not, and
//! the trigger stays quiet for a session that turned it off.

use std::time::Duration;

use orders::store::InjectFault;
use pipeline::testing::TestDb;
use reqwest::StatusCode;
use sqlx::PgPool;

use super::{BODY, TestApp, counts, n};

/// A connection listening on the channel the relay is woken on.
async fn outbox_listener(db: &TestDb) -> sqlx::postgres::PgListener {
    let mut listener = sqlx::postgres::PgListener::connect(&db.url)
        .await
        .expect("listener");
    listener
        .listen(pipeline::outbox::NOTIFY_CHANNEL)
        .await
        .expect("listen");
    listener
}

/// The outbox's NOTIFY wakes the relay when a write inserts events, and only
/// then: a batch of replays inserts no outbox row, so it notifies no one.
#[tokio::test]
async fn a_new_order_notifies_the_relay_and_a_replay_does_not() {
    let db = TestDb::create().await;
    let app = TestApp::spawn(&db, InjectFault::None).await;
    let mut listener = outbox_listener(&db).await;
    let quiet = Duration::from_millis(500);

    assert_eq!(
        app.create("notify-1", BODY).await.status,
        StatusCode::CREATED
    );
    let woken = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await;
    let Ok(Ok(notification)) = woken else {
        panic!("a new order notifies: {woken:?}");
    };
    // It names the relay shard of the order's outbox row, and no other.
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let shard: i16 = sqlx::query_scalar("SELECT shard FROM orders.outbox")
        .fetch_one(&pool)
        .await
        .expect("shard");
    assert_eq!(
        notification.payload(),
        pipeline::outbox::shards_payload(1 << shard),
        "the NOTIFY names shard {shard}"
    );
    for _ in 0..3 {
        assert_eq!(
            app.create("notify-1", BODY).await.status,
            StatusCode::CREATED
        );
    }
    let after_replays = tokio::time::timeout(quiet, listener.recv()).await;
    assert!(
        after_replays.is_err(),
        "replays notify nobody: {after_replays:?}"
    );
    assert_eq!(counts(&db).await, n(1));
    app.stop().await;
}

/// The outbox trigger wakes the relay on the commit of any session that
/// inserts outbox rows, except a session that turned it off
/// (`effectively.outbox_notify = off`, as Orders' sessions do: its
/// `Notifier` wakes the relay instead, outside the write transactions).
#[tokio::test]
async fn the_outbox_trigger_notifies_unless_the_session_turned_it_off() {
    use sqlx::ConnectOptions;
    let db = TestDb::create().await;
    let mut listener = outbox_listener(&db).await;
    let options: sqlx::postgres::PgConnectOptions = db.url.parse().expect("url");
    let insert = "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
                  VALUES (gen_random_uuid(), gen_random_uuid(), 'order.created', '\\x7b7d')";

    let mut quiet = options
        .clone()
        .options([(pipeline::outbox::NOTIFY_SETTING, "off")])
        .connect()
        .await
        .expect("connect with the NOTIFY off");
    sqlx::query(insert)
        .execute(&mut quiet)
        .await
        .expect("insert");
    let heard = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await;
    assert!(heard.is_err(), "a session with the NOTIFY off: {heard:?}");

    let mut plain = options.connect().await.expect("connect");
    sqlx::query(insert)
        .execute(&mut plain)
        .await
        .expect("insert");
    let heard = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await;
    assert!(matches!(heard, Ok(Ok(_))), "any other session: {heard:?}");
}
