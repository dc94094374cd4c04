//! The library on a schema of the user's choosing (`effectively::store`),
//! against the real PostgreSQL, in a database the pipeline's migrations
//! never touched: the schema and its ledger, the outbox in the caller's
//! transaction, the inbox's claims and the idempotency keys, each with the
//! races a service meets.

use std::time::Duration;

use chrono::Utc;
use effectively::idempotency::{Fingerprint, IdempotencyKey, StoredResponse};
use effectively::store::{
    Applied, Effectively, Event, InboxClaim, KeyClaim, Message, MigrateError,
};
use pipeline::testing::TestDb;
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgPool};
use uuid::Uuid;

/// A database of its own with the library migrated into `schema` (the
/// other `store_*` test files' set-up too).
pub(crate) async fn store(schema: &str) -> (TestDb, PgPool, Effectively) {
    let db = TestDb::empty().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let fx = Effectively::postgres(pool.clone())
        .schema(schema)
        .expect("schema name");
    fx.migrate().await.expect("migrate");
    (db, pool, fx)
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

#[tokio::test]
async fn migrate_installs_into_the_named_schema_with_its_own_ledger_and_nothing_else() {
    let db = TestDb::empty().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let roles = count(&pool, "SELECT count(*) FROM pg_roles").await;
    let fx = Effectively::postgres(pool.clone())
        .schema("shop_fx")
        .expect("a valid schema name");
    let first = fx.migrate().await.expect("migrate");
    assert_eq!(first.applied, vec![1, 2, 3, 4, 5]);
    let again = fx.migrate().await.expect("migrate again");
    assert!(again.applied.is_empty(), "{again:?}");
    assert_eq!(again.version, 5);

    // Tables, not counting the partitioned inbox's partitions.
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = 'shop_fx' AND c.relkind IN ('r', 'p') AND NOT c.relispartition ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .expect("test step");
    assert_eq!(
        tables,
        [
            "dead_letters",
            "idempotency_keys",
            "inbox",
            "migrations",
            "outbox",
            "partitioned_inbox",
            "partitioned_inbox_consumers",
            "partitioned_inbox_parts"
        ]
    );
    // The partitioned inbox's partitions are made by its consumers' upkeep.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM shop_fx.partitioned_inbox_parts"
        )
        .await,
        0
    );
    // Nothing outside the schema: no sqlx ledger, no role, no publication.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM pg_tables WHERE tablename = '_sqlx_migrations'"
        )
        .await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM pg_roles").await, roles);
    assert_eq!(count(&pool, "SELECT count(*) FROM pg_publication").await, 0);
    let ledger: Vec<(i32, String)> =
        sqlx::query_as("SELECT version, name FROM shop_fx.migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .expect("test step");
    assert_eq!(
        ledger,
        [
            (1, "outbox_inbox_keys".to_owned()),
            (2, "dead_letters".to_owned()),
            (3, "outbox_expiry".to_owned()),
            (4, "keys_batch_claim".to_owned()),
            (5, "partitioned_inbox".to_owned())
        ]
    );

    // A second schema in the same database is another install.
    let other = Effectively::postgres(pool.clone())
        .schema("other_fx")
        .expect("a valid schema name");
    assert_eq!(
        other.migrate().await.expect("migrate").applied,
        vec![1, 2, 3, 4, 5]
    );

    // The SQL as text names the schema it is for.
    let text = other.migrations();
    assert_eq!(text.len(), 5);
    assert!(text[0].2.contains("CREATE TABLE \"other_fx\".outbox"));
}

