//! Making a relay ([`Relay::new`], [`Relay::over`]) and its settings, each
//! set by a method that takes and returns it; what it holds.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::Semaphore;

use super::{DEFAULT_BATCH_SIZE, MAX_SHARD_DEPTH, NoHooks, Relay, RelayHooks, RelayStats, Sink};
use crate::store::source::{OutboxSource, Source};
use crate::store::{Effectively, SHARDS};

impl<S: Sink> Relay<S> {
    /// A relay of `fx`'s outbox into `sink`: batches of 2,000 rows, the 16
    /// shards in 2 groups passed over side by side, every key of a batch
    /// sent at once, a look every second when no `NOTIFY` came.
    pub fn new(fx: &Effectively, sink: S) -> Self {
        Relay::over(fx.pool().clone(), OutboxSource::new(fx), sink)
    }

    /// How long [`Relay::run`] keeps a published row (counted from when it
    /// was written) before it deletes it, once a minute, in batches
    /// ([`Outbox::expire`](crate::store::Outbox::expire)); `None` keeps every row
    /// (the user expires them). Default:
    /// [`DEFAULT_KEEP_PUBLISHED`](crate::store::DEFAULT_KEEP_PUBLISHED).
    ///
    /// `Some(Duration::ZERO)` keeps none: a pass deletes the rows it
    /// delivered instead of marking them, in the same transaction: a
    /// pass's mark took a third to a half as long (FINDINGS.md §26).
    /// The outbox then holds no record of what was sent, and a msg_id the
    /// caller supplies may be enqueued again once its row is gone (the
    /// consumer's inbox still takes the second copy as a duplicate while
    /// it remembers the first).
    pub fn keep_published(self, keep: Option<Duration>) -> Self {
        Self {
            source: self.source.keep_published(keep),
            ..self
        }
    }
}

impl<S: Sink, T: Source> Relay<S, T> {
    /// A relay of `source`'s rows (on `pool`) into `sink`, with the
    /// defaults of [`Relay::new`].
    pub fn over(pool: PgPool, source: T, sink: S) -> Self {
        // The advisory lock of shard s is (class, s); the class is the
        // source's, so two sources' relays never meet.
        let h = blake3::hash(format!("effectively.relay:{}", source.name()).as_bytes());
        let b = h.as_bytes();
        Self {
            pool,
            sink,
            source,
            hooks: Arc::new(NoHooks),
            lock_class: i32::from_be_bytes([b[0], b[1], b[2], b[3]]),
            batch_size: DEFAULT_BATCH_SIZE,
            keys_at_once: None,
            shards_at_once: 4,
            shard_groups: 2,
            shard_depth: 1,
            passes_at_once: None,
            poll_every: Duration::from_secs(1),
            stats: Arc::default(),
        }
    }

    /// Rows read per pass (at least 1; default 2,000), the pass's shards
    /// an equal share each. A pass's sends take about one round trip to
    /// the destination whatever its size, so bigger batches drain faster,
    /// until the database's work per row (claim and mark) bounds the pass
    /// (FINDINGS.md §26: 2,000 drained 1.2–2.2× as fast as 500 into Kafka,
    /// 8,000 no faster). A relay killed mid-pass sends its batch again.
    pub fn batch_size(self, rows: u32) -> Self {
        Self {
            batch_size: i64::from(rows.max(1)),
            ..self
        }
    }

    /// Keys of a batch sent side by side (at least 1); each key's rows go
    /// as [`Sink::send_in_order`] sends them (one after the other, or all in
    /// flight through a sink that keeps their order). Default: every key
    /// of the batch, as a Kafka producer wants; bound it for a sink whose
    /// destination takes only so many requests at once.
    pub fn keys_at_once(self, keys: usize) -> Self {
        Self {
            keys_at_once: Some(keys.max(1)),
            ..self
        }
    }

    /// Shards passed over side by side by [`Relay::relay_all`] (1 to 16);
    /// each holds a connection for its pass. Default 4.
    pub fn shards_at_once(self, shards: usize) -> Self {
        Self {
            shards_at_once: shards.clamp(1, usize::from(SHARDS)),
            ..self
        }
    }

    /// Groups of shards [`Relay::run`] passes over side by side (1 to 16;
    /// shard `s` is in group `s % groups`), each pass of a group one
    /// transaction over its shards, holding one connection. Default 2.
    pub fn shard_groups(self, groups: u8) -> Self {
        Self {
            shard_groups: groups.clamp(1, SHARDS as u8),
            ..self
        }
    }

    /// Passes each group of [`Relay::run`] has in flight at once (1 to
    /// [`MAX_SHARD_DEPTH`]), each under a lock slot of its own, so that one
    /// pass claims and settles while another waits for its sends. Only for
    /// a source whose passes may overlap
    /// ([`Source::overlapping_passes`]); 1 for any other. Default 1.
    pub fn shard_depth(self, depth: u8) -> Self {
        let depth = if self.source.overlapping_passes() {
            depth.clamp(1, MAX_SHARD_DEPTH)
        } else {
            1
        };
        Self {
            shard_depth: depth,
            ..self
        }
    }

    /// The most passes [`Relay::run`] has in flight at once, over every
    /// group (at least 1): each holds a connection. Default: one per group
    /// and depth slot.
    pub fn passes_at_once(self, passes: usize) -> Self {
        Self {
            passes_at_once: Some(Arc::new(Semaphore::new(passes.max(1)))),
            ..self
        }
    }

    /// How long [`Relay::run`] waits for a `NOTIFY` before it looks anyway.
    pub fn poll_every(self, every: Duration) -> Self {
        Self {
            poll_every: every,
            ..self
        }
    }

    /// What it tells as its passes go ([`RelayHooks`]).
    pub fn hooks(self, hooks: Arc<dyn RelayHooks>) -> Self {
        Self { hooks, ..self }
    }

    /// Its counts.
    pub fn stats(&self) -> Arc<RelayStats> {
        self.stats.clone()
    }

    /// Its sink.
    pub fn sink(&self) -> &S {
        &self.sink
    }

    /// Its source.
    pub fn source(&self) -> &T {
        &self.source
    }
}
