//! The relay as a library value: an outbox's pending rows published to a
//! [`Sink`] (Kafka, signed webhooks, or the user's own), at least once, each
//! key's events in order, with any number of relays at once. The outbox is
//! a [`Source`]: the library's own ([`OutboxSource`], what [`Relay::new`]
//! relays) or a table the user already has ([`Relay::over`]).
//!
//! How a pass over a group of shards goes ([`Relay::relay_shards`]; [`Relay::run`]
//! has a loop of them per group), in one transaction:
//!
//! 1. each shard's transaction-level advisory lock is tried: a shard
//!    another relay holds is skipped (that one publishes it);
//! 2. the source claims each locked shard's oldest pending rows (its share
//!    of a batch); the library's outbox leaves out the rows of a key whose
//!    earlier row failed for good;
//! 3. each key's rows are sent in id order, the keys side by side: one
//!    after the other by default, all in flight at once through a sink that
//!    keeps their order ([`Sink::send_in_order`]; the [`super::KafkaSink`]
//!    does); a row whose send must be tried again ([`SendError::Retry`])
//!    stops its key for this pass; one the sink refuses for itself
//!    ([`SendError::Reject`]) is marked failed by the library's outbox,
//!    and its key's later rows wait (a person looks at it);
//! 4. the source settles what the sends did ([`Source::settle`]: the
//!    library's outbox marks the rows sent published, the refused ones
//!    failed), and the transaction commits, which frees the shards.
//!
//! A crash (or a lost connection) before the commit leaves the rows pending
//! and the locks free: the next pass sends them again, so a consumer sees a
//! row at least once and must deduplicate (the [`super::Inbox`]). A shard's
//! lock is the fence: while one relay's pass holds it no other relay can
//! send the shard's rows, and a relay whose session the server ended cannot
//! mark.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::future::join_all;
use futures::stream::{self, StreamExt};
use sqlx::postgres::PgListener;
use sqlx::{Connection, PgPool};
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::source::{Claimed, OutboxSource, Sent, Source};
use super::{Effectively, SHARDS};
use crate::retry::Backoff;

/// An outbox row as a [`Sink`] gets it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Outgoing {
    /// The row's id (its place in the publish order).
    pub id: i64,
    /// The id every consumer deduplicates it by.
    pub msg_id: Uuid,
    /// Where it goes: a topic, a webhook destination's name.
    pub destination: String,
    /// Its key (a Kafka message key).
    pub key: String,
    /// Its type.
    pub event_type: String,
    /// Its payload.
    pub payload: Vec<u8>,
    /// The payload's media type.
    pub content_type: String,
    /// Its headers, in order.
    #[sqlx(json)]
    pub headers: Vec<(String, String)>,
    /// When its transaction wrote it.
    pub created_at: DateTime<Utc>,
}

/// Why a send did not deliver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// Not now (the broker or the receiver is away, a timeout): the row
    /// stays pending and is sent again.
    #[error("try again: {0}")]
    Retry(String),
    /// Never: the row itself is refused (too large, a destination that does
    /// not exist, a receiver's 4xx). It is marked failed with the reason,
    /// and its key's later rows are held back.
    #[error("refused: {0}")]
    Reject(String),
}

/// Where a relay sends rows. A send returns once the destination has the
/// row durably (a Kafka ack with `acks=all`, a webhook's 2xx); the relay
/// then marks it published.
pub trait Sink: Send + Sync + 'static {
    /// Sends one row.
    fn send(&self, row: &Outgoing) -> impl Future<Output = Result<(), SendError>> + Send;

    /// Sends one key's rows of a pass, in id order, and answers for each
    /// row it sent, in that order; the rows after its answers were not
    /// sent and stay pending.
    ///
    /// By default one row at a time, each once the last was delivered,
    /// stopping at the first that was not: the key's rows reach the
    /// destination in order whatever fails. A sink that keeps the order of
    /// a key's sends while several are in flight (Kafka's idempotent
    /// producer: a key's partition, a sequence number per partition, the
    /// sends retried in order) may put them all in flight at once, which
    /// takes one round trip for the key instead of one per row. Then a row
    /// after one that failed may have been delivered anyway: the sink
    /// answers for it too, and the relay marks it published (counted in
    /// [`RelayStats::reordered`]).
    fn send_in_order(
        &self,
        rows: &[&Outgoing],
    ) -> impl Future<Output = Vec<Result<(), SendError>>> + Send {
        one_at_a_time(self, rows)
    }
}

