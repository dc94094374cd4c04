//! The batching writer in front of the write transaction
//! ([`Store::write_batch`]).
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
//!
//! Two requests with one key are never written at once: the writers share a
//! registry of the keys in their batches, and a request whose key is in one
//! (this writer's or another's) is parked behind that batch. When the batch
//! ends, its writer takes the parked requests as deferred ones: answered at
//! once if the committed batch settled their key ([`settle_deferred`]),
//! else written in its next batch. Within a batch this is required (one
//! statement cannot both insert and see a key); across writers it keeps a
//! retry from waiting in PostgreSQL on the row its original's batch has not
//! committed yet, with its whole batch behind it.
//!
//! Fewer commits for the same requests: the write path is bound by its
//! commits (each one a WAL flush), not by their size (FINDINGS §14). A writer
//! that finds fewer requests queued than a batch holds may wait up to
//! `--write-linger-us` for more before it writes ([`Linger`]), but only when
//! the recent arrival rate says at least one more request is likely to come
//! in that time: at a low rate nobody waits for nothing.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use effectively::store::KeyClaim;
use pipeline::idempotency::{Fingerprint, StoredResponse};
use prometheus::IntGauge;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::metrics::OrdersMetrics;
use crate::store::{Create, ScopedKey, Store};

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
    /// How long a writer with room in its batch may wait for more requests
    /// (zero: never; it writes what is queued).
    pub linger: Duration,
}

/// How long a writer may wait to fill its batch: `max`, when the arrival
/// rate measured over the last windows says at least one more request
/// should arrive within it; else not at all.
#[derive(Debug)]
struct Linger {
    max: Duration,
    /// Create requests queued since the start, counted by [`WriteQueue`].
    arrivals: AtomicU64,
    rate: std::sync::Mutex<Rate>,
}

/// The arrival rate, smoothed over windows of at least [`Linger::WINDOW`].
#[derive(Debug)]
struct Rate {
    since: Instant,
    arrivals: u64,
    per_sec: f64,
}

impl Linger {
    /// The shortest span a rate is measured over.
    const WINDOW: Duration = Duration::from_millis(10);
    /// A window this long or longer replaces the estimate instead of being
    /// averaged into it: the rate it described is history.
    const STALE: Duration = Duration::from_secs(1);

    fn new(max: Duration, now: Instant) -> Self {
        Self {
            max,
            arrivals: AtomicU64::new(0),
            rate: std::sync::Mutex::new(Rate {
                since: now,
                arrivals: 0,
                per_sec: 0.0,
            }),
        }
    }

    fn arrived(&self) {
        if !self.max.is_zero() {
            self.arrivals.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Until when a writer starting a batch at `now` may wait for more.
    fn deadline(&self, now: Instant) -> Option<Instant> {
        if self.max.is_zero() {
            return None;
        }
        let arrivals = self.arrivals.load(Ordering::Relaxed);
        let mut rate = self
            .rate
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let span = now.saturating_duration_since(rate.since);
        if span >= Self::WINDOW {
            let measured = arrivals.saturating_sub(rate.arrivals) as f64 / span.as_secs_f64();
            rate.per_sec = if span >= Self::STALE {
                measured
            } else {
                0.5 * rate.per_sec + 0.5 * measured
            };
            rate.since = now;
            rate.arrivals = arrivals;
        }
        (rate.per_sec * self.max.as_secs_f64() >= 1.0).then(|| now + self.max)
    }
}

/// The next queued job: at once if one is queued; else, until `deadline`,
/// the next to arrive. `None` when none came (or the queue closed).
async fn next_job(queue: &mut mpsc::Receiver<Job>, deadline: Option<Instant>) -> Option<Job> {
    match queue.try_recv() {
        Ok(job) => Some(job),
        Err(mpsc::error::TryRecvError::Disconnected) => None,
        Err(mpsc::error::TryRecvError::Empty) => {
            let deadline = deadline?;
            tokio::time::timeout_at(deadline, queue.recv())
                .await
                .ok()
                .flatten()
        }
    }
}

/// Why a queued create got no claim. The front ends map it to their error
/// (`error.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    /// `--write-queue` requests are already accepted and not yet answered.
    #[error("the write queue is full")]
    Overloaded,
    /// The database went away or refuses work for now, or the writers have
    /// stopped (shutting down): retrying later is safe.
    #[error("the database is unavailable")]
    Unavailable,
    /// The transaction carrying the request failed; its writer logged why,
    /// once for the whole batch.
    #[error("the write batch failed")]
    Failed,
    /// The writer went away without answering (it panicked).
    #[error("the writer dropped the request")]
    Dropped,
}

/// One create request waiting for a writer.
struct Job {
    create: Create,
    reply: oneshot::Sender<Result<KeyClaim, WriteError>>,
    /// Its place in the `--write-queue` bound, given back when the job is
    /// answered or dropped.
    _slot: Slot,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("key", &self.create.key)
            .finish_non_exhaustive()
    }
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
    store: Arc<Store>,
    max_batch: usize,
    metrics: Arc<OrdersMetrics>,
    queue: Mutex<mpsc::Receiver<Job>>,
    /// The keys in the writers' batches, with the jobs parked behind them.
    in_flight: InFlight,
    linger: Arc<Linger>,
}

