//! A model of the pipeline's protocol, checked by `stateright` over every
//! interleaving of its steps, crashes, retries and redeliveries at small
//! bounds.
//!
//! The model is one state machine ([`Pipeline`]) whose state holds every
//! process and store at once: the clients, orders' in-flight requests, the
//! idempotency keys, the orders, the outbox, the relays and their shard lease,
//! the broker's log per partition, and payments with its inbox, its charges
//! (the effects) and its offsets. Each action is one step of one process that
//! the real code takes atomically (one transaction, one produce, one offset
//! commit), or a crash, an expiry or a redelivery. The checker explores every
//! order of them breadth first.
//!
//! # Actions and the code they stand for
//!
//! | action | real code |
//! | --- | --- |
//! | [`Action::Send`], [`Action::Retry`] | loadgen: a create with an `Idempotency-Key`, sent again with the same key after a timeout (the first may still be in flight) or an error |
//! | [`Action::Commit`] | orders `store.rs` `Store::write_batch`: key claimed, order and outbox row in one statement (one transaction); a taken key replays its stored response |
//! | [`Action::SecondWrite`] | broken variant (b) only: the commit after the publish, or the publish after the commit (the dual write the outbox replaces) |
//! | [`Action::Answer`] | orders `writer.rs` `Writer::create` returning the claim; the 201 (or the replay) reaches the client |
//! | [`Action::OrdersCrash`] | orders killed before its commit or at crash point `commit` (after the commit, before the responses): every open request fails |
//! | [`Action::Cancel`] | a second event of the same aggregate (`order.cancelled`), written with its outbox row in one transaction, so one key has two events in order |
//! | [`Action::Acquire`] | the library relay's `LOCK_SHARDS` (`effectively::store::Relay`, as the relay binary runs it): the shard's lock, as a lease with an epoch |
//! | [`Action::Claim`] | relay `outbox.rs` `read_shards`: the shard's oldest pending row (batch of one; a key lives in one shard, so its aggregate has no earlier pending row) |
//! | [`Action::Publish`] | the relay's sink (`engine.rs` `EventSink`, through the library's `KafkaSink`): the broker appends the row's message to its key's partition and acks; not fenced by the lease (a relay paused after its claim produces when it resumes, whatever the lease did meanwhile), unless [`Fence::Publish`] |
//! | [`Action::Mark`] | the library relay's pass: the commit of the claim's transaction (the settle marks what was delivered, `engine.rs` `OrdersOutbox`, `outbox.rs` `mark_published`), refused once the lease moved, since the session's end aborted that transaction |
//! | [`Action::RelayCrash`] | relay killed after the claim (before the publish) or at crash point `publish` (after the ack, before the mark): the lock goes with its session |
//! | [`Action::LeaseExpire`] | the holder's session ends while it is paused (chaos SIGSTOPs relays): its lock is released, the process does not know |
//! | [`Action::Apply`], [`Action::Finish`] | payments `inbox.rs` `apply_batch` / `claim_and_charge`: inbox claim (`claim_inbox`) and charge (`insert_effects`) in one transaction; `unsafe_split.rs` `apply_batch` for the split variants |
//! | [`Action::CommitOffsets`] | payments `consumer.rs`: the offsets committed after the batch's transaction |
//! | [`Action::PaymentsCrash`] | payments killed after its transaction, before the offset commit, or at crash point `split` (between the split variant's two transactions); crash points `claim` and `effect` fall inside the one transaction, which rolls back: the same state as no step |
//! | [`Action::Redeliver`] | a duplicate delivery by a seek back (payments `dup.rs`), or chaos's offset reset: the consumer reads again from the earliest retained offset |
//! | [`Action::LogRetention`] | the topic's retention deletes the oldest consumed message of a partition |
//! | [`Action::InboxExpire`] | payments `expiry.rs` `expire`: an inbox row dropped once its message is beyond the redelivery horizon (`horizon.rs`) |
//! | [`Action::KeyExpire`] | orders `store.rs` `expire_keys`: an idempotency key dropped once its client no longer retries |
//!
//! # What is abstracted away
//!
//! Time is not modelled: an expiry is an action, enabled when the real
//! system's retention would allow it (after the horizon) or, in the broken
//! variant, earlier. Batches are of one row or one message: the real
//! code's batches (one row per key, committed or rolled back together) are
//! reached here one row at a time, which is not proven equivalent; a key's
//! rows are never in flight together in either. One orders process and one payments process: orders' requests for
//! one key are serialised by the key's row in the real code, and the model's
//! commit is one atomic step. Message contents, payload fingerprints, dead
//! letters and the `UNIQUE(order_id)` on charges are left out: the effect is
//! counted per message (the ledger entry, which no second constraint guards).
//!
//! # Properties
//!
//! Safety ([`Property::always`]), each of which the correct model must keep
//! ([`PROPERTIES`]): [`NO_DOUBLE_EFFECT`], [`EFFECT_HAS_INTENT`],
//! [`ONE_ORDER_PER_KEY`], [`APPLIED_IN_KEY_ORDER`] (per-key order of the
//! effects), [`FIRST_PUBLISH_IN_KEY_ORDER`]. One more is checked and claimed
//! NOT to hold of today's relay ([`NOT_CLAIMED`]): [`LOG_IN_KEY_ORDER`], every
//! copy on the log in its key's order. Today's relay fences only its mark by
//! the lease, not its publish, so a stale produce can land after the next
//! holder published the key's later event; the checker finds that
//! counter-example with two relays ([`log_order_scope`]), and the
//! `fenced-publish` variant ([`Fence::Publish`], what a transactional
//! producer per shard would give) keeps it.
//! Against vacuity ([`Property::sometimes`]): the situations of [`REACHED`]
//! (a duplicate on the log, a claim under an expired lease, an expired inbox
//! row, a key's earlier event on the log after its later one, ...) must each
//! be reached by the correct model at its bounds.
//! Liveness ([`ENDS_WITH_ONE_EFFECT`]) is checked as a safety property of the
//! terminal states: every budget (crashes, retries, expiries, redeliveries)
//! is finite and every step consumes one or makes progress, so every path
//! ends in a state where no action is enabled, and [`check_acyclic`] verifies
//! that no cycle exists. In every such terminal state, every order that was
//! committed (every intent: the acknowledged ones among them) must have
//! exactly one charge, and a cancelled one exactly one refund. That is
//! "every run, once its faults stop, ends with every intent applied once",
//! with the weak fairness that a run does not stop while a step is enabled.
//! `stateright`'s own `eventually` is not used for it: it reports a path only
//! at a terminal state whose path never satisfied the condition, and the
//! condition ("every acknowledged intent has one effect") holds vacuously in
//! the initial state.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::hash::{DefaultHasher, Hash, Hasher};

