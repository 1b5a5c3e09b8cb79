//! `kvforge bench` refuses bad `--ladders` before it touches a GPU, naming what is wrong.

use std::process::Command;

fn bench(ladder: &str) -> (bool, String) {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let out = Command::new(env!("CARGO_BIN_EXE_kvforge")).args(["bench", "--root", root, "--ladders", ladder]).output().expect("kvforge runs");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn ladder_without_a_spec_is_refused() {
    let (ok, err) = bench("b8+b4");
    assert!(!ok);
    assert!(err.contains("--ladders takes spec:tier+tier"), "{err}");
}

#[test]
fn ladder_with_an_unknown_spec_is_refused() {
    let (ok, err) = bench("nospec:b8+b4");
    assert!(!ok);
    assert!(err.contains("no spec named `nospec`"), "{err}");
}

#[test]
fn ladder_with_an_unknown_or_unservable_tier_is_refused() {
    let (ok, err) = bench("rdkv:b8+nope");
    assert!(!ok);
    assert!(err.contains("has no servable tier `nope`"), "{err}");
    // The drop tier holds no tokens to decode.
    let (ok, err) = bench("rdkv:b8+b0");
    assert!(!ok);
    assert!(err.contains("has no servable tier `b0`"), "{err}");
}