/// The keys in the writers' batches, each with the jobs parked behind it.
#[derive(Default)]
struct InFlight(std::sync::Mutex<HashMap<ScopedKey, Vec<Job>>>);

impl InFlight {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<ScopedKey, Vec<Job>>> {
        // A panic elsewhere cannot leave the map half-updated: every change
        // is one insert, push or remove.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Gives `job` back with its key now held by `held`'s batch, or parks
    /// it behind the batch that holds its key (`None`).
    fn hold_or_park(&self, job: Job, held: &mut Held<'_>) -> Option<Job> {
        let mut map = self.map();
        if let Some(parked) = map.get_mut(&job.create.key) {
            parked.push(job);
            return None;
        }
        map.insert(job.create.key.clone(), Vec::new());
        held.keys.push(job.create.key.clone());
        Some(job)
    }
}

/// The keys a writer's batch holds in [`InFlight`]. Released when the batch
/// ends ([`Held::release`]); if the writer panics instead, dropping this
/// releases them and drops their parked jobs (their clients get
/// [`WriteError::Dropped`]) rather than leaving them parked forever.
struct Held<'a> {
    in_flight: &'a InFlight,
    keys: Vec<ScopedKey>,
}

impl<'a> Held<'a> {
    fn new(in_flight: &'a InFlight) -> Self {
        Self {
            in_flight,
            keys: Vec::new(),
        }
    }

    /// Frees the keys; returns the jobs parked behind them, in arrival order
    /// per key.
    fn release(mut self) -> Vec<Job> {
        let keys = std::mem::take(&mut self.keys);
        let mut map = self.in_flight.map();
        keys.iter()
            .filter_map(|key| map.remove(key))
            .flatten()
            .collect()
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        let mut map = self.in_flight.map();
        for key in &self.keys {
            map.remove(key);
        }
    }
}

/// The queue in front of the writers: the handle the front ends create
/// orders through.
#[derive(Debug, Clone)]
pub struct WriteQueue {
    jobs: mpsc::Sender<Job>,
    slots: Arc<Semaphore>,
    inflight: IntGauge,
    linger: Arc<Linger>,
}

impl WriteQueue {
    /// Starts the writer tasks on `store`; they stop when every clone of the
    /// queue is dropped (after finishing the batch in hand). Join the handles
    /// to wait.
    pub fn start(
        store: Arc<Store>,
        settings: WriterSettings,
        metrics: Arc<OrdersMetrics>,
    ) -> (Self, Vec<JoinHandle<()>>) {
        let bound = settings.queue.max(1);
        let (jobs, queue) = mpsc::channel(bound);
        let slots = Arc::new(Semaphore::new(bound));
        let inflight = metrics.write_inflight.clone();
        let linger = Arc::new(Linger::new(settings.linger, Instant::now()));
        let shared = Arc::new(Shared {
            store,
            max_batch: settings.max_batch.max(1),
            metrics,
            queue: Mutex::new(queue),
            in_flight: InFlight::default(),
            linger: linger.clone(),
        });
        let handles = (0..settings.writers.max(1))
            .map(|_| tokio::spawn(writer(shared.clone())))
            .collect();
        (
            Self {
                jobs,
                slots,
                inflight,
                linger,
            },
            handles,
        )
    }

    /// Writes `create` unless its key was used before; the claim says which.
    pub async fn create(&self, create: Create) -> Result<KeyClaim, WriteError> {
        // The bound counts every request until it is answered, deferred ones
        // included: the channel alone would only count the queued ones.
        let Ok(permit) = self.slots.clone().try_acquire_owned() else {
            return Err(WriteError::Overloaded);
        };
        self.inflight.inc();
        let (reply, answer) = oneshot::channel();
        let job = Job {
            create,
            reply,
            _slot: Slot {
                _permit: permit,
                inflight: self.inflight.clone(),
            },
        };
        match self.jobs.try_send(job) {
            Ok(()) => self.linger.arrived(),
            Err(mpsc::error::TrySendError::Full(_)) => return Err(WriteError::Overloaded),
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(WriteError::Unavailable),
        }
        answer.await.map_err(|_| WriteError::Dropped)?
    }
}

