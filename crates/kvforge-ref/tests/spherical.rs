//! Spherical keys: the decode-time LUT logit equals ⟨q, k̂⟩, decoded radii and directions are
//! the coded ones, and the shipped spherical tiers round-trip.

mod common;

use common::{data, data64, dot, spherical_tier};
use kvforge_ref::segment::layout;
use kvforge_ref::spherical::{self, index_of, norm};
use kvforge_ref::{decode_segment, encode_segment, radius_scales, spherical_logits, RefError};
use kvforge_spec::KeyScheme;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Σ_j r̂_j · LUT[j][idx_j] = ⟨q, k̂_t⟩ to 1e-9 of Σ_c |q_c k̂_c| (the sum's own scale:
    /// the two sides add the same products in a different order).
    #[test]
    fn lut_logit_equals_dot_with_decoded_key(group in prop_oneof![Just(4usize), Just(8), Just(16), Just(32)], groups in 1usize..9, angle_bits in 1u32..9,
                                            tokens in 1usize..17, scale in 0.01f32..100.0, seed in any::<u64>()) {
        let d = group * groups;
        prop_assume!(d % 8 == 0);
        let tier = spherical_tier(group, angle_bits, seed);
        let k: Vec<f32> = data(tokens * d, -1.0, 1.0, seed ^ 1).iter().map(|x| x * scale).collect();
        let rs = radius_scales(&k, d, group);
        let seg = encode_segment(&tier, d, tokens, &k, &k, &rs);
        let (kh, _) = decode_segment(&tier, d, tokens, &seg, &rs);
        let q = data64(d, seed ^ 2);
        let logits = spherical_logits(&q, &tier, d, tokens, &seg, &rs).unwrap();
        prop_assert_eq!(logits.len(), tokens);
        for t in 0..tokens {
            let kt = &kh[t * d..(t + 1) * d];
            let exact = dot(&q, kt);
            let scale: f64 = q.iter().zip(kt).map(|(a, b)| (a * b).abs()).sum();
            prop_assert!((logits[t] - exact).abs() <= 1e-9 * scale + 1e-300, "token {}: lut {} dot {}", t, logits[t], exact);
        }
    }

    /// Each decoded group is r̂ · c_idx with r̂ = code · rscale within half a radius step of
    /// ‖k_j‖, and c_idx has the largest cosine with k_j of all codewords.
    #[test]
    fn radius_and_angle_decode_consistently(group in prop_oneof![Just(8usize), Just(16), Just(32)], groups in 1usize..5, angle_bits in 1u32..8,
                                            tokens in 1usize..9, seed in any::<u64>()) {
        let d = group * groups;
        let tier = spherical_tier(group, angle_bits, seed);
        let KeyScheme::Spherical { codebook, .. } = &tier.key else { unreachable!() };
        let k = data(tokens * d, -2.0, 2.0, seed ^ 3);
        let rs = radius_scales(&k, d, group);
        let seg = encode_segment(&tier, d, tokens, &k, &k, &rs);
        let lay = layout(&tier, d, tokens);
        let radius = &seg[lay.offset("k_radius")..];
        let index = &seg[lay.offset("k_index")..];
        let (kh, _) = decode_segment(&tier, d, tokens, &seg, &rs);
        for t in 0..tokens {
            for j in 0..groups {
                let kj = &k[t * d + j * group..t * d + (j + 1) * group];
                let idx = index_of(angle_bits, groups, index, t, j) as usize;
                let code = radius[t * groups + j];
                let r = norm(kj);
                let rhat = spherical::radius(code, rs[j]);
                prop_assert!((rhat - r).abs() <= f64::from(rs[j]) / 2.0 + 1e-6 * r, "radius {} decoded {}", r, rhat);
                let word: Vec<f64> = codebook.word(idx).iter().map(|&c| f64::from(c)).collect();
                let got = &kh[t * d + j * group..t * d + (j + 1) * group];
                for (g, w) in got.iter().zip(&word) {
                    prop_assert_eq!(*g, rhat * w);
                }
                let kj64: Vec<f64> = kj.iter().map(|&x| f64::from(x)).collect();
                let cos = |i: usize| codebook.word(i).iter().zip(&kj64).map(|(&c, x)| f64::from(c) * x).sum::<f64>();
                let best = (0..codebook.entries).map(cos).fold(f64::NEG_INFINITY, f64::max);
                prop_assert!(cos(idx) >= best - 1e-12 * r, "index {} is not the nearest codeword", idx);
                prop_assert!((0..idx).all(|i| cos(i) < cos(idx) + 1e-12 * r) , "a lower index ties");
            }
        }
    }
}

#[test]
fn shipped_spherical_tiers_round_trip_through_the_lut() {
    let s = common::spec("spherical");
    for tier in s.ladder().iter().filter(|t| !t.is_drop()) {
        let KeyScheme::Spherical { group, .. } = &tier.key else { panic!("{} is not spherical", tier.name) };
        for &d in &s.geometry.head_dims {
            let p = s.page.tokens;
            let k = data(p * d, -3.0, 3.0, d as u64);
            let rs = radius_scales(&k, d, *group);
            let seg = encode_segment(tier, d, p, &k, &k, &rs);
            assert_eq!(seg.len(), s.segment(tier.id, d).bytes);
            let (kh, vh) = decode_segment(tier, d, p, &seg, &rs);
            let q = data64(d, 5);
            let logits = spherical_logits(&q, tier, d, p, &seg, &rs).unwrap();
            for t in 0..p {
                let e = dot(&q, &kh[t * d..(t + 1) * d]);
                assert!((logits[t] - e).abs() <= 1e-12 * (1.0 + e.abs()), "{} d{d} token {t}", tier.name);
            }
            // Values are dense fp16 in these tiers.
            for (a, b) in k.iter().zip(&vh) {
                assert_eq!(half::f16::from_f32(*a).to_f64(), *b);
            }
        }
    }
}

#[test]
fn zero_keys_code_to_zero() {
    let tier = spherical_tier(16, 4, 1);
    let d = 32;
    let k = vec![0f32; 2 * d];
    let rs = radius_scales(&k, d, 16);
    assert_eq!(rs, vec![1.0, 1.0]);
    let seg = encode_segment(&tier, d, 2, &k, &k, &rs);
    let (kh, _) = decode_segment(&tier, d, 2, &seg, &rs);
    assert!(kh.iter().all(|&x| x == 0.0));
}

#[test]
fn logits_need_a_spherical_tier_and_matching_scales() {
    let tier = spherical_tier(16, 4, 1);
    let d = 32;
    let k = data(d, -1.0, 1.0, 1);
    let seg = encode_segment(&tier, d, 1, &k, &k, &[0.1, 0.1]);
    let q = data64(d, 2);
    assert!(matches!(spherical_logits(&q, &tier, d, 1, &seg, &[0.1]), Err(RefError::Shape { what: "rscale", .. })));
    assert!(matches!(spherical_logits(&q, &tier, d, 1, &seg[..10], &[0.1, 0.1]), Err(RefError::Shape { what: "segment", .. })));
    let dense = common::spec("baseline").tiers[1].clone();
    assert!(matches!(spherical_logits(&q, &dense, d, 1, &seg, &[]), Err(RefError::Geometry(_))));
}
