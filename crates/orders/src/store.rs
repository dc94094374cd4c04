//! The write path: idempotency key, order and outbox row in ONE transaction.
//!
//! This is one of the two places where correctness lives (the other is the
//! Payments inbox). One `begin`, one `commit` ([`write_batch`]): the keys,
//! the orders and the events commit together or not at all. So
//! * a committed order always has its event in the outbox (no lost publish:
//!   nothing is published here, the relay reads the outbox after commit);
//! * a failed request leaves no key behind, and its retry can succeed;
//! * a retry finds the key and gets the first response, with nothing written.
//!
//! Requests are coalesced: handlers put a job on a bounded queue and a few
//! writer tasks each take whatever is queued (up to a batch limit) into one
//! transaction. Three things follow. Throughput: a commit and its round trips
//! are shared by every request of the batch. Cancel-safety: the transaction
//! belongs to the writer task, so a client that disconnects cannot abort a
//! write halfway. Overload: `--write-queue` bounds the requests accepted and
//! not yet answered — queued, deferred behind an earlier request with the
//! same key, or in a transaction — and a request beyond it gets 503 at once
//! instead of piling up in memory or on the connection pool. A request whose
//! client went away before a writer took it is dropped unwritten.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use effectively::contract::{CrashPoint, ORDER_CREATED, OrderCreated, OrderStatus};
use effectively::crash::Crasher;
use effectively::idempotency::{
    Claim, Fingerprint, IdempotencyKey, IdempotencyStore, NewKey, StoredResponse,
};
use effectively::outbox::{Outbox, OutboxMessage};
use prometheus::IntGauge;
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::api::{CreateOrder, ORDER_STATUS_CREATED};
use crate::error::ApiError;
use crate::metrics::OrdersMetrics;

/// A failure to inject inside the write transaction, for tests and chaos runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InjectFault {
    /// No fault.
    #[default]
    None,
    /// Fail after the order insert, before the outbox insert and the commit.
    AfterOrderInsert,
}

/// An order as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct OrderRow {
    /// Order id.
    pub order_id: Uuid,
    /// Account charged.
    pub account_id: i64,
    /// Amount in cents.
    pub amount_cents: i64,
    /// Status.
    pub status: String,
    /// When the order was created.
    pub created_at: DateTime<Utc>,
}

/// Coalescing settings.
#[derive(Debug, Clone, Copy)]
pub struct WriterSettings {
    /// Writer tasks (concurrent write transactions).
    pub writers: usize,
    /// Most requests per transaction.
    pub max_batch: usize,
    /// Requests accepted and not yet answered (queued, deferred or being
    /// written); beyond it, 503.
    pub queue: usize,
    /// UNSAFE, measurement baseline only (`orders --no-idempotency`): no key
    /// claim, no stored response; every request writes a new order and event.
    pub no_idempotency: bool,
}

/// One create request waiting for a writer.
struct Job {
    key: IdempotencyKey,
    fingerprint: Fingerprint,
    request: CreateOrder,
    order_id: Uuid,
    response: StoredResponse,
    reply: oneshot::Sender<Result<Claim, ApiError>>,
    /// Its place in the `--write-queue` bound, given back when the job is
    /// answered or dropped.
    _slot: Slot,
}

/// A place in the bound on requests accepted and not yet answered.
struct Slot {
    _permit: OwnedSemaphorePermit,
    inflight: IntGauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.inflight.dec();
    }
}

/// What the writers share.
struct Shared {
    pool: PgPool,
    keys: IdempotencyStore,
    outbox: Outbox,
    fault: InjectFault,
    max_batch: usize,
    no_idempotency: bool,
    metrics: Arc<OrdersMetrics>,
    crasher: Arc<Crasher>,
    queue: Mutex<mpsc::Receiver<Job>>,
}

