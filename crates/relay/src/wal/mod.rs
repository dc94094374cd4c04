//! `relay --mode wal`: the outbox read from PostgreSQL's logical replication
//! stream (the `pgoutput` plugin, publication [`PUBLICATION`]) instead of
//! polled.
//!
//! The poll relay's contract stays: at least once, each key's first
//! publishes in order, a row marked published only after the broker acked
//! it (a restart's re-publishes may land after a later event of their key;
//! the inbox absorbs them). How:
//!
//! 1. The slot is made first (when missing), so every row committed from
//!    then on is in the stream.
//! 2. Rows pending from before it (a first start, a slot dropped after it
//!    was lost) are published by the poll path, shard by shard, until none
//!    of them is left (retried with a backoff while the broker fails or
//!    another relay holds a shard). Only then does the stream start, so
//!    those go first. When the slot was there before (a restart), the rows
//!    committed meanwhile are in the stream too: the stream leaves the ones
//!    the drain published ([`drained`]).
//! 3. The stream's outbox inserts are produced as they arrive, in commit
//!    order, up to `--workers` × `--batch-size` in flight. At most one event
//!    of a key is in flight: the next one waits for that one's ack.
//! 4. Results are settled in stream order. Delivered rows are marked
//!    published in batches, and only after that commit does the slot's
//!    confirmed position move, to the end of the last transaction whose rows
//!    are all settled, seen and marked (a row a mark could not see or did
//!    not change ends the stream instead, confirming nothing past it). A crash before it re-reads the stream from the
//!    confirmed position and re-publishes (the duplicates the inbox absorbs).
//! 5. A broker failure is tried again in place (`publish_in_place`: 50 ms
//!    doubling to 5 s) until the broker takes the row, refuses it, or the
//!    relay stops; the rest of the window goes on meanwhile, and the
//!    confirmed position cannot pass the row until it settles. A key's
//!    later event is never sent before its earlier one settled (point 3),
//!    so the key stays in order.
//! 6. A row that can never be published (not JSON, over the broker's size
//!    limit) is marked failed at once: the stream cannot come back to it.
//!    Like the poll relay, the later events of its key are held back (left
//!    pending), and of no other key; recon reports them.
//!
//! Rows stay marked as the poll relay marks them, so recon's proof, the lag
//! metrics and the poll relay (the recovery from a lost slot) work unchanged.
//!
//! The stream's life (slot, drain, reader, restarts) is this module; what
//! happens to each event read, from its publish to the slot's confirmed
//! position, is [`settle`]; an insert's columns are decoded in [`decode`];
//! the rows the drain published, which the stream does not send again, are
//! [`drained`]; which producer a row goes through, by the stream's rate, is
//! [`pace`]; the slot itself (its name, state and loss) is [`slot`].

mod conninfo;
mod decode;
mod drained;
mod pace;
mod settle;
mod slot;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use effectively::retry::Backoff;
use pg_walstream::{ChangeEvent, LogicalReplicationStream, ReplicationStreamConfig, StreamingMode};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::outbox::SHARDS;
use crate::publish::Worker;
use drained::{DrainStart, Drained};
use settle::{End, Settle};
use slot::lost_slot;
pub use slot::{PUBLICATION, SlotState, default_slot_name, slot_name, slot_state};

/// Prefix of the logical message a heartbeat writes.
const HEARTBEAT_PREFIX: &str = "effectively.relay.heartbeat";

/// Events read ahead of the producer.
const READ_AHEAD: usize = 4096;

/// How often the relay tells the server its confirmed position: by the
/// stream while it reads, and by the reader while the read-ahead is full
/// ([`read`]).
const FEEDBACK_EVERY: Duration = Duration::from_secs(1);

/// What the WAL relay needs besides the poll relay's [`Worker`].
pub(crate) struct WalConfig {
    /// The relay role's database URL, as for the pool.
    pub database_url: String,
    /// The slot: `--wal-slot`, or [`slot_name`]'s default for the database.
    pub slot: String,
    /// Most rows in flight to the broker.
    pub max_in_flight: usize,
    /// Rows marked per statement.
    pub mark_batch: usize,
    /// How often a heartbeat is written while the relay runs.
    pub heartbeat: Duration,
    /// `--busy-rows-per-sec` when there is a busy producer ([`pace`]).
    pub busy_rows_per_sec: Option<u64>,
}

