//! The contracts between the pipeline's processes, as types and constants.
//!
//! The binaries never depend on each other, only on this crate, so whatever
//! two of them must agree on lives here: a renamed crash point, event field or
//! metric then fails to compile on both sides instead of being a string that
//! silently stops matching at run time. Each item says which processes share
//! it.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

// --- processes and crash points ----------------------------------------------

/// The three services of the pipeline, as a supervisor names them.
///
/// Shared by chaos (which starts, kills and scrapes them) and by the crash
/// points below (each lives in one of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ServiceName {
    /// The Orders API.
    Orders,
    /// The outbox relay.
    Relay,
    /// The Payments consumer.
    Payments,
}

impl ServiceName {
    /// Every service, in start order.
    pub const ALL: [ServiceName; 3] = [Self::Orders, Self::Relay, Self::Payments];

    /// The binary's (and its log file's) name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Orders => "orders",
            Self::Relay => "relay",
            Self::Payments => "payments",
        }
    }
}

/// A named place where a service SIGKILLs itself when a chaos run armed it
/// (the book, docs/book/src/faults.md).
///
/// Shared by the service that passes the point (`Crasher::point`), its
/// `--crash-point`/`CRASH_POINT` flag, and chaos (`--crash-point`, which arms
/// each point in the service that owns it and reads the name back from the
/// crash marker file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CrashPoint {
    /// Orders: after the write transaction commits, before the responses.
    Commit,
    /// Relay: after the broker acked, before the rows are marked published.
    Publish,
    /// Payments: after the inbox claim, before the charge.
    Claim,
    /// Payments: after the charge insert, before the commit.
    Effect,
    /// Payments with `--unsafe-split-txn`: between its two transactions.
    Split,
    /// Payments over HTTP (`--source http`): after a webhook's inbox row
    /// commits, before the response (the sender retries; the retry is a
    /// duplicate).
    Respond,
    /// Relay with `--sink http`: after the receiver answered 2xx, before the
    /// delivery is marked delivered (it is delivered again: a duplicate).
    Deliver,
}

impl CrashPoint {
    /// Every crash point.
    pub const ALL: [CrashPoint; 7] = [
        Self::Commit,
        Self::Publish,
        Self::Claim,
        Self::Effect,
        Self::Split,
        Self::Respond,
        Self::Deliver,
    ];

    /// The name `--crash-point` takes (in the services and in chaos) and the
    /// crash marker file holds.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Commit => "commit",
            Self::Publish => "publish",
            Self::Claim => "claim",
            Self::Effect => "effect",
            Self::Split => "split",
            Self::Respond => "respond",
            Self::Deliver => "deliver",
        }
    }

    /// The service in which this point lives.
    pub const fn service(self) -> ServiceName {
        match self {
            Self::Commit => ServiceName::Orders,
            Self::Publish | Self::Deliver => ServiceName::Relay,
            Self::Claim | Self::Effect | Self::Split | Self::Respond => ServiceName::Payments,
        }
    }
}

// --- clients and orders ----------------------------------------------------

/// The HTTP header (`Idempotency-Key`; HTTP names are case-insensitive) and the
/// gRPC metadata key that carry a create request's idempotency key. Shared by
/// orders (reads it on both protocols) and loadgen (sends it).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The scope of orders' idempotency keys in the library's table
/// (`fx.idempotency_keys`): one, shared by every caller, until callers have
/// an identity of their own to scope their keys by.
pub const KEY_SCOPE: &str = "";

/// The longest name of an orders caller (`orders --auth-tokens-file`).
pub const MAX_CALLER_LEN: usize = 64;