/// The Orders tables, written through the coalescing writers.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    jobs: mpsc::Sender<Job>,
    slots: Arc<Semaphore>,
    inflight: IntGauge,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Starts the writer tasks; they stop when every clone of the store is
    /// dropped (after finishing the batch in hand). Join the handles to wait.
    pub fn start(
        pool: PgPool,
        fault: InjectFault,
        settings: WriterSettings,
        metrics: Arc<OrdersMetrics>,
        crasher: Arc<Crasher>,
    ) -> (Self, Vec<JoinHandle<()>>) {
        let bound = settings.queue.max(1);
        let (jobs, queue) = mpsc::channel(bound);
        let slots = Arc::new(Semaphore::new(bound));
        let inflight = metrics.write_inflight.clone();
        let shared = Arc::new(Shared {
            pool: pool.clone(),
            keys: IdempotencyStore::default(),
            outbox: Outbox::default(),
            fault,
            max_batch: settings.max_batch.max(1),
            no_idempotency: settings.no_idempotency,
            metrics,
            crasher,
            queue: Mutex::new(queue),
        });
        let handles = (0..settings.writers.max(1))
            .map(|_| tokio::spawn(writer(shared.clone())))
            .collect();
        (
            Self {
                pool,
                jobs,
                slots,
                inflight,
            },
            handles,
        )
    }

    /// Creates the order for `key` unless the key was used before.
    ///
    /// `response` is what the first request answers; it is stored with the key
    /// in the same transaction, so every replay returns exactly it.
    pub async fn create(
        &self,
        key: &IdempotencyKey,
        fingerprint: &Fingerprint,
        request: &CreateOrder,
        order_id: Uuid,
        response: &StoredResponse,
    ) -> Result<Claim, ApiError> {
        // The bound counts every request until it is answered, deferred ones
        // included: the channel alone would only count the queued ones.
        let Ok(permit) = self.slots.clone().try_acquire_owned() else {
            return Err(ApiError::Overloaded);
        };
        self.inflight.inc();
        let (reply, answer) = oneshot::channel();
        let job = Job {
            key: key.clone(),
            fingerprint: *fingerprint,
            request: *request,
            order_id,
            response: response.clone(),
            reply,
            _slot: Slot {
                _permit: permit,
                inflight: self.inflight.clone(),
            },
        };
        match self.jobs.try_send(job) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => return Err(ApiError::Overloaded),
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(ApiError::Unavailable),
        }
        answer
            .await
            .map_err(|_| ApiError::Internal(anyhow::anyhow!("the writer dropped the request")))?
    }

    /// Reads one order.
    pub async fn get(&self, order_id: Uuid) -> Result<Option<OrderRow>, ApiError> {
        Ok(sqlx::query_as(
            "SELECT order_id, account_id, amount_cents, status, created_at \
             FROM orders.orders WHERE order_id = $1",
        )
        .bind(order_id)
        .fetch_optional(&self.pool)
        .await?)
    }
}

/// A writer: take a batch of distinct keys, write it, answer every job.
async fn writer(shared: Arc<Shared>) {
    // Jobs whose key was already in the batch being built: they go first in
    // the next batch, so they see the first one's committed row.
    let mut deferred: VecDeque<Job> = VecDeque::new();
    loop {
        let mut batch: Vec<Job> = Vec::with_capacity(shared.max_batch);
        let mut keys: HashSet<IdempotencyKey> = HashSet::new();
        let mut take = |job: Job, batch: &mut Vec<Job>, deferred: &mut VecDeque<Job>| {
            // Nobody waits for the answer: drop it unwritten (and free its
            // slot). Once in a batch a job is written whatever the client does.
            if job.reply.is_closed() {
                shared.metrics.write_abandoned_total.inc();
                return;
            }
            // Deferring exists for the key claim only (one statement cannot
            // both insert and see a key); without the claim, nothing waits.
            if shared.no_idempotency || keys.insert(job.key.clone()) {
                batch.push(job);
            } else {
                deferred.push_back(job);
            }
        };
        let carried = std::mem::take(&mut deferred);
        for job in carried {
            take(job, &mut batch, &mut deferred);
        }
        // An idle writer waits for work holding the queue lock; a writer that
        // already has work (deferred jobs) must not wait for that lock, or it
        // would wait for the next request to arrive: it only tops up its
        // batch when the lock is free.
        let queue = if batch.is_empty() {
            let mut queue = shared.queue.lock().await;
            match queue.recv().await {
                Some(job) => take(job, &mut batch, &mut deferred),
                None => return, // every sender dropped: shutting down
            }
            Some(queue)
        } else {
            shared.queue.try_lock().ok()
        };
        if let Some(mut queue) = queue {
            while batch.len() < shared.max_batch {
                match queue.try_recv() {
                    Ok(job) => take(job, &mut batch, &mut deferred),
                    Err(_) => break,
                }
            }
        }
        shared.metrics.write_batch_size.observe(batch.len() as f64);
        match write_batch(&shared, &batch).await {
            Ok(claims) => {
                settle_deferred(&mut deferred, &batch, &claims);
                for (job, claim) in batch.into_iter().zip(claims) {
                    let _ = job.reply.send(Ok(claim)); // the client may be gone
                }
            }
            Err(error) => {
                let unavailable = matches!(error, ApiError::Unavailable);
                if !unavailable {
                    tracing::error!(
                        error = format!("{error:#}"),
                        jobs = batch.len(),
                        "write batch failed"
                    );
                }
                for job in batch {
                    let answer = if unavailable {
                        ApiError::Unavailable
                    } else {
                        ApiError::Internal(anyhow::anyhow!("write batch failed"))
                    };
                    let _ = job.reply.send(Err(answer));
                }
            }
        }
    }
}

