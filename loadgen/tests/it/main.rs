//! The load generator's integration tests, in one binary
//! (`cargo nextest run -p loadgen`), against the PostgreSQL of `make up`.

// Several orders instances, one key's sends spread over them.
mod spread;
