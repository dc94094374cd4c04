//! `relay --sink http`: the outbox delivered as signed webhooks.
//!
//! Two stages, each at least once and each keeping per-key order:
//!
//! 1. **Fan-out.** The shard loop of the Kafka sink, with the same claim
//!    (`outbox::claim`: the first pending row of each key, under the shard's
//!    lock), writes one row per destination into `orders.webhook_deliveries`
//!    and marks the outbox rows published, in the claim's transaction: the
//!    hop from the outbox to the deliveries can neither lose nor double.
//! 2. **Delivery**, per destination, each with its own loop, client, timeout
//!    and concurrency, so a slow or dead destination delays no other. A
//!    claim takes due deliveries whose key has no earlier open delivery to
//!    that destination (so a key's later event waits until the earlier one
//!    was delivered or given up), counts the attempt and moves
//!    `next_attempt_at` past its timeout (the lease). The request carries
//!    the Standard Webhooks headers (`webhook-id` = the msg_id on every
//!    attempt, a fresh `webhook-timestamp`, `webhook-signature` under every
//!    secret of the destination) and `Idempotency-Key`. The answer decides:
//!    2xx delivered (crash point `deliver` between the 2xx and the mark: the
//!    re-delivery is the receiver's duplicate); 410 disables the destination
//!    (`orders.webhook_destinations`) and leaves the delivery pending;
//!    anything else (every other status, 4xx included, or no answer) is
//!    retried on the schedule of `effectively::webhook` (5 s, 30 s, 5 min,
//!    30 min, 4 h, ... ×[0.8, 1.2] jitter; a `Retry-After` up to 4 h is
//!    honoured if longer) until its last attempt, then fails (ERROR log,
//!    `relay_webhook_failed_total`). No status fails a delivery at once: a
//!    4xx is often the receiver's passing state, not the message's (a 401
//!    from a receiver whose clock is off by more than its signature
//!    tolerance, or whose secret was rotated before the sender's), so it
//!    gets the whole schedule, as large webhook senders give it. Every
//!    attempt is also a row of `orders.webhook_attempts`; every answer is
//!    counted by status (`relay_webhook_responses_total`), and its `Date`
//!    gives the receiver's clock skew (`relay_webhook_clock_skew_seconds`,
//!    a WARN past [`CLOCK_SKEW_WARN`]).

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use chrono::{DateTime, Utc};
use effectively::contract::CrashPoint;
use effectively::crash::Crasher;
use effectively::retry::Backoff;
use effectively::webhook::{self, Secret};
use rand::Rng;
use reqwest::header::{CONTENT_TYPE, DATE, HeaderMap, RETRY_AFTER};
use sqlx::PgPool;
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::metrics::RelayMetrics;
use crate::outbox::{self, PendingRow, SHARDS};

/// The default timeout of one attempt.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a running relay reads the destinations again.
pub const DESTINATIONS_REFRESH: Duration = Duration::from_secs(2);

/// Each running destination's wake, by name: the fan-out notifies them all.
type Wakes = Arc<Mutex<HashMap<String, Arc<Notify>>>>;

/// The default number of attempts in flight to one destination.
pub const DEFAULT_CONCURRENCY: usize = 16;
/// How much longer than its timeout an attempt's lease lasts: a sender that
/// died mid-attempt leaves the delivery due again after this.
const LEASE_MARGIN: Duration = Duration::from_secs(5);
/// How many times an attempt's outcome is written before it is left to the
/// lease (the backoff's waits add up to about 13 s).
const RECORD_TRIES: u32 = 8;
/// The most of an error answer's body kept in `last_error`.
const ERROR_BODY_BYTES: usize = 256;
/// How far a receiver's clock (its answer's `Date`) may be from the
/// sender's before the sender warns. The receiver refuses a signature whose
/// `webhook-timestamp` is further from its own clock than its tolerance
/// (`webhook::DEFAULT_TOLERANCE`, 5 minutes, in every Standard Webhooks
/// library), answering 401 to every attempt however often it is retried.
/// A `Date` is whole seconds and servers cache it up to a second, so a
/// measured skew is good to about 2 s: 60 s is far above that noise and
/// well inside the tolerance, so the warning comes while signatures still
/// verify, before the clocks drift far enough apart to refuse them all.
pub const CLOCK_SKEW_WARN: Duration = Duration::from_secs(60);
/// The least time between two clock-skew warnings for one destination (the
/// gauge has every measurement).
const CLOCK_SKEW_WARN_EVERY: Duration = Duration::from_secs(60);

/// One destination: where, signed with what, how patiently.
#[derive(Clone)]
pub struct Destination {
    /// Its name: the label of its metrics and its rows.
    pub name: String,
    /// The URL posted to.
    pub url: reqwest::Url,
    /// The signing secrets (several during a rotation).
    pub secrets: Vec<Secret>,
    /// One attempt's timeout (at most `webhook::MAX_ATTEMPT_TIMEOUT`).
    pub timeout: Duration,
    /// Attempts in flight at once.
    pub concurrency: usize,
    /// Attempts before a delivery fails (at most `webhook::MAX_ATTEMPTS`).
    pub max_attempts: u32,
    /// The text it was parsed from (secrets included), as stored in
    /// `orders.webhook_destinations.spec`.
    spec: String,
}

impl fmt::Debug for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Destination")
            .field("name", &self.name)
            .field("url", &self.url.as_str())
            .field("secrets", &self.secrets.len())
            .field("timeout", &self.timeout)
            .field("concurrency", &self.concurrency)
            .field("max_attempts", &self.max_attempts)
            .finish()
    }
}