/// An orders caller's name: 1 to [`MAX_CALLER_LEN`] ASCII letters, digits,
/// `_` or `-` (so never the anonymous scope [`KEY_SCOPE`], and never a dot,
/// which ends it in a token). Shared by orders (its tokens file, its
/// callers) and loadgen (the caller its intents files name).
pub fn validate_caller(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_CALLER_LEN {
        return Err(format!(
            "a caller's name has 1 to {MAX_CALLER_LEN} characters, not {}",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(format!(
            "a caller's name has ASCII letters, digits, '_' and '-' only, not {c:?}"
        ));
    }
    Ok(())
}

/// The caller of a bearer token `CALLER.SECRET` (a valid name, a secret that
/// is not empty); `None` when the token has not that shape.
pub fn token_caller(token: &str) -> Option<&str> {
    let (name, secret) = token.split_once('.')?;
    (validate_caller(name).is_ok() && !secret.is_empty()).then_some(name)
}

/// The status of a created order's response (201 Created).
pub const ORDER_CREATED_STATUS: u16 = 201;

/// The response orders gives a created order, to the first request and to
/// every retry with its idempotency key: stored in
/// `fx.idempotency_keys` (status, headers, body) and replayed verbatim,
/// in its HTTP form whatever protocol carried the request. Shared by orders
/// (builds and stores it) and recon (checks each stored key's status,
/// `Location` and `ETag` against it).
///
/// Status [`ORDER_CREATED_STATUS`]; headers in this order: `content-type:
/// application/json`, `location: /orders/{order_id}`, `etag`: the first 32
/// hex digits of the body's BLAKE3 hash, quoted; body
/// `{"order_id":"…","status":"created"}` (the order's own id, hyphenated).
pub fn created_response(order_id: Uuid) -> crate::idempotency::StoredResponse {
    let body = format!(
        r#"{{"order_id":"{order_id}","status":"{}"}}"#,
        OrderStatus::Created.as_str()
    )
    .into_bytes();
    let etag = format!("\"{}\"", &blake3::hash(&body).to_hex()[..32]);
    crate::idempotency::StoredResponse {
        status: ORDER_CREATED_STATUS,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), format!("/orders/{order_id}")),
            ("etag".into(), etag),
        ],
        body,
    }
}

// --- webhooks ----------------------------------------------------------------

/// The path at which payments (`--source http`) receives the `order.events`
/// webhooks: `POST`, signed per Standard Webhooks (`effectively::webhook`), the body
/// the same envelope as a Kafka message's value. Shared by payments (its
/// route) and whoever builds a destination URL for it (chaos, the demos).
pub const WEBHOOK_PATH: &str = "/webhooks/orders";

// --- the split-transaction counter-example ---------------------------------

/// The environment variable (and `--unsafe-split-txn` flag) that runs payments
/// with its deliberately broken consume path. Shared by payments (its flag)
/// and chaos (`--unsafe-split-txn` passes it to payments).
pub const UNSAFE_SPLIT_TXN_ENV: &str = "PAYMENTS_UNSAFE_SPLIT_TXN";

/// Which half of the broken consume path commits first (the value of
/// [`UNSAFE_SPLIT_TXN_ENV`]). Shared by payments and chaos.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SplitTxn {
    /// Inbox row, commit, then the effect: a crash in between loses the effect.
    InboxFirst,
    /// Effect, commit, then the inbox row: a crash in between doubles it.
    EffectFirst,
}

impl SplitTxn {
    /// Both modes.
    pub const ALL: [SplitTxn; 2] = [Self::InboxFirst, Self::EffectFirst];

    /// The value payments' `--unsafe-split-txn` takes.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InboxFirst => "inbox-first",
            Self::EffectFirst => "effect-first",
        }
    }
}

// --- the order.created event ------------------------------------------------

/// The event type of a new order: the outbox row's `event_type`, the
/// envelope's `event_type` and the `event_type` Kafka header. Shared by orders
/// (writes it), the relay (copies it from the outbox row onto the wire) and
/// payments (applies events of this type and dead-letters any other).
pub const ORDER_CREATED: &str = "order.created";

/// An order's status as its events carry it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OrderStatus {
    /// Just created: the only status an order has so far.
    #[default]
    Created,
}

impl OrderStatus {
    /// The status as stored (`orders.orders.status`) and sent.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Created => "created",
        }
    }
}

