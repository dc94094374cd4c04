//! Kafka message → charge intent, or a dead letter with the reason.
//!
//! Two record shapes ([`InputFormat`]): the project's relays' envelope, and
//! the shape Debezium's Outbox Event Router gives an outbox row, so payments
//! can sit behind a Debezium connector as it sits behind its own relays. An
//! event is the same either way: the same `msg_id` (the inbox's key), the
//! same payload bytes (the same fingerprint), whichever relay published it.

use chrono::{DateTime, Utc};
use pipeline::contract::{ORDER_CREATED, OrderCreated};
use pipeline::envelope::{Envelope, HEADER_EVENT_TYPE, HEADER_ROUTER_ID};
use uuid::Uuid;

use crate::delivery::ChargeIntent;

/// How the events' records are shaped (`--input-format`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InputFormat {
    /// The project's relays (`relay`, poll or WAL): the value is the JSON
    /// envelope (`msg_id`, `event_type`, `aggregate_id`, `created_at`,
    /// `payload`).
    #[default]
    Envelope,
    /// Debezium's Outbox Event Router over `orders.outbox`
    /// (`scripts/debezium.sh`): the key is the aggregate id, the value the
    /// payload column's JSON bytes, header `id` the event id (`msg_id`),
    /// header `event_type` the event type (placed by
    /// `table.fields.additional.placement=event_type:header:event_type`),
    /// and an optional header `created_at` (RFC 3339) the row's commit
    /// time, for the commit-to-effect latency.
    OutboxRouter,
}

/// The header the router is told to place the row's `created_at` in (the
/// event id comes in [`HEADER_ROUTER_ID`], the event type in
/// [`HEADER_EVENT_TYPE`], the library's header names).
pub const ROUTER_HEADER_CREATED_AT: &str = "created_at";

/// Decodes a message value. `Err` carries the dead-letter reason (which may
/// quote the input: it is made storable where it is written).
pub fn decode(value: Option<&[u8]>) -> Result<(ChargeIntent, DateTime<Utc>), String> {
    let value = value.ok_or("null message value (a tombstone?)")?;
    let envelope = Envelope::decode(value).map_err(|e| e.to_string())?;
    let intent = intent(
        envelope.msg_id,
        &envelope.event_type,
        envelope.aggregate_id,
        envelope.payload.get().as_bytes(),
    )?;
    Ok((intent, envelope.created_at))
}

/// Decodes a record in `format`: `headers` yields its headers in order (the
/// first of a name counts). The commit time is `None` when the record does
/// not carry one.
pub fn decode_record<'h>(
    format: InputFormat,
    key: Option<&[u8]>,
    headers: impl IntoIterator<Item = (&'h str, Option<&'h [u8]>)>,
    value: Option<&[u8]>,
) -> Result<(ChargeIntent, Option<DateTime<Utc>>), String> {
    match format {
        InputFormat::Envelope => decode(value).map(|(intent, at)| (intent, Some(at))),
        InputFormat::OutboxRouter => decode_router(key, headers, value),
    }
}

fn decode_router<'h>(
    key: Option<&[u8]>,
    headers: impl IntoIterator<Item = (&'h str, Option<&'h [u8]>)>,
    value: Option<&[u8]>,
) -> Result<(ChargeIntent, Option<DateTime<Utc>>), String> {
    let value = value.ok_or("null message value (a tombstone?)")?;
    let (mut id, mut event_type, mut created_at) = (None, None, None);
    for (name, v) in headers {
        let slot = match name {
            HEADER_ROUTER_ID => &mut id,
            HEADER_EVENT_TYPE => &mut event_type,
            ROUTER_HEADER_CREATED_AT => &mut created_at,
            _ => continue,
        };
        if slot.is_none() {
            *slot = Some(v.unwrap_or_default());
        }
    }
    let id =
        id.ok_or("no \"id\" header (the Outbox Event Router's event id, the outbox's msg_id)")?;
    let msg_id = Uuid::parse_str(text(HEADER_ROUTER_ID, id)?)
        .map_err(|e| format!("header \"id\" is not a UUID: {e}"))?;
    let event_type = event_type.ok_or(
        "no \"event_type\" header (the router places it with \
         table.fields.additional.placement=event_type:header:event_type)",
    )?;
    let event_type = text(HEADER_EVENT_TYPE, event_type)?;
    let key = key.ok_or("no key (the router's key is the aggregate id)")?;
    let aggregate_id = std::str::from_utf8(key)
        .ok()
        .and_then(|k| Uuid::parse_str(k).ok())
        .ok_or("the key is not an aggregate id (a UUID)")?;
    let created_at = match created_at {
        None => None,
        Some(v) => Some(
            DateTime::parse_from_rfc3339(text(ROUTER_HEADER_CREATED_AT, v)?)
                .map_err(|e| format!("header \"created_at\" is not an RFC 3339 time: {e}"))?
                .with_timezone(&Utc),
        ),
    };
    Ok((intent(msg_id, event_type, aggregate_id, value)?, created_at))
}

/// Header `name`'s value as text.
fn text<'v>(name: &str, v: &'v [u8]) -> Result<&'v str, String> {
    std::str::from_utf8(v).map_err(|_| format!("header {name:?} is not UTF-8"))
}

