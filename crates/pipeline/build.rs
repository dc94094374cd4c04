//! `sqlx::migrate!` embeds the migrations at compile time but does not notice
//! a new file; watching the folder makes cargo rebuild when one is added.
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
