//! The write queue: a full queue sheds with 503, a flood on one key is
//! bounded and settled at once, and a request whose client left is not written.

use std::time::Duration;

use orders::auth::Caller;
use orders::store::InjectFault;
use pipeline::testing::{TestDb, eventually};
use reqwest::StatusCode;
use sqlx::PgPool;

use super::{BODY, TestApp, counts, n};

/// A full write queue sheds load with 503 `overloaded` at once; a shed
/// request consumed nothing and its retry succeeds.
#[tokio::test]
async fn a_full_write_queue_answers_503_and_the_retry_succeeds() {
    let db = TestDb::create().await;
    let app = TestApp::spawn_with(&db, InjectFault::None, 1, 1, false).await;
    let keys: Vec<String> = (0..200).map(|i| format!("burst-{i}")).collect();
    let replies = futures::future::join_all(keys.iter().map(|k| app.create(k, BODY))).await;
    let mut shed = Vec::new();
    for (key, reply) in keys.iter().zip(&replies) {
        match reply.status {
            StatusCode::CREATED => {}
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(reply.error_code(), "overloaded");
                shed.push(key);
            }
            other => panic!("{key}: unexpected {other}"),
        }
    }
    assert_eq!(
        counts(&db).await,
        n((200 - shed.len()) as i64),
        "a shed request wrote nothing"
    );
    for key in &shed {
        assert_eq!(app.create(key, BODY).await.status, StatusCode::CREATED);
    }
    assert_eq!(counts(&db).await, n(200));
    app.stop().await;
}

/// The write path driven in-process (no sockets: 5,000 concurrent clients fit
/// in one test), with one writer and a bound of `queue`.
struct Writers {
    api: orders::api::OrdersApi,
    metrics: std::sync::Arc<orders::metrics::OrdersMetrics>,
    pool: PgPool,
}

impl Writers {
    async fn start(db: &TestDb, queue: usize) -> Self {
        let pool = PgPool::connect(&db.url).await.expect("pool");
        let metrics = std::sync::Arc::new(orders::metrics::OrdersMetrics::new().expect("metrics"));
        let store = std::sync::Arc::new(orders::store::Store::new(
            pool.clone(),
            InjectFault::None,
            false,
            pipeline::crash::Crasher::default(),
        ));
        let (writes, _writers) = orders::writer::WriteQueue::start(
            store.clone(),
            orders::writer::WriterSettings {
                writers: 1,
                max_batch: 128,
                queue,
                linger: std::time::Duration::ZERO,
            },
            metrics.clone(),
        );
        Self {
            api: orders::api::OrdersApi::new(store, writes, metrics.clone()),
            metrics,
            pool,
        }
    }

    /// Holds the keys table so the next write transaction waits in its claim;
    /// returns once a write is waiting on it.
    async fn hold_keys(&self) -> sqlx::Transaction<'static, sqlx::Postgres> {
        let mut tx = self.pool.begin().await.expect("begin");
        sqlx::query("LOCK TABLE fx.idempotency_keys IN EXCLUSIVE MODE")
            .execute(&mut *tx)
            .await
            .expect("lock");
        tx
    }

    async fn wait_for_blocked_writer(&self) {
        let blocked = || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&self.pool)
            .await
            .expect("pg_stat_activity");
            waiting > 0
        };
        assert!(
            eventually(Duration::from_secs(10), blocked).await,
            "no write waits on the lock"
        );
    }

    async fn wait_for_inflight(&self, value: i64) {
        let reached = || async { self.metrics.write_inflight.get() == value };
        assert!(
            eventually(Duration::from_secs(30), reached).await,
            "in flight: {} (expected {value})",
            self.metrics.write_inflight.get()
        );
    }
}

