// At the crate root, with a trailing comma.
kvforge_macros::kernels!("specs/baseline.toml",);

fn main() {
    assert_eq!(SPEC_NAME, "baseline");
    assert_eq!(tiers::tail::ID, 0);
    assert_eq!(tiers::fp16::d64::BYTES_PER_TOKEN, 256.0);
    assert_eq!(tiers::fp16::d128::BYTES_PER_TOKEN, 512.0);
    assert_eq!(tiers::fp16::d128::V_OFFSET, 64 * 128 * 2);
    assert_eq!(tiers::fp16::d256::PAGE_BYTES, 65664);
    let info = Variant::ALL[0].info();
    assert_eq!(info.kind, "decode");
    assert_eq!(info.head_dim, 64);
    assert_eq!(info.source.lines().next().unwrap().starts_with("// @generated"), true);
    assert!(Variant::ALL.iter().any(|v| v.info().kind == "combine"));
}