#[tokio::test]
async fn migrate_refuses_a_ledger_from_another_build() {
    let (_db, pool, fx) = store("shop_fx").await;
    sqlx::query("UPDATE shop_fx.migrations SET checksum = '\\x00' WHERE version = 1")
        .execute(&pool)
        .await
        .expect("test step");
    let err = fx.migrate().await.expect_err("a changed version");
    assert!(
        matches!(err, MigrateError::Changed { version: 1, .. }),
        "{err}"
    );
    sqlx::query("DELETE FROM shop_fx.migrations WHERE version = 1; ")
        .execute(&pool)
        .await
        .expect("test step");
    sqlx::query(
        "INSERT INTO shop_fx.migrations (version, name, checksum) VALUES (99, 'future', '\\x00')",
    )
    .execute(&pool)
    .await
    .expect("test step");
    let err = fx.migrate().await.expect_err("a newer version");
    assert!(
        matches!(
            err,
            MigrateError::Newer {
                found: 99,
                known: 5,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("newer than this build"), "{err}");
}

#[tokio::test]
async fn a_schema_at_an_older_version_is_upgraded_with_only_what_it_lacks() {
    let (_db, pool, fx) = store("shop_fx").await;
    // As a schema installed by the first release (version 1) is.
    sqlx::raw_sql(
        "DROP TABLE shop_fx.dead_letters; DROP INDEX shop_fx.outbox_published_by_created_at; \
         DROP FUNCTION shop_fx.claim_keys; \
         ALTER TABLE shop_fx.idempotency_keys DROP COLUMN reference; \
         DELETE FROM shop_fx.migrations WHERE version IN (2, 3, 4)",
    )
    .execute(&pool)
    .await
    .expect("roll the schema back to version 1");
    sqlx::query("INSERT INTO shop_fx.inbox (consumer, msg_id, payload_hash, sent_at) VALUES ('c', 'm', '\\x00', now())")
        .execute(&pool)
        .await
        .expect("a row of version 1's");
    let fp = Fingerprint::new("c", b"r");
    sqlx::query(
        "INSERT INTO shop_fx.idempotency_keys \
         (scope, key, request_hash, response_status, response_headers, response_body) \
         VALUES ('s', 'k', $1, 201, '[]', 'done')",
    )
    .bind(fp.as_bytes().as_slice())
    .execute(&pool)
    .await
    .expect("a key of version 1's");
    let upgraded = fx.migrate().await.expect("upgrade");
    assert_eq!(upgraded.applied, vec![2, 3, 4]);
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        fx.keys()
            .claim(&mut tx, "s", &key("k"), &fp)
            .await
            .expect("claim"),
        KeyClaim::Replay(StoredResponse {
            status: 201,
            headers: vec![],
            body: b"done".to_vec()
        }),
        "a key of version 1 replays after the upgrade"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM shop_fx.dead_letters").await,
        0
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM shop_fx.inbox").await,
        1,
        "its data kept"
    );
}

#[tokio::test]
async fn two_processes_migrating_at_once_take_turns() {
    let db = TestDb::empty().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let fx = Effectively::postgres(pool)
        .schema("shop_fx")
        .expect("a valid schema name");
    // Spawned: a service migrates from inside its own spawned task, so the
    // future must be `Send` (sqlx's `raw_sql(..).execute` made it not).
    let spawn = |fx: Effectively| tokio::spawn(async move { fx.migrate().await });
    let (a, b) = tokio::join!(spawn(fx.clone()), spawn(fx));
    let mut applied = [
        a.expect("task").expect("a").applied,
        b.expect("task").expect("b").applied,
    ];
    applied.sort();
    assert_eq!(applied, [vec![], vec![1, 2, 3, 4, 5]]);
}

#[tokio::test]
async fn an_event_exists_if_and_only_if_its_transaction_commits() {
    let (_db, pool, fx) = store("shop_fx").await;
    sqlx::query("CREATE TABLE carts (id int PRIMARY KEY)")
        .execute(&pool)
        .await
        .expect("test step");
    let outbox = fx.outbox();
    let mut listener = PgListener::connect_with(&pool).await.expect("connect");
    listener.listen("shop_fx.outbox").await.expect("connect");

    // Rolled back: neither the cart nor its event.
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO carts VALUES (1)")
        .execute(&mut *tx)
        .await
        .expect("the statement");
    let lost = Event::json(
        "cart.events",
        "cart-1",
        "cart.created",
        &serde_json::json!({"id": 1}),
    )
    .expect("a valid event");
    outbox.enqueue(&mut *tx, &lost).await.expect("enqueue");
    tx.rollback().await.expect("rollback");
    assert_eq!(count(&pool, "SELECT count(*) FROM shop_fx.outbox").await, 0);

    // Committed: both, and the relay's channel is told.
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO carts VALUES (1)")
        .execute(&mut *tx)
        .await
        .expect("the statement");
    let event = Event::json(
        "cart.events",
        "cart-1",
        "cart.created",
        &serde_json::json!({"id": 1}),
    )
    .expect("test step")
    .with_header(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )
    .expect("test step");
    outbox.enqueue(&mut *tx, &event).await.expect("enqueue");
    tx.commit().await.expect("commit");
    let note = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("a NOTIFY on the schema's channel")
        .expect("test step");
    assert_eq!(note.channel(), "shop_fx.outbox");

    let row: (Uuid, String, String, String, Vec<u8>, String, serde_json::Value, i16) = sqlx::query_as(
        "SELECT msg_id, destination, key, event_type, payload, content_type, headers, shard FROM shop_fx.outbox",
    )
    .fetch_one(&pool)
    .await
    .expect("test step");
    assert_eq!(row.0, event.msg_id());
    assert_eq!(
        (row.1.as_str(), row.2.as_str(), row.3.as_str()),
        ("cart.events", "cart-1", "cart.created")
    );
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&row.4).expect("JSON payload"),
        serde_json::json!({"id": 1})
    );
    assert_eq!(row.5, "application/json");
    assert_eq!(
        row.6,
        serde_json::json!([[
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        ]])
    );
    assert_eq!(row.7, effectively::store::shard_of("cart-1"));

    // The same msg_id again is refused whole.
    assert!(outbox.enqueue(&pool, &event).await.is_err());
    assert_eq!(count(&pool, "SELECT count(*) FROM shop_fx.outbox").await, 1);
}

