//! The sender: the fan-out of outbox rows into per-destination deliveries,
//! and each destination's delivery loop, attempts and their records.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use chrono::{DateTime, Utc};
use effectively::egress::Egress;
use effectively::retry::Backoff;
use effectively::webhook::{self};
use pipeline::contract::CrashPoint;
use pipeline::crash::Crasher;
use rand::Rng;
use reqwest::header::CONTENT_TYPE;
use sqlx::PgPool;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::metrics::RelayMetrics;
use crate::outbox::{self, PendingRow, SHARDS};

use super::answer::{
    CLOCK_SKEW_WARN, Outcome, clock_skew, describe, error_body, hint, judge, next_wait, retry_after,
};
use super::destination::{DESTINATIONS_REFRESH, Destination};
use super::sealed::Specs;
use super::store::{Claimed, active, claim};

/// The least time between two clock-skew warnings for one destination (the
/// gauge has every measurement).
const CLOCK_SKEW_WARN_EVERY: Duration = Duration::from_secs(60);

/// Each running destination's wake, by name: the fan-out notifies them all.
type Wakes = Arc<Mutex<HashMap<String, Arc<Notify>>>>;

/// How much longer than its timeout an attempt's lease lasts: a sender that
/// died mid-attempt leaves the delivery due again after this.
const LEASE_MARGIN: Duration = Duration::from_secs(5);
/// How many times an attempt's outcome is written before it is left to the
/// lease (the backoff's waits add up to about 13 s).
const RECORD_TRIES: u32 = 8;

/// What the sender's loops share.
pub struct Sender {
    pool: PgPool,
    /// How the destinations' specs are stored (sealed under the relay's keys).
    specs: Specs,
    metrics: Arc<RelayMetrics>,
    crasher: Arc<Crasher>,
    /// Where the deliveries may connect (`--webhook-allow-addresses`).
    egress: Egress,
    /// Every scheduled wait is multiplied by this (tests and experiments
    /// shrink the hours to seconds; 1 in production).
    scale: f64,
    /// When each destination's clock skew was last warned about.
    skew_warned: Mutex<HashMap<String, Instant>>,
}

impl Sender {
    /// A sender on `pool` whose deliveries connect where `egress` permits.
    pub fn new(
        pool: PgPool,
        specs: Specs,
        metrics: Arc<RelayMetrics>,
        crasher: Arc<Crasher>,
        egress: Egress,
        scale: f64,
    ) -> Self {
        Self {
            pool,
            specs,
            metrics,
            crasher,
            egress,
            scale,
            skew_warned: Mutex::default(),
        }
    }

