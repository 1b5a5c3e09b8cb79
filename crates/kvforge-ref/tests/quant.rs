//! Integer schemes: every decoded value lies within the derived bound of its group, codes and
//! metadata sit where the layout says, and packing round-trips.

mod common;

use common::{data, int_tier, scale_dtype};
use kvforge_ref::bits::{key_code_slot, pack_codes, pack_indices, pack_key_codes, unpack_code, unpack_index, unpack_key_code};
use kvforge_ref::quant::{self, load_scale, min_max, qmax, IntStep};
use kvforge_ref::segment::layout;
use kvforge_ref::{decode_segment, encode_segment, int_error_bound};
use proptest::prelude::*;

/// Random block of `n` values: `offset + spread · u`, or constant when `spread` is 0.
fn values(n: usize, offset: f32, spread: f32, seed: u64) -> Vec<f32> {
    data(n, 0.0, 1.0, seed).into_iter().map(|u| offset + spread * u).collect()
}

fn step_at(lay: &kvforge_spec::SegmentLayout, seg: &[u8], name_scale: &str, name_zero: &str, dt: kvforge_spec::ScaleDType, i: usize) -> IntStep {
    let s = lay.array(name_scale).unwrap();
    let z = lay.array(name_zero).unwrap();
    IntStep { scale: load_scale(dt, &seg[s.offset..s.offset + s.bytes], i), zero: load_scale(dt, &seg[z.offset..z.offset + z.bytes], i) }
}

