//! `relay --sink http`: the outbox delivered as signed webhooks.
//!
//! Two stages, each at least once and each keeping per-key order:
//!
//! 1. **Fan-out.** A loop over the shards that reads each one's oldest
//!    pending rows as the Kafka relay's pass does (`outbox::read_shards`:
//!    every row of a key among them, none behind a failed row), under the
//!    shard's lock, writes one row per destination into
//!    `orders.webhook_deliveries` and marks the outbox rows published, in
//!    that transaction: the hop from the outbox to the deliveries can
//!    neither lose nor double.
//! 2. **Delivery**, per destination, each with its own loop, client, timeout
//!    and concurrency, so a slow or dead destination delays no other. A
//!    claim takes due deliveries whose key has no earlier open delivery to
//!    that destination (so a key's later event waits until the earlier one
//!    was delivered or given up), counts the attempt and moves
//!    `next_attempt_at` past its timeout (the lease). The request carries
//!    the Standard Webhooks headers (`webhook-id` = the msg_id on every
//!    attempt, a fresh `webhook-timestamp`, `webhook-signature` under every
//!    secret of the destination) and `Idempotency-Key`. The answer decides:
//!    2xx delivered (crash point `deliver` between the 2xx and the mark: the
//!    re-delivery is the receiver's duplicate); 410 disables the destination
//!    (`orders.webhook_destinations`) and leaves the delivery pending;
//!    anything else (every other status, 4xx included, or no answer) is
//!    retried on the schedule of `effectively::webhook` (5 s, 30 s, 5 min,
//!    30 min, 4 h, ... ×[0.8, 1.2] jitter; a `Retry-After` up to 4 h is
//!    honoured if longer) until its last attempt, then fails (ERROR log,
//!    `relay_webhook_failed_total`). No status fails a delivery at once: a
//!    4xx is often the receiver's passing state, not the message's (a 401
//!    from a receiver whose clock is off by more than its signature
//!    tolerance, or whose secret was rotated before the sender's), so it
//!    gets the whole schedule, as large webhook senders give it. Every
//!    attempt is also a row of `orders.webhook_attempts`; every answer is
//!    counted by status (`relay_webhook_responses_total`), and its `Date`
//!    gives the receiver's clock skew (`relay_webhook_clock_skew_seconds`,
//!    a WARN past [`CLOCK_SKEW_WARN`]).
//!
//! The destinations' specs (their signing secrets) are stored sealed: see
//! [`Specs`] (`sealed.rs`).

mod admin;
mod answer;
mod destination;
mod sealed;
mod sender;
mod store;

pub use admin::{Admin, ReceiverHorizon, replay_failed};
pub use answer::{CLOCK_SKEW_WARN, Outcome, clock_skew, judge, next_wait};
pub use destination::{DEFAULT_CONCURRENCY, DEFAULT_TIMEOUT, DESTINATIONS_REFRESH, Destination};
pub use sealed::{KEY_ENV, Keyring, SealError, SecretsArgs, Specs, is_sealed};
pub use sender::Sender;
pub use store::{Added, Rekeyed, active, add_missing, expire, plaintext, rekey, remove, upsert};