    /// Runs the fan-out and one delivery loop per destination of
    /// `orders.webhook_destinations` until `cancel` fires; attempts in
    /// flight then finish (each within its timeout) and are recorded. The
    /// destinations are read again every [`DESTINATIONS_REFRESH`]: a loop
    /// starts for one added, stops for one removed, and restarts for one
    /// whose spec changed.
    pub async fn run(
        self: Arc<Self>,
        batch_size: i64,
        poll: Duration,
        wake: watch::Receiver<u64>,
        cancel: CancellationToken,
    ) -> anyhow::Result<()> {
        let wakes: Wakes = Arc::default();
        let mut loops = JoinSet::new();
        loops.spawn(self.clone().sample_pending(cancel.clone()));
        loops.spawn(self.clone().fan_out_loop(
            batch_size,
            poll,
            wake,
            wakes.clone(),
            cancel.clone(),
        ));
        // name -> (its spec, its loop's cancel)
        let mut running: HashMap<String, (String, CancellationToken)> = HashMap::new();
        loop {
            match active(&self.pool, &self.specs).await {
                Ok(destinations) => {
                    let names: Vec<&str> = destinations.iter().map(|d| d.name.as_str()).collect();
                    running.retain(|name, (_, stop)| {
                        let keep = names.contains(&name.as_str());
                        if !keep {
                            tracing::info!(
                                destination = name,
                                "webhook destination removed; its loop stops"
                            );
                            stop.cancel();
                            if let Ok(mut w) = wakes.lock() {
                                w.remove(name);
                            }
                        }
                        keep
                    });
                    for destination in destinations {
                        if let Some((spec, stop)) = running.get(&destination.name) {
                            if *spec == destination.spec {
                                continue;
                            }
                            tracing::info!(destination = %destination.name, "webhook destination changed; its loop restarts");
                            stop.cancel();
                        }
                        let stop = cancel.child_token();
                        let wake = Arc::new(Notify::new());
                        if let Ok(mut w) = wakes.lock() {
                            w.insert(destination.name.clone(), wake.clone());
                        }
                        for outcome in crate::metrics::WEBHOOK_ATTEMPT_OUTCOMES {
                            self.metrics
                                .relay_webhook_attempts_total
                                .with_label_values(&[destination.name.as_str(), outcome]);
                        }
                        self.metrics
                            .relay_webhook_failed_total
                            .with_label_values(&[destination.name.as_str()]);
                        running.insert(
                            destination.name.clone(),
                            (destination.spec.clone(), stop.clone()),
                        );
                        loops.spawn(self.clone().deliver_loop(destination, poll, wake, stop));
                    }
                }
                Err(error) => {
                    self.metrics
                        .relay_errors_total
                        .with_label_values(&["destinations"])
                        .inc();
                    tracing::warn!(
                        error = format!("{error:#}"),
                        "reading the webhook destinations failed; will retry"
                    );
                }
            }
            tokio::select! {
                () = tokio::time::sleep(DESTINATIONS_REFRESH) => {}
                () = cancel.cancelled() => break,
            }
            while loops.try_join_next().is_some() {}
        }
        while loops.join_next().await.is_some() {}
        Ok(())
    }

    /// Fans the outbox out into deliveries, shard by shard, while there is
    /// something to claim; then waits for a NOTIFY or the poll.
    async fn fan_out_loop(
        self: Arc<Self>,
        batch_size: i64,
        poll: Duration,
        mut wake: watch::Receiver<u64>,
        destination_wakes: Wakes,
        cancel: CancellationToken,
    ) {
        let mut backoff = Backoff::new();
        while !cancel.is_cancelled() {
            wake.borrow_and_update();
            let mut moved = 0;
            let mut failed = None;
            for shard in 0..SHARDS {
                match self.fan_out_shard(shard, batch_size).await {
                    Ok(n) => moved += n,
                    Err(error) => {
                        failed = Some(error);
                        break;
                    }
                }
            }
            if moved > 0
                && let Ok(wakes) = destination_wakes.lock()
            {
                for w in wakes.values() {
                    w.notify_one();
                }
            }
            match failed {
                Some(error) => {
                    self.metrics
                        .relay_errors_total
                        .with_label_values(&["fan_out"])
                        .inc();
                    tracing::warn!(
                        error = format!("{error:#}"),
                        "webhook fan-out failed; will retry"
                    );
                    if !backoff.wait(&cancel).await {
                        return;
                    }
                }
                None if moved > 0 => backoff.reset(),
                None => {
                    backoff.reset();
                    tokio::select! {
                        _ = wake.changed() => {}
                        () = tokio::time::sleep(poll) => {}
                        () = cancel.cancelled() => return,
                    }
                }
            }
        }
    }

