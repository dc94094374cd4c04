//! `relay --mode wal`: the outbox read from PostgreSQL's logical replication
//! stream (the `pgoutput` plugin, publication [`PUBLICATION`]) instead of
//! polled.
//!
//! The poll relay's contract stays: at least once, each key's events in
//! order, a row marked published only after the broker acked it. How:
//!
//! 1. The slot is made first (when missing), so every row committed from
//!    then on is in the stream.
//! 2. Rows pending from before it (a first start, a slot dropped after it
//!    was lost) are published by the poll path, shard by shard, until none is
//!    claimable. Only then does the stream start, so those go first.
//! 3. The stream's outbox inserts are produced as they arrive, in commit
//!    order, up to `--workers` × `--batch-size` in flight. At most one event
//!    of a key is in flight: the next one waits for that one's ack.
//! 4. Results are settled in stream order. Delivered rows are marked
//!    published in batches, and only after that commit does the slot's
//!    confirmed position move, to the end of the last transaction whose rows
//!    are all settled. A crash before it re-reads the stream from the
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

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use effectively::retry::Backoff;
use futures::future::{BoxFuture, FutureExt};
use futures::stream::{FuturesOrdered, StreamExt};
use pg_walstream::{
    ChangeEvent, ColumnValue, EventType, LogicalReplicationStream, ReplicationStreamConfig,
    RowData, SharedLsnFeedback, StreamingMode, format_lsn, parse_lsn,
};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::outbox::{PendingRow, SHARDS};
use crate::publish::{Publish, Worker};

/// The publication the WAL relay reads: inserts into `orders.outbox` only
/// (migration `…_wal_relay.sql`).
pub const PUBLICATION: &str = "effectively_outbox";

/// Prefix of the logical message a heartbeat writes.
const HEARTBEAT_PREFIX: &str = "effectively.relay.heartbeat";

/// Events read ahead of the producer.
const READ_AHEAD: usize = 4096;

/// How often the relay tells the server its confirmed position: by the
/// stream while it reads, and by the reader while the read-ahead is full
/// ([`read`]).
const FEEDBACK_EVERY: Duration = Duration::from_secs(1);

/// How often the table is compared with the stream ([`Probe`]).
const GAP_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Pending rows a [`Probe`] follows.
const PROBE_ROWS: i64 = 100;

/// Settled rows are marked at least this often.
const MARK_EVERY: Duration = Duration::from_millis(50);

/// How long a mark waits for rows the stream delivered to become visible
/// ([`wait_visible`]) before it ends the stream.
const VISIBLE_WITHIN: Duration = Duration::from_secs(10);

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
}

/// How a stream's life ended.
enum End {
    /// `cancel` fired; everything settled is marked and confirmed.
    Cancelled,
    /// Worth another try after a backoff (the broker, the connection).
    Retry(anyhow::Error),
    /// Another WAL relay streams from the slot: try again later.
    Busy,
}

/// A stream that lived this long before it ended starts the backoff over.
const STREAM_HELD: Duration = Duration::from_secs(5);

/// The slot's name: `--wal-slot`, or `effectively_outbox_<database>` (a
/// slot belongs to one database, its name to the whole server).
pub async fn slot_name(pool: &PgPool, configured: Option<&str>) -> anyhow::Result<String> {
    if let Some(slot) = configured {
        return Ok(slot.to_owned());
    }
    let db: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(pool)
        .await
        .context("read the database's name")?;
    Ok(default_slot_name(&db))
}

/// `effectively_outbox_<database>`, with what a slot name cannot hold
/// (anything but a-z, 0-9 and `_`) replaced by `_`, cut to 63 bytes.
pub fn default_slot_name(database: &str) -> String {
    let mut name: String = format!("{PUBLICATION}_{database}")
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    name.truncate(63);
    name
}

/// A replication slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct SlotState {
    /// `reserved`, `extended`, `unreserved` or `lost` (invalidated).
    pub wal_status: String,
    /// The WAL it holds back from removal, in bytes.
    pub retained_bytes: i64,
    /// Whether a replication connection streams from it now.
    pub active: bool,
    /// Where a stream from it starts: everything committed before is
    /// confirmed (`confirmed_flush_lsn`).
    pub confirmed_flush: Option<String>,
}

