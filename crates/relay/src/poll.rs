//! `--mode poll`: the outbox's shards are split into `--shard-groups`
//! groups, and every group has a loop of its own in each process
//! (`--shard-depth` of them, one per lock slot); a loop claims a batch of
//! its group's shards under their advisory locks, publishes it and marks it
//! ([`crate::publish`]) in one transaction, then waits for a NOTIFY of one
//! of its shards ([`crate::wake`]) or the poll interval.

use std::sync::Arc;
use std::time::{Duration, Instant};

use effectively::retry::Backoff;
use futures::future::join_all;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::outbox;
use crate::publish::{BatchError, Marks, Publish, Stage, Worker};

impl Worker {
    /// One group slot's loop (`--shard-depth` of them per group of
    /// shards): publish a batch while there is one, then wait for a NOTIFY
    /// or the poll. A batch holds one of the `--workers` permits from its
    /// claim to its commit; the semaphore is fair, so a busy group queues
    /// behind the others between batches instead of starving them.
    pub(crate) async fn run_group(
        self: Arc<Self>,
        shards: Vec<i16>,
        slot: u8,
        poll: Duration,
        mut wake: watch::Receiver<u64>,
        cancel: CancellationToken,
    ) {
        let mut backoff = Backoff::new();
        while !cancel.is_cancelled() {
            // Mark notifications seen *before* the batch: one arriving
            // meanwhile makes `changed()` below return at once.
            wake.borrow_and_update();
            let permit = tokio::select! {
                p = self.permits.acquire() => match p {
                    Ok(p) => p,
                    Err(_) => return, // closed: shutting down
                },
                () = cancel.cancelled() => return,
            };
            self.metrics.relay_shards_in_flight.inc();
            // Not cut short by a shutdown: a batch handed to the producer is
            // awaited and marked, so a clean stop re-publishes nothing.
            let result = self.relay_shards(&shards, slot).await;
            self.metrics.relay_shards_in_flight.dec();
            drop(permit);
            match result {
                // A full batch, or one that held back later events of its
                // keys (claimable now that it is marked): more right away.
                Ok(batch) if batch.more() => backoff.reset(),
                // A partial batch took every row claimable at its claim. A row
                // committed since came with a NOTIFY for its shard, which
                // ends the wait below at once; claiming again right away
                // would mostly find nothing, a transaction each (at 1,000
                // orders/s, one empty claim for every batch: FINDINGS §15).
                // Nothing claimable, or another relay holds the shards: the same.
                Ok(batch) => {
                    if batch.delivered == 0 {
                        self.metrics.relay_empty_claims_total.inc();
                    }
                    backoff.reset();
                    tokio::select! {
                        _ = wake.changed() => {}
                        () = tokio::time::sleep(poll) => {}
                        () = cancel.cancelled() => return,
                    }
                }
                Err(error) => {
                    self.metrics
                        .relay_errors_total
                        .with_label_values(&[error.stage.as_str()])
                        .inc();
                    tracing::warn!(
                        ?shards,
                        slot,
                        stage = error.stage.as_str(),
                        error = %error,
                        retry_in_ms = backoff.next().as_millis() as u64,
                        "relay batch failed; will retry"
                    );
                    if !backoff.wait(&cancel).await {
                        return;
                    }
                }
            }
        }
    }

    /// One transaction: lock the shards' slot, claim (which marks), publish,
    /// await acks, put back what was not acked, commit. Of `shards`, those
    /// whose slot another relay worker holds are left to it.
    ///
    /// Its span names the shards and, once claimed, the batch's row count, so
    /// every log of a row's publish says which batch it was in.
    #[tracing::instrument(level = "info", skip(self), fields(rows = tracing::field::Empty))]
    pub(crate) async fn relay_shards(&self, shards: &[i16], slot: u8) -> Result<Batch, BatchError> {
        let mut tx = self
            .pool
            .begin()
            .await
            .map_err(BatchError::at(Stage::Claim, "begin"))?;
        let locked = outbox::try_lock_shards(&mut tx, shards, slot)
            .await
            .map_err(BatchError::at(Stage::Claim, "lock shard"))?;
        if locked.is_empty() {
            return Ok(Batch::default());
        }
        let outbox::Claim { rows, full } = outbox::claim_shards(&mut tx, &locked, self.batch_size)
            .await
            .map_err(BatchError::at(Stage::Claim, "claim outbox batch"))?;
        if rows.is_empty() {
            tx.commit()
                .await
                .map_err(BatchError::at(Stage::Claim, "commit empty claim"))?;
            return Ok(Batch::default());
        }
        tracing::Span::current().record("rows", rows.len());
        let start = Instant::now();
        let results = join_all(rows.iter().map(|row| self.publish(row))).await;
        let mut delivered = 0;
        let mut undelivered = Vec::new();
        let mut rejected = Vec::new();
        for (row, result) in rows.iter().zip(results) {
            match result {
                Publish::Delivered => delivered += 1,
                Publish::Retry => undelivered.push(row.id),
                Publish::Rejected(error) => rejected.push((row.id, error)),
            }
        }
        self.metrics
            .relay_publish_duration_seconds
            .observe(start.elapsed().as_secs_f64());
        let marks = Marks::Claimed {
            delivered,
            undelivered: &undelivered,
        };
        self.mark_batch(tx, marks, &rejected, self.max_attempts)
            .await?;
        Ok(Batch {
            full,
            delivered,
            held_back: rows.iter().any(|row| row.later),
        })
    }
}

/// What one transaction did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Batch {
    /// A shard gave all its share of `--batch-size` ([`outbox::Claim::full`]).
    pub(crate) full: bool,
    /// Rows the broker acked and the transaction marked published.
    pub(crate) delivered: usize,
    /// A later event of a claimed row's key was pending at the claim.
    pub(crate) held_back: bool,
}

impl Batch {
    /// Whether rows are claimable right after this batch without a NOTIFY:
    /// a shard gave all it could (its share of `--batch-size`), or the claim
    /// held back later events of its keys. Only when something was
    /// published: a batch the broker refused is retried after the wait.
    fn more(self) -> bool {
        self.delivered > 0 && (self.held_back || self.full)
    }
}
