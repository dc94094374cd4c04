// --- configuration --------------------------------------------------------

use crate::properties::{EFFECT_HAS_INTENT, ENDS_WITH_ONE_EFFECT, NO_DOUBLE_EFFECT};

/// How orders writes an order and its event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Write {
    /// Key, order and outbox row in one transaction; the relay publishes.
    Outbox,
    /// Broken (b): publish to the broker, then commit the order (dual write).
    PublishFirst,
    /// Broken (b'): commit the order, then publish (save-then-publish).
    SaveFirst,
}

/// How payments applies a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Consume {
    /// Inbox claim and charge in one transaction, offsets committed after.
    Atomic,
    /// Broken (a): the inbox row's transaction, then the effect's.
    SplitInboxFirst,
    /// Broken (a): the effect's transaction, then the inbox row's.
    SplitEffectFirst,
    /// Broken (c): the offset committed before the transaction.
    OffsetsFirst,
}

/// The bounds and the variant of one check.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Config {
    /// Clients, one idempotency key (one create intent) each.
    pub clients: u8,
    /// The first client cancels its order once acknowledged: a second event
    /// of the same aggregate.
    pub cancel: bool,
    /// Retries each client may send with its key.
    pub retries: u8,
    /// Relay processes racing for the shard's lease.
    pub relays: u8,
    /// Partitions of the topic (an order's partition: its id modulo this).
    pub partitions: u8,
    /// Orders crashes (kill -9) in a run.
    pub orders_crashes: u8,
    /// Relay crashes in a run (all relays together).
    pub relay_crashes: u8,
    /// Payments crashes in a run.
    pub payments_crashes: u8,
    /// Lease expiries (a paused holder losing its lock) in a run.
    pub lease_expiries: u8,
    /// Redeliveries (seeks back to the earliest retained offset) in a run.
    pub redeliveries: u8,
    /// Idempotency keys and inbox rows expire (the retentions are modelled).
    pub expiry: bool,
    /// How orders writes.
    pub write: Write,
    /// How payments consumes.
    pub consume: Consume,
    /// Broken (d) when false: the inbox retention is shorter than the
    /// redelivery horizon (a row expires once its message's offset is
    /// committed, while the message can still be redelivered).
    pub inbox_covers_horizon: bool,
    /// What the lease's epoch fences.
    pub fence: Fence,
}

/// What a relay's lease fences once it has moved to another holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fence {
    /// Today's relay: the mark only. The mark is the commit of the claim's
    /// transaction, which the session's end aborts (the advisory lock goes
    /// with it); the produce is not fenced: a relay paused between its claim
    /// and its produce (SIGSTOP, a partition) produces when it resumes.
    Mark,
    /// `fenced-publish`: the publish too, as a transactional producer per
    /// shard (one `transactional.id` per shard, whose next holder's
    /// `init_transactions` bumps the epoch) would refuse a stale producer.
    Publish,
}

impl Fence {
    /// A short name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Mark => "mark-only",
            Self::Publish => "fenced-publish",
        }
    }
}

/// `base` with the faults a stale relay needs to put a key's earlier event
/// after its later one on the log: two relays and a second event of one key.
pub fn log_order_scope(base: &Config) -> Config {
    Config {
        relays: base.relays.max(2),
        cancel: true,
        ..base.clone()
    }
}

impl Config {
    /// The correct protocol at the bounds the tests use (seconds in a debug
    /// build): one client that retries once and cancels its order (two
    /// events for one key), one relay, one partition, one crash of each
    /// process, a lease expiry and a redelivery. One relay cannot put a
    /// stale event on the log (its own stale claim is published before it
    /// claims again): [`Config::test_two_relays`] has two.
    pub fn test() -> Self {
        Self {
            clients: 1,
            cancel: true,
            retries: 1,
            relays: 1,
            partitions: 1,
            orders_crashes: 1,
            relay_crashes: 1,
            payments_crashes: 1,
            lease_expiries: 1,
            redeliveries: 1,
            expiry: true,
            write: Write::Outbox,
            consume: Consume::Atomic,
            inbox_covers_horizon: true,
            fence: Fence::Mark,
        }
    }