/// `--webhook-destination`'s syntax, for its errors.
const DESTINATION_SYNTAX: &str =
    "NAME=URL,secret=whsec_...[,secret=...][,timeout=10s][,concurrency=16][,max-attempts=8]";

impl FromStr for Destination {
    type Err = String;

    /// `NAME=URL,secret=whsec_…[,secret=…][,timeout=10s][,concurrency=16][,max-attempts=8]`.
    /// The errors never quote a secret.
    fn from_str(text: &str) -> Result<Self, String> {
        let mut parts = text.trim().split(',');
        let head = parts.next().unwrap_or_default();
        let (name, url) = head
            .split_once('=')
            .ok_or_else(|| format!("a destination is {DESTINATION_SYNTAX}"))?;
        let name = name.trim();
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(format!(
                "destination name {name:?}: 1 to 64 letters, digits, '-' or '_'"
            ));
        }
        let url = reqwest::Url::parse(url.trim())
            .map_err(|e| format!("destination {name}: URL {:?}: {e}", url.trim()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!("destination {name}: the URL must be http or https"));
        }
        let mut destination = Destination {
            name: name.to_owned(),
            url,
            secrets: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            concurrency: DEFAULT_CONCURRENCY,
            max_attempts: webhook::MAX_ATTEMPTS,
            spec: text.trim().to_owned(),
        };
        for part in parts {
            let (key, value) = part.split_once('=').ok_or_else(|| {
                format!("destination {name}: {part:?} is not key=value ({DESTINATION_SYNTAX})")
            })?;
            let value = value.trim();
            match key.trim() {
                "secret" => destination
                    .secrets
                    .push(Secret::parse(value).map_err(|e| format!("destination {name}: {e}"))?),
                "timeout" => {
                    let t = humantime::parse_duration(value)
                        .map_err(|e| format!("destination {name}: timeout {value:?}: {e}"))?;
                    if t.is_zero() || t > webhook::MAX_ATTEMPT_TIMEOUT {
                        return Err(format!(
                            "destination {name}: timeout {value} must be over 0 and at most {}",
                            humantime::format_duration(webhook::MAX_ATTEMPT_TIMEOUT)
                        ));
                    }
                    destination.timeout = t;
                }
                "concurrency" => {
                    destination.concurrency = value
                        .parse()
                        .ok()
                        .filter(|c| (1..=1024).contains(c))
                        .ok_or_else(|| {
                            format!("destination {name}: concurrency {value:?} must be 1 to 1024")
                        })?;
                }
                "max-attempts" => {
                    destination.max_attempts = value
                        .parse()
                        .ok()
                        .filter(|a| (1..=webhook::MAX_ATTEMPTS).contains(a))
                        .ok_or_else(|| {
                            format!(
                                "destination {name}: max-attempts {value:?} must be 1 to {} \
                                 (the receiver's horizon assumes no more)",
                                webhook::MAX_ATTEMPTS
                            )
                        })?;
                }
                other => {
                    return Err(format!(
                        "destination {name}: unknown setting {other:?} ({DESTINATION_SYNTAX})"
                    ));
                }
            }
        }
        if destination.secrets.is_empty() {
            return Err(format!(
                "destination {name}: a secret=whsec_... is required (every request is signed)"
            ));
        }
        Ok(destination)
    }
}

/// A delivery claimed for one attempt.
#[derive(Debug, Clone)]
struct Claimed {
    outbox_id: i64,
    msg_id: Uuid,
    body: Vec<u8>,
    /// This attempt's number (1 for the first; a replay starts over).
    attempts: i32,
    /// The replay this attempt belongs to (0: the first run).
    replays: i32,
    created_at: DateTime<Utc>,
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// 2xx.
    Delivered(u16),
    /// Tried again on the schedule (failed after the last attempt): any
    /// status but 2xx and 410 (a 4xx too: see the module docs), or no
    /// answer. With the receiver's `Retry-After`, if any.
    Retry {
        /// The status, if there was an answer.
        status: Option<u16>,
        /// Why, readable.
        error: String,
        /// The receiver's `Retry-After`.
        retry_after: Option<Duration>,
    },
    /// 410: the destination is gone.
    Gone(String),
}

/// The outcome of an answer's status (and its `Retry-After`): 2xx
/// delivered, 410 gone, anything else retried. No status fails a delivery
/// at once: a 4xx may be the receiver's passing state (a clock off by more
/// than its signature tolerance, a secret it rotated before the sender, a
/// deploy that broke it) rather than the message's, and the schedule gives
/// it days to recover; a message the receiver will never take fails after
/// its last attempt, visibly, and waits for `relay webhooks replay`.
pub fn judge(status: u16, retry_after: Option<Duration>, body: &str) -> Outcome {
    let error = || {
        let body = body.trim();
        if body.is_empty() {
            format!("HTTP {status}")
        } else {
            format!("HTTP {status}: {body}")
        }
    };
    match status {
        200..=299 => Outcome::Delivered(status),
        410 => Outcome::Gone(error()),
        _ => Outcome::Retry {
            status: Some(status),
            error: error(),
            retry_after,
        },
    }
}

/// `Retry-After` in seconds (the HTTP-date form is not taken: receivers of
/// webhooks send seconds), capped at `webhook::MAX_RETRY_AFTER`.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let seconds: u64 = headers
        .get(RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds).min(webhook::MAX_RETRY_AFTER))
}

/// The receiver's clock minus the sender's, in seconds, from an answer's
/// `Date` (an HTTP-date, whole seconds) and the sender's clock `now` when
/// the answer came; `None` without a readable `Date`.
pub fn clock_skew(headers: &HeaderMap, now: SystemTime) -> Option<f64> {
    let date = httpdate::parse_http_date(headers.get(DATE)?.to_str().ok()?).ok()?;
    Some(match date.duration_since(now) {
        Ok(ahead) => ahead.as_secs_f64(),
        Err(behind) => -behind.duration().as_secs_f64(),
    })
}

