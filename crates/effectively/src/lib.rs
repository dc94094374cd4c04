//! Building blocks for effectively-once processing across service boundaries.
//!
//! There is no exactly-once *delivery*; this crate gives the pieces that make
//! *processing* effectively-once on top of at-least-once delivery:
//!
//! * [`store`]: the library on a schema of the user's choosing (its own
//!   migration ledger): [`store::Outbox`], [`store::Inbox`] and
//!   [`store::Keys`] for a service that is not this project's pipeline;
//! * [`idempotency`]: client-supplied idempotency keys with a request
//!   fingerprint and a stored response that is replayed verbatim;
//! * [`outbox`]: the transactional outbox writer (the caller's business row and
//!   the outbox row commit in one transaction, a `NOTIFY` wakes the relay);
//! * [`text`]: untrusted text made storable in a `text` column;
//! * [`v7`]: the time a UUIDv7 id carries (the stores expire by it);
//! * [`clock`]: a service's clock against the database's (measured, bounded,
//!   refused past a bound at start-up);
//! * [`lifecycle`]: expiry in small batches for the stores that cannot drop
//!   partitions (the outbox, the idempotency keys);
//! * [`webhook`]: Standard Webhooks signing and verification (HMAC-SHA256
//!   over id, timestamp and raw body; a timestamp tolerance against replay);
//! * [`contract`]: what the pipeline's processes agree on (crash points, the
//!   event type and payload, header and metric names), as types;
//! * `kafka` (feature `kafka`): topic creation and a Kafka client's fatal
//!   state; `inspect` (feature `kafka`): what the `kafka-tool` binary does;
//! * `serve` (feature `http`): an axum router served over HTTP/1.1 with a
//!   header read timeout and a cap on open connections;
//! * [`db`] (including the transient/deterministic error split), [`config`], [`metrics`], [`telemetry`], [`shutdown`]: the plumbing
//!   every service of the pipeline shares.
//!
//! Every function that writes takes `&mut PgConnection`, so the caller owns the
//! transaction boundary: that boundary is where correctness lives.

pub mod clock;
pub mod config;
pub mod contract;
pub mod crash;
pub mod db;
pub mod envelope;
pub mod idempotency;
#[cfg(feature = "kafka")]
pub mod inspect;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod lifecycle;
pub mod metrics;
pub mod outbox;
pub mod retry;
#[cfg(feature = "http")]
pub mod serve;
pub mod shutdown;
pub mod store;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod text;
pub mod v7;
pub mod webhook;
