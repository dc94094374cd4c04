//! The relay against the real PostgreSQL and broker of `make up`: a fresh
//! database and topic per test.

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::time::Duration;

use pipeline::config::DbArgs;
use pipeline::crash::CrashArgs;
use pipeline::db::ServiceRole;
use pipeline::envelope::Envelope;
use pipeline::outbox::{NOTIFY_CHANNEL, NOTIFY_SETTING, Outbox, OutboxMessage, shards_payload};
use pipeline::testing::{KafkaPrincipal, Service, TestDb, TestTopic, TopicMessage, eventually};
use relay::{Config, Mode, Sink, run};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn config(db: &TestDb, topic: &TestTopic, workers: u16, batch_size: i64) -> Config {
    let db_args = DbArgs::for_url(db.url_as(ServiceRole::Relay));
    Config {
        command: None,
        db: db_args,
        runtime: pipeline::config::RuntimeArgs { worker_threads: 0 },
        kafka: topic.kafka_args(),
        crash: CrashArgs::default(),
        batch_size,
        workers,
        shard_groups: 2,
        shard_depth: 1,
        poll_interval_ms: 200,
        lag_sample_ms: 200,
        synchronous_commit: false,
        metrics_addr: "127.0.0.1:0".parse().expect("addr"),
        linger_ms: 2,
        message_timeout_ms: 10_000,
        max_attempts: 5,
        mode: Mode::Poll,
        wal_slot: None,
        wal_heartbeat_ms: 10_000,
        sink: Sink::Kafka,
        webhook_destination: Vec::new(),
        webhook_allow_addresses: Vec::new(),
        webhook_schedule_scale: 1.0,
        webhook_secrets: Default::default(),
    }
}

/// The relay on `config`, in this process.
async fn spawn_relay(config: Config) -> Service {
    Service::spawn("relay", |metrics, cancel| run(config, metrics, cancel)).await
}

/// [`config`] for `--mode wal`, with heartbeats every 200 ms.
fn wal_config(db: &TestDb, topic: &TestTopic, workers: u16, batch_size: i64) -> Config {
    Config {
        mode: Mode::Wal,
        wal_heartbeat_ms: 200,
        ..config(db, topic, workers, batch_size)
    }
}

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

/// A test event of `aggregate_id` whose payload carries `seq` (read back by
/// [`per_key_sequences`]).
fn seq_event(aggregate_id: Uuid, seq: usize) -> OutboxMessage {
    OutboxMessage {
        aggregate_id,
        msg_id: Uuid::now_v7(),
        event_type: "test.event".into(),
        payload: format!(r#"{{"seq":{seq}}}"#).into_bytes(),
    }
}

/// Appends `events_per_key` events for each of `keys` aggregates, one
/// transaction per event, interleaving the keys; event payloads carry `seq`.
async fn fill_outbox(pool: &PgPool, keys: &[Uuid], events_per_key: usize) {
    fill_outbox_seqs(pool, keys, 0..events_per_key).await;
}

/// As [`fill_outbox`], the events numbered `seqs`.
async fn fill_outbox_seqs(pool: &PgPool, keys: &[Uuid], seqs: std::ops::Range<usize>) {
    let outbox = Outbox;
    for seq in seqs {
        for key in keys {
            let mut tx = pool.begin().await.expect("begin");
            outbox
                .enqueue_batch(&mut tx, &[seq_event(*key, seq)])
                .await
                .expect("enqueue");
            tx.commit().await.expect("commit");
        }
    }
}

async fn pending(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders.outbox WHERE published_at IS NULL")
        .fetch_one(pool)
        .await
        .expect("pending")
}

/// Decodes the topic: per key, the seq values in topic order, and every msg_id seen.
fn per_key_sequences(messages: &[TopicMessage]) -> (HashMap<String, Vec<i64>>, Vec<Uuid>) {
    let mut seqs: HashMap<String, Vec<i64>> = HashMap::new();
    let mut msg_ids = Vec::new();
    for TopicMessage { key, value, .. } in messages {
        let key = String::from_utf8(key.clone().expect("key")).expect("utf8 key");
        let env = Envelope::decode(value.as_deref().expect("value")).expect("envelope");
        assert_eq!(
            env.aggregate_id.to_string(),
            key,
            "the message key is the aggregate id"
        );
        let payload: serde_json::Value = serde_json::from_str(env.payload.get()).expect("payload");
        seqs.entry(key)
            .or_default()
            .push(payload["seq"].as_i64().expect("seq"));
        msg_ids.push(env.msg_id);
    }
    (seqs, msg_ids)
}

/// Per key, the first occurrence of each seq must come in increasing order;
/// a later duplicate (a re-publish) is allowed, a reordering is not.
fn assert_first_occurrences_in_order(seqs: &HashMap<String, Vec<i64>>, events_per_key: usize) {
    for (key, seq) in seqs {
        let mut seen = HashSet::new();
        let firsts: Vec<i64> = seq.iter().copied().filter(|s| seen.insert(*s)).collect();
        let expected: Vec<i64> = (0..events_per_key as i64).collect();
        assert_eq!(
            firsts, expected,
            "key {key}: events out of order or missing: {seq:?}"
        );
    }
}

/// Reads the topic and asserts each of `keys` × `events_per_key` events
/// arrived exactly once, every key's in outbox order. Reads one more than
/// was written, so a duplicate would show.
async fn assert_each_event_once_in_order(topic: &TestTopic, keys: usize, events_per_key: usize) {
    let written = keys * events_per_key;
    let messages = topic.read_all(written + 1, Duration::from_secs(20)).await;
    assert_eq!(
        messages.len(),
        written,
        "each event once: no crash, no re-publish"
    );
    let (seqs, _) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), keys);
    let expected: Vec<i64> = (0..events_per_key as i64).collect();
    for (key, seq) in &seqs {
        assert_eq!(seq, &expected, "key {key} in outbox order");
    }
}

#[tokio::test]
async fn publishes_every_pending_row_in_per_key_order_and_marks_it() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..60).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &keys, 3).await;

    let relay = spawn_relay(config(&db, &topic, 2, 50)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "relay drained the outbox"
    );
    let messages = topic.read_all(180, Duration::from_secs(30)).await;
    assert_eq!(messages.len(), 180);
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 60);
    for (key, seq) in &seqs {
        assert_eq!(seq, &vec![0, 1, 2], "key {key} in outbox order, each once");
    }
    let distinct: HashSet<Uuid> = msg_ids.iter().copied().collect();
    assert_eq!(distinct.len(), 180);

    // New rows after the drain are picked up by NOTIFY (or the poll).
    fill_outbox(&pool, &keys[..5], 1).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            pending(&pool).await == 0
        })
        .await
    );
    relay.stop().await;
}

#[tokio::test]
async fn two_relays_at_once_keep_every_key_in_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();

    let r1 = spawn_relay(config(&db, &topic, 2, 7)).await;
    let r2 = spawn_relay(config(&db, &topic, 3, 5)).await;
    // Write while both relays run, so they race for the same shards.
    fill_outbox(&pool, &keys, 8).await;
    assert!(
        eventually(Duration::from_secs(90), || async {
            pending(&pool).await == 0
        })
        .await
    );
    let messages = topic.read_all(320, Duration::from_secs(30)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 40);
    assert_first_occurrences_in_order(&seqs, 8);
    assert_eq!(
        msg_ids.iter().collect::<HashSet<_>>().len(),
        320,
        "every event published"
    );
    r1.stop().await;
    r2.stop().await;
}