/// A stream that lived this long before it ended starts the backoff over.
const STREAM_HELD: Duration = Duration::from_secs(5);

/// Runs the WAL relay until `cancel` fires or the slot is lost.
pub(crate) async fn run(
    worker: Arc<Worker>,
    config: WalConfig,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let slot = config.slot.as_str();
    tracing::info!(%slot, publication = PUBLICATION, "relay reads the outbox from the WAL");
    let heartbeat = tokio::spawn(heartbeats(
        worker.pool.clone(),
        config.heartbeat,
        cancel.clone(),
    ));
    let mut backoff = Backoff::new();
    let mut waiting = false;
    let result = loop {
        let started = std::time::Instant::now();
        let end = stream_once(&worker, &config, slot, &cancel).await;
        if started.elapsed() >= STREAM_HELD {
            backoff.reset();
        }
        match end {
            Ok(End::Cancelled) => break Ok(()),
            Ok(End::Busy) => {
                if !waiting {
                    tracing::info!(%slot, "another WAL relay streams from the slot; standing by");
                    waiting = true;
                }
                if !backoff.wait(&cancel).await {
                    break Ok(());
                }
            }
            Ok(End::Retry(error)) => {
                worker
                    .metrics
                    .relay_errors_total
                    .with_label_values(&["wal"])
                    .inc();
                tracing::warn!(
                    %slot,
                    error = format!("{error:#}"),
                    retry_in_ms = backoff.next().as_millis() as u64,
                    "WAL stream ended; restarting from the slot's confirmed position"
                );
                if !backoff.wait(&cancel).await {
                    break Ok(());
                }
            }
            Err(fatal) => break Err(fatal),
        }
    };
    heartbeat.abort();
    result
}

/// Writes a transactional logical message every `every`: its commit reaches
/// the stream even when no outbox row does, so the slot's confirmed position
/// follows the server's WAL instead of holding all of it since the last
/// outbox commit.
async fn heartbeats(pool: PgPool, every: Duration, cancel: CancellationToken) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = cancel.cancelled() => return,
        }
        if let Err(error) = sqlx::query("SELECT pg_logical_emit_message(true, $1, ''::text)")
            .bind(HEARTBEAT_PREFIX)
            .execute(&pool)
            .await
        {
            tracing::warn!(%error, "WAL relay heartbeat failed");
        }
    }
}