fn bits() -> impl Strategy<Value = u32> {
    prop_oneof![Just(8u32), Just(4), Just(2)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Per-channel keys over blocks: |k − k̂| ≤ biased_error_bound(block's mn, mx, stored step).
    #[test]
    fn int_keys_within_bound(kbits in bits(), fp16 in any::<bool>(), d8 in 1usize..9, block in prop_oneof![Just(1usize), Just(2), Just(4), Just(16), Just(64)],
                             blocks in 1usize..4, offset in -300f32..300.0, spread in prop_oneof![Just(0f32), 1e-4f32..1e-2, 0.1f32..100.0], seed in any::<u64>()) {
        let (d, tokens, dt) = (8 * d8, block * blocks, scale_dtype(fp16));
        let tier = int_tier(kbits, block, dt, 8, 8, dt);
        let k = values(tokens * d, offset, spread, seed);
        let seg = encode_segment(&tier, d, tokens, &k, &k, &[]);
        let lay = layout(&tier, d, tokens);
        prop_assert_eq!(seg.len(), lay.bytes);
        let (kh, _) = decode_segment(&tier, d, tokens, &seg, &[]);
        for b in 0..blocks {
            for c in 0..d {
                let (mn, mx) = min_max((0..block).map(|t| k[(b * block + t) * d + c]));
                let step = step_at(&lay, &seg, "k_scale", "k_zero", dt, b * d + c);
                let bias = kvforge_ref::quant::key_bias(kbits, dt);
                prop_assert_eq!(step, kvforge_ref::quant::biased_step(kbits, bias, mn, mx, dt), "stored step of block {} channel {}", b, c);
                let bound = kvforge_ref::quant::biased_error_bound(kbits, bias, mn, mx, step);
                for t in b * block..(b + 1) * block {
                    let e = (f64::from(k[t * d + c]) - kh[t * d + c]).abs();
                    prop_assert!(e <= bound, "token {} channel {}: error {} > bound {} (step {:?}, mn {}, mx {})", t, c, e, bound, step, mn, mx);
                }
            }
        }
    }

    /// Per-token value groups: same bound, groups of channels of one token.
    #[test]
    fn int_values_within_bound(vbits in bits(), fp16 in any::<bool>(), groups in 1usize..5, g8 in 1usize..5, tokens in 1usize..9,
                               offset in -300f32..300.0, spread in prop_oneof![Just(0f32), 1e-4f32..1e-2, 0.1f32..100.0], seed in any::<u64>()) {
        let (group, dt) = (8 * g8, scale_dtype(fp16));
        let d = group * groups;
        let tier = int_tier(8, 1, dt, vbits, group, dt);
        let v = values(tokens * d, offset, spread, seed);
        let seg = encode_segment(&tier, d, tokens, &v, &v, &[]);
        let lay = layout(&tier, d, tokens);
        let (_, vh) = decode_segment(&tier, d, tokens, &seg, &[]);
        for t in 0..tokens {
            for j in 0..groups {
                let xs = &v[t * d + j * group..t * d + (j + 1) * group];
                let (mn, mx) = min_max(xs.iter().copied());
                let step = step_at(&lay, &seg, "v_scale", "v_zero", dt, t * groups + j);
                let bias = kvforge_ref::quant::value_bias(vbits, dt);
                prop_assert_eq!(step, kvforge_ref::quant::biased_step(vbits, bias, mn, mx, dt));
                let bound = kvforge_ref::quant::biased_error_bound(vbits, bias, mn, mx, step);
                for c in 0..group {
                    let e = (f64::from(xs[c]) - vh[t * d + j * group + c]).abs();
                    prop_assert!(e <= bound, "token {} group {}: error {} > bound {}", t, j, e, bound);
                }
            }
        }
    }

    /// The bound is tight: with fp32 metadata nothing but f32 rounding adds to s/2, and with
    /// fp16 metadata the excess is the zero's and the scale's fp16 rounding and nothing more.
    #[test]
    fn bound_is_half_a_step_plus_metadata_rounding(b in bits(), mn in -300f32..300.0, width in 0f32..200.0) {
        let mx = mn + width;
        let q = f64::from(qmax(b));
        let s32 = quant::int_step(b, mn, mx, kvforge_spec::ScaleDType::Fp32);
        let mag = 1e-12 * (1.0 + f64::from(mn.abs().max(mx.abs())));
        prop_assert!(int_error_bound(b, mn, mx, s32) <= f64::from(s32.scale) * (0.5 + 1e-4) + mag);
        let s16 = quant::int_step(b, mn, mx, kvforge_spec::ScaleDType::Fp16);
        let exact = (f64::from(mx) - f64::from(mn)) / q;
        let excess = (f64::from(mn) - f64::from(s16.zero)).abs() + q * (exact - f64::from(s16.scale)).abs();
        prop_assert!(int_error_bound(b, mn, mx, s16) <= f64::from(s16.scale) * (0.5 + 1e-4) + excess + mag);
    }

    /// Every value of a group codes to a valid code whose grid point is nearest (interior
    /// points): the error never exceeds half a step there.
    #[test]
    fn interior_codes_are_nearest(b in bits(), mn in -10f32..10.0, width in 0.01f32..20.0, u in 0f32..1.0) {
        let mx = mn + width;
        let step = quant::int_step(b, mn, mx, kvforge_spec::ScaleDType::Fp32);
        let x = mn + u * width;
        let c = quant::int_code(b, x, step);
        prop_assert!(u32::from(c) <= qmax(b));
        let xh = quant::int_dequant(c, step);
        prop_assert!((f64::from(x) - xh).abs() <= f64::from(step.scale) * (0.5 + 1e-4) + 1e-9);
    }

    #[test]
    fn code_packing_round_trips(b in bits(), n8 in 1usize..33, seed in any::<u64>()) {
        let n = 8 * n8;
        let codes: Vec<u8> = data(n, 0.0, (1u32 << b) as f32, seed).iter().map(|&x| x as u8).collect();
        let mut row = vec![0u8; n * b as usize / 8];
        pack_codes(b, &codes, &mut row);
        for (c, &code) in codes.iter().enumerate() {
            prop_assert_eq!(unpack_code(b, &row, c), code);
        }
    }

    #[test]
    fn key_code_packing_round_trips(b in bits(), n8 in 1usize..33, seed in any::<u64>()) {
        let n = 8 * n8;
        let codes: Vec<u8> = data(n, 0.0, (1u32 << b) as f32, seed).iter().map(|&x| x as u8).collect();
        let mut row = vec![0u8; n * b as usize / 8];
        pack_key_codes(b, &codes, &mut row);
        for (c, &code) in codes.iter().enumerate() {
            prop_assert_eq!(unpack_key_code(b, &row, c), code);
            // 4 bits: channels 2e, 2e + 1 of a word at the same bit of its two halves.
            if b == 4 && c % 2 == 1 {
                prop_assert_eq!(key_code_slot(b, c), key_code_slot(b, c - 1) + 4);
            }
        }
    }

    #[test]
    fn index_packing_round_trips(b in 1u32..9, n in 1usize..33, seed in any::<u64>()) {
        let idx: Vec<u32> = data(n, 0.0, (1u32 << b) as f32, seed).iter().map(|&x| x as u32).collect();
        let mut row = vec![0xffu8; (n * b as usize).div_ceil(8)];
        pack_indices(b, &idx, &mut row);
        for (j, &i) in idx.iter().enumerate() {
            prop_assert_eq!(unpack_index(b, &row, j), i);
        }
        // Unused high bits of the last byte are zero.
        let used = n * b as usize;
        if used % 8 != 0 {
            prop_assert_eq!(row[row.len() - 1] >> (used % 8), 0);
        }
    }
}

#[test]
fn codes_sit_where_the_layout_says() {
    // 4-bit keys, one block of 2 tokens, d = 8: token t's row is bytes t*4 ..; the even channels
    // fill the word's low half, the odd ones its high half (bits::key_code_slot).
    let tier = int_tier(4, 2, kvforge_spec::ScaleDType::Fp32, 2, 8, kvforge_spec::ScaleDType::Fp32);
    let d = 8;
    let k: Vec<f32> = (0..16).map(|i| if i < 8 { 0.0 } else { 15.0 * (i % 2) as f32 }).collect();
    let v: Vec<f32> = (0..16).map(|i| (i % 4) as f32).collect();
    let seg = encode_segment(&tier, d, 2, &k, &v, &[]);
    let lay = layout(&tier, d, 2);
    let codes = lay.array("k_codes").unwrap();
    // Token 0 all at the block minimum (0); token 1 alternates 0, 15: odd channels code 15.
    assert_eq!(&seg[codes.offset..codes.offset + 8], &[0, 0, 0, 0, 0, 0, 0xff, 0xff]);
    // Values 0,1,2,3 per group of 8: 2-bit codes 0,1,2,3 -> byte 0b11_10_01_00.
    let vc = lay.array("v_codes").unwrap();
    assert_eq!(&seg[vc.offset..vc.offset + 4], &[0xe4, 0xe4, 0xe4, 0xe4]);
}

#[test]
fn certified_q8k4v_stores_288_bytes_per_token_at_d128() {
    let s = common::spec("certified");
    let t = s.tier("q8k4v").unwrap();
    let lay = layout(t, 128, 64);
    assert_eq!(lay.arrays.iter().map(|a| a.bytes).sum::<usize>(), 288 * 64);
    assert_eq!(t.bytes_per_token(128, 64), 288.0);
}

/// The bound is attained: over many groups some value is within 1% of the bound (it is not
/// a loose envelope).
#[test]
fn bound_is_attained() {
    for b in [8u32, 4, 2] {
        for dt in [kvforge_spec::ScaleDType::Fp32, kvforge_spec::ScaleDType::Fp16] {
            let mut worst = 0f64;
            for seed in 0..200u64 {
                let xs = data(64, -3.0, 5.0, seed);
                let (mn, mx) = min_max(xs.iter().copied());
                let step = quant::int_step(b, mn, mx, dt);
                let bound = int_error_bound(b, mn, mx, step);
                for &x in &xs {
                    let e = (f64::from(x) - quant::int_dequant(quant::int_code(b, x, step), step)).abs();
                    assert!(e <= bound);
                    worst = worst.max(e / bound);
                }
            }
            assert!(worst > 0.99, "bits {b} {dt:?}: worst error is only {worst} of the bound");
        }
    }
}
