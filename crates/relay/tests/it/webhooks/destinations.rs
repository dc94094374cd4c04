//! Destinations: the address allowlist, the sink refused without one (or with
//! `--mode wal`), replays and enables past the receiver's horizon, destinations
//! added and removed in the database, a relay's flags never overwriting them.

use std::time::Duration;

use effectively::webhook::Secret;
use pipeline::db::ServiceRole;
use pipeline::testing::{TestDb, eventually};
use relay::webhooks::{Admin, ReceiverHorizon};
use relay::{Mode, run};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{OPEN, Receiver, Reply, config, count, enqueue, spawn_relay, specs};

/// With no allowlist, webhooks reach public addresses only: a destination
/// whose URL is a loopback address never starts, and one whose URL is a
/// name that resolves to loopback (`localhost`, the way a name rebound to
/// an inside address would) is refused by the resolver at every
/// connection: the receiver on 127.0.0.1 gets nothing. Allowed by the
/// operator, both deliver, each event once per destination.
#[tokio::test]
async fn webhooks_never_reach_an_address_the_operator_did_not_allow() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    // Three keys: a key's later delivery waits for its earlier one.
    for _ in 0..3 {
        enqueue(&pool, Uuid::now_v7(), 0).await;
    }
    let (r, url) = Receiver::start(|_| Reply::OK).await;
    let by_name = url.replace("127.0.0.1", "localhost");
    let destinations = vec![
        r.destination("literal", &url, ""),
        r.destination("name", &by_name, ""),
    ];
    let mut guarded = config(&db, destinations.clone(), 0.01);
    guarded.webhook_allow_addresses = Vec::new();
    let relay = spawn_relay(guarded).await;
    let refused = "SELECT count(*) FROM orders.webhook_deliveries \
                   WHERE destination = 'name' AND attempts >= 2 AND last_error LIKE '%loopback%'";
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, refused).await == 3
                && relay
                    .metric(r#"relay_errors_total{stage="destinations"}"#)
                    .await
                    >= 1.0
        })
        .await,
        "the name refused at connection ({} deliveries), the literal not started",
        count(&pool, refused).await
    );
    assert!(r.hits().is_empty(), "nothing reached the receiver");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'literal' AND attempts = 0"
        )
        .await,
        3,
        "the literal's deliveries wait, never tried"
    );
    relay.stop().await;

    let relay = spawn_relay(config(&db, destinations, 0.01)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            count(&pool, OPEN).await == 0
        })
        .await,
        "allowed, both deliver (open: {})",
        count(&pool, OPEN).await
    );
    relay.stop().await;
    let hits = r.hits();
    assert_eq!(hits.len(), 6, "each event once per destination");
    assert!(hits.iter().all(|h| h.authentic));
}

#[tokio::test]
async fn the_http_sink_without_a_destination_or_with_wal_is_refused() {
    let db = TestDb::create().await;
    let mut c = config(&db, Vec::new(), 1.0);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let error = run(c.clone(), listener, CancellationToken::new())
        .await
        .expect_err("refused");
    assert!(
        error.to_string().contains("--webhook-destination"),
        "{error}"
    );
    let (r, url) = Receiver::start(|_| Reply::OK).await;
    c.webhook_destination = vec![r.destination("r", &url, "")];
    c.mode = Mode::Wal;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let error = run(c, listener, CancellationToken::new())
        .await
        .expect_err("refused");
    assert!(error.to_string().contains("--mode poll"), "{error}");
}

