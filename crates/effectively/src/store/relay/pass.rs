//! A relay's passes: one over a group of shards (claim, send each key's
//! rows, settle, commit), every shard's, and the loops of [`Relay::run`].

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::future::join_all;
use futures::stream::{self, StreamExt};
use sqlx::Connection;
use sqlx::postgres::PgListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{MAX_SHARD_DEPTH, Outgoing, Relay, SendError, Sink, Stage, group_woken};
use crate::retry::Backoff;
use crate::store::SHARDS;
use crate::store::source::{Claimed, Sent, Source};

/// Tries the advisory lock of slot `$3` of each shard of `$2` (lock `($1,
/// shard + 16 × slot)`: the class is the source's) for the transaction: the
/// shards it now holds, in the order given. Slot 0's lock is `($1, shard)`.
const LOCK_SHARDS: &str = "SELECT s FROM unnest($2::int2[]) WITH ORDINALITY AS u(s, n) \
                           WHERE pg_try_advisory_xact_lock($1, s + 16 * $3) ORDER BY n";

/// How often [`Relay::run`] expires published rows ([`Source::expire`]).
const EXPIRE_EVERY: Duration = Duration::from_secs(60);

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

impl<S: Sink, T: Source> Relay<S, T> {
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
