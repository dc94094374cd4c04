//! The gRPC contract's types, generated from `proto/orders.proto` by the
//! build script (server and client: the tests use the client).

tonic::include_proto!("orders.v1");
