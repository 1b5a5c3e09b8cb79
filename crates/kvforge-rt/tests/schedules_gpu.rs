//! One format, every schedule: a decode format compiled under each schedule of its table
//! (kvforge-gen `schedule::alternatives`: the default, the other warp count, fp32 values, the
//! shallowest pipeline, one CTA per SM) gets the f64 reference's answer on the self-test's
//! cases. Run on the device with `cargo test -p kvforge-rt --test schedules_gpu -- --ignored`.

use kvforge_spec::Family;

fn every_schedule_matches_the_reference(file: &str, format: &str) {
    let dev = kvforge_rt::testing::device();
    let s = kvforge_rt::testing::shipped_spec(file);
    let v = kvforge_gen::variants(&s).into_iter().find(|v| v.name().starts_with(&format!("{format}_w"))).unwrap_or_else(|| panic!("{format} not in {file}"));
    let Family::Decode { tiers, gqa, .. } = &v.family else { unreachable!() };
    let schedules = kvforge_gen::schedule::alternatives(&s, tiers, v.head_dim, *gqa);
    assert!(schedules.len() >= 3, "{v}: {schedules:?}");
    for sc in schedules {
        let w = v.with_schedule(sc);
        let r = kvforge_lab::selftest::run_variant(&dev, &s, &w, false).unwrap();
        println!("{} {} max_abs {:.3e} tol {:.3e} {}", r.spec, r.variant, r.max_abs_err, r.tolerance, r.status);
        assert_eq!(r.status, "pass", "{r:?}");
        assert!(r.launched.contains(&w.name()), "{w} was not launched: {:?}", r.launched);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_schedule_of_rdkv_int4_matches_the_reference() {
    // Per-warp layout by default; fp32 values and 8 warps take the block layout.
    every_schedule_matches_the_reference("rdkv.toml", "decode_kint4c64f16_vint4g32f16_d128_g4_p64");
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_schedule_of_the_rdkv_ladder_matches_the_reference() {
    every_schedule_matches_the_reference("rdkv.toml", "decode_kfp16_vfp16__kint8c64f16_vint8g32f16__kint4c64f16_vint4g32f16__kint2c64f16_vint2g32f16_d128_g4_p64");
}
