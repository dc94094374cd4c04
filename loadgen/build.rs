//! Generates the gRPC client from `proto/orders.proto` with protox, a pure-Rust
//! protobuf compiler, so building needs no `protoc` on the machine. Only the
//! client is generated: the load generator never serves gRPC.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = "../proto";
    let fds = protox::compile(["orders.proto"], [proto_dir])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed={proto_dir}/orders.proto");
    Ok(())
}
