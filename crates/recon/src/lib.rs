//! Recon: the ground-truth diff. Read-only; one SQL statement per range of
//! order ids, the ranges run side by side on connections that share one
//! exported snapshot, so every number comes from one snapshot; `--show-sql`
//! prints the statement so anyone can run the diff by hand (over the whole
//! id space, `$1` and `$2` are the nil and the max UUID).
//!
//! The invariant, checked order by order (not as sums, which two swapped
//! amounts would leave equal): for every accepted intent (idempotency key)
//! exactly one order; for every order exactly one key whose stored response
//! names it and is the one orders stores for it (status, `Location`,
//! `ETag`: [`RESPONSES_SQL`]), one outbox event whose payload is that order (same id, account
//! and amount), that event's msg_id in the inbox, one charge made by that
//! msg_id for the same account and amount, and one ledger entry, the same
//! again. Nothing missing, doubled, orphaned or different. Failed outbox rows
//! and dead letters are reported and count as drift unless allowed.
//!
//! Across expiry: keys, published outbox rows and inbox partitions expire
//! (orders, charges and the ledger never do). Each store's floor says where
//! what it kept starts ([`Floors`]); an order is checked against the stores
//! that still cover it, and the report says what range each covers.

//!
//! The crate: the statements ([`PART_SQL`] and the others, `src/sql/`), the
//! report they add up to (`report.rs`), running them in one snapshot, whole
//! or in parts (`diff.rs`), the client's own intents against the database
//! (`intents.rs`), what the consumer group committed past against the
//! database (`committed.rs`), and the command (`cli.rs`).

pub mod cli;
mod committed;
mod diff;
mod intents;
mod report;
pub mod seed;
mod sql;

pub use committed::{
    CommittedMessage, CommittedReport, check_committed, check_committed_below, parse_committed,
};
pub use diff::{id_ranges, reconcile, reconcile_in_parts, wait_drained};
pub use intents::{ClientIntents, ClientKey, IntentsReport, check_intents};
pub use report::{DeadLetters, Delta, Floors, Part, Policy, Report, Responses};
pub use sql::{COMMITTED_SQL, DEAD_LETTERS_SQL, DRAINED_SQL, FLOORS_SQL, PART_SQL, RESPONSES_SQL};