    /// Two relays at the test bounds made smaller where it does not touch
    /// the relays (no retry, no orders or payments crash; the redelivery
    /// still makes payments read the log again from its start), so that a
    /// debug test explores it in seconds: the scope where a stale relay's
    /// publish lands after a later event of its key, and the effects must
    /// stay in order anyway.
    pub fn test_two_relays() -> Self {
        Self {
            retries: 0,
            orders_crashes: 0,
            payments_crashes: 0,
            ..log_order_scope(&Self::test())
        }
    }

    /// The correct protocol at the full bounds (`make model`), in two scopes
    /// each larger than [`Config::test`] in one direction (two clients with
    /// a cancel did not finish in 6 minutes here, even with one relay): two
    /// clients (keys) with one event each, and one client whose order is
    /// cancelled with two relays racing for the lease.
    pub fn full() -> [(&'static str, Self); 2] {
        [
            (
                "two keys",
                Self {
                    clients: 2,
                    cancel: false,
                    ..Self::test()
                },
            ),
            (
                "two relays",
                Self {
                    relays: 2,
                    ..Self::test()
                },
            ),
        ]
    }
}

/// The broken variants: each a change of one flag of [`Config`], and the
/// property the checker must find broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bug {
    /// (a) effect, commit, then inbox row: a crash between doubles the effect.
    SplitEffectFirst,
    /// (a) inbox row, commit, then effect: a crash between loses it.
    SplitInboxFirst,
    /// (b) publish before the order commits: an effect without an intent.
    PublishBeforeCommit,
    /// (b') commit the order, then publish: a crash between loses the event.
    SaveThenPublish,
    /// (c) offsets committed before the effect: a crash between loses it.
    OffsetsBeforeEffect,
    /// (d) inbox retention shorter than the redelivery horizon: a late
    /// redelivery is applied again.
    InboxRetentionShort,
}

impl Bug {
    /// Every broken variant.
    pub const ALL: [Bug; 6] = [
        Self::SplitEffectFirst,
        Self::SplitInboxFirst,
        Self::PublishBeforeCommit,
        Self::SaveThenPublish,
        Self::OffsetsBeforeEffect,
        Self::InboxRetentionShort,
    ];

    /// A short name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::SplitEffectFirst => "split-effect-first",
            Self::SplitInboxFirst => "split-inbox-first",
            Self::PublishBeforeCommit => "publish-before-commit",
            Self::SaveThenPublish => "save-then-publish",
            Self::OffsetsBeforeEffect => "offsets-before-effect",
            Self::InboxRetentionShort => "inbox-retention-short",
        }
    }

    /// The property this variant breaks.
    pub const fn breaks(self) -> &'static str {
        match self {
            Self::SplitEffectFirst | Self::InboxRetentionShort => NO_DOUBLE_EFFECT,
            Self::PublishBeforeCommit => EFFECT_HAS_INTENT,
            Self::SplitInboxFirst | Self::SaveThenPublish | Self::OffsetsBeforeEffect => {
                ENDS_WITH_ONE_EFFECT
            }
        }
    }

    /// `base` with this variant's flag flipped.
    pub fn config(self, base: &Config) -> Config {
        let mut c = base.clone();
        match self {
            Self::SplitEffectFirst => c.consume = Consume::SplitEffectFirst,
            Self::SplitInboxFirst => c.consume = Consume::SplitInboxFirst,
            Self::PublishBeforeCommit => c.write = Write::PublishFirst,
            Self::SaveThenPublish => c.write = Write::SaveFirst,
            Self::OffsetsBeforeEffect => c.consume = Consume::OffsetsFirst,
            Self::InboxRetentionShort => c.inbox_covers_horizon = false,
        }
        c
    }
}