/// What a committed batch settled about a key.
enum Settled {
    /// The key's row holds this fingerprint, order and response.
    Known(Fingerprint, Uuid, StoredResponse),
    /// The key's row holds a fingerprint other than this one (the batch's
    /// claim was a mismatch; the stored fingerprint itself is not read).
    Not(Fingerprint),
}

/// Answers, after a batch committed, the deferred jobs whose key that batch
/// settled: the key's row is now committed, so the claim would answer them
/// from it (`Replay` for the same request, `Mismatch` for another) —
/// answered here, all at once, without a batch each. Without this a hot key
/// is served one request per batch and its deferred jobs queue up behind it
/// (experiment 1's cliff). A key whose claim was `Mismatch` settles the
/// deferred requests with that same body (mismatches too); a deferred request
/// with yet another body stays deferred, for the next claim.
fn settle_deferred(deferred: &mut VecDeque<Job>, batch: &[Job], claims: &[Claim]) {
    if deferred.is_empty() {
        return;
    }
    let waiting: HashSet<&IdempotencyKey> = deferred.iter().map(|d| &d.key).collect();
    let settled: HashMap<IdempotencyKey, Settled> = batch
        .iter()
        .zip(claims)
        .filter(|(job, _)| waiting.contains(&job.key))
        .map(|(job, claim)| {
            let settled = match claim {
                Claim::New => Settled::Known(job.fingerprint, job.order_id, job.response.clone()),
                Claim::Replay { order_id, response } => {
                    Settled::Known(job.fingerprint, *order_id, response.clone())
                }
                Claim::Mismatch => Settled::Not(job.fingerprint),
            };
            (job.key.clone(), settled)
        })
        .collect();
    if settled.is_empty() {
        return;
    }
    for job in std::mem::take(deferred) {
        let claim = match settled.get(&job.key) {
            Some(Settled::Known(fingerprint, order_id, response)) => {
                if job.fingerprint == *fingerprint {
                    Claim::Replay {
                        order_id: *order_id,
                        response: response.clone(),
                    }
                } else {
                    Claim::Mismatch
                }
            }
            Some(Settled::Not(fingerprint)) if job.fingerprint == *fingerprint => Claim::Mismatch,
            _ => {
                deferred.push_back(job);
                continue;
            }
        };
        let _ = job.reply.send(Ok(claim)); // the client may be gone
    }
}

/// THE transaction: claim every key, insert the orders and the outbox events
/// of the new ones, commit. Keys are distinct within a batch.
///
/// With `no_idempotency` (the unsafe measurement baseline) the claim is
/// skipped and every job counts as new: the rest of the transaction is the
/// same code, so the two modes differ by exactly the idempotency check.
async fn write_batch(shared: &Shared, batch: &[Job]) -> Result<Vec<Claim>, ApiError> {
    let mut tx = shared.pool.begin().await?;
    let claims = if shared.no_idempotency {
        vec![Claim::New; batch.len()]
    } else {
        let items: Vec<NewKey<'_>> = batch
            .iter()
            .map(|j| NewKey {
                key: &j.key,
                fingerprint: &j.fingerprint,
                order_id: j.order_id,
                response: &j.response,
            })
            .collect();
        shared.keys.claim_batch(&mut tx, &items).await?
    };
    let new: Vec<&Job> = batch
        .iter()
        .zip(&claims)
        .filter(|(_, claim)| **claim == Claim::New)
        .map(|(job, _)| job)
        .collect();
    if new.is_empty() {
        // Only replays and mismatches: nothing written, nothing to commit.
        return Ok(claims);
    }
    insert_orders(&mut tx, &new).await?;
    if shared.fault == InjectFault::AfterOrderInsert {
        return Err(ApiError::Internal(anyhow::anyhow!(
            "injected fault after the order insert"
        )));
    }
    let mut events = Vec::with_capacity(new.len());
    for job in &new {
        let payload = serde_json::to_vec(&OrderCreated {
            order_id: job.order_id,
            account_id: job.request.account_id,
            amount_cents: job.request.amount_cents,
            status: OrderStatus::Created,
        })
        .map_err(|e| ApiError::Internal(e.into()))?;
        events.push(OutboxMessage {
            aggregate_id: job.order_id,
            msg_id: Uuid::now_v7(),
            event_type: ORDER_CREATED.to_owned(),
            payload,
        });
    }
    shared.outbox.enqueue_batch(&mut tx, &events).await?;
    tx.commit().await?;
    // Committed, nobody answered yet: a crash here leaves orders whose
    // clients saw an error. Their retries must get the stored responses.
    shared.crasher.point(CrashPoint::Commit);
    Ok(claims)
}

