//! What this project's pipeline services (orders, relay, payments, recon,
//! chaos) share, and a service adopting the library does not need: their
//! configuration and its flags, the contract between the processes (crash
//! points, the event type and payload, header and metric names), the
//! database roles and migrator of the pipeline's own schemas, metrics and
//! logs, and the test support against the stack of `make up`. The library's
//! parts (`effectively`) are under it.
//!
//! * [`outbox`]: the pipeline's transactional outbox writer (orders'
//!   business row and the outbox row commit in one transaction, a `NOTIFY`
//!   wakes the relay);
//! * [`idempotency`]: the claim of a batch's keys in orders' own table;
//! * [`clock`]: a service's clock against the database's (measured, bounded,
//!   refused past a bound at start-up);
//! * [`lifecycle`]: expiry in small batches for the stores that cannot drop
//!   partitions (the outbox, the idempotency keys);
//! * [`contract`]: what the pipeline's processes agree on, as types;
//!   [`envelope`]: the event on the wire; [`crash`]: the named crash points;
//! * `kafka` (feature `kafka`): topic creation and a Kafka client's fatal
//!   state; `inspect` (feature `kafka`): what the `kafka-tool` binary does;
//! * `serve` (feature `http`): an axum router served over HTTP/1.1 with a
//!   header read timeout and a cap on open connections;
//! * [`db`] (including the transient/deterministic error split), [`config`],
//!   [`metrics`], [`telemetry`], [`shutdown`]: the plumbing every service of
//!   the pipeline shares.

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
#[cfg(feature = "http")]
pub mod serve;
pub mod shutdown;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