/// Up to `--workers` shard transactions are open at once (one shard's acks
/// overlap another's claim and mark), and still each shard is published by
/// one transaction at a time: every key's events arrive in outbox order,
/// each exactly once. The gauge shows the overlap really happened.
#[tokio::test]
async fn shards_in_flight_at_once_keep_every_key_in_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..100).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &keys, 4).await;

    let relay = spawn_relay(config(&db, &topic, 8, 5)).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut most_in_flight = 0.0f64;
    while pending(&pool).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "relay drained the outbox"
        );
        most_in_flight = most_in_flight.max(relay.metric("relay_shards_in_flight").await);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        most_in_flight > 1.0,
        "more than one shard transaction was open at once (most seen: {most_in_flight})"
    );
    assert!(most_in_flight <= 8.0, "never more than --workers");
    assert_each_event_once_in_order(&topic, 100, 4).await;
    relay.stop().await;
}

/// `--shard-groups 1`: one transaction claims rows of every shard at once
/// (a mark's `published_at` is its transaction's start, so rows marked
/// together share it), and every key's events still arrive in outbox order,
/// each once. With a group per shard (`--shard-groups 16`) no transaction
/// spans two shards.
#[tokio::test]
async fn a_groups_transaction_claims_all_its_shards_at_once() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..64).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &keys, 2).await;
    let shards: i64 = sqlx::query_scalar("SELECT count(DISTINCT shard) FROM orders.outbox")
        .fetch_one(&pool)
        .await
        .expect("shards");

    let relay = spawn_relay(Config {
        shard_groups: 1,
        ..config(&db, &topic, 8, 1000)
    })
    .await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "relay drained the outbox"
    );
    let most: i64 = sqlx::query_scalar(
        "SELECT max(n) FROM (SELECT count(DISTINCT shard) AS n FROM orders.outbox GROUP BY published_at) t",
    )
    .fetch_one(&pool)
    .await
    .expect("shards per transaction");
    assert_eq!(most, shards, "one transaction marked rows of every shard");
    assert_each_event_once_in_order(&topic, 64, 2).await;
    relay.stop().await;
}

/// `--shard-depth` over 1 is not taken: the relay reads a key's rows and
/// marks them after the acks, so a second pass over the shard would send
/// them again. Two relays asking for depths 4 and 2, while the events are
/// written: every key arrives in outbox order, each event once, and no two
/// passes of one shard are ever in flight together (sessions holding a
/// lock of the shard, each idle in its transaction awaiting acks; the
/// library's lock of shard s in slot k is (class, s + 16 × k), in pg_locks
/// objid with objsubid 2).
#[tokio::test]
async fn a_shard_depth_over_one_is_not_taken_and_every_key_stays_in_order() {
    const SHARD: i16 = 5;
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let mut keys = Vec::new();
    while keys.len() < 40 {
        let key = Uuid::now_v7();
        let shard: i16 = sqlx::query_scalar("SELECT (abs(uuid_hash($1)::bigint) % 16)::smallint")
            .bind(key)
            .fetch_one(&pool)
            .await
            .expect("shard");
        if shard == SHARD {
            keys.push(key);
        }
    }

    let sampling = CancellationToken::new();
    let sampler = tokio::spawn({
        let (pool, sampling) = (pool.clone(), sampling.clone());
        async move {
            let awaiting = "SELECT count(DISTINCT a.pid) FROM pg_stat_activity a \
                 JOIN pg_locks l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.granted \
                 WHERE a.datname = current_database() AND a.state = 'idle in transaction' \
                   AND l.objsubid = 2 AND l.objid::int8 % 16 = $1";
            let (mut most, mut seen) = (0i64, 0u64);
            while !sampling.is_cancelled() {
                let n: i64 = sqlx::query_scalar(awaiting)
                    .bind(i64::from(SHARD))
                    .fetch_one(&pool)
                    .await
                    .expect("sample");
                most = most.max(n);
                seen += u64::from(n > 0);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            (most, seen)
        }
    });
    let r1 = spawn_relay(Config {
        shard_depth: 4,
        ..config(&db, &topic, 8, 3)
    })
    .await;
    let r2 = spawn_relay(Config {
        shard_depth: 2,
        ..config(&db, &topic, 4, 5)
    })
    .await;
    fill_outbox(&pool, &keys, 8).await;
    assert!(
        eventually(Duration::from_secs(90), || async {
            pending(&pool).await == 0
        })
        .await,
        "the relays drained the outbox"
    );
    sampling.cancel();
    let (most_awaiting, seen) = sampler.await.expect("sampler");
    assert_each_event_once_in_order(&topic, 40, 8).await;
    assert!(
        seen > 0,
        "the sampler saw a pass of the shard await its acks"
    );
    assert_eq!(
        most_awaiting, 1,
        "one pass of a shard in flight at a time (most seen: {most_awaiting})"
    );
    r1.stop().await;
    r2.stop().await;
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

/// Waits (up to 30 s) until the test database's WAL relay slot exists and
/// is streaming (`active`), or is idle.
async fn wait_for_slot(pool: &PgPool, db: &TestDb, active: bool) {
    let slot = relay::wal::default_slot_name(&db.name);
    assert!(
        eventually(Duration::from_secs(30), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&slot)
            .fetch_optional(pool)
            .await
            .expect("slot")
                == Some(active)
        })
        .await,
        "slot {slot} active = {active} within 30 s"
    );
}

/// Drops the test database's WAL relay slot once its relay has let go (a
/// slot left behind would hold the server's WAL).
async fn drop_slot(pool: &PgPool, db: &TestDb) {
    wait_for_slot(pool, db, false).await;
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(relay::wal::default_slot_name(&db.name))
        .execute(pool)
        .await
        .expect("drop slot");
}

async fn insert_raw(pool: &PgPool, aggregate: Uuid, payload: &[u8]) -> Uuid {
    let msg_id = Uuid::now_v7();
    let mut conn = pool.acquire().await.expect("acquire");
    Outbox
        .enqueue_batch(
            &mut conn,
            &[OutboxMessage {
                aggregate_id: aggregate,
                msg_id,
                event_type: "test.event".into(),
                payload: payload.to_vec(),
            }],
        )
        .await
        .expect("enqueue");
    msg_id
}