/// A delivery whose event was minted before the receiver's dedup horizon,
/// or so close to it that its retries (about 28 h of them) could arrive
/// after it, would be refused there as `after_horizon` and dead-lettered: `replay
/// --failed` and `enable` refuse to send it (nothing is changed), or leave it
/// out with `--skip-past-horizon` (a waiting one is marked failed, with why).
#[tokio::test]
async fn replays_and_enables_refuse_events_past_the_receivers_horizon() {
    let db = TestDb::create().await;
    let owner = PgPool::connect(&db.url).await.expect("connect");
    let as_relay = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as relay");
    let old = effectively::v7::minted_ago(Duration::from_secs(20 * 86_400));
    sqlx::query("INSERT INTO orders.webhook_destinations (destination, disabled_at, reason) VALUES ('r', NULL, NULL), ('gone', now(), 'HTTP 410')")
        .execute(&owner)
        .await
        .expect("destinations");
    // Inside the horizon, but its retries (up to about 28 h) could reach the
    // receiver past it.
    let late = effectively::v7::minted_ago(Duration::from_secs(15 * 86_400 + 12 * 3600));
    // r: one old, one late and one young failed delivery; gone: one old and
    // one young waiting.
    for (destination, outbox_id, msg_id, failed) in [
        ("r", 1_i64, old, true),
        ("r", 5, late, true),
        ("r", 2, Uuid::now_v7(), true),
        ("gone", 3, old, false),
        ("gone", 4, Uuid::now_v7(), false),
    ] {
        sqlx::query(
            "INSERT INTO orders.webhook_deliveries \
               (destination, outbox_id, aggregate_id, msg_id, body, failed_at) \
             VALUES ($1, $2, $3, $3, '\\x7b7d', CASE WHEN $4 THEN now() END)",
        )
        .bind(destination)
        .bind(outbox_id)
        .bind(msg_id)
        .bind(failed)
        .execute(&owner)
        .await
        .expect("delivery");
    }
    let failed = || {
        count(
            &owner,
            "SELECT count(*) FROM orders.webhook_deliveries WHERE failed_at IS NOT NULL",
        )
    };

    let replay = |skip: bool| Admin::Replay {
        failed: true,
        destination: None,
        since: None,
        horizon: ReceiverHorizon {
            skip_past_horizon: skip,
            ..ReceiverHorizon::default()
        },
    };
    let refused = replay(false)
        .run(&as_relay, &specs())
        .await
        .expect_err("refused");
    let cutoff = humantime::format_duration(ReceiverHorizon::default().cutoff()).to_string();
    assert!(
        format!("{refused:#}").contains(&format!(
            "2 of the failed deliveries selected carry events minted more than {cutoff} ago: \
             the receiver's dedup horizon (--receiver-horizon 16days"
        )),
        "{refused:#}"
    );
    assert_eq!(failed().await, 3, "nothing was replayed");
    assert_eq!(
        replay(true).run(&as_relay, &specs()).await.expect("replay"),
        "1 failed deliveries queued again\n2 left failed: their events are past the receiver's horizon\n"
    );
    assert_eq!(failed().await, 2, "the old and the late one stay failed");

    let enable = |skip: bool| Admin::Enable {
        destination: "gone".into(),
        horizon: ReceiverHorizon {
            skip_past_horizon: skip,
            ..ReceiverHorizon::default()
        },
    };
    assert!(
        enable(false).run(&as_relay, &specs()).await.is_err(),
        "refused"
    );
    assert_eq!(
        count(
            &owner,
            "SELECT count(*) FROM orders.webhook_destinations WHERE disabled_at IS NOT NULL"
        )
        .await,
        1,
        "still disabled"
    );
    assert_eq!(
        enable(true).run(&as_relay, &specs()).await.expect("enable"),
        "destination gone enabled\n1 waiting deliveries marked failed: their events are past the receiver's horizon\n"
    );
    assert_eq!(failed().await, 3);
    assert_eq!(
        count(&owner, "SELECT count(*) FROM orders.webhook_deliveries WHERE last_error LIKE 'past the receiver%'").await,
        1
    );
}

/// The destinations live in `orders.webhook_destinations`, one source of
/// truth for every relay. A relay started without a destination fans out
/// and delivers to one added by `relay webhooks add` while it runs (the
/// events committed after the add); a second relay started with other
/// flags adds its own and keeps the first's. A destination removed by
/// `relay webhooks remove` gets no later event, and its pending deliveries
/// are marked failed at once with the reason (not left open forever);
/// `add` and `replay --failed` send them after all.
#[tokio::test]
async fn destinations_added_and_removed_in_the_database_are_followed_by_running_relays() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let relay_pool = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as the relay");
    let (a, a_url) = Receiver::start(|_| Reply::OK).await;
    let (b, b_url) = Receiver::start(|_| Reply::OK).await;
    // c refuses everything: its deliveries stay pending (next try in 5 s).
    let (c, c_url) = Receiver::start(|_| Reply::status(500)).await;
    let first = spawn_relay(config(&db, vec![a.destination("a", &a_url, "")], 1.0)).await;
    let key = Uuid::now_v7();
    enqueue(&pool, key, 0).await;
    assert!(
        eventually(Duration::from_secs(20), || async { a.hits().len() == 1 }).await,
        "a gets the first event"
    );

    // b is added by the command; c by a second relay's flag.
    let added = Admin::Add {
        destination: b.destination("b", &b_url, ""),
    }
    .run(&relay_pool, &specs())
    .await
    .expect("add b");
    assert!(added.contains("destination b delivers to"), "{added}");
    let second = spawn_relay(config(&db, vec![c.destination("c", &c_url, "")], 1.0)).await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            count(
                &pool,
                "SELECT count(*) FROM orders.webhook_destinations WHERE spec IS NOT NULL AND removed_at IS NULL",
            )
            .await
                == 3
        })
        .await
    );
    for seq in 1..=3 {
        enqueue(&pool, key, seq).await;
    }
    assert!(
        eventually(Duration::from_secs(30), || async {
            a.hits().len() == 4 && b.hits().len() == 3 && !c.hits().is_empty()
        })
        .await,
        "a {} (4), b {} (3: from its add on), c {} (tried)",
        a.hits().len(),
        b.hits().len(),
        c.hits().len()
    );
    let b_seqs: Vec<i64> = b.hits().iter().map(|h| h.seq).collect();
    assert_eq!(
        b_seqs,
        [1, 2, 3],
        "b gets the events committed after its add"
    );
    let pending_c = count(
        &pool,
        "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'c' \
         AND delivered_at IS NULL AND failed_at IS NULL",
    )
    .await;
    assert_eq!(pending_c, 3, "c's deliveries wait for their next try");

    // c is removed: its pending deliveries fail at once, with the reason,
    // and no later event is fanned out to it.
    let removed = Admin::Remove {
        destination: "c".into(),
    }
    .run(&relay_pool, &specs())
    .await
    .expect("remove c");
    assert!(
        removed.contains("3 pending deliveries marked failed"),
        "{removed}"
    );
    let failed: Vec<String> = sqlx::query_scalar(
        "SELECT last_error FROM orders.webhook_deliveries WHERE destination = 'c' AND failed_at IS NOT NULL",
    )
    .fetch_all(&pool)
    .await
    .expect("failed");
    assert_eq!(failed.len(), 3);
    assert!(
        failed
            .iter()
            .all(|e| e.contains("the destination was removed")),
        "{failed:?}"
    );
    let c_tries = c.hits().len();
    enqueue(&pool, key, 4).await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            a.hits().len() == 5 && b.hits().len() == 4
        })
        .await
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'c'"
        )
        .await,
        3,
        "no delivery for c after its removal"
    );
    tokio::time::sleep(Duration::from_secs(6)).await; // past c's next try
    assert_eq!(c.hits().len(), c_tries, "c's loop stopped");
    let error = Admin::Remove {
        destination: "c".into(),
    }
    .run(&relay_pool, &specs())
    .await
    .expect_err("already removed");
    assert!(
        error.to_string().contains("no destination \"c\""),
        "{error}"
    );
    let status = Admin::Status
        .run(&relay_pool, &specs())
        .await
        .expect("status");
    assert!(
        status
            .lines()
            .any(|l| l.starts_with('c') && l.contains("removed since")),
        "{status}"
    );
    assert_eq!(count(&pool, OPEN).await, 0);
    first.stop().await;
    second.stop().await;
}