    /// One shard: read its oldest pending rows (every row of a key among
    /// them, `outbox::read_shards`, as the Kafka relay's pass reads them),
    /// write the deliveries to every destination of
    /// `orders.webhook_destinations` (read in this transaction, FOR KEY
    /// SHARE: a removal waits for this commit), mark the moved rows
    /// published, record the rows that are not JSON as failed, commit.
    /// A key whose row is not JSON moves none of its later rows: they stay
    /// pending behind the failed one, as a refused row holds its key in
    /// Kafka. With no destination nothing is read: the rows wait. Returns
    /// how many outbox rows moved or failed.
    async fn fan_out_shard(&self, shard: i16, batch_size: i64) -> anyhow::Result<usize> {
        let mut tx = self.pool.begin().await.context("begin")?;
        if !outbox::try_lock_shard(&mut tx, shard)
            .await
            .context("lock shard")?
        {
            return Ok(0);
        }
        let names: Vec<String> = sqlx::query_scalar!(
            "SELECT destination FROM orders.webhook_destinations \
             WHERE spec IS NOT NULL AND removed_at IS NULL ORDER BY destination FOR KEY SHARE"
        )
        .fetch_all(&mut *tx)
        .await
        .context("read the destinations")?;
        if names.is_empty() {
            tx.commit().await.context("commit empty fan-out")?;
            return Ok(0);
        }
        let rows = outbox::read_shards(&mut tx, &[shard], batch_size)
            .await
            .context("read outbox batch")?
            .rows;
        if rows.is_empty() {
            tx.commit().await.context("commit empty read")?;
            return Ok(0);
        }
        let mut ready: Vec<(&PendingRow, Vec<u8>)> = Vec::with_capacity(rows.len());
        let mut rejected = Vec::new();
        let mut held = HashSet::new(); // keys with a row that is not JSON
        for row in &rows {
            if held.contains(&row.aggregate_id) {
                continue;
            }
            match row.encode() {
                Ok(body) => ready.push((row, body)),
                Err(error) => {
                    self.metrics
                        .relay_errors_total
                        .with_label_values(&["encode"])
                        .inc();
                    tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, %error, "outbox payload is not JSON");
                    rejected.push((row.id, format!("payload is not JSON: {error}")));
                    held.insert(row.aggregate_id);
                }
            }
        }
        let mut destination = Vec::new();
        let (mut ids, mut keys, mut msg_ids, mut bodies, mut created) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for name in &names {
            for (row, body) in &ready {
                destination.push(name.clone());
                ids.push(row.id);
                keys.push(row.aggregate_id);
                msg_ids.push(row.msg_id);
                bodies.push(body.clone());
                created.push(row.created_at);
            }
        }
        let written = sqlx::query!(
            "INSERT INTO orders.webhook_deliveries \
               (destination, outbox_id, aggregate_id, msg_id, body, created_at) \
             SELECT * FROM unnest($1::text[], $2::int8[], $3::uuid[], $4::uuid[], $5::bytea[], $6::timestamptz[]) \
             ON CONFLICT (destination, outbox_id) DO NOTHING",
            &destination,
            &ids,
            &keys,
            &msg_ids,
            &bodies,
            &created
        )
        .execute(&mut *tx)
        .await
        .context("write the deliveries")?
        .rows_affected();
        let moved: Vec<i64> = ready.iter().map(|(row, _)| row.id).collect();
        outbox::mark_published(&mut tx, &moved)
            .await
            .context("mark the moved rows published")?;
        if !rejected.is_empty() {
            // Not JSON: it never will be; failed at once (max attempts 1).
            outbox::record_failures(&mut tx, &rejected, 1)
                .await
                .context("record unpublishable rows")?;
        }
        tx.commit().await.context("commit the fan-out")?;
        self.metrics.relay_webhook_fanned_out_total.inc_by(written);
        self.metrics
            .relay_published_total
            .inc_by(moved.len() as u64);
        self.metrics
            .relay_rows_failed_total
            .inc_by(rejected.len() as u64);
        Ok(moved.len() + rejected.len())
    }

    /// One destination's deliveries: keeps up to its concurrency of attempts
    /// in flight; waits for a wake (new deliveries), an attempt's end (its
    /// key's next event may be due) or the poll.
    async fn deliver_loop(
        self: Arc<Self>,
        destination: Destination,
        poll: Duration,
        wake: Arc<Notify>,
        cancel: CancellationToken,
    ) {
        // A URL whose host is an address the policy refuses never starts
        // (its deliveries wait, pending, until the destination is changed or
        // the address allowed); a name is judged by the resolver at each
        // connection, so a name rebound to such an address is refused then.
        if let Err(refused) = self
            .egress
            .check_url(&destination.url, destination.allow_http)
        {
            self.metrics
                .relay_errors_total
                .with_label_values(&["destinations"])
                .inc();
            tracing::error!(
                destination = %destination.name,
                error = %refused,
                "not delivering to this destination: change its URL (relay webhooks add) \
                 or allow its network (--webhook-allow-addresses)"
            );
            return;
        }
        // Redirects are not followed (their target is a URL nobody checked),
        // and no proxy is taken from the environment (it would connect in
        // the resolver's place).
        let client = match self
            .egress
            .client_builder()
            .timeout(destination.timeout)
            .user_agent(concat!("effectively-relay/", env!("CARGO_PKG_VERSION")))
            .build()
        {
            Ok(client) => client,
            Err(error) => {
                tracing::error!(destination = %destination.name, %error, "building the HTTP client failed");
                return;
            }
        };
        let destination = Arc::new(destination);
        let permits = Arc::new(Semaphore::new(destination.concurrency));
        let mut attempts: JoinSet<()> = JoinSet::new();
        let mut backoff = Backoff::new();
        let lease = destination.timeout + LEASE_MARGIN;
        loop {
            if cancel.is_cancelled() {
                break;
            }
            while attempts.try_join_next().is_some() {}
            let free = permits.available_permits();
            let claimed = if free == 0 {
                Ok(Vec::new())
            } else {
                claim(&self.pool, &destination.name, free, lease).await
            };
            let claimed = match claimed {
                Ok(rows) => {
                    backoff.reset();
                    rows
                }
                Err(error) => {
                    self.metrics
                        .relay_errors_total
                        .with_label_values(&["claim"])
                        .inc();
                    tracing::warn!(destination = %destination.name, %error, "claiming webhook deliveries failed; will retry");
                    if !backoff.wait(&cancel).await {
                        break;
                    }
                    continue;
                }
            };
            if claimed.is_empty() {
                tokio::select! {
                    () = wake.notified() => {}
                    Some(_) = attempts.join_next(), if !attempts.is_empty() => {}
                    () = tokio::time::sleep(poll) => {}
                    () = cancel.cancelled() => break,
                }
                continue;
            }
            for row in claimed {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    break;
                };
                let (sender, destination, client) =
                    (self.clone(), destination.clone(), client.clone());
                attempts.spawn(async move {
                    sender.attempt(&destination, &client, row).await;
                    drop(permit);
                });
            }
        }
        // The attempts in flight end within their timeout; their outcome is
        // recorded (a delivery left unrecorded is due again after its lease).
        while attempts.join_next().await.is_some() {}
    }

    /// One attempt: send, judge, record.
    async fn attempt(&self, destination: &Destination, client: &reqwest::Client, row: Claimed) {
        let started_at = Utc::now();
        let started = Instant::now();
        let id = row.msg_id.to_string();
        let timestamp = started_at.timestamp();
        let signature = webhook::signature_header(&destination.secrets, &id, timestamp, &row.body);
        let sent = client
            .post(destination.url.clone())
            .header(webhook::HEADER_ID, &id)
            .header(webhook::HEADER_TIMESTAMP, timestamp.to_string())
            .header(webhook::HEADER_SIGNATURE, signature)
            .header(pipeline::contract::IDEMPOTENCY_KEY, &id)
            .header(CONTENT_TYPE, "application/json")
            .body(row.body.clone())
            .send()
            .await;
        let name = destination.name.as_str();
        let outcome = match sent {
            Ok(response) => {
                let status = response.status().as_u16();
                if let Some(skew) = clock_skew(response.headers(), SystemTime::now()) {
                    self.clock_skew(name, skew);
                }
                let after = retry_after(response.headers());
                let body = if response.status().is_success() {
                    String::new()
                } else {
                    error_body(response).await
                };
                judge(status, after, &body)
            }
            Err(error) => Outcome::Retry {
                status: None,
                error: describe(&error),
                retry_after: None,
            },
        };
        let elapsed = started.elapsed();
        let status = match &outcome {
            Outcome::Delivered(status) => Some(*status),
            Outcome::Gone(_) => Some(410),
            Outcome::Retry { status, .. } => *status,
        };
        self.metrics
            .relay_webhook_responses_total
            .with_label_values(&[
                name,
                &status.map_or_else(|| "none".to_owned(), |s| s.to_string()),
            ])
            .inc();
        self.metrics
            .relay_webhook_attempt_duration_seconds
            .with_label_values(&[name])
            .observe(elapsed.as_secs_f64());
        if matches!(outcome, Outcome::Delivered(_)) {
            // The receiver has it; it is not marked. A crash here delivers
            // it again: the receiver's duplicate.
            self.crasher.point(CrashPoint::Deliver);
        }
        let jitter = rand::rng().random::<f64>();
        let mut backoff = Backoff::new();
        let mut tries = 0;
        let recorded = loop {
            match self
                .record(destination, &row, &outcome, started_at, elapsed, jitter)
                .await
            {
                Ok(recorded) => break recorded,
                Err(error) => {
                    self.metrics
                        .relay_errors_total
                        .with_label_values(&["record"])
                        .inc();
                    tracing::warn!(destination = name, outbox_id = row.outbox_id, %error, "recording a webhook attempt failed; retrying");
                    tries += 1;
                    if tries >= RECORD_TRIES {
                        // Given up: the lease runs out and the delivery is
                        // attempted again (at least once).
                        return;
                    }
                    backoff.wait(&CancellationToken::new()).await;
                }
            }
        };
        let Some(label) = recorded else {
            return; // the lease had run out; another attempt owns the row
        };
        self.metrics
            .relay_webhook_attempts_total
            .with_label_values(&[name, label])
            .inc();
        if label == "failed" {
            // Given up after its last attempt: the alert.
            self.metrics
                .relay_webhook_failed_total
                .with_label_values(&[name])
                .inc();
        }
        match &outcome {
            Outcome::Delivered(_) => {
                let age = (Utc::now() - row.created_at)
                    .num_microseconds()
                    .unwrap_or(0) as f64
                    / 1e6;
                self.metrics
                    .relay_webhook_commit_to_delivered_seconds
                    .with_label_values(&[name])
                    .observe(age.max(0.0));
            }
            Outcome::Gone(error) => tracing::error!(
                destination = name, outbox_id = row.outbox_id, %error,
                "the destination answered 410 Gone: disabled; its deliveries wait (relay webhooks enable)"
            ),
            Outcome::Retry { error, status, .. } if label == "failed" => tracing::error!(
                destination = name, outbox_id = row.outbox_id, msg_id = %row.msg_id,
                attempts = row.attempts, ?status, %error, hint = hint(*status),
                "webhook delivery failed after its last attempt (relay webhooks replay --failed)"
            ),
            Outcome::Retry { error, status, .. } => tracing::warn!(
                destination = name, outbox_id = row.outbox_id, attempts = row.attempts,
                ?status, %error, hint = hint(*status), "webhook attempt failed; will retry"
            ),
        }
    }

    /// Sets a destination's measured clock skew (receiver minus sender,
    /// seconds) and warns, at most every `CLOCK_SKEW_WARN_EVERY`, when it is
    /// past `CLOCK_SKEW_WARN`.
    fn clock_skew(&self, destination: &str, skew: f64) {
        self.metrics
            .relay_webhook_clock_skew_seconds
            .with_label_values(&[destination])
            .set(skew);
        if skew.abs() <= CLOCK_SKEW_WARN.as_secs_f64() {
            return;
        }
        let now = Instant::now();
        {
            let Ok(mut warned) = self.skew_warned.lock() else {
                return;
            };
            if warned
                .get(destination)
                .is_some_and(|at| now.duration_since(*at) < CLOCK_SKEW_WARN_EVERY)
            {
                return;
            }
            warned.insert(destination.to_owned(), now);
        }
        let (ahead, seconds) = if skew > 0.0 {
            ("ahead of", skew)
        } else {
            ("behind", -skew)
        };
        tracing::warn!(
            destination,
            skew_seconds = skew,
            "the sender's and the receiver's clocks differ by {seconds:.0} s (the receiver's \
             answer is dated {seconds:.0} s {ahead} the sender's clock): signatures fail once \
             that exceeds the receiver's timestamp tolerance ({} s in the Standard Webhooks \
             libraries), and every attempt is then refused with 401; fix the clock that is wrong",
            webhook::DEFAULT_TOLERANCE.as_secs()
        );
    }

    /// Writes an attempt's outcome, fenced by the attempt number (a late
    /// answer after the lease ran out and another attempt took the row is
    /// not written over it). Returns the outcome's label, or `None` when
    /// fenced out.
    async fn record(
        &self,
        destination: &Destination,
        row: &Claimed,
        outcome: &Outcome,
        started_at: DateTime<Utc>,
        elapsed: Duration,
        jitter: f64,
    ) -> sqlx::Result<Option<&'static str>> {
        let failed_attempts = u32::try_from(row.attempts).unwrap_or(1);
        let last = failed_attempts >= destination.max_attempts;
        let (label, status, error, next) = match outcome {
            Outcome::Delivered(status) => ("delivered", Some(*status), None, None),
            Outcome::Gone(error) => (
                "gone",
                Some(410),
                Some(error.as_str()),
                Some(Duration::ZERO),
            ),
            Outcome::Retry { status, error, .. } if last => {
                ("failed", *status, Some(error.as_str()), None)
            }
            Outcome::Retry {
                status,
                error,
                retry_after,
            } => (
                "retry",
                *status,
                Some(error.as_str()),
                Some(next_wait(failed_attempts, self.scale, jitter, *retry_after)),
            ),
        };
        let status = status.map(i32::from);
        let error = error.map(effectively::text::storable);
        let next_ms = next.map(|d| d.as_secs_f64() * 1000.0);
        let mut tx = self.pool.begin().await?;
        let updated = sqlx::query!(
            "UPDATE orders.webhook_deliveries SET \
               last_status = $4, last_error = $5, \
               delivered_at = CASE WHEN $6 = 'delivered' THEN now() END, \
               failed_at = CASE WHEN $6 = 'failed' THEN now() END, \
               next_attempt_at = CASE WHEN $7::float8 IS NULL THEN next_attempt_at \
                                      ELSE now() + $7::float8 * interval '1 millisecond' END \
             WHERE destination = $1 AND outbox_id = $2 AND attempts = $3 AND replays = $8 \
               AND delivered_at IS NULL AND failed_at IS NULL",
            destination.name,
            row.outbox_id,
            row.attempts,
            status,
            error.as_deref(),
            label,
            next_ms,
            row.replays
        )
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if updated == 0 {
            tx.rollback().await?;
            return Ok(None);
        }
        sqlx::query!(
            "INSERT INTO orders.webhook_attempts \
               (destination, outbox_id, replay, attempt, started_at, duration_ms, status, outcome, error) \
             VALUES ($1, $2, $9, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
            destination.name,
            row.outbox_id,
            row.attempts,
            started_at,
            i32::try_from(elapsed.as_millis()).unwrap_or(i32::MAX),
            status,
            label,
            error.as_deref(),
            row.replays
        )
        .execute(&mut *tx)
        .await?;
        if label == "gone" {
            sqlx::query!(
                "UPDATE orders.webhook_destinations SET disabled_at = now(), reason = $2 \
                 WHERE destination = $1 AND disabled_at IS NULL",
                destination.name,
                error.as_deref()
            )
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(Some(label))
    }

    /// Every second: each destination's open deliveries.
    async fn sample_pending(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            match sqlx::query!(
                r#"SELECT w.destination AS "destination!", count(d.outbox_id) AS "n!"
                   FROM orders.webhook_destinations w
                   LEFT JOIN orders.webhook_deliveries d ON d.destination = w.destination
                     AND d.delivered_at IS NULL AND d.failed_at IS NULL
                   WHERE w.spec IS NOT NULL AND w.removed_at IS NULL
                   GROUP BY w.destination"#
            )
            .fetch_all(&self.pool)
            .await
            {
                Ok(rows) => {
                    for row in rows {
                        self.metrics
                            .relay_webhook_pending
                            .with_label_values(&[row.destination.as_str()])
                            .set(row.n);
                    }
                }
                Err(error) => tracing::debug!(%error, "sample webhook deliveries"),
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = cancel.cancelled() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests;