/// A hint for the log of an attempt that was not delivered, by status.
fn hint(status: Option<u16>) -> &'static str {
    match status {
        Some(401 | 403) => {
            "the receiver refused the request, likely a signature it cannot verify: its clock off \
             by more than its tolerance (relay_webhook_clock_skew_seconds), or a secret it does \
             not hold (a rotation done on one side only)"
        }
        Some(400..=499) => "the receiver refused the request; retried, it may be a passing state",
        Some(300..=399) => "a redirect, not followed: configure the URL it points to",
        Some(500..=599) => "the receiver failed",
        Some(_) => "an unexpected status",
        None => "no answer",
    }
}

/// The wait before the next attempt after `failed` attempts: the schedule's
/// wait × `scale` × a jitter factor in `[JITTER_MIN, JITTER_MAX]` (`jitter`
/// in `[0, 1]` picks it), or the receiver's `Retry-After` if longer.
pub fn next_wait(failed: u32, scale: f64, jitter: f64, retry_after: Option<Duration>) -> Duration {
    let factor =
        webhook::JITTER_MIN + (webhook::JITTER_MAX - webhook::JITTER_MIN) * jitter.clamp(0.0, 1.0);
    let scheduled = webhook::retry_wait(failed).mul_f64(scale.max(0.0) * factor);
    retry_after.map_or(scheduled, |r| scheduled.max(r))
}

/// What the sender's loops share.
pub struct Sender {
    pool: PgPool,
    metrics: Arc<RelayMetrics>,
    crasher: Arc<Crasher>,
    /// Every scheduled wait is multiplied by this (tests and experiments
    /// shrink the hours to seconds; 1 in production).
    scale: f64,
    /// When each destination's clock skew was last warned about.
    skew_warned: Mutex<HashMap<String, Instant>>,
}