/// The charge an `order.created` event with this payload asks for, or why
/// there is none.
fn intent(
    msg_id: Uuid,
    event_type: &str,
    aggregate_id: Uuid,
    payload: &[u8],
) -> Result<ChargeIntent, String> {
    if event_type != ORDER_CREATED {
        return Err(format!("unknown event type {event_type:?}"));
    }
    let order: OrderCreated = serde_json::from_slice(payload)
        .map_err(|e| format!("invalid {ORDER_CREATED} payload: {e}"))?;
    if order.amount_cents <= 0 || order.account_id <= 0 {
        return Err("non-positive amount or account".into());
    }
    if order.order_id != aggregate_id {
        return Err("payload order_id differs from the event's aggregate id (the key)".into());
    }
    Ok(ChargeIntent {
        msg_id,
        order_id: order.order_id,
        account_id: order.account_id,
        amount_cents: order.amount_cents,
        payload_hash: payload_hash(payload),
    })
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

    /// A record as Debezium's Outbox Event Router gives an outbox row.
    fn routed<'a>(
        msg_id: &'a str,
        event_type: Option<&'a str>,
        created_at: Option<&'a str>,
    ) -> Vec<(&'a str, Option<&'a [u8]>)> {
        let mut headers = vec![("id", Some(msg_id.as_bytes()))];
        if let Some(t) = event_type {
            headers.push(("event_type", Some(t.as_bytes())));
        }
        if let Some(t) = created_at {
            headers.push(("created_at", Some(t.as_bytes())));
        }
        headers
    }

    #[test]
    fn the_outbox_routers_records_decode_to_the_same_event_as_the_envelope() {
        let order = Uuid::now_v7();
        let msg_id = Uuid::now_v7();
        // As Debezium carries a bytea payload: its bytes, untouched.
        let payload = format!(
            r#"{{"order_id" : "{order}", "account_id" : 3, "amount_cents" : 10, "status" : "created"}}"#
        );
        let key = order.to_string();
        let id = msg_id.to_string();
        let (routed_intent, at) = decode_record(
            InputFormat::OutboxRouter,
            Some(key.as_bytes()),
            routed(
                &id,
                Some("order.created"),
                Some("2026-12-03T17:07:53.351115Z"),
            ),
            Some(payload.as_bytes()),
        )
        .expect("decodes");
        let at = at.expect("created_at read");
        assert_eq!(at.to_rfc3339(), "2026-12-03T17:07:53.351115+00:00");
        let env = Envelope::new(msg_id, ORDER_CREATED.into(), order, at, payload.as_bytes())
            .expect("envelope")
            .encode()
            .expect("encode");
        let (enveloped, _) =
            decode_record(InputFormat::Envelope, None, [], Some(&env)).expect("decodes");
        // One event, one inbox key and one fingerprint, whichever relay sent it.
        assert_eq!(routed_intent, enveloped);

        // No created_at: decoded, no commit time.
        let (_, at) = decode_record(
            InputFormat::OutboxRouter,
            Some(key.as_bytes()),
            routed(&id, Some("order.created"), None),
            Some(payload.as_bytes()),
        )
        .expect("decodes");
        assert!(at.is_none());
    }

    #[test]
    fn a_routed_record_without_what_it_needs_is_dead_lettered_with_why() {
        let order = Uuid::now_v7();
        let key = order.to_string();
        let id = Uuid::now_v7().to_string();
        let payload = format!(r#"{{"order_id":"{order}","account_id":3,"amount_cents":10}}"#);
        let bad =
            |key: Option<&[u8]>, headers: Vec<(&str, Option<&[u8]>)>, value: Option<&[u8]>| {
                decode_record(InputFormat::OutboxRouter, key, headers, value).expect_err("refused")
            };
        let k = Some(key.as_bytes());
        let v = Some(payload.as_bytes());
        let ok = || routed(&id, Some("order.created"), None);
        assert!(
            bad(k, vec![("event_type", Some(b"order.created"))], v).contains("no \"id\" header")
        );
        assert!(bad(k, routed("42", Some("order.created"), None), v).contains("not a UUID"));
        assert!(bad(k, routed(&id, None, None), v).contains("additional.placement"));
        assert!(bad(k, routed(&id, Some("order.shipped"), None), v).contains("unknown event type"));
        assert!(bad(None, ok(), v).contains("no key"));
        assert!(bad(Some(b"not-a-uuid"), ok(), v).contains("not an aggregate id"));
        let other = Uuid::now_v7().to_string();
        assert!(bad(Some(other.as_bytes()), ok(), v).contains("differs"));
        assert!(bad(k, ok(), None).contains("tombstone"));
        assert!(bad(k, ok(), Some(b"garbage")).contains("invalid order.created payload"));
        assert!(
            bad(k, routed(&id, Some("order.created"), Some("yesterday")), v).contains("RFC 3339")
        );
        assert!(bad(k, vec![("id", Some(&[0xff, 0xfe][..]))], v).contains("not UTF-8"));
        // The first header of a name counts; a later one changes nothing.
        let mut twice = ok();
        twice.push(("id", Some(b"not-a-uuid")));
        assert!(decode_record(InputFormat::OutboxRouter, k, twice, v).is_ok());
    }
}