async fn insert_orders(conn: &mut PgConnection, jobs: &[&Job]) -> Result<(), sqlx::Error> {
    let ids: Vec<Uuid> = jobs.iter().map(|j| j.order_id).collect();
    let accounts: Vec<i64> = jobs.iter().map(|j| j.request.account_id).collect();
    let amounts: Vec<i64> = jobs.iter().map(|j| j.request.amount_cents).collect();
    sqlx::query(
        "INSERT INTO orders.orders (order_id, account_id, amount_cents, status) \
         SELECT o, a, m, $4 FROM unnest($1::uuid[], $2::int8[], $3::int8[]) AS u(o, a, m)",
    )
    .bind(&ids)
    .bind(&accounts)
    .bind(&amounts)
    .bind(ORDER_STATUS_CREATED)
    .execute(conn)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(
        key: &str,
        body: &str,
        order_id: Uuid,
    ) -> (Job, oneshot::Receiver<Result<Claim, ApiError>>) {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            key: IdempotencyKey::parse(key.as_bytes()).expect("key"),
            fingerprint: Fingerprint::new("test", body.as_bytes()),
            request: CreateOrder {
                account_id: 1,
                amount_cents: 1,
            },
            order_id,
            response: StoredResponse {
                status: 201,
                headers: vec![("location".into(), format!("/orders/{order_id}"))],
                body: format!("{{\"order_id\":\"{order_id}\"}}").into_bytes(),
            },
            reply,
            _slot: Slot {
                _permit: Arc::new(Semaphore::new(1))
                    .try_acquire_owned()
                    .expect("permit"),
                inflight: IntGauge::new("test_inflight", "test").expect("gauge"),
            },
        };
        (job, answer)
    }

    fn answered(rx: &mut oneshot::Receiver<Result<Claim, ApiError>>) -> Option<Claim> {
        rx.try_recv().ok().map(|r| r.expect("no error"))
    }

    #[test]
    fn deferred_jobs_of_a_settled_key_are_answered_as_the_claim_would() {
        let (first, _) = job("k1", "A", Uuid::now_v7());
        let (replayed, _) = job("k2", "B", Uuid::now_v7());
        let stored = replayed.response.clone();
        let (conflicted, _) = job("k3", "C", Uuid::now_v7());
        let batch = vec![first, replayed, conflicted];
        let claims = vec![
            Claim::New,
            Claim::Replay {
                order_id: batch[1].order_id,
                response: stored.clone(),
            },
            Claim::Mismatch,
        ];
        let (same, mut same_rx) = job("k1", "A", Uuid::now_v7());
        let (other, mut other_rx) = job("k1", "Z", Uuid::now_v7());
        let (again, mut again_rx) = job("k2", "B", Uuid::now_v7());
        let (refused, mut refused_rx) = job("k3", "C", Uuid::now_v7());
        let (unknown, mut unknown_rx) = job("k3", "D", Uuid::now_v7());
        let (elsewhere, mut elsewhere_rx) = job("k9", "A", Uuid::now_v7());
        let mut deferred: VecDeque<Job> = [same, other, again, refused, unknown, elsewhere].into();

        settle_deferred(&mut deferred, &batch, &claims);

        // Same request as the new key's first: its committed response, its order.
        assert_eq!(
            answered(&mut same_rx),
            Some(Claim::Replay {
                order_id: batch[0].order_id,
                response: batch[0].response.clone(),
            })
        );
        // Another request with that key: refused.
        assert_eq!(answered(&mut other_rx), Some(Claim::Mismatch));
        // A replayed key: the stored response again.
        assert_eq!(
            answered(&mut again_rx),
            Some(Claim::Replay {
                order_id: batch[1].order_id,
                response: stored,
            })
        );
        // A key whose claim was a mismatch: the same body is refused too...
        assert_eq!(answered(&mut refused_rx), Some(Claim::Mismatch));
        // ...another body (the stored fingerprint is not known here) and a
        // key not in the batch: still deferred, for the next claim.
        assert_eq!(answered(&mut unknown_rx), None);
        assert_eq!(answered(&mut elsewhere_rx), None);
        let left: Vec<&str> = deferred.iter().map(|j| j.key.as_str()).collect();
        assert_eq!(left, vec!["k3", "k9"]);
    }
}