/// Outbox rows that can never be published (payload not JSON, over the
/// broker's size limit) are tried `--max-attempts` times, then marked failed
/// with their error; they hold back the later events of their own key and
/// nothing else.
#[tokio::test]
async fn a_row_that_cannot_be_published_fails_alone_and_holds_back_only_its_key() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let (not_json, too_big) = (Uuid::now_v7(), Uuid::now_v7());
    insert_raw(&pool, not_json, b"\xff{ not json").await;
    insert_raw(&pool, not_json, br#"{"seq":1}"#).await;
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    insert_raw(&pool, too_big, big.as_bytes()).await;
    insert_raw(&pool, too_big, br#"{"seq":1}"#).await;
    let keys: Vec<Uuid> = (0..40).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &keys, 2).await;

    let mut cfg = config(&db, &topic, 1, 10);
    cfg.max_attempts = 3;
    let relay = spawn_relay(cfg).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 4
                && relay.metric("outbox_failed_rows").await == 2.0
                // A sample taken once the rest was published (the backlog
                // sampler runs apart from the batches).
                && relay.metric("outbox_pending_rows").await == 2.0
        })
        .await,
        "everything else published, the two bad rows failed (pending {})",
        pending(&pool).await
    );
    let rows: Vec<(Uuid, i32, Option<String>, bool)> = sqlx::query_as(
        "SELECT aggregate_id, attempts, last_error, failed_at IS NOT NULL \
         FROM orders.outbox WHERE published_at IS NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("rows");
    assert_eq!(rows.len(), 4);
    assert_eq!((rows[0].0, rows[0].1, rows[0].3), (not_json, 3, true));
    assert!(
        rows[0].2.as_deref().unwrap_or("").contains("not JSON"),
        "{:?}",
        rows[0].2
    );
    assert_eq!(
        (rows[1].0, rows[1].1, rows[1].3),
        (not_json, 0, false),
        "held back, never tried"
    );
    assert_eq!((rows[2].0, rows[2].1, rows[2].3), (too_big, 3, true));
    assert!(
        rows[2].2.as_deref().unwrap_or("").contains("too large"),
        "{:?}",
        rows[2].2
    );
    assert_eq!(
        (rows[3].0, rows[3].1, rows[3].3),
        (too_big, 0, false),
        "held back, never tried"
    );
    assert_eq!(relay.metric("relay_rows_failed_total").await, 2.0);

    let messages = topic.read_all(80, Duration::from_secs(30)).await;
    let (seqs, _) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 40, "only the good keys were published");
    assert_first_occurrences_in_order(&seqs, 2);
    relay.stop().await;
}

/// `--mode wal`: rows committed before the slot existed are published by
/// the start-up drain, rows committed after it from the stream; every key in
/// order, every row marked. A row that cannot be published is marked failed
/// at once and holds back the later events of its key only. The slot's
/// confirmed position moves past the last commit (heartbeats).
/// The WAL relay holds back a key's next event when the one before it fails,
/// even when the next one arrives while the failing one is still in flight:
/// it must wait for the predecessor's outcome and only then decide (it used
/// to look at the failed keys first and then wait, and published the next
/// event of a key whose predecessor had just failed). The failing rows are
/// refused by the broker (over the topic's max.message.bytes, so the
/// refusal takes a round trip), fifty keys of them each followed by a good
/// row, in one transaction.
#[tokio::test]
async fn wal_mode_never_publishes_an_event_after_its_keys_predecessor_failed() {
    let db = TestDb::create().await;
    let bootstrap_servers = pipeline::testing::stack_var("KAFKA_BOOTSTRAP_SERVERS");
    let name = format!("test-{}", Uuid::new_v4().simple());
    let mut configs = pipeline::contract::order_events_topic_configs().to_vec();
    configs.push(("max.message.bytes", "4096".into()));
    pipeline::kafka::ensure_topic(&KafkaPrincipal::Admin.client(), &name, 3, -1, &configs)
        .await
        .expect("create the topic");
    let topic = TestTopic {
        name,
        bootstrap_servers,
    };
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let relay = spawn_relay(wal_config(&db, &topic, 2, 10)).await;
    wait_for_slot(&pool, &db, true).await;
    let keys: Vec<Uuid> = (0..50).map(|_| Uuid::now_v7()).collect();
    // Random hex does not compress below the topic's limit.
    let blob = || -> String {
        (0..2_000)
            .map(|_| Uuid::new_v4().simple().to_string())
            .collect()
    };
    let messages: Vec<OutboxMessage> = keys
        .iter()
        .flat_map(|&key| {
            [
                OutboxMessage {
                    aggregate_id: key,
                    msg_id: Uuid::now_v7(),
                    event_type: "test.event".into(),
                    payload: format!(r#"{{"blob":"{}"}}"#, blob()).into_bytes(),
                },
                seq_event(key, 1),
            ]
        })
        .collect();
    let mut conn = pool.acquire().await.expect("acquire");
    Outbox
        .enqueue_batch(&mut conn, &messages)
        .await
        .expect("enqueue");
    assert!(
        eventually(Duration::from_secs(90), || async {
            relay.metric("outbox_failed_rows").await >= 50.0
        })
        .await,
        "the fifty rows over the limit failed: {} failed, {} pending",
        relay.metric("outbox_failed_rows").await,
        pending(&pool).await
    );
    assert_eq!(
        relay.metric("outbox_failed_rows").await,
        50.0,
        "only they failed"
    );
    let published = topic.read_all(1, Duration::from_secs(5)).await;
    assert!(
        published.is_empty(),
        "no event of a key whose predecessor failed was published: {} were",
        published.len()
    );
    assert_eq!(
        pending(&pool).await,
        100,
        "50 failed and 50 held back, none published"
    );
    relay.stop().await;
}

#[tokio::test]
async fn wal_mode_publishes_from_before_and_after_its_slot_in_per_key_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    fill_outbox_seqs(&pool, &keys, 0..2).await;

    let relay = spawn_relay(wal_config(&db, &topic, 2, 10)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "the rows from before the slot drained"
    );
    wait_for_slot(&pool, &db, true).await;

    // From the stream: two more events of every key, and two keys whose
    // first event cannot be published.
    let (not_json, too_big) = (Uuid::now_v7(), Uuid::now_v7());
    insert_raw(&pool, not_json, b"\xff{ not json").await;
    insert_raw(&pool, not_json, br#"{"seq":1}"#).await;
    let big = format!(r#"{{"blob":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    insert_raw(&pool, too_big, big.as_bytes()).await;
    insert_raw(&pool, too_big, br#"{"seq":1}"#).await;
    fill_outbox_seqs(&pool, &keys, 2..4).await;
    let last: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .expect("lsn");
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 4 && relay.metric("outbox_failed_rows").await == 2.0
        })
        .await,
        "everything else published, the two bad rows failed, the next of their keys held back (pending {})",
        pending(&pool).await
    );
    let rows: Vec<(Uuid, bool, Option<String>)> = sqlx::query_as(
        "SELECT aggregate_id, failed_at IS NOT NULL, last_error \
         FROM orders.outbox WHERE published_at IS NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .expect("rows");
    let shape: Vec<(Uuid, bool)> = rows.iter().map(|r| (r.0, r.1)).collect();
    assert_eq!(
        shape,
        [
            (not_json, true),
            (not_json, false),
            (too_big, true),
            (too_big, false)
        ],
        "each bad row failed, the next event of its key held back: {rows:?}"
    );
    assert!(rows[0].2.as_deref().unwrap_or("").contains("not JSON"));
    assert!(rows[2].2.as_deref().unwrap_or("").contains("too large"));
    assert_eq!(relay.metric("relay_wal_held_back_total").await, 2.0);
    assert_eq!(relay.metric("relay_rows_failed_total").await, 2.0);

    let messages = topic.read_all(80, Duration::from_secs(30)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 20, "only the good keys were published");
    assert_first_occurrences_in_order(&seqs, 4);
    let distinct: HashSet<Uuid> = msg_ids.iter().copied().collect();
    assert_eq!(distinct.len(), 80, "every event of the good keys");

    // A heartbeat after the last commit lets the slot confirm past it; a
    // clean stop sends the last confirmation.
    tokio::time::sleep(Duration::from_secs(1)).await;
    relay.stop().await;
    // The last confirmation is sent as the stream stops, unanswered: the
    // slot shows it once its walsender has let go.
    wait_for_slot(&pool, &db, false).await;
    let confirmed: bool = sqlx::query_scalar(
        "SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = $2",
    )
    .bind(&last)
    .bind(relay::wal::default_slot_name(&db.name))
    .fetch_one(&pool)
    .await
    .expect("slot");
    assert!(confirmed, "the slot confirmed past {last}");
    drop_slot(&pool, &db).await;
}

/// Two WAL relays and a poll relay at once: the second WAL relay stands by
/// (the slot is exclusive), the poll relay's claims and the stream race
/// (duplicates, never out of order). Then the first WAL relay and the poll
/// relay stop, and the standby takes the slot over and publishes the rest.
#[tokio::test]
async fn a_standby_wal_relay_takes_over_and_every_key_stays_in_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..30).map(|_| Uuid::now_v7()).collect();
    let r1 = spawn_relay(wal_config(&db, &topic, 2, 7)).await;
    wait_for_slot(&pool, &db, true).await;
    let r2 = spawn_relay(wal_config(&db, &topic, 3, 5)).await;
    let r3 = spawn_relay(config(&db, &topic, 2, 5)).await;
    fill_outbox_seqs(&pool, &keys, 0..4).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await
    );
    r1.stop().await;
    r3.stop().await;
    fill_outbox_seqs(&pool, &keys, 4..8).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "the standby took the slot over"
    );
    let messages = topic.read_all(usize::MAX, Duration::from_secs(10)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), 30);
    assert_first_occurrences_in_order(&seqs, 8);
    assert_eq!(
        msg_ids.iter().collect::<HashSet<_>>().len(),
        240,
        "every event published"
    );
    r2.stop().await;
    drop_slot(&pool, &db).await;
}

