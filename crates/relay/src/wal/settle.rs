//! What happens to each event the stream reads: its publish (one event of
//! a key in flight at a time, a broker failure tried again in place), the
//! results settled in stream order, the delivered rows marked in batches
//! once they are visible, and only then the slot's confirmed position moved
//! to the end of the last transaction wholly settled. A [`Probe`] compares
//! the table with the stream now and then.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use chrono::{DateTime, Utc};
use effectively::retry::Backoff;
use futures::future::{BoxFuture, FutureExt};
use futures::stream::{FuturesOrdered, StreamExt};
use pg_walstream::{ChangeEvent, EventType, SharedLsnFeedback, format_lsn, parse_lsn};
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::decode::decode_row;
use super::drained::Drained;
use super::pace::Pace;
use crate::outbox::{self, PendingRow};
use crate::publish::{Publish, Worker};

/// How often the table is compared with the stream ([`Probe`]).
const GAP_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Pending rows a [`Probe`] follows.
const PROBE_ROWS: i64 = 100;

/// Settled rows are marked at least this often.
const MARK_EVERY: Duration = Duration::from_millis(50);

/// How long a mark waits for rows the stream delivered to become visible
/// ([`wait_visible`]) before it ends the stream.
const VISIBLE_WITHIN: Duration = Duration::from_secs(10);

/// How long the last mark of a stream waits when a mark of it failed
/// already: those rows were waited for; it looks once.
const VISIBLE_AFTER_A_FAILED_MARK: Duration = Duration::ZERO;

