//! `kafka-tool` against the stack's broker, as a user runs it: the binary,
//! its arguments, its output and exit status. Each test has its own topic and
//! group.

use std::process::Output;
use std::time::Duration;

use pipeline::testing::TestTopic;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;
use uuid::Uuid;

fn tool(topic: &TestTopic) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kafka-tool"));
    command
        .env("KAFKA_BOOTSTRAP_SERVERS", &topic.bootstrap_servers)
        .env("KAFKA_TOPIC", &topic.name)
        .kill_on_drop(true);
    command
}

async fn run(topic: &TestTopic, args: &[&str]) -> Output {
    tool(topic)
        .args(args)
        .output()
        .await
        .expect("run kafka-tool")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn assert_ok(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "{what}: {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Sends `count` messages to partition 0 with `--value`.
async fn produce_to_partition_0(topic: &TestTopic, count: usize) {
    for i in 0..count {
        let value = format!("m{i}");
        let output = run(
            topic,
            &["produce", "--partition", "0", "--value", value.as_str()],
        )
        .await;
        assert_ok(&output, "produce");
    }
}

/// Sends one message per line of `input` with `kafka-tool produce ARGS`
/// reading standard input, and checks it succeeded.
async fn produce_lines(topic: &TestTopic, args: &[&str], input: &[u8]) {
    let mut produce = tool(topic)
        .arg("produce")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn produce");
    let mut stdin = produce.stdin.take().expect("stdin");
    stdin.write_all(input).await.expect("write stdin");
    drop(stdin);
    let output = produce.wait_with_output().await.expect("produce");
    assert_ok(&output, "produce");
}

/// A member of `group` subscribed to the topic that has read `count`
/// messages and committed after them; still in the group until dropped.
async fn member_that_read(topic: &TestTopic, group: &str, count: usize) -> StreamConsumer {
    let consumer: StreamConsumer = topic
        .client()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("create consumer");
    consumer.subscribe(&[&topic.name]).expect("subscribe");
    for _ in 0..count {
        let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
            .await
            .expect("a message within 30 s")
            .expect("receive");
        consumer
            .commit_message(&message, CommitMode::Sync)
            .expect("commit");
    }
    consumer
}

/// The `offsets show` row of `partition`: committed, low, high, lag.
fn row(show: &str, partition: i32) -> (String, i64, i64, i64) {
    let line = show
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cols| cols.len() == 6 && cols[1] == partition.to_string())
        .unwrap_or_else(|| panic!("no row for partition {partition} in:\n{show}"));
    let n = |i: usize| line[i].parse::<i64>().expect("a number");
    (line[2].to_owned(), n(3), n(4), n(5))
}

#[tokio::test]
async fn produced_headers_show_in_the_tail() {
    let topic = TestTopic::create(3).await;
    produce_lines(
        &topic,
        &[
            "--key",
            "k1",
            "--header",
            "msg-id=abc",
            "--header",
            "trace=x=y",
        ],
        b"one\r\n{\"a\": 1}\nbad \xff\n",
    )
    .await;

    let output = run(&topic, &["tail", "--max", "3", "--timeout", "30s"]).await;
    assert_ok(&output, "tail");
    let lines: Vec<String> = stdout(&output).lines().map(str::to_owned).collect();
    let suffix = |i: usize, value: &str| {
        format!("offset={i} key=k1 header:msg-id=abc header:trace=x=y value={value}")
    };
    assert_eq!(lines.len(), 3, "{lines:?}");
    for (i, value) in ["one", "{\"a\": 1}", "bad \\xff"].iter().enumerate() {
        assert!(
            lines[i].starts_with("partition=") && lines[i].ends_with(&suffix(i, value)),
            "line {i}: {:?}, expected … {:?}",
            lines[i],
            suffix(i, value)
        );
    }

    let output = run(&topic, &["tail", "--until-end"]).await;
    assert_ok(&output, "tail --until-end");
    assert_eq!(stdout(&output).lines().count(), 3);
}

#[tokio::test]
async fn offsets_show_what_a_consumer_committed() {
    let topic = TestTopic::create(2).await;
    produce_to_partition_0(&topic, 5).await;
    let group = format!("g-{}", Uuid::new_v4().simple());
    let member = member_that_read(&topic, &group, 3).await;
    drop(member);

    let output = run(&topic, &["offsets", "show", "--group", &group]).await;
    assert_ok(&output, "offsets show");
    let show = stdout(&output);
    assert_eq!(row(&show, 0), ("3".to_owned(), 0, 5, 2), "{show}");
    assert_eq!(row(&show, 1), ("-".to_owned(), 0, 0, 0), "{show}");
    assert!(show.contains("total lag 2"), "{show}");
}

#[tokio::test]
async fn a_reset_refuses_a_live_group_and_moves_an_empty_one_to_the_earliest() {
    let topic = TestTopic::create(2).await;
    produce_to_partition_0(&topic, 4).await;
    let group = format!("g-{}", Uuid::new_v4().simple());
    let member = member_that_read(&topic, &group, 4).await;

    let output = run(
        &topic,
        &["offsets", "reset", "--group", &group, "--to", "earliest"],
    )
    .await;
    assert_eq!(
        output.status.code(),
        Some(1),
        "refused while a member lives"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("live member"), "{stderr}");

    drop(member);
    let output = run(
        &topic,
        &[
            "offsets", "reset", "--group", &group, "--to", "earliest", "--wait", "60s",
        ],
    )
    .await;
    assert_ok(&output, "offsets reset");
    let output = run(&topic, &["offsets", "show", "--group", &group]).await;
    assert_ok(&output, "offsets show");
    let show = stdout(&output);
    assert_eq!(row(&show, 0), ("0".to_owned(), 0, 4, 4), "{show}");
    assert_eq!(row(&show, 1), ("0".to_owned(), 0, 0, 0), "{show}");

    // And a fresh member of the group reads everything again.
    drop(member_that_read(&topic, &group, 4).await);
}

#[tokio::test]
async fn a_missing_topic_is_a_clear_error() {
    let topic = TestTopic::create(1).await;
    let output = run(
        &topic,
        &["tail", "--topic", "no-such-topic-here", "--max", "1"],
    )
    .await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("does not exist"), "{stderr}");
    let output = run(
        &topic,
        &["produce", "--header", "no-equals", "--value", "v"],
    )
    .await;
    assert_eq!(output.status.code(), Some(2), "bad usage");
}