#[tokio::test]
async fn enqueue_takes_a_pool_a_connection_or_a_transaction_and_a_batch_keeps_its_order() {
    let (_db, pool, fx) = store("shop_fx").await;
    let outbox = fx.outbox();
    let e =
        |i: i32| Event::json("cart.events", "cart-9", "cart.updated", &i).expect("a valid event");
    outbox.enqueue(&pool, &e(0)).await.expect("enqueue");
    let mut conn = pool.acquire().await.expect("the statement");
    outbox.enqueue(&mut *conn, &e(1)).await.expect("enqueue");
    let mut tx = conn.begin().await.expect("begin");
    let batch: Vec<Event> = (2..50).map(e).collect();
    assert_eq!(
        outbox
            .enqueue_batch(&mut *tx, &batch)
            .await
            .expect("enqueue"),
        48
    );
    tx.commit().await.expect("commit");
    let payloads: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT payload FROM shop_fx.outbox ORDER BY id")
            .fetch_all(&pool)
            .await
            .expect("test step");
    let order: Vec<i32> = payloads
        .iter()
        .map(|p| serde_json::from_slice(p).expect("JSON payload"))
        .collect();
    assert_eq!(order, (0..50).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_message_is_applied_once_per_consumer_and_a_reused_id_is_a_conflict() {
    let (_db, pool, fx) = store("shop_fx").await;
    sqlx::query("CREATE TABLE invoices (msg text, consumer text)")
        .execute(&pool)
        .await
        .expect("test step");
    let msg =
        Message::new("order-7/created", Utc::now(), b"{\"total\":10}").expect("a valid message");
    let billing = fx.inbox("billing");
    let apply = |inbox: effectively::store::Inbox, msg: Message| {
        let pool = pool.clone();
        async move {
            let consumer = inbox.consumer().to_owned();
            inbox
                .apply(&pool, &msg, |tx| {
                    Box::pin(async move {
                        sqlx::query("INSERT INTO invoices VALUES ($1, $2)")
                            .bind("order-7")
                            .bind(consumer)
                            .execute(&mut *tx)
                            .await?;
                        Ok::<_, sqlx::Error>(7)
                    })
                })
                .await
                .expect("test step")
        }
    };
    assert_eq!(apply(billing.clone(), msg.clone()).await, Applied::New(7));
    assert_eq!(
        apply(billing.clone(), msg.clone()).await,
        Applied::Duplicate
    );
    // Another consumer applies it once too.
    assert_eq!(apply(fx.inbox("audit"), msg.clone()).await, Applied::New(7));
    // The same id with another payload.
    let reused =
        Message::new("order-7/created", Utc::now(), b"{\"total\":11}").expect("a valid message");
    assert_eq!(apply(billing.clone(), reused).await, Applied::Conflict);
    // Older than the retention less its margin: cannot be told; refused.
    let old = Message::new(
        "order-8/created",
        Utc::now() - chrono::TimeDelta::days(8),
        b"{}",
    )
    .expect("a valid message");
    assert_eq!(apply(billing.clone(), old).await, Applied::TooOld);
    assert_eq!(count(&pool, "SELECT count(*) FROM invoices").await, 2);
    assert_eq!(count(&pool, "SELECT count(*) FROM shop_fx.inbox").await, 2);
}

#[tokio::test]
async fn a_batch_claim_answers_as_claims_one_after_the_other_would() {
    let (_db, pool, fx) = store("shop_fx").await;
    let billing = fx.inbox("billing");
    let m = |id: &str, body: &[u8]| Message::new(id, Utc::now(), body).expect("a valid message");
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        billing
            .claim(&mut tx, &m("seen", b"1"))
            .await
            .expect("claim"),
        InboxClaim::New
    );
    tx.commit().await.expect("commit");
    let old = Message::new("old", Utc::now() - chrono::TimeDelta::days(8), b"0")
        .expect("a valid message");
    let batch = [
        m("b", b"2"),
        m("seen", b"1"), // committed before, same payload
        m("a", b"3"),
        m("seen", b"other"), // committed before, another payload
        m("b", b"2"),        // a copy of the first, in the batch
        m("a", b"x"),        // the batch's own id, another payload
        old,
    ];
    let mut tx = pool.begin().await.expect("begin");
    let claims = billing.claim_batch(&mut tx, &batch).await.expect("claim");
    assert_eq!(
        claims,
        [
            InboxClaim::New,
            InboxClaim::Duplicate,
            InboxClaim::New,
            InboxClaim::Conflict,
            InboxClaim::Duplicate,
            InboxClaim::Conflict,
            InboxClaim::TooOld,
        ]
    );
    tx.commit().await.expect("commit");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM shop_fx.inbox WHERE consumer = 'billing'"
        )
        .await,
        3
    );
    let empty = billing
        .claim_batch(&mut pool.acquire().await.expect("conn"), &[])
        .await;
    assert_eq!(empty.expect("an empty batch"), []);
}