/// How a stream's life ended.
pub(super) enum End {
    /// `cancel` fired; everything settled is marked and confirmed.
    Cancelled,
    /// Worth another try after a backoff (the broker, the connection).
    Retry(anyhow::Error),
    /// Another WAL relay streams from the slot: try again later.
    Busy,
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
pub(super) struct Settle {
    worker: Arc<Worker>,
    feedback: Arc<SharedLsnFeedback>,
    /// Publishes in flight and commit boundaries, in stream order.
    queue: FuturesOrdered<BoxFuture<'static, Step>>,
    /// Rows in flight per aggregate (0 or 1).
    keys: HashMap<Uuid, u32>,
    rows_in_flight: usize,
    /// Aggregates with a failed row: their later events are not published.
    blocked: HashSet<Uuid>,
    /// Rows the start-up drain published: read again, not sent again.
    drained: Drained,
    /// Which producer a row goes through.
    pace: Pace,
    /// Delivered, not yet marked.
    delivered: Vec<i64>,
    /// `(id, msg_id)` of the delivered and rejected rows not yet marked,
    /// for the mark's [`wait_visible`] and its check. Kept until a mark
    /// verified and marked them all: a row dropped unverified would let the
    /// next mark confirm past it.
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
    /// A mark of this stream failed (its rows are still to mark).
    mark_failed: bool,
    /// The relay's: cuts a row's retries in place short.
    cancel: CancellationToken,
    /// Most rows in flight to the broker.
    max_in_flight: usize,
    /// Delivered rows that make a mark before the next tick.
    mark_batch: usize,
}

/// Publishes a row; a broker failure is tried again in place ([`Backoff`]:
/// 50 ms doubling to 5 s) until the broker takes it, refuses the row itself,
/// or the relay stops. The row's key has nothing else in flight (one event
/// per key), so its order holds, and the rest of the window goes on. A
/// stream restart instead would send the whole unconfirmed window again: at
/// 3×S in experiment 6 the broker's errors made the relay restart over and
/// over (FINDINGS §22). The poll relay, likewise, tries a row until it goes.
async fn publish_in_place(
    worker: &Worker,
    row: &PendingRow,
    busy: bool,
    cancel: &CancellationToken,
) -> Publish {
    let mut backoff = Backoff::new();
    loop {
        match worker.publish(row, busy).await {
            Publish::Retry if backoff.wait(cancel).await => {}
            settled => return settled,
        }
    }
}

impl Settle {
    /// A stream's state before its first event: nothing in flight, settled
    /// or marked; `blocked`: the aggregates a failed row holds back;
    /// `busy_rows_per_sec`: when there is a busy producer, the rows a
    /// second that take it ([`Pace`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        worker: Arc<Worker>,
        feedback: Arc<SharedLsnFeedback>,
        blocked: HashSet<Uuid>,
        drained: Drained,
        max_in_flight: usize,
        mark_batch: usize,
        busy_rows_per_sec: Option<u64>,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            worker,
            feedback,
            queue: FuturesOrdered::new(),
            keys: HashMap::new(),
            rows_in_flight: 0,
            blocked,
            drained,
            pace: Pace::new(busy_rows_per_sec, std::time::Instant::now()),
            delivered: Vec::new(),
            settled_rows: Vec::new(),
            rejected: Vec::new(),
            settled_lsn: 0,
            marked_lsn: 0,
            probe: None,
            reading: None,
            gap_checked: std::time::Instant::now(),
            broken: None,
            mark_failed: false,
            cancel,
            max_in_flight,
            mark_batch,
        }
    }

    /// Reads events and settles results until cancelled or broken.
    pub(super) async fn pump(
        &mut self,
        mut rx: mpsc::Receiver<Result<ChangeEvent, String>>,
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
                    if self.delivered.len() >= self.mark_batch {
                        self.mark_or_break().await;
                    }
                }
                event = rx.recv(), if self.rows_in_flight < self.max_in_flight => match event {
                    Some(Ok(event)) => self.take(event).await?,
                    Some(Err(error)) => {
                        self.broken = Some(format!("replication stream: {error}"));
                    }
                    None => self.broken = Some("replication stream ended".into()),
                },
                _ = tick.tick() => {
                    let busy = self.pace.busy_at(std::time::Instant::now());
                    self.worker.metrics.relay_wal_busy.set(i64::from(busy));
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
        // A mark that fails (the database, a row still invisible, a row
        // its UPDATE missed) leaves its rows unconfirmed: the restart reads
        // them again.
        let within = if self.mark_failed {
            VISIBLE_AFTER_A_FAILED_MARK
        } else {
            VISIBLE_WITHIN
        };
        self.mark_or_break_within(within).await;
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
                // Marked published by the drain, after its broker's ack:
                // nothing to settle.
                if self.drained.contains(row.id) {
                    self.worker.metrics.relay_wal_drained_skipped_total.inc();
                    return Ok(());
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
                // The gauge `relay_wal_busy` is set on the mark's tick.
                let busy = self.pace.row(std::time::Instant::now());
                if busy {
                    self.worker.metrics.relay_wal_busy_rows_total.inc();
                }
                let worker = self.worker.clone();
                let cancel = self.cancel.clone();
                self.queue.push_back(
                    async move {
                        let result = publish_in_place(&worker, &row, busy, &cancel).await;
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
                self.drained.passed(lsn);
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

    /// [`Settle::mark`], its rows waited for up to [`VISIBLE_WITHIN`].
    async fn mark_or_break(&mut self) {
        self.mark_or_break_within(VISIBLE_WITHIN).await;
    }

    /// [`Settle::mark`]; a failure breaks the stream (nothing more is
    /// confirmed: the restart reads the unmarked rows again).
    async fn mark_or_break_within(&mut self, within: Duration) {
        if let Err(error) = self.mark(within).await {
            self.mark_failed = true;
            if self.broken.is_none() {
                self.broken = Some(format!("{error:#}"));
            }
        }
    }

    /// Marks the delivered rows, records the failed ones, then confirms the
    /// settled position to the slot: only once every one of them was seen
    /// ([`wait_visible`], up to `within`) and is marked. A failure confirms
    /// nothing and keeps every row it did not settle, for the next mark.
    async fn mark(&mut self, within: Duration) -> anyhow::Result<()> {
        // Every row of the transactions up to here is in `delivered` or
        // `rejected`, or was marked before, or is held back.
        let confirm = self.settled_lsn;
        if !self.delivered.is_empty() || !self.rejected.is_empty() {
            let mut tx = self.worker.pool.begin().await.context("begin mark")?;
            wait_visible(&mut tx, &self.settled_rows, within, &self.worker.metrics).await?;
            // The stream cannot come back to a row: its own failure is final
            // at its first attempt.
            let marked = self
                .worker
                .mark_batch(tx, &self.delivered, &self.rejected, 1)
                .await?;
            if marked.published < self.delivered.len() as u64
                || marked.failed < self.rejected.len() as u64
            {
                self.check_marked().await?;
            }
            self.delivered.clear();
            self.rejected.clear();
            self.settled_rows.clear();
        }
        // Only now: every row up to this position is marked (or failed, or
        // held back), so a restart from it loses nothing.
        if confirm > self.marked_lsn {
            tracing::trace!(confirm = %format_lsn(confirm), "marked; confirming");
        }
        self.feedback.update_applied_lsn(confirm);
        self.marked_lsn = confirm;
        Ok(())
    }

    /// After a mark that changed fewer rows than it meant to: fine when the
    /// others were settled already (published before: read again after a
    /// restart, or by a poll relay meanwhile; deleted by the expiry). A row
    /// still pending, or still not there, is not: it stays to be marked
    /// again, and the mark fails, so nothing past it is confirmed.
    async fn check_marked(&mut self) -> anyhow::Result<()> {
        let mut conn = self
            .worker
            .pool
            .acquire()
            .await
            .context("connect to check a mark")?;
        let left = outbox::unsettled(&mut conn, &self.settled_rows)
            .await
            .context("check the rows a mark changed")?;
        if left.is_empty() {
            return Ok(());
        }
        let keep: HashSet<i64> = left.iter().copied().collect();
        self.delivered.retain(|id| keep.contains(id));
        self.rejected.retain(|(id, _)| keep.contains(id));
        self.settled_rows.retain(|(id, _)| keep.contains(id));
        anyhow::bail!(
            "a mark left {} of the rows read from the stream unmarked (outbox ids {:?}); \
             nothing past them is confirmed",
            left.len(),
            &left[..left.len().min(10)]
        )
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
/// their commit (the "rows the stream missed" of FINDINGS.md §22, found
/// by `make wal-witness`). Each statement here takes a new snapshot
/// (read committed), so once a count sees every row, so does the mark.
/// A commit flushed but invisible for `within` ([`VISIBLE_WITHIN`]) ends
/// the stream instead (nothing past it is confirmed; the restart reads it
/// again).
async fn wait_visible(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    rows: &[(i64, Uuid)],
    within: Duration,
    metrics: &crate::metrics::RelayMetrics,
) -> anyhow::Result<()> {
    let mut rows = rows.to_vec();
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
/// (FINDINGS.md §22: marks that could not see them yet, fixed by
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

#[cfg(test)]
mod tests {
    use pipeline::testing::TestDb;
    use sqlx::{Connection, PgConnection};

    use super::*;

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
            &[(id, msg_id), (id, msg_id)],
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
            &[(id, Uuid::now_v7())],
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

    /// After a mark that changed fewer rows than it meant to, the check
    /// finds the rows it left: one still pending, one not there and young
    /// (a commit it cannot see); not a published or failed row, nor one the
    /// outbox expiry deleted.
    #[tokio::test]
    async fn a_marks_check_finds_the_rows_left_pending_or_unseen() {
        let db = TestDb::create().await;
        let pool = PgPool::connect(&db.url).await.expect("pool");
        let mut ids = Vec::new();
        for (published, failed) in [("now()", "NULL"), ("NULL", "now()"), ("NULL", "NULL")] {
            let id: i64 = sqlx::query_scalar(&format!(
                "INSERT INTO orders.outbox (aggregate_id, msg_id, event_type, payload, published_at, failed_at) \
                 VALUES (gen_random_uuid(), gen_random_uuid(), 'order.created', '{{}}', {published}, {failed}) \
                 RETURNING id"
            ))
            .fetch_one(&pool)
            .await
            .expect("insert");
            ids.push(id);
        }
        let (_writer, unseen) = uncommitted_row(&db).await;
        let old = effectively::v7::minted_ago(Duration::from_secs(8 * 86_400));
        let rows = [
            (ids[0], Uuid::now_v7()),
            (ids[1], Uuid::now_v7()),
            (ids[2], Uuid::now_v7()),
            (unseen, Uuid::now_v7()),
            (1_000_000_001, old),
        ];
        let mut conn = pool.acquire().await.expect("acquire");
        let left = outbox::unsettled(&mut conn, &rows).await.expect("check");
        assert_eq!(left, vec![ids[2], unseen], "the pending and the unseen row");
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
            &[(1_000_000_001, old)],
            Duration::from_millis(300),
            &metrics,
        )
        .await
        .expect("an expired row is settled");
        let error = wait_visible(
            &mut tx,
            &[(1_000_000_001, old), (1_000_000_002, Uuid::now_v7())],
            Duration::from_millis(300),
            &metrics,
        )
        .await
        .expect_err("a young row that is not there is waited for");
        assert!(error.to_string().contains("1 of 2 rows"), "{error}");
    }
}
