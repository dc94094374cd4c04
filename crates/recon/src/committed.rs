//! The consumer's side of the story against the database: the messages
//! payments' consumer group has committed past, as `kafka-tool offsets
//! committed-past` lists them. The group will never be given them again, so
//! each must have left its trace in the database; one that did not is an
//! effect lost after its offset was committed, the failure a database that
//! loses committed transactions (an asynchronous failover) makes, and which
//! the diff alone sees only as an order without its charge.

use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::Floors;

/// One message below the group's committed offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedMessage {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Its event's msg_id; `None` for a message that is not an event
    /// envelope (payments dead-letters those, by position).
    pub msg_id: Option<Uuid>,
    /// Its event's aggregate (order) id.
    pub aggregate_id: Option<Uuid>,
}

/// Parses `kafka-tool offsets committed-past` output: one message per line,
/// `topic<TAB>partition<TAB>offset<TAB>msg_id<TAB>aggregate_id`, `-` for no
/// id; blank lines and lines starting with `#` skipped.
pub fn parse_committed(text: &str) -> Result<Vec<CommittedMessage>, String> {
    let id = |n: usize, field: &str| -> Result<Option<Uuid>, String> {
        match field {
            "-" => Ok(None),
            id => Uuid::parse_str(id)
                .map(Some)
                .map_err(|e| format!("line {n}: {id:?} is not a UUID: {e}")),
        }
    };
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l.trim_end())) {
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split('\t').collect();
        let [topic, partition, offset, msg_id, aggregate_id] = fields[..] else {
            return Err(format!(
                "line {n}: expected topic<TAB>partition<TAB>offset<TAB>msg_id<TAB>aggregate_id"
            ));
        };
        out.push(CommittedMessage {
            topic: topic.to_owned(),
            partition: partition
                .parse()
                .map_err(|e| format!("line {n}: partition {partition:?}: {e}"))?,
            offset: offset
                .parse()
                .map_err(|e| format!("line {n}: offset {offset:?}: {e}"))?,
            msg_id: id(n, msg_id)?,
            aggregate_id: id(n, aggregate_id)?,
        });
    }
    Ok(out)
}

/// The messages the group committed past against the database
/// (`src/sql/committed.sql`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CommittedReport {
    /// Messages the group committed past.
    pub messages: i64,
    /// ... recorded by payments: the msg_id in the inbox, a dead letter at
    /// the message's position, or the event parked.
    pub recorded: i64,
    /// ... not recorded, with a msg_id below the inbox's floor: its inbox
    /// row may have expired by design.
    pub inbox_expired: i64,
    /// ... not recorded at all: an effect gone after its offset was
    /// committed, never to be redelivered (must be 0).
    pub lost_effects: i64,
    /// Events among them whose outbox row is gone, their order above the
    /// outbox's floor: published from a row the database no longer holds
    /// (must be 0).
    pub events_without_outbox_row: i64,
}

impl CommittedReport {
    /// Nothing committed past that left no trace, nothing published that
    /// the database no longer holds.
    pub fn is_clean(&self) -> bool {
        self.lost_effects == 0 && self.events_without_outbox_row == 0
    }

    /// The human table.
    pub fn table(&self) -> String {
        let rows = [
            ("messages the group committed past", self.messages),
            ("  recorded (inbox, dead letter, parked)", self.recorded),
            ("  inbox row expired by design", self.inbox_expired),
            ("  lost effects (no trace at all)", self.lost_effects),
            (
                "events whose outbox row is gone",
                self.events_without_outbox_row,
            ),
        ];
        let mut out = String::from("recon: the consumer group's committed offsets vs database\n");
        for (name, value) in rows {
            out.push_str(&format!("  {name:<40} {value:>14}\n"));
        }
        out.push_str(if self.is_clean() {
            "committed: CLEAN — every message the group committed past left its trace\n"
        } else {
            "committed: DRIFT — the group committed past an effect that is gone, or an event's outbox row is gone\n"
        });
        out
    }
}

