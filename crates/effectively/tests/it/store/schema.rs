//! The schema: installed with its own ledger and nothing else, a ledger
//! refused or upgraded, migrations at once, and the grants of each role.

use std::time::Duration;

use effectively::idempotency::{Fingerprint, StoredResponse};
use effectively::store::{Effectively, Event, InboxClaim, KeyClaim, Message, MigrateError};
use pipeline::testing::TestDb;
use sqlx::PgPool;
use uuid::Uuid;

use super::{count, key, store};

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
