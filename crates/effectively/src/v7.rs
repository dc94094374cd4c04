//! UUIDv7 time, the Rust side of the SQL helpers `effectively.v7_floor` /
//! `effectively.v7_time` (migrations/20261124000001_inbox_partitions.sql).
//! Ids minted by the pipeline (order ids, msg_ids) are UUIDv7s, so the stores
//! that expire do it by the time an id carries.

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// The mint time a UUIDv7 carries: its first 48 bits, Unix milliseconds (as
/// `effectively.v7_time` reads them). Any uuid has these bits; for one that
/// is not a UUIDv7 they mean nothing.
pub fn mint_time(id: Uuid) -> DateTime<Utc> {
    let b = id.as_bytes();
    let ms = u64::from_be_bytes([0, 0, b[0], b[1], b[2], b[3], b[4], b[5]]);
    // 48 bits of milliseconds end in the year 10889, inside chrono's range.
    DateTime::from_timestamp_millis(i64::try_from(ms).unwrap_or(i64::MAX))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// A UUIDv7 minted as a host whose clock reads `ago` before now would mint
/// it (tests of clocks and expiry: a slow host, an id past a retention).
pub fn minted_ago(ago: std::time::Duration) -> Uuid {
    minted_at(
        std::time::SystemTime::now()
            .checked_sub(ago)
            .unwrap_or(std::time::UNIX_EPOCH),
    )
}

/// A UUIDv7 minted as a host whose clock reads `ahead` after now would mint
/// it (tests of a fast clock: an id beyond the inbox's partitions).
pub fn minted_ahead(ahead: std::time::Duration) -> Uuid {
    minted_at(
        std::time::SystemTime::now()
            .checked_add(ahead)
            .unwrap_or(std::time::UNIX_EPOCH),
    )
}

fn minted_at(at: std::time::SystemTime) -> Uuid {
    let since = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        since.as_secs(),
        since.subsec_nanos(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_ago_carries_that_time() {
        let id = minted_ago(std::time::Duration::from_secs(3_600));
        let age = (Utc::now() - mint_time(id)).num_seconds();
        assert!((3_599..3_605).contains(&age), "{age} s");
    }

    #[test]
    fn mint_time_reads_the_first_48_bits() {
        let id = Uuid::now_v7();
        let drift = (Utc::now() - mint_time(id)).num_milliseconds();
        assert!((0..5_000).contains(&drift), "{drift} ms");
        let mut b = [0u8; 16];
        b[..6].copy_from_slice(&1_000u64.to_be_bytes()[2..]);
        assert_eq!(mint_time(Uuid::from_bytes(b)).timestamp_millis(), 1_000);
        assert_eq!(mint_time(Uuid::max()).timestamp_millis(), (1i64 << 48) - 1);
    }
}
