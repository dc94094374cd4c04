//! Consumer-group membership: members splitting the partitions, joining
//! (classic and KIP-848 protocols), killed, and static members fenced.

use std::time::Duration;

use payments::GroupProtocol;
use pipeline::testing::{Service, TestDb, TestTopic, eventually};
use rdkafka::consumer::{BaseConsumer, Consumer};
use sqlx::PgPool;

use super::{
    CHARGES, DOUBLES, LEDGER, config, count, events, payments_process, produce_events,
    spawn_payments,
};

#[tokio::test]
async fn two_consumers_in_one_group_split_the_partitions() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let a = spawn_payments(config(&db, &topic, "g-split")).await;
    let b = spawn_payments(config(&db, &topic, "g-split")).await;
    let events = events(300);
    produce_events(&topic, &events).await;
    assert!(
        eventually(Duration::from_secs(90), || async {
            count(&pool, CHARGES).await == 300
        })
        .await
    );
    let (consumed_a, consumed_b) = (
        a.metric("payments_consumed_total").await,
        b.metric("payments_consumed_total").await,
    );
    assert!(
        consumed_a > 0.0 && consumed_b > 0.0,
        "both members consumed: {consumed_a} / {consumed_b}"
    );
    assert_eq!(count(&pool, LEDGER).await, 300);
    assert_eq!(count(&pool, DOUBLES).await, 0);
    a.stop().await;
    b.stop().await;
}

/// The partitions a member owns now: assigned minus revoked, from its
/// `payments_partitions_moved_total`.
async fn owned(member: &Service) -> f64 {
    member
        .metric(r#"payments_partitions_moved_total{event="assigned"}"#)
        .await
        - member
            .metric(r#"payments_partitions_moved_total{event="revoked"}"#)
            .await
}

#[tokio::test]
async fn a_member_joining_moves_only_the_partitions_that_change_owner() {
    a_member_joins(GroupProtocol::Classic, "g-coop").await;
}

/// The same with the consumer protocol (KIP-848): the coordinator assigns,
/// incrementally too.
#[tokio::test]
async fn with_the_consumer_protocol_a_member_joining_moves_only_what_changes_owner() {
    a_member_joins(GroupProtocol::Consumer, "g-coop-848").await;
}

async fn a_member_joins(protocol: GroupProtocol, group: &str) {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let member = || {
        let mut c = config(&db, &topic, group);
        c.group_protocol = protocol;
        c
    };
    let a = spawn_payments(member()).await;
    let first = events(200);
    produce_events(&topic, &first).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            owned(&a).await == 6.0 && count(&pool, CHARGES).await == 200
        })
        .await,
        "the first member owns all six partitions and charged the first events"
    );

    // A second member joins while events keep coming.
    let b = spawn_payments(member()).await;
    let second = events(200);
    produce_events(&topic, &second).await;
    assert!(
        eventually(Duration::from_secs(90), || async {
            owned(&a).await == 3.0 && owned(&b).await == 3.0
        })
        .await,
        "the partitions split three and three: a owns {}, b owns {}",
        owned(&a).await,
        owned(&b).await
    );
    // Cooperative-sticky: the first member gave up the three that moved and
    // kept the other three throughout (an eager rebalance revokes all six,
    // then assigns three back).
    let revoked = a
        .metric(r#"payments_partitions_moved_total{event="revoked"}"#)
        .await;
    assert_eq!(revoked, 3.0, "the first member revoked only what moved");
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 400
        })
        .await
    );
    assert_eq!(count(&pool, LEDGER).await, 400);
    assert_eq!(count(&pool, DOUBLES).await, 0);
    a.stop().await;
    b.stop().await;
}