/// A committed row the stream never delivers (here: written while the
/// publication left inserts out) is found by the relay's comparison of the
/// table with the stream, and the stream's restart publishes it.
#[tokio::test]
async fn a_row_the_stream_never_delivered_is_found_and_published() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let relay = spawn_relay(wal_config(&db, &topic, 2, 10)).await;
    wait_for_slot(&pool, &db, true).await;

    let key = Uuid::now_v7();
    sqlx::query("ALTER PUBLICATION effectively_outbox SET (publish = 'delete')")
        .execute(&pool)
        .await
        .expect("publication without inserts");
    insert_raw(&pool, key, br#"{"seq":0}"#).await;
    sqlx::query("ALTER PUBLICATION effectively_outbox SET (publish = 'insert')")
        .execute(&pool)
        .await
        .expect("publication with inserts");
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "the row the stream skipped was published"
    );
    assert!(relay.metric("relay_wal_stream_gaps_total").await >= 1.0);
    let messages = topic.read_all(1, Duration::from_secs(30)).await;
    let (seqs, _) = per_key_sequences(&messages);
    assert_eq!(seqs.get(&key.to_string()), Some(&vec![0]));
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// A transaction open for longer than the gap check's period, with many
/// rows: its rows were written (`created_at`, the transaction's start) long
/// before the commits around them, and stay in flight for a while after its
/// own. The check compares positions, not times: it takes none of them for
/// rows the stream missed (the time-based check did, and restarted the
/// stream, which sent the window again).
#[tokio::test]
async fn a_long_transaction_is_not_taken_for_a_gap() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // 500 rows in flight: with 10 (one worker, batches of 10) each row
    // waits for its acks (acks=all, three replicas) in turn, and the 20,000
    // took 60 s alone and over 120 s on a busy machine.
    let relay = spawn_relay(wal_config(&db, &topic, 1, 500)).await;
    wait_for_slot(&pool, &db, true).await;

    const ROWS: usize = 20_000;
    let mut tx = pool.begin().await.expect("begin");
    let messages: Vec<OutboxMessage> = (0..ROWS).map(|i| seq_event(Uuid::now_v7(), i)).collect();
    Outbox
        .enqueue_batch(&mut tx, &messages)
        .await
        .expect("enqueue");
    // Heartbeats commit meanwhile: the stream reads commits 12 s younger
    // than these rows.
    tokio::time::sleep(Duration::from_secs(12)).await;
    tx.commit().await.expect("commit");
    assert!(
        eventually(Duration::from_secs(120), || async {
            pending(&pool).await == 0
        })
        .await,
        "every row published"
    );
    // Two more checks' periods with nothing pending.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(relay.metric("relay_wal_stream_gaps_total").await, 0.0);
    assert_eq!(
        relay.metric(r#"relay_errors_total{stage="wal"}"#).await,
        0.0,
        "the stream never restarted"
    );
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// A row the stream delivered that the relay's marks cannot see (a commit
/// decoded but not yet visible: a synchronous standby that does not answer
/// holds a committing backend after its commit record is flushed, and a
/// logical walsender does not wait for it) ends the stream after the
/// visibility wait, and nothing past it is confirmed: the stream reads it
/// again, and once it is visible marks it itself. The last mark of the
/// stream whose wait failed used to confirm past it all the same (the rows
/// waited for were dropped), so it was left pending behind the slot.
///
/// Row-level security stands in for the invisible commit: a policy on this
/// test's database hides the row from the relay's role, and lifting it
/// (a delete, no lock on the outbox) makes it visible. A synchronous
/// standby name would hold every commit of the shared server's other
/// databases, and only a server-wide setting makes one.
#[tokio::test]
async fn a_row_the_marks_cannot_see_is_never_confirmed_past() {
    a_row_the_relay_cannot_mark_is_never_confirmed_past(Hidden::FromEveryStatement).await;
}

/// A mark whose `UPDATE` changed fewer rows than it meant to (here a row the
/// relay's role sees but may not update) confirms nothing past them either:
/// the relay checks what its mark left pending, and the stream reads it
/// again. The mark's row count used to go unread, and the slot was
/// confirmed past the row it left pending.
#[tokio::test]
async fn a_row_a_mark_did_not_change_is_never_confirmed_past() {
    a_row_the_relay_cannot_mark_is_never_confirmed_past(Hidden::FromUpdates).await;
}

/// What the policy of [`a_row_the_relay_cannot_mark_is_never_confirmed_past`]
/// hides a row from.
enum Hidden {
    /// Every statement of the relay: the row is not there for it.
    FromEveryStatement,
    /// The relay's `UPDATE`s: its marks leave the row pending.
    FromUpdates,
}

/// A row of `public.invisible_to_the_relay` is hidden from the relay's role
/// as `hidden` says until it is deleted from there: the slot is never
/// confirmed past it meanwhile, and then the relay marks it.
async fn a_row_the_relay_cannot_mark_is_never_confirmed_past(hidden: Hidden) {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    const NOT_HIDDEN: &str =
        "NOT EXISTS (SELECT 1 FROM public.invisible_to_the_relay h WHERE h.id = outbox.id)";
    let policies = match hidden {
        Hidden::FromEveryStatement => vec![format!(
            "CREATE POLICY the_relay_sees ON orders.outbox TO effectively_relay USING ({NOT_HIDDEN})"
        )],
        Hidden::FromUpdates => vec![
            "CREATE POLICY the_relay_reads ON orders.outbox FOR SELECT TO effectively_relay \
             USING (true)"
                .to_owned(),
            format!(
                "CREATE POLICY the_relay_marks ON orders.outbox FOR UPDATE TO effectively_relay \
                 USING ({NOT_HIDDEN})"
            ),
        ],
    };
    let setup = [
        "CREATE TABLE public.invisible_to_the_relay (id int8 PRIMARY KEY)".to_owned(),
        "GRANT SELECT ON public.invisible_to_the_relay TO effectively_relay".to_owned(),
        "ALTER TABLE orders.outbox ENABLE ROW LEVEL SECURITY".to_owned(),
    ];
    for sql in setup.iter().chain(&policies) {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    // No heartbeats: the stream's only commits are this test's, so the
    // slot's position says which of them the relay confirmed.
    let config = Config {
        wal_heartbeat_ms: 3_600_000,
        ..wal_config(&db, &topic, 1, 10)
    };
    let relay = spawn_relay(config).await;
    wait_for_slot(&pool, &db, true).await;
    let first_stream = walsender_pid(&pool, &db).await;
    let (seen, unseen) = (Uuid::now_v7(), Uuid::now_v7());
    insert_raw(&pool, seen, br#"{"seq":0}"#).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            pending(&pool).await == 0
        })
        .await,
        "a visible row is published and marked"
    );

    let before: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&pool)
        .await
        .expect("lsn");
    let mut tx = pool.begin().await.expect("begin");
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
         VALUES ($1, $2, 'test.event', '{\"seq\":0}') RETURNING id",
    )
    .bind(unseen)
    .bind(Uuid::now_v7())
    .fetch_one(&mut *tx)
    .await
    .expect("insert");
    sqlx::query("INSERT INTO public.invisible_to_the_relay (id) VALUES ($1)")
        .bind(id)
        .execute(&mut *tx)
        .await
        .expect("hide");
    tx.commit().await.expect("commit");

    // The mark fails (an invisible row after waiting 10 s for it), the
    // stream ends, and its walsender lets go of the slot with the last
    // confirmation.
    assert!(
        eventually(Duration::from_secs(60), || async {
            relay.metric(r#"relay_errors_total{stage="wal"}"#).await >= 1.0
        })
        .await,
        "the stream ended: its mark could not see the row"
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            walsender_pid(&pool, &db).await != first_stream
        })
        .await,
        "the first stream let go of the slot"
    );
    let (confirmed, past): (String, bool) = sqlx::query_as(
        "SELECT confirmed_flush_lsn::text, confirmed_flush_lsn > $1::pg_lsn \
         FROM pg_replication_slots WHERE slot_name = $2",
    )
    .bind(&before)
    .bind(relay::wal::default_slot_name(&db.name))
    .fetch_one(&pool)
    .await
    .expect("slot");
    assert!(
        !past,
        "the slot confirmed {confirmed}, past the commit of row {id} (after {before}), \
         which the relay could not mark"
    );
    assert_eq!(pending(&pool).await, 1, "the row is pending");

    sqlx::query("DELETE FROM public.invisible_to_the_relay")
        .execute(&pool)
        .await
        .expect("show the row");
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "once visible, the row is marked"
    );
    assert_eq!(
        relay.metric("relay_wal_stream_gaps_total").await,
        0.0,
        "the relay marked the row again (the stream read it again, or the drain of a \
         restart took it): it was never left behind the slot"
    );
    let messages = topic.read_all(usize::MAX, Duration::from_secs(10)).await;
    let (seqs, _) = per_key_sequences(&messages);
    assert_eq!(seqs.get(&seen.to_string()), Some(&vec![0]));
    assert!(
        seqs.get(&unseen.to_string())
            .is_some_and(|s| !s.is_empty() && s.iter().all(|&q| q == 0)),
        "the row is published (once per stream that read it): {seqs:?}"
    );
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// A topic that does not exist yet: the relay's sends to it fail until
/// [`create_topic_and_drain_without_a_restart`] creates it.
fn missing_topic() -> TestTopic {
    TestTopic {
        name: format!("test-{}", Uuid::new_v4().simple()),
        bootstrap_servers: pipeline::testing::stack_var("KAFKA_BOOTSTRAP_SERVERS"),
    }
}