/// The payload of an [`ORDER_CREATED`] event, embedded verbatim in the
/// envelope. Orders serializes it into the outbox row; payments decodes it.
///
/// The wire form is `{"order_id":"…","account_id":N,"amount_cents":N,
/// "status":"created"}`, fields in this order: recon's diff searches the
/// payload's bytes for `"order_id":"…"`, `"account_id":N` and
/// `"amount_cents":N`, so the field names and their order are part of the
/// contract. Decoding is payments' strict rule: the three fields are required,
/// each at most once and of its type (a UUID, two `i64`s); other fields are
/// ignored, `status` included (it is written for readers of the topic; an
/// `order.created` event is about a created order by definition, so a decoded
/// payload says [`OrderStatus::Created`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCreated {
    /// The new order (also the envelope's `aggregate_id` and the Kafka key).
    pub order_id: Uuid,
    /// The account to charge.
    pub account_id: i64,
    /// The amount to charge, in cents.
    pub amount_cents: i64,
    /// The order's status when the event was written.
    #[serde(skip_deserializing)]
    pub status: OrderStatus,
}

// --- environment variables ---------------------------------------------------

/// The environment variables one process sets for another: each service's
/// clap flag reads its variable by this name (`env = env::…`), and chaos sets
/// it for the children it supervises. Renaming one renames both sides.
pub mod env {
    /// Relay and payments: run on a topic whose replication factor or
    /// `min.insync.replicas` is under 2 (the single-node stack writes it).
    pub const KAFKA_ALLOW_UNDER_REPLICATED_TOPIC: &str = "KAFKA_ALLOW_UNDER_REPLICATED_TOPIC";
    /// The database URL of every binary (its role's own URL under chaos).
    pub const DATABASE_URL: &str = "DATABASE_URL";
    /// The session limit `idle_in_transaction_session_timeout`, in ms.
    pub const DB_IDLE_IN_TRANSACTION_TIMEOUT_MS: &str = "DB_IDLE_IN_TRANSACTION_TIMEOUT_MS";
    /// Orders: the HTTP listen address.
    pub const ORDERS_HTTP_ADDR: &str = "ORDERS_HTTP_ADDR";
    /// Orders: the gRPC listen address.
    pub const ORDERS_GRPC_ADDR: &str = "ORDERS_GRPC_ADDR";
    /// Orders: the metrics listen address (off the public HTTP port).
    pub const ORDERS_METRICS_ADDR: &str = "ORDERS_METRICS_ADDR";
    /// Relay: the metrics listen address.
    pub const RELAY_METRICS_ADDR: &str = "RELAY_METRICS_ADDR";
    /// Relay: the broker ack timeout of one message, in ms.
    pub const RELAY_MESSAGE_TIMEOUT_MS: &str = "RELAY_MESSAGE_TIMEOUT_MS";
    /// Payments: the metrics listen address.
    pub const PAYMENTS_METRICS_ADDR: &str = "PAYMENTS_METRICS_ADDR";
    /// Payments: static group membership (`group.instance.id`).
    pub const PAYMENTS_GROUP_INSTANCE_ID: &str = "PAYMENTS_GROUP_INSTANCE_ID";
    /// Payments: the rate of injected duplicate deliveries.
    pub const PAYMENTS_DUP_RATE: &str = "PAYMENTS_DUP_RATE";
    /// Payments: the kind of injected duplicates.
    pub const PAYMENTS_DUP_KIND: &str = "PAYMENTS_DUP_KIND";
    /// Relay: where the outbox goes (`kafka`, `http`).
    pub const RELAY_SINK: &str = "RELAY_SINK";
    /// Relay `--sink http`: the destinations (`;`-separated).
    pub const RELAY_WEBHOOK_DESTINATIONS: &str = "RELAY_WEBHOOK_DESTINATIONS";
    /// Relay `--sink http`: the networks webhooks may reach besides public
    /// addresses (comma-separated).
    pub const RELAY_WEBHOOK_ALLOW_ADDRESSES: &str = "RELAY_WEBHOOK_ALLOW_ADDRESSES";
    /// Relay `--sink http`: the factor on every scheduled retry wait.
    pub const RELAY_WEBHOOK_SCHEDULE_SCALE: &str = "RELAY_WEBHOOK_SCHEDULE_SCALE";
    /// Payments: where the events come from (`kafka`, `http`).
    pub const PAYMENTS_SOURCE: &str = "PAYMENTS_SOURCE";
    /// Payments `--source http`: the webhook listen address.
    pub const PAYMENTS_WEBHOOK_ADDR: &str = "PAYMENTS_WEBHOOK_ADDR";
    /// Payments `--source http`: the signing secrets (comma-separated).
    pub const PAYMENTS_WEBHOOK_SECRET: &str = "PAYMENTS_WEBHOOK_SECRET";
    /// The crash points armed in a service (a list).
    pub const CRASH_POINT: &str = "CRASH_POINT";
    /// Fire every Nth pass of an armed point.
    pub const CRASH_EVERY: &str = "CRASH_EVERY";
    /// Fire each pass of an armed point with this probability.
    pub const CRASH_PROBABILITY: &str = "CRASH_PROBABILITY";
    /// Where a firing point writes its name before the process dies.
    pub const CRASH_MARKER_FILE: &str = "CRASH_MARKER_FILE";
    /// What a firing point does (kill or stop).
    pub const CRASH_ACTION: &str = "CRASH_ACTION";
}