/// Checks `messages` against the database, in one read-only snapshot that
/// reads the stores' floors first: a floor moves before the rows below it
/// are deleted, so no row the check needs can vanish between the two reads
/// (floors read in another snapshot, the diff's, could be older than an
/// expiry that ran since).
pub async fn check_committed(
    pool: &PgPool,
    messages: &[CommittedMessage],
) -> sqlx::Result<CommittedReport> {
    let mut tx = pool.begin().await?;
    sqlx::query!("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await?;
    let floors = Floors::read(&mut tx).await?;
    let report = check_committed_below(&mut tx, messages, floors).await?;
    tx.commit().await?;
    Ok(report)
}

/// [`check_committed`] on `conn`, with the stores' `floors` as given (tests
/// pass their own).
pub async fn check_committed_below(
    conn: &mut PgConnection,
    messages: &[CommittedMessage],
    floors: Floors,
) -> sqlx::Result<CommittedReport> {
    let topics: Vec<String> = messages.iter().map(|m| m.topic.clone()).collect();
    let partitions: Vec<i32> = messages.iter().map(|m| m.partition).collect();
    let offsets: Vec<i64> = messages.iter().map(|m| m.offset).collect();
    let msg_ids: Vec<Option<Uuid>> = messages.iter().map(|m| m.msg_id).collect();
    let aggregates: Vec<Option<Uuid>> = messages.iter().map(|m| m.aggregate_id).collect();
    let row = sqlx::query_file!(
        "src/sql/committed.sql",
        &topics,
        &partitions,
        &offsets,
        &msg_ids as &[Option<Uuid>],
        &aggregates as &[Option<Uuid>],
        floors.inbox,
        floors.outbox
    )
    .fetch_one(conn)
    .await?;
    Ok(CommittedReport {
        messages: row.messages,
        recorded: row.recorded,
        inbox_expired: row.expired,
        lost_effects: row.lost,
        events_without_outbox_row: row.without_outbox_row,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kafka_tools_lines_and_refuses_garbage() {
        let (m, a) = (Uuid::now_v7(), Uuid::now_v7());
        let parsed = parse_committed(&format!(
            "# a comment\norder.events\t3\t41\t{m}\t{a}\n\norder.events\t0\t7\t-\t-\n"
        ))
        .expect("parse");
        assert_eq!(
            parsed,
            vec![
                CommittedMessage {
                    topic: "order.events".into(),
                    partition: 3,
                    offset: 41,
                    msg_id: Some(m),
                    aggregate_id: Some(a),
                },
                CommittedMessage {
                    topic: "order.events".into(),
                    partition: 0,
                    offset: 7,
                    msg_id: None,
                    aggregate_id: None,
                },
            ]
        );
        for bad in [
            "t\t1\t2\t-",
            "t\tone\t2\t-\t-",
            "t\t1\t2.5\t-\t-",
            "t\t1\t2\tnot-a-uuid\t-",
            "t\t1\t2\t-\t-\textra",
        ] {
            let error = parse_committed(bad).expect_err(bad);
            assert!(error.starts_with("line 1: "), "{bad}: {error}");
        }
    }

    #[test]
    fn a_lost_effect_or_a_vanished_outbox_row_is_drift() {
        let clean = CommittedReport {
            messages: 10,
            recorded: 9,
            inbox_expired: 1,
            ..CommittedReport::default()
        };
        assert!(clean.is_clean(), "{}", clean.table());
        assert!(clean.table().contains("committed: CLEAN"));
        for dirty in [
            CommittedReport {
                lost_effects: 1,
                ..clean
            },
            CommittedReport {
                events_without_outbox_row: 1,
                ..clean
            },
        ] {
            assert!(!dirty.is_clean());
            assert!(dirty.table().contains("committed: DRIFT"));
        }
    }
}
