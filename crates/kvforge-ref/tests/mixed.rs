//! Mixed per-channel keys (seed 002 TriZone): every channel decodes within its segment's
//! error bound at its natural position, dropped channels decode to 0, and scoring in stored
//! order through the channel order equals scoring the natural-order keys.

mod common;

use common::{data, dot};
use half::f16;
use kvforge_ref::mixed::{check_order, identity_order, to_natural, to_stored};
use kvforge_ref::quant::{self, min_max};
use kvforge_ref::{decode_segment, encode_segment};
use kvforge_spec::{mixed_widths, ChannelSegment, DType, KeyScheme, ScaleDType, Tier, ValueScheme};
use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::SeedableRng;

fn tier(segments: Vec<ChannelSegment>, block: usize, scale: ScaleDType) -> Tier {
    Tier { id: 1, name: "mixed".into(), key: KeyScheme::Mixed { segments, block, scale }, value: ValueScheme::Dense(DType::Fp16) }
}

/// Up to four segments at distinct widths, 16 > 8 > 4 > 2, with at most 8 eighths in all.
fn segments() -> impl Strategy<Value = Vec<ChannelSegment>> {
    prop::collection::vec(0u32..4, 4).prop_filter_map("1 to 8 eighths", |e| {
        let segs: Vec<ChannelSegment> = [16, 8, 4, 2].iter().zip(&e).filter(|(_, &n)| n > 0).map(|(&bits, &eighths)| ChannelSegment { bits, eighths }).collect();
        let total: u32 = segs.iter().map(|s| s.eighths).sum();
        (1..=8).contains(&total).then_some(segs)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn channels_decode_within_their_segment_bound(segs in segments(), d in prop_oneof![Just(64usize), Just(128)], blocks in 1usize..4,
        block in prop_oneof![Just(1usize), Just(16), Just(64)], fp16 in any::<bool>(), seed in 0u64..1000) {
        let tokens = blocks * block;
        let scale = if fp16 { ScaleDType::Fp16 } else { ScaleDType::Fp32 };
        let t = tier(segs.clone(), block, scale);
        let mut order = identity_order(d);
        order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
        check_order(&order, d).unwrap();
        let k = data(tokens * d, -3.0, 5.0, seed + 1);
        let v = data(tokens * d, -1.0, 1.0, seed + 2);
        let seg = encode_segment(&t, d, tokens, &to_stored(&k, d, &order), &v, &[]);
        let (stored, _) = decode_segment(&t, d, tokens, &seg, &[]);
        let kh = to_natural(&stored, d, &order);
        let mut width = vec![0u32; d];
        for (&c, &bits) in order.iter().zip(&mixed_widths(&segs, d)) {
            width[c as usize] = bits;
        }
        for c in 0..d {
            for b in 0..blocks {
                let rows = b * block..(b + 1) * block;
                let (mn, mx) = min_max(rows.clone().map(|t| k[t * d + c]));
                for t in rows {
                    let (x, y) = (f64::from(k[t * d + c]), kh[t * d + c]);
                    match width[c] {
                        0 => prop_assert_eq!(y, 0.0, "dropped channel {} decodes to 0", c),
                        16 => prop_assert_eq!(y, f64::from(f16::from_f32(k[t * d + c]).to_f32())),
                        bits => {
                            let bound = quant::biased_error_bound(bits, quant::key_bias(bits, scale), mn, mx, quant::biased_step(bits, quant::key_bias(bits, scale), mn, mx, scale));
                            prop_assert!((x - y).abs() <= bound, "channel {} ({} bits) token {}: |{} - {}| > {}", c, bits, t, x, y, bound);
                        }
                    }
                }
            }
        }
        // The kernel's score: Σ_j q[order[j]] · k̂_stored[j] = q · k̂_natural.
        let q: Vec<f64> = data(d, -1.0, 1.0, seed + 3).into_iter().map(f64::from).collect();
        for t in 0..tokens {
            let gathered: f64 = (0..d).map(|j| q[order[j] as usize] * stored[t * d + j]).sum();
            let natural = dot(&q, &kh[t * d..(t + 1) * d]);
            prop_assert!((gathered - natural).abs() <= 1e-12 * (1.0 + natural.abs()));
        }
    }
}

#[test]
fn bad_geometry_is_a_typed_error() {
    let t = tier(vec![ChannelSegment { bits: 8, eighths: 8 }], 16, ScaleDType::Fp16);
    let k = data(16 * 64, -1.0, 1.0, 1);
    let e = kvforge_ref::try_encode_segment(&t, 64, 8, &k[..8 * 64], &k[..8 * 64], &[]).unwrap_err();
    assert!(e.to_string().contains("whole blocks of 16 tokens"), "{e}");
}