/// [`Sink::send_in_order`]'s default: each row once the last was
/// delivered, stopping at the first that was not.
pub(crate) async fn one_at_a_time<S: Sink + ?Sized>(
    sink: &S,
    rows: &[&Outgoing],
) -> Vec<Result<(), SendError>> {
    let mut answers = Vec::with_capacity(rows.len());
    for row in rows {
        let answer = sink.send(row).await;
        let stop = answer.is_err();
        answers.push(answer);
        if stop {
            break;
        }
    }
    answers
}

/// A relay's counts since it was made (export them as you export metrics).
#[derive(Debug, Default)]
pub struct RelayStats {
    /// Rows sent and marked published.
    pub published: AtomicU64,
    /// Rows refused and marked failed.
    pub failed: AtomicU64,
    /// Sends to be tried again (the rows stayed pending).
    pub retried: AtomicU64,
    /// Shard passes skipped because another relay held the shard.
    pub busy: AtomicU64,
    /// Passes whose transaction failed (the database): their rows stay
    /// pending.
    pub errors: AtomicU64,
    /// Rows delivered after an earlier row of their key failed in the same
    /// pass (possible only with a sink that has a key's rows in flight
    /// together, [`Sink::send_in_order`]): published ahead of that row.
    pub reordered: AtomicU64,
    /// Published rows expired ([`Relay::keep_published`]).
    pub expired: AtomicU64,
    /// Passes that claimed rows and committed.
    pub passes: AtomicU64,
    /// Time those passes spent getting a connection, locking their shards
    /// and claiming, in microseconds (divide by `passes` for a pass's
    /// mean).
    pub claim_micros: AtomicU64,
    /// Time those passes spent sending (the sink's answers), in
    /// microseconds.
    pub send_micros: AtomicU64,
    /// Time those passes spent marking their rows and committing, in
    /// microseconds.
    pub mark_micros: AtomicU64,
}

/// Rows a pass reads by default ([`Relay::batch_size`]).
const DEFAULT_BATCH_SIZE: i64 = 2000;

/// Tries the advisory lock of slot `$3` of each shard of `$2` (lock `($1,
/// shard + 16 × slot)`: the class is the source's) for the transaction: the
/// shards it now holds, in the order given. Slot 0's lock is `($1, shard)`.
const LOCK_SHARDS: &str = "SELECT s FROM unnest($2::int2[]) WITH ORDINALITY AS u(s, n) \
                           WHERE pg_try_advisory_xact_lock($1, s + 16 * $3) ORDER BY n";

/// How often [`Relay::run`] expires published rows ([`Source::expire`]).
const EXPIRE_EVERY: Duration = Duration::from_secs(60);

/// The most passes one shard can have in flight at once
/// ([`Relay::shard_depth`]).
pub const MAX_SHARD_DEPTH: u8 = 4;

/// What one pass over a shard did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pass {
    /// Rows marked published.
    pub published: u64,
    /// Rows marked failed.
    pub failed: u64,
    /// Rows left pending to be tried again (their sends failed, or an
    /// earlier row of their key's did).
    pub retried: u64,
    /// Another relay held the shard: nothing was read.
    pub busy: bool,
    /// More rows may be claimable at once ([`Claimed::more`]).
    pub more: bool,
}

impl Pass {
    /// Counts `other` into this sum of passes (`more` is left as it is: a
    /// sum is not a batch).
    fn add(&mut self, other: &Pass) {
        self.published += other.published;
        self.failed += other.failed;
        self.retried += other.retried;
        self.busy |= other.busy;
    }
}

/// The stage of a pass whose transaction failed ([`RelayHooks::pass_failed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Beginning, locking the shards, claiming their rows.
    Claim,
    /// Settling what the sends did ([`Source::settle`]).
    Settle,
    /// Committing.
    Commit,
}

impl Stage {
    /// Its name: `claim`, `settle`, `commit`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Settle => "settle",
            Self::Commit => "commit",
        }
    }
}