/// Waits for the relay to fail a send.
async fn wait_for_a_failed_send(relay: &Service) {
    assert!(
        eventually(Duration::from_secs(30), || async {
            relay.metric(r#"relay_errors_total{stage="produce"}"#).await >= 1.0
        })
        .await,
        "the sends failed"
    );
}

/// Creates the [`missing_topic`] and waits until every row is published.
async fn create_topic_and_drain(pool: &PgPool, topic: &TestTopic) {
    pipeline::kafka::ensure_topic(
        &topic.client(),
        &topic.name,
        3,
        // The brokers' default replication (3): the relay checks the topic
        // again once it exists, and refuses one replica.
        -1,
        &pipeline::contract::order_events_topic_configs(),
    )
    .await
    .expect("create the topic");
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(pool).await == 0
        })
        .await,
        "every row published once the topic exists"
    );
}

/// [`create_topic_and_drain`], and checks that the WAL relay's stream never
/// restarted meanwhile.
async fn create_topic_and_drain_without_a_restart(
    pool: &PgPool,
    topic: &TestTopic,
    relay: &Service,
) {
    create_topic_and_drain(pool, topic).await;
    assert_eq!(
        relay.metric(r#"relay_errors_total{stage="wal"}"#).await,
        0.0,
        "the stream never restarted"
    );
}

/// A publish the broker fails (here: the topic does not exist yet, so each
/// send times out after `--message-timeout-ms`) is tried again in place: once
/// the topic is there every row goes out, in per-key order, and the stream
/// never restarted (a restart would send its whole unconfirmed window again).
#[tokio::test]
async fn a_failed_publish_is_retried_in_place_without_a_stream_restart() {
    let db = TestDb::create().await;
    let topic = missing_topic();
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let config = Config {
        message_timeout_ms: 1_000,
        ..wal_config(&db, &topic, 1, 10)
    };
    let relay = spawn_relay(config).await;
    wait_for_slot(&pool, &db, true).await;

    let keys: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    for seq in 0..3 {
        for key in &keys {
            insert_raw(&pool, *key, format!(r#"{{"seq":{seq}}}"#).as_bytes()).await;
        }
    }
    wait_for_a_failed_send(&relay).await;
    create_topic_and_drain_without_a_restart(&pool, &topic, &relay).await;
    let messages = topic.read_all(15, Duration::from_secs(30)).await;
    let (seqs, _) = per_key_sequences(&messages);
    for key in &keys {
        assert_eq!(
            seqs.get(&key.to_string()),
            Some(&vec![0, 1, 2]),
            "key {key}"
        );
    }
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// The WAL relay starts its stream only once the rows pending from before
/// its slot are published, however long that takes: here the topic does
/// not exist yet, so every send of the start-up drain fails. The drain used
/// to end at a round that delivered nothing, and the stream, started with
/// the older rows pending, published each key's later event (committed
/// after the slot) before them.
#[tokio::test]
async fn wal_mode_streams_only_once_the_rows_from_before_its_slot_are_published() {
    let db = TestDb::create().await;
    let topic = missing_topic();
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    fill_outbox_seqs(&pool, &keys, 0..2).await;
    let config = Config {
        message_timeout_ms: 1_000,
        ..wal_config(&db, &topic, 1, 10)
    };
    let relay = spawn_relay(config).await;
    // The drain sends: the slot is made, the rows from before it known.
    wait_for_a_failed_send(&relay).await;
    // Committed after the slot: the stream's.
    fill_outbox_seqs(&pool, &keys, 2..3).await;
    // A round sends each key's first row: more failed sends than keys, a
    // second round (or, before, the stream's sends).
    assert!(
        eventually(Duration::from_secs(60), || async {
            relay.metric(r#"relay_errors_total{stage="produce"}"#).await > keys.len() as f64
        })
        .await,
        "the sends failed again"
    );
    let active: Option<bool> =
        sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
            .bind(relay::wal::default_slot_name(&db.name))
            .fetch_optional(&pool)
            .await
            .expect("slot");
    assert_eq!(
        active,
        Some(false),
        "the slot is made, and the stream waits for the rows from before it"
    );
    assert_eq!(pending(&pool).await, 15);
    create_topic_and_drain(&pool, &topic).await;
    // The drain may take rows committed after the slot too, and the stream
    // sends them again: duplicates, never a key's later event first.
    let messages = topic.read_all(usize::MAX, Duration::from_secs(10)).await;
    let (seqs, msg_ids) = per_key_sequences(&messages);
    assert_eq!(seqs.len(), keys.len());
    assert_first_occurrences_in_order(&seqs, 3);
    assert_eq!(msg_ids.iter().collect::<HashSet<_>>().len(), 15);
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// The poll relay's claim marks the rows it takes; a row the broker did
/// not ack is put back before the batch commits. Here every send fails
/// (the topic does not exist yet, `--message-timeout-ms` 1 s): batches
/// commit, and every row stays pending. Once the topic is there, every row
/// goes out once, in per-key order.
#[tokio::test]
async fn rows_the_broker_did_not_ack_are_put_back_pending() {
    let db = TestDb::create().await;
    let topic = missing_topic();
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let config = Config {
        message_timeout_ms: 1_000,
        ..config(&db, &topic, 2, 10)
    };
    let relay = spawn_relay(config).await;
    let keys: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    for seq in 0..3 {
        for key in &keys {
            insert_raw(&pool, *key, format!(r#"{{"seq":{seq}}}"#).as_bytes()).await;
        }
    }
    // Only each key's first row is claimable: 5 sends fail a round. More
    // than 5 failed sends: a second round began, so a first batch
    // committed.
    assert!(
        eventually(Duration::from_secs(60), || async {
            relay.metric(r#"relay_errors_total{stage="produce"}"#).await > 5.0
        })
        .await,
        "the sends failed, twice"
    );
    assert_eq!(pending(&pool).await, 15, "no unacked row is left marked");
    assert_eq!(relay.metric("relay_published_total").await, 0.0);
    create_topic_and_drain(&pool, &topic).await;
    assert_each_event_once_in_order(&topic, 5, 3).await;
    relay.stop().await;
}

/// The PID of the walsender streaming the test database's slot, if any.
async fn walsender_pid(pool: &PgPool, db: &TestDb) -> Option<i32> {
    sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
        .bind(relay::wal::default_slot_name(&db.name))
        .fetch_optional(pool)
        .await
        .expect("slot")
        .flatten()
}

/// A broker failing for longer than the server's `wal_sender_timeout`
/// (2 s here, for the relay's role in the test's database) does not end the stream: while
/// its read-ahead is full, the WAL relay still tells the server where it
/// stands. Before, nothing answered the server then, the walsender gave
/// up, and the restart sent the unconfirmed window again (FINDINGS §22).
#[tokio::test]
async fn a_broker_outage_longer_than_the_senders_timeout_keeps_the_stream() {
    let db = TestDb::create().await;
    let topic = missing_topic();
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // The relay's sessions in this database only (the replication
    // connection ignores a URL's `options`).
    sqlx::query(&format!(
        "ALTER ROLE {} IN DATABASE {} SET wal_sender_timeout = '2s'",
        ServiceRole::Relay.name(),
        db.name
    ))
    .execute(&pool)
    .await
    .expect("set the relay's wal_sender_timeout");
    // 50 rows in flight, one per key.
    let config = Config {
        message_timeout_ms: 1_000,
        ..wal_config(&db, &topic, 1, 50)
    };
    let relay = spawn_relay(config).await;
    wait_for_slot(&pool, &db, true).await;
    let walsender = walsender_pid(&pool, &db).await;
    assert!(walsender.is_some(), "the relay streams");

    // More events than the read-ahead holds (4,096): 100 transactions of
    // one event for each of 50 keys, with no topic to send them to.
    let (keys, events_per_key) = (50, 100);
    let aggregates: Vec<Uuid> = (0..keys).map(|_| Uuid::now_v7()).collect();
    let mut conn = pool.acquire().await.expect("acquire");
    for seq in 0..events_per_key {
        let messages: Vec<OutboxMessage> =
            aggregates.iter().map(|key| seq_event(*key, seq)).collect();
        Outbox
            .enqueue_batch(&mut conn, &messages)
            .await
            .expect("enqueue");
    }
    drop(conn);
    wait_for_a_failed_send(&relay).await;
    // Three of the server's timeouts with the read-ahead full.
    tokio::time::sleep(Duration::from_secs(6)).await;
    create_topic_and_drain_without_a_restart(&pool, &topic, &relay).await;
    assert_eq!(
        walsender_pid(&pool, &db).await,
        walsender,
        "the same walsender streams"
    );
    assert_each_event_once_in_order(&topic, keys, events_per_key).await;
    relay.stop().await;
    drop_slot(&pool, &db).await;
}

/// A hot key's backlog goes out a pass's share at a time, in order, not a
/// row per pass (a 10-key backlog drained at 93 rows/s when a claim took
/// each key's first pending row only: FINDINGS §26), and the other keys of
/// its shard follow in commit order (oldest first, as every shard's rows).
#[tokio::test]
async fn a_hot_key_backlog_goes_a_share_per_pass_and_its_shard_keeps_commit_order() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let hot = Uuid::now_v7();
    fill_outbox(&pool, &[hot], 300).await;
    let others: Vec<Uuid> = (0..50).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &others, 1).await;

    // Each shard's share of a pass is 20 rows (160 ÷ 8 shards a group).
    let relay = spawn_relay(config(&db, &topic, 1, 160)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "the outbox drains"
    );
    let passes = relay.metric("relay_batch_size_count").await;
    assert!(
        passes < 60.0,
        "{passes} passes published rows: the hot key's 300 went 20 a pass, not one"
    );
    // Marked by the pass that sent them, at its transaction's start.
    let (hot_last, others_first): (chrono::DateTime<chrono::Utc>, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as(
            "SELECT (SELECT max(published_at) FROM orders.outbox WHERE aggregate_id = $1), \
                    (SELECT min(o.published_at) FROM orders.outbox o \
                     WHERE o.aggregate_id <> $1 \
                       AND o.shard = (SELECT shard FROM orders.outbox WHERE aggregate_id = $1 LIMIT 1))",
        )
        .bind(hot)
        .fetch_one(&pool)
        .await
        .expect("published times");
    if let Some(first) = others_first {
        assert!(
            first >= hot_last,
            "the hot key's shard published its later keys after its older backlog"
        );
    }
    let messages = topic.read_all(350, Duration::from_secs(30)).await;
    let (seqs, _) = per_key_sequences(&messages);
    assert_first_occurrences_in_order(
        &HashMap::from([(hot.to_string(), seqs[&hot.to_string()].clone())]),
        300,
    );
    relay.stop().await;
}

/// An outbox whose statistics say "nothing is pending" (5,000 rows, every
/// one published, then analyzed; autovacuum off, so they stay so), then a
/// burst of 4,000 pending rows, one per aggregate.
async fn analyzed_empty_then_a_backlog(owner: &PgPool) {
    for sql in [
        "ALTER TABLE orders.outbox SET (autovacuum_enabled = off)",
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, published_at) \
         SELECT gen_random_uuid(), gen_random_uuid(), 'test.event', '{}', now() \
         FROM generate_series(1, 5000)",
        "ANALYZE orders.outbox",
        "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
         SELECT gen_random_uuid(), gen_random_uuid(), 'test.event', '{}' \
         FROM generate_series(1, 4000)",
    ] {
        sqlx::query(sql).execute(owner).await.expect(sql);
    }
}

/// The rows of the outbox this transaction has read so far (fetched through
/// an index or read by a scan): a count, not a time.
async fn outbox_reads(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>) -> i64 {
    let (fetched, scanned): (i64, i64) = sqlx::query_as(
        "SELECT idx_tup_fetch, seq_tup_read FROM pg_stat_xact_user_tables \
         WHERE relid = 'orders.outbox'::regclass",
    )
    .fetch_one(&mut **tx)
    .await
    .expect("this transaction's reads");
    fetched + scanned
}

/// The claim's plan holds when the statistics were taken while nothing was
/// pending (a drained queue, analyzed) and a backlog arrived before the next
/// analyze: the claims read about one row of the table per row they return.
/// The anti-join the planner chose under such statistics read every pending
/// row per row returned (FINDINGS.md §16). The count is this transaction's
/// own reads (pg_stat_xact_user_tables), not a time.
#[tokio::test]
async fn a_claim_after_an_empty_outbox_was_analyzed_reads_each_row_once() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    const BACKLOG: usize = 4000;
    analyzed_empty_then_a_backlog(&owner).await;
    let mut tx = owner.begin().await.expect("begin");
    let mut claimed = 0;
    for shard in 0..relay::outbox::SHARDS {
        claimed += relay::outbox::read_shards(&mut tx, &[shard], 1000)
            .await
            .expect("claim")
            .rows
            .len();
    }
    let read = usize::try_from(outbox_reads(&mut tx).await).expect("a count");
    assert_eq!(claimed, BACKLOG, "every aggregate's only row, once");
    assert!(
        read <= 3 * BACKLOG,
        "the claims read {read} rows of the table to return {claimed}: a plan per row, not per claim"
    );
}

/// The WAL relay's mark after the same statistics: each mark reads its own
/// rows (by `outbox_pkey`), not every pending row (a scan of
/// `outbox_pending_by_aggregate` filtered by id, which its `published_at IS
/// NULL` let the planner choose).
#[tokio::test]
async fn a_mark_after_an_empty_outbox_was_analyzed_reads_only_its_rows() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    analyzed_empty_then_a_backlog(&owner).await;
    let pending: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM orders.outbox WHERE published_at IS NULL ORDER BY id LIMIT 100",
    )
    .fetch_all(&owner)
    .await
    .expect("pending ids");
    let mut tx = owner.begin().await.expect("begin");
    let mut marked = 0;
    for ids in pending.chunks(10) {
        marked += relay::outbox::mark_published(&mut tx, ids)
            .await
            .expect("mark");
    }
    // Marking them again marks nothing: a row keeps its first time.
    let again = relay::outbox::mark_published(&mut tx, &pending[..10])
        .await
        .expect("mark again");
    let read = outbox_reads(&mut tx).await;
    assert_eq!((marked, again), (100, 0), "each row marked once");
    assert!(
        read <= 3 * 110,
        "11 marks of 10 rows read {read} rows of the table: every pending row per mark"
    );
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

/// Every pooled session of the relay sets its own limits, whatever the
/// server's defaults: READ COMMITTED, the statement and idle-in-transaction
/// timeouts (flags over the relay's defaults), TCP keepalives, and a custom
/// plan for every statement (a generic claim plan made on an empty outbox is
/// quadratic in the backlog).
#[tokio::test]
async fn database_sessions_set_their_own_limits() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(1).await;
    let mut cfg = config(&db, &topic, 1, 10);
    cfg.db.db_idle_in_transaction_timeout_ms = Some(4_000);
    let pool = pipeline::db::connect(&cfg.db, relay::session_limits(&cfg))
        .await
        .expect("connect");
    for (setting, want) in [
        ("default_transaction_isolation", "read committed"),
        ("statement_timeout", "30s"),
        ("idle_in_transaction_session_timeout", "4s"),
        ("tcp_keepalives_idle", "30"),
        ("plan_cache_mode", "force_custom_plan"),
        // its marks: a crash of the server undoes at most the last ones
        ("synchronous_commit", "off"),
    ] {
        let got: String = sqlx::query_scalar(&format!("SHOW {setting}"))
            .fetch_one(&pool)
            .await
            .expect(setting);
        assert_eq!(got, want, "{setting}");
    }
    // Asked for, and for everything but polling for Kafka, its commits wait.
    let mut durable = vec![cfg.clone(), cfg.clone(), cfg.clone()];
    durable[0].synchronous_commit = true;
    durable[1].mode = Mode::Wal;
    durable[2].sink = Sink::Http;
    for cfg in durable {
        assert!(!relay::session_limits(&cfg).asynchronous_commit, "{cfg:?}");
    }
}

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

/// Published rows older than the outbox retention are deleted in batches,
/// oldest first; a pending or failed row never is (an intent still on its
/// way); the floor moves up once nothing expired is left.
#[tokio::test]
async fn published_rows_expire_after_the_retention_and_unpublished_ones_stay() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    let relay_pool = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as relay");
    let keys: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&owner, &keys, 2).await;
    // 7 published, 2 pending, 1 failed.
    sqlx::query(
        "UPDATE orders.outbox SET published_at = now() \
         WHERE id IN (SELECT id FROM orders.outbox ORDER BY id LIMIT 7)",
    )
    .execute(&owner)
    .await
    .expect("publish");
    sqlx::query(
        "UPDATE orders.outbox SET failed_at = now(), attempts = 5, last_error = 'x' \
         WHERE id = (SELECT max(id) FROM orders.outbox)",
    )
    .execute(&owner)
    .await
    .expect("fail one");

    // Under the default retention (7 days) nothing is old enough.
    assert_eq!(
        relay::outbox::expire(&relay_pool, 100)
            .await
            .expect("expire"),
        0
    );
    sqlx::query("UPDATE orders.outbox_policy SET retention = interval '1 millisecond'")
        .execute(&owner)
        .await
        .expect("shorten");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut batches = Vec::new();
    loop {
        let n = relay::outbox::expire(&relay_pool, 3).await.expect("expire");
        batches.push(n);
        if n < 3 {
            break;
        }
    }
    assert_eq!(batches, [3, 3, 1], "the 7 published rows, at most 3 a call");
    let left: Vec<bool> =
        sqlx::query_scalar("SELECT published_at IS NULL FROM orders.outbox ORDER BY id")
            .fetch_all(&owner)
            .await
            .expect("left");
    assert_eq!(
        left,
        [true, true, true],
        "the pending and the failed rows stay"
    );
    let floor: Uuid = sqlx::query_scalar("SELECT floor FROM orders.outbox_policy")
        .fetch_one(&owner)
        .await
        .expect("floor");
    let newest: Uuid = sqlx::query_scalar("SELECT max(msg_id::text)::uuid FROM orders.outbox")
        .fetch_one(&owner)
        .await
        .expect("newest");
    assert!(
        floor > newest,
        "the floor moved past every row minted before the cut"
    );
}

/// The relay binary on `db` and `topic` (one worker, batches of 10, its
/// metrics on `metrics_port`, its log on a pipe, killed when dropped), with
/// `extra` settings.
fn relay_process(
    db: &TestDb,
    topic: &TestTopic,
    metrics_port: u16,
    extra: &[(&str, &str)],
) -> tokio::process::Command {
    let mut relay = tokio::process::Command::new(env!("CARGO_BIN_EXE_relay"));
    relay
        .env("DATABASE_URL", db.url_as(ServiceRole::Relay))
        .env("KAFKA_BOOTSTRAP_SERVERS", &topic.bootstrap_servers)
        .env("KAFKA_TOPIC", &topic.name)
        .env("RELAY_METRICS_ADDR", format!("127.0.0.1:{metrics_port}"))
        .env("RELAY_BATCH_SIZE", "10")
        .env("RELAY_WORKERS", "1")
        .env("RUST_LOG", "info")
        .envs(extra.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    relay
}

/// `series` in the metrics a relay child serves on `port`; 0 while it
/// serves none (not up yet) or does not have the series.
async fn child_metric(port: u16, series: &str) -> f64 {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("http client");
    let Ok(response) = client
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
    else {
        return 0.0;
    };
    let text = response.text().await.unwrap_or_default();
    pipeline::testing::series_value(&text, series).unwrap_or(0.0)
}

/// Issue item 11, reproduced: a topic made by hand with one replica. The
/// relay ran on it without a word, though `acks=all` is then one copy and
/// a lost node loses events the outbox already marked published. It now
/// refuses at start-up (status 2) naming the replication factor, publishes
/// nothing, and runs with `--allow-under-replicated-topic`.
#[tokio::test]
async fn a_topic_with_one_replica_is_refused_at_start_naming_the_replication_factor() {
    let db = TestDb::create().await;
    // As a single-node stack's brokers would have it: one replica, one in
    // sync (the stack's default of 2 would refuse every acks=all produce).
    let topic = TestTopic::create_with(2, 1, &[("min.insync.replicas", "1")]).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    fill_outbox(&pool, &[Uuid::now_v7()], 1).await;

    let refused = relay_process(
        &db,
        &topic,
        pipeline::testing::free_port(),
        &[("KAFKA_ALLOW_UNDER_REPLICATED_TOPIC", "false")],
    )
    .output();
    let out = tokio::time::timeout(Duration::from_secs(60), refused)
        .await
        .expect("the relay still runs on a topic with one replica after 60 s")
        .expect("run relay");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("topic {}: replication factor is 1", topic.name)),
        "{stderr}"
    );
    assert!(
        stderr.contains("--allow-under-replicated-topic"),
        "{stderr}"
    );
    assert_eq!(pending(&pool).await, 1, "nothing was published to it");

    let _relay = relay_process(
        &db,
        &topic,
        pipeline::testing::free_port(),
        &[("KAFKA_ALLOW_UNDER_REPLICATED_TOPIC", "true")],
    )
    .stderr(Stdio::null())
    .spawn()
    .expect("spawn relay");
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "with --allow-under-replicated-topic it publishes"
    );
}

