//! Generates the gRPC types from `proto/orders.proto` with protox, a pure-Rust
//! protobuf compiler, so building needs no `protoc` on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = "../../proto";
    let fds = protox::compile(["orders.proto"], [proto_dir])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    println!("cargo:rerun-if-changed={proto_dir}/orders.proto");
    Ok(())
}
