//! Property tests of the consumer's decoding and dead-lettering: whatever a
//! Kafka message holds (value, key, topic, headers: arbitrary bytes,
//! arbitrary JSON, envelopes that are nearly right), decoding never panics,
//! an accepted message is a valid charge, and every dead-letter reason, as
//! written, is storable: no NUL, no other control character but newline and
//! tab, valid UTF-8, at most `MAX_STORED_TEXT` bytes plus the truncation
//! mark. The second property writes them to a real PostgreSQL database
//! through the consumer's own transaction and reads them back.
//!
//! `PROPS_DECODE_CASES` (default 2,000) and `PROPS_DEAD_LETTER_CASES`
//! (default 200 batches) set the numbers of cases; `make fuzz` runs many
//! more and prints the counts.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::time::Instant;

use effectively::text::{MAX_STORED_TEXT, storable};
use payments::decode::decode;
use payments::delivery::{DeadLetterKind, Origin, Rules, Source};
use payments::inbox::{apply_batch, reject, split};
use pipeline::contract::ORDER_CREATED;
use pipeline::crash::{CrashArgs, Crasher};
use pipeline::envelope::Envelope;
use pipeline::testing::{TestDb, cases_from_env as cases};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use rdkafka::Timestamp;
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use serde_json::Value;
use uuid::Uuid;

const TRUNCATED: &str = "…[truncated]";

// ---------------------------------------------------------------- inputs

/// One consumed message, before it is an `OwnedMessage`.
#[derive(Debug, Clone)]
struct Msg {
    topic: String,
    partition: i32,
    key: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
    value: Option<Vec<u8>>,
}

/// Text for a Rust string that stresses storable: NULs, controls, escapes,
/// multi-byte characters, and lengths around the cap.
fn nasty_string() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => any::<String>(),
        2 => "[\\x00-\\x1f\\x7f-\\u{9f}a\"\\\\é✓]{0,40}",
        1 => (MAX_STORED_TEXT - 12..MAX_STORED_TEXT + 40, "[\\x00a€\u{10ffff}]")
            .prop_map(|(n, c)| c.repeat(n)),
        1 => Just("\0".repeat(3000)),
    ]
}

/// A JSON string literal holding `s` (control characters escaped, so the
/// decoded string has them raw).
fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

/// Small pools, so that the database property sees duplicates, msg_id
/// conflicts (one msg_id, two payloads) and order conflicts (two msg_ids,
/// one order).
fn pool_uuid() -> impl Strategy<Value = Uuid> {
    (1u128..12).prop_map(Uuid::from_u128)
}

/// The JSON text of a uuid field: valid, or not a uuid in every way.
fn uuid_json(valid: Uuid) -> impl Strategy<Value = String> {
    prop_oneof![
        6 => Just(quoted(&valid.to_string())),
        1 => any::<u128>().prop_map(|n| quoted(&Uuid::from_u128(n).simple().to_string())),
        2 => nasty_string().prop_map(|s| quoted(&s)),
        1 => prop::sample::select(vec![
            "null", "1", "[]", "{}", "\"\"", "\"00000000-0000-0000-0000-00000000000\\u0000\"",
            "\"urn:uuid:\"", "\"{00000000-0000-0000-0000-000000000000}\"",
        ])
        .prop_map(str::to_owned),
    ]
}

