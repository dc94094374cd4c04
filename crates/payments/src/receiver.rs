//! Payments over HTTP (`--source http`): the webhook receiver and its inbox
//! processor.
//!
//! `POST /webhooks/orders` answers fast and applies nothing:
//!
//! 1. The Standard Webhooks signature is verified over the raw body, and the
//!    timestamp against the tolerance, before anything is parsed (401).
//! 2. The body is decoded by the Kafka path's rules (`decode::decode`), and
//!    the `webhook-id` must be the event's msg_id (400 otherwise: a body that
//!    is not an event can never become one, retrying is useless).
//! 3. ONE statement claims the webhook-id in `payments.webhook_inbox` with
//!    the body (`INSERT ... ON CONFLICT DO NOTHING`); it commits, then the
//!    answer: 200 `accepted` (new) or `duplicate` (claimed before, same
//!    event), 422 `conflict` (claimed before with another event under the
//!    same id: dead-lettered, the first stands), 503 while the database fails.
//!
//! A crash after the claim and before the answer (crash point `respond`)
//! makes the sender retry; the retry finds the claim and gets 200.
//!
//! What one client can hold is bounded (the sender retries every non-2xx,
//! so a refusal here is a delay, never a loss): a request's head must
//! arrive within `--webhook-header-read-timeout`, and connections are capped
//! (`pipeline::serve`); a request, its body's reading included, is
//! answered within `--webhook-request-timeout` (408 past it: a body sent a
//! byte a second holds its connection that long and no longer); and at most
//! `--webhook-concurrency` requests whose body has arrived are handled at
//! once (503 with `Retry-After: 1` past it). The body is read before a
//! handling slot is taken, so slow bodies cannot starve valid requests.
//!
//! The inbox processor applies the claims: it reads unprocessed rows in
//! msg_id order and applies them like a Kafka batch (`process_deliveries`,
//! with its bisection and dead letters), in one transaction per batch that
//! locks the rows (`FOR UPDATE SKIP LOCKED`), claims their msg_ids in
//! the inbox (`fx.partitioned_inbox`), writes the charges and ledger entries, and marks the
//! rows processed. So a charge and its processed mark commit together, and
//! two processors (two payments processes) never apply a row twice. A scan
//! that applied nothing because another processor holds every row it found
//! is followed by a backoff (5 ms doubling to the poll interval), not by
//! the next scan at once: `SKIP LOCKED` would answer the same, as fast as
//! the database can.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use chrono::{DateTime, Utc};
use clap::Args;
use effectively::retry::Backoff;
use effectively::webhook::{self, Secret};
use pipeline::contract::{CrashPoint, WEBHOOK_PATH};
use pipeline::crash::Crasher;
use pipeline::db::{ErrorClass, classify as classify_db_error};
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::decode;
use crate::delivery::{DeadLetter, DeadLetterKind, Delivery, Source};
use crate::metrics::{PaymentsMetrics, Stage};

/// The largest body taken (an event is well under a kilobyte; Kafka's
/// default message limit is 1 MB): larger is a 413.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// The first wait of the inbox processor after a scan that found every
/// claim held by another processor; it doubles, up to the poll interval,
/// while they stay held. Another processor's batch usually commits within
/// milliseconds.
pub const HELD_BACKOFF_MIN: Duration = Duration::from_millis(5);

/// The receiver's settings (`--source http`).
#[derive(Debug, Clone, Args)]
pub struct WebhookArgs {
    /// Address serving POST /webhooks/orders (with --source http).
    #[arg(long, env = pipeline::contract::env::PAYMENTS_WEBHOOK_ADDR, default_value = "127.0.0.1:9103")]
    pub webhook_addr: SocketAddr,

    /// The signing secrets (`whsec_<base64>`, comma-separated): a request
    /// signed with any one of them is taken, so a secret can be rotated
    /// without downtime. Required with --source http.
    #[arg(
        long,
        env = pipeline::contract::env::PAYMENTS_WEBHOOK_SECRET,
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub webhook_secret: Vec<Secret>,