/// Three replicas, but `min.insync.replicas` 1 on the topic: an `acks=all`
/// ack may be the leader's alone once its followers fall behind. Refused,
/// naming the setting, its value and where it comes from.
#[tokio::test]
async fn a_topic_whose_min_insync_replicas_is_one_is_refused_naming_it() {
    let db = TestDb::create().await;
    let topic = TestTopic::create_with(2, 3, &[("min.insync.replicas", "1")]).await;
    let mut cfg = config(&db, &topic, 1, 10);
    cfg.kafka.allow_under_replicated_topic = false;
    let error = spawn_relay(cfg)
        .await
        .ended(Duration::from_secs(60))
        .await
        .expect_err("refused");
    assert!(
        error
            .downcast_ref::<pipeline::kafka::TopicRefusal>()
            .is_some(),
        "{error:#}"
    );
    let text = format!("{error:#}");
    assert!(
        text.contains("min.insync.replicas is 1 (set on the topic), with replication factor 3"),
        "{text}"
    );
}

/// A topic whose brokers take a record only if its producer timestamp is
/// no earlier than their own clock (`message.timestamp.before.max.ms` 0),
/// with `timestamp_type`: to a CreateTime topic every record of the relay
/// arrives "from the past" (it waits out the linger at least), as every
/// record of a relay clock 2 h ahead arrives from the future of a topic
/// with Kafka 4's defaults (`message.timestamp.after.max.ms` 1 h). The
/// relay itself cannot be run under `faketime +2h`: librdkafka derives its
/// timed waits' deadlines from the faked `gettimeofday` and glibc's
/// `cnd_timedwait` waits on the real clock, so a 100 ms poll lasts 2 h and
/// the relay (before this fix too) hangs at start-up dropping its admin
/// client.
async fn narrow_timestamp_window_topic(timestamp_type: &str) -> TestTopic {
    TestTopic::create_with(
        2,
        -1,
        &[
            ("message.timestamp.type", timestamp_type),
            ("message.timestamp.before.max.ms", "0"),
        ],
    )
    .await
}