/// One life of the stream: slot, drain, stream, until cancelled or broken.
/// `Err`: the relay cannot go on (a lost slot, an undecodable row).
async fn stream_once(
    worker: &Arc<Worker>,
    config: &WalConfig,
    slot: &str,
    cancel: &CancellationToken,
) -> anyhow::Result<End> {
    // The database gone for now (a failover, a restart): a stream like any
    // other that ended, tried again; any other error reading the slot ends
    // the relay.
    let state = match slot_state(&worker.pool, slot).await {
        Ok(state) => state,
        Err(error) if pipeline::db::is_unavailable(&error) => {
            return Ok(End::Retry(
                anyhow::Error::new(error).context("read the slot"),
            ));
        }
        Err(error) => return Err(anyhow::Error::new(error).context("read the slot")),
    };
    if let Some(state) = state {
        if state.wal_status == "lost" {
            anyhow::bail!(lost_slot(slot));
        }
        // Another WAL relay streams from it: wait, without draining (its
        // rows would be published twice).
        if state.active {
            return Ok(End::Busy);
        }
    }
    let stream_config = ReplicationStreamConfig::builder(slot, PUBLICATION)
        .with_protocol_version(1)
        .with_streaming_mode(StreamingMode::Off)
        .with_binary(true)
        .with_messages(true)
        .with_feedback_interval(FEEDBACK_EVERY);
    let url = conninfo::replication_url(&config.database_url, &conninfo::Libpq::process())
        .with_context(|| conninfo::redacted(&config.database_url))?;
    let mut stream = match LogicalReplicationStream::new(&url, stream_config).await {
        Ok(stream) => stream,
        Err(error) => {
            return Ok(End::Retry(anyhow::anyhow!(
                "connect for replication: {error}"
            )));
        }
    };
    if let Err(error) = stream.ensure_replication_slot().await {
        return Ok(End::Retry(anyhow::anyhow!(
            "create replication slot {slot}: {error}"
        )));
    }
    // Rows committed before the slot: by the poll path, before the stream.
    // Every one of them has an id at most this: a row this read cannot see
    // commits after the slot, so the stream carries it.
    let before_slot = match last_outbox_id(&worker.pool).await {
        Ok(id) => id,
        Err(error) => {
            return Ok(End::Retry(
                error.context("read the last outbox id before the stream"),
            ));
        }
    };
    let start = match DrainStart::read(&worker.pool).await {
        Ok(start) => start,
        Err(error) => {
            return Ok(End::Retry(
                anyhow::Error::new(error).context("read the outbox before the drain"),
            ));
        }
    };
    let drained = match drain(worker, before_slot, cancel).await {
        Ok(n) => n,
        Err(error) => {
            return Ok(End::Retry(
                error.context("drain the rows pending before the slot"),
            ));
        }
    };
    if cancel.is_cancelled() {
        return Ok(End::Cancelled);
    }
    // The stream reads again the rows it carries that the drain published
    // (the slot was there before): it leaves those.
    let drained = if drained > 0 {
        match Drained::read(&worker.pool, &start, before_slot).await {
            Ok(set) => {
                tracing::info!(
                    rows = drained,
                    left_to_the_drain = set.rows(),
                    "published the rows pending before the stream; the stream leaves those it reads again"
                );
                set
            }
            Err(error) => {
                return Ok(End::Retry(
                    error.context("read the rows the drain published"),
                ));
            }
        }
    } else {
        Drained::default()
    };
    if let Err(error) = stream.start(None).await {
        if let Ok(Some(state)) = slot_state(&worker.pool, slot).await
            && state.wal_status == "lost"
        {
            anyhow::bail!(lost_slot(slot));
        }
        return Ok(End::Retry(anyhow::anyhow!("start replication: {error}")));
    }
    if let Ok(Some(state)) = slot_state(&worker.pool, slot).await {
        tracing::info!(
            %slot,
            confirmed = state.confirmed_flush.as_deref().unwrap_or("none"),
            "streaming from the slot's confirmed position"
        );
    }
    let feedback = stream.shared_lsn_feedback.clone();
    let blocked = blocked_aggregates(&worker.pool)
        .await
        .context("read the aggregates held back by failed rows");
    let blocked = match blocked {
        Ok(b) => b,
        Err(error) => return Ok(End::Retry(error)),
    };

    let (tx, rx) = mpsc::channel(READ_AHEAD);
    let reader_cancel = pg_walstream::CancellationToken::new();
    let reader = tokio::spawn(read(stream, tx, reader_cancel.clone()));
    let mut settle = Settle::new(
        worker.clone(),
        feedback,
        blocked,
        drained,
        config.max_in_flight,
        config.mark_batch,
        config.busy_rows_per_sec,
        cancel.clone(),
    );
    let end = settle.pump(rx, cancel).await;
    reader_cancel.cancel();
    let _ = reader.await;
    end
}

/// Publishes the rows pending from before the slot by the poll path, and
/// returns only once none of them is left (or `cancel` fired): the stream
/// must not send a key's later event before them. A round takes each
/// shard's batches until one delivers nothing; that happens as well when
/// the broker failed or refused every row, or another relay holds the
/// shard, so then the rows pending up to `before_slot` (the last id before
/// the slot, [`last_outbox_id`]) are counted, and another round follows a
/// [`Backoff`] while any is. Rows above it are the stream's, so a steady
/// write load cannot keep the drain going; rows held back by a failed row
/// of their key are never claimable and do not count.
async fn drain(
    worker: &Arc<Worker>,
    before_slot: i64,
    cancel: &CancellationToken,
) -> anyhow::Result<usize> {
    let mut backoff = Backoff::new();
    let mut total = 0;
    loop {
        let delivered = drain_round(worker, cancel).await?;
        total += delivered;
        if cancel.is_cancelled() {
            return Ok(total);
        }
        let left = pending_before(&worker.pool, before_slot)
            .await
            .context("count the rows pending from before the slot")?;
        if left == 0 {
            return Ok(total);
        }
        if delivered > 0 {
            backoff.reset();
        }
        tracing::info!(
            rows = left,
            retry_in_ms = backoff.next().as_millis() as u64,
            "rows pending from before the slot are not published yet; the stream waits for them"
        );
        if !backoff.wait(cancel).await {
            return Ok(total);
        }
    }
}

