//! An `orders.outbox` insert as `pgoutput` carries it in binary format,
//! decoded to the [`PendingRow`] the publisher takes. A column missing,
//! NULL, sent as text or of the wrong width is an error, never a panic.

use chrono::{DateTime, Utc};
use pg_walstream::{ColumnValue, RowData};
use uuid::Uuid;

use crate::outbox::PendingRow;

/// An `orders.outbox` insert as the stream carries it (binary format).
pub(super) fn decode_row(data: &RowData) -> Result<PendingRow, String> {
    Ok(PendingRow {
        id: int8(data, "id")?,
        aggregate_id: uuid(data, "aggregate_id")?,
        msg_id: uuid(data, "msg_id")?,
        event_type: String::from_utf8(bytes(data, "event_type")?.to_vec())
            .map_err(|_| "event_type is not UTF-8".to_string())?,
        payload: bytes(data, "payload")?.to_vec(),
        created_at: timestamptz(data, "created_at")?,
        attempts: 0,
    })
}

/// A non-NULL binary column.
fn bytes<'a>(data: &'a RowData, name: &str) -> Result<&'a [u8], String> {
    match data.get(name) {
        None => Err(format!("no column {name}")),
        Some(ColumnValue::Null) => Err(format!("{name} is NULL")),
        Some(ColumnValue::Text(_)) => Err(format!("{name} came as text, not binary")),
        Some(ColumnValue::Binary(b)) => Ok(b),
    }
}

fn int8(data: &RowData, name: &str) -> Result<i64, String> {
    let b: [u8; 8] = bytes(data, name)?
        .try_into()
        .map_err(|_| format!("{name} is not an int8"))?;
    Ok(i64::from_be_bytes(b))
}

fn uuid(data: &RowData, name: &str) -> Result<Uuid, String> {
    Uuid::from_slice(bytes(data, name)?).map_err(|_| format!("{name} is not a uuid"))
}

/// PostgreSQL's binary timestamptz: microseconds since 2000-01-01 UTC.
fn timestamptz(data: &RowData, name: &str) -> Result<DateTime<Utc>, String> {
    let b: [u8; 8] = bytes(data, name)?
        .try_into()
        .map_err(|_| format!("{name} is not a timestamptz"))?;
    let micros = i64::from_be_bytes(b);
    const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;
    micros
        .checked_add(PG_EPOCH_UNIX_MICROS)
        .and_then(DateTime::from_timestamp_micros)
        .ok_or_else(|| format!("{name} is out of range"))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn bin(v: &[u8]) -> ColumnValue {
        ColumnValue::Binary(Bytes::copy_from_slice(v))
    }

    fn row(cols: Vec<(&str, ColumnValue)>) -> RowData {
        RowData::from_pairs(cols)
    }

    #[test]
    fn an_outbox_insert_decodes_from_the_binary_format() {
        let agg = Uuid::now_v7();
        let msg = Uuid::now_v7();
        // 2026-11-24T00:00:00Z in microseconds since 2000-01-01.
        let at = DateTime::parse_from_rfc3339("2026-11-24T00:00:00.123456Z")
            .expect("time")
            .with_timezone(&Utc);
        let micros = at.timestamp_micros() - 946_684_800_000_000;
        let data = row(vec![
            ("id", bin(&42i64.to_be_bytes())),
            ("aggregate_id", bin(agg.as_bytes())),
            ("msg_id", bin(msg.as_bytes())),
            ("event_type", bin(b"order.created")),
            ("payload", bin(br#"{"a":1}"#)),
            ("created_at", bin(&micros.to_be_bytes())),
            ("published_at", ColumnValue::Null),
        ]);
        let r = decode_row(&data).expect("decodes");
        assert_eq!(r.id, 42);
        assert_eq!(r.aggregate_id, agg);
        assert_eq!(r.msg_id, msg);
        assert_eq!(r.event_type, "order.created");
        assert_eq!(r.payload, br#"{"a":1}"#);
        assert_eq!(r.created_at, at);
    }

    #[test]
    fn a_malformed_insert_is_an_error_not_a_panic() {
        let good = |name: &str| -> ColumnValue {
            match name {
                "id" | "created_at" => bin(&1i64.to_be_bytes()),
                "aggregate_id" | "msg_id" => bin(Uuid::nil().as_bytes()),
                _ => bin(b"x"),
            }
        };
        let names = [
            "id",
            "aggregate_id",
            "msg_id",
            "event_type",
            "payload",
            "created_at",
        ];
        for broken in names {
            for bad in [
                None,
                Some(ColumnValue::Null),
                Some(ColumnValue::text("1")),
                Some(bin(b"\xff\xfe\xfd")),
            ] {
                let cols: Vec<(&str, ColumnValue)> = names
                    .iter()
                    .filter_map(|&n| {
                        if n == broken {
                            bad.clone().map(|v| (n, v))
                        } else {
                            Some((n, good(n)))
                        }
                    })
                    .collect();
                let result = decode_row(&row(cols));
                // Three bytes are valid for the text and bytea columns.
                let ok_anyway = matches!(&bad, Some(ColumnValue::Binary(_))) && broken == "payload";
                assert_eq!(result.is_ok(), ok_anyway, "{broken} as {bad:?}: {result:?}");
            }
        }
    }
}
