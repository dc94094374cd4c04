//! The payments crate's integration tests, in one binary
//! (`cargo nextest run -p payments`), against the stack of `make up`.

// The consumer over Kafka.
mod kafka;
// The brokers' SASL and ACLs: what each principal may do.
mod kafka_acl;
// Property tests of decoding and dead-lettering.
mod props;
// The consumer over signed HTTP webhooks (`--source http`).
mod webhooks;
