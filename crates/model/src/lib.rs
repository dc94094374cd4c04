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

mod check;
mod config;
mod narrate;
mod properties;
mod state;
mod steps;

#[cfg(doc)]
use stateright::Property;

pub use check::{Outcome, check, check_acyclic, find, find_broken};
pub use config::{Bug, Config, Consume, Fence, Write, log_order_scope};
pub use narrate::{narrate, narrate_path, numbered};
pub use properties::{
    APPLIED_IN_KEY_ORDER, EFFECT_HAS_INTENT, ENDS_WITH_ONE_EFFECT, FIRST_PUBLISH_IN_KEY_ORDER,
    LOG_IN_KEY_ORDER, NO_DOUBLE_EFFECT, NOT_CLAIMED, ONE_ORDER_PER_KEY, PROPERTIES, REACHED,
};
pub use state::{Action, Client, Kind, Msg, PayStage, Phase, RelayStage, Req, Row, Stage, State};
pub use steps::Pipeline;
