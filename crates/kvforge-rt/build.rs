//! Renders the kernel parameter structs from kvforge-gen's field list, so the runtime always
//! matches the C++ structs the kernels are compiled with (kernels-generated/params.rs is the
//! reviewed copy of the same text).
fn main() {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("params.rs");
    std::fs::write(out, kvforge_gen::params::render_rust()).unwrap();
    println!("cargo:rerun-if-changed=build.rs");
}