    /// How far a request's webhook-timestamp may be from this host's clock,
    /// either way (a captured request is replayable that long; it must cover
    /// the clock skew between the hosts).
    #[arg(long, env = "PAYMENTS_WEBHOOK_TOLERANCE", default_value = "5m",
          value_parser = crate::horizon::parse_duration)]
    pub webhook_tolerance: Duration,

    /// How long a processed webhook's receipt is kept, answering its
    /// retries "duplicate" at once. The dedup record that lasts the whole
    /// redelivery horizon is the inbox's (--inbox-retention); a retry after
    /// its receipt is gone is claimed again and found applied there.
    #[arg(long, env = "PAYMENTS_WEBHOOK_RECEIPTS_KEPT", default_value = "1d",
          value_parser = crate::horizon::parse_duration)]
    pub webhook_receipts_kept: Duration,

    /// How often the inbox processor looks for claims no request of this
    /// process woke it for (another process's, or left by a crash), in
    /// milliseconds.
    #[arg(long, env = "PAYMENTS_WEBHOOK_POLL_MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub webhook_poll_ms: u64,

    /// How long a client may take to send a request's head, from accept or
    /// from its previous response (so also how long a keep-alive connection
    /// may sit idle); past it the connection is closed.
    #[arg(long, env = "PAYMENTS_WEBHOOK_HEADER_READ_TIMEOUT", default_value = "10s",
          value_parser = crate::horizon::parse_duration)]
    pub webhook_header_read_timeout: Duration,

    /// How long a request may take, from its head to its answer, its
    /// body's reading included; past it the answer is 408
    /// `request_timeout` (the sender retries it).
    #[arg(long, env = "PAYMENTS_WEBHOOK_REQUEST_TIMEOUT", default_value = "15s",
          value_parser = crate::horizon::parse_duration)]
    pub webhook_request_timeout: Duration,

    /// Connections open at once; at the cap new ones wait in the kernel's
    /// accept backlog until one closes.
    #[arg(long, env = "PAYMENTS_WEBHOOK_MAX_CONNECTIONS", default_value_t = 4096,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub webhook_max_connections: u64,

    /// Requests handled at once (verified and claimed), once their body
    /// has arrived; past it the answer is 503 `overloaded` with
    /// `Retry-After: 1` (the sender retries it then).
    #[arg(long, env = "PAYMENTS_WEBHOOK_CONCURRENCY", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub webhook_concurrency: u64,
}

impl WebhookArgs {
    /// The HTTP server's bounds.
    pub fn limits(&self) -> pipeline::serve::Limits {
        pipeline::serve::Limits {
            header_read_timeout: self.webhook_header_read_timeout,
            max_connections: usize::try_from(self.webhook_max_connections).unwrap_or(usize::MAX),
        }
    }
}

/// What the request handler shares.
#[derive(Clone)]
struct Receiver {
    pool: PgPool,
    secrets: Arc<[Secret]>,
    tolerance: Duration,
    crasher: Arc<Crasher>,
    metrics: Arc<PaymentsMetrics>,
    wake: Arc<Notify>,
    /// Handling slots ([`WebhookArgs::webhook_concurrency`]).
    slots: Arc<Semaphore>,
}

/// The router serving [`WEBHOOK_PATH`]. `wake` is notified on every new
/// claim (the inbox processor waits on it).
pub fn router(
    pool: PgPool,
    args: &WebhookArgs,
    crasher: Arc<Crasher>,
    metrics: Arc<PaymentsMetrics>,
    wake: Arc<Notify>,
) -> Router {
    let state = Receiver {
        pool,
        secrets: args.webhook_secret.clone().into(),
        tolerance: args.webhook_tolerance,
        crasher,
        metrics: metrics.clone(),
        wake,
        slots: Arc::new(Semaphore::new(
            usize::try_from(args.webhook_concurrency).unwrap_or(usize::MAX),
        )),
    };
    Router::new()
        .route(WEBHOOK_PATH, post(receive))
        .route_layer(middleware::from_fn_with_state(
            (args.webhook_request_timeout, metrics),
            time_limit,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Answers 408 `request_timeout` when the request (its body's reading
/// included) is not answered within the limit.
async fn time_limit(
    State((limit, metrics)): State<(Duration, Arc<PaymentsMetrics>)>,
    request: Request,
    next: Next,
) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            let answer = Answer::error(
                "request_timeout",
                StatusCode::REQUEST_TIMEOUT,
                format!("the request was not complete within {limit:?}"),
            );
            metrics
                .webhook_requests_total
                .with_label_values(&[answer.outcome])
                .inc();
            answer.into_response()
        }
    }
}

/// An answer and the outcome it is counted as.
struct Answer {
    outcome: &'static str,
    status: StatusCode,
    body: serde_json::Value,
    retry_after: Option<u64>,
}

impl Answer {
    fn status(outcome: &'static str, msg_id: Uuid) -> Self {
        Self {
            outcome,
            status: StatusCode::OK,
            body: json!({ "status": outcome, "msg_id": msg_id }),
            retry_after: None,
        }
    }

    fn error(outcome: &'static str, status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            outcome,
            status,
            body: json!({ "error": { "code": outcome, "message": message.into() } }),
            retry_after: None,
        }
    }
}

