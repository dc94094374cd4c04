//! The recon crate's integration tests, in one binary
//! (`cargo nextest run -p recon`), against the stack of `make up`.

// What the consumer group committed past against the database.
mod committed;
// The whole pipeline as processes, then recon's diff.
mod e2e;
// loadgen's ground-truth files against the database.
mod intents;
