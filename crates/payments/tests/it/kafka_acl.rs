//! The stack's Kafka trusts nobody (`STACK_SECURITY=tls`, the default):
//! every listener is SASL_SSL, and each service's principal may do only its
//! own part. Each test signs in as a principal of the stack
//! ([`KafkaPrincipal`]) on a topic under the services' grants
//! (`order.events.test-<uuid>`), and one forges an `order.created` that
//! payments, running as its own principal, must never charge.

use std::time::Duration;

use payments::run;
use pipeline::testing::{KafkaPrincipal, Service, TestDb, TestTopic, eventually, stack_var_opt};
use rdkafka::ClientConfig;
use rdkafka::Offset;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use sqlx::PgPool;
use uuid::Uuid;

/// Whether the stack's brokers take only SASL_SSL; a stack started with
/// `STACK_SECURITY=plaintext` (the cost table's counter-example) has no
/// principals to test.
fn secured() -> bool {
    let secured = stack_var_opt("STACK_SECURITY").as_deref() != Some("plaintext");
    if !secured {
        eprintln!("STACK_SECURITY=plaintext: the brokers take anyone; nothing to test");
    }
    secured
}

fn order_created(order_id: Uuid, amount_cents: i64) -> Vec<u8> {
    crate::kafka::envelope(&crate::kafka::Event {
        msg_id: Uuid::now_v7(),
        order_id,
        amount_cents,
    })
}

/// Sends one record with `client` (no idempotence: a refused principal's
/// produce fails on the topic, not on a producer id) and returns how the
/// broker answered.
async fn send(
    client: ClientConfig,
    topic: &str,
    key: &str,
    value: &[u8],
) -> Result<(), KafkaError> {
    let producer: FutureProducer = client
        .clone()
        .set("enable.idempotence", "false")
        .set("message.timeout.ms", "15000")
        .create()
        .expect("producer");
    let sent = producer
        .send(
            FutureRecord::to(topic).key(key).payload(value),
            Duration::from_secs(20),
        )
        .await
        .map(|_| ())
        .map_err(|(e, _)| e);
    producer.flush(Duration::from_secs(5)).ok();
    sent
}

fn code(error: &KafkaError) -> Option<RDKafkaErrorCode> {
    error.rdkafka_error_code()
}

/// A client of the stack's brokers as nobody: no TLS, no SASL.
fn anonymous() -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set(
        "bootstrap.servers",
        pipeline::testing::stack_var("KAFKA_BOOTSTRAP_SERVERS"),
    );
    config
}

/// A client with TLS and the relay's name but not its password.
fn impostor() -> ClientConfig {
    let mut config = KafkaPrincipal::Relay.client();
    config.set("sasl.password", "not-the-relay-s-password");
    config
}

#[tokio::test]
async fn a_client_without_the_credentials_is_refused() {
    if !secured() {
        return;
    }
    let topic = TestTopic::create_for_services(1).await;
    for (who, client) in [
        ("no TLS, no SASL", anonymous()),
        ("a wrong password", impostor()),
    ] {
        let reader = client.clone();
        let metadata = tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = reader.create().expect("client");
            consumer
                .fetch_metadata(None, Duration::from_secs(5))
                .map(|m| m.topics().len())
        })
        .await
        .expect("task");
        assert!(metadata.is_err(), "{who}: read the metadata: {metadata:?}");
        let sent = send(client, &topic.name, "k", b"v").await;
        assert!(sent.is_err(), "{who}: a produce was acknowledged");
    }
    // The admin, with the same TLS, is served: the refusals were the
    // credentials', not the cluster's.
    send(KafkaPrincipal::Admin.client(), &topic.name, "k", b"v")
        .await
        .expect("the admin produces");
}

#[tokio::test]
async fn payments_may_read_its_topics_in_its_groups_but_not_produce() {
    if !secured() {
        return;
    }
    let topic = TestTopic::create_for_services(1).await;
    let refused = send(KafkaPrincipal::Payments.client(), &topic.name, "k", b"v")
        .await
        .expect_err("payments produced");
    assert_eq!(
        code(&refused),
        Some(RDKafkaErrorCode::TopicAuthorizationFailed),
        "{refused}"
    );

    send(KafkaPrincipal::Relay.client(), &topic.name, "k", b"v")
        .await
        .expect("the relay produces to its topic");
    let group = format!("payments-test-{}", Uuid::new_v4().simple());
    let name = topic.name.clone();
    let read = tokio::task::spawn_blocking(move || {
        read_and_commit(KafkaPrincipal::Payments, &group, &name)
    })
    .await
    .expect("task");
    assert_eq!(
        read,
        Ok(1),
        "payments reads and commits in a payments-* group"
    );

    // Not in a group that is not its own.
    let name = topic.name.clone();
    let other = tokio::task::spawn_blocking(move || {
        read_and_commit(KafkaPrincipal::Payments, "billing", &name)
    })
    .await
    .expect("task");
    assert_eq!(other, Err(RDKafkaErrorCode::GroupAuthorizationFailed));
}

