//! What the inbox is handed and what it answers: a consumed message
//! ([`Delivery`]: where it came from, [`Source`], and the [`ChargeIntent`] it
//! carries or why it carries none), a message that is not applied
//! ([`DeadLetter`], [`DeadLetterKind`]), one held back ([`Held`]), and what
//! applying a batch did ([`Applied`]). Both transports build them
//! (`consumer.rs`, `receiver.rs`), `process.rs` hands them to `inbox.rs`.

use uuid::Uuid;

/// A decoded `order.created` event ready to apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChargeIntent {
    /// Dedup identity.
    pub msg_id: Uuid,
    /// Order to charge.
    pub order_id: Uuid,
    /// Account charged.
    pub account_id: i64,
    /// Amount in cents.
    pub amount_cents: i64,
    /// Fingerprint of the event payload (see `decode::payload_hash`).
    pub payload_hash: i64,
}

/// Where a message came from, borrowed from the consumed message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Source<'a> {
    /// Its transport's coordinates.
    pub origin: Origin<'a>,
    /// Raw key (a Kafka message's; a webhook has none).
    pub key: Option<&'a [u8]>,
    /// Raw value (a webhook's body).
    pub payload: Option<&'a [u8]>,
}

/// How a message's transport knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin<'a> {
    /// A Kafka message.
    Kafka {
        /// Topic.
        topic: &'a str,
        /// Partition.
        partition: i32,
        /// Offset.
        offset: i64,
    },
    /// A webhook claimed in `payments.webhook_inbox`, known by its
    /// `webhook-id` (the event's msg_id).
    Webhook {
        /// The webhook-id.
        msg_id: Uuid,
    },
}

impl<'a> Source<'a> {
    /// A Kafka message's source.
    pub fn kafka(
        topic: &'a str,
        partition: i32,
        offset: i64,
        key: Option<&'a [u8]>,
        payload: Option<&'a [u8]>,
    ) -> Self {
        Self {
            origin: Origin::Kafka {
                topic,
                partition,
                offset,
            },
            key,
            payload,
        }
    }

    /// A webhook's source: its id and body.
    pub fn webhook(msg_id: Uuid, body: &'a [u8]) -> Self {
        Self {
            origin: Origin::Webhook { msg_id },
            key: None,
            payload: Some(body),
        }
    }

    /// The webhook-id, for a webhook.
    pub fn webhook_id(&self) -> Option<Uuid> {
        match self.origin {
            Origin::Webhook { msg_id } => Some(msg_id),
            Origin::Kafka { .. } => None,
        }
    }
}

impl std::fmt::Display for Origin<'_> {
    /// For the log: `partition 3 offset 17`, `webhook <msg_id>`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Kafka {
                partition, offset, ..
            } => write!(f, "partition {partition} offset {offset}"),
            Self::Webhook { msg_id } => write!(f, "webhook {msg_id}"),
        }
    }
}

/// One consumed message: where it came from and what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery<'a> {
    /// The message's coordinates and raw bytes.
    pub source: Source<'a>,
    /// The intent, or why the message is not one (the dead-letter reason).
    pub content: Result<ChargeIntent, String>,
}

/// Why a message is a dead letter (`payments.dead_letters.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeadLetterKind {
    /// Not an `order.created` event this consumer can read.
    Undecodable,
    /// The database refused to apply it; isolated from its batch.
    Rejected,
    /// Its msg_id was already applied with another payload.
    MsgIdConflict,
    /// A new msg_id for an order that is already charged.
    OrderConflict,
    /// Older than the oldest inbox partition kept: its dedup record may have
    /// expired, so it is never applied (see `expiry::Window`).
    AfterHorizon,
    /// At or after the end of the inbox partitions and not a UUIDv7: no
    /// mint time, so no partition will ever cover it. (A UUIDv7 there is
    /// parked instead over Kafka, `crate::park`, and held back over HTTP:
    /// [`Applied::held`].)
    FutureMsgId,
    /// A UUIDv7 minted further ahead of the database's clock than the clock
    /// skew payments accepts (`--clock-skew`): a producer's clock far ahead,
    /// or a forged msg_id. Refused at once rather than parked until the
    /// partitions reach it (it would hold its key back for that long).
    AheadOfClock,
}

impl DeadLetterKind {
    /// The value stored in `dead_letters.kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Undecodable => "undecodable",
            Self::Rejected => "rejected",
            Self::MsgIdConflict => "msg_id_conflict",
            Self::OrderConflict => "order_conflict",
            Self::AfterHorizon => "after_horizon",
            Self::FutureMsgId => "future_msg_id",
            Self::AheadOfClock => "ahead_of_clock",
        }
    }
}

