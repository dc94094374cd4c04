//! The effectively crate's integration tests, in one binary
//! (`cargo nextest run -p effectively`), against the stack of `make up`.

// The library on a schema of the user's choosing, in a database of its own.
mod store;
// The library's relay: a scripted sink and Kafka.
mod store_relay;
// The library's consumer loop over the real broker.
mod store_consume;
// Idempotency keys on an axum route.
mod store_http;
// Signed webhooks received into an inbox.
mod store_receive;
// Idempotency keys claimed a batch at a time, and in the caller's statement.
mod store_keys;
// The relay over a table of the user's own (a Source), its hooks and depth.
mod store_source;
// The partitioned inbox: its window, its upkeep, its drops.
mod store_partitioned;
