// --- properties ----------------------------------------------------------

use std::collections::HashMap;

use stateright::Property;

#[cfg(doc)]
use crate::config::log_order_scope;
use crate::state::{Kind, Msg, PAYMENTS_CRASH, RelayStage, Stage, State, u};
use crate::steps::Pipeline;

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

/// The properties the checker evaluates ([`Model::properties`] of
/// [`Pipeline`]), in the order it is given them.
///
/// [`Model::properties`]: stateright::Model::properties
pub(crate) fn properties() -> Vec<Property<Pipeline>> {
    vec![
        Property::always(NO_DOUBLE_EFFECT, |_, s: &State| {
            s.effects.iter().all(|&m| s.effect_count(m) == 1)
        }),
        Property::always(EFFECT_HAS_INTENT, |_, s: &State| {
            s.effects.iter().all(|&m| {
                let order = s.msgs[usize::from(m)].order;
                s.order_committed(order)
                    || s.reqs
                        .iter()
                        .any(|r| matches!(r.stage, Stage::Published { order: o, .. } if o == order))
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