async fn receive(
    State(receiver): State<Receiver>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    let answer = match body {
        // The body has arrived: a handling slot, or 503 at once.
        Ok(body) => match receiver.slots.clone().try_acquire_owned() {
            Ok(_slot) => receiver.handle(&headers, &body).await,
            Err(_) => Answer {
                retry_after: Some(1),
                ..Answer::error(
                    "overloaded",
                    StatusCode::SERVICE_UNAVAILABLE,
                    "too many webhooks in hand; retry after a second",
                )
            },
        },
        // Over the limit (413), or the body could not be read.
        Err(rejection) => Answer::error("bad_request", rejection.status(), rejection.body_text()),
    };
    let metrics = &receiver.metrics;
    metrics
        .webhook_requests_total
        .with_label_values(&[answer.outcome])
        .inc();
    metrics
        .webhook_request_duration_seconds
        .observe(started.elapsed().as_secs_f64());
    answer.into_response()
}

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body)).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// A header's value, or "" when absent or not visible ASCII (which
/// verification then refuses as missing).
fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> &'h str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

impl Receiver {
    async fn handle(&self, headers: &HeaderMap, body: &[u8]) -> Answer {
        let id = header_str(headers, webhook::HEADER_ID);
        let now = Utc::now().timestamp();
        if let Err(error) = webhook::verify(
            &self.secrets,
            id,
            header_str(headers, webhook::HEADER_TIMESTAMP),
            header_str(headers, webhook::HEADER_SIGNATURE),
            body,
            now,
            self.tolerance,
        ) {
            tracing::warn!(%error, "webhook refused: verification failed");
            return Answer::error("unauthorized", StatusCode::UNAUTHORIZED, error.to_string());
        }
        // Authenticated: now the body may be parsed.
        let (intent, _) = match decode::decode(Some(body)) {
            Ok(decoded) => decoded,
            Err(reason) => {
                let reason = effectively::text::storable(&reason);
                tracing::warn!(webhook_id = id, %reason, "webhook refused: not an event");
                return Answer::error(
                    "bad_request",
                    StatusCode::BAD_REQUEST,
                    format!("not an order.created event: {reason}"),
                );
            }
        };
        if Uuid::parse_str(id.trim()).ok() != Some(intent.msg_id) {
            return Answer::error(
                "bad_request",
                StatusCode::BAD_REQUEST,
                format!(
                    "the webhook-id header must be the event's msg_id ({})",
                    intent.msg_id
                ),
            );
        }
        match claim(&self.pool, intent.msg_id, body, intent.payload_hash).await {
            Ok(claimed) => {
                // Committed, not answered: the sender will retry, and the
                // retry is a duplicate.
                self.crasher.point(CrashPoint::Respond);
                match claimed {
                    Claimed::New => {
                        self.wake.notify_one();
                        Answer::status("accepted", intent.msg_id)
                    }
                    Claimed::Before => Answer::status("duplicate", intent.msg_id),
                    Claimed::Conflict { first } => {
                        self.metrics.msg_id_conflicts_total.inc();
                        self.metrics.dead_letters_total.inc();
                        tracing::warn!(msg_id = %intent.msg_id, "webhook refused: its id was claimed with another event (dead-lettered)");
                        Answer::error(
                            "conflict",
                            StatusCode::UNPROCESSABLE_ENTITY,
                            format!(
                                "webhook-id {} was received before with another event \
                                 (payload hash {first:016x}, this one {:016x}); the first stands",
                                intent.msg_id, intent.payload_hash
                            ),
                        )
                    }
                }
            }
            Err(error) if classify_db_error(&error) == ErrorClass::Deterministic => {
                tracing::error!(%error, msg_id = %intent.msg_id, "the database refused a webhook's claim");
                Answer::error(
                    "error",
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the receiver could not record this webhook",
                )
            }
            Err(error) => {
                tracing::warn!(%error, "claiming a webhook failed; asking the sender to retry");
                let mut answer = Answer::error(
                    "unavailable",
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the receiver's database is unavailable; retry later",
                );
                answer.retry_after = Some(1);
                answer
            }
        }
    }
}

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// The webhook-id was new: claimed now.
    New,
    /// Claimed before with the same event.
    Before,
    /// Claimed before with another event (payload hash `first`): recorded as
    /// a dead letter.
    Conflict {
        /// The first event's payload hash.
        first: i64,
    },
}