#[tokio::test]
async fn an_effect_that_fails_rolls_its_claim_back() {
    let (_db, pool, fx) = store("shop_fx").await;
    let inbox = fx.inbox("billing");
    let msg = Message::v7(Uuid::now_v7(), b"p");
    let failed: Result<Applied<()>, sqlx::Error> = inbox
        .apply(&pool, &msg, |tx| {
            Box::pin(async move {
                sqlx::query("SELECT 1/0").execute(&mut *tx).await?;
                Ok(())
            })
        })
        .await;
    assert!(failed.is_err());
    assert_eq!(count(&pool, "SELECT count(*) FROM shop_fx.inbox").await, 0);
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        inbox.claim(&mut tx, &msg).await.expect("claim"),
        InboxClaim::New
    );
}

#[tokio::test]
async fn a_copy_claimed_while_the_first_is_in_flight_waits_and_is_a_duplicate() {
    let (_db, pool, fx) = store("shop_fx").await;
    let inbox = fx.inbox("billing");
    let msg = Message::v7(Uuid::now_v7(), b"p");
    let mut first = pool.begin().await.expect("begin");
    assert_eq!(
        inbox.claim(&mut first, &msg).await.expect("claim"),
        InboxClaim::New
    );
    let second = {
        let (pool, inbox, msg) = (pool.clone(), inbox.clone(), msg.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.expect("begin");
            inbox.claim(&mut tx, &msg).await.expect("claim")
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !second.is_finished(),
        "the copy must wait for the first claim's transaction"
    );
    first.commit().await.expect("commit");
    assert_eq!(second.await.expect("the statement"), InboxClaim::Duplicate);
}

#[tokio::test]
async fn expiry_deletes_only_rows_past_the_retention() {
    let (_db, pool, fx) = store("shop_fx").await;
    let inbox = fx.inbox("billing").retention(Duration::from_secs(3600));
    let mut tx = pool.begin().await.expect("begin");
    for i in 0..30 {
        let m = Message::new(
            format!("m{i}"),
            Utc::now() - chrono::TimeDelta::minutes(30),
            b"",
        )
        .expect("a valid message");
        assert_eq!(
            inbox.claim(&mut tx, &m).await.expect("claim"),
            InboxClaim::New
        );
    }
    tx.commit().await.expect("commit");
    // Rows past an hour, as a claim an hour ago would have left them.
    sqlx::query(
        "UPDATE shop_fx.inbox SET sent_at = sent_at - interval '1 hour' WHERE msg_id < 'm2'",
    )
    .execute(&pool)
    .await
    .expect("test step");
    let old = count(
        &pool,
        "SELECT count(*) FROM shop_fx.inbox WHERE msg_id < 'm2'",
    )
    .await;
    assert_eq!(inbox.expire(&pool, 4).await.expect("expire"), old as u64);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM shop_fx.inbox").await,
        30 - old
    );
    // Another consumer's rows are its own to expire.
    assert_eq!(fx.inbox("audit").expire(&pool, 4).await.expect("expire"), 0);
}

