//! The gRPC client's types, generated from `proto/orders.proto` by the
//! build script: a module of its own, below the client that uses it.

tonic::include_proto!("orders.v1");