/// What a relay tells its user as a pass goes (metrics, logs, crash points
/// for tests): every method does nothing by default. Called on the pass's
/// task: keep them short.
pub trait RelayHooks: Send + Sync + 'static {
    /// A pass begins (it holds a connection from here to its end).
    fn pass_begins(&self) {}

    /// Every send of a pass was answered (in `took`) and its settle is
    /// about to be written: a crash from here to the commit sends the
    /// delivered rows again.
    fn answered(&self, sent: &Sent, took: Duration) {
        let _ = (sent, took);
    }

    /// A pass ended: committed (or found nothing, or every shard busy).
    fn pass_ended(&self, pass: &Pass) {
        let _ = pass;
    }

    /// A pass's transaction failed at `stage`: its rows stay pending.
    fn pass_failed(&self, stage: Stage, error: &sqlx::Error) {
        let _ = (stage, error);
    }

    /// The connection that listens for the source's `NOTIFY` was lost (or
    /// could not be made): the loops poll until it is back.
    fn listen_lost(&self, error: &sqlx::Error) {
        let _ = error;
    }
}

/// Whether group `group` of `groups` (shard `s` in group `s % groups`)
/// holds a shard of `mask` (bit `s`: shard `s`).
fn group_woken(mask: u16, group: usize, groups: usize) -> bool {
    (0..SHARDS).any(|s| mask & (1 << s) != 0 && usize::from(s) % groups.max(1) == group)
}

/// The hooks of a relay given none.
struct NoHooks;

impl RelayHooks for NoHooks {}

/// The relay of a [`Source`] (by default the library's outbox,
/// [`OutboxSource`]) into a [`Sink`]. Cheap to share (`Arc` it); run it
/// with [`Relay::run`], or drive passes yourself with
/// [`Relay::relay_shard`] / [`Relay::relay_all`].
pub struct Relay<S, T = OutboxSource> {
    pool: PgPool,
    sink: S,
    source: T,
    hooks: Arc<dyn RelayHooks>,
    lock_class: i32,
    batch_size: i64,
    keys_at_once: Option<usize>,
    shards_at_once: usize,
    shard_groups: u8,
    shard_depth: u8,
    passes_at_once: Option<Arc<Semaphore>>,
    poll_every: Duration,
    stats: Arc<RelayStats>,
}

impl<S, T: Source> std::fmt::Debug for Relay<S, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("source", &self.source.name())
            .field("batch_size", &self.batch_size)
            .finish_non_exhaustive()
    }
}

impl<S: Sink> Relay<S> {
    /// A relay of `fx`'s outbox into `sink`: batches of 2,000 rows, the 16
    /// shards in 2 groups passed over side by side, every key of a batch
    /// sent at once, a look every second when no `NOTIFY` came.
    pub fn new(fx: &Effectively, sink: S) -> Self {
        Relay::over(fx.pool().clone(), OutboxSource::new(fx), sink)
    }

    /// How long [`Relay::run`] keeps a published row (counted from when it
    /// was written) before it deletes it, once a minute, in batches
    /// ([`Outbox::expire`](super::Outbox::expire)); `None` keeps every row
    /// (the user expires them). Default:
    /// [`DEFAULT_KEEP_PUBLISHED`](super::DEFAULT_KEEP_PUBLISHED).
    ///
    /// `Some(Duration::ZERO)` keeps none: a pass deletes the rows it
    /// delivered instead of marking them, in the same transaction: a
    /// pass's mark took a third to a half as long (FINDINGS.md §26).
    /// The outbox then holds no record of what was sent, and a msg_id the
    /// caller supplies may be enqueued again once its row is gone (the
    /// consumer's inbox still takes the second copy as a duplicate while
    /// it remembers the first).
    pub fn keep_published(self, keep: Option<Duration>) -> Self {
        Self {
            source: self.source.keep_published(keep),
            ..self
        }
    }
}

impl<S: Sink, T: Source> Relay<S, T> {
    /// A relay of `source`'s rows (on `pool`) into `sink`, with the
    /// defaults of [`Relay::new`].
    pub fn over(pool: PgPool, source: T, sink: S) -> Self {
        // The advisory lock of shard s is (class, s); the class is the
        // source's, so two sources' relays never meet.
        let h = blake3::hash(format!("effectively.relay:{}", source.name()).as_bytes());
        let b = h.as_bytes();
        Self {
            pool,
            sink,
            source,
            hooks: Arc::new(NoHooks),
            lock_class: i32::from_be_bytes([b[0], b[1], b[2], b[3]]),
            batch_size: DEFAULT_BATCH_SIZE,
            keys_at_once: None,
            shards_at_once: 4,
            shard_groups: 2,
            shard_depth: 1,
            passes_at_once: None,
            poll_every: Duration::from_secs(1),
            stats: Arc::default(),
        }
    }