/// Claims `msg_id` with its body in `payments.webhook_inbox`: one statement,
/// committed on return. A claim that exists with another payload hash is a
/// conflict; its dead letter (kind `msg_id_conflict`, once per msg_id) is
/// written before this returns.
pub async fn claim(
    pool: &PgPool,
    msg_id: Uuid,
    body: &[u8],
    payload_hash: i64,
) -> sqlx::Result<Claimed> {
    let new = sqlx::query_scalar!(
        "INSERT INTO payments.webhook_inbox (msg_id, payload, payload_hash) VALUES ($1, $2, $3) \
         ON CONFLICT (msg_id) DO NOTHING RETURNING msg_id",
        msg_id,
        body,
        payload_hash
    )
    .fetch_optional(pool)
    .await?;
    if new.is_some() {
        return Ok(Claimed::New);
    }
    let stored = sqlx::query_scalar!(
        "SELECT payload_hash FROM payments.webhook_inbox WHERE msg_id = $1",
        msg_id
    )
    .fetch_optional(pool)
    .await?;
    match stored {
        // Pruned since (only a processed receipt is): the processor finds
        // the msg_id applied; a duplicate either way.
        None => Ok(Claimed::Before),
        Some(first) if first == payload_hash => Ok(Claimed::Before),
        Some(first) => {
            let dead = DeadLetter {
                source: Source::webhook(msg_id, body),
                kind: DeadLetterKind::MsgIdConflict,
                msg_id: Some(msg_id),
                order_id: None,
                reason: format!(
                    "webhook-id {msg_id} was received before with another event \
                     (first payload hash {first:016x}, this one {payload_hash:016x}); the first stands"
                ),
            };
            let mut tx = pool.begin().await?;
            crate::inbox::insert_dead_letters(&mut tx, &[dead]).await?;
            tx.commit().await?;
            Ok(Claimed::Conflict { first })
        }
    }
}

/// One unprocessed claim, as read by the processor.
struct Row {
    msg_id: Uuid,
    payload: Vec<u8>,
}

/// Unprocessed claims after `after` (from the start when `None`), in msg_id
/// order, at most `limit`.
async fn unprocessed(pool: &PgPool, after: Option<Uuid>, limit: usize) -> sqlx::Result<Vec<Row>> {
    sqlx::query_as!(
        Row,
        "SELECT msg_id, payload FROM payments.webhook_inbox \
         WHERE processed_at IS NULL AND ($1::uuid IS NULL OR msg_id > $1) ORDER BY msg_id LIMIT $2",
        after,
        limit as i64
    )
    .fetch_all(pool)
    .await
}

/// The inbox processor (see the module docs).
pub(crate) struct Processor {
    pub(crate) pool: PgPool,
    pub(crate) apply: crate::process::Apply,
    pub(crate) crasher: Arc<Crasher>,
    pub(crate) metrics: Arc<PaymentsMetrics>,
    /// Most claims applied per transaction.
    pub(crate) batch: usize,
    /// How long it waits for a wake before it looks anyway.
    pub(crate) poll: Duration,
    /// Notified on every new claim.
    pub(crate) wake: Arc<Notify>,
}

