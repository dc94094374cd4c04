//! The replication slot and publication the WAL relay reads: the slot's
//! name, its state as `pg_replication_slots` shows it, and what to do when
//! PostgreSQL has invalidated it.

use anyhow::Context;
use sqlx::PgPool;

/// The publication the WAL relay reads: inserts into `orders.outbox` only
/// (migration `…_wal_relay.sql`).
pub const PUBLICATION: &str = "effectively_outbox";

/// The slot's name: `--wal-slot`, or `effectively_outbox_<database>` (a
/// slot belongs to one database, its name to the whole server). The
/// relay's first statement: while the database is unavailable (a relay
/// restarted mid-failover), tried again for up to `patience`.
pub async fn slot_name(
    pool: &PgPool,
    configured: Option<&str>,
    patience: std::time::Duration,
) -> anyhow::Result<String> {
    if let Some(slot) = configured {
        return Ok(slot.to_owned());
    }
    let db: String = pipeline::db::patiently(patience, || {
        sqlx::query_scalar("SELECT current_database()::text").fetch_one(pool)
    })
    .await
    .context("read the database's name")?;
    Ok(default_slot_name(&db))
}

/// `effectively_outbox_<database>`, with what a slot name cannot hold
/// (anything but a-z, 0-9 and `_`) replaced by `_`, cut to 63 bytes.
pub fn default_slot_name(database: &str) -> String {
    let mut name: String = format!("{PUBLICATION}_{database}")
        .chars()
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    name.truncate(63);
    name
}

/// A replication slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct SlotState {
    /// `reserved`, `extended`, `unreserved` or `lost` (invalidated).
    pub wal_status: String,
    /// The WAL it holds back from removal, in bytes.
    pub retained_bytes: i64,
    /// Whether a replication connection streams from it now.
    pub active: bool,
    /// Where a stream from it starts: everything committed before is
    /// confirmed (`confirmed_flush_lsn`).
    pub confirmed_flush: Option<String>,
}

/// The slot's state; `None`: no such slot.
pub async fn slot_state(pool: &PgPool, slot: &str) -> sqlx::Result<Option<SlotState>> {
    sqlx::query_as(
        "SELECT COALESCE(wal_status, 'unknown') AS wal_status, \
                COALESCE(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8 AS retained_bytes, \
                active, confirmed_flush_lsn::text AS confirmed_flush \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
}

/// The message for a slot PostgreSQL invalidated.
pub(super) fn lost_slot(slot: &str) -> String {
    format!(
        "replication slot {slot} was invalidated: it fell more than max_slot_wal_keep_size behind \
         and PostgreSQL removed the WAL it needed. Nothing is lost (rows are marked published only \
         after the broker acked them), but this slot can never be read again. Drop it \
         (SELECT pg_drop_replication_slot('{slot}');) and start the relay again: it makes a new \
         slot and publishes every row still pending first (or run it with --mode poll)."
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_slot_name_is_a_valid_slot_name() {
        assert_eq!(
            default_slot_name("effectively"),
            "effectively_outbox_effectively"
        );
        let odd = default_slot_name(&format!("Test-DB.{}", "x".repeat(80)));
        assert!(odd.len() <= 63, "{odd}");
        assert!(
            odd.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            "{odd}"
        );
    }
}