    /// Rows read per pass (at least 1; default 2,000), the pass's shards
    /// an equal share each. A pass's sends take about one round trip to
    /// the destination whatever its size, so bigger batches drain faster,
    /// until the database's work per row (claim and mark) bounds the pass
    /// (FINDINGS.md §26: 2,000 drained 1.2–2.2× as fast as 500 into Kafka,
    /// 8,000 no faster). A relay killed mid-pass sends its batch again.
    pub fn batch_size(self, rows: u32) -> Self {
        Self {
            batch_size: i64::from(rows.max(1)),
            ..self
        }
    }

    /// Keys of a batch sent side by side (at least 1); each key's rows go
    /// as [`Sink::send_in_order`] sends them (one after the other, or all in
    /// flight through a sink that keeps their order). Default: every key
    /// of the batch, as a Kafka producer wants; bound it for a sink whose
    /// destination takes only so many requests at once.
    pub fn keys_at_once(self, keys: usize) -> Self {
        Self {
            keys_at_once: Some(keys.max(1)),
            ..self
        }
    }

    /// Shards passed over side by side by [`Relay::relay_all`] (1 to 16);
    /// each holds a connection for its pass. Default 4.
    pub fn shards_at_once(self, shards: usize) -> Self {
        Self {
            shards_at_once: shards.clamp(1, usize::from(SHARDS)),
            ..self
        }
    }

    /// Groups of shards [`Relay::run`] passes over side by side (1 to 16;
    /// shard `s` is in group `s % groups`), each pass of a group one
    /// transaction over its shards, holding one connection. Default 2.
    pub fn shard_groups(self, groups: u8) -> Self {
        Self {
            shard_groups: groups.clamp(1, SHARDS as u8),
            ..self
        }
    }

    /// Passes each group of [`Relay::run`] has in flight at once (1 to
    /// [`MAX_SHARD_DEPTH`]), each under a lock slot of its own, so that one
    /// pass claims and settles while another waits for its sends. Only for
    /// a source whose passes may overlap
    /// ([`Source::overlapping_passes`]); 1 for any other. Default 1.
    pub fn shard_depth(self, depth: u8) -> Self {
        let depth = if self.source.overlapping_passes() {
            depth.clamp(1, MAX_SHARD_DEPTH)
        } else {
            1
        };
        Self {
            shard_depth: depth,
            ..self
        }
    }

    /// The most passes [`Relay::run`] has in flight at once, over every
    /// group (at least 1): each holds a connection. Default: one per group
    /// and depth slot.
    pub fn passes_at_once(self, passes: usize) -> Self {
        Self {
            passes_at_once: Some(Arc::new(Semaphore::new(passes.max(1)))),
            ..self
        }
    }

    /// How long [`Relay::run`] waits for a `NOTIFY` before it looks anyway.
    pub fn poll_every(self, every: Duration) -> Self {
        Self {
            poll_every: every,
            ..self
        }
    }

    /// What it tells as its passes go ([`RelayHooks`]).
    pub fn hooks(self, hooks: Arc<dyn RelayHooks>) -> Self {
        Self { hooks, ..self }
    }

    /// Its counts.
    pub fn stats(&self) -> Arc<RelayStats> {
        self.stats.clone()
    }

    /// Its sink.
    pub fn sink(&self) -> &S {
        &self.sink
    }

    /// Its source.
    pub fn source(&self) -> &T {
        &self.source
    }

    /// One pass over shard `shard` (0..16): [`Relay::relay_shards`] of it
    /// alone.
    pub async fn relay_shard(&self, shard: i16) -> Result<Pass, sqlx::Error> {
        self.relay_shards(&[shard]).await
    }

    /// One pass over `shards` (each 0..16) in one transaction: the shards
    /// another relay holds are left to it; of the others, a batch claimed
    /// (each shard an equal share of [`Relay::batch_size`]), sent, settled
    /// and committed (the module's doc says how). `busy` when every shard
    /// was held.
    pub async fn relay_shards(&self, shards: &[i16]) -> Result<Pass, sqlx::Error> {
        self.relay_slot(shards, 0).await
    }

