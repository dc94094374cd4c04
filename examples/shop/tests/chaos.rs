//! The shop under chaos, against the real PostgreSQL and Kafka: 300
//! checkouts sent with retries and duplicate requests while the server, the
//! relay and billing are killed -9 and restarted, and published events are
//! marked pending again (so relayed twice). Then its own effects == intents
//! check: one checkout per key, every answer to a key the same, one invoice
//! per checkout: 0 lost, 0 doubled.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use pipeline::testing::{TestDb, TestTopic, free_port};
use sqlx::PgPool;

const CARTS: i32 = 300;

/// The shop's processes, each restartable.
struct Shop {
    env: Vec<(&'static str, String)>,
    addr: String,
}

impl Shop {
    fn spawn(&self, command: &str) -> Child {
        let mut c = Command::new(env!("CARGO_BIN_EXE_shop"));
        c.arg(command)
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("SHOP_ADDR", &self.addr)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        c.spawn()
            .unwrap_or_else(|e| panic!("spawn shop {command}: {e}"))
    }

    /// Kills `child` with SIGKILL (no shutdown: kill -9) and starts another.
    fn kill_and_restart(&self, child: &mut Child, command: &str) {
        child.kill().expect("kill -9");
        child.wait().expect("reap");
        *child = self.spawn(command);
    }
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// Sends cart `cart`'s checkout under its key until an answer other than a
/// connection error or a 5xx comes back; returns it.
async fn checkout(client: &reqwest::Client, addr: &str, cart: i32) -> (u16, String) {
    for _ in 0..600 {
        let sent = client
            .post(format!("http://{addr}/carts/{cart}/checkout"))
            .header("idempotency-key", format!("checkout-{cart}"))
            .header("content-type", "application/json")
            .body(format!("{{\"total\": {}}}", cart * 10))
            .send()
            .await;
        if let Ok(answer) = sent {
            let status = answer.status().as_u16();
            if status < 500 {
                return (status, answer.text().await.unwrap_or_default());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("cart {cart}: no answer in 60 s");
}

#[tokio::test]
async fn checkouts_are_invoiced_once_through_retries_duplicates_and_kill_9() {
    let db = TestDb::empty().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    let topic = TestTopic::create(3).await;
    let shop = Shop {
        env: vec![
            ("DATABASE_URL", db.url.clone()),
            ("KAFKA_BOOTSTRAP_SERVERS", topic.bootstrap_servers.clone()),
            ("SHOP_TOPIC", topic.name.clone()),
            ("BILLING_GROUP", format!("billing-{}", topic.name)),
        ],
        addr: format!("127.0.0.1:{}", free_port()),
    };
    assert!(shop.spawn("migrate").wait().expect("migrate").success());
    let mut server = shop.spawn("serve");
    let mut relay = shop.spawn("relay");
    let mut billing = shop.spawn("billing");

    // The load: every cart's checkout, a fifth of them sent twice at once.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("a client");
    let done = Arc::new(AtomicBool::new(false));
    let load = {
        let (client, addr, done) = (client.clone(), shop.addr.clone(), done.clone());
        tokio::spawn(async move {
            let sends = (0..CARTS).flat_map(|cart| {
                let twice = cart % 5 == 0;
                std::iter::repeat_n(cart, if twice { 2 } else { 1 })
            });
            let answers: Vec<(i32, (u16, String))> = futures::stream::iter(sends)
                .map(|cart| {
                    let (client, addr) = (client.clone(), addr.clone());
                    async move {
                        tokio::time::sleep(Duration::from_millis(
                            u64::from(cart.unsigned_abs()) * 3 % 40,
                        ))
                        .await;
                        (cart, checkout(&client, &addr, cart).await)
                    }
                })
                .buffer_unordered(16)
                .collect()
                .await;
            done.store(true, Ordering::SeqCst);
            answers
        })
    };

    // The chaos, while the load runs: kill -9 each process in turn, and
    // mark some published events pending again (the relay sends them twice).
    let mut kills = 0;
    let mut republished = 0;
    let mut round = 0;
    while !done.load(Ordering::SeqCst) || round < 6 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        match round % 3 {
            0 => shop.kill_and_restart(&mut relay, "relay"),
            1 => shop.kill_and_restart(&mut billing, "billing"),
            _ => shop.kill_and_restart(&mut server, "serve"),
        }
        kills += 1;
        republished += sqlx::query(
            "UPDATE shop_fx.outbox SET published_at = NULL WHERE id IN \
               (SELECT id FROM shop_fx.outbox WHERE published_at IS NOT NULL ORDER BY random() LIMIT 10)",
        )
        .execute(&pool)
        .await
        .expect("mark published events pending again")
        .rows_affected();
        round += 1;
        assert!(round < 400, "the load did not end");
    }
    let answers = load.await.expect("the load");

    // Calm: everything relayed and invoiced.
    let mut settled = false;
    for _ in 0..600 {
        if count(
            &pool,
            "SELECT count(*) FROM shop_fx.outbox WHERE published_at IS NULL AND failed_at IS NULL",
        )
        .await
            == 0
            && count(&pool, "SELECT count(*) FROM billing.invoices").await
                >= count(&pool, "SELECT count(*) FROM shop.checkouts").await
        {
            settled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A moment more: an invoice written twice would show now.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for mut child in [server, relay, billing] {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(
        settled,
        "the outbox drained and billing caught up within 60 s"
    );
    assert!(
        kills >= 6 && republished > 0,
        "{kills} kills, {republished} re-published"
    );

    // Intents: every cart answered 201, the same body each time.
    let mut by_cart: HashMap<i32, Vec<(u16, String)>> = HashMap::new();
    for (cart, answer) in answers {
        by_cart.entry(cart).or_default().push(answer);
    }
    assert_eq!(by_cart.len(), CARTS as usize);
    for (cart, got) in &by_cart {
        assert!(
            got.iter().all(|a| a.0 == 201 && a == &got[0]),
            "cart {cart}: {got:?}"
        );
    }
    // Effects: one checkout per cart, one invoice per checkout, nothing else.
    assert_eq!(
        count(&pool, "SELECT count(*) FROM shop.checkouts").await,
        i64::from(CARTS)
    );
    assert_eq!(
        count(&pool, "SELECT count(DISTINCT cart) FROM shop.checkouts").await,
        i64::from(CARTS)
    );
    let diff = count(
        &pool,
        "SELECT count(*) FROM shop.checkouts c FULL JOIN \
           (SELECT checkout_id, count(*) AS n, sum(total) AS total FROM billing.invoices GROUP BY 1) i \
           ON i.checkout_id = c.id \
         WHERE c.id IS NULL OR i.checkout_id IS NULL OR i.n <> 1 OR i.total <> c.total",
    )
    .await;
    assert_eq!(
        diff, 0,
        "checkouts without their one invoice, or invoices without a checkout"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM billing_fx.dead_letters").await,
        0
    );
    // One claim per event, in billing's partitioned inbox.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM billing_fx.partitioned_inbox WHERE consumer = 'billing'"
        )
        .await,
        i64::from(CARTS)
    );
    // Each checkout's answer names the checkout its key made.
    for (cart, got) in &by_cart {
        let body: serde_json::Value = serde_json::from_str(&got[0].1).expect("a JSON answer");
        let id: i64 = sqlx::query_scalar("SELECT id FROM shop.checkouts WHERE cart = $1")
            .bind(cart)
            .fetch_one(&pool)
            .await
            .expect("the cart's checkout");
        assert_eq!(body["checkout"], id, "cart {cart}");
    }
    let requests: usize = by_cart.values().map(Vec::len).sum();
    eprintln!(
        "shop chaos: {CARTS} carts, {requests} requests answered, {kills} kill -9, {republished} events \
         marked pending again; {} checkouts, {} invoices, {} inbox rows, 0 lost, 0 doubled",
        count(&pool, "SELECT count(*) FROM shop.checkouts").await,
        count(&pool, "SELECT count(*) FROM billing.invoices").await,
        count(&pool, "SELECT count(*) FROM billing_fx.partitioned_inbox").await,
    );
}
