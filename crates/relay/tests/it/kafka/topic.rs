//! The topic checks at start-up (replication factor, `min.insync.replicas`) and
//! records the brokers refuse for their timestamp.

use std::process::Stdio;
use std::time::Duration;

use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, TestTopic, eventually};
use sqlx::PgPool;
use uuid::Uuid;

use super::{assert_each_event_once_in_order, config, fill_outbox, pending, spawn_relay};

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
