//! The orders crate's integration tests, in one binary
//! (`cargo nextest run -p orders`), against the PostgreSQL of `make up`.

// The service over HTTP and gRPC: `run` on port 0, real clients.
mod api;
// Property tests of the HTTP router over the real store.
mod props;