/// One round of [`drain`]: each shard's batches until one delivers nothing.
async fn drain_round(worker: &Arc<Worker>, cancel: &CancellationToken) -> anyhow::Result<usize> {
    let shards = (0..SHARDS).map(|shard| {
        let worker = worker.clone();
        let cancel = cancel.clone();
        async move {
            let mut total = 0;
            while !cancel.is_cancelled() {
                let permit = worker.permits.acquire().await?;
                let pass = worker.relay.relay_shards(&[shard]).await;
                drop(permit);
                match pass?.published {
                    0 => break,
                    n => total += usize::try_from(n).unwrap_or(usize::MAX),
                }
            }
            anyhow::Ok(total)
        }
    });
    let mut total = 0;
    for n in futures::future::join_all(shards).await {
        total += n?;
    }
    Ok(total)
}

/// The highest outbox id there is (0 when none): read after the slot is
/// made, it bounds the rows committed before it.
async fn last_outbox_id(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT COALESCE(max(id), 0)::int8 FROM orders.outbox")
            .fetch_one(pool)
            .await?,
    )
}

/// Rows up to `last_id` still to publish: pending, not failed, and not held
/// back by a failed row of their key (the claim never takes those).
async fn pending_before(pool: &PgPool, last_id: i64) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM orders.outbox o \
         WHERE o.published_at IS NULL AND o.failed_at IS NULL AND o.id <= $1 \
           AND NOT EXISTS (SELECT 1 FROM orders.outbox f \
                           WHERE f.aggregate_id = o.aggregate_id AND f.id < o.id \
                             AND f.published_at IS NULL AND f.failed_at IS NOT NULL)",
    )
    .bind(last_id)
    .fetch_one(pool)
    .await?)
}

/// Aggregates with a failed row still pending: their later events are held
/// back (left pending), as the poll relay's claim does.
async fn blocked_aggregates(pool: &PgPool) -> anyhow::Result<HashSet<Uuid>> {
    let rows: Vec<Uuid> = sqlx::query_scalar(
        "SELECT DISTINCT aggregate_id FROM orders.outbox \
         WHERE published_at IS NULL AND failed_at IS NOT NULL",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// The reader: the stream's events, in order, into `tx`, until cancelled,
/// an error (sent on), or the receiver gone. `next_event` is not raced
/// against anything (a frame half read would be lost); it is stopped through
/// its token. Stopping sends the last feedback (the confirmed position).
///
/// While the read-ahead is full (the broker fails, and every row in flight
/// is retried in place) the reader does not read, so nothing would answer
/// the server: after `wal_sender_timeout` (1 min by default) it ended the
/// stream, and the restart sent the whole unconfirmed window again
/// (FINDINGS.md §22). So while it waits for room it sends the confirmed
/// position every [`FEEDBACK_EVERY`], which keeps the connection alive.
async fn read(
    mut stream: LogicalReplicationStream,
    tx: mpsc::Sender<Result<ChangeEvent, String>>,
    cancel: pg_walstream::CancellationToken,
) {
    'events: loop {
        match stream.next_event(&cancel).await {
            Ok(event) => {
                let event = match tx.try_send(Ok(event)) {
                    Ok(()) => continue,
                    Err(mpsc::error::TrySendError::Closed(_)) => break,
                    Err(mpsc::error::TrySendError::Full(event)) => event,
                };
                let room = tx.reserve();
                tokio::pin!(room);
                let mut feedback = tokio::time::interval_at(
                    tokio::time::Instant::now() + FEEDBACK_EVERY,
                    FEEDBACK_EVERY,
                );
                loop {
                    tokio::select! {
                        biased;
                        permit = &mut room => match permit {
                            Ok(permit) => {
                                permit.send(event);
                                break;
                            }
                            Err(_) => break 'events,
                        },
                        _ = feedback.tick() => {
                            if let Err(error) = stream.send_feedback().await {
                                tracing::debug!(%error, "feedback while the read-ahead is full");
                            }
                        }
                    }
                }
            }
            Err(pg_walstream::ReplicationError::Cancelled(_)) => break,
            Err(error) => {
                let _ = tx.send(Err(error.to_string())).await;
                break;
            }
        }
    }
    if let Err(error) = stream.stop().await {
        tracing::debug!(%error, "stop the replication stream");
    }
}
