mod nope {
    kvforge_macros::kernels!("specs/does_not_exist.toml");
}

fn main() {}
