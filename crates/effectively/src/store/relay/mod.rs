//! The relay as a library value: an outbox's pending rows published to a
//! [`Sink`] (Kafka, signed webhooks, or the user's own), at least once, each
//! key's events in order, with any number of relays at once. The outbox is
//! a [`Source`]: the library's own ([`OutboxSource`], what [`Relay::new`]
//! relays) or a table the user already has ([`Relay::over`]).
//!
//! How a pass over a group of shards goes ([`Relay::relay_shards`]; [`Relay::run`]
//! has a loop of them per group), in one transaction:
//!
//! 1. each shard's transaction-level advisory lock is tried: a shard
//!    another relay holds is skipped (that one publishes it);
//! 2. the source claims each locked shard's oldest pending rows (its share
//!    of a batch); the library's outbox leaves out the rows of a key whose
//!    earlier row failed for good;
//! 3. each key's rows are sent in id order, the keys side by side: one
//!    after the other by default, all in flight at once through a sink that
//!    keeps their order ([`Sink::send_in_order`]; the [`super::KafkaSink`]
//!    does); a row whose send must be tried again ([`SendError::Retry`])
//!    stops its key for this pass; one the sink refuses for itself
//!    ([`SendError::Reject`]) is marked failed by the library's outbox,
//!    and its key's later rows wait (a person looks at it);
//! 4. the source settles what the sends did ([`Source::settle`]: the
//!    library's outbox marks the rows sent published, the refused ones
//!    failed), and the transaction commits, which frees the shards.
//!
//! A crash (or a lost connection) before the commit leaves the rows pending
//! and the locks free: the next pass sends them again, so a consumer sees a
//! row at least once and must deduplicate (the [`super::Inbox`]). A shard's
//! lock is the fence: while one relay's pass holds it no other relay can
//! send the shard's rows, and a relay whose session the server ended cannot
//! mark.

mod builder;
mod hooks;
mod pass;
mod sink;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::Semaphore;

use super::SHARDS;
use super::source::{OutboxSource, Source};

pub use hooks::{RelayHooks, RelayStats, Stage};
pub use pass::Pass;
#[cfg(feature = "kafka")]
pub(crate) use sink::one_at_a_time;
pub use sink::{Outgoing, SendError, Sink};

/// Rows a pass reads by default ([`Relay::batch_size`]).
const DEFAULT_BATCH_SIZE: i64 = 2000;

/// The most passes one shard can have in flight at once
/// ([`Relay::shard_depth`]).
pub const MAX_SHARD_DEPTH: u8 = 4;

/// Whether group `group` of `groups` (shard `s` in group `s % groups`)
/// holds a shard of `mask` (bit `s`: shard `s`).
fn group_woken(mask: u16, group: usize, groups: usize) -> bool {
    (0..SHARDS).any(|s| mask & (1 << s) != 0 && usize::from(s) % groups.max(1) == group)
}

/// The hooks of a relay given none.
struct NoHooks;

impl RelayHooks for NoHooks {}

/// The relay of a [`Source`] (by default the library's outbox,
/// [`OutboxSource`]) into a [`Sink`]. Cheap to share (`Arc` it); run it
/// with [`Relay::run`], or drive passes yourself with
/// [`Relay::relay_shard`] / [`Relay::relay_all`].
pub struct Relay<S, T = OutboxSource> {
    pool: PgPool,
    sink: S,
    source: T,
    hooks: Arc<dyn RelayHooks>,
    lock_class: i32,
    batch_size: i64,
    keys_at_once: Option<usize>,
    shards_at_once: usize,
    shard_groups: u8,
    shard_depth: u8,
    passes_at_once: Option<Arc<Semaphore>>,
    poll_every: Duration,
    stats: Arc<RelayStats>,
}

impl<S, T: Source> std::fmt::Debug for Relay<S, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("source", &self.source.name())
            .field("batch_size", &self.batch_size)
            .finish_non_exhaustive()
    }
}
