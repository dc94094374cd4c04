//! LISTEN/NOTIFY wake-ups: a lost LISTEN connection re-established, a NOTIFY
//! naming shards, a batch's held-back events going out without another NOTIFY.

use std::time::Duration;

use pipeline::outbox::{NOTIFY_CHANNEL, NOTIFY_SETTING, Outbox, OutboxMessage, shards_payload};
use pipeline::testing::{Service, TestDb, TestTopic, eventually};
use sqlx::PgPool;
use uuid::Uuid;

use super::{config, fill_outbox, pending, per_key_sequences, seq_event, spawn_relay};

/// The backend holding the relay's LISTEN on this test's database.
async fn listener_pid(pool: &PgPool) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity \
         WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
    )
    .fetch_optional(pool)
    .await
    .expect("pg_stat_activity")
}

/// The relay's LISTEN connection is cut three times (its backend
/// terminated): each time it is re-established after one failure (a backoff,
/// not a tight loop), and a new row is published on its NOTIFY — the poll
/// interval is a minute, so nothing else could find it in time.
#[tokio::test]
async fn a_lost_listen_connection_is_reestablished_and_wakes_the_relay_again() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let mut cfg = config(&db, &topic, 1, 10);
    cfg.poll_interval_ms = 60_000;
    let relay = spawn_relay(cfg).await;
    let listen_errors = || relay.metric("relay_errors_total{stage=\"listen\"}");

    let mut pid = None;
    for round in 0..=3 {
        assert!(
            eventually(Duration::from_secs(10), || async {
                let now = listener_pid(&pool).await;
                now.is_some() && now != pid
            })
            .await,
            "round {round}: a new LISTEN connection"
        );
        pid = listener_pid(&pool).await;
        // Past the startup pass and the reconnect's own pass: only a NOTIFY
        // can wake the relay for the next row.
        tokio::time::sleep(Duration::from_millis(300)).await;
        fill_outbox(&pool, &[Uuid::now_v7()], 1).await;
        assert!(
            eventually(Duration::from_secs(10), || async {
                pending(&pool).await == 0
            })
            .await,
            "round {round}: the row is published on its NOTIFY"
        );
        assert_eq!(
            listen_errors().await,
            f64::from(round),
            "one failure per cut"
        );
        if round < 3 {
            let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .fetch_one(&pool)
                .await
                .expect("terminate");
            assert!(killed);
        }
    }
    let topic_messages = topic.read_all(4, Duration::from_secs(20)).await;
    assert_eq!(topic_messages.len(), 4);
    relay.stop().await;
}

/// A relay (4 workers, batches of 10) whose poll is a minute away, once it
/// listens and its startup pass is over: only a NOTIFY can wake a loop now.
async fn relay_woken_by_notify_alone(db: &TestDb, topic: &TestTopic, pool: &PgPool) -> Service {
    let mut cfg = config(db, topic, 4, 10);
    cfg.poll_interval_ms = 60_000;
    let relay = spawn_relay(cfg).await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            listener_pid(pool).await.is_some()
        })
        .await,
        "the relay listens"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay
}

/// A NOTIFY that names shards (orders' `Notifier`) wakes only those
/// shards' loops: a row of another shard waits (the poll interval is a
/// minute) until a NOTIFY names its shard; the trigger's NOTIFY, which names
/// none, wakes every shard.
#[tokio::test]
async fn a_notify_naming_shards_wakes_only_their_loops() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let relay = relay_woken_by_notify_alone(&db, &topic, &pool).await;
    let notify = |mask: u16| {
        let pool = pool.clone();
        async move {
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(NOTIFY_CHANNEL)
                .bind(shards_payload(mask))
                .execute(&pool)
                .await
                .expect("notify");
        }
    };

    // A row written as orders writes them: the trigger's NOTIFY off.
    let mut conn = pool.acquire().await.expect("acquire");
    sqlx::query(&format!("SET {NOTIFY_SETTING} = off"))
        .execute(&mut *conn)
        .await
        .expect("set");
    Outbox
        .enqueue_batch(&mut conn, &[seq_event(Uuid::now_v7(), 0)])
        .await
        .expect("enqueue");
    let shard: i16 = sqlx::query_scalar("SELECT shard FROM orders.outbox")
        .fetch_one(&pool)
        .await
        .expect("shard");
    // The next shard is in the other group at the default 2 groups, as at 16.
    let other = (shard + 1) % 16;
    notify(1 << other).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        pending(&pool).await,
        1,
        "a NOTIFY of shard {other} leaves the row of shard {shard}"
    );
    notify((1 << shard) | (1 << other)).await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            pending(&pool).await == 0
        })
        .await,
        "a NOTIFY naming shard {shard} publishes its row"
    );

    // The trigger's NOTIFY (an empty payload) wakes whatever shard it is.
    fill_outbox(&pool, &[Uuid::now_v7()], 1).await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            pending(&pool).await == 0
        })
        .await,
        "the trigger's NOTIFY wakes every shard"
    );
    assert_eq!(topic.read_all(2, Duration::from_secs(20)).await.len(), 2);
    relay.stop().await;
}

/// A loop that published a partial batch waits for its shard's next NOTIFY,
/// except when the batch held back later events of its keys: those become
/// claimable when it commits, with no NOTIFY to say so, and go out at once.
/// Five events of one key in one transaction and one NOTIFY, with the poll a
/// minute away: all five are published within seconds, in order.
#[tokio::test]
async fn later_events_of_a_batchs_keys_go_out_without_another_notify() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let relay = relay_woken_by_notify_alone(&db, &topic, &pool).await;
    let key = Uuid::now_v7();
    let mut tx = pool.begin().await.expect("begin");
    let events: Vec<OutboxMessage> = (0..5).map(|seq| seq_event(key, seq)).collect();
    Outbox
        .enqueue_batch(&mut tx, &events)
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit"); // the trigger's NOTIFY, once
    assert!(
        eventually(Duration::from_secs(10), || async {
            pending(&pool).await == 0
        })
        .await,
        "every event of the key published without a poll: {} pending",
        pending(&pool).await
    );
    let messages = topic.read_all(5, Duration::from_secs(20)).await;
    let (seqs, _) = per_key_sequences(&messages);
    assert_eq!(seqs.get(&key.to_string()), Some(&vec![0, 1, 2, 3, 4]));
    relay.stop().await;
}
