//! kvtc restore on the device (kvforge-rt `kvtc`) against the f64 reference of kvforge-kvtc.

/// The module compiles through NVRTC (CPU; skipped, visibly, without NVRTC or the CUDA headers,
/// as tests/spec_compiles.rs).
#[test]
fn kvtc_module_compiles() {
    if !kvforge_rt::nvrtc_present() || kvforge_rt::jit::cuda_include_dir().is_err() {
        assert!(std::env::var("CI").is_err(), "CI needs NVRTC");
        println!("skipped: no NVRTC or CUDA headers");
        return;
    }
    let src = kvforge_gen::render_kvtc().unwrap();
    for arch in ["sm_90", "sm_80"] {
        let c = kvforge_rt::jit::compile_module(kvforge_gen::KVTC_SYMBOL, &src, arch, true).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(!c.cubin.is_empty());
    }
}