pub(crate) fn key(k: &str) -> IdempotencyKey {
    IdempotencyKey::parse(k.as_bytes()).expect("test step")
}

#[tokio::test]
async fn a_key_replays_its_stored_response_and_refuses_another_request() {
    let (_db, pool, fx) = store("shop_fx").await;
    let keys = fx.keys();
    let k = key("checkout-1");
    let fp = Fingerprint::new("shop.checkout v1", b"cart=1");
    let response = StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/carts/1".into()),
        ],
        body: b"{\"cart\":1}".to_vec(),
    };
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "alice", &k, &fp).await.expect("claim"),
        KeyClaim::New
    );
    keys.complete(&mut tx, "alice", &k, &fp, &response)
        .await
        .expect("complete");
    tx.commit().await.expect("commit");

    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "alice", &k, &fp).await.expect("claim"),
        KeyClaim::Replay(response.clone())
    );
    let other = Fingerprint::new("shop.checkout v1", b"cart=2");
    assert_eq!(
        keys.claim(&mut tx, "alice", &k, &other)
            .await
            .expect("claim"),
        KeyClaim::Mismatch
    );
    // Another caller's key of the same name is its own.
    assert_eq!(
        keys.claim(&mut tx, "bob", &k, &other).await.expect("claim"),
        KeyClaim::New
    );
    tx.rollback().await.expect("rollback");
    // A rollback freed bob's.
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "bob", &k, &fp).await.expect("claim"),
        KeyClaim::New
    );
    // Completing a key that is not this request's claim is refused.
    assert!(matches!(
        keys.complete(&mut tx, "alice", &k, &fp, &response).await,
        Err(sqlx::Error::RowNotFound)
    ));
    tx.rollback().await.expect("rollback");
    // A key committed without its response cannot be replayed.
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "carol", &k, &fp).await.expect("claim"),
        KeyClaim::New
    );
    tx.commit().await.expect("commit");
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut tx, "carol", &k, &fp).await.expect("claim"),
        KeyClaim::Unfinished
    );
}

