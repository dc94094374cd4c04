//! The library's relay over an outbox table of the user's own (a
//! `Source`), and what it tells its hooks, against the real PostgreSQL.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use effectively::store::{
    Claimed, Event, OutboxSource, Outgoing, Pass, Relay, RelayHooks, SendError, Sent, Settled,
    Sink, Source, Stage, shard_of,
};
use pipeline::testing::{TestDb, eventually};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

/// A service's own outbox, not the library's: its key is a bigint, its
/// event a jsonb body, its shard a column it fills itself.
const TABLE: &str = "CREATE SCHEMA legacy; \
    CREATE TABLE legacy.events ( \
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
        account bigint NOT NULL, \
        shard smallint NOT NULL, \
        body jsonb NOT NULL, \
        created_at timestamptz NOT NULL DEFAULT now(), \
        sent_at timestamptz, \
        refused text); \
    CREATE INDEX events_pending ON legacy.events (shard, id) WHERE sent_at IS NULL AND refused IS NULL; \
    CREATE INDEX events_pending_by_account ON legacy.events (account, id) WHERE sent_at IS NULL; \
    CREATE FUNCTION legacy.notify() RETURNS trigger LANGUAGE plpgsql AS \
        $$ BEGIN PERFORM pg_notify('legacy_events', ''); RETURN NULL; END $$; \
    CREATE TRIGGER events_notify AFTER INSERT ON legacy.events \
        FOR EACH STATEMENT EXECUTE FUNCTION legacy.notify();";

/// `legacy.events` as a relay's source, claimed as the pipeline's relay
/// claims `orders.outbox`: a key's first pending row only, locked and
/// marked sent by the claim itself (`SKIP LOCKED`), so passes may overlap;
/// the settle puts back what was not delivered.
struct Legacy;

impl Source for Legacy {
    fn name(&self) -> &str {
        "legacy.events"
    }

    fn channel(&self) -> &str {
        "legacy_events"
    }

    fn overlapping_passes(&self) -> bool {
        true
    }

    async fn claim(
        &self,
        conn: &mut PgConnection,
        shards: &[i16],
        share: i64,
    ) -> Result<Claimed, sqlx::Error> {
        let rows: Vec<(i64, i64, String, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
            "WITH c AS ( \
               SELECT c.id FROM unnest($1::int2[]) AS s(shard), LATERAL ( \
                 SELECT e.id FROM legacy.events e \
                 WHERE e.shard = s.shard AND e.sent_at IS NULL AND e.refused IS NULL \
                   AND NOT EXISTS (SELECT 1 FROM legacy.events p WHERE p.account = e.account \
                                   AND p.sent_at IS NULL AND p.id < e.id OFFSET 0) \
                 ORDER BY e.id LIMIT $2 FOR UPDATE OF e SKIP LOCKED) c) \
             UPDATE legacy.events x SET sent_at = now() FROM c WHERE x.id = c.id \
             RETURNING x.id, x.account, x.body::text, x.created_at",
        )
        .bind(shards)
        .bind(share)
        .fetch_all(&mut *conn)
        .await?;
        let more = !rows.is_empty(); // a later row of a key may wait
        let mut rows: Vec<Outgoing> = rows
            .into_iter()
            .map(|(id, account, body, created_at)| Outgoing {
                id,
                msg_id: uuid::Uuid::now_v7(),
                destination: "accounts".into(),
                key: account.to_string(),
                event_type: "account.changed".into(),
                payload: body.into_bytes(),
                content_type: "application/json".into(),
                headers: Vec::new(),
                created_at,
            })
            .collect();
        rows.sort_unstable_by_key(|row| row.id);
        Ok(Claimed { rows, more })
    }