use stateright::{Checker, HasDiscoveries, Model, Path, Property};

// --- properties ----------------------------------------------------------

/// Safety: no message's effect is applied twice (one charge per order.created,
/// one refund per order.cancelled).
pub const NO_DOUBLE_EFFECT: &str = "never two effects for one intent";
/// Safety: every effect's order is committed, or its create is still in flight
/// at orders (which may yet commit it).
pub const EFFECT_HAS_INTENT: &str = "never an effect without an intent";
/// Safety: one order per idempotency key, and every answer for a key names it.
pub const ONE_ORDER_PER_KEY: &str = "a retried key never yields a second order";
/// Safety: payments applies each aggregate's events in their order (no refund
/// before its charge, no charge after its refund): per-key order of the
/// effects. It rests on [`FIRST_PUBLISH_IN_KEY_ORDER`]: payments reads a
/// partition in offset order and applies a message at its first delivery
/// (a later copy is an inbox hit), and the inbox row outlives every copy.
pub const APPLIED_IN_KEY_ORDER: &str = "per-key order of applied events";
/// Safety: on the broker's log, the first copy of each of an aggregate's
/// events is in the events' order (a later row is claimed only once the
/// earlier one is marked, which is after its ack). Later copies (a stale
/// relay's, a re-publish after a crash) may land anywhere after their first.
pub const FIRST_PUBLISH_IN_KEY_ORDER: &str = "per-key order of first publishes on the log";
/// Every copy on the broker's log in its aggregate's order: no copy of an
/// event after a later event of its aggregate. NOT claimed of today's
/// relay ([`NOT_CLAIMED`]): its publish is not fenced by the lease.
pub const LOG_IN_KEY_ORDER: &str = "per-key order on the log";
/// Liveness, as a property of terminal states: every intent ends with exactly
/// one effect.
pub const ENDS_WITH_ONE_EFFECT: &str = "every intent ends with exactly one effect";

/// The safety properties and the liveness one the correct model must keep,
/// as the checker names them.
pub const PROPERTIES: [&str; 6] = [
    NO_DOUBLE_EFFECT,
    EFFECT_HAS_INTENT,
    ONE_ORDER_PER_KEY,
    APPLIED_IN_KEY_ORDER,
    FIRST_PUBLISH_IN_KEY_ORDER,
    ENDS_WITH_ONE_EFFECT,
];

/// Properties checked but not claimed of today's code: the checker must
/// find each broken in the correct model at [`log_order_scope`]'s bounds.
pub const NOT_CLAIMED: [&str; 1] = [LOG_IN_KEY_ORDER];

/// Situations the correct model must reach ([`Property::sometimes`]), so that
/// the properties above are not kept by faults never happening.
pub const REACHED: [&str; 7] = [
    "a message is on the log twice",
    "a relay holds a claim under an expired lease",
    "payments has crashed and an effect is applied",
    "an inbox row has expired",
    "an idempotency key has expired",
    "a cancelled order is refunded",
    "a key's earlier event is on the log after its later one",
];

// --- configuration --------------------------------------------------------

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

// --- state ------------------------------------------------------------------

/// An event's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `order.created`: payments charges.
    Created,
    /// `order.cancelled`: payments refunds.
    Cancelled,
}

/// A message (an event with its `msg_id`): its index in [`State::msgs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Msg {
    /// The aggregate (order id).
    pub order: u8,
    /// The event.
    pub kind: Kind,
}

/// Where a client is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Not sent yet.
    Idle,
    /// Sent, waiting for an answer.
    Waiting,
    /// Its request failed (orders crashed); it may retry.
    Failed,
    /// Answered: the order it was given.
    Acked(u8),
}

/// A client (one idempotency key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Client {
    /// Where it is.
    pub phase: Phase,
    /// Retries left.
    pub retries_left: u8,
    /// An answer named another order than the first answer did.
    pub second_order: bool,
    /// It has cancelled its order.
    pub cancelled: bool,
}

/// A request inside orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// Received, nothing written.
    Received,
    /// (b) published as order `order`'s message `msg`, not committed.
    Published { order: u8, msg: u8 },
    /// (b') order committed, its event not published yet.
    Saved { order: u8 },
    /// Committed (or replayed); the answer not sent yet.
    Committed { order: u8 },
}

/// A request inside orders: its key (client) and stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Req {
    /// The client's index.
    pub key: u8,
    /// How far it got.
    pub stage: Stage,
}

/// An outbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Row {
    /// Its message.
    pub msg: u8,
    /// Marked published.
    pub published: bool,
}

/// A relay's batch in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RelayStage {
    /// No batch.
    Idle,
    /// Row claimed under the lease of this epoch.
    Claimed { row: u8, epoch: u8 },
    /// Row published (broker acked), not marked.
    Published { row: u8, epoch: u8 },
}

/// Payments' step in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayStage {
    /// Between messages.
    Idle,
    /// Split variants: the first transaction committed for `msg`.
    Half { msg: u8 },
    /// (c): the offset past `msg` committed, its transaction not run.
    Fetched { msg: u8 },
}

/// The whole pipeline.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct State {
    /// One per idempotency key.
    pub clients: Vec<Client>,
    /// Orders' open requests (sorted: a multiset).
    pub reqs: Vec<Req>,
    /// The idempotency keys: the order each key created, while stored.
    pub keys: Vec<Option<u8>>,
    /// Committed orders: (order id, key), in id order.
    pub orders: Vec<(u8, u8)>,
    /// Order ids handed out (committed or not).
    pub next_order: u8,
    /// Every message minted, by `msg_id`.
    pub msgs: Vec<Msg>,
    /// The outbox, by row id.
    pub outbox: Vec<Row>,
    /// The shard's lease: holder and epoch.
    pub lease: Option<(u8, u8)>,
    /// The last epoch handed out.
    pub epoch: u8,
    /// Each relay's batch.
    pub relays: Vec<RelayStage>,
    /// The broker's log per partition (msg ids; never shrinks).
    pub log: Vec<Vec<u8>>,
    /// The first retained offset per partition.
    pub log_start: Vec<u8>,
    /// Payments' position (next offset to read) per partition.
    pub position: Vec<u8>,
    /// Payments' committed offset per partition.
    pub committed: Vec<u8>,
    /// Payments' step in flight.
    pub pay: PayStage,
    /// The inbox: msg ids claimed (sorted).
    pub inbox: Vec<u8>,
    /// The effects (charges and refunds) in the order applied, by msg id.
    pub effects: Vec<u8>,
    /// Fault budgets left: orders, relay, payments crashes, lease expiries,
    /// redeliveries.
    pub budget: [u8; 5],
}

