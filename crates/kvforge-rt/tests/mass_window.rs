//! The importance-window kernel on the CPU: NVRTC compiles it for every shipped spec without
//! a diagnostic and without spills (skipped, visibly, where NVRTC is missing).

use kvforge_rt::jit::{compile, CompileMode, PtxasReport};
use kvforge_spec::VariantId;

#[test]
fn mass_window_compiles_cleanly_for_every_spec() {
    if !kvforge_rt::nvrtc_present() {
        println!("skipped: no NVRTC");
        return;
    }
    for file in ["baseline.toml", "spherical.toml", "certified.toml", "rdkv.toml", "trizone.toml"] {
        let spec = kvforge_rt::testing::shipped_spec(file);
        let v = VariantId::mass_window(&spec);
        assert!(kvforge_gen::variants(&spec).contains(&v), "{file}: the generator must render {v}");
        let src = kvforge_gen::render(&spec, &v).unwrap();
        let c = compile(&v, &src, "sm_90", CompileMode { strict: true, ptxas_report: true, use_cache: false }).unwrap_or_else(|e| panic!("{v}: {e}"));
        let r = PtxasReport::parse(&c.log).unwrap_or_else(|| panic!("{v}: no ptxas report in {:?}", c.log));
        println!("{v}: {} registers, {} B spilled", r.registers, r.spill_stores);
        assert_eq!((r.spill_stores, r.spill_loads), (0, 0), "{v} spills: {r:?}");
        assert!(!c.cubin.is_empty());
    }
}
