//! The relay binary killed between publish and mark (both modes), or hung
//! inside a shard's transaction: nothing lost, every key in order.

use std::collections::HashSet;
use std::process::Stdio;
use std::time::Duration;

use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, TestTopic, eventually};
use relay::Mode;
use sqlx::PgPool;
use uuid::Uuid;

use super::{
    assert_first_occurrences_in_order, config, drop_slot, fill_outbox, pending, per_key_sequences,
    spawn_relay, wait_for_slot,
};

/// The relay binary on `db` and `topic` (one worker, batches of 10, metrics
/// on a free port, output discarded, killed when dropped), with `extra`
/// settings (crash point, timeouts).
fn relay_child(db: &TestDb, topic: &TestTopic, extra: &[(&str, &str)]) -> tokio::process::Child {
    let mut relay = tokio::process::Command::new(env!("CARGO_BIN_EXE_relay"));
    relay
        .env("DATABASE_URL", db.url_as(ServiceRole::Relay))
        .env("KAFKA_BOOTSTRAP_SERVERS", &topic.bootstrap_servers)
        .env("KAFKA_TOPIC", &topic.name)
        .env("RELAY_METRICS_ADDR", "127.0.0.1:0")
        .env("RELAY_BATCH_SIZE", "10")
        .env("RELAY_WORKERS", "1")
        .envs(extra.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    relay.spawn().expect("spawn relay")
}

/// The relay binary SIGKILLs itself after the broker acked a batch and before
/// marking it (crash point `publish`), again and again; restarted each time,
/// it loses nothing, re-publishes the unmarked batch, and keeps key order.
#[tokio::test]
async fn relay_killed_between_publish_and_mark_loses_nothing() {
    killed_between_publish_and_mark(Mode::Poll).await;
}

/// The WAL relay killed after the broker's acks, before its marks and the
/// slot's confirmation: the next life re-reads the stream from the confirmed
/// position (and drains what is pending): nothing lost, every key in order.
#[tokio::test]
async fn wal_relay_killed_between_publish_and_mark_loses_nothing() {
    killed_between_publish_and_mark(Mode::Wal).await;
}

async fn killed_between_publish_and_mark(mode: Mode) {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..30).map(|_| Uuid::now_v7()).collect();
    let mode_env = match mode {
        Mode::Poll => "poll",
        Mode::Wal => "wal",
    };
    let crashing = [
        ("CRASH_POINT", "publish"),
        ("CRASH_EVERY", "3"),
        ("RUST_LOG", "warn"),
        ("RELAY_MODE", mode_env),
    ];
    let mut first = None;
    match mode {
        Mode::Poll => fill_outbox(&pool, &keys, 4).await,
        // The rows arrive while the first life streams, so they come from
        // the WAL (later lives also drain what is pending at their start).
        Mode::Wal => {
            first = Some(relay_child(&db, &topic, &crashing));
            wait_for_slot(&pool, &db, true).await;
            fill_outbox(&pool, &keys, 4).await;
        }
    }

    let mut kills = 0;
    for _ in 0..40 {
        if pending(&pool).await == 0 {
            break;
        }
        let mut child = first
            .take()
            .unwrap_or_else(|| relay_child(&db, &topic, &crashing));
        // It dies at its crash point, or (fewer than 3 batches left) drains
        // and idles: then stop it.
        let drained = eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        });
        tokio::select! {
            status = child.wait() => {
                assert!(!status.expect("wait").success(), "killed by its crash point");
                kills += 1;
            }
            done = drained => {
                assert!(done, "the relay neither crashed nor drained within 60 s");
                child.kill().await.expect("kill");
                break;
            }
        }
    }
    // A final life without the crash point, in-process, finishes any rest.
    let mut cfg = config(&db, &topic, 1, 10);
    cfg.mode = mode;
    let relay = spawn_relay(cfg).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await
    );
    relay.stop().await;
    if mode == Mode::Wal {
        drop_slot(&pool, &db).await;
    }
    assert!(
        kills >= 3,
        "the relay was killed mid-stream ({kills} times)"
    );

    let messages = topic.read_all(usize::MAX, Duration::from_secs(10)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    let distinct: HashSet<Uuid> = msg_ids.iter().copied().collect();
    assert_eq!(distinct.len(), 120, "every event published at least once");
    assert!(
        msg_ids.len() > distinct.len(),
        "the unmarked batches were re-published ({} messages, {} distinct)",
        msg_ids.len(),
        distinct.len()
    );
    assert_first_occurrences_in_order(&seqs, 4);
}

/// A relay that hangs (SIGSTOP at crash point `publish`, inside a group's
/// transaction, holding its shards' locks) loses them within its
/// idle-in-transaction limit: the server ends the session, the locks go
/// with it, and another relay publishes the shards. When the hung one is
/// continued, its transaction is gone, so it cannot mark anything.
#[tokio::test]
async fn a_hung_relay_loses_its_shard_within_the_idle_in_transaction_limit() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..30).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &keys, 2).await;

    let mut hung = relay_child(
        &db,
        &topic,
        &[
            ("RELAY_MESSAGE_TIMEOUT_MS", "2000"),
            ("DB_IDLE_IN_TRANSACTION_TIMEOUT_MS", "3000"),
            ("CRASH_POINT", "publish"),
            ("CRASH_EVERY", "1"),
            ("CRASH_ACTION", "stop"),
            ("RELAY_SHARD_GROUPS", "2"),
            ("RUST_LOG", "error"),
        ],
    );
    let pid = hung.id().expect("pid");
    let stopped = || async move {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, rest)| rest.trim_start().starts_with('T'))
            })
            .unwrap_or(false)
    };
    assert!(
        eventually(Duration::from_secs(30), stopped).await,
        "the relay stopped itself inside a shard's transaction"
    );
    let locked: i64 = sqlx::query_scalar(
        // This test's database only: other tests' relays hold shards too.
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&pool)
    .await
    .expect("locks");
    assert_eq!(locked, 8, "the hung relay holds its group's 8 shards");

    let taken_over = std::time::Instant::now();
    let relay = spawn_relay(config(&db, &topic, 2, 10)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "another relay published every row, the hung relay's shards included"
    );
    let waited = taken_over.elapsed();
    assert!(
        waited >= Duration::from_secs(2),
        "the shard was held until the limit ({waited:?})"
    );

    // Continued, the hung relay finds its session gone; it marks nothing
    // and carries on (nothing is pending any more).
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGCONT,
    )
    .expect("SIGCONT");
    relay.stop().await;
    hung.kill().await.expect("kill");

    let messages = topic.read_all(usize::MAX, Duration::from_secs(10)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(
        msg_ids.iter().collect::<HashSet<_>>().len(),
        60,
        "every event published"
    );
    assert_first_occurrences_in_order(&seqs, 2);
}
