//! Kafka message → charge intent, or a dead letter with the reason.

use pipeline::contract::{ORDER_CREATED, OrderCreated};
use pipeline::envelope::Envelope;

use crate::delivery::ChargeIntent;

/// Decodes a message value. `Err` carries the dead-letter reason (which may
/// quote the input: it is made storable where it is written).
pub fn decode(
    value: Option<&[u8]>,
) -> Result<(ChargeIntent, chrono::DateTime<chrono::Utc>), String> {
    let value = value.ok_or("null message value (a tombstone?)")?;
    let envelope = Envelope::decode(value).map_err(|e| e.to_string())?;
    if envelope.event_type != ORDER_CREATED {
        return Err(format!("unknown event type {:?}", envelope.event_type));
    }
    let order: OrderCreated = serde_json::from_str(envelope.payload.get())
        .map_err(|e| format!("invalid {ORDER_CREATED} payload: {e}"))?;
    if order.amount_cents <= 0 || order.account_id <= 0 {
        return Err("non-positive amount or account".into());
    }
    if order.order_id != envelope.aggregate_id {
        return Err("payload order_id differs from the envelope's aggregate_id".into());
    }
    Ok((
        ChargeIntent {
            msg_id: envelope.msg_id,
            order_id: order.order_id,
            account_id: order.account_id,
            amount_cents: order.amount_cents,
            payload_hash: payload_hash(envelope.payload.get().as_bytes()),
        },
        envelope.created_at,
    ))
}

/// The fingerprint of an event payload kept in the inbox: the first 8 bytes
/// of its BLAKE3 hash. Two deliveries of one msg_id with different
/// fingerprints carry different payloads.
pub fn payload_hash(payload: &[u8]) -> i64 {
    let hash = blake3::hash(payload);
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    i64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use super::*;

    #[test]
    fn good_and_bad_messages() {
        let order = Uuid::now_v7();
        let payload = format!(
            r#"{{"order_id":"{order}","account_id":3,"amount_cents":10,"status":"created"}}"#
        );
        let env = Envelope::new(
            Uuid::now_v7(),
            ORDER_CREATED.into(),
            order,
            chrono::Utc::now(),
            payload.as_bytes(),
        )
        .expect("envelope");
        let bytes = env.encode().expect("encode");
        let (intent, _) = decode(Some(&bytes)).expect("decodes");
        assert_eq!(intent.order_id, order);
        assert_eq!(intent.msg_id, env.msg_id);

        assert!(decode(None).is_err());
        assert!(
            decode(Some(b"garbage"))
                .expect_err("garbage")
                .contains("not an event envelope")
        );
        let no_msg_id = format!(
            r#"{{"event_type":"order.created","aggregate_id":"{order}","created_at":"2026-01-01T00:00:00Z","payload":{payload}}}"#
        );
        assert!(
            decode(Some(no_msg_id.as_bytes()))
                .expect_err("no msg_id")
                .contains("msg_id")
        );
        let other = Envelope::new(
            Uuid::now_v7(),
            "order.shipped".into(),
            order,
            chrono::Utc::now(),
            payload.as_bytes(),
        )
        .expect("envelope")
        .encode()
        .expect("encode");
        assert!(
            decode(Some(&other))
                .expect_err("type")
                .contains("unknown event type")
        );
    }
}