fn number_json() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (1i64..1_000_000).prop_map(|n| n.to_string()),
        2 => prop::sample::select(vec![
            "0", "-1", "9223372036854775807", "9223372036854775808", "-9223372036854775809",
            "1e400", "1.5", "-0", "\"7\"", "null", "true", "[]", "{}",
            "123456789012345678901234567890123456789",
        ])
        .prop_map(str::to_owned),
        1 => any::<i64>().prop_map(|n| n.to_string()),
        1 => any::<f64>().prop_map(|f| f.to_string()),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        nasty_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((any::<String>(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// An `order.created` payload: right, or wrong in one or more fields.
fn payload_json(order: Uuid) -> impl Strategy<Value = String> {
    let object = (
        uuid_json(order),
        number_json(),
        number_json(),
        prop::option::weighted(0.2, nasty_string()),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(order_id, account, amount, extra, duplicate)| {
            let mut fields = vec![
                format!("\"order_id\":{order_id}"),
                format!("\"account_id\":{account}"),
                format!("\"amount_cents\":{amount}"),
                "\"status\":\"created\"".to_owned(),
            ];
            if let Some(extra) = extra {
                fields.push(format!("{}:{}", quoted(&extra), quoted(&extra)));
            }
            if duplicate {
                fields.push(format!("\"amount_cents\":{amount}"));
            }
            format!("{{{}}}", fields.join(","))
        });
    prop_oneof![
        6 => object,
        1 => json_value().prop_map(|v| v.to_string()),
    ]
}

/// An envelope: every field right or wrong, sometimes missing or twice.
fn envelope_json() -> impl Strategy<Value = Vec<u8>> {
    (pool_uuid(), pool_uuid()).prop_flat_map(|(msg_id, order)| {
        let event_type = prop_oneof![
            8 => Just(quoted(ORDER_CREATED)),
            2 => nasty_string().prop_map(|s| quoted(&s)),
            1 => Just("42".to_owned()),
        ];
        let created_at = prop_oneof![
            8 => Just("\"2026-01-01T00:00:00Z\"".to_owned()),
            1 => prop::sample::select(vec![
                "\"2026-13-45T25:61:61Z\"", "\"\"", "0", "\"+275760-09-13T00:00:00Z\"",
                "\"1970-01-01T00:00:00.123456789123+14:00\"",
            ])
            .prop_map(str::to_owned),
            1 => nasty_string().prop_map(|s| quoted(&s)),
        ];
        (
            uuid_json(msg_id),
            event_type,
            uuid_json(order),
            created_at,
            payload_json(order),
            prop::collection::vec(any::<bool>(), 5),
            prop::bool::weighted(0.1),
        )
            .prop_map(
                |(msg_id, event_type, aggregate, created_at, payload, keep, dup)| {
                    let all = [
                        ("msg_id", msg_id),
                        ("event_type", event_type),
                        ("aggregate_id", aggregate),
                        ("created_at", created_at),
                        ("payload", payload),
                    ];
                    // Drop a field only now and then (keep[i] is true half the
                    // time; both false drops it).
                    let mut fields: Vec<String> = all
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| keep[*i] || keep[(i + 1) % 5] || keep[(i + 2) % 5])
                        .map(|(_, (k, v))| format!("\"{k}\":{v}"))
                        .collect();
                    if dup && let Some(first) = fields.first().cloned() {
                        fields.push(first);
                    }
                    format!("{{{}}}", fields.join(",")).into_bytes()
                },
            )
    })
}

/// A valid `order.created` envelope as the relay publishes it.
fn valid_envelope(msg_id: Uuid, order: Uuid, amount: i64) -> Vec<u8> {
    let payload = format!(
        r#"{{"order_id":"{order}","account_id":3,"amount_cents":{amount},"status":"created"}}"#
    );
    Envelope::new(
        msg_id,
        ORDER_CREATED.into(),
        order,
        chrono::DateTime::UNIX_EPOCH,
        payload.as_bytes(),
    )
    .and_then(|e| e.encode())
    .unwrap_or_default()
}

/// Valid envelopes from the small pools: mostly a msg_id's own order and
/// amount (redeliveries), sometimes another amount (a msg_id conflict) or
/// another msg_id for the order (an order conflict).
fn good_envelope() -> impl Strategy<Value = Vec<u8>> {
    (
        pool_uuid(),
        1u128..4,
        prop::bool::weighted(0.1),
        prop::bool::weighted(0.1),
    )
        .prop_map(|(msg_id, n, other_amount, other_msg)| {
            let order = Uuid::from_u128(msg_id.as_u128() + 1000);
            let msg_id = if other_msg {
                Uuid::from_u128(msg_id.as_u128() * 100 + n)
            } else {
                msg_id
            };
            valid_envelope(msg_id, order, if other_amount { 7 } else { 5 })
        })
}

/// A valid envelope with its bytes edited: flipped, inserted, removed,
/// truncated.
fn mutated_envelope() -> impl Strategy<Value = Vec<u8>> {
    (
        pool_uuid(),
        pool_uuid(),
        1i64..1000,
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..6),
    )
        .prop_map(|(msg_id, order, amount, edits)| {
            let mut bytes = valid_envelope(msg_id, order, amount);
            for (at, byte, op) in edits {
                if bytes.is_empty() {
                    break;
                }
                let i = at.index(bytes.len());
                match op {
                    0 => bytes[i] = byte,
                    1 => bytes.insert(i, byte),
                    2 => {
                        bytes.remove(i);
                    }
                    _ => bytes.truncate(i),
                }
            }
            bytes
        })
}

fn value() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        4 => good_envelope().prop_map(Some),
        6 => envelope_json().prop_map(Some),
        3 => mutated_envelope().prop_map(Some),
        2 => prop::collection::vec(any::<u8>(), 0..600).prop_map(Some),
        2 => json_value().prop_map(|v| Some(v.to_string().into_bytes())),
        1 => Just(None),
    ]
}