const ORDERS_CRASH: usize = 0;
const RELAY_CRASH: usize = 1;
const PAYMENTS_CRASH: usize = 2;
const LEASE_EXPIRY: usize = 3;
const REDELIVERY: usize = 4;

/// One step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Client `k` sends its create.
    Send(u8),
    /// Client `k` retries with the same key (after a timeout or an error).
    Retry(u8),
    /// Orders writes request `i` (of `reqs`): commit (or, in the dual-write
    /// variants, the first of its two writes).
    Commit(u8),
    /// Orders' second write of request `i` in the dual-write variants.
    SecondWrite(u8),
    /// Orders answers request `i`.
    Answer(u8),
    /// Orders is killed: every open request fails.
    OrdersCrash,
    /// Client `k` cancels its order.
    Cancel(u8),
    /// Relay `r` takes the shard's lease.
    Acquire(u8),
    /// Relay `r` claims the first pending row.
    Claim(u8),
    /// Relay `r` publishes its claimed row.
    Publish(u8),
    /// Relay `r` marks its row published.
    Mark(u8),
    /// Relay `r` is killed.
    RelayCrash(u8),
    /// The lease's holder loses it while paused.
    LeaseExpire,
    /// Payments reads the next message of partition `p` and applies it (or,
    /// in the broken variants, takes the first of two steps).
    Apply(u8),
    /// Payments' second step in the broken variants.
    Finish,
    /// Payments commits its offsets.
    CommitOffsets,
    /// Payments is killed.
    PaymentsCrash,
    /// Partition `p` is read again from its earliest retained offset.
    Redeliver(u8),
    /// The broker deletes partition `p`'s oldest consumed message.
    LogRetention(u8),
    /// Payments' expiry drops message `m`'s inbox row.
    InboxExpire(u8),
    /// Orders' expiry drops key `k`.
    KeyExpire(u8),
}

/// The model: a [`Config`].
#[derive(Debug, Clone)]
pub struct Pipeline(pub Config);

fn u(n: usize) -> u8 {
    u8::try_from(n).unwrap_or(u8::MAX)
}

impl State {
    fn partition(&self, cfg: &Config, msg: u8) -> usize {
        usize::from(self.msgs[usize::from(msg)].order % cfg.partitions.max(1))
    }

    fn claimable(&self) -> Option<u8> {
        let msgs = &self.msgs;
        self.outbox.iter().enumerate().find_map(|(i, row)| {
            let order = msgs[usize::from(row.msg)].order;
            let earlier_pending = self.outbox[..i]
                .iter()
                .any(|e| !e.published && msgs[usize::from(e.msg)].order == order);
            (!row.published && !earlier_pending).then_some(u(i))
        })
    }

    fn order_committed(&self, order: u8) -> bool {
        self.orders.iter().any(|&(o, _)| o == order)
    }

    fn effect_count(&self, msg: u8) -> usize {
        self.effects.iter().filter(|&&m| m == msg).count()
    }

    fn count_effects(&self, order: u8, kind: Kind) -> usize {
        self.effects
            .iter()
            .filter(|&&m| self.msgs[usize::from(m)] == Msg { order, kind })
            .count()
    }

    fn push_req(&mut self, req: Req) {
        self.reqs.push(req);
        self.reqs.sort();
    }

    fn new_msg(&mut self, order: u8, kind: Kind) -> u8 {
        self.msgs.push(Msg { order, kind });
        u(self.msgs.len() - 1)
    }

    fn answer(&mut self, key: u8, order: u8) {
        let c = &mut self.clients[usize::from(key)];
        match c.phase {
            Phase::Acked(first) if first != order => c.second_order = true,
            Phase::Acked(_) => {}
            _ => c.phase = Phase::Acked(order),
        }
    }

    fn apply_effect(&mut self, msg: u8) {
        self.effects.push(msg);
    }

    fn claim_inbox(&mut self, msg: u8) -> bool {
        match self.inbox.binary_search(&msg) {
            Ok(_) => false,
            Err(at) => {
                self.inbox.insert(at, msg);
                true
            }
        }
    }
}

impl Pipeline {
    fn cfg(&self) -> &Config {
        &self.0
    }

    /// Whether no step is enabled.
    pub fn is_terminal(&self, state: &State) -> bool {
        let mut actions = Vec::new();
        self.actions(state, &mut actions);
        actions.is_empty()
    }

    /// Whether client `key` is done with its key: answered, or failed with
    /// no retry left, and no request of its key is open.
    fn key_done(&self, s: &State, key: u8) -> bool {
        let c = &s.clients[usize::from(key)];
        let done = match c.phase {
            Phase::Acked(_) => true,
            Phase::Failed => c.retries_left == 0,
            Phase::Idle | Phase::Waiting => false,
        };
        done && !s.reqs.iter().any(|r| r.key == key)
    }

    /// Whether message `msg` can never reach payments again: the real
    /// system's redelivery horizon has passed for it.
    fn beyond_horizon(&self, s: &State, msg: u8) -> bool {
        let cfg = self.cfg();
        let p = s.partition(cfg, msg);
        if s.pay == (PayStage::Half { msg }) || s.pay == (PayStage::Fetched { msg }) {
            return false;
        }
        if !cfg.inbox_covers_horizon {
            // (d): the retention counts from the offset commit.
            let from = usize::from(s.committed[p]);
            return !s.log[p][from.min(s.log[p].len())..].contains(&msg);
        }
        let retained = usize::from(s.log_start[p]);
        let on_log = s.log[p][retained..].contains(&msg);
        let row = s.outbox.iter().position(|r| r.msg == msg);
        let republishable = row.is_some_and(|i| {
            !s.outbox[i].published
                || s.relays.iter().any(|r| match *r {
                    RelayStage::Claimed { row, .. } | RelayStage::Published { row, .. } => {
                        usize::from(row) == i
                    }
                    RelayStage::Idle => false,
                })
        });
        let orders_may_publish = s
            .reqs
            .iter()
            .any(|r| matches!(r.stage, Stage::Published { msg: m, .. } if m == msg));
        !on_log && !republishable && !orders_may_publish
    }