// --- the redelivery horizon ------------------------------------------------
//
// The longest a msg_id can keep arriving after it was minted bounds how long
// payments must remember it (its inbox retention). The terms that the
// processes set, rather than the broker or the database, live here, so the
// side that sets one and the side that adds it up cannot drift apart.

/// The longest the relay may wait for the broker's ack of one message
/// (librdkafka `message.timeout.ms`, the producer's delivery timeout): a
/// message the producer is still retrying can land this long after the relay
/// handed it over. Shared by the relay (refuses a larger
/// `--message-timeout-ms`) and payments (one term of the horizon).
pub const RELAY_MAX_MESSAGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// `retention.ms` of `order.events` when it is created by this project's
/// tools (stack, tests, compose): 7 days, Kafka's default, set explicitly so
/// that the broker reports it (payments reads it back at start-up).
pub const ORDER_EVENTS_RETENTION_MS: u64 = 7 * 24 * 3600 * 1000;

/// `segment.ms` of `order.events` when this project creates it: 1 day. Kafka
/// deletes whole segments, so a record can outlive `retention.ms` by up to
/// one segment's span (Kafka's default is 7 days, which would add a week to
/// the horizon).
pub const ORDER_EVENTS_SEGMENT_MS: u64 = 24 * 3600 * 1000;

/// `message.timestamp.type` of `order.events` when this project creates it:
/// the broker stamps each record as it appends it. With Kafka's default
/// (`CreateTime`) the relay host's clock stamps them, and a clock over an
/// hour ahead of the brokers' (`message.timestamp.after.max.ms`) gets every
/// record refused with INVALID_TIMESTAMP, one behind expires them early.
/// Nothing in the pipeline reads a record's timestamp.
pub const ORDER_EVENTS_TIMESTAMP_TYPE: &str = "LogAppendTime";

