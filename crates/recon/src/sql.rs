//! The statements recon runs, each a file under `src/sql/` that both these
//! constants (for `--show-sql`) and the compile-time checked queries read.

/// The diff of one order-id range, `$1` to `$2` inclusive: one statement.
/// Every table is matched by order id (merge joins over the order-id
/// indexes, so the range is a slice of each index): each order with its
/// keys, its outbox events (each compared with the order: the payload
/// carries its id, account and amount, found by byte searches so that no
/// payload can make the statement fail; and with the charge: made by this
/// event's msg_id), its charge (same account and amount) and its ledger
/// entries (each equal to the charge: msg_id, account, amount). Rows that
/// belong to no order are counted as the rows of the range minus the rows
/// matched to an order; outbox events and inbox rows are matched by msg_id
/// over the same range of msg_ids. Every column is a count or a sum, so the
/// parts of a partition of the id space add up to the whole
/// ([`Report::from_parts`](crate::Report::from_parts)). The text is `src/sql/part.sql`, the one file
/// both this constant and the compile-time checked query read.
pub const PART_SQL: &str = include_str!("sql/part.sql");

/// The stored responses of one range of order ids, `$1` to `$2`: each key's
/// order id, status, `Location` and `ETag`, which recon compares with the
/// response orders stores for that order
/// ([`pipeline::contract::created_response`]) row by row, in Rust (the
/// `ETag` is a BLAKE3 hash PostgreSQL cannot compute; [`Responses`](crate::Responses)). Run
/// after [`PART_SQL`] on the same connection, in the same snapshot when
/// in parts. Checked at run time only (`src/sql/responses.sql`, covered by
/// the tests).
pub const RESPONSES_SQL: &str = include_str!("sql/responses.sql");

/// The floors of the stores that expire ([`Floors`](crate::Floors)), read first, in the
/// diff's snapshot.
pub const FLOORS_SQL: &str = include_str!("sql/floors.sql");

/// Dead letters: counted once, not per range (a dead letter need not have
/// a msg_id).
pub const DEAD_LETTERS_SQL: &str = include_str!("sql/dead_letters.sql");

/// Pipeline drained: nothing in the outbox that the relay will still
/// publish (rows marked failed, and the later rows of their keys that they
/// hold back, never will), every published event consumed (in the inbox, a
/// dead letter, or a webhook delivery the sender gave up), and no webhook
/// claimed and not applied.
pub const DRAINED_SQL: &str = include_str!("sql/drained.sql");

/// The messages the consumer group committed past against the database
/// (`recon --committed-past`; [`check_committed`](crate::check_committed)).
pub const COMMITTED_SQL: &str = include_str!("sql/committed.sql");
