//! The pipeline crate's integration tests, in one binary
//! (`cargo nextest run -p pipeline`), against the stack of `make up`.

// `kafka-tool` as a user runs it, against the broker.
mod kafka_tool;
// Each service role's rights in PostgreSQL, and nothing more.
mod roles;
// PostgreSQL trusts nobody: passwords, TLS, closed socket and data directory.
mod pg_security;
// Payments' inbox moved into the library's, on a database in use.
mod inbox_move;
// A write the failing-over cluster refuses is retryable.
mod failover;
