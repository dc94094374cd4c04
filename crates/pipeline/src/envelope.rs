//! The event envelope on the wire (Kafka value of `order.events`).
//!
//! The consumer deduplicates on `msg_id`, which comes from `outbox.msg_id`
//! and is stable across re-publishes. It is never a Kafka offset: a relay
//! that crashes after publishing and re-publishes on restart puts the same
//! event at a new offset.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use uuid::Uuid;

/// The Kafka headers carrying the msg_id (also in the value; headers help
/// tools) and the event type: the library's, which its relay and consumer
/// use too; and the one Debezium's Outbox Event Router carries the event id
/// in, which the library's consumer and payments read it from.
pub use effectively::store::{HEADER_EVENT_TYPE, HEADER_MSG_ID, HEADER_ROUTER_ID};

/// One event as published.
#[derive(Debug, Serialize, Deserialize)]
pub struct Envelope {
    /// Stable dedup identity (`outbox.msg_id`).
    pub msg_id: Uuid,
    /// Event type, e.g. [`ORDER_CREATED`](crate::contract::ORDER_CREATED).
    pub event_type: String,
    /// The entity the event is about; also the Kafka key.
    pub aggregate_id: Uuid,
    /// When the outbox row was committed (for commit→effect latency).
    pub created_at: DateTime<Utc>,
    /// The event body, embedded verbatim as JSON.
    pub payload: Box<RawValue>,
}

/// Why bytes are not an envelope.
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    /// Not JSON, or a field is missing or of the wrong type (msg_id included).
    #[error("not an event envelope: {0}")]
    Decode(#[from] serde_json::Error),
}

impl Envelope {
    /// Builds an envelope; `payload` must be JSON.
    pub fn new(
        msg_id: Uuid,
        event_type: String,
        aggregate_id: Uuid,
        created_at: DateTime<Utc>,
        payload: &[u8],
    ) -> Result<Self, EnvelopeError> {
        let payload = serde_json::from_slice::<Box<RawValue>>(payload)?;
        Ok(Self {
            msg_id,
            event_type,
            aggregate_id,
            created_at,
            payload,
        })
    }

    /// Encodes to JSON bytes.
    pub fn encode(&self) -> Result<Vec<u8>, EnvelopeError> {
        Ok(serde_json::to_vec(self)?)
    }

    /// Decodes JSON bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        Ok(serde_json::from_slice(bytes)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_garbage() {
        let env = Envelope::new(
            Uuid::now_v7(),
            crate::contract::ORDER_CREATED.into(),
            Uuid::now_v7(),
            Utc::now(),
            br#"{"a": 1}"#,
        )
        .expect("envelope");
        let bytes = env.encode().expect("encode");
        let back = Envelope::decode(&bytes).expect("decode");
        assert_eq!(back.msg_id, env.msg_id);
        assert_eq!(back.payload.get(), r#"{"a": 1}"#);
        assert!(Envelope::decode(b"not json").is_err());
        assert!(
            Envelope::decode(br#"{"event_type":"x"}"#).is_err(),
            "msg_id is required"
        );
        assert!(Envelope::new(Uuid::nil(), "x".into(), Uuid::nil(), Utc::now(), b"{").is_err());
    }
}