impl Processor {
    /// Applies the claims until `cancel` fires. It scans the unprocessed
    /// rows in msg_id order, a batch at a time, and starts over from the
    /// beginning when a scan comes to its end; with nothing to do it waits
    /// for a wake or the poll interval. Rows another processor holds are
    /// skipped by this scan and taken by a later one if still there; when a
    /// scan applied nothing and skipped rows, the next waits a backoff
    /// ([`HELD_BACKOFF_MIN`] doubling to the poll interval, reset by a scan
    /// that applies something; a wake cuts it short).
    pub(crate) async fn run(self, cancel: CancellationToken) {
        let Processor {
            pool,
            apply,
            crasher,
            metrics,
            batch,
            poll,
            wake,
        } = self;
        let batch = batch.max(1);
        let mut after: Option<Uuid> = None;
        let mut backoff = Backoff::new();
        let mut held = Backoff::between(HELD_BACKOFF_MIN, poll);
        // The scan under way: whether it applied a row, whether it skipped one.
        let (mut applied, mut skipped) = (false, false);
        loop {
            if cancel.is_cancelled() {
                return;
            }
            let rows = match unprocessed(&pool, after, batch).await {
                Ok(rows) => {
                    backoff.reset();
                    rows
                }
                Err(error) => {
                    metrics.error(Stage::Scan);
                    tracing::warn!(%error, "reading the webhook claims failed; retrying");
                    if !backoff.wait(&cancel).await {
                        return;
                    }
                    continue;
                }
            };
            if !rows.is_empty() {
                metrics.consumed_total.inc_by(rows.len() as u64);
                let (deliveries, committed_at) = classify(&rows);
                let Some(left) = crate::process::process_deliveries(
                    &pool,
                    apply,
                    &deliveries,
                    &committed_at,
                    &crasher,
                    &metrics,
                    &cancel,
                )
                .await
                else {
                    return;
                };
                // Rows held back (the inbox cannot record them yet) stay
                // unprocessed and count as skipped: a scan that found only
                // those waits before the next.
                let undone = left.skipped + left.held.len() as u64;
                applied |= undone < rows.len() as u64;
                skipped |= undone > 0;
            }
            if rows.len() == batch {
                after = Some(rows[rows.len() - 1].msg_id);
                continue; // the scan goes on
            }
            // The end of a scan: the next starts over from the beginning.
            after = None;
            match (std::mem::take(&mut applied), std::mem::take(&mut skipped)) {
                (true, _) => held.reset(),
                (false, true) => {
                    // Every row found is another processor's.
                    tokio::select! {
                        () = wake.notified() => {}
                        waited = held.wait(&cancel) => if !waited { return },
                    }
                }
                (false, false) => {
                    held.reset();
                    tokio::select! {
                        () = wake.notified() => {}
                        () = tokio::time::sleep(poll) => {}
                        () = cancel.cancelled() => return,
                    }
                }
            }
        }
    }
}

/// The claims as deliveries (a stored body that no longer decodes becomes
/// an `undecodable` dead letter, like a Kafka message).
fn classify(rows: &[Row]) -> (Vec<Delivery<'_>>, HashMap<Uuid, DateTime<Utc>>) {
    let mut committed_at = HashMap::with_capacity(rows.len());
    let deliveries = rows
        .iter()
        .map(|row| {
            let content = decode::decode(Some(&row.payload)).map(|(intent, created)| {
                committed_at.insert(intent.msg_id, created);
                intent
            });
            Delivery {
                source: Source::webhook(row.msg_id, &row.payload),
                content,
            }
        })
        .collect();
    (deliveries, committed_at)
}

/// Every second until `cancel` fires: counts the unprocessed claims
/// (`payments_webhook_backlog`), and every minute deletes the receipts
/// processed more than `kept` ago, in bounded batches.
pub async fn upkeep(
    pool: PgPool,
    kept: Duration,
    metrics: Arc<PaymentsMetrics>,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ticks: u64 = 0;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = cancel.cancelled() => return,
        }
        match sqlx::query_scalar!(
            r#"SELECT count(*) AS "n!" FROM payments.webhook_inbox WHERE processed_at IS NULL"#
        )
        .fetch_one(&pool)
        .await
        {
            Ok(n) => metrics.webhook_backlog.set(n),
            Err(error) => tracing::debug!(%error, "counting the webhook backlog"),
        }
        if ticks.is_multiple_of(60) {
            match prune(&pool, kept).await {
                Ok(0) => {}
                Ok(n) => {
                    metrics.webhook_receipts_pruned_total.inc_by(n);
                    tracing::info!(pruned = n, "processed webhook receipts deleted");
                }
                Err(error) => tracing::warn!(%error, "pruning webhook receipts failed; retrying"),
            }
        }
        ticks += 1;
    }
}

/// Deletes the receipts processed more than `kept` ago, 10,000 at a time;
/// returns how many.
pub async fn prune(pool: &PgPool, kept: Duration) -> sqlx::Result<u64> {
    let mut total = 0;
    loop {
        let n = sqlx::query!(
            "DELETE FROM payments.webhook_inbox WHERE msg_id IN ( \
               SELECT msg_id FROM payments.webhook_inbox \
               WHERE processed_at < now() - $1 * interval '1 second' LIMIT 10000)",
            kept.as_secs_f64()
        )
        .execute(pool)
        .await?
        .rows_affected();
        total += n;
        if n < 10_000 {
            return Ok(total);
        }
    }
}