/// With the consumer protocol (KIP-848) a member killed -9 holds its
/// partitions for the brokers' session (`group.consumer.session.timeout.ms`,
/// the stack's 10 s) and no longer; meanwhile the other member goes on with
/// its own, then takes the dead one's and applies what waited there.
#[tokio::test]
async fn with_the_consumer_protocol_a_member_killed_gives_its_partitions_up_after_its_session() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(6).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let group = "g-kill-848";
    let mut cfg = config(&db, &topic, group);
    cfg.group_protocol = GroupProtocol::Consumer;
    let a = spawn_payments(cfg).await;
    let mut b = payments_process(&db, &topic, group)
        .env("PAYMENTS_GROUP_PROTOCOL", "consumer")
        .spawn()
        .expect("spawn payments");
    produce_events(&topic, &events(200)).await;
    assert!(
        eventually(Duration::from_secs(90), || async {
            owned(&a).await == 3.0 && count(&pool, CHARGES).await == 200
        })
        .await,
        "the two members split the partitions and charged the first events (a owns {})",
        owned(&a).await
    );
    b.start_kill().expect("kill -9");
    b.wait().await.expect("wait");
    let killed = std::time::Instant::now();
    produce_events(&topic, &events(200)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            owned(&a).await == 6.0 && count(&pool, CHARGES).await == 400
        })
        .await,
        "the survivor took all six partitions and charged everything (owns {}, {} charges)",
        owned(&a).await,
        count(&pool, CHARGES).await
    );
    let took = killed.elapsed();
    assert!(
        took >= Duration::from_secs(5),
        "the dead member's partitions waited for its session, not {took:?}"
    );
    assert_eq!(count(&pool, DOUBLES).await, 0);
    a.stop().await;
}

#[tokio::test]
async fn a_static_member_fenced_again_by_a_second_process_with_its_id_exits_with_an_error() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(2).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let mut static_config = config(&db, &topic, "g-fenced");
    static_config.group_instance_id = Some("payments-1".into());
    let old = spawn_payments(static_config.clone()).await;
    produce_events(&topic, &events(20)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 20
        })
        .await
    );
    // A second process with the same group.instance.id: the broker fences
    // the older one, whose client turns fatal. It joins again once, which
    // fences the newer one, which joins again too: fenced a second time
    // within the rejoin window, the older one must end, with the reason.
    let new = spawn_payments(static_config).await;
    let ended = old.ended(Duration::from_secs(120)).await;
    let error = ended.expect_err("the fenced member ends with an error");
    assert!(
        format!("{error:#}").to_lowercase().contains("fenc"),
        "the error says it was fenced: {error:#}"
    );
    assert_eq!(new.metric("payments_consumer_rejoins_total").await, 1.0);
    // The new member carries on.
    produce_events(&topic, &events(20)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 40
        })
        .await
    );
    new.stop().await;
}

#[tokio::test]
async fn a_static_member_fenced_once_joins_again_and_carries_on() {
    let db = TestDb::create().await;
    let topic = TestTopic::create(2).await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let group = format!("g-fenced-once-{}", topic.name);
    let mut static_config = config(&db, &topic, &group);
    static_config.group_instance_id = Some("payments-1".into());
    let member = spawn_payments(static_config.clone()).await;
    produce_events(&topic, &events(20)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 20
        })
        .await
    );
    // A client with the member's id joins the group and goes away (a static
    // member's close does not leave the group): the coordinator fences the
    // member, as one that lost track of it does.
    let intruder: BaseConsumer = topic
        .client()
        .set("group.id", &group)
        .set("group.instance.id", "payments-1")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", "6000")
        .create()
        .expect("intruder");
    intruder.subscribe(&[&topic.name]).expect("subscribe");
    let joined = tokio::task::spawn_blocking(move || {
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while std::time::Instant::now() < until {
            let _ = intruder.poll(Duration::from_millis(100));
            if intruder.assignment().is_ok_and(|a| a.count() > 0) {
                return true;
            }
        }
        false
    })
    .await
    .expect("intruder task");
    assert!(joined, "the intruder got partitions");
    assert!(
        eventually(Duration::from_secs(60), || async {
            member.metric("payments_consumer_rejoins_total").await == 1.0
        })
        .await,
        "the fenced member joined again"
    );
    // It carries on: what comes next is charged, nothing twice.
    produce_events(&topic, &events(20)).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&pool, CHARGES).await == 40
        })
        .await
    );
    assert_eq!(count(&pool, DOUBLES).await, 0);
    member.stop().await;
}
