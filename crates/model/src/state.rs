// --- state ------------------------------------------------------------------

use crate::config::Config;

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

pub(crate) const ORDERS_CRASH: usize = 0;
pub(crate) const RELAY_CRASH: usize = 1;
pub(crate) const PAYMENTS_CRASH: usize = 2;
pub(crate) const LEASE_EXPIRY: usize = 3;
pub(crate) const REDELIVERY: usize = 4;

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

pub(crate) fn u(n: usize) -> u8 {
    u8::try_from(n).unwrap_or(u8::MAX)
}

impl State {
    pub(crate) fn partition(&self, cfg: &Config, msg: u8) -> usize {
        usize::from(self.msgs[usize::from(msg)].order % cfg.partitions.max(1))
    }

    pub(crate) fn claimable(&self) -> Option<u8> {
        let msgs = &self.msgs;
        self.outbox.iter().enumerate().find_map(|(i, row)| {
            let order = msgs[usize::from(row.msg)].order;
            let earlier_pending = self.outbox[..i]
                .iter()
                .any(|e| !e.published && msgs[usize::from(e.msg)].order == order);
            (!row.published && !earlier_pending).then_some(u(i))
        })
    }

    pub(crate) fn order_committed(&self, order: u8) -> bool {
        self.orders.iter().any(|&(o, _)| o == order)
    }

    pub(crate) fn effect_count(&self, msg: u8) -> usize {
        self.effects.iter().filter(|&&m| m == msg).count()
    }

    pub(crate) fn count_effects(&self, order: u8, kind: Kind) -> usize {
        self.effects
            .iter()
            .filter(|&&m| self.msgs[usize::from(m)] == Msg { order, kind })
            .count()
    }

    pub(crate) fn push_req(&mut self, req: Req) {
        self.reqs.push(req);
        self.reqs.sort();
    }

    pub(crate) fn new_msg(&mut self, order: u8, kind: Kind) -> u8 {
        self.msgs.push(Msg { order, kind });
        u(self.msgs.len() - 1)
    }

    pub(crate) fn answer(&mut self, key: u8, order: u8) {
        let c = &mut self.clients[usize::from(key)];
        match c.phase {
            Phase::Acked(first) if first != order => c.second_order = true,
            Phase::Acked(_) => {}
            _ => c.phase = Phase::Acked(order),
        }
    }

    pub(crate) fn apply_effect(&mut self, msg: u8) {
        self.effects.push(msg);
    }

    pub(crate) fn claim_inbox(&mut self, msg: u8) -> bool {
        match self.inbox.binary_search(&msg) {
            Ok(_) => false,
            Err(at) => {
                self.inbox.insert(at, msg);
                true
            }
        }
    }
}