/// The topic configs this project sets when it creates `order.events`.
pub fn order_events_topic_configs() -> [(&'static str, String); 3] {
    [
        ("retention.ms", ORDER_EVENTS_RETENTION_MS.to_string()),
        ("segment.ms", ORDER_EVENTS_SEGMENT_MS.to_string()),
        (
            "message.timestamp.type",
            ORDER_EVENTS_TIMESTAMP_TYPE.to_owned(),
        ),
    ]
}

// --- the metrics chaos scrapes ----------------------------------------------
//
// Each service registers these in its `metrics.rs` and serves them at
// `GET /metrics`; chaos scrapes them per process life (its `scrape.rs`), sums
// the lives into its report and takes the first increase of a service's
// progress counter in a new life as that service working again.

/// Orders' histogram of create requests per write transaction; chaos reads its
/// `_count` series (write transactions committed or failed): orders' progress.
pub const ORDERS_WRITE_BATCH_SIZE: &str = "orders_write_batch_size";
/// Orders: write transactions that failed, by the label
/// [`ORDERS_WRITE_ERROR_LABEL`] (`deadlock`, `serialization`, ...).
pub const ORDERS_WRITE_ERRORS_TOTAL: &str = "orders_write_errors_total";
/// The label of [`ORDERS_WRITE_ERRORS_TOTAL`].
pub const ORDERS_WRITE_ERROR_LABEL: &str = "kind";
/// Relay: outbox rows published to Kafka and marked published; its progress.
pub const RELAY_PUBLISHED_TOTAL: &str = "relay_published_total";
/// Payments: messages consumed from Kafka, redeliveries included; its progress.
pub const PAYMENTS_CONSUMED_TOTAL: &str = "payments_consumed_total";
/// Payments: messages whose msg_id was already in the inbox (no-ops).
pub const PAYMENTS_DEDUP_HITS_TOTAL: &str = "payments_dedup_hits_total";
/// Payments: partitions assigned to or revoked from this member, by the
/// label `event` (`assigned`, `revoked`): their difference is what the
/// member owns now (chaos's payments-scale fault waits on it).
pub const PAYMENTS_PARTITIONS_MOVED_TOTAL: &str = "payments_partitions_moved_total";
/// Payments: messages whose msg_id was new (claimed and charged).
pub const PAYMENTS_DEDUP_MISSES_TOTAL: &str = "payments_dedup_misses_total";
/// Payments `--source http`: webhook requests, by [`WEBHOOK_OUTCOME_LABEL`]
/// (`accepted`, `duplicate`, ...).
pub const PAYMENTS_WEBHOOK_REQUESTS_TOTAL: &str = "payments_webhook_requests_total";
/// Relay `--sink http`: delivery attempts, by `destination` and
/// [`WEBHOOK_OUTCOME_LABEL`] (`delivered`, `retry`, `failed`, `gone`).
pub const RELAY_WEBHOOK_ATTEMPTS_TOTAL: &str = "relay_webhook_attempts_total";
/// The outcome label of [`PAYMENTS_WEBHOOK_REQUESTS_TOTAL`] and
/// [`RELAY_WEBHOOK_ATTEMPTS_TOTAL`].
pub const WEBHOOK_OUTCOME_LABEL: &str = "outcome";
/// Payments: charges written.
pub const PAYMENTS_CHARGES_TOTAL: &str = "payments_charges_total";
/// Payments: messages dead-lettered, every kind.
pub const PAYMENTS_DEAD_LETTERS_TOTAL: &str = "payments_dead_letters_total";
/// Payments: deliveries refused as after the dedup horizon (dead-lettered).
pub const PAYMENTS_AFTER_HORIZON_TOTAL: &str = "payments_after_horizon_total";
/// Payments, UNSAFE (`--unsafe-apply-after-horizon`): deliveries after the
/// dedup horizon applied anyway.
pub const PAYMENTS_APPLIED_AFTER_HORIZON_TOTAL: &str = "payments_applied_after_horizon_total";
/// Payments: duplicate deliveries injected on purpose (`--dup-rate`), by
/// the label [`INJECTED_DUPLICATE_LABEL`].
pub const PAYMENTS_INJECTED_DUPLICATES_TOTAL: &str = "payments_injected_duplicates_total";
/// The label of [`PAYMENTS_INJECTED_DUPLICATES_TOTAL`]; its values are
/// [`InjectedDuplicate::as_str`].
pub const INJECTED_DUPLICATE_LABEL: &str = "kind";

/// How an injected duplicate was delivered: the values of
/// [`INJECTED_DUPLICATE_LABEL`]. Shared by payments (counts them) and chaos
/// (reports them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InjectedDuplicate {
    /// Applied again after the commit, as if redelivered.
    Reprocess,
    /// The consumer seeks back and the broker delivers again.
    Redeliver,
}

impl InjectedDuplicate {
    /// Both kinds.
    pub const ALL: [InjectedDuplicate; 2] = [Self::Reprocess, Self::Redeliver];

    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Reprocess => "reprocess",
            Self::Redeliver => "redeliver",
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::ValueEnum;

    use super::*;

    #[test]
    fn a_created_response_names_its_order_and_tags_its_body() {
        let id = Uuid::parse_str("0190d9c4-7e2a-7b3c-8d4e-5f6a7b8c9d0e").expect("uuid");
        let r = created_response(id);
        assert_eq!(r.status, 201);
        assert_eq!(
            r.body,
            br#"{"order_id":"0190d9c4-7e2a-7b3c-8d4e-5f6a7b8c9d0e","status":"created"}"#
        );
        assert_eq!(
            r.header("location"),
            Some("/orders/0190d9c4-7e2a-7b3c-8d4e-5f6a7b8c9d0e")
        );
        let etag = r.header("etag").expect("an etag");
        assert_eq!(
            etag,
            format!("\"{}\"", &blake3::hash(&r.body).to_hex()[..32])
        );
        assert_eq!(etag.len(), 34);
        assert_eq!(r.headers.len(), 3);
        assert_eq!(r, created_response(id), "deterministic");
        assert_ne!(
            r.header("etag"),
            created_response(Uuid::nil()).header("etag")
        );
    }

