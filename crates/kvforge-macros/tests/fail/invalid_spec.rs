// A spec the validator rejects: the error carries the file, line, column and field.
mod bad {
    kvforge_macros::kernels!("crates/kvforge-macros/tests/specs/bad_bits.toml");
}

fn main() {}