/// A writer: take a batch of keys no other batch holds, write it, answer
/// every job.
async fn writer(shared: Arc<Shared>) {
    // Jobs that were parked behind a batch with their key: they go first in
    // the next batch, so they see that batch's committed row.
    let mut deferred: VecDeque<Job> = VecDeque::new();
    loop {
        let mut batch: Vec<Job> = Vec::with_capacity(shared.max_batch);
        let mut held = Held::new(&shared.in_flight);
        let mut take = |job: Job, batch: &mut Vec<Job>| {
            // Nobody waits for the answer: drop it unwritten (and free its
            // slot). Once in a batch a job is written whatever the client does.
            if job.reply.is_closed() {
                shared.metrics.write_abandoned_total.inc();
                return;
            }
            // Parking exists for the key claim only; without the claim,
            // nothing waits.
            if shared.store.no_idempotency() {
                batch.push(job);
                return;
            }
            if let Some(job) = shared.in_flight.hold_or_park(job, &mut held) {
                batch.push(job);
            }
        };
        let carried = std::mem::take(&mut deferred);
        for job in carried {
            take(job, &mut batch);
        }
        // An idle writer waits for work holding the queue lock; a writer that
        // already has work (deferred jobs) must not wait for that lock, or it
        // would wait for the next request to arrive: it only tops up its
        // batch when the lock is free.
        // Only a writer that waited for its first request may linger for
        // more (holding the queue lock, so the next writer's batch starts
        // filling when this one's is written).
        let (queue, deadline) = if batch.is_empty() {
            let mut queue = shared.queue.lock().await;
            match queue.recv().await {
                Some(job) => take(job, &mut batch),
                None => return, // every sender dropped: shutting down
            }
            (Some(queue), shared.linger.deadline(Instant::now()))
        } else {
            (shared.queue.try_lock().ok(), None)
        };
        if let Some(mut queue) = queue {
            while batch.len() < shared.max_batch {
                match next_job(&mut queue, deadline).await {
                    Some(job) => take(job, &mut batch),
                    None => break,
                }
            }
        }
        if batch.is_empty() {
            // Everything taken was parked behind other batches, or abandoned.
            continue;
        }
        shared.metrics.write_batch_size.observe(batch.len() as f64);
        let creates: Vec<&Create> = batch.iter().map(|job| &job.create).collect();
        let written = shared.store.write_batch(&creates).await;
        deferred.extend(held.release());
        match written {
            Ok(claims) => {
                settle_deferred(&mut deferred, &batch, &claims);
                for (job, claim) in batch.into_iter().zip(claims) {
                    let _ = job.reply.send(Ok(claim)); // the client may be gone
                }
            }
            Err(error) => {
                shared
                    .metrics
                    .write_errors_total
                    .with_label_values(&[error.kind().label()])
                    .inc();
                // Handled here, so logged here, once for the batch; its
                // requests only say that it failed. A database that went away
                // is no one's bug: its clients get 503 and retry.
                let answer = if error.is_unavailable() {
                    WriteError::Unavailable
                } else {
                    tracing::error!(%error, jobs = batch.len(), "write batch failed");
                    WriteError::Failed
                };
                for job in batch {
                    let _ = job.reply.send(Err(answer));
                }
            }
        }
    }
}

