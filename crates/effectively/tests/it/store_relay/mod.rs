//! The library's relay (`effectively::store::Relay`) against the real
//! PostgreSQL, through a sink the test scripts (which rows fail, and how;
//! a send that never ends), and through `KafkaSink` to the real broker.

mod expiry;
mod kafka;
mod passes;
mod run;
mod webhook;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use effectively::store::{Effectively, Event, Outgoing, SendError, Sink};
use pipeline::testing::TestDb;
use sqlx::PgPool;

async fn store() -> (TestDb, PgPool, Effectively) {
    super::store::store("shop_fx").await
}

/// What a scripted sink does with a row, by its payload (a JSON number).
#[derive(Clone, Copy)]
enum Script {
    Retry,
    Reject,
    Hang,
}

/// Records every send in order; fails or hangs the rows its script names.
#[derive(Default, Clone)]
struct Recorder {
    sent: Arc<Mutex<Vec<(String, i64)>>>,
    script: Arc<Mutex<HashMap<i64, Script>>>,
}

impl Recorder {
    fn sent(&self) -> Vec<(String, i64)> {
        self.sent.lock().expect("lock").clone()
    }
    fn set(&self, n: i64, script: Option<Script>) {
        let mut s = self.script.lock().expect("lock");
        match script {
            Some(x) => s.insert(n, x),
            None => s.remove(&n),
        };
    }
    /// Each key's payloads in the order they were sent.
    fn by_key(&self) -> HashMap<String, Vec<i64>> {
        let mut m: HashMap<String, Vec<i64>> = HashMap::new();
        for (k, n) in self.sent() {
            m.entry(k).or_default().push(n);
        }
        m
    }
}

impl Sink for Recorder {
    async fn send(&self, row: &Outgoing) -> Result<(), SendError> {
        let n: i64 = serde_json::from_slice(&row.payload).expect("a number");
        let script = self.script.lock().expect("lock").get(&n).copied();
        match script {
            Some(Script::Retry) => return Err(SendError::Retry("scripted".into())),
            Some(Script::Reject) => return Err(SendError::Reject("scripted refusal".into())),
            Some(Script::Hang) => std::future::pending::<()>().await,
            None => {}
        }
        self.sent.lock().expect("lock").push((row.key.clone(), n));
        Ok(())
    }
}

/// Enqueues payloads `ns` for keys `k0..k{keys}` in turn, in one transaction.
async fn enqueue(fx: &Effectively, keys: i64, ns: std::ops::Range<i64>) {
    let events: Vec<Event> = ns
        .map(|n| {
            Event::json("carts", &format!("k{}", n % keys), "cart.updated", &n)
                .expect("a valid event")
        })
        .collect();
    fx.outbox()
        .enqueue_batch(fx.pool(), &events)
        .await
        .expect("enqueue");
}

async fn pending(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM shop_fx.outbox WHERE published_at IS NULL AND failed_at IS NULL",
    )
    .fetch_one(pool)
    .await
    .expect("count")
}

fn ascending(v: &[i64]) -> bool {
    v.windows(2).all(|w| w[0] < w[1])
}