    /// The first of orders' writes for a request.
    fn commit(&self, s: &mut State, i: usize) {
        let cfg = self.cfg();
        let Req { key, stage } = s.reqs[i];
        debug_assert_eq!(stage, Stage::Received);
        let k = usize::from(key);
        if let Some(order) = s.keys[k] {
            // The key is taken: its stored response is replayed.
            s.reqs[i].stage = Stage::Committed { order };
        } else {
            let order = s.next_order;
            s.next_order += 1;
            match cfg.write {
                Write::Outbox => {
                    s.keys[k] = Some(order);
                    s.orders.push((order, key));
                    let msg = s.new_msg(order, Kind::Created);
                    s.outbox.push(Row {
                        msg,
                        published: false,
                    });
                    s.reqs[i].stage = Stage::Committed { order };
                }
                Write::PublishFirst => {
                    let msg = s.new_msg(order, Kind::Created);
                    let p = s.partition(cfg, msg);
                    s.log[p].push(msg);
                    s.reqs[i].stage = Stage::Published { order, msg };
                }
                Write::SaveFirst => {
                    s.keys[k] = Some(order);
                    s.orders.push((order, key));
                    s.reqs[i].stage = Stage::Saved { order };
                }
            }
        }
        s.reqs.sort();
    }

    fn second_write(&self, s: &mut State, i: usize) {
        let cfg = self.cfg();
        let Req { key, stage } = s.reqs[i];
        let k = usize::from(key);
        match stage {
            Stage::Published { order, .. } => {
                // The commit, after the publish: a taken key replays (the
                // published message's order never commits).
                let order = match s.keys[k] {
                    Some(existing) => existing,
                    None => {
                        s.keys[k] = Some(order);
                        s.orders.push((order, key));
                        s.orders.sort();
                        order
                    }
                };
                s.reqs[i].stage = Stage::Committed { order };
            }
            Stage::Saved { order } => {
                let msg = s.new_msg(order, Kind::Created);
                let p = s.partition(cfg, msg);
                s.log[p].push(msg);
                s.reqs[i].stage = Stage::Committed { order };
            }
            Stage::Received | Stage::Committed { .. } => {}
        }
        s.reqs.sort();
    }

    /// Payments' transaction for `msg` (inbox claim + effect), as the
    /// variant runs its first step.
    fn apply(&self, s: &mut State, p: usize) {
        let msg = s.log[p][usize::from(s.position[p])];
        s.position[p] += 1;
        match self.cfg().consume {
            Consume::Atomic => {
                if s.claim_inbox(msg) {
                    s.apply_effect(msg);
                }
            }
            Consume::SplitInboxFirst => {
                if s.claim_inbox(msg) {
                    s.pay = PayStage::Half { msg };
                }
            }
            Consume::SplitEffectFirst => {
                if s.inbox.binary_search(&msg).is_err() {
                    s.apply_effect(msg);
                    s.pay = PayStage::Half { msg };
                }
            }
            Consume::OffsetsFirst => {
                s.committed[p] = s.position[p];
                s.pay = PayStage::Fetched { msg };
            }
        }
    }

    fn finish(&self, s: &mut State) {
        match (self.cfg().consume, s.pay) {
            (Consume::SplitInboxFirst, PayStage::Half { msg }) => s.apply_effect(msg),
            (Consume::SplitEffectFirst, PayStage::Half { msg }) => {
                s.claim_inbox(msg);
            }
            (_, PayStage::Fetched { msg }) if s.claim_inbox(msg) => s.apply_effect(msg),
            _ => {}
        }
        s.pay = PayStage::Idle;
    }

    /// Whether `s` is terminal and some intent lacks its one effect.
    fn ends_badly(&self, s: &State) -> bool {
        if !self.is_terminal(s) {
            return false;
        }
        s.orders.iter().any(|&(order, key)| {
            let cancelled = s.clients[usize::from(key)].cancelled;
            s.count_effects(order, Kind::Created) != 1
                || (cancelled && s.count_effects(order, Kind::Cancelled) != 1)
        })
    }
}

/// The first copy of each message of `part`, in log order.
fn first_copies(part: &[u8]) -> impl Iterator<Item = u8> + '_ {
    part.iter()
        .enumerate()
        .filter(|&(i, m)| !part[..i].contains(m))
        .map(|(_, &m)| m)
}

fn in_key_order(msgs: &[Msg], seq: impl Iterator<Item = u8>) -> bool {
    let mut last: HashMap<u8, Kind> = HashMap::new();
    for m in seq {
        let msg = msgs[usize::from(m)];
        match last.get(&msg.order) {
            Some(&k) if k > msg.kind => return false,
            _ => {
                last.insert(msg.order, msg.kind);
            }
        }
    }
    true
}

