//! The library's consumer loop (`effectively::store::consume`) against the
//! real broker and PostgreSQL: events relayed by the library's relay, every
//! one of them published twice, a poison record and one with no msg_id: each
//! effect applied once, the rest dead-lettered, nothing stalled.

use std::time::Duration;

use effectively::store::{Event, Handler, HandlerError, KafkaSink, Record, Relay, consume};
use pipeline::testing::TestTopic;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

#[tokio::test]
async fn each_record_is_applied_once_and_what_cannot_be_is_dead_lettered() {
    let (_db, pool, fx) = super::store::store("billing_fx").await;
    sqlx::query("CREATE TABLE invoices (cart int PRIMARY KEY, total int NOT NULL)")
        .execute(&pool)
        .await
        .expect("the consumer's own table");
    let topic = TestTopic::create(3).await;

    // 40 events, relayed twice (every row marked pending again after the
    // first pass): 80 records, each event's two copies with one msg_id.
    let events: Vec<Event> = (0..40)
        .map(|n| {
            Event::json(
                &topic.name,
                &format!("cart-{n}"),
                "cart.checked_out",
                &serde_json::json!({"cart": n, "total": n * 10}),
            )
            .expect("a valid event")
        })
        .collect();
    fx.outbox()
        .enqueue_batch(&pool, &events)
        .await
        .expect("enqueue");
    let config = topic.client();
    let relay = Relay::new(&fx, KafkaSink::new(&config).expect("a producer"));
    assert_eq!(relay.relay_all().await.expect("relay").published, 40);
    sqlx::query("UPDATE billing_fx.outbox SET published_at = NULL")
        .execute(&pool)
        .await
        .expect("mark pending again");
    assert_eq!(relay.relay_all().await.expect("relay").published, 40);
    // A record the handler refuses, and one with no msg_id header.
    let poison = Event::json(
        &topic.name,
        "cart-999",
        "cart.checked_out",
        &serde_json::json!({"cart": 999}),
    )
    .expect("a valid event");
    fx.outbox().enqueue(&pool, &poison).await.expect("enqueue");
    assert_eq!(relay.relay_all().await.expect("relay").published, 1);
    let raw: FutureProducer = config.create().expect("a producer");
    raw.send(
        FutureRecord::to(&topic.name).key("cart-x").payload("{}"),
        Duration::from_secs(10),
    )
    .await
    .expect("produce a record without headers");

    let consumer: StreamConsumer = topic
        .client()
        .set("group.id", format!("billing-{}", topic.name))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("a consumer");
    consumer.subscribe(&[&topic.name]).expect("subscribe");
    let handler: &Handler = &|tx, record: &Record| {
        Box::pin(async move {
            let body: serde_json::Value = serde_json::from_slice(&record.payload)
                .map_err(|e| HandlerError::Reject(format!("not JSON: {e}")))?;
            let (Some(cart), Some(total)) = (body["cart"].as_i64(), body["total"].as_i64()) else {
                return Err(HandlerError::Reject("no cart or total".into()));
            };
            sqlx::query("INSERT INTO invoices (cart, total) VALUES ($1, $2)")
                .bind(i32::try_from(cart).map_err(|e| HandlerError::Reject(e.to_string()))?)
                .bind(i32::try_from(total).map_err(|e| HandlerError::Reject(e.to_string()))?)
                .execute(&mut *tx)
                .await?;
            Ok(())
        })
    };
    let inbox = fx.inbox("billing");
    let cancel = CancellationToken::new();
    let watch = async {
        let mut done = false;
        for _ in 0..300 {
            if count(&pool, "SELECT count(*) FROM invoices").await == 40
                && count(&pool, "SELECT count(*) FROM billing_fx.dead_letters").await == 2
            {
                done = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A moment more: a copy applied twice would show now.
        tokio::time::sleep(Duration::from_millis(500)).await;
        cancel.cancel();
        done
    };
    let (result, done) = tokio::join!(consume(&fx, &inbox, &consumer, handler, &cancel), watch);
    result.expect("consume");
    assert!(done, "40 invoices and 2 dead letters within 30 s");
    assert_eq!(count(&pool, "SELECT count(*) FROM invoices").await, 40);
    assert_eq!(
        count(&pool, "SELECT sum(total) FROM invoices").await,
        (0..40).map(|n| n * 10).sum::<i64>()
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM billing_fx.inbox WHERE consumer = 'billing'"
        )
        .await,
        41,
        "40 applied, and the refused one's claim kept"
    );
    let letters: Vec<(Option<String>, String)> =
        sqlx::query_as("SELECT msg_id, reason FROM billing_fx.dead_letters ORDER BY reason")
            .fetch_all(&pool)
            .await
            .expect("dead letters");
    assert!(
        letters.iter().any(
            |(id, why)| id.as_deref() == Some(poison.msg_id().to_string().as_str())
                && why == "no cart or total"
        ),
        "{letters:?}"
    );
    assert!(
        letters
            .iter()
            .any(|(id, why)| id.is_none() && why.contains("is empty")),
        "{letters:?}"
    );
}

/// A record for `handle_batch`, as the consumer loop would make it.
fn record(msg_id: &str, payload: &str) -> Record {
    Record {
        source: format!("t/0/{msg_id}"),
        key: None,
        payload: payload.as_bytes().to_vec(),
        headers: vec![],
        msg_id: msg_id.to_owned(),
        sent_at: chrono::Utc::now(),
    }
}

#[tokio::test]
async fn a_batch_is_one_transaction_and_a_refused_record_leaves_the_others_applied() {
    use effectively::store::{Handled, handle_batch};
    let (_db, pool, fx) = super::store::store("billing_fx").await;
    sqlx::query("CREATE TABLE effects (n int NOT NULL)")
        .execute(&pool)
        .await
        .expect("the consumer's own table");
    // Applies n; refuses negatives; "not now" for 99.
    let handler: &Handler = &|tx, record: &Record| {
        Box::pin(async move {
            let n: i32 = std::str::from_utf8(&record.payload)
                .ok()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| HandlerError::Reject("not a number".into()))?;
            if n < 0 {
                return Err(HandlerError::Reject(format!("{n} is negative")));
            }
            if n == 99 {
                return Err(HandlerError::Retry("not now".into()));
            }
            sqlx::query("INSERT INTO effects (n) VALUES ($1)")
                .bind(n)
                .execute(&mut *tx)
                .await?;
            Ok(())
        })
    };
    let inbox = fx.inbox("billing");
    let batch = [
        record("a", "1"),
        record("b", "-2"),
        record("c", "3"),
        record("a", "1"),  // a copy of the first, in the same batch
        record("", "4"),   // no id
        record("d", "-5"), // a second refusal
        record("e", "6"),
    ];
    let handled = handle_batch(&fx, &inbox, handler, &batch)
        .await
        .expect("the batch");
    assert_eq!(
        handled,
        [
            Handled::Applied,
            Handled::DeadLettered("-2 is negative".into()),
            Handled::Applied,
            Handled::Duplicate,
            handled[4].clone(),
            Handled::DeadLettered("-5 is negative".into()),
            Handled::Applied,
        ]
    );
    assert!(matches!(handled[4], Handled::DeadLettered(_)));
    let applied: Vec<i32> = sqlx::query_scalar("SELECT n FROM effects ORDER BY n")
        .fetch_all(&pool)
        .await
        .expect("effects");
    assert_eq!(applied, [1, 3, 6], "each once, the refused ones not at all");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM billing_fx.dead_letters").await,
        3
    );

    // The same batch again: every claimed id a duplicate, nothing new.
    let again = handle_batch(&fx, &inbox, handler, &batch[..4])
        .await
        .expect("the batch again");
    assert_eq!(again, vec![Handled::Duplicate; 4]);
    // "Not now" anywhere in a batch: nothing of it commits.
    let retry = [record("f", "7"), record("g", "99")];
    assert!(handle_batch(&fx, &inbox, handler, &retry).await.is_err());
    assert_eq!(
        count(&pool, "SELECT count(*) FROM effects WHERE n = 7").await,
        0
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM billing_fx.inbox WHERE msg_id = 'f'"
        )
        .await,
        0
    );
}
