//! Byte costs reproduce the seeds' tables.
use kvforge_spec::Spec;
use std::path::Path;

fn spec(name: &str) -> Spec {
    Spec::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs").join(name)).unwrap()
}

#[test]
fn spherical_key_bytes_match_seed_000_table_b1() {
    let s = spec("spherical.toml");
    let key = |n: &str| s.tier(n).unwrap().key.page_bytes(128, 64) as f64 / 64.0;
    assert_eq!(key("high"), 14.0);
    assert_eq!(key("mid"), 12.0);
    assert_eq!(key("low"), 6.0);
    assert_eq!(s.tier("drop").unwrap().bytes_per_token(128, 64), 0.0);
}

#[test]
fn certified_tier_matches_seed_004_section_5_1() {
    let s = spec("certified.toml");
    assert_eq!(s.tier("q8k4v").unwrap().bytes_per_token(128, 64), 288.0);
    assert_eq!(s.tier("fp16").unwrap().bytes_per_token(128, 64), 512.0);
}

#[test]
fn shipped_specs_enumerate_variants() {
    for f in ["baseline.toml", "spherical.toml", "certified.toml", "rdkv.toml"] {
        let s = spec(f);
        let v = s.variants_with(&|_: &Spec, _: &[kvforge_spec::TierId], _: usize, _: usize| kvforge_spec::Schedule { warps: 4, ctas_per_sm: 1, stages: 2, tc_values: true });
        assert!(!v.is_empty());
        let mut names: Vec<String> = v.iter().map(|v| v.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), v.len(), "{f}: variant names must be unique");
    }
}