/// The slot's state; `None`: no such slot.
pub async fn slot_state(pool: &PgPool, slot: &str) -> sqlx::Result<Option<SlotState>> {
    sqlx::query_as(
        "SELECT COALESCE(wal_status, 'unknown') AS wal_status, \
                COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8 AS retained_bytes, \
                active, confirmed_flush_lsn::text AS confirmed_flush \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
}

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

/// The URL of a replication connection to the same database.
fn replication_url(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}replication=database")
}

/// One life of the stream: slot, drain, stream, until cancelled or broken.
/// `Err`: the relay cannot go on (a lost slot, an undecodable row).
async fn stream_once(
    worker: &Arc<Worker>,
    config: &WalConfig,
    slot: &str,
    cancel: &CancellationToken,
) -> anyhow::Result<End> {
    if let Some(state) = slot_state(&worker.pool, slot)
        .await
        .context("read the slot")?
    {
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
    let mut stream =
        match LogicalReplicationStream::new(&replication_url(&config.database_url), stream_config)
            .await
        {
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
    let drained = match drain(worker, cancel).await {
        Ok(n) => n,
        Err(error) => {
            return Ok(End::Retry(
                error.context("drain the rows pending before the slot"),
            ));
        }
    };
    if drained > 0 {
        tracing::info!(
            rows = drained,
            "published the rows pending before the stream"
        );
    }
    if cancel.is_cancelled() {
        return Ok(End::Cancelled);
    }
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
    let mut settle = Settle {
        worker: worker.clone(),
        feedback,
        queue: FuturesOrdered::new(),
        keys: HashMap::new(),
        rows_in_flight: 0,
        blocked,
        delivered: Vec::new(),
        settled_rows: Vec::new(),
        rejected: Vec::new(),
        settled_lsn: 0,
        marked_lsn: 0,
        probe: None,
        reading: None,
        gap_checked: std::time::Instant::now(),
        broken: None,
        cancel: cancel.clone(),
    };
    let end = settle.pump(rx, config, cancel).await;
    reader_cancel.cancel();
    let _ = reader.await;
    end
}

/// The message for a slot PostgreSQL invalidated.
fn lost_slot(slot: &str) -> String {
    format!(
        "replication slot {slot} was invalidated: it fell more than max_slot_wal_keep_size behind \
         and PostgreSQL removed the WAL it needed. Nothing is lost (rows are marked published only \
         after the broker acked them), but this slot can never be read again. Drop it \
         (SELECT pg_drop_replication_slot('{slot}');) and start the relay again: it makes a new \
         slot and publishes every row still pending first (or run it with --mode poll)."
    )
}

/// Publishes every claimable pending row by the poll path: each shard's
/// batches until it has none (or another relay holds it).
async fn drain(worker: &Arc<Worker>, cancel: &CancellationToken) -> anyhow::Result<usize> {
    let shards = (0..SHARDS).map(|shard| {
        let worker = worker.clone();
        let cancel = cancel.clone();
        async move {
            let mut total = 0;
            while !cancel.is_cancelled() {
                let permit = worker.permits.acquire().await?;
                let n = worker.relay_shard(shard, 0).await;
                drop(permit);
                match n? {
                    0 => break,
                    n => total += n,
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
/// (FINDINGS.md §21). So while it waits for room it sends the confirmed
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

/// One settled step of the stream, in stream order.
enum Step {
    /// A row's publish ended.
    Row {
        id: i64,
        msg_id: Uuid,
        aggregate: Uuid,
        result: Publish,
    },
    /// A transaction ended at this LSN: every row before it is settled.
    Commit(u64),
}

/// A transaction as read so far: its outbox inserts.
#[derive(Default)]
struct Reading {
    xid: u32,
    rows: usize,
    first_id: Option<i64>,
    last_id: Option<i64>,
}

/// The stream's state between the reader and the marks.
struct Settle {
    worker: Arc<Worker>,
    feedback: Arc<SharedLsnFeedback>,
    /// Publishes in flight and commit boundaries, in stream order.
    queue: FuturesOrdered<BoxFuture<'static, Step>>,
    /// Rows in flight per aggregate (0 or 1).
    keys: HashMap<Uuid, u32>,
    rows_in_flight: usize,
    /// Aggregates with a failed row: their later events are not published.
    blocked: HashSet<Uuid>,
    /// Delivered, not yet marked.
    delivered: Vec<i64>,
    /// `(id, msg_id)` of the delivered and rejected rows, for the mark's
    /// [`wait_visible`].
    settled_rows: Vec<(i64, Uuid)>,
    /// The row's own failures, not yet recorded.
    rejected: Vec<(i64, String)>,
    /// End of the last transaction settled before any broker failure.
    settled_lsn: u64,
    /// The position up to which every row is marked (or failed, or held
    /// back): [`Settle::settled_lsn`] as of the last successful mark.
    marked_lsn: u64,
    /// Pending rows the stream must have delivered once it has marked past
    /// the probe's position.
    probe: Option<Probe>,
    /// The transaction being read (for the debug log of every transaction
    /// read, `make wal-witness`).
    reading: Option<Reading>,
    /// When the table was last compared with the stream.
    gap_checked: std::time::Instant,
    /// A broker failure: nothing past it is confirmed; the stream restarts.
    broken: Option<String>,
    /// The relay's: cuts a row's retries in place short.
    cancel: CancellationToken,
}

/// Publishes a row; a broker failure is tried again in place ([`Backoff`]:
/// 50 ms doubling to 5 s) until the broker takes it, refuses the row itself,
/// or the relay stops. The row's key has nothing else in flight (one event
/// per key), so its order holds, and the rest of the window goes on. A
/// stream restart instead would send the whole unconfirmed window again: at
/// 3×S in experiment 6 the broker's errors made the relay restart over and
/// over (FINDINGS §21). The poll relay, likewise, tries a row until it goes.
async fn publish_in_place(
    worker: &Worker,
    row: &PendingRow,
    cancel: &CancellationToken,
) -> Publish {
    let mut backoff = Backoff::new();
    loop {
        match worker.publish(row).await {
            Publish::Retry if backoff.wait(cancel).await => {}
            settled => return settled,
        }
    }
}

impl Settle {
    /// Reads events and settles results until cancelled or broken.
    async fn pump(
        &mut self,
        mut rx: mpsc::Receiver<Result<ChangeEvent, String>>,
        config: &WalConfig,
        cancel: &CancellationToken,
    ) -> anyhow::Result<End> {
        let mut tick = tokio::time::interval(MARK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.broken.is_some() {
                break;
            }
            tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                Some(step) = self.queue.next(), if !self.queue.is_empty() => {
                    self.settle(step);
                    if self.delivered.len() >= config.mark_batch {
                        self.mark_or_break().await;
                    }
                }
                event = rx.recv(), if self.rows_in_flight < config.max_in_flight => match event {
                    Some(Ok(event)) => self.take(event).await?,
                    Some(Err(error)) => {
                        self.broken = Some(format!("replication stream: {error}"));
                    }
                    None => self.broken = Some("replication stream ended".into()),
                },
                _ = tick.tick() => {
                    self.mark_or_break().await;
                    if self.gap_checked.elapsed() >= GAP_CHECK_EVERY {
                        self.gap_checked = std::time::Instant::now();
                        self.check_gap().await;
                    }
                }
            }
        }
        // Settle what is in flight, mark it, confirm what is settled.
        while let Some(step) = self.queue.next().await {
            self.settle(step);
        }
        // A mark that fails (the database) leaves its rows unconfirmed:
        // the restart reads them again.
        self.mark_or_break().await;
        Ok(match self.broken.take() {
            Some(why) => End::Retry(anyhow::anyhow!(why)),
            None => End::Cancelled,
        })
    }

    /// One event from the stream.
    async fn take(&mut self, event: ChangeEvent) -> anyhow::Result<()> {
        match event.event_type {
            EventType::Insert {
                schema,
                table,
                data,
                ..
            } if &*schema == "orders" && &*table == "outbox" => {
                let row = decode_row(&data).map_err(|why| {
                    anyhow::anyhow!(
                        "an orders.outbox insert at {} cannot be read: {why} \
                         (is the relay older than the outbox's schema?)",
                        event.lsn
                    )
                })?;
                if let Some(reading) = &mut self.reading {
                    reading.rows += 1;
                    reading.first_id.get_or_insert(row.id);
                    reading.last_id = Some(row.id);
                }
                // One event of a key in flight at a time: settle up to the
                // earlier one first, then look at its outcome: a key whose
                // earlier event just failed is held back too.
                while self.keys.contains_key(&row.aggregate_id) && self.broken.is_none() {
                    match self.queue.next().await {
                        Some(step) => self.settle(step),
                        None => break,
                    }
                }
                if self.broken.is_some() {
                    return Ok(()); // not sent; the restart reads it again
                }
                if self.blocked.contains(&row.aggregate_id) {
                    self.worker.metrics.relay_wal_held_back_total.inc();
                    return Ok(());
                }
                *self.keys.entry(row.aggregate_id).or_default() += 1;
                self.rows_in_flight += 1;
                let worker = self.worker.clone();
                let cancel = self.cancel.clone();
                self.queue.push_back(
                    async move {
                        let result = publish_in_place(&worker, &row, &cancel).await;
                        Step::Row {
                            id: row.id,
                            msg_id: row.msg_id,
                            aggregate: row.aggregate_id,
                            result,
                        }
                    }
                    .boxed(),
                );
            }
            EventType::Begin { transaction_id, .. } => {
                self.reading = Some(Reading {
                    xid: transaction_id,
                    ..Reading::default()
                });
            }
            EventType::Commit { end_lsn, .. } => {
                let lsn = end_lsn.value();
                if let Some(r) = self.reading.take() {
                    tracing::debug!(
                        xid = r.xid,
                        end_lsn = %format_lsn(lsn),
                        rows = r.rows,
                        first_id = r.first_id.unwrap_or(0),
                        last_id = r.last_id.unwrap_or(0),
                        "read a transaction"
                    );
                }
                self.queue
                    .push_back(futures::future::ready(Step::Commit(lsn)).boxed());
            }
            _ => {}
        }
        Ok(())
    }

    /// A step's result, in stream order.
    fn settle(&mut self, step: Step) {
        match step {
            Step::Row {
                id,
                msg_id,
                aggregate,
                result,
            } => {
                self.rows_in_flight -= 1;
                if let Some(n) = self.keys.get_mut(&aggregate) {
                    *n -= 1;
                    if *n == 0 {
                        self.keys.remove(&aggregate);
                    }
                }
                match result {
                    Publish::Delivered => {
                        self.delivered.push(id);
                        self.settled_rows.push((id, msg_id));
                    }
                    Publish::Rejected(error) => {
                        self.settled_rows.push((id, msg_id));
                        self.blocked.insert(aggregate);
                        self.rejected.push((id, error));
                    }
                    Publish::Retry => {
                        if self.broken.is_none() {
                            self.broken = Some(format!(
                                "publish of outbox row {id} did not settle before the relay stopped"
                            ));
                        }
                    }
                }
            }
            Step::Commit(lsn) => {
                if self.broken.is_none() {
                    self.settled_lsn = lsn;
                }
            }
        }
    }

    /// [`Settle::mark`]; a failure breaks the stream (nothing more is
    /// confirmed: the restart reads the unmarked rows again).
    async fn mark_or_break(&mut self) {
        if let Err(error) = self.mark().await
            && self.broken.is_none()
        {
            self.broken = Some(format!("{error:#}"));
        }
    }

    /// Marks the delivered rows, records the failed ones, then confirms the
    /// settled position to the slot.
    async fn mark(&mut self) -> anyhow::Result<()> {
        if !self.delivered.is_empty() || !self.rejected.is_empty() {
            let mut tx = self.worker.pool.begin().await.context("begin mark")?;
            let rows = std::mem::take(&mut self.settled_rows);
            let worker = self.worker.clone();
            wait_visible(&mut tx, rows, VISIBLE_WITHIN, &worker.metrics).await?;
            // The stream cannot come back to a row: its own failure is final
            // at its first attempt.
            self.worker
                .mark_batch(tx, &self.delivered, &self.rejected, 1)
                .await?;
            self.delivered.clear();
            self.rejected.clear();
        }
        // Only now: every row up to this position is marked (or failed, or
        // held back), so a restart from it loses nothing.
        if self.settled_lsn > self.marked_lsn {
            tracing::trace!(confirm = %format_lsn(self.settled_lsn), "marked; confirming");
        }
        self.feedback.update_applied_lsn(self.settled_lsn);
        self.marked_lsn = self.settled_lsn;
        Ok(())
    }

    /// Compares the table with the stream, in two steps (a [`Probe`]): a
    /// database error skips a step (the next tick tries again).
    async fn check_gap(&mut self) {
        match self.probe.take() {
            None => match Probe::take(&self.worker.pool).await {
                Ok(probe) => self.probe = probe,
                Err(error) => tracing::debug!(%error, "probe the outbox for the stream"),
            },
            Some(probe) if self.marked_lsn < probe.lsn => self.probe = Some(probe),
            Some(probe) => match probe.missed(&self.worker.pool).await {
                Ok(None) => {}
                Ok(Some(why)) => {
                    self.worker.metrics.relay_wal_stream_gaps_total.inc();
                    tracing::warn!(%why, "the stream missed committed outbox rows; restarting it (the restart publishes them)");
                    self.broken = Some(why);
                }
                Err(error) => tracing::debug!(%error, "check the probed outbox rows"),
            },
        }
    }
}

/// Waits until the mark's statements will see every row in `ids`.
///
/// The walsender may send a transaction as soon as its commit record is
/// flushed, and the committing backend makes it visible to other
/// snapshots only after that. On a busy machine a backend can lose the
/// CPU in between for longer than a publish takes, so a mark could run
/// before its rows are visible: its `UPDATE … WHERE id = ANY(…)` then
/// skipped them, they stayed pending, and the slot was confirmed past
/// their commit (the "rows the stream missed" of FINDINGS.md §21, found
/// by `make wal-witness`). Each statement here takes a new snapshot
/// (read committed), so once a count sees every row, so does the mark.
/// A commit flushed but invisible for `within` ([`VISIBLE_WITHIN`]) ends
/// the stream instead (nothing past it is confirmed; the restart reads it
/// again).
async fn wait_visible(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    mut rows: Vec<(i64, Uuid)>,
    within: Duration,
    metrics: &crate::metrics::RelayMetrics,
) -> anyhow::Result<()> {
    rows.sort_unstable();
    rows.dedup();
    let want = rows.len() as i64;
    let started = std::time::Instant::now();
    let mut pause = Duration::from_millis(1);
    let mut waited = false;
    loop {
        let seen = crate::outbox::count_settled(tx, &rows)
            .await
            .context("count the rows to mark")?;
        if seen >= want {
            if waited {
                metrics.relay_wal_unseen_marks_total.inc();
                tracing::debug!(
                    rows = want,
                    waited_ms = started.elapsed().as_millis() as u64,
                    "a mark waited for committed rows to become visible"
                );
            }
            return Ok(());
        }
        if started.elapsed() >= within {
            anyhow::bail!(
                "{} of {want} rows read from the stream are still not visible after {within:?}",
                want - seen
            );
        }
        waited = true;
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Pending rows and the WAL position they committed before. The relay is
/// at-least-once only if every committed insert is delivered and marked; a
/// full experiment 6 run found rows left pending behind the stream
/// (FINDINGS.md §21: marks that could not see them yet, fixed by
/// [`wait_visible`]), so the relay checks: once every commit up to `lsn` is
/// marked, each of `ids` must be published, failed or held back by a failed
/// row of its key. One that is still pending was missed, and a restart
/// (whose start-up drain publishes pending rows) repairs it.
///
/// Positions, not times: a row's `created_at` is its transaction's start,
/// which may be long before its commit, and a row read from the stream may
/// still be in flight.
struct Probe {
    /// At or past the commit of every row in `ids`.
    lsn: u64,
    ids: Vec<i64>,
}

impl Probe {
    /// The oldest pending rows with the WAL's insert position, read in one
    /// statement: a row its snapshot sees as committed has its commit record
    /// before that position. `None` when nothing is pending. Rows held back
    /// by a failed row of their key are left out: they stay pending by
    /// design, and as the oldest they filled every probe, so a row the
    /// stream missed behind them was never looked at.
    async fn take(pool: &PgPool) -> sqlx::Result<Option<Self>> {
        let (lsn, ids): (String, Option<Vec<i64>>) = sqlx::query_as(
            "SELECT pg_current_wal_insert_lsn()::text, \
                    (SELECT array_agg(id) FROM (SELECT o.id FROM orders.outbox o \
                      WHERE o.published_at IS NULL AND o.failed_at IS NULL \
                        AND NOT EXISTS (SELECT 1 FROM orders.outbox f \
                                        WHERE f.aggregate_id = o.aggregate_id \
                                          AND f.published_at IS NULL AND f.failed_at IS NOT NULL) \
                      ORDER BY o.created_at, o.id LIMIT $1) p)",
        )
        .bind(PROBE_ROWS)
        .fetch_one(pool)
        .await?;
        let Some(ids) = ids else { return Ok(None) };
        let lsn = parse_lsn(&lsn).map_err(|error| sqlx::Error::Protocol(error.to_string()))?;
        Ok(Some(Self { lsn, ids }))
    }

    /// A probed row still pending now that the stream has marked past the
    /// probe's position, and not held back by a failed row of its key.
    async fn missed(&self, pool: &PgPool) -> sqlx::Result<Option<String>> {
        let row: Option<(i64, DateTime<Utc>)> = sqlx::query_as(
            "SELECT o.id, o.created_at FROM orders.outbox o \
             WHERE o.id = ANY($1) AND o.published_at IS NULL AND o.failed_at IS NULL \
               AND NOT EXISTS (SELECT 1 FROM orders.outbox f WHERE f.aggregate_id = o.aggregate_id \
                               AND f.published_at IS NULL AND f.failed_at IS NOT NULL) \
             LIMIT 1",
        )
        .bind(&self.ids)
        .fetch_optional(pool)
        .await?;
        Ok(row.map(|(id, created_at)| {
            format!(
                "outbox row {id} (written {created_at}) is pending, and the stream has marked \
                 every commit up to {}, past its commit",
                format_lsn(self.lsn)
            )
        }))
    }
}

/// An `orders.outbox` insert as the stream carries it (binary format).
fn decode_row(data: &RowData) -> Result<PendingRow, String> {
    Ok(PendingRow {
        id: int8(data, "id")?,
        aggregate_id: uuid(data, "aggregate_id")?,
        msg_id: uuid(data, "msg_id")?,
        event_type: String::from_utf8(bytes(data, "event_type")?.to_vec())
            .map_err(|_| "event_type is not UTF-8".to_string())?,
        payload: bytes(data, "payload")?.to_vec(),
        created_at: timestamptz(data, "created_at")?,
        attempts: 0,
    })
}

/// A non-NULL binary column.
fn bytes<'a>(data: &'a RowData, name: &str) -> Result<&'a [u8], String> {
    match data.get(name) {
        None => Err(format!("no column {name}")),
        Some(ColumnValue::Null) => Err(format!("{name} is NULL")),
        Some(ColumnValue::Text(_)) => Err(format!("{name} came as text, not binary")),
        Some(ColumnValue::Binary(b)) => Ok(b),
    }
}

fn int8(data: &RowData, name: &str) -> Result<i64, String> {
    let b: [u8; 8] = bytes(data, name)?
        .try_into()
        .map_err(|_| format!("{name} is not an int8"))?;
    Ok(i64::from_be_bytes(b))
}

fn uuid(data: &RowData, name: &str) -> Result<Uuid, String> {
    Uuid::from_slice(bytes(data, name)?).map_err(|_| format!("{name} is not a uuid"))
}

/// PostgreSQL's binary timestamptz: microseconds since 2000-01-01 UTC.
fn timestamptz(data: &RowData, name: &str) -> Result<DateTime<Utc>, String> {
    let b: [u8; 8] = bytes(data, name)?
        .try_into()
        .map_err(|_| format!("{name} is not a timestamptz"))?;
    let micros = i64::from_be_bytes(b);
    const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;
    micros
        .checked_add(PG_EPOCH_UNIX_MICROS)
        .and_then(DateTime::from_timestamp_micros)
        .ok_or_else(|| format!("{name} is out of range"))
}

#[cfg(test)]
mod tests {
    use effectively::testing::TestDb;
    use sqlx::{Connection, PgConnection};

    use super::*;
    use bytes::Bytes;

    /// An outbox row inserted by an open transaction on its own connection.
    async fn uncommitted_row(db: &TestDb) -> (PgConnection, i64) {
        let mut writer = PgConnection::connect(&db.url).await.expect("connect");
        sqlx::query("BEGIN")
            .execute(&mut writer)
            .await
            .expect("begin");
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload) \
             VALUES (gen_random_uuid(), gen_random_uuid(), 'order.created', '{}') RETURNING id",
        )
        .fetch_one(&mut writer)
        .await
        .expect("insert");
        (writer, id)
    }

    /// A probe follows rows that should move: not the rows held back by a
    /// failed row of their key, which stay pending for good and, being the
    /// oldest, once filled every probe (a missed row behind them was never
    /// looked at).
    #[tokio::test]
    async fn a_probe_skips_rows_held_back_and_finds_a_missed_row_behind_them() {
        let db = TestDb::create().await;
        let pool = PgPool::connect(&db.url).await.expect("pool");
        for sql in [
            // A key whose first row failed, and more than a probe's worth of
            // its rows held back behind it, all older than the missed row.
            "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, failed_at, created_at) \
             VALUES ('00000000-0000-0000-0000-00000000000a', gen_random_uuid(), 'order.created', '{}', \
                     now(), now() - interval '1 hour')",
            "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, created_at) \
             SELECT '00000000-0000-0000-0000-00000000000a', gen_random_uuid(), 'order.created', '{}', \
                    now() - interval '1 hour' + i * interval '1 ms' FROM generate_series(1, 150) i",
            // The row the stream missed.
            "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, created_at) \
             VALUES (gen_random_uuid(), gen_random_uuid(), 'order.created', '{}', now() - interval '1 minute')",
        ] {
            sqlx::query(sql).execute(&pool).await.expect(sql);
        }
        let missed: i64 = sqlx::query_scalar("SELECT max(id) FROM orders.outbox")
            .fetch_one(&pool)
            .await
            .expect("id");
        let probe = Probe::take(&pool)
            .await
            .expect("probe")
            .expect("pending rows");
        assert_eq!(probe.ids, vec![missed], "only the row that should move");
        let why = probe
            .missed(&pool)
            .await
            .expect("check")
            .expect("the missed row is found");
        assert!(why.contains(&format!("outbox row {missed} ")), "{why}");
    }

    #[tokio::test]
    async fn a_mark_waits_for_a_row_its_snapshot_cannot_see_yet() {
        let db = TestDb::create().await;
        let pool = PgPool::connect(&db.url).await.expect("pool");
        let metrics = crate::metrics::RelayMetrics::new().expect("metrics");
        let (mut writer, id) = uncommitted_row(&db).await;
        let mut tx = pool.begin().await.expect("begin mark");
        // What the mark did before: its UPDATE does not see the row, and
        // leaves it pending.
        let marked = crate::outbox::mark_published(&mut tx, &[id])
            .await
            .expect("mark");
        assert_eq!(marked, 0, "the row is not visible yet");
        let commit = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            sqlx::query("COMMIT")
                .execute(&mut writer)
                .await
                .expect("commit");
        });
        let started = std::time::Instant::now();
        let msg_id = Uuid::now_v7();
        wait_visible(
            &mut tx,
            vec![(id, msg_id), (id, msg_id)],
            Duration::from_secs(10),
            &metrics,
        )
        .await
        .expect("the row becomes visible");
        assert!(started.elapsed() >= Duration::from_millis(250));
        commit.await.expect("writer");
        let marked = crate::outbox::mark_published(&mut tx, &[id])
            .await
            .expect("mark");
        tx.commit().await.expect("commit mark");
        assert_eq!(marked, 1, "after the wait the mark sees the row");
        assert_eq!(metrics.relay_wal_unseen_marks_total.get(), 1);
    }

    #[tokio::test]
    async fn a_row_that_never_becomes_visible_ends_the_wait_with_an_error() {
        let db = TestDb::create().await;
        let pool = PgPool::connect(&db.url).await.expect("pool");
        let metrics = crate::metrics::RelayMetrics::new().expect("metrics");
        let (_writer, id) = uncommitted_row(&db).await;
        let mut tx = pool.begin().await.expect("begin mark");
        let error = wait_visible(
            &mut tx,
            vec![(id, Uuid::now_v7())],
            Duration::from_millis(300),
            &metrics,
        )
        .await
        .expect_err("never visible");
        assert!(
            error.to_string().contains("1 of 1 rows"),
            "unexpected error: {error}"
        );
        assert_eq!(metrics.relay_wal_unseen_marks_total.get(), 0);
    }

    /// A row the stream reads again after a restart may be gone: the outbox
    /// expiry deletes published rows minted before the retention (here a
    /// row 8 days old against the default 7). The mark counts it as settled
    /// instead of waiting for it, which would end the stream, restart it at
    /// the same position and wait again, for good.
    #[tokio::test]
    async fn a_row_the_outbox_expiry_deleted_does_not_hold_the_mark() {
        let db = TestDb::create().await;
        let pool = PgPool::connect(&db.url).await.expect("pool");
        let metrics = crate::metrics::RelayMetrics::new().expect("metrics");
        let old = effectively::v7::minted_ago(Duration::from_secs(8 * 86_400));
        let mut tx = pool.begin().await.expect("begin mark");
        // Ids no row has: deleted.
        wait_visible(
            &mut tx,
            vec![(1_000_000_001, old)],
            Duration::from_millis(300),
            &metrics,
        )
        .await
        .expect("an expired row is settled");
        let error = wait_visible(
            &mut tx,
            vec![(1_000_000_001, old), (1_000_000_002, Uuid::now_v7())],
            Duration::from_millis(300),
            &metrics,
        )
        .await
        .expect_err("a young row that is not there is waited for");
        assert!(error.to_string().contains("1 of 2 rows"), "{error}");
    }

    fn bin(v: &[u8]) -> ColumnValue {
        ColumnValue::Binary(Bytes::copy_from_slice(v))
    }

    fn row(cols: Vec<(&str, ColumnValue)>) -> RowData {
        RowData::from_pairs(cols)
    }

    #[test]
    fn an_outbox_insert_decodes_from_the_binary_format() {
        let agg = Uuid::now_v7();
        let msg = Uuid::now_v7();
        // 2026-11-24T00:00:00Z in microseconds since 2000-01-01.
        let at = DateTime::parse_from_rfc3339("2026-11-24T00:00:00.123456Z")
            .expect("time")
            .with_timezone(&Utc);
        let micros = at.timestamp_micros() - 946_684_800_000_000;
        let data = row(vec![
            ("id", bin(&42i64.to_be_bytes())),
            ("aggregate_id", bin(agg.as_bytes())),
            ("msg_id", bin(msg.as_bytes())),
            ("event_type", bin(b"order.created")),
            ("payload", bin(br#"{"a":1}"#)),
            ("created_at", bin(&micros.to_be_bytes())),
            ("published_at", ColumnValue::Null),
        ]);
        let r = decode_row(&data).expect("decodes");
        assert_eq!(r.id, 42);
        assert_eq!(r.aggregate_id, agg);
        assert_eq!(r.msg_id, msg);
        assert_eq!(r.event_type, "order.created");
        assert_eq!(r.payload, br#"{"a":1}"#);
        assert_eq!(r.created_at, at);
    }

    #[test]
    fn a_malformed_insert_is_an_error_not_a_panic() {
        let good = |name: &str| -> ColumnValue {
            match name {
                "id" | "created_at" => bin(&1i64.to_be_bytes()),
                "aggregate_id" | "msg_id" => bin(Uuid::nil().as_bytes()),
                _ => bin(b"x"),
            }
        };
        let names = [
            "id",
            "aggregate_id",
            "msg_id",
            "event_type",
            "payload",
            "created_at",
        ];
        for broken in names {
            for bad in [
                None,
                Some(ColumnValue::Null),
                Some(ColumnValue::text("1")),
                Some(bin(b"\xff\xfe\xfd")),
            ] {
                let cols: Vec<(&str, ColumnValue)> = names
                    .iter()
                    .filter_map(|&n| {
                        if n == broken {
                            bad.clone().map(|v| (n, v))
                        } else {
                            Some((n, good(n)))
                        }
                    })
                    .collect();
                let result = decode_row(&row(cols));
                // Three bytes are valid for the text and bytea columns.
                let ok_anyway = matches!(&bad, Some(ColumnValue::Binary(_))) && broken == "payload";
                assert_eq!(result.is_ok(), ok_anyway, "{broken} as {bad:?}: {result:?}");
            }
        }
    }

    #[test]
    fn the_default_slot_name_is_a_valid_slot_name() {
        assert_eq!(
            default_slot_name("effectively"),
            "effectively_outbox_effectively"
        );
        let odd = default_slot_name(&format!("Test-DB.{}", "x".repeat(80)));
        assert!(odd.len() <= 63, "{odd}");
        assert!(
            odd.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            "{odd}"
        );
    }
}