    /// [`Relay::relay_shards`] under lock slot `slot`.
    async fn relay_slot(&self, shards: &[i16], slot: u8) -> Result<Pass, sqlx::Error> {
        self.hooks.pass_begins();
        let result = self.pass(shards, slot).await;
        match &result {
            Ok(pass) => {
                self.stats
                    .published
                    .fetch_add(pass.published, Ordering::Relaxed);
                self.stats.failed.fetch_add(pass.failed, Ordering::Relaxed);
                self.stats
                    .retried
                    .fetch_add(pass.retried, Ordering::Relaxed);
                if pass.busy {
                    self.stats.busy.fetch_add(1, Ordering::Relaxed);
                }
                self.hooks.pass_ended(pass);
            }
            Err((stage, error)) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                self.hooks.pass_failed(*stage, error);
            }
        }
        result.map_err(|(_, error)| error)
    }

    async fn pass(&self, shards: &[i16], slot: u8) -> Result<Pass, (Stage, sqlx::Error)> {
        let at = |stage: Stage| move |error: sqlx::Error| (stage, error);
        let started = Instant::now();
        let mut conn = self.pool.acquire().await.map_err(at(Stage::Claim))?;
        let mut tx = conn.begin().await.map_err(at(Stage::Claim))?;
        let locked: Vec<i16> = sqlx::query_scalar(LOCK_SHARDS)
            .bind(self.lock_class)
            .bind(shards)
            .bind(i16::from(slot.min(MAX_SHARD_DEPTH - 1)))
            .fetch_all(&mut *tx)
            .await
            .map_err(at(Stage::Claim))?;
        if locked.is_empty() {
            return Ok(Pass {
                busy: true,
                ..Pass::default()
            });
        }
        let share = (self.batch_size / locked.len() as i64).max(1);
        let Claimed { rows, more } = self
            .source
            .claim(&mut tx, &locked, share)
            .await
            .map_err(at(Stage::Claim))?;
        if rows.is_empty() {
            tx.commit().await.map_err(at(Stage::Commit))?;
            return Ok(Pass::default());
        }
        // Each key's rows in id order (the claim's order), as indices into
        // `rows`: the stream's items hold no borrow, so the pass's future
        // is `Send` and a caller can spawn `run`.
        let mut by_key: Vec<Vec<usize>> = Vec::new();
        let mut slot_of: HashMap<&str, usize> = HashMap::new();
        for (at, row) in rows.iter().enumerate() {
            let i = *slot_of.entry(row.key.as_str()).or_insert_with(|| {
                by_key.push(Vec::new());
                by_key.len() - 1
            });
            by_key[i].push(at);
        }
        let claimed = Instant::now();
        let rows = &rows;
        let outcomes: Vec<KeyOutcome> = stream::iter(by_key)
            .map(|key_rows| self.send_key(rows, key_rows))
            .buffer_unordered(self.keys_at_once.unwrap_or(usize::MAX))
            .collect()
            .await;
        let sent_at = Instant::now();
        let mut sent = Sent::default();
        for o in outcomes {
            sent.published.extend(o.published);
            sent.refused.extend(o.failed);
            sent.retried.extend(o.left);
        }
        self.hooks.answered(&sent, sent_at - claimed);
        let settled = self
            .source
            .settle(&mut tx, &sent)
            .await
            .map_err(at(Stage::Settle))?;
        tx.commit().await.map_err(at(Stage::Commit))?;
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        let stats = &self.stats;
        stats.passes.fetch_add(1, Ordering::Relaxed);
        stats
            .claim_micros
            .fetch_add(micros(claimed - started), Ordering::Relaxed);
        stats
            .send_micros
            .fetch_add(micros(sent_at - claimed), Ordering::Relaxed);
        stats
            .mark_micros
            .fetch_add(micros(sent_at.elapsed()), Ordering::Relaxed);
        Ok(Pass {
            published: settled.published,
            failed: settled.failed,
            retried: sent.retried.len() as u64,
            busy: false,
            more,
        })
    }

    /// Sends one key's rows ([`Sink::send_in_order`]) and sorts the
    /// answers: delivered, refused, left pending.
    async fn send_key(&self, rows: &[Outgoing], key_rows: Vec<usize>) -> KeyOutcome {
        let rows: Vec<&Outgoing> = key_rows.into_iter().map(|at| &rows[at]).collect();
        let answers = self.sink.send_in_order(&rows).await;
        let mut outcome = KeyOutcome::default();
        let mut broken = false;
        let mut answered = 0;
        for (row, answer) in rows.iter().zip(answers) {
            answered += 1;
            match answer {
                Ok(()) => {
                    if broken {
                        self.stats.reordered.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, key = %row.key, "delivered after an earlier row of its key failed: published ahead of it");
                    }
                    outcome.published.push(row.id);
                }
                Err(SendError::Reject(why)) => {
                    tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, destination = %row.destination, %why, "the sink refused the row; it is marked failed and its key's later rows wait");
                    outcome.failed.push((row.id, why));
                    broken = true;
                }
                Err(SendError::Retry(why)) => {
                    tracing::debug!(outbox_id = row.id, msg_id = %row.msg_id, %why, "send failed; the row stays pending");
                    outcome.left.push(row.id);
                    broken = true;
                }
            }
        }
        // The rows after the sink's last answer were not sent.
        outcome
            .left
            .extend(rows.iter().skip(answered).map(|row| row.id));
        outcome
    }

    /// Passes over every shard, `shards_at_once` side by side, each shard
    /// again while its passes may have more and all went, until none has
    /// more. Returns the sum of the passes.
    pub async fn relay_all(&self) -> Result<Pass, sqlx::Error> {
        let passes: Vec<Result<Pass, sqlx::Error>> = stream::iter(0..SHARDS as i16)
            .map(|shard| async move {
                let mut sum = Pass::default();
                loop {
                    let pass = self.relay_shard(shard).await?;
                    sum.add(&pass);
                    if !pass.more || pass.retried > 0 || pass.busy {
                        return Ok(sum);
                    }
                }
            })
            .buffer_unordered(self.shards_at_once)
            .collect()
            .await;
        let mut sum = Pass::default();
        for pass in passes {
            let pass = pass?;
            sum.add(&pass);
        }
        Ok(sum)
    }

    /// Relays until `cancel` fires: each group of shards
    /// ([`Relay::shard_groups`]) has a loop of passes per depth slot
    /// ([`Relay::shard_depth`]); a pass that delivered something and may
    /// have more ([`Pass::more`]) is followed by another at once; one that
    /// delivered nothing and must try again, or whose transaction failed,
    /// by a backoff (50 ms doubling to 5 s); any other by a wait for a
    /// `NOTIFY` of the source's channel naming one of the group's shards
    /// (a commit that wrote rows) or [`Relay::poll_every`] (a `NOTIFY` is
    /// lost with a connection). Published rows no longer kept are deleted
    /// once a minute ([`Source::expire`]). Returns once the passes in
    /// progress have committed.
    pub async fn run(&self, cancel: CancellationToken) {
        let groups = usize::from(self.shard_groups);
        let wakes: Vec<watch::Sender<u64>> = (0..groups).map(|_| watch::channel(0).0).collect();
        let loops = (0..groups).flat_map(|g| {
            let shards: Vec<i16> = (0..SHARDS as i16)
                .filter(|s| *s as usize % groups == g)
                .collect();
            let wake = &wakes[g];
            let cancel = &cancel;
            (0..self.shard_depth)
                .map(move |slot| self.run_group(shards.clone(), slot, wake.subscribe(), cancel))
        });
        futures::join!(join_all(loops), self.listen(&wakes, &cancel));
    }

    /// One group's loop of passes in lock slot `slot` ([`Relay::run`]).
    async fn run_group(
        &self,
        shards: Vec<i16>,
        slot: u8,
        mut woken: watch::Receiver<u64>,
        cancel: &CancellationToken,
    ) {
        let mut backoff = Backoff::new();
        while !cancel.is_cancelled() {
            // Seen before the pass: a NOTIFY meanwhile ends the wait below.
            woken.borrow_and_update();
            let permit = match &self.passes_at_once {
                Some(passes) => tokio::select! {
                    p = passes.clone().acquire_owned() => p.ok(),
                    () = cancel.cancelled() => return,
                },
                None => None,
            };
            // Not cut short by a shutdown: a pass's sends are awaited and
            // settled, so a clean stop sends nothing twice.
            let result = self.relay_slot(&shards, slot).await;
            drop(permit);
            match result {
                Ok(pass) if pass.published > 0 && pass.more => backoff.reset(),
                Ok(pass) if pass.retried > 0 && pass.published == 0 => {
                    if !backoff.wait(cancel).await {
                        return;
                    }
                }
                Ok(_) => {
                    backoff.reset();
                    tokio::select! {
                        _ = woken.changed() => {}
                        () = tokio::time::sleep(self.poll_every) => {}
                        () = cancel.cancelled() => return,
                    }
                }
                Err(error) => {
                    tracing::warn!(?shards, slot, %error, "relay pass failed; its rows stay pending");
                    if !backoff.wait(cancel).await {
                        return;
                    }
                }
            }
        }
    }

    /// Listens for the source's `NOTIFY` and wakes the loops of the shards
    /// it names; expires published rows once a minute. A lost connection
    /// comes back with a backoff; the loops poll meanwhile.
    async fn listen(&self, wakes: &[watch::Sender<u64>], cancel: &CancellationToken) {
        let wake = |mask: u16| {
            for (g, tx) in wakes.iter().enumerate() {
                if group_woken(mask, g, wakes.len()) {
                    tx.send_modify(|n| *n = n.wrapping_add(1));
                }
            }
        };
        let mut listener: Option<PgListener> = None;
        let mut expired_at: Option<tokio::time::Instant> = None;
        let mut backoff = Backoff::new();
        while !cancel.is_cancelled() {
            if expired_at.is_none_or(|at| at.elapsed() >= EXPIRE_EVERY) {
                expired_at = Some(tokio::time::Instant::now());
                match self.source.expire(&self.pool).await {
                    Ok(n) => {
                        self.stats.expired.fetch_add(n, Ordering::Relaxed);
                    }
                    Err(error) => {
                        tracing::warn!(%error, "expire published rows; next minute again")
                    }
                }
            }
            let Some(l) = listener.as_mut() else {
                let connected = match PgListener::connect_with(&self.pool).await {
                    Ok(mut l) => l.listen(self.source.channel()).await.map(|()| l),
                    Err(error) => Err(error),
                };
                match connected {
                    Ok(l) => {
                        listener = Some(l);
                        backoff.reset();
                        // Rows committed while nobody listened.
                        wake(u16::MAX);
                    }
                    Err(error) => {
                        tracing::warn!(%error, "listen for the outbox's NOTIFY; polling meanwhile");
                        self.hooks.listen_lost(&error);
                        if !backoff.wait(cancel).await {
                            return;
                        }
                    }
                }
                continue;
            };
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(EXPIRE_EVERY) => {}
                note = l.try_recv() => match note {
                    Ok(Some(note)) => wake(self.source.shards_woken(note.payload())),
                    Ok(None) => {
                        // Lost; it reconnects on the next call. A NOTIFY
                        // sent meanwhile is lost with it: every loop looks.
                        let lost = sqlx::Error::Io(std::io::Error::new(
                            std::io::ErrorKind::ConnectionAborted,
                            "the LISTEN connection was lost",
                        ));
                        tracing::warn!(error = %lost, "the outbox's NOTIFY connection was lost; reconnecting");
                        self.hooks.listen_lost(&lost);
                        wake(u16::MAX);
                    }
                    Err(error) => {
                        tracing::warn!(%error, "the outbox's NOTIFY connection was lost; reconnecting");
                        self.hooks.listen_lost(&error);
                        listener = None;
                    }
                },
            }
        }
    }
}

/// What sending one key's rows did.
#[derive(Default)]
struct KeyOutcome {
    published: Vec<i64>,
    failed: Vec<(i64, String)>,
    left: Vec<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notify_wakes_the_groups_of_the_shards_it_names_and_no_other() {
        assert!(group_woken(1 << 3, 3, 16));
        assert!(!group_woken(1 << 3, 5, 16));
        assert!(
            group_woken(1 << 15, 15, 16),
            "the last shard's bit is its own"
        );
        // Four groups: group 1 holds shards 1, 5, 9, 13.
        assert!(group_woken(1 << 13, 1, 4));
        assert!(!group_woken(1 << 13, 2, 4));
        assert!(group_woken(1 << 14, 2, 4));
        for g in 0..4 {
            assert!(group_woken(u16::MAX, g, 4), "every shard wakes every group");
            assert!(!group_woken(0, g, 4));
        }
        assert!(group_woken(1 << 7, 0, 1), "one group holds every shard");
    }
}