fn message() -> impl Strategy<Value = Msg> {
    let topic = prop_oneof![
        6 => Just("order.events".to_owned()),
        1 => nasty_string(),
    ];
    let header = (
        nasty_string(),
        prop::option::of(prop::collection::vec(any::<u8>(), 0..40)),
    );
    (
        topic,
        any::<i32>(),
        prop::option::of(prop::collection::vec(any::<u8>(), 0..80)),
        prop::collection::vec(header, 0..3),
        value(),
    )
        .prop_map(|(topic, partition, key, headers, value)| Msg {
            topic,
            partition,
            key,
            headers,
            value,
        })
}

/// A batch, and the text of a database error to dead-letter one with.
fn batch() -> impl Strategy<Value = (Vec<Msg>, String)> {
    (prop::collection::vec(message(), 1..6), nasty_string())
}

// ---------------------------------------------------------------- checks

/// Builds the consumed messages, offsets from `next_offset` on.
fn owned(batch: &[Msg], next_offset: &Cell<i64>) -> Vec<OwnedMessage> {
    batch
        .iter()
        .map(|m| {
            let headers = m.headers.iter().fold(OwnedHeaders::new(), |h, (k, v)| {
                h.insert(Header {
                    key: k,
                    value: v.as_deref(),
                })
            });
            let offset = next_offset.get();
            next_offset.set(offset + 1);
            OwnedMessage::new(
                m.value.clone(),
                m.key.clone(),
                m.topic.clone(),
                Timestamp::NotAvailable,
                m.partition,
                offset,
                Some(headers),
            )
        })
        .collect()
}

/// `storable(text)` can be written to a `text` column, and keeps what
/// needs no escaping.
fn check_storable(text: &str) -> Result<String, TestCaseError> {
    let s = storable(text);
    prop_assert!(!s.contains('\0'), "NUL in {s:?}");
    prop_assert!(
        s.chars().all(|c| !c.is_control() || c == '\n' || c == '\t'),
        "a control character in {s:?}"
    );
    prop_assert!(
        s.len() <= MAX_STORED_TEXT + TRUNCATED.len(),
        "{} bytes",
        s.len()
    );
    let plain = text
        .chars()
        .all(|c| !c.is_control() || c == '\n' || c == '\t');
    if plain && text.len() <= MAX_STORED_TEXT {
        prop_assert_eq!(&s, text, "plain text changed");
    }
    Ok(s)
}

#[derive(Default)]
struct Tally {
    cases: u64,
    messages: u64,
    accepted: u64,
    dead: u64,
}

/// Decodes a batch as the consumer does (`classify`, then `split`) and
/// checks every outcome; returns the deliveries' dead-letter reasons.
fn check_decoded(
    messages: &[OwnedMessage],
    db_error: &str,
    tally: &mut Tally,
) -> Result<(), TestCaseError> {
    let (deliveries, _) = payments::classify(payments::InputFormat::Envelope, messages);
    prop_assert_eq!(deliveries.len(), messages.len());
    for (d, m) in deliveries.iter().zip(messages) {
        tally.messages += 1;
        let Origin::Kafka { topic, .. } = d.source.origin else {
            return Err(TestCaseError::fail("a Kafka message's source is Kafka"));
        };
        check_storable(topic)?;
        match &d.content {
            Ok(intent) => {
                tally.accepted += 1;
                prop_assert!(intent.account_id > 0 && intent.amount_cents > 0);
                let direct = decode(rdkafka::Message::payload(m));
                prop_assert!(direct.is_ok_and(|(i, _)| i == *intent));
            }
            Err(reason) => {
                tally.dead += 1;
                prop_assert!(!reason.is_empty(), "an empty reason");
                check_storable(reason)?;
            }
        }
    }
    let (_, dead) = split(&deliveries);
    prop_assert_eq!(
        dead.len(),
        deliveries.iter().filter(|d| d.content.is_err()).count()
    );
    for d in &dead {
        prop_assert_eq!(d.kind, DeadLetterKind::Undecodable);
        check_storable(&d.reason)?;
    }
    check_storable(&format!(
        "the database refused to apply this message: {db_error}"
    ))?;
    Ok(())
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        max_local_rejects: u32::MAX,
        max_global_rejects: u32::MAX,
        ..Config::default()
    })
}

// ---------------------------------------------------------------- properties

