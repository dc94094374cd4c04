//! The effectively crate's integration tests, in one binary
//! (`cargo nextest run -p effectively`), against the stack of `make up`.

// `kafka-tool` as a user runs it, against the broker.
mod kafka_tool;
// Each service role's rights in PostgreSQL, and nothing more.
mod roles;
// The library on a schema of the user's choosing, in a database of its own.
mod store;
// The library's relay: a scripted sink and Kafka.
mod store_relay;
// The library's consumer loop over the real broker.
mod store_consume;
// Idempotency keys on an axum route.
mod store_http;
