//! The relay crate's integration tests, in one binary
//! (`cargo nextest run -p relay`), against the stack of `make up`.

// `--sink kafka`, both modes (`poll`, `wal`).
mod kafka;
// `--sink http`: signed webhooks to a scripted receiver.
mod webhooks;