    #[test]
    fn every_crash_point_round_trips_through_its_name() {
        for point in CrashPoint::ALL {
            let name = point.as_str();
            assert_eq!(
                CrashPoint::from_str(name, false),
                Ok(point),
                "clap takes {name}"
            );
            assert_eq!(
                serde_json::to_string(&point).expect("json"),
                format!("\"{name}\""),
                "the report names {name} alike"
            );
        }
        assert_eq!(CrashPoint::value_variants().len(), CrashPoint::ALL.len());
    }

    #[test]
    fn crash_points_map_to_their_services() {
        assert_eq!(CrashPoint::Commit.service(), ServiceName::Orders);
        assert_eq!(CrashPoint::Publish.service(), ServiceName::Relay);
        assert_eq!(CrashPoint::Claim.service(), ServiceName::Payments);
        assert_eq!(CrashPoint::Effect.service(), ServiceName::Payments);
        assert_eq!(CrashPoint::Split.service(), ServiceName::Payments);
        assert_eq!(CrashPoint::Respond.service(), ServiceName::Payments);
        assert_eq!(CrashPoint::Deliver.service(), ServiceName::Relay);
        for service in ServiceName::ALL {
            assert_eq!(ServiceName::from_str(service.as_str(), false), Ok(service));
        }
    }

    #[test]
    fn every_split_mode_round_trips_through_its_name() {
        for mode in SplitTxn::ALL {
            let name = mode.as_str();
            assert_eq!(SplitTxn::from_str(name, false), Ok(mode));
            assert_eq!(
                serde_json::to_string(&mode).expect("json"),
                format!("\"{name}\"")
            );
        }
        assert_eq!(SplitTxn::value_variants().len(), SplitTxn::ALL.len());
    }

    #[test]
    fn the_order_created_payload_keeps_its_wire_form() {
        let order_id = Uuid::parse_str("0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b").expect("uuid");
        let event = OrderCreated {
            order_id,
            account_id: 3,
            amount_cents: 10,
            status: OrderStatus::Created,
        };
        // The bytes orders wrote before the struct moved here.
        let before = format!(
            r#"{{"order_id":"{order_id}","account_id":3,"amount_cents":10,"status":"created"}}"#
        );
        assert_eq!(serde_json::to_string(&event).expect("json"), before);
        let back: OrderCreated = serde_json::from_str(&before).expect("decodes");
        assert_eq!(back, event);
    }

    #[test]
    fn decoding_the_payload_ignores_status_and_unknown_fields_only() {
        let id = "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";
        let decode = |json: &str| serde_json::from_str::<OrderCreated>(json);
        let minimal = decode(&format!(
            r#"{{"order_id":"{id}","account_id":1,"amount_cents":2}}"#
        ))
        .expect("no status");
        assert_eq!(minimal.status, OrderStatus::Created);
        assert!(
            decode(&format!(
                r#"{{"order_id":"{id}","account_id":1,"amount_cents":2,"status":7,"status":null,"x":[]}}"#
            ))
            .is_ok(),
            "status of any type, twice, and unknown fields are ignored"
        );
        for bad in [
            format!(r#"{{"order_id":"{id}","account_id":1}}"#),
            format!(r#"{{"order_id":"{id}","account_id":1,"amount_cents":2,"amount_cents":2}}"#),
            format!(r#"{{"order_id":"{id}","account_id":"1","amount_cents":2}}"#),
            format!(r#"{{"order_id":"{id}","account_id":1,"amount_cents":99999999999999999999}}"#),
            r#"{"order_id":"not-a-uuid","account_id":1,"amount_cents":2}"#.to_owned(),
        ] {
            assert!(decode(&bad).is_err(), "{bad}");
        }
    }
}