/// What a committed batch settled about a key.
enum Settled {
    /// The key's row holds this fingerprint and response.
    Known(Fingerprint, StoredResponse),
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
fn settle_deferred(deferred: &mut VecDeque<Job>, batch: &[Job], claims: &[KeyClaim]) {
    if deferred.is_empty() {
        return;
    }
    let waiting: HashSet<&ScopedKey> = deferred.iter().map(|d| &d.create.key).collect();
    let settled: HashMap<ScopedKey, Settled> = batch
        .iter()
        .zip(claims)
        .filter(|(job, _)| waiting.contains(&job.create.key))
        .map(|(job, claim)| {
            let create = &job.create;
            let settled = match claim {
                KeyClaim::New => Settled::Known(create.fingerprint, create.response.clone()),
                KeyClaim::Replay(response) => Settled::Known(create.fingerprint, response.clone()),
                KeyClaim::Mismatch | KeyClaim::Unfinished => Settled::Not(create.fingerprint),
            };
            (create.key.clone(), settled)
        })
        .collect();
    if settled.is_empty() {
        return;
    }
    for job in std::mem::take(deferred) {
        let fingerprint_of_job = job.create.fingerprint;
        let claim = match settled.get(&job.create.key) {
            Some(Settled::Known(fingerprint, response)) => {
                if fingerprint_of_job == *fingerprint {
                    KeyClaim::Replay(response.clone())
                } else {
                    KeyClaim::Mismatch
                }
            }
            Some(Settled::Not(fingerprint)) if fingerprint_of_job == *fingerprint => {
                KeyClaim::Mismatch
            }
            _ => {
                deferred.push_back(job);
                continue;
            }
        };
        let _ = job.reply.send(Ok(claim)); // the client may be gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::order::{CreateOrder, NewOrder};

    fn job(key: &str, body: &str) -> (Job, oneshot::Receiver<Result<KeyClaim, WriteError>>) {
        let (reply, answer) = oneshot::channel();
        let order = NewOrder::new(&CreateOrder {
            account_id: 1,
            amount_cents: 1,
        })
        .expect("valid");
        let order_id = order.order_id();
        let job = Job {
            create: Create {
                key: ScopedKey {
                    caller: crate::auth::Caller::anonymous(),
                    key: pipeline::idempotency::IdempotencyKey::parse(key.as_bytes()).expect("key"),
                },
                fingerprint: Fingerprint::new("test", body.as_bytes()),
                order,
                response: StoredResponse {
                    status: 201,
                    headers: vec![("location".into(), format!("/orders/{order_id}"))],
                    body: format!("{{\"order_id\":\"{order_id}\"}}").into_bytes(),
                },
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

    fn answered(rx: &mut oneshot::Receiver<Result<KeyClaim, WriteError>>) -> Option<KeyClaim> {
        rx.try_recv().ok().map(|r| r.expect("no error"))
    }

    #[tokio::test(start_paused = true)]
    async fn a_writer_lingers_only_while_requests_arrive_faster_than_one_per_linger() {
        let max = Duration::from_millis(1);
        let start = Instant::now();
        let linger = Linger::new(max, start);
        // Nothing measured yet: no wait.
        assert_eq!(linger.deadline(start), None);
        // 100 requests in 20 ms (5,000/s), averaged with the 0 before:
        // 2,500/s, 2.5 expected per millisecond.
        for _ in 0..100 {
            linger.arrived();
        }
        let at = start + Duration::from_millis(20);
        assert_eq!(linger.deadline(at), Some(at + max));
        // Within the same window the estimate stands.
        assert_eq!(
            linger.deadline(at + Duration::from_millis(5)),
            Some(at + Duration::from_millis(5) + max)
        );
        // Quiet windows halve it: 1,250/s still waits, 625/s (under one per
        // millisecond) does not.
        let quiet = at + Duration::from_millis(20);
        assert!(linger.deadline(quiet).is_some(), "1,250/s waits");
        let quieter = quiet + Duration::from_millis(20);
        assert_eq!(linger.deadline(quieter), None);
        // A second without a window replaces the estimate: 2 in 2 s is idle.
        linger.arrived();
        linger.arrived();
        assert_eq!(linger.deadline(quieter + Duration::from_secs(2)), None);
        // And a busy second after it is the estimate at once.
        for _ in 0..3_000 {
            linger.arrived();
        }
        let busy = quieter + Duration::from_secs(4);
        assert_eq!(linger.deadline(busy), Some(busy + max));
        // Turned off: never, whatever the rate.
        let off = Linger::new(Duration::ZERO, start);
        for _ in 0..1_000 {
            off.arrived();
        }
        assert_eq!(off.deadline(at), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lingering_writer_takes_what_arrives_before_its_deadline_and_no_more() {
        let (tx, mut rx) = mpsc::channel(8);
        let (queued, _a) = job("k1", "A");
        tx.try_send(queued).expect("room");
        // Queued: taken at once, deadline or not.
        assert!(next_job(&mut rx, None).await.is_some());
        // Nothing queued and no deadline: no wait.
        assert!(next_job(&mut rx, None).await.is_none());
        let deadline = Instant::now() + Duration::from_millis(2);
        let sender = tx.clone();
        let (soon, _b) = job("k2", "B");
        let (late, _c) = job("k3", "C");
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            let _ = sender.try_send(soon);
            tokio::time::sleep(Duration::from_millis(2)).await;
            let _ = sender.try_send(late);
        });
        let taken = next_job(&mut rx, Some(deadline))
            .await
            .expect("arrived in time");
        assert_eq!(taken.create.key.as_str(), "k2");
        assert!(
            next_job(&mut rx, Some(deadline)).await.is_none(),
            "k3 came after the deadline"
        );
        assert!(Instant::now() >= deadline);
        // The late one is the next batch's.
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(
            next_job(&mut rx, None)
                .await
                .expect("queued")
                .create
                .key
                .as_str(),
            "k3"
        );
        drop(tx);
        assert!(
            next_job(&mut rx, Some(Instant::now() + Duration::from_secs(1)))
                .await
                .is_none()
        );
    }

    #[test]
    fn a_key_in_one_batch_parks_its_other_requests_until_that_batch_ends() {
        let in_flight = InFlight::default();
        let mut a = Held::new(&in_flight);
        let mut b = Held::new(&in_flight);
        let (first, _) = job("k1", "A");
        let (retry, _) = job("k1", "A");
        let (same_batch, _) = job("k1", "A");
        let (other, _) = job("k2", "B");
        assert!(in_flight.hold_or_park(first, &mut a).is_some());
        // Another writer's request with the key: parked, not written.
        assert!(in_flight.hold_or_park(retry, &mut b).is_none());
        // The holder's own duplicate: parked too (one statement cannot both
        // insert and see a key).
        assert!(in_flight.hold_or_park(same_batch, &mut a).is_none());
        assert!(in_flight.hold_or_park(other, &mut b).is_some());
        let parked = a.release();
        let keys: Vec<&str> = parked.iter().map(|j| j.create.key.as_str()).collect();
        assert_eq!(keys, vec!["k1", "k1"]);
        // Released: the key can be held again; k2 is still b's.
        let mut c = Held::new(&in_flight);
        let (again, _) = job("k1", "A");
        let (k2_again, _) = job("k2", "B");
        assert!(in_flight.hold_or_park(again, &mut c).is_some());
        assert!(in_flight.hold_or_park(k2_again, &mut c).is_none());
        assert_eq!(b.release().len(), 1);
    }

    #[test]
    fn a_batch_dropped_without_release_frees_its_keys_and_its_parked_jobs() {
        let in_flight = InFlight::default();
        let mut a = Held::new(&in_flight);
        let (first, _) = job("k1", "A");
        let (parked, mut parked_rx) = job("k1", "A");
        assert!(in_flight.hold_or_park(first, &mut a).is_some());
        let mut b = Held::new(&in_flight);
        assert!(in_flight.hold_or_park(parked, &mut b).is_none());
        drop(a); // the writer panicked mid-batch
        assert!(
            matches!(
                parked_rx.try_recv(),
                Err(oneshot::error::TryRecvError::Closed)
            ),
            "the parked job's client is answered (Dropped), not left waiting"
        );
        assert!(in_flight.map().is_empty());
    }

    #[test]
    fn deferred_jobs_of_a_settled_key_are_answered_as_the_claim_would() {
        let (first, _) = job("k1", "A");
        let (replayed, _) = job("k2", "B");
        let stored = replayed.create.response.clone();
        let (conflicted, _) = job("k3", "C");
        let batch = vec![first, replayed, conflicted];
        let claims = vec![
            KeyClaim::New,
            KeyClaim::Replay(stored.clone()),
            KeyClaim::Mismatch,
        ];
        let (same, mut same_rx) = job("k1", "A");
        let (other, mut other_rx) = job("k1", "Z");
        let (again, mut again_rx) = job("k2", "B");
        let (refused, mut refused_rx) = job("k3", "C");
        let (unknown, mut unknown_rx) = job("k3", "D");
        let (elsewhere, mut elsewhere_rx) = job("k9", "A");
        let mut deferred: VecDeque<Job> = [same, other, again, refused, unknown, elsewhere].into();

        settle_deferred(&mut deferred, &batch, &claims);

        // Same request as the new key's first: its committed response, its order.
        assert_eq!(
            answered(&mut same_rx),
            Some(KeyClaim::Replay(batch[0].create.response.clone()))
        );
        // Another request with that key: refused.
        assert_eq!(answered(&mut other_rx), Some(KeyClaim::Mismatch));
        // A replayed key: the stored response again.
        assert_eq!(answered(&mut again_rx), Some(KeyClaim::Replay(stored)));
        // A key whose claim was a mismatch: the same body is refused too...
        assert_eq!(answered(&mut refused_rx), Some(KeyClaim::Mismatch));
        // ...another body (the stored fingerprint is not known here) and a
        // key not in the batch: still deferred, for the next claim.
        assert_eq!(answered(&mut unknown_rx), None);
        assert_eq!(answered(&mut elsewhere_rx), None);
        let left: Vec<&str> = deferred.iter().map(|j| j.create.key.as_str()).collect();
        assert_eq!(left, vec!["k3", "k9"]);
    }
}