/// A relay's `--webhook-destination` flags add a destination the database
/// does not have, and nothing more: after an operator rotated a's secret
/// (`relay webhooks add`) and removed b, a relay started again with its old
/// flags keeps the rotated secret, leaves b removed (no later event is
/// fanned out to it) and says so. (Before, every start re-applied the
/// flags: the removed destination came back and the rotation was reverted.)
#[tokio::test]
async fn a_relay_s_flags_never_overwrite_or_bring_back_a_destination() {
    let db = TestDb::create().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let relay_pool = PgPool::connect(&db.url_as(ServiceRole::Relay))
        .await
        .expect("connect as the relay");
    let (a, a_url) = Receiver::start(|_| Reply::OK).await;
    let (b, b_url) = Receiver::start(|_| Reply::OK).await;
    let flags = vec![
        a.destination("a", &a_url, ""),
        b.destination("b", &b_url, ""),
    ];
    let spec = |name: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT spec FROM orders.webhook_destinations WHERE destination = $1",
            )
            .bind(name)
            .fetch_optional(&pool)
            .await
            .expect("spec")
            .flatten()
        }
    };
    let relay = spawn_relay(config(&db, flags.clone(), 1.0)).await;
    assert!(
        eventually(Duration::from_secs(20), || async {
            spec("a").await.is_some()
        })
        .await,
        "the relay's flag adds a"
    );
    let first = spec("a").await.expect("a's spec");
    assert!(!first.contains(&a.secret.to_whsec()), "sealed at rest");
    let first = specs().open("a", &first).expect("opens");
    assert!(first.contains(&a.secret.to_whsec()), "the flag added a");
    relay.stop().await;

    // The operator rotates a's secret and removes b.
    let new_secret = Secret::generate().to_whsec();
    let rotated_spec = format!(
        "a={a_url},secret={new_secret},secret={},allow-http",
        a.secret.to_whsec()
    );
    Admin::Add {
        destination: rotated_spec.parse().expect("destination"),
    }
    .run(&relay_pool, &specs())
    .await
    .expect("rotate a");
    Admin::Remove {
        destination: "b".into(),
    }
    .run(&relay_pool, &specs())
    .await
    .expect("remove b");

    let added = relay::webhooks::add_missing(&relay_pool, &specs(), &flags)
        .await
        .expect("flags");
    assert_eq!(
        added,
        relay::webhooks::Added {
            added: vec![],
            differing: vec!["a".into()],
            removed: vec!["b".into()],
        }
    );
    let relay = spawn_relay(config(&db, flags.clone(), 1.0)).await;
    enqueue(&pool, Uuid::now_v7(), 0).await;
    assert!(
        eventually(Duration::from_secs(20), || async { a.hits().len() == 1 }).await,
        "a gets the event: the relay is past its start-up"
    );
    let kept = specs()
        .open("a", &spec("a").await.expect("a's spec"))
        .expect("opens");
    assert!(kept.contains(&new_secret), "the rotation stays");
    assert_ne!(kept, first);
    let removed: i64 = count(
        &pool,
        "SELECT count(*) FROM orders.webhook_destinations WHERE destination = 'b' AND removed_at IS NOT NULL",
    )
    .await;
    assert_eq!(removed, 1, "b stays removed");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders.webhook_deliveries WHERE destination = 'b'"
        )
        .await,
        0,
        "nothing fanned out to b"
    );
    assert!(b.hits().is_empty());
    relay.stop().await;
}