#[test]
fn decoding_never_panics_and_every_reason_is_storable() {
    let cases = cases("PROPS_DECODE_CASES", 2_000);
    let tally = RefCell::new(Tally::default());
    let offset = Cell::new(0);
    let start = Instant::now();
    let result = runner(cases).run(&batch(), |(batch, db_error)| {
        let mut tally = tally.borrow_mut();
        tally.cases += 1;
        check_decoded(&owned(&batch, &offset), &db_error, &mut tally)
    });
    let t = tally.into_inner();
    eprintln!(
        "decode property: {} cases ({} messages: {} accepted, {} dead letters) in {:.1} s",
        t.cases,
        t.messages,
        t.accepted,
        t.dead,
        start.elapsed().as_secs_f64()
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn every_dead_letter_is_written_and_read_back_storable() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (db, pool) = rt.block_on(async {
        let db = TestDb::create().await;
        let pool = sqlx::PgPool::connect(&db.url).await.expect("connect");
        (db, pool)
    });
    let crasher = Crasher::new(CrashArgs::default());
    let cases = cases("PROPS_DEAD_LETTER_CASES", 200);
    let tally = RefCell::new(Tally::default());
    let kinds = RefCell::new(BTreeMap::<&'static str, u64>::new());
    let offset = Cell::new(0);
    let start = Instant::now();
    let result = runner(cases).run(&batch(), |(batch, db_error)| {
        let mut tally = tally.borrow_mut();
        tally.cases += 1;
        let messages = owned(&batch, &offset);
        check_decoded(&messages, &db_error, &mut tally)?;
        let (deliveries, _) = payments::classify(payments::InputFormat::Envelope, &messages);
        rt.block_on(async {
            let applied = apply_batch(&pool, &deliveries, Rules::refusing(), &crasher)
                .await
                .map_err(|e| TestCaseError::fail(format!("apply_batch: {e}")))?;
            let undecodable = deliveries.iter().filter(|d| d.content.is_err()).count();
            prop_assert_eq!(
                applied
                    .dead_lettered
                    .iter()
                    .filter(|k| **k == DeadLetterKind::Undecodable)
                    .count(),
                undecodable
            );
            for kind in &applied.dead_lettered {
                *kinds.borrow_mut().entry(kind.as_str()).or_default() += 1;
            }
            for d in &deliveries {
                if let Err(reason) = &d.content {
                    let stored = stored_reason(&pool, d.source).await?;
                    prop_assert_eq!(stored, Some(storable(reason)));
                }
            }
            // The database's own reasons take the other path, `reject`.
            let first = &deliveries[0].source;
            let Origin::Kafka {
                topic, partition, ..
            } = first.origin
            else {
                return Err(TestCaseError::fail("a Kafka message's source is Kafka"));
            };
            let source = Source::kafka(topic, partition, offset.get(), first.key, first.payload);
            offset.set(offset.get() + 1);
            let written = reject(&pool, source, None, &db_error)
                .await
                .map_err(|e| TestCaseError::fail(format!("reject: {e}")))?;
            prop_assert!(written);
            *kinds
                .borrow_mut()
                .entry(DeadLetterKind::Rejected.as_str())
                .or_default() += 1;
            let stored = stored_reason(&pool, source).await?;
            prop_assert_eq!(
                stored,
                Some(storable(&format!(
                    "the database refused to apply this message: {db_error}"
                )))
            );
            Ok(())
        })
    });
    let t = tally.into_inner();
    eprintln!(
        "dead-letter property: {} cases ({} messages: {} accepted, {} undecodable) in {:.1} s; \
         dead letters written by kind {:?}",
        t.cases,
        t.messages,
        t.accepted,
        t.dead,
        start.elapsed().as_secs_f64(),
        kinds.borrow()
    );
    rt.block_on(pool.close());
    drop(db);
    if let Err(e) = result {
        panic!("{e}");
    }
}

async fn stored_reason(
    pool: &sqlx::PgPool,
    source: Source<'_>,
) -> Result<Option<String>, TestCaseError> {
    let Origin::Kafka {
        topic,
        partition,
        offset,
    } = source.origin
    else {
        return Err(TestCaseError::fail("a Kafka message's source is Kafka"));
    };
    sqlx::query_scalar(
        "SELECT reason FROM payments.dead_letters \
         WHERE topic = $1 AND partition = $2 AND \"offset\" = $3",
    )
    .bind(storable(topic))
    .bind(partition)
    .bind(offset)
    .fetch_optional(pool)
    .await
    .map_err(|e| TestCaseError::fail(format!("read back: {e}")))
}
