//! Building blocks for effectively-once processing across service boundaries.
//!
//! There is no exactly-once *delivery*; this crate gives the pieces that make
//! *processing* effectively-once on top of at-least-once delivery, on a
//! PostgreSQL schema of the user's choosing (with its own migration ledger):
//!
//! * [`store`]: the store value ([`store::Effectively`]) and what it hands
//!   out: the transactional outbox ([`store::Outbox`]: the caller's business
//!   row and its event commit in one transaction), the relay that delivers
//!   it at least once through a sink ([`store::Relay`], [`store::Sink`]; a
//!   Kafka sink with feature `kafka`, signed webhooks with `webhooks`), the
//!   inbox guard that makes a redelivered message a no-op ([`store::Inbox`];
//!   a Kafka consumer loop with `kafka`, a receiver of signed webhooks with
//!   `http`), and idempotency keys claimed in the
//!   caller's transaction ([`store::Keys`]; an axum extractor with `http`);
//! * [`idempotency`]: a client's key, a request's fingerprint and the stored
//!   response, as values;
//! * [`webhook`]: Standard Webhooks signing and verification (HMAC-SHA256
//!   over id, timestamp and raw body; a timestamp tolerance against replay);
//! * `egress` (feature `webhooks`): where a webhook sender may connect,
//!   a guard against server-side request forgery judged at connection time;
//! * `kafka_config` (feature `kafka`): a Kafka client's librdkafka
//!   properties (TLS, SASL) from a file kept as a secret;
//! * [`retry`]: the backoff the relay and the consumer loop wait by;
//! * [`text`]: untrusted text made storable in a `text` column;
//! * [`v7`]: the time a UUIDv7 id carries (the stores expire by it).
//!
//! Every function that writes takes the caller's executor (a pool, a
//! connection or a transaction), so the caller owns the transaction
//! boundary: that boundary is where correctness lives.
//!
//! The crate needs no database at compile time (its queries are checked at
//! run time, and by its tests against a real PostgreSQL). This project's own
//! pipeline (orders, relay, payments, recon) shares its plumbing through a
//! crate of its own, `pipeline`, which builds on this one.

#![warn(missing_docs)]

#[cfg(feature = "webhooks")]
pub mod egress;
pub mod idempotency;
#[cfg(feature = "kafka")]
pub mod kafka_config;
pub mod retry;
pub mod store;
pub mod text;
pub mod v7;
pub mod webhook;