/// 5,000 concurrent requests reusing one key with another body: requests
/// deferred behind the key count against `--write-queue` (exactly `queue` are
/// accepted, the rest get 503 at once), and when the key's claim settles as a
/// mismatch every deferred request with that body is answered with it, in
/// the same batch — not one per batch.
#[tokio::test]
async fn a_flood_on_one_key_is_bounded_and_settled_at_once() {
    const QUEUE: usize = 256;
    const FLOOD: usize = 5_000;
    let db = TestDb::create().await;
    let writers = Writers::start(&db, QUEUE).await;
    let key = pipeline::idempotency::IdempotencyKey::parse(b"flooded").expect("key");
    let first = orders::order::CreateOrder {
        account_id: 1,
        amount_cents: 100,
    };
    writers
        .api
        .create(&Caller::anonymous(), &key, &first)
        .await
        .expect("first use");
    let batches_before = writers.metrics.write_batch_size.get_sample_count();

    let lock = writers.hold_keys().await;
    let other = orders::order::CreateOrder {
        account_id: 1,
        amount_cents: 200,
    };
    let (done, mut answers) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..FLOOD {
        let (api, key, done) = (writers.api.clone(), key.clone(), done.clone());
        tokio::spawn(async move {
            let _ = done.send(
                api.create(&Caller::anonymous(), &key, &other)
                    .await
                    .map(|_| ()),
            );
        });
    }
    drop(done);
    // Every request beyond the bound is shed at once, while the accepted
    // ones wait (their claim is blocked on the lock).
    let mut shed = 0;
    while shed < FLOOD - QUEUE {
        let answer = tokio::time::timeout(Duration::from_secs(30), answers.recv())
            .await
            .expect("the shed requests are answered at once")
            .expect("answer");
        match answer {
            Err(orders::error::ApiError::Overloaded) => shed += 1,
            other => panic!("before the claim settles: {other:?}"),
        }
    }
    writers.wait_for_blocked_writer().await;
    assert_eq!(writers.metrics.write_inflight.get(), QUEUE as i64);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), answers.recv())
            .await
            .is_err(),
        "nothing more is answered while the claim waits"
    );

    lock.rollback().await.expect("release");
    let mut refused = 0;
    while let Some(answer) = tokio::time::timeout(Duration::from_secs(30), answers.recv())
        .await
        .expect("every accepted request is answered")
    {
        match answer {
            Err(orders::error::ApiError::KeyReused) => refused += 1,
            other => panic!("after the claim: {other:?}"),
        }
    }
    assert_eq!(refused, QUEUE);
    writers.wait_for_inflight(0).await;
    let batches = writers.metrics.write_batch_size.get_sample_count() - batches_before;
    assert!(
        batches <= 3,
        "{batches} batches for {QUEUE} requests on one key"
    );
    assert_eq!(counts(&db).await, n(1), "nothing written by the flood");
}

/// A request whose client went away before a writer took it is dropped
/// unwritten and gives its place back.
#[tokio::test]
async fn a_request_whose_client_left_is_not_written() {
    let db = TestDb::create().await;
    let writers = Writers::start(&db, 256).await;
    let body = orders::order::CreateOrder {
        account_id: 7,
        amount_cents: 700,
    };
    let lock = writers.hold_keys().await;
    let stays = {
        let api = writers.api.clone();
        let key = pipeline::idempotency::IdempotencyKey::parse(b"stays").expect("key");
        tokio::spawn(async move { api.create(&Caller::anonymous(), &key, &body).await })
    };
    writers.wait_for_blocked_writer().await;
    let leaving: Vec<_> = (0..100)
        .map(|i| {
            let api = writers.api.clone();
            let key =
                pipeline::idempotency::IdempotencyKey::parse(format!("leaves-{i}").as_bytes())
                    .expect("key");
            tokio::spawn(async move { api.create(&Caller::anonymous(), &key, &body).await })
        })
        .collect();
    writers.wait_for_inflight(101).await;
    for task in &leaving {
        task.abort(); // the client disconnects: its handler future is dropped
    }
    for task in leaving {
        assert!(task.await.expect_err("aborted").is_cancelled());
    }
    lock.rollback().await.expect("release");
    stays
        .await
        .expect("task")
        .expect("the waiting client is answered");
    writers.wait_for_inflight(0).await;
    assert_eq!(writers.metrics.write_abandoned_total.get(), 100);
    assert_eq!(counts(&db).await, n(1), "only the client that stayed");
}
