//! The order and its event: what a valid create request is, the order it
//! becomes, and the `order.created` event written to the outbox with it. No
//! protocol and no SQL here: the front ends parse requests into
//! [`CreateOrder`], the store writes [`NewOrder`]s and their events.

use pipeline::contract::{ORDER_CREATED, OrderCreated, OrderStatus};
use pipeline::idempotency::Fingerprint;
use pipeline::outbox::OutboxMessage;
use serde::Deserialize;
use uuid::Uuid;

/// Largest accepted amount: 10,000,000,000 cents (100M in currency units).
pub const MAX_AMOUNT_CENTS: i64 = 10_000_000_000;
/// Status of a freshly created order.
pub const ORDER_STATUS_CREATED: &str = OrderStatus::Created.as_str();
/// Fingerprint context: bump the version if the canonical form changes.
const FINGERPRINT_CONTEXT: &str = "effectively orders.create v1";

/// A create-order request, whatever protocol carried it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateOrder {
    /// Account to charge (> 0).
    pub account_id: i64,
    /// Amount in cents (1..=[`MAX_AMOUNT_CENTS`]).
    pub amount_cents: i64,
}

/// Why a create request is not a valid order (the message says which field
/// and why; the front ends answer it as `invalid_request`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidOrder(String);

impl CreateOrder {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), InvalidOrder> {
        if self.account_id <= 0 {
            return Err(InvalidOrder("account_id must be a positive integer".into()));
        }
        if !(1..=MAX_AMOUNT_CENTS).contains(&self.amount_cents) {
            return Err(InvalidOrder(format!(
                "amount_cents must be between 1 and {MAX_AMOUNT_CENTS}"
            )));
        }
        Ok(())
    }

    /// Hash of the canonical form: the typed fields in a fixed order. Two
    /// requests that differ only in JSON whitespace, key order or protocol
    /// have the same fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        let mut canonical = [0u8; 16];
        canonical[..8].copy_from_slice(&self.account_id.to_be_bytes());
        canonical[8..].copy_from_slice(&self.amount_cents.to_be_bytes());
        Fingerprint::new(FINGERPRINT_CONTEXT, &canonical)
    }
}

/// A validated order with its new id: what the store writes. Only
/// [`NewOrder::new`] makes one, so an order that reaches the store passed
/// validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewOrder {
    order_id: Uuid,
    account_id: i64,
    amount_cents: i64,
}

impl NewOrder {
    /// Validates `request` and gives the order a new id (UUIDv7, time-ordered:
    /// index inserts land at the right edge of the B-tree).
    pub fn new(request: &CreateOrder) -> Result<Self, InvalidOrder> {
        request.validate()?;
        Ok(Self {
            order_id: Uuid::now_v7(),
            account_id: request.account_id,
            amount_cents: request.amount_cents,
        })
    }

    /// The order's id.
    pub fn order_id(&self) -> Uuid {
        self.order_id
    }

    /// The account to charge.
    pub fn account_id(&self) -> i64 {
        self.account_id
    }

    /// The amount in cents.
    pub fn amount_cents(&self) -> i64 {
        self.amount_cents
    }

    /// The `order.created` event of this order, for the outbox, in the
    /// order's own transaction. Its msg_id is made here and stays with the
    /// outbox row through every re-publish: it is what the consumer dedups on.
    pub fn created_event(&self) -> Result<OutboxMessage, serde_json::Error> {
        let payload = serde_json::to_vec(&OrderCreated {
            order_id: self.order_id,
            account_id: self.account_id,
            amount_cents: self.amount_cents,
            status: OrderStatus::Created,
        })?;
        Ok(OutboxMessage {
            aggregate_id: self.order_id,
            msg_id: Uuid::now_v7(),
            event_type: ORDER_CREATED.to_owned(),
            payload,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_depends_on_every_field() {
        let a = CreateOrder {
            account_id: 1,
            amount_cents: 2,
        };
        let b = CreateOrder {
            account_id: 2,
            amount_cents: 1,
        };
        assert_eq!(a.fingerprint(), a.fingerprint());
        assert_ne!(a.fingerprint(), b.fingerprint());
    }

    #[test]
    fn validation_bounds() {
        let ok = |account_id, amount_cents| {
            CreateOrder {
                account_id,
                amount_cents,
            }
            .validate()
            .is_ok()
        };
        assert!(ok(1, 1));
        assert!(ok(1, MAX_AMOUNT_CENTS));
        assert!(!ok(0, 1));
        assert!(!ok(-1, 1));
        assert!(!ok(1, 0));
        assert!(!ok(1, MAX_AMOUNT_CENTS + 1));
    }

    #[test]
    fn only_a_valid_request_becomes_an_order_and_its_event() {
        let request = CreateOrder {
            account_id: 3,
            amount_cents: 10,
        };
        let order = NewOrder::new(&request).expect("valid");
        assert_eq!(
            (order.account_id(), order.amount_cents()),
            (request.account_id, request.amount_cents)
        );
        let event = order.created_event().expect("event");
        assert_eq!(event.aggregate_id, order.order_id());
        assert_eq!(event.event_type, "order.created");
        assert_eq!(
            String::from_utf8(event.payload).expect("utf-8"),
            format!(
                r#"{{"order_id":"{}","account_id":3,"amount_cents":10,"status":"created"}}"#,
                order.order_id()
            )
        );
        assert!(
            NewOrder::new(&CreateOrder {
                account_id: 0,
                amount_cents: 10,
            })
            .is_err()
        );
    }
}