impl Model for Pipeline {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let c = self.cfg();
        let n = usize::from(c.clients);
        let p = usize::from(c.partitions.max(1));
        vec![State {
            clients: vec![
                Client {
                    phase: Phase::Idle,
                    retries_left: c.retries,
                    second_order: false,
                    cancelled: false,
                };
                n
            ],
            reqs: Vec::new(),
            keys: vec![None; n],
            orders: Vec::new(),
            next_order: 0,
            msgs: Vec::new(),
            outbox: Vec::new(),
            lease: None,
            epoch: 0,
            relays: vec![RelayStage::Idle; usize::from(c.relays)],
            log: vec![Vec::new(); p],
            log_start: vec![0; p],
            position: vec![0; p],
            committed: vec![0; p],
            pay: PayStage::Idle,
            inbox: Vec::new(),
            effects: Vec::new(),
            budget: [
                c.orders_crashes,
                c.relay_crashes,
                c.payments_crashes,
                c.lease_expiries,
                c.redeliveries,
            ],
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let cfg = self.cfg();
        // Clients.
        for (k, c) in s.clients.iter().enumerate() {
            let k = u(k);
            match c.phase {
                Phase::Idle => actions.push(Action::Send(k)),
                Phase::Waiting | Phase::Failed if c.retries_left > 0 => {
                    actions.push(Action::Retry(k));
                }
                Phase::Acked(_) if cfg.cancel && k == 0 && !c.cancelled => {
                    actions.push(Action::Cancel(k));
                }
                _ => {}
            }
        }
        // Orders.
        let mut seen = BTreeSet::new();
        for (i, r) in s.reqs.iter().enumerate() {
            if !seen.insert(*r) {
                continue; // an identical request: the same successor
            }
            let i = u(i);
            match r.stage {
                Stage::Received => actions.push(Action::Commit(i)),
                Stage::Published { .. } | Stage::Saved { .. } => {
                    actions.push(Action::SecondWrite(i));
                }
                Stage::Committed { .. } => actions.push(Action::Answer(i)),
            }
        }
        if !s.reqs.is_empty() && s.budget[ORDERS_CRASH] > 0 {
            actions.push(Action::OrdersCrash);
        }
        for (k, key) in s.keys.iter().enumerate() {
            let k8 = u(k);
            if cfg.expiry && key.is_some() && self.key_done(s, k8) {
                actions.push(Action::KeyExpire(k8));
            }
        }
        // Relays.
        for (r, stage) in s.relays.iter().enumerate() {
            let r8 = u(r);
            match stage {
                RelayStage::Idle => {
                    if s.lease.is_none() && s.claimable().is_some() {
                        actions.push(Action::Acquire(r8));
                    } else if s.lease.is_some_and(|(h, _)| h == r8) && s.claimable().is_some() {
                        actions.push(Action::Claim(r8));
                    }
                }
                RelayStage::Claimed { .. } => actions.push(Action::Publish(r8)),
                RelayStage::Published { .. } => actions.push(Action::Mark(r8)),
            }
            if *stage != RelayStage::Idle && s.budget[RELAY_CRASH] > 0 {
                actions.push(Action::RelayCrash(r8));
            }
        }
        if let Some((h, _)) = s.lease
            && s.relays[usize::from(h)] != RelayStage::Idle
            && s.budget[LEASE_EXPIRY] > 0
        {
            actions.push(Action::LeaseExpire);
        }
        // Payments.
        if s.pay == PayStage::Idle {
            for p in 0..s.log.len() {
                if usize::from(s.position[p]) < s.log[p].len() {
                    actions.push(Action::Apply(u(p)));
                }
            }
            if s.committed != s.position {
                actions.push(Action::CommitOffsets);
            }
            for p in 0..s.log.len() {
                if s.position[p] > s.log_start[p] && s.budget[REDELIVERY] > 0 {
                    actions.push(Action::Redeliver(u(p)));
                }
            }
        } else {
            actions.push(Action::Finish);
        }
        if (s.pay != PayStage::Idle || s.committed != s.position) && s.budget[PAYMENTS_CRASH] > 0 {
            actions.push(Action::PaymentsCrash);
        }
        // Expiry.
        for p in 0..s.log.len() {
            if s.log_start[p] < s.committed[p].min(s.position[p]) {
                actions.push(Action::LogRetention(u(p)));
            }
        }
        if cfg.expiry {
            for &m in &s.inbox {
                if self.beyond_horizon(s, m) {
                    actions.push(Action::InboxExpire(m));
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let cfg = self.cfg();
        let mut s = last.clone();
        match action {
            Action::Send(k) => {
                s.clients[usize::from(k)].phase = Phase::Waiting;
                s.push_req(Req {
                    key: k,
                    stage: Stage::Received,
                });
            }
            Action::Retry(k) => {
                let c = &mut s.clients[usize::from(k)];
                c.retries_left -= 1;
                c.phase = Phase::Waiting;
                s.push_req(Req {
                    key: k,
                    stage: Stage::Received,
                });
            }
            Action::Commit(i) => self.commit(&mut s, usize::from(i)),
            Action::SecondWrite(i) => self.second_write(&mut s, usize::from(i)),
            Action::Answer(i) => {
                let r = s.reqs.remove(usize::from(i));
                if let Stage::Committed { order } = r.stage {
                    s.answer(r.key, order);
                }
            }
            Action::OrdersCrash => {
                s.budget[ORDERS_CRASH] -= 1;
                s.reqs.clear();
                for c in &mut s.clients {
                    if c.phase == Phase::Waiting {
                        c.phase = Phase::Failed;
                    }
                }
            }
            Action::Cancel(k) => {
                let Phase::Acked(order) = s.clients[usize::from(k)].phase else {
                    return None;
                };
                s.clients[usize::from(k)].cancelled = true;
                let msg = s.new_msg(order, Kind::Cancelled);
                s.outbox.push(Row {
                    msg,
                    published: false,
                });
            }
            Action::Acquire(r) => {
                s.epoch += 1;
                s.lease = Some((r, s.epoch));
            }
            Action::Claim(r) => {
                let row = s.claimable()?;
                s.relays[usize::from(r)] = RelayStage::Claimed {
                    row,
                    epoch: s.epoch,
                };
            }
            Action::Publish(r) => {
                let RelayStage::Claimed { row, epoch } = s.relays[usize::from(r)] else {
                    return None;
                };
                if cfg.fence == Fence::Publish && s.lease != Some((r, epoch)) {
                    s.relays[usize::from(r)] = RelayStage::Idle;
                } else {
                    let msg = s.outbox[usize::from(row)].msg;
                    let p = s.partition(cfg, msg);
                    s.log[p].push(msg);
                    s.relays[usize::from(r)] = RelayStage::Published { row, epoch };
                }
            }
            Action::Mark(r) => {
                let RelayStage::Published { row, epoch } = s.relays[usize::from(r)] else {
                    return None;
                };
                // Both fences refuse a stale mark: the session's end aborted
                // the claim's transaction.
                if s.lease == Some((r, epoch)) {
                    s.outbox[usize::from(row)].published = true;
                }
                s.relays[usize::from(r)] = RelayStage::Idle;
            }
            Action::RelayCrash(r) => {
                s.budget[RELAY_CRASH] -= 1;
                s.relays[usize::from(r)] = RelayStage::Idle;
                if s.lease.is_some_and(|(h, _)| h == r) {
                    s.lease = None;
                }
            }
            Action::LeaseExpire => {
                s.budget[LEASE_EXPIRY] -= 1;
                s.lease = None;
            }
            Action::Apply(p) => self.apply(&mut s, usize::from(p)),
            Action::Finish => self.finish(&mut s),
            Action::CommitOffsets => s.committed.clone_from(&s.position),
            Action::PaymentsCrash => {
                s.budget[PAYMENTS_CRASH] -= 1;
                s.pay = PayStage::Idle;
                s.position.clone_from(&s.committed);
            }
            Action::Redeliver(p) => {
                s.budget[REDELIVERY] -= 1;
                let p = usize::from(p);
                s.position[p] = s.log_start[p];
            }
            Action::LogRetention(p) => s.log_start[usize::from(p)] += 1,
            Action::InboxExpire(m) => s.inbox.retain(|&x| x != m),
            Action::KeyExpire(k) => s.keys[usize::from(k)] = None,
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(NO_DOUBLE_EFFECT, |_, s: &State| {
                s.effects.iter().all(|&m| s.effect_count(m) == 1)
            }),
            Property::always(EFFECT_HAS_INTENT, |_, s: &State| {
                s.effects.iter().all(|&m| {
                    let order = s.msgs[usize::from(m)].order;
                    s.order_committed(order)
                        || s.reqs.iter().any(
                            |r| matches!(r.stage, Stage::Published { order: o, .. } if o == order),
                        )
                })
            }),
            Property::always(ONE_ORDER_PER_KEY, |_, s: &State| {
                s.clients.iter().enumerate().all(|(k, c)| {
                    !c.second_order
                        && s.orders
                            .iter()
                            .filter(|&&(_, key)| usize::from(key) == k)
                            .count()
                            <= 1
                })
            }),
            Property::always(APPLIED_IN_KEY_ORDER, |_, s: &State| {
                in_key_order(&s.msgs, s.effects.iter().copied())
            }),
            Property::always(FIRST_PUBLISH_IN_KEY_ORDER, |_, s: &State| {
                s.log
                    .iter()
                    .all(|part| in_key_order(&s.msgs, first_copies(part)))
            }),
            Property::always(LOG_IN_KEY_ORDER, |_, s: &State| {
                s.log
                    .iter()
                    .all(|part| in_key_order(&s.msgs, part.iter().copied()))
            }),
            Property::always(ENDS_WITH_ONE_EFFECT, |m: &Pipeline, s: &State| {
                !m.ends_badly(s)
            }),
            Property::sometimes(REACHED[0], |_, s: &State| {
                s.log
                    .iter()
                    .any(|part| part.iter().enumerate().any(|(i, m)| part[..i].contains(m)))
            }),
            Property::sometimes(REACHED[1], |_, s: &State| {
                s.relays.iter().enumerate().any(|(r, stage)| match *stage {
                    RelayStage::Claimed { epoch, .. } | RelayStage::Published { epoch, .. } => {
                        s.lease != Some((u(r), epoch))
                    }
                    RelayStage::Idle => false,
                })
            }),
            Property::sometimes(REACHED[2], |m: &Pipeline, s: &State| {
                s.budget[PAYMENTS_CRASH] < m.0.payments_crashes && !s.effects.is_empty()
            }),
            Property::sometimes(REACHED[3], |_, s: &State| s.inbox.len() < s.effects.len()),
            Property::sometimes(REACHED[4], |_, s: &State| {
                s.orders
                    .iter()
                    .any(|&(_, k)| s.keys[usize::from(k)].is_none())
            }),
            Property::sometimes(REACHED[5], |_, s: &State| {
                s.effects
                    .iter()
                    .any(|&m| s.msgs[usize::from(m)].kind == Kind::Cancelled)
            }),
            Property::sometimes(REACHED[6], |_, s: &State| {
                !s.log
                    .iter()
                    .all(|part| in_key_order(&s.msgs, part.iter().copied()))
            }),
        ]
    }
}

// --- running a check ------------------------------------------------------------

/// What a check found.
#[derive(Debug)]
pub struct Outcome {
    /// States generated (with repeats).
    pub states: usize,
    /// Distinct states.
    pub unique: usize,
    /// The longest path explored.
    pub max_depth: usize,
    /// Each property broken, with a counter-example, and each situation of
    /// [`REACHED`] reached, with an example.
    pub discoveries: Vec<(&'static str, Path<State, Action>)>,
    /// Wall time.
    pub elapsed: std::time::Duration,
}

/// Explores every state of `config` breadth first on one thread; stops early
/// once `stop_at` is broken, and at paths of `max_steps` actions.
///
/// `stateright` 0.31's BFS records a property's path again at every later
/// state that breaks it, so the path it returns is a counter-example but not
/// always a shortest one: [`find`] bounds the depth to get one.
pub fn check(config: Config, stop_at: Option<&'static str>, max_steps: Option<usize>) -> Outcome {
    let start = std::time::Instant::now();
    let mut builder = Pipeline(config).checker().threads(1);
    if let Some(name) = stop_at {
        builder = builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])));
    }
    if let Some(steps) = max_steps {
        // The depth counts states: a path of n actions has n + 1.
        builder = builder.target_max_depth(steps + 2);
    }
    let checker = builder.spawn_bfs().join();
    let mut discoveries: Vec<_> = checker.discoveries().into_iter().collect();
    discoveries.sort_by_key(|(name, _)| *name);
    Outcome {
        states: checker.state_count(),
        unique: checker.unique_state_count(),
        max_depth: checker.max_depth(),
        discoveries,
        elapsed: start.elapsed(),
    }
}

/// Whether the state graph of `config` is acyclic (so every path ends in a
/// terminal state, and [`ENDS_WITH_ONE_EFFECT`] covers every run): a depth
/// first search over states by their hash. Returns the distinct states seen,
/// or `Err` with the depth at which a state reached itself.
pub fn check_acyclic(config: Config) -> Result<usize, usize> {
    fn fp(s: &State) -> u64 {
        let mut h = DefaultHasher::new();
        s.hash(&mut h);
        h.finish()
    }
    let model = Pipeline(config);
    // false: on the stack; true: done.
    let mut seen: HashMap<u64, bool> = HashMap::new();
    let mut stack: Vec<(State, Vec<State>)> = Vec::new();
    for init in model.init_states() {
        seen.insert(fp(&init), false);
        let next = model.next_states(&init);
        stack.push((init, next));
        while let Some((_, children)) = stack.last_mut() {
            match children.pop() {
                Some(child) => {
                    let f = fp(&child);
                    match seen.get(&f) {
                        Some(false) => return Err(stack.len()),
                        Some(true) => {}
                        None => {
                            seen.insert(f, false);
                            let next = model.next_states(&child);
                            stack.push((child, next));
                        }
                    }
                }
                None => {
                    if let Some((done, _)) = stack.pop() {
                        seen.insert(fp(&done), true);
                    }
                }
            }
        }
    }
    Ok(seen.len())
}

// --- traces in the pipeline's words ---------------------------------------------

fn key(k: u8) -> String {
    format!("k{}", k + 1)
}

fn order(o: u8) -> String {
    format!("o{}", o + 1)
}

fn event(s: &State, msg: u8) -> String {
    let m = s.msgs[usize::from(msg)];
    let kind = match m.kind {
        Kind::Created => "order.created",
        Kind::Cancelled => "order.cancelled",
    };
    format!("{} {kind} (msg {})", order(m.order), msg + 1)
}

/// One step in the pipeline's words, from the state it is taken in.
pub fn narrate(model: &Pipeline, s: &State, action: Action) -> String {
    let cfg = model.cfg();
    let next = model.next_state(s, action);
    let next = next.as_ref().unwrap_or(s);
    match action {
        Action::Send(k) => format!("client sends {}", key(k)),
        Action::Retry(k) => {
            let why = if s.clients[usize::from(k)].phase == Phase::Failed {
                "after an error"
            } else {
                "after a timeout (the first still in flight)"
            };
            format!("client retries {} {why}", key(k))
        }
        Action::Commit(i) => {
            let r = s.reqs[usize::from(i)];
            let after = next
                .reqs
                .iter()
                .find(|x| x.key == r.key && x.stage != Stage::Received);
            match (s.keys[usize::from(r.key)], after.map(|x| x.stage)) {
                (Some(o), _) => format!(
                    "orders finds {} taken: replays the stored response for {}",
                    key(r.key),
                    order(o)
                ),
                (None, Some(Stage::Published { msg, .. })) => {
                    let p = next.partition(cfg, msg);
                    format!(
                        "orders publishes {} at partition {p} offset {} before committing (dual write)",
                        event(next, msg),
                        next.log[p].len() - 1,
                    )
                }
                (None, Some(Stage::Saved { order: o })) => format!(
                    "orders commits order {} for {} (no outbox row; the publish comes after)",
                    order(o),
                    key(r.key)
                ),
                (None, _) => {
                    let o = next.keys[usize::from(r.key)].unwrap_or_default();
                    format!(
                        "orders commits key {} + order {} + outbox row {} in one transaction",
                        key(r.key),
                        order(o),
                        next.outbox.len()
                    )
                }
            }
        }
        Action::SecondWrite(i) => match s.reqs[usize::from(i)].stage {
            Stage::Published { order: o, .. } => {
                match s.keys[usize::from(s.reqs[usize::from(i)].key)] {
                    Some(taken) => format!(
                        "orders finds the key taken by {}: {} never commits",
                        order(taken),
                        order(o)
                    ),
                    None => format!("orders commits order {} after its publish", order(o)),
                }
            }
            Stage::Saved { .. } => {
                let msg = u(next.msgs.len() - 1);
                format!(
                    "orders publishes {} after the commit, at offset {}",
                    event(next, msg),
                    next.log[next.partition(cfg, msg)].len() - 1
                )
            }
            _ => "orders: nothing".into(),
        },
        Action::Answer(i) => {
            let r = s.reqs[usize::from(i)];
            match r.stage {
                Stage::Committed { order: o } => {
                    format!("orders answers {}: 201 {}", key(r.key), order(o))
                }
                _ => "orders answers".into(),
            }
        }
        Action::OrdersCrash => {
            let committed = s
                .reqs
                .iter()
                .any(|r| matches!(r.stage, Stage::Committed { .. } | Stage::Saved { .. }));
            let published = s
                .reqs
                .iter()
                .any(|r| matches!(r.stage, Stage::Published { .. }));
            if published {
                "orders crashes (kill -9 after its publish, before its commit); its clients get an error".into()
            } else if committed {
                "orders crashes (kill -9 at 'commit': committed, before the answer); its clients get an error".into()
            } else {
                "orders crashes (kill -9 before the commit); its clients get an error".into()
            }
        }
        Action::Cancel(k) => {
            let msg = u(next.msgs.len() - 1);
            format!(
                "client cancels its order ({}): orders writes {} as outbox row {}",
                key(k),
                event(next, msg),
                next.outbox.len()
            )
        }
        Action::Acquire(r) => format!("relay {r} takes the shard's lease (epoch {})", next.epoch),
        Action::Claim(r) => match next.relays[usize::from(r)] {
            RelayStage::Claimed { row, .. } => format!(
                "relay {r} claims row {} ({})",
                row + 1,
                event(s, s.outbox[usize::from(row)].msg)
            ),
            _ => format!("relay {r} claims"),
        },
        Action::Publish(r) => match (s.relays[usize::from(r)], next.relays[usize::from(r)]) {
            (RelayStage::Claimed { row, epoch }, RelayStage::Published { .. }) => {
                let msg = s.outbox[usize::from(row)].msg;
                let p = s.partition(cfg, msg);
                let stale = if s.lease != Some((r, epoch)) {
                    format!(
                        " (its lease, epoch {epoch}, has expired: the publish is not fenced, only the mark)"
                    )
                } else {
                    String::new()
                };
                format!(
                    "relay {r} publishes row {} at partition {p} offset {}{stale}",
                    row + 1,
                    s.log[p].len()
                )
            }
            (RelayStage::Claimed { row, epoch }, _) => format!(
                "relay {r}'s publish of row {} is fenced off (epoch {epoch} is stale: its transactional producer is fenced)",
                row + 1
            ),
            _ => format!("relay {r} publishes"),
        },
        Action::Mark(r) => match s.relays[usize::from(r)] {
            RelayStage::Published { row, epoch } => {
                if s.lease != Some((r, epoch)) {
                    format!(
                        "relay {r}'s mark of row {} is fenced off (epoch {epoch} is stale: its transaction was aborted)",
                        row + 1
                    )
                } else {
                    format!("relay {r} marks row {} published", row + 1)
                }
            }
            _ => format!("relay {r} marks"),
        },
        Action::RelayCrash(r) => match s.relays[usize::from(r)] {
            RelayStage::Published { row, .. } => format!(
                "relay {r} crashes (kill -9 at 'publish': row {} acked, not marked)",
                row + 1
            ),
            _ => format!("relay {r} crashes (kill -9 after the claim, before the publish)"),
        },
        Action::LeaseExpire => match s.lease {
            Some((h, e)) => format!("relay {h}'s lease (epoch {e}) expires while it is paused"),
            None => "a lease expires".into(),
        },
        Action::Apply(p) => {
            let pi = usize::from(p);
            let off = s.position[pi];
            let msg = s.log[pi][usize::from(off)];
            let what = match (cfg.consume, next.pay) {
                (Consume::OffsetsFirst, _) => {
                    "commits the offset past it first (before its transaction)".to_owned()
                }
                (Consume::SplitInboxFirst, PayStage::Half { .. }) => {
                    "claims its inbox row (tx 1 of 2, committed)".to_owned()
                }
                (Consume::SplitEffectFirst, PayStage::Half { .. }) => {
                    "applies its effect (tx 1 of 2, committed)".to_owned()
                }
                _ if next.effects.len() > s.effects.len() => {
                    "claims the inbox row and applies the effect in one transaction".to_owned()
                }
                _ => "finds it in the inbox: a duplicate, skipped".to_owned(),
            };
            format!(
                "payments reads {} at partition {p} offset {off}: {what}",
                event(s, msg)
            )
        }
        Action::Finish => match s.pay {
            PayStage::Half { msg } => match cfg.consume {
                Consume::SplitInboxFirst => {
                    format!(
                        "payments applies the effect of {} (tx 2 of 2)",
                        event(s, msg)
                    )
                }
                _ => format!(
                    "payments claims the inbox row of {} (tx 2 of 2)",
                    event(s, msg)
                ),
            },
            PayStage::Fetched { msg } => {
                format!(
                    "payments applies {} (inbox + effect, one transaction)",
                    event(s, msg)
                )
            }
            PayStage::Idle => "payments: nothing".into(),
        },
        Action::CommitOffsets => format!("payments commits offsets {:?}", next.committed),
        Action::PaymentsCrash => match s.pay {
            PayStage::Half { .. } => {
                "payments crashes (kill -9 at 'split', between its two transactions)".into()
            }
            PayStage::Fetched { .. } => {
                "payments crashes (after the offset commit, before the transaction)".into()
            }
            PayStage::Idle => format!(
                "payments crashes (after its transaction, before the offset commit); it resumes at offsets {:?}",
                s.committed
            ),
        },
        Action::Redeliver(p) => format!(
            "partition {p} is delivered again from offset {} (seek back)",
            s.log_start[usize::from(p)]
        ),
        Action::LogRetention(p) => format!(
            "the broker deletes partition {p} offset {} (retention)",
            s.log_start[usize::from(p)]
        ),
        Action::InboxExpire(m) => {
            if cfg.inbox_covers_horizon {
                format!(
                    "the inbox row of {} expires (beyond the redelivery horizon)",
                    event(s, m)
                )
            } else {
                format!(
                    "the inbox row of {} expires (retention shorter than the horizon)",
                    event(s, m)
                )
            }
        }
        Action::KeyExpire(k) => format!("key {} expires (its client no longer retries)", key(k)),
    }
}

/// A path as numbered lines in the pipeline's words.
pub fn narrate_path(model: &Pipeline, path: &Path<State, Action>) -> Vec<String> {
    path.clone()
        .into_vec()
        .into_iter()
        .filter_map(|(s, a)| a.map(|a| narrate(model, &s, a)))
        .collect()
}

/// `lines` numbered, one per line.
pub fn numbered(lines: &[String]) -> String {
    let mut out = String::new();
    for (i, l) in lines.iter().enumerate() {
        let _ = writeln!(out, "  {:>2}. {l}", i + 1);
    }
    out
}

/// A shortest counter-example of `bug` at `base`'s bounds, with the first
/// search's counts and the time of all of them; `None` if there is none.
pub fn find(bug: Bug, base: &Config) -> (Option<Path<State, Action>>, Outcome) {
    find_broken(&bug.config(base), bug.breaks())
}

/// A shortest path of `config` that breaks `property`, with the first
/// search's counts and the time of all of them; `None` if there is none.
///
/// The first search stops at the first counter-example; each next one
/// looks only at paths shorter than the last found, until none is: the
/// last found is then a shortest one.
pub fn find_broken(
    config: &Config,
    property: &'static str,
) -> (Option<Path<State, Action>>, Outcome) {
    let start = std::time::Instant::now();
    let mut first: Option<Outcome> = None;
    let mut best: Option<Path<State, Action>> = None;
    let mut bound = None;
    loop {
        let mut outcome = check(config.clone(), Some(property), bound);
        let path = outcome
            .discoveries
            .iter()
            .position(|(n, _)| *n == property)
            .map(|i| outcome.discoveries.swap_remove(i).1);
        if first.is_none() {
            first = Some(outcome);
        }
        match path {
            Some(path) => {
                let steps = path.clone().into_actions().len();
                best = Some(path);
                if steps == 0 {
                    break;
                }
                bound = Some(steps - 1);
            }
            None => break,
        }
    }
    let mut outcome = first.unwrap_or(Outcome {
        states: 0,
        unique: 0,
        max_depth: 0,
        discoveries: Vec::new(),
        elapsed: std::time::Duration::ZERO,
    });
    outcome.elapsed = start.elapsed();
    (best, outcome)
}

impl Outcome {
    /// The properties of [`PROPERTIES`] broken (not the situations reached,
    /// nor those of [`NOT_CLAIMED`]).
    pub fn broken(&self) -> Vec<&'static str> {
        self.discoveries
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| PROPERTIES.contains(n))
            .collect()
    }

    /// Whether the check found `property` broken.
    pub fn breaks(&self, property: &str) -> bool {
        self.discoveries.iter().any(|(n, _)| *n == property)
    }

    /// The situations of [`REACHED`] that `config`'s faults allow and the
    /// check did not reach (a stale event after a later one of its key
    /// needs two relays, a lease expiry and a cancel, and is what
    /// [`Fence::Publish`] rules out).
    pub fn unreached(&self, config: &Config) -> Vec<&'static str> {
        let possible = [
            config.relay_crashes > 0 || config.lease_expiries > 0,
            config.lease_expiries > 0,
            config.payments_crashes > 0,
            config.expiry,
            config.expiry,
            config.cancel,
            config.cancel
                && config.relays >= 2
                && config.lease_expiries > 0
                && config.fence == Fence::Mark,
        ];
        REACHED
            .into_iter()
            .zip(possible)
            .filter(|&(r, p)| p && !self.discoveries.iter().any(|(n, _)| *n == r))
            .map(|(r, _)| r)
            .collect()
    }
}
