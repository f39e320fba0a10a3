//! Compiles `proto/afd.proto` with protox (pure Rust, no protoc on the machine needed) and
//! generates the tonic/prost code.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/afd.proto");
    let descriptors = protox::compile(["proto/afd.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
