//! The checked-in `kernels-generated/<spec>/bindings.rs` compile, and each names every kernel
//! the generator renders for its spec (the certify kernels too), in the generator's order.

use std::path::Path;

use kvforge_spec::Spec;

#[allow(dead_code)]
mod baseline {
    include!("../../../kernels-generated/baseline/bindings.rs");
}
#[allow(dead_code)]
mod certified {
    include!("../../../kernels-generated/certified/bindings.rs");
}
#[allow(dead_code)]
mod rdkv {
    include!("../../../kernels-generated/rdkv/bindings.rs");
}
#[allow(dead_code)]
mod rotated {
    include!("../../../kernels-generated/rotated/bindings.rs");
}
#[allow(dead_code)]
mod spherical {
    include!("../../../kernels-generated/spherical/bindings.rs");
}
#[allow(dead_code)]
mod trizone {
    include!("../../../kernels-generated/trizone/bindings.rs");
}

/// Kernel names the generator renders for the spec `specs/<name>.toml`.
fn rendered(name: &str) -> Vec<String> {
    let spec = Spec::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../specs/{name}.toml"))).unwrap();
    assert_eq!(spec.name, name);
    kvforge_gen::variants(&spec).into_iter().chain(spec.certify_variants()).map(|v| v.name()).collect()
}

macro_rules! check_spec {
    ($($spec:ident),* $(,)?) => {$(
        let names: Vec<String> = $spec::Variant::ALL.iter().map(|v| v.info().name.to_string()).collect();
        assert_eq!(names, rendered(stringify!($spec)), "kernels-generated/{}/bindings.rs is stale: run `kvforge generate`", stringify!($spec));
        assert_eq!($spec::SPEC_NAME, stringify!($spec));
        for v in $spec::Variant::ALL {
            let info = v.info();
            assert!(info.source.contains(info.symbol), "{}: source lacks its symbol", info.name);
        }
    )*};
}

#[test]
fn checked_in_bindings_name_every_kernel() {
    check_spec!(baseline, certified, rdkv, rotated, spherical, trizone);
}

#[test]
fn every_spec_has_checked_in_bindings() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs");
    let mut stems: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "toml")).map(|p| p.file_stem().unwrap().to_string_lossy().into_owned()).collect();
    stems.sort();
    assert_eq!(stems, ["baseline", "certified", "rdkv", "rotated", "spherical", "trizone"], "a new spec needs a `mod` in this test");
}