    async fn settle(&self, conn: &mut PgConnection, sent: &Sent) -> Result<Settled, sqlx::Error> {
        sqlx::query("UPDATE legacy.events SET sent_at = NULL WHERE id = ANY($1)")
            .bind(&sent.retried)
            .execute(&mut *conn)
            .await?;
        let (ids, why): (Vec<i64>, Vec<String>) = sent.refused.iter().cloned().unzip();
        let failed = sqlx::query(
            "UPDATE legacy.events e SET sent_at = NULL, refused = r.why \
             FROM unnest($1::int8[], $2::text[]) AS r(id, why) WHERE e.id = r.id",
        )
        .bind(ids)
        .bind(why)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        Ok(Settled {
            published: sent.published.len() as u64,
            failed,
        })
    }
}

/// Records each key's payloads (`{"n": N}`, or `N`) in the order they were sent;
/// sends slowly, so that passes overlap.
#[derive(Default, Clone)]
struct Recorder {
    sent: Arc<Mutex<HashMap<String, Vec<i64>>>>,
}

impl Sink for Recorder {
    async fn send(&self, row: &Outgoing) -> Result<(), SendError> {
        let body: serde_json::Value = serde_json::from_slice(&row.payload).expect("json");
        tokio::time::sleep(Duration::from_millis(2)).await;
        self.sent
            .lock()
            .expect("lock")
            .entry(row.key.clone())
            .or_default()
            .push(body.as_i64().or(body["n"].as_i64()).expect("n"));
        Ok(())
    }
}

/// Counts what the relay tells.
#[derive(Default)]
struct Counts {
    began: AtomicU64,
    answered: AtomicU64,
    ended: AtomicU64,
    failed: Mutex<Vec<Stage>>,
}

impl RelayHooks for Counts {
    fn pass_begins(&self) {
        self.began.fetch_add(1, Ordering::Relaxed);
    }
    fn answered(&self, sent: &Sent, _took: Duration) {
        self.answered
            .fetch_add(sent.published.len() as u64, Ordering::Relaxed);
    }
    fn pass_ended(&self, _pass: &Pass) {
        self.ended.fetch_add(1, Ordering::Relaxed);
    }
    fn pass_failed(&self, stage: Stage, _error: &sqlx::Error) {
        self.failed.lock().expect("lock").push(stage);
    }
}

#[tokio::test]
async fn a_relay_over_a_table_of_the_users_own_sends_each_keys_rows_in_order_with_overlapping_passes()
 {
    let db = TestDb::empty().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    sqlx::raw_sql(TABLE).execute(&pool).await.expect("table");
    let (accounts, per_account) = (40_i64, 15_i64);
    let sink = Recorder::default();
    let hooks = Arc::new(Counts::default());
    let relay = Arc::new(
        Relay::over(pool.clone(), Legacy, sink.clone())
            .batch_size(32)
            .shard_groups(2)
            .shard_depth(3)
            .passes_at_once(4)
            .poll_every(Duration::from_millis(100))
            .hooks(hooks.clone()),
    );
    let cancel = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, cancel) = (relay.clone(), cancel.clone());
        async move { relay.run(cancel).await }
    });
    // Written while the relay runs, one transaction per round of accounts.
    for n in 0..per_account {
        let mut tx = pool.begin().await.expect("begin");
        for account in 0..accounts {
            sqlx::query("INSERT INTO legacy.events (account, shard, body) VALUES ($1, $2, $3)")
                .bind(account)
                .bind(shard_of(&account.to_string()))
                .bind(serde_json::json!({ "n": n }))
                .execute(&mut *tx)
                .await
                .expect("insert");
        }
        tx.commit().await.expect("commit");
    }
    let total = (accounts * per_account) as u64;
    let stats = relay.stats();
    let all = eventually(Duration::from_secs(60), || async {
        stats.published.load(Ordering::Relaxed) == total
    })
    .await;
    cancel.cancel();
    running.await.expect("run ends");
    assert!(
        all,
        "published {} of {total}",
        stats.published.load(Ordering::Relaxed)
    );
    let sent = sink.sent.lock().expect("lock").clone();
    assert_eq!(sent.len(), accounts as usize);
    for (account, ns) in &sent {
        assert_eq!(
            ns,
            &(0..per_account).collect::<Vec<_>>(),
            "account {account}"
        );
    }
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM legacy.events WHERE sent_at IS NULL")
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(pending, 0);
    assert_eq!(hooks.answered.load(Ordering::Relaxed), total);
    let (began, ended) = (
        hooks.began.load(Ordering::Relaxed),
        hooks.ended.load(Ordering::Relaxed),
    );
    assert!(
        began > 0 && began == ended,
        "{began} passes began, {ended} ended"
    );
    assert!(hooks.failed.lock().expect("lock").is_empty());
}