#[tokio::test]
async fn the_relay_may_write_its_topics_but_not_read_them_nor_commit() {
    if !secured() {
        return;
    }
    let topic = TestTopic::create_for_services(1).await;
    send(KafkaPrincipal::Relay.client(), &topic.name, "k", b"v")
        .await
        .expect("the relay produces");
    // Not to a topic outside its grant.
    let elsewhere = TestTopic::create(1).await;
    let refused = send(KafkaPrincipal::Relay.client(), &elsewhere.name, "k", b"v")
        .await
        .expect_err("the relay produced outside order.events*");
    assert_eq!(
        code(&refused),
        Some(RDKafkaErrorCode::TopicAuthorizationFailed),
        "{refused}"
    );

    let group = format!("payments-test-{}", Uuid::new_v4().simple());
    let name = topic.name.clone();
    let read =
        tokio::task::spawn_blocking(move || read_and_commit(KafkaPrincipal::Relay, &group, &name))
            .await
            .expect("task");
    assert!(
        matches!(
            read,
            Err(RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::GroupAuthorizationFailed)
        ),
        "the relay read or committed: {read:?}"
    );
}

/// As `principal` in `group`: reads partition 0 of `topic` from the start
/// until it is at its end, then commits after what it read; how many it
/// read, or the broker's refusal.
fn read_and_commit(
    principal: KafkaPrincipal,
    group: &str,
    topic: &str,
) -> Result<usize, RDKafkaErrorCode> {
    use rdkafka::message::Message;
    let consumer: BaseConsumer = principal
        .client()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .create()
        .expect("consumer");
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(topic, 0, Offset::Beginning)
        .expect("partition");
    consumer.assign(&assignment).expect("assign");
    let mut read = 0usize;
    let mut next = 0i64;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "no end of partition within 20 s"
        );
        match consumer.poll(Duration::from_millis(500)) {
            Some(Ok(m)) => {
                read += 1;
                next = m.offset() + 1;
            }
            Some(Err(KafkaError::PartitionEOF(_))) => break,
            Some(Err(e)) => return Err(code(&e).unwrap_or(RDKafkaErrorCode::Unknown)),
            None => {}
        }
    }
    let mut offsets = TopicPartitionList::new();
    offsets
        .add_partition_offset(topic, 0, Offset::Offset(next))
        .expect("offset");
    consumer
        .commit(&offsets, CommitMode::Sync)
        .map_err(|e| code(&e).unwrap_or(RDKafkaErrorCode::Unknown))?;
    Ok(read)
}

/// A forged `order.created` sent by anyone but the relay never reaches
/// payments, which runs as its own principal on the services' topic: only
/// the relay's own event is charged.
#[tokio::test]
async fn a_forged_order_created_is_never_charged() {
    if !secured() {
        return;
    }
    let db = TestDb::create().await;
    let topic = TestTopic::create_for_services(3).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let mut config = crate::kafka::config(
        &db,
        &topic,
        &format!("payments-forged-{}", Uuid::new_v4().simple()),
    );
    config.kafka = topic.kafka_args_as(KafkaPrincipal::Payments);
    let consumer = Service::spawn("payments", |metrics, cancel| run(config, metrics, cancel)).await;

    let (forged, genuine) = (Uuid::now_v7(), Uuid::now_v7());
    for (who, client) in [
        ("nobody", anonymous()),
        ("a wrong password", impostor()),
        ("payments", KafkaPrincipal::Payments.client()),
    ] {
        let sent = send(
            client,
            &topic.name,
            &forged.to_string(),
            &order_created(forged, 1_000_000),
        )
        .await;
        assert!(sent.is_err(), "{who} produced a forged order.created");
    }
    send(
        KafkaPrincipal::Relay.client(),
        &topic.name,
        &genuine.to_string(),
        &order_created(genuine, 500),
    )
    .await
    .expect("the relay produces");
    assert!(
        eventually(Duration::from_secs(60), || async {
            consumer.metric("payments_charges_total").await >= 1.0
        })
        .await,
        "payments, as its own principal, charged the relay's event"
    );
    let charged: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT order_id, amount_cents::int8 FROM payments.charges")
            .fetch_all(&pool)
            .await
            .expect("charges");
    assert_eq!(
        charged,
        vec![(genuine, 500)],
        "only the relay's order was charged"
    );
    consumer.stop().await;
}
