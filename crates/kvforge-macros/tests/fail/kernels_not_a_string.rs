mod x {
    kvforge_macros::kernels!(specs::spherical);
}

fn main() {}