#[tokio::test]
async fn a_retry_while_the_first_request_is_in_flight_waits_and_replays_it() {
    let (_db, pool, fx) = store("shop_fx").await;
    let keys = fx.keys();
    let k = key("checkout-2");
    let fp = Fingerprint::new("shop.checkout v1", b"cart=2");
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: b"made".to_vec(),
    };
    let mut first = pool.begin().await.expect("begin");
    assert_eq!(
        keys.claim(&mut first, "alice", &k, &fp)
            .await
            .expect("claim"),
        KeyClaim::New
    );
    let retry = {
        let (pool, keys, k) = (pool.clone(), keys.clone(), k.clone());
        tokio::spawn(async move {
            let mut tx = pool.begin().await.expect("begin");
            keys.claim(&mut tx, "alice", &k, &fp).await.expect("claim")
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !retry.is_finished(),
        "the retry must wait for the first request's transaction"
    );
    keys.complete(&mut first, "alice", &k, &fp, &response)
        .await
        .expect("complete");
    first.commit().await.expect("commit");
    assert_eq!(
        retry.await.expect("the statement"),
        KeyClaim::Replay(response)
    );
    // Expiry: nothing is past a day yet; past a second, the key goes.
    assert_eq!(
        keys.expire(&pool, Duration::from_secs(86_400), 10)
            .await
            .expect("expire"),
        0
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        keys.expire(&pool, Duration::from_secs(1), 10)
            .await
            .expect("expire"),
        1
    );
}

#[tokio::test]
async fn the_grants_give_each_role_its_part_and_nothing_more() {
    let (db, pool, fx) = store("shop_fx").await;
    let tag = Uuid::new_v4().simple().to_string();
    let (writer, relay, consumer) = (format!("w_{tag}"), format!("r_{tag}"), format!("c_{tag}"));
    // The stack trusts nobody: each role signs in with a password (this
    // test's own, dropped with the role).
    let password = Uuid::new_v4().simple().to_string();
    for r in [&writer, &relay, &consumer] {
        sqlx::query(&format!("CREATE ROLE \"{r}\" LOGIN PASSWORD '{password}'"))
            .execute(&pool)
            .await
            .expect("test step");
    }
    sqlx::raw_sql(&fx.grants(Some(&writer), Some(&relay), Some(&consumer)))
        .execute(&pool)
        .await
        .expect("the grants apply");
    let as_role = |r: &str| {
        let (scheme, rest) = db.url.split_once("://").expect("test step");
        let host = rest.split_once('@').map_or(rest, |(_, h)| h);
        format!("{scheme}://{r}:{password}@{host}")
    };
    let w = PgPool::connect(&as_role(&writer)).await.expect("connect");
    let wfx = Effectively::postgres(w.clone())
        .schema("shop_fx")
        .expect("a valid schema name");
    let event = Event::json("d", "k", "t", &1).expect("a valid event");
    wfx.outbox()
        .enqueue(&w, &event)
        .await
        .expect("the writer enqueues");
    let mut tx = w.begin().await.expect("begin");
    let fp = Fingerprint::new("c", b"r");
    assert_eq!(
        wfx.keys()
            .claim(&mut tx, "s", &key("k"), &fp)
            .await
            .expect("claim"),
        KeyClaim::New
    );
    tx.rollback().await.expect("rollback");
    let msg = Message::v7(Uuid::now_v7(), b"p");
    let mut tx = w.begin().await.expect("begin");
    assert!(
        wfx.inbox("x").claim(&mut tx, &msg).await.is_err(),
        "the writer has no inbox"
    );
    tx.rollback().await.expect("rollback");

    let r = PgPool::connect(&as_role(&relay)).await.expect("connect");
    sqlx::query("UPDATE shop_fx.outbox SET published_at = now()")
        .execute(&r)
        .await
        .expect("the relay marks");
    assert!(
        sqlx::query("UPDATE shop_fx.outbox SET payload = ''")
            .execute(&r)
            .await
            .is_err()
    );
    // The relay expires the published rows (Relay::run does, as it).
    let rfx = Effectively::postgres(r.clone())
        .schema("shop_fx")
        .expect("a valid schema name");
    assert_eq!(
        rfx.outbox()
            .expire(&r, Duration::ZERO, 10)
            .await
            .expect("the relay expires"),
        1
    );
    assert!(
        sqlx::query("INSERT INTO shop_fx.inbox (consumer, msg_id, payload_hash, sent_at) VALUES ('c', 'm', '\\x00', now())")
            .execute(&r)
            .await
            .is_err(),
        "the relay has no inbox"
    );

    let c = PgPool::connect(&as_role(&consumer)).await.expect("connect");
    let cfx = Effectively::postgres(c.clone())
        .schema("shop_fx")
        .expect("a valid schema name");
    let mut tx = c.begin().await.expect("begin");
    assert_eq!(
        cfx.inbox("billing")
            .claim(&mut tx, &msg)
            .await
            .expect("claim"),
        InboxClaim::New
    );
    tx.commit().await.expect("commit");
    // The partitioned inbox: its upkeep (functions that run as the owner)
    // and its claims.
    let partitioned = cfx.partitioned_inbox("billing");
    let done = partitioned
        .maintain_once(&c)
        .await
        .expect("the consumer keeps its partitions");
    assert!(done.made > 0, "{done:?}");
    let mut tx = c.begin().await.expect("begin");
    assert_eq!(
        partitioned.claim(&mut tx, &msg).await.expect("claim"),
        InboxClaim::New
    );
    tx.commit().await.expect("commit");
    assert!(
        cfx.outbox()
            .enqueue(&c, &Event::json("d", "k", "t", &1).expect("a valid event"))
            .await
            .is_err()
    );
    // Neither the writer nor the relay makes or drops partitions.
    for other in [&w, &r] {
        assert!(
            wfx.partitioned_inbox("x")
                .maintain_once(other)
                .await
                .is_err(),
            "only the consumer's role keeps the partitions"
        );
    }

    for p in [w, r, c] {
        p.close().await;
    }
    for role in [&writer, &relay, &consumer] {
        sqlx::raw_sql(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
            .execute(&pool)
            .await
            .expect("test step");
    }
}

/// Every copy of a message is judged by one time, the one its id carries:
/// a copy re-published (or re-signed) later carries a later timestamp of
/// its own, and judged by that it would be claimed again once the first
/// copy's row had expired.
#[tokio::test]
async fn a_copy_sent_again_after_the_first_copys_row_expired_is_not_applied_again() {
    use effectively::store::{Handled, Handler, HandlerError, Record, handle};
    use futures::future::BoxFuture;
    let (_db, pool, fx) = store("shop_fx").await;
    sqlx::query("CREATE TABLE invoices (msg text)")
        .execute(&pool)
        .await
        .expect("test step");
    let retention = Duration::from_secs(16);
    let inbox = fx.inbox("billing").retention(retention);
    let handler: Box<Handler> = Box::new(|tx, record| {
        let work: BoxFuture<'_, Result<(), HandlerError>> = Box::pin(async move {
            sqlx::query("INSERT INTO invoices VALUES ($1)")
                .bind(&record.msg_id)
                .execute(&mut *tx)
                .await?;
            Ok(())
        });
        work
    });
    // Minted (and first sent) 10 s ago: inside the retention less its
    // margin (14 s), so the first copy is applied.
    let id = effectively::v7::minted_ago(Duration::from_secs(10));
    let copy = |sent_at| Record {
        source: "test".to_owned(),
        key: None,
        payload: b"{}".to_vec(),
        headers: Vec::new(),
        msg_id: id.hyphenated().to_string(),
        sent_at,
    };
    let first = copy(Utc::now() - chrono::TimeDelta::seconds(10));
    assert_eq!(
        handle(&fx, &inbox, handler.as_ref(), &first)
            .await
            .expect("handled"),
        Handled::Applied
    );
    // Past the retention since it was minted: its row expires.
    tokio::time::sleep(Duration::from_millis(6_500)).await;
    assert_eq!(inbox.expire(&pool, 10).await.expect("expire"), 1);
    // A copy sent again now (a relay that re-published it, a webhook
    // re-signed for a retry) is not a new message.
    let again = copy(Utc::now());
    let outcome = handle(&fx, &inbox, handler.as_ref(), &again)
        .await
        .expect("handled");
    assert!(
        matches!(outcome, Handled::DeadLettered(ref why) if why.contains("longer ago")),
        "{outcome:?}"
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM invoices").await, 1);
}