impl Sender {
    /// A sender on `pool`.
    pub fn new(
        pool: PgPool,
        metrics: Arc<RelayMetrics>,
        crasher: Arc<Crasher>,
        scale: f64,
    ) -> Self {
        Self {
            pool,
            metrics,
            crasher,
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
            match active(&self.pool).await {
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
                        .with_label_values(&["db"])
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
                        .with_label_values(&["db"])
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

    /// One shard: claim, write the deliveries to every destination of
    /// `orders.webhook_destinations` (read in this transaction, FOR KEY
    /// SHARE: a removal waits for this commit), mark published, commit.
    /// With no destination nothing is claimed: the rows wait. Returns how
    /// many outbox rows moved.
    async fn fan_out_shard(&self, shard: i16, batch_size: i64) -> anyhow::Result<usize> {
        let mut tx = self.pool.begin().await.context("begin")?;
        if !outbox::try_lock_shard(&mut tx, shard, 0)
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
        let rows = outbox::claim(&mut tx, shard, batch_size)
            .await
            .context("claim outbox batch")?;
        if rows.is_empty() {
            tx.commit().await.context("commit empty claim")?;
            return Ok(0);
        }
        let mut ready: Vec<(&PendingRow, Vec<u8>)> = Vec::with_capacity(rows.len());
        let mut rejected = Vec::new();
        for row in &rows {
            match row.encode() {
                Ok(body) => ready.push((row, body)),
                Err(error) => {
                    self.metrics
                        .relay_errors_total
                        .with_label_values(&["encode"])
                        .inc();
                    tracing::warn!(outbox_id = row.id, msg_id = %row.msg_id, %error, "outbox payload is not JSON");
                    rejected.push((row.id, format!("payload is not JSON: {error}")));
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
            .context("mark published")?;
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
        Ok(rows.len())
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
        let client = match reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
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
                        .with_label_values(&["db"])
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
            .header(effectively::contract::IDEMPOTENCY_KEY, &id)
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
                        .with_label_values(&["db"])
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

/// Deletes up to `batch` deliveries delivered longer ago than the outbox
/// retention (`orders.outbox_policy`), with their attempts; returns how
/// many. Pending and failed deliveries are never deleted (a failed one waits
/// for `relay webhooks replay` or an operator).
pub async fn expire(pool: &PgPool, batch: i32) -> sqlx::Result<i32> {
    let n = sqlx::query_scalar!(
        r#"WITH gone AS (
             DELETE FROM orders.webhook_deliveries d
             WHERE (d.destination, d.outbox_id) IN (
               SELECT e.destination, e.outbox_id FROM orders.webhook_deliveries e
               WHERE e.delivered_at < now() - (SELECT p.retention FROM orders.outbox_policy p)
               LIMIT $1)
             RETURNING d.destination, d.outbox_id),
           a AS (
             DELETE FROM orders.webhook_attempts t USING gone
             WHERE t.destination = gone.destination AND t.outbox_id = gone.outbox_id)
           SELECT count(*) AS "n!" FROM gone"#,
        i64::from(batch)
    )
    .fetch_one(pool)
    .await?;
    Ok(i32::try_from(n).unwrap_or(i32::MAX))
}

/// `relay webhooks ...`: what an operator does with the deliveries.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Admin {
    /// Sends failed deliveries again: each becomes pending with its attempts
    /// reset (its `replays` counts this). A replayed delivery goes after any
    /// later event of its key that was delivered meanwhile. Running relays
    /// take them within their poll interval.
    Replay {
        /// Replay the failed deliveries (required: the only selection so far).
        #[arg(long, required = true)]
        failed: bool,
        /// Only this destination's.
        #[arg(long)]
        destination: Option<String>,
        /// Only those that failed since: an RFC 3339 time
        /// (2026-11-24T08:00:00Z) or a duration ago (90m, 2h, 1d).
        #[arg(long, value_parser = parse_since)]
        since: Option<DateTime<Utc>>,
        #[command(flatten)]
        horizon: ReceiverHorizon,
    },
    /// Enables a destination a 410 Gone disabled; its waiting deliveries go.
    Enable {
        /// The destination.
        #[arg(long)]
        destination: String,
        #[command(flatten)]
        horizon: ReceiverHorizon,
    },
    /// Each destination's deliveries: pending, delivered, failed, and
    /// whether it is disabled or removed.
    Status,
    /// Adds a destination, or replaces one's settings: every relay fans the
    /// events committed from now on out to it too (within
    /// `DESTINATIONS_REFRESH`), and delivers them.
    Add {
        /// NAME=URL,secret=whsec_...[,secret=...][,timeout=10s][,concurrency=16][,max-attempts=8]
        destination: Destination,
    },
    /// Removes a destination: no later event is fanned out to it, and its
    /// pending deliveries are marked failed at once ("the destination was
    /// removed"); add it again and `replay --failed --destination NAME` to
    /// send them after all. To let them be delivered first, wait until
    /// `status` shows it has none pending.
    Remove {
        /// The destination's name.
        #[arg(long)]
        destination: String,
    },
}

/// How far back the receiver remembers, for the commands that send old
/// events again. Past its dedup horizon (payments' `--inbox-retention`, 16
/// days by default) a receiver refuses an event as `after_horizon` and
/// dead-letters it, because it can no longer tell a first delivery from a
/// duplicate; sending such events is refused here unless told to skip them.
#[derive(Debug, Clone, clap::Args)]
pub struct ReceiverHorizon {
    /// The receiver's dedup horizon: its inbox retention (payments
    /// `--inbox-retention`). Events minted longer ago than this are past it.
    #[arg(long = "receiver-horizon", value_parser = humantime::parse_duration, default_value = "16d")]
    pub receiver_horizon: std::time::Duration,
    /// Leave the deliveries of events past the receiver's horizon out (they
    /// stay failed, and `enable` marks its waiting ones failed) instead of
    /// refusing the whole command.
    #[arg(long)]
    pub skip_past_horizon: bool,
}

impl Default for ReceiverHorizon {
    fn default() -> Self {
        Self {
            receiver_horizon: std::time::Duration::from_secs(16 * 86_400),
            skip_past_horizon: false,
        }
    }
}

impl ReceiverHorizon {
    /// The horizon as a PostgreSQL interval's seconds.
    fn seconds(&self) -> f64 {
        self.receiver_horizon.as_secs_f64()
    }

    /// The refusal when `n` deliveries are past the horizon and
    /// `--skip-past-horizon` was not given.
    fn refusal(&self, n: i64, what: &str) -> anyhow::Error {
        anyhow::anyhow!(
            "{n} of the {what} carry events minted more than {} ago, past the receiver's dedup \
             horizon (--receiver-horizon, its --inbox-retention): it would refuse them as \
             after_horizon and dead-letter them, so nothing was done. Give --skip-past-horizon \
             to send only the younger ones (the older stay failed); for each older one, check \
             at the receiver whether its effect exists (payments.charges by order id) and apply \
             the missing ones there by hand",
            humantime::format_duration(self.receiver_horizon)
        )
    }
}

/// `--since`: an RFC 3339 time, or a duration before now.
fn parse_since(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s.trim()) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = humantime::parse_duration(s.trim()).map_err(|_| {
        format!("{s:?}: an RFC 3339 time (2026-11-24T08:00:00Z) or a duration ago (90m, 2h, 1d)")
    })?;
    chrono::Duration::from_std(ago)
        .ok()
        .and_then(|d| Utc::now().checked_sub_signed(d))
        .ok_or_else(|| format!("{s:?}: too far back"))
}

impl Admin {
    /// Runs the command; returns what to print.
    pub async fn run(&self, pool: &PgPool) -> anyhow::Result<String> {
        match self {
            Admin::Replay {
                failed: _,
                destination,
                since,
                horizon,
            } => {
                let (replayed, skipped) =
                    replay_failed(pool, destination.as_deref(), *since, horizon).await?;
                let mut out = format!("{replayed} failed deliveries queued again\n");
                if skipped > 0 {
                    out.push_str(&format!(
                        "{skipped} left failed: their events are past the receiver's horizon\n"
                    ));
                }
                Ok(out)
            }
            Admin::Enable {
                destination,
                horizon,
            } => enable(pool, destination, horizon).await,
            Admin::Add { destination } => {
                upsert(pool, std::slice::from_ref(destination)).await?;
                Ok(format!(
                    "destination {} delivers to {}; running relays take it within {}\n",
                    destination.name,
                    destination.url,
                    humantime::format_duration(DESTINATIONS_REFRESH)
                ))
            }
            Admin::Remove { destination } => {
                let failed = remove(pool, destination).await?;
                Ok(format!(
                    "destination {destination} removed; {failed} pending deliveries marked failed\n"
                ))
            }
            Admin::Status => {
                let rows = sqlx::query!(
                    r#"SELECT w.destination AS "destination!", w.disabled_at, w.reason, w.removed_at,
                              count(d.outbox_id) FILTER (WHERE d.delivered_at IS NULL AND d.failed_at IS NULL) AS "pending!",
                              count(d.outbox_id) FILTER (WHERE d.delivered_at IS NOT NULL) AS "delivered!",
                              count(d.outbox_id) FILTER (WHERE d.failed_at IS NOT NULL) AS "failed!"
                       FROM orders.webhook_destinations w
                       LEFT JOIN orders.webhook_deliveries d ON d.destination = w.destination
                       GROUP BY w.destination, w.disabled_at, w.reason, w.removed_at ORDER BY w.destination"#
                )
                .fetch_all(pool)
                .await?;
                let mut out = format!(
                    "{:<24} {:>10} {:>12} {:>8}  state\n",
                    "destination", "pending", "delivered", "failed"
                );
                for r in rows {
                    let state = match (r.removed_at, r.disabled_at) {
                        (Some(at), _) => format!("removed since {at}"),
                        (None, Some(at)) => {
                            format!("disabled since {at}: {}", r.reason.unwrap_or_default())
                        }
                        (None, None) => "enabled".to_owned(),
                    };
                    out.push_str(&format!(
                        "{:<24} {:>10} {:>12} {:>8}  {state}\n",
                        r.destination, r.pending, r.delivered, r.failed
                    ));
                }
                Ok(out)
            }
        }
    }
}

/// Makes failed deliveries pending again (of `destination`, failed since
/// `since`, when given), but none whose event is past the receiver's
/// `horizon`: with any of those selected the command is refused, or with
/// `--skip-past-horizon` they stay failed. Returns (replayed, left failed).
pub async fn replay_failed(
    pool: &PgPool,
    destination: Option<&str>,
    since: Option<DateTime<Utc>>,
    horizon: &ReceiverHorizon,
) -> anyhow::Result<(u64, i64)> {
    // One statement: the selection, which of it is past the horizon, and
    // the replay of the rest, unless something is past it and not skipped
    // (then nothing changes and the command is refused).
    let (replayed, past): (i64, i64) = sqlx::query_as(
        "WITH sel AS ( \
           SELECT destination, outbox_id, \
                  msg_id < effectively.v7_floor(now() - make_interval(secs => $3)) AS past \
           FROM orders.webhook_deliveries \
           WHERE failed_at IS NOT NULL \
             AND ($1::text IS NULL OR destination = $1) \
             AND ($2::timestamptz IS NULL OR failed_at >= $2)), \
         go AS ( \
           UPDATE orders.webhook_deliveries d SET failed_at = NULL, attempts = 0, \
             next_attempt_at = now(), replays = d.replays + 1 \
           FROM sel \
           WHERE d.destination = sel.destination AND d.outbox_id = sel.outbox_id AND NOT sel.past \
             AND ($4 OR NOT EXISTS (SELECT 1 FROM sel WHERE sel.past)) \
           RETURNING 1) \
         SELECT (SELECT count(*) FROM go), (SELECT count(*) FROM sel WHERE sel.past)",
    )
    .bind(destination)
    .bind(since)
    .bind(horizon.seconds())
    .bind(horizon.skip_past_horizon)
    .fetch_one(pool)
    .await?;
    if past > 0 && !horizon.skip_past_horizon {
        return Err(horizon.refusal(past, "failed deliveries selected"));
    }
    Ok((u64::try_from(replayed).unwrap_or(0), past))
}

/// Enables `destination` (disabled by a 410); its waiting deliveries go,
/// but none whose event is past the receiver's horizon: with any of those
/// waiting the command is refused, or with `--skip-past-horizon` they are
/// marked failed (with the reason) first.
async fn enable(
    pool: &PgPool,
    destination: &str,
    horizon: &ReceiverHorizon,
) -> anyhow::Result<String> {
    let mut tx = pool.begin().await?;
    // The waiting deliveries past the horizon, marked failed only with
    // --skip-past-horizon (otherwise the command is refused, unchanged).
    let past: i64 = sqlx::query_scalar(
        "WITH past AS ( \
           SELECT outbox_id FROM orders.webhook_deliveries \
           WHERE destination = $1 AND delivered_at IS NULL AND failed_at IS NULL \
             AND msg_id < effectively.v7_floor(now() - make_interval(secs => $2))), \
         failed AS ( \
           UPDATE orders.webhook_deliveries d SET failed_at = now(), \
             last_error = 'past the receiver''s dedup horizon when the destination was enabled' \
           FROM past WHERE $3 AND d.destination = $1 AND d.outbox_id = past.outbox_id \
           RETURNING 1) \
         SELECT count(*) FROM past",
    )
    .bind(destination)
    .bind(horizon.seconds())
    .bind(horizon.skip_past_horizon)
    .fetch_one(&mut *tx)
    .await?;
    if past > 0 && !horizon.skip_past_horizon {
        return Err(horizon.refusal(past, "deliveries waiting for this destination"));
    }
    let was = sqlx::query_scalar!(
        "UPDATE orders.webhook_destinations SET disabled_at = NULL, reason = NULL \
         WHERE destination = $1 RETURNING destination",
        destination
    )
    .fetch_optional(&mut *tx)
    .await?;
    if was.is_none() {
        anyhow::bail!("no destination {destination:?} (relay webhooks status lists them)");
    }
    tx.commit().await?;
    let mut out = format!("destination {destination} enabled\n");
    if past > 0 {
        out.push_str(&format!(
            "{past} waiting deliveries marked failed: their events are past the receiver's horizon\n"
        ));
    }
    Ok(out)
}

/// The start of an error answer's body, for `last_error`: its first
/// `ERROR_BODY_BYTES`, read a chunk at a time and no further (the
/// destination is not trusted: its body may be gigabytes, or endless, and
/// reading it whole held the attempt to its timeout and the body in
/// memory). The rest is not read: dropping the response closes the
/// connection rather than returning it to the pool. A body that fails
/// midway keeps what arrived.
async fn error_body(mut response: reqwest::Response) -> String {
    let mut kept = Vec::with_capacity(ERROR_BODY_BYTES);
    while kept.len() < ERROR_BODY_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = ERROR_BODY_BYTES - kept.len();
                kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    String::from_utf8_lossy(&kept).into_owned()
}

/// A request error, readable: what failed (connect, timeout, ...).
fn describe(error: &reqwest::Error) -> String {
    let kind = if error.is_timeout() {
        "timed out"
    } else if error.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    let mut text = format!("{kind}: {error}");
    let mut source = std::error::Error::source(error);
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

/// Records the destinations (a destination's disabled state lives there).
/// Adds `destinations` to `orders.webhook_destinations`, or replaces the
/// spec of those there (a removed one is added again: its later events are
/// fanned out to it; its failed deliveries wait for `relay webhooks replay`).
pub async fn upsert(pool: &PgPool, destinations: &[Destination]) -> sqlx::Result<()> {
    let names: Vec<&str> = destinations.iter().map(|d| d.name.as_str()).collect();
    let specs: Vec<&str> = destinations.iter().map(|d| d.spec.as_str()).collect();
    sqlx::query!(
        "INSERT INTO orders.webhook_destinations (destination, spec) \
         SELECT * FROM unnest($1::text[], $2::text[]) \
         ON CONFLICT (destination) DO UPDATE SET spec = EXCLUDED.spec, removed_at = NULL, \
           added_at = CASE WHEN orders.webhook_destinations.removed_at IS NULL \
                                AND orders.webhook_destinations.spec IS NOT NULL \
                           THEN orders.webhook_destinations.added_at ELSE now() END",
        &names as &[&str],
        &specs as &[&str]
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The destinations fanned out to: in `orders.webhook_destinations`, with a
/// spec, not removed. A spec that no longer parses (written by another
/// version) is left out with an ERROR.
pub async fn active(pool: &PgPool) -> sqlx::Result<Vec<Destination>> {
    let rows = sqlx::query!(
        r#"SELECT destination, spec AS "spec!" FROM orders.webhook_destinations
           WHERE spec IS NOT NULL AND removed_at IS NULL ORDER BY destination"#
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| match r.spec.parse::<Destination>() {
            Ok(d) if d.name == r.destination => Some(d),
            Ok(d) => {
                tracing::error!(destination = r.destination, named = d.name, "a destination's spec names another destination; not delivering to it");
                None
            }
            Err(error) => {
                tracing::error!(destination = r.destination, %error, "a destination's spec does not parse; not delivering to it");
                None
            }
        })
        .collect())
}

/// Removes `name`: no later event is fanned out to it, and its pending
/// deliveries are marked failed ("the destination was removed"), in one
/// transaction that first locks the destination's row, so no fan-out
/// writes a delivery for it after. Returns how many were pending.
pub async fn remove(pool: &PgPool, name: &str) -> anyhow::Result<u64> {
    let mut tx = pool.begin().await?;
    let found: Option<i32> = sqlx::query_scalar!(
        "SELECT 1 FROM orders.webhook_destinations \
         WHERE destination = $1 AND spec IS NOT NULL AND removed_at IS NULL FOR UPDATE",
        name
    )
    .fetch_optional(&mut *tx)
    .await?
    .flatten();
    if found.is_none() {
        anyhow::bail!("no destination {name:?} (relay webhooks status lists them)");
    }
    sqlx::query!(
        "UPDATE orders.webhook_destinations SET removed_at = now() WHERE destination = $1",
        name
    )
    .execute(&mut *tx)
    .await?;
    let failed = sqlx::query!(
        "UPDATE orders.webhook_deliveries SET failed_at = now(), \
           last_error = 'the destination was removed (relay webhooks remove)' \
         WHERE destination = $1 AND delivered_at IS NULL AND failed_at IS NULL",
        name
    )
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(failed)
}

/// Claims up to `limit` due deliveries of `destination` for one attempt
/// each: none while the destination is disabled (a 410), and only those
/// whose key has no earlier open delivery to it (`OFFSET 0` keeps the
/// `NOT EXISTS` a probe per candidate, as in `outbox::claim`). Counts the
/// attempt and moves `next_attempt_at` a lease ahead.
async fn claim(
    pool: &PgPool,
    destination: &str,
    limit: usize,
    lease: Duration,
) -> sqlx::Result<Vec<Claimed>> {
    sqlx::query_as!(
        Claimed,
        "UPDATE orders.webhook_deliveries d \
         SET attempts = d.attempts + 1, last_attempt_at = now(), \
             next_attempt_at = now() + $3::float8 * interval '1 millisecond' \
         FROM (SELECT c.destination, c.outbox_id FROM orders.webhook_deliveries c \
               WHERE c.destination = $1 AND c.delivered_at IS NULL AND c.failed_at IS NULL \
                 AND c.next_attempt_at <= now() \
                 AND NOT EXISTS (SELECT 1 FROM orders.webhook_destinations w \
                                 WHERE w.destination = $1 AND w.disabled_at IS NOT NULL) \
                 AND NOT EXISTS (SELECT 1 FROM orders.webhook_deliveries e \
                                 WHERE e.destination = c.destination \
                                   AND e.aggregate_id = c.aggregate_id \
                                   AND e.outbox_id < c.outbox_id \
                                   AND e.delivered_at IS NULL AND e.failed_at IS NULL \
                                 OFFSET 0) \
               ORDER BY c.next_attempt_at, c.outbox_id LIMIT $2 \
               FOR UPDATE OF c SKIP LOCKED) AS picked \
         WHERE d.destination = picked.destination AND d.outbox_id = picked.outbox_id \
         RETURNING d.outbox_id, d.msg_id, d.body, d.attempts, d.replays, d.created_at",
        destination,
        i64::try_from(limit).unwrap_or(i64::MAX),
        lease.as_secs_f64() * 1000.0
    )
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A destination answering 500 with an endless body: the sender reads
    /// `ERROR_BODY_BYTES` of it and stops, at once, not at the attempt's
    /// timeout, and closes the connection (the destination stops sending).
    #[tokio::test]
    async fn an_endless_error_body_is_read_up_to_the_cap_and_no_further() {
        use std::sync::atomic::{AtomicU64, Ordering};
        // 16 KiB a millisecond, without end (paced, so that a sender that
        // reads it all does not fill this machine's memory in the test).
        const CHUNK: usize = 16 * 1024;
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        let endless = move || {
            let counter = counter.clone();
            async move {
                let chunks = futures::stream::unfold(counter, |counter| async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    counter.fetch_add(CHUNK as u64, Ordering::Relaxed);
                    let chunk = bytes::Bytes::from(vec![b'x'; CHUNK]);
                    Some((Ok::<_, std::convert::Infallible>(chunk), counter))
                });
                (
                    axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                    axum::body::Body::from_stream(chunks),
                )
            }
        };
        let app = axum::Router::new().route("/hook", axum::routing::post(endless));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client");

        let response = client.post(url).send().await.expect("an answer");
        assert_eq!(response.status().as_u16(), 500);
        let started = Instant::now();
        let body = tokio::time::timeout(Duration::from_secs(5), error_body(response))
            .await
            .expect("the read stops at the cap, long before the attempt's 60 s timeout");
        assert_eq!(body, "x".repeat(ERROR_BODY_BYTES));
        assert!(started.elapsed() < Duration::from_secs(1));
        // The connection is closed: the destination's writes fail and it
        // stops, having sent what the sockets' buffers took.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let stopped_at = sent.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            sent.load(Ordering::Relaxed),
            stopped_at,
            "the destination stopped"
        );
        assert!(
            stopped_at < 64 * 1024 * 1024,
            "{stopped_at} bytes sent: no more than the sockets' buffers"
        );
        server.abort();
    }

    #[test]
    fn the_answer_decides_delivered_gone_or_retried_and_no_status_fails_at_once() {
        assert_eq!(judge(200, None, ""), Outcome::Delivered(200));
        assert_eq!(judge(204, None, ""), Outcome::Delivered(204));
        assert!(matches!(judge(410, None, ""), Outcome::Gone(_)));
        // Every 4xx but 410 too: a 401 from a receiver whose clock or secret
        // disagrees with the sender's is retried, never failed at once.
        for status in [
            400, 401, 403, 404, 408, 409, 413, 415, 422, 425, 429, 451, 499, 500, 502, 503, 504,
            599, 301, 302, 304, 100,
        ] {
            assert_eq!(
                judge(status, Some(Duration::from_secs(3)), "no"),
                Outcome::Retry {
                    status: Some(status),
                    error: format!("HTTP {status}: no"),
                    retry_after: Some(Duration::from_secs(3)),
                },
                "{status} is retried"
            );
        }
        let Outcome::Retry {
            retry_after, error, ..
        } = judge(429, Some(Duration::from_secs(7)), " slow down ")
        else {
            panic!("429 is retried");
        };
        assert_eq!(retry_after, Some(Duration::from_secs(7)));
        assert_eq!(error, "HTTP 429: slow down");
    }

    #[test]
    fn the_clock_skew_is_the_receivers_date_minus_the_senders_clock() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut headers = HeaderMap::new();
        assert_eq!(clock_skew(&headers, now), None, "no Date");
        for (off, text) in [
            (0, "Fri, 15 Jan 2027 08:00:00 GMT"),
            (600, "Fri, 15 Jan 2027 08:10:00 GMT"),
            (-90, "Fri, 15 Jan 2027 07:58:30 GMT"),
        ] {
            headers.insert(DATE, text.parse().expect("value"));
            assert_eq!(clock_skew(&headers, now), Some(f64::from(off)), "{text}");
        }
        let later = now + Duration::from_millis(400);
        let skew = clock_skew(&headers, later).expect("a skew");
        assert!(
            (skew + 90.4).abs() < 1e-9,
            "the sender's clock to the sub-second: {skew}"
        );
        headers.insert(DATE, "yesterday".parse().expect("value"));
        assert_eq!(clock_skew(&headers, now), None, "not an HTTP-date");
        assert!(
            CLOCK_SKEW_WARN < webhook::DEFAULT_TOLERANCE,
            "the warning comes before signatures fail"
        );
    }

    #[test]
    fn waits_follow_the_schedule_with_jitter_and_honour_a_longer_retry_after() {
        let s = |secs: f64| Duration::from_secs_f64(secs);
        assert_eq!(next_wait(1, 1.0, 0.0, None), s(4.0), "5 s x 0.8");
        assert_eq!(next_wait(1, 1.0, 1.0, None), s(6.0), "5 s x 1.2");
        assert_eq!(next_wait(2, 1.0, 0.5, None), s(30.0));
        assert_eq!(next_wait(5, 1.0, 0.5, None), s(4.0 * 3600.0));
        assert_eq!(
            next_wait(7, 1.0, 0.5, None),
            s(4.0 * 3600.0),
            "the last repeats"
        );
        assert_eq!(
            next_wait(3, 0.01, 0.5, None),
            s(3.0),
            "scaled for experiments"
        );
        assert_eq!(
            next_wait(1, 1.0, 0.5, Some(s(60.0))),
            s(60.0),
            "a longer Retry-After wins"
        );
        assert_eq!(
            next_wait(4, 1.0, 0.5, Some(s(60.0))),
            s(1800.0),
            "a shorter one does not"
        );
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, "999999".parse().expect("value"));
        assert_eq!(
            retry_after(&headers),
            Some(webhook::MAX_RETRY_AFTER),
            "capped"
        );
        headers.insert(
            RETRY_AFTER,
            "Wed, 21 Oct 2026 07:28:00 GMT".parse().expect("value"),
        );
        assert_eq!(retry_after(&headers), None, "dates are not taken");
    }

    /// A sender paused past its lease (before the delivery failed and was
    /// replayed) records its stale result nowhere: the replay's attempt of
    /// the same number is another attempt. And the attempts log keeps both
    /// runs' attempt 1.
    #[tokio::test]
    async fn a_stale_result_from_before_a_replay_is_not_recorded_over_it() {
        use effectively::db::ServiceRole;
        let db = effectively::testing::TestDb::create().await;
        let pool = PgPool::connect(&db.url_as(ServiceRole::Relay))
            .await
            .expect("connect");
        let owner = PgPool::connect(&db.url).await.expect("connect");
        let secret = Secret::generate().to_whsec();
        let d: Destination = format!("p=http://127.0.0.1:9/h,secret={secret}")
            .parse()
            .expect("destination");
        sqlx::query(
            "INSERT INTO orders.webhook_deliveries (destination, outbox_id, aggregate_id, msg_id, body) \
             VALUES ('p', 1, $1, $2, '\\x7b7d')",
        )
        .bind(Uuid::now_v7())
        .bind(Uuid::now_v7())
        .execute(&owner)
        .await
        .expect("delivery");
        let sender = Sender::new(
            pool.clone(),
            Arc::new(RelayMetrics::new().expect("metrics")),
            Arc::new(Crasher::default()),
            1.0,
        );
        let lease = Duration::from_secs(60);
        let stale = claim(&pool, "p", 10, lease).await.expect("claim");
        assert_eq!(stale.len(), 1);
        // Meanwhile the delivery failed for good and an operator replayed it.
        sqlx::query("UPDATE orders.webhook_deliveries SET failed_at = now()")
            .execute(&owner)
            .await
            .expect("fail");
        let (replayed, _) = replay_failed(&pool, None, None, &ReceiverHorizon::default())
            .await
            .expect("replay");
        assert_eq!(replayed, 1);
        let fresh = claim(&pool, "p", 10, lease).await.expect("claim");
        assert_eq!(fresh.len(), 1);
        assert_eq!(fresh[0].attempts, stale[0].attempts, "the same number");

        let now = Utc::now();
        let gone = Outcome::Gone("stale".into());
        let recorded = sender
            .record(&d, &stale[0], &gone, now, Duration::ZERO, 0.5)
            .await
            .expect("record");
        assert_eq!(recorded, None, "the stale result is fenced off");
        let disabled: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM orders.webhook_destinations WHERE disabled_at IS NOT NULL",
        )
        .fetch_one(&owner)
        .await
        .expect("destinations");
        assert_eq!(disabled, 0, "nothing of the stale result took effect");
        let recorded = sender
            .record(
                &d,
                &fresh[0],
                &Outcome::Delivered(200),
                now,
                Duration::ZERO,
                0.5,
            )
            .await
            .expect("record");
        assert_eq!(recorded, Some("delivered"));
        let (delivered, logged): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM orders.webhook_deliveries WHERE delivered_at IS NOT NULL), \
                    (SELECT count(*) FROM orders.webhook_attempts WHERE replay = 1 AND attempt = 1)",
        )
        .fetch_one(&owner)
        .await
        .expect("state");
        assert_eq!((delivered, logged), (1, 1));
    }