/// What the consume transaction does with a message whose msg_id is older
/// than the oldest inbox partition kept (its dedup record may have expired).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AfterHorizon {
    /// Dead-letter it (kind `after_horizon`), never apply it.
    #[default]
    Refuse,
    /// UNSAFE, for experiment 5's resurrection run only: apply it as new, as
    /// a consumer whose dedup store expired the record would. There is no
    /// partition to record it in, so no inbox row; the charge row keeps its
    /// UNIQUE(order_id) guard, the ledger entry (the non-idempotent part of
    /// the effect, as in the split counter-example) is written again: a
    /// redelivered duplicate doubles it, and recon counts a double charge.
    UnsafeApply,
}

/// How the consume transaction treats a msg_id outside the inbox's
/// partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// Below the oldest partition kept.
    pub after_horizon: AfterHorizon,
    /// At or beyond the newest partition's end: a Kafka event minted further
    /// ahead of the database's clock than this is a dead letter
    /// ([`DeadLetterKind::AheadOfClock`]); one within it is parked
    /// (`crate::park`) until the partitions reach it.
    pub clock_skew: std::time::Duration,
}

impl Rules {
    /// The rules of a consumer that refuses what arrives after the dedup
    /// horizon, with payments' default `--clock-skew` (5 minutes).
    pub fn refusing() -> Self {
        Self {
            after_horizon: AfterHorizon::Refuse,
            clock_skew: std::time::Duration::from_secs(300),
        }
    }
}

/// A message that is not applied, kept with its raw bytes and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter<'a> {
    /// The message.
    pub source: Source<'a>,
    /// Which kind of dead letter.
    pub kind: DeadLetterKind,
    /// The event's msg_id, when it could be read.
    pub msg_id: Option<Uuid>,
    /// The order the event names, when it could be read.
    pub order_id: Option<Uuid>,
    /// Why, readable; made storable when written.
    pub reason: String,
}

/// A delivery held back (see [`Applied::held`]), by where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// A Kafka message: its partition must not move past it.
    Kafka {
        /// Topic.
        topic: String,
        /// Partition.
        partition: i32,
        /// Offset.
        offset: i64,
    },
    /// A webhook's claim, left unprocessed.
    Webhook {
        /// The webhook-id.
        msg_id: Uuid,
    },
}

impl From<Origin<'_>> for Held {
    fn from(origin: Origin<'_>) -> Self {
        match origin {
            Origin::Kafka {
                topic,
                partition,
                offset,
            } => Self::Kafka {
                topic: topic.to_owned(),
                partition,
                offset,
            },
            Origin::Webhook { msg_id } => Self::Webhook { msg_id },
        }
    }
}

/// What applying a batch did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Messages whose msg_id was new: charged now (or an order conflict).
    pub charged: u64,
    /// Messages whose msg_id was already in the inbox with the same payload:
    /// no-ops.
    pub duplicates: u64,
    /// New msg_ids whose order already had a charge: the first charge
    /// stands, the message is a dead letter (should stay 0).
    pub charge_conflicts: u64,
    /// Deliveries of an applied msg_id with another payload: the first
    /// effect stands, the message is a dead letter (should stay 0).
    pub msg_id_conflicts: u64,
    /// Dead letters written, by kind (a redelivered dead letter is not
    /// written twice).
    pub dead_lettered: Vec<DeadLetterKind>,
    /// The msg_ids charged by this batch.
    pub new_msg_ids: Vec<Uuid>,
    /// Deliveries refused because they arrived after the dedup horizon.
    pub after_horizon: u64,
    /// Deliveries after the dedup horizon applied anyway
    /// ([`AfterHorizon::UnsafeApply`]).
    pub applied_after_horizon: u64,
    /// Of those, the ones whose charge row was inserted (first deliveries
    /// that came too late); the others only wrote a ledger entry.
    pub charged_after_horizon: u64,
    /// Webhooks held back because their msg_id is at or beyond the end of
    /// the inbox's partitions (a producer's clock ahead, or partitions not
    /// created for a while): valid events that cannot be recorded yet. They
    /// are neither applied nor dead-lettered: the claim stays unprocessed
    /// and is tried again later ([`Held`]). (A Kafka event there is parked
    /// instead: [`Applied::parked`].)
    pub held: Vec<Held>,
    /// Kafka events parked by this batch (`payments.parked`, see
    /// `crate::park`): those the inbox cannot record yet, and the later
    /// events of their keys. Their offsets are committed: the park is
    /// durable, and only their keys wait.
    pub parked: u64,
    /// Of those, the ones whose own msg_id lies beyond the partitions.
    pub parked_future: u64,
    /// Kafka events refused as minted too far ahead of the database's clock
    /// (dead letters `ahead_of_clock`).
    pub ahead_of_clock: u64,
    /// Deliveries refused because their msg_id is at or beyond the end of
    /// the partitions and is not a UUIDv7 (dead letters `future_msg_id`).
    pub never_recordable: u64,
    /// Webhooks left alone: another processor holds their row, or has
    /// processed it since they were read.
    pub skipped: u64,
}