/// Issue item 4: the brokers refuse a record whose producer timestamp is
/// outside their window (`INVALID_TIMESTAMP`: a relay clock an hour ahead,
/// for Kafka 4's defaults); the relay retried that forever as any broker
/// error, unseen. Now each refusal is counted
/// (`relay_errors_total{stage="invalid_timestamp"}`) and logged as an
/// error saying what to fix, and the row is neither lost nor marked failed
/// (`--max-attempts 1`): it goes once the clock is right.
#[tokio::test]
async fn a_record_refused_for_its_timestamp_is_a_loud_error_and_stays_pending() {
    let db = TestDb::create().await;
    let topic = narrow_timestamp_window_topic("CreateTime").await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    fill_outbox(&pool, &[Uuid::now_v7()], 1).await;
    let port = pipeline::testing::free_port();
    let mut relay = relay_process(&db, &topic, port, &[("RELAY_MAX_ATTEMPTS", "1")])
        .spawn()
        .expect("spawn relay");
    let series = r#"relay_errors_total{stage="invalid_timestamp"}"#;
    assert!(
        eventually(Duration::from_secs(60), || async {
            child_metric(port, series).await >= 3.0
        })
        .await,
        "the broker's refusals are counted as {series}"
    );
    let (pending_rows, failed): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE published_at IS NULL AND failed_at IS NULL), \
                count(*) FILTER (WHERE failed_at IS NOT NULL) FROM orders.outbox",
    )
    .fetch_one(&pool)
    .await
    .expect("outbox");
    assert_eq!((pending_rows, failed), (1, 0), "the row stays pending");
    relay.start_kill().expect("kill relay");
    let out = relay.wait_with_output().await.expect("relay output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("ERROR") && l.contains("INVALID_TIMESTAMP")),
        "an error names the refusal: {stderr}"
    );
    assert!(
        stderr.contains("message.timestamp.type=LogAppendTime"),
        "{stderr}"
    );
}

/// The topic as the project now creates it (`LogAppendTime`, the
/// contract's): the brokers stamp each record and check no producer
/// timestamp, so the same narrow window refuses nothing and every row is
/// published, whatever the relay's clock says.
#[tokio::test]
async fn the_projects_topic_takes_records_whatever_the_relays_clock() {
    let db = TestDb::create().await;
    let topic = TestTopic::create_with(2, -1, &[("message.timestamp.before.max.ms", "0")]).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let keys: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    fill_outbox(&pool, &keys, 2).await;
    let relay = spawn_relay(config(&db, &topic, 1, 10)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            pending(&pool).await == 0
        })
        .await,
        "every row published; invalid_timestamp refusals: {}",
        relay
            .metric(r#"relay_errors_total{stage="invalid_timestamp"}"#)
            .await
    );
    assert_each_event_once_in_order(&topic, 5, 2).await;
    relay.stop().await;
}