    #[test]
    fn a_destination_parses_with_its_defaults_and_refuses_what_is_wrong() {
        let secret = Secret::generate().to_whsec();
        let d: Destination =
            format!("payments=http://127.0.0.1:9103/webhooks/orders,secret={secret}")
                .parse()
                .expect("parses");
        assert_eq!(d.name, "payments");
        assert_eq!(d.url.as_str(), "http://127.0.0.1:9103/webhooks/orders");
        assert_eq!(
            (d.timeout, d.concurrency, d.max_attempts, d.secrets.len()),
            (DEFAULT_TIMEOUT, DEFAULT_CONCURRENCY, 8, 1)
        );
        let other = Secret::generate().to_whsec();
        let d: Destination = format!(
            "a_b-1=https://example.com/h,secret={secret},secret={other},timeout=2s,concurrency=4,max-attempts=3"
        )
        .parse()
        .expect("parses");
        assert_eq!(
            (d.timeout, d.concurrency, d.max_attempts, d.secrets.len()),
            (Duration::from_secs(2), 4, 3, 2)
        );
        assert!(
            !format!("{d:?}").contains(&secret[6..]),
            "no secret in Debug"
        );
        for (text, wanted) in [
            ("payments", "NAME=URL"),
            ("=http://x/,secret=S", "destination name"),
            ("p=ftp://x/,secret=S", "http or https"),
            ("p=not a url,secret=S", "URL"),
            ("p=http://x/", "secret=whsec_"),
            ("p=http://x/,secret=short", "base64"),
            ("p=http://x/,secret=S,timeout=31s", "at most 30s"),
            ("p=http://x/,secret=S,concurrency=0", "concurrency"),
            ("p=http://x/,secret=S,max-attempts=9", "max-attempts"),
            ("p=http://x/,secret=S,colour=blue", "unknown setting"),
        ] {
            let text = text.replace("secret=S", &format!("secret={secret}"));
            let error = text.parse::<Destination>().expect_err(&text);
            assert!(error.contains(wanted), "{text}: {error}");
            assert!(
                !error.contains(&secret[6..]),
                "{text}: the error quotes no secret"
            );
        }
    }
}