/// `create` gives a new topic the pipeline's retention and segment span (the
/// broker reports them back, as payments reads them for its horizon); a
/// `--config` replaces one of them.
#[tokio::test]
async fn create_sets_the_pipeline_topic_configs() {
    let topic = TestTopic::create(1).await;
    let name = format!("{}-created", topic.name);
    let output = run(
        &topic,
        &[
            "create",
            "--topic",
            &name,
            "--partitions",
            "1",
            "--config",
            "retention.ms=3600000",
        ],
    )
    .await;
    assert_ok(&output, "create");
    let configs =
        pipeline::kafka::topic_configs(&topic.client(), &name, &["retention.ms", "segment.ms"])
            .await
            .expect("describe");
    assert_eq!(
        configs.get("retention.ms").map(String::as_str),
        Some("3600000")
    );
    assert_eq!(
        configs.get("segment.ms"),
        Some(&pipeline::contract::ORDER_EVENTS_SEGMENT_MS.to_string())
    );
    // TestTopic creates its topics with the contract's configs too.
    let configs = pipeline::kafka::topic_configs(
        &topic.client(),
        &topic.name,
        &["retention.ms", "segment.ms"],
    )
    .await
    .expect("describe");
    assert_eq!(
        configs.get("retention.ms"),
        Some(&pipeline::contract::ORDER_EVENTS_RETENTION_MS.to_string())
    );
}

/// `offsets committed-past` lists, per message below the group's committed
/// offset, its position and its event's ids (`-` for a message that is not
/// an envelope), and nothing at or past the commit, nor of a partition the
/// group never committed in.
#[tokio::test]
async fn committed_past_lists_what_the_group_will_not_be_given_again() {
    let topic = TestTopic::create(2).await;
    let events: Vec<(Uuid, Uuid)> = (0..3).map(|_| (Uuid::now_v7(), Uuid::now_v7())).collect();
    let mut lines = String::new();
    for (msg_id, order_id) in &events {
        let envelope = pipeline::envelope::Envelope::new(
            *msg_id,
            pipeline::contract::ORDER_CREATED.into(),
            *order_id,
            chrono::Utc::now(),
            br#"{"a": 1}"#,
        )
        .expect("envelope");
        lines.push_str(&String::from_utf8(envelope.encode().expect("encode")).expect("utf-8"));
        lines.push('\n');
    }
    lines.push_str("not an envelope\nthe fifth, not consumed\n");
    produce_lines(&topic, &["--partition", "0"], lines.as_bytes()).await;
    let group = format!("g-{}", Uuid::new_v4().simple());
    let member = member_that_read(&topic, &group, 4).await;
    drop(member);

    let output = run(&topic, &["offsets", "committed-past", "--group", &group]).await;
    assert_ok(&output, "offsets committed-past");
    let mut expected: Vec<String> = events
        .iter()
        .enumerate()
        .map(|(i, (m, a))| format!("{}\t0\t{i}\t{m}\t{a}", topic.name))
        .collect();
    expected.push(format!("{}\t0\t3\t-\t-", topic.name));
    assert_eq!(
        stdout(&output).lines().collect::<Vec<_>>(),
        expected,
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let nobody = run(
        &topic,
        &["offsets", "committed-past", "--group", "never-consumed"],
    )
    .await;
    assert_ok(&nobody, "a group that never committed");
    assert_eq!(stdout(&nobody), "");
}