/// The library's outbox, whose settle fails (a statement that cannot run).
struct FailingSettle(OutboxSource);

impl Source for FailingSettle {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn channel(&self) -> &str {
        self.0.channel()
    }
    async fn claim(
        &self,
        conn: &mut PgConnection,
        shards: &[i16],
        share: i64,
    ) -> Result<Claimed, sqlx::Error> {
        self.0.claim(conn, shards, share).await
    }
    async fn settle(&self, conn: &mut PgConnection, _sent: &Sent) -> Result<Settled, sqlx::Error> {
        sqlx::query("SELECT 1 / 0").execute(conn).await?;
        Ok(Settled::default())
    }
}

#[tokio::test]
async fn a_pass_whose_settle_fails_leaves_its_rows_pending_and_says_where_it_failed() {
    let (_db, pool, fx) = super::store::store("shop_fx").await;
    let events: Vec<Event> = (0..5)
        .map(|n| Event::json("carts", "k0", "cart.updated", &n).expect("event"))
        .collect();
    fx.outbox()
        .enqueue_batch(&pool, &events)
        .await
        .expect("enqueue");
    let hooks = Arc::new(Counts::default());
    let relay = Relay::over(
        pool.clone(),
        FailingSettle(OutboxSource::new(&fx)),
        Recorder::default(),
    )
    .hooks(hooks.clone());
    let error = relay
        .relay_shard(shard_of("k0"))
        .await
        .expect_err("the settle fails");
    assert!(error.to_string().contains("division by zero"), "{error}");
    assert_eq!(*hooks.failed.lock().expect("lock"), [Stage::Settle]);
    assert_eq!(hooks.answered.load(Ordering::Relaxed), 5);
    assert_eq!(relay.stats().errors.load(Ordering::Relaxed), 1);
    let backlog = fx.outbox().backlog(&pool).await.expect("backlog");
    assert_eq!((backlog.pending, backlog.failed), (5, 0));
    // The same rows go with the library's own settle.
    let relay = Relay::new(&fx, Recorder::default());
    assert_eq!(relay.relay_all().await.expect("relay").published, 5);
}

#[tokio::test]
async fn a_relay_of_the_librarys_outbox_keeps_one_pass_per_shard_whatever_depth_it_is_given() {
    let (_db, pool, fx) = super::store::store("shop_fx").await;
    let events: Vec<Event> = (0..50)
        .map(|n| Event::json("carts", &format!("k{}", n % 5), "cart.updated", &n).expect("event"))
        .collect();
    fx.outbox()
        .enqueue_batch(&pool, &events)
        .await
        .expect("enqueue");
    let sink = Recorder::default();
    // Its claim reads without locking rows: two passes of one shard would
    // send the same rows. The depth asked for is not taken.
    let relay = Arc::new(
        Relay::new(&fx, sink.clone())
            .batch_size(4)
            .shard_depth(4)
            .poll_every(Duration::from_millis(50)),
    );
    let cancel = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, cancel) = (relay.clone(), cancel.clone());
        async move { relay.run(cancel).await }
    });
    let stats = relay.stats();
    let all = eventually(Duration::from_secs(30), || async {
        stats.published.load(Ordering::Relaxed) == 50
    })
    .await;
    cancel.cancel();
    running.await.expect("run ends");
    assert!(all);
    let sent = sink.sent.lock().expect("lock").clone();
    for k in 0..5_i64 {
        let expected: Vec<i64> = (0..50).filter(|n| n % 5 == k).collect();
        assert_eq!(
            sent[&format!("k{k}")],
            expected,
            "k{k}: each row once, in order"
        );
    }
}
