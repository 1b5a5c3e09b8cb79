//! Model coding (the container coder `rans`): each group of a coded allocation
//! ([`crate::alloc::DpConfig::coded`], [`crate::step`]) carries a static distribution of its
//! codes (one for the whole group, or one per coordinate), and a chunk's codes are range-coded
//! against it with rANS (`constriction`'s 24-bit ANS coder). A byte coder (DEFLATE, zstd) sees
//! packed 1–16-bit codes as near-uniform bytes; a model sees each code as the symbol it is, so
//! a code of entropy 1.3 bits costs about 1.3 bits, below one bit too.
//!
//! Chunk payload: the per-token fp16 shift and scale of every group that stores them (`4·n`
//! bytes per group, in group order, as [`crate::pack`] lays them out; a [`Fit::Step`] group's
//! are the allocation's constants and are not stored), then the ANS words (`u32`,
//! little-endian) of all codes, group after group, token-major. The decoder writes the
//! [`crate::pack`] layout, so everything after the entropy stage (CPU unpack, GPU restore) is
//! unchanged.

use constriction::stream::model::DefaultContiguousCategoricalEntropyModel;
use constriction::stream::stack::DefaultAnsCoder;
use constriction::stream::{Decode, Encode};

use crate::alloc::{Allocation, Group};
use crate::quant::Fit;

/// Fixed-point precision of the models' probabilities (they sum to `2^PRECISION`).
pub const PRECISION: usize = 24;

/// Pseudo-count added to every code of a histogram (the model must give every code a non-zero
/// probability, and a few rows should not make a rare code look impossible).
pub const SMOOTHING: f64 = 0.5;

/// Widest code the coded DP gives a group (its pooled models are measured histograms).
pub const MAX_CODED_BITS: u8 = 8;

/// Widest code a model may cover.
pub const MAX_MODEL_BITS: u8 = 15;

/// Estimated coded bits per code of a group whose codes fell as `hist`: the cross-entropy of
/// the histogram under its own smoothed model (what the coder pays on data like the rows).
pub fn bits_per_code(hist: &[u32]) -> f64 {
    let n: f64 = hist.iter().map(|&c| c as f64).sum();
    if n == 0.0 {
        return (hist.len() as f64).log2();
    }
    let denom = n + SMOOTHING * hist.len() as f64;
    -hist.iter().filter(|&&c| c > 0).map(|&c| c as f64 * ((c as f64 + SMOOTHING) / denom).log2()).sum::<f64>() / n
}

/// The model of a histogram: smoothed probabilities in `PRECISION`-bit fixed point, each at
/// least 1, summing to `2^PRECISION` exactly.
pub fn quantised_model(hist: &[u32]) -> Vec<u32> {
    let n: f64 = hist.iter().map(|&c| c as f64).sum::<f64>() + SMOOTHING * hist.len() as f64;
    let p: Vec<f64> = hist.iter().map(|&c| (c as f64 + SMOOTHING) / n).collect();
    fixed_point(&p)
}

/// Probabilities `p` (summing to about 1) in `PRECISION`-bit fixed point: each at least 1,
/// summing to `2^PRECISION` exactly.
pub fn fixed_point(p: &[f64]) -> Vec<u32> {
    let total = 1u32 << PRECISION;
    let k = p.len();
    assert!(k >= 1 && k <= total as usize / 2, "{k} symbols do not fit a {PRECISION}-bit model");
    // one unit each, the rest in proportion (floors), the remainder to the largest fractions
    let psum: f64 = p.iter().map(|x| x.max(0.0)).sum();
    let free = (total as usize - k) as f64;
    let share: Vec<f64> = p.iter().map(|&x| if psum > 0.0 { x.max(0.0) / psum * free } else { free / k as f64 }).collect();
    let mut q: Vec<u32> = share.iter().map(|&r| 1 + r.floor() as u32).collect();
    let rem = total as i64 - q.iter().map(|&x| x as i64).sum::<i64>();
    let mut order: Vec<usize> = (0..k).collect();
    order.sort_by(|&a, &b| (share[b] - share[b].floor()).total_cmp(&(share[a] - share[a].floor())).then(a.cmp(&b)));
    for &i in order.iter().take(rem.max(0) as usize) {
        q[i] += 1;
    }
    q
}

/// Models a group's entry of [`Allocation::models`] holds: one pooled model, or one per coordinate.
pub fn models_in(g: &Group, entries: usize) -> usize {
    if entries == 1usize << g.bits {
        1
    } else {
        g.len as usize
    }
}

/// Checks a group's stored models: one of `2^bits` entries or one per coordinate, each entry
/// ≥ 1, each model summing to `2^PRECISION`.
pub fn check_model(probs: &[u32], g: &Group) -> Result<(), String> {
    let k = 1usize << g.bits.min(MAX_MODEL_BITS + 1);
    if g.bits > MAX_MODEL_BITS || !(probs.len() == k || probs.len() == k * g.len as usize) {
        return Err(format!("{} model entries for {} {}-bit codes", probs.len(), g.len, g.bits));
    }
    if probs.contains(&0) || probs.chunks(k).any(|m| m.iter().map(|&p| p as u64).sum::<u64>() != 1 << PRECISION) {
        return Err(format!("model probabilities must be ≥ 1 and sum to {}", 1u64 << PRECISION));
    }
    Ok(())
}

/// Expected coded bits per code of a model on data distributed as the model.
pub fn model_bits_per_code(probs: &[u32]) -> f64 {
    let t = (1u64 << PRECISION) as f64;
    -probs.iter().map(|&p| p as f64 / t * (p as f64 / t).log2()).sum::<f64>()
}

/// Expected coded bits per token of a group's codes (its models' entropies).
pub fn group_bits(g: &Group, probs: &[u32]) -> f64 {
    let k = 1usize << g.bits;
    let per: f64 = probs.chunks(k).map(model_bits_per_code).sum();
    if probs.len() == k {
        per * g.len as f64
    } else {
        per
    }
}

/// Whether a group's per-token shift and scale are stored (not the allocation's constants).
pub fn stores_scales(g: &Group) -> bool {
    g.fit != Fit::Step
}

fn side_len(n: usize, alloc: &Allocation) -> usize {
    4 * n * alloc.groups.iter().filter(|g| stores_scales(g)).count()
}

type Model = DefaultContiguousCategoricalEntropyModel<Vec<u32>>;

/// The coder's models of `alloc`: per group, one or one per coordinate.
fn build_models(alloc: &Allocation) -> Result<Vec<Vec<Model>>, String> {
    alloc.groups.iter().zip(&alloc.models).map(|(g, p)| p.chunks(1 << g.bits).map(|m| Model::from_nonzero_fixed_point_probabilities(m, false).map_err(|()| "invalid model".to_string())).collect()).collect()
}

/// Model-codes a chunk of `n` tokens packed with `alloc` ([`crate::pack`] layout). The
/// allocation must be coded (one model per group).
pub fn encode(raw: &[u8], n: usize, alloc: &Allocation) -> Result<Vec<u8>, String> {
    if !alloc.codable() {
        return Err("the allocation has no entropy models (calibrate with `--step` or `--coded`)".into());
    }
    let models = build_models(alloc)?;
    let mut side = Vec::with_capacity(side_len(n, alloc));
    let mut symbols: Vec<(u16, u32)> = Vec::new(); // (code, model index)
    let mut pos = 0;
    let mut first_model = 0u32;
    for (g, ms) in alloc.groups.iter().zip(&models) {
        if stores_scales(g) {
            side.extend_from_slice(&raw[pos..pos + 4 * n]);
        }
        pos += 4 * n;
        let (bits, len) = (g.bits as u32, g.len as usize);
        let mut cs = crate::pack::codes(&raw[pos..], bits);
        for _ in 0..n {
            for (j, c) in (0..len).zip(cs.by_ref()) {
                let m = if ms.len() == 1 { 0 } else { j };
                symbols.push((c as u16, first_model + m as u32));
            }
        }
        pos += (n * len * bits as usize).div_ceil(8);
        first_model += ms.len() as u32;
    }
    let flat: Vec<&Model> = models.iter().flatten().collect();
    let mut coder = DefaultAnsCoder::new();
    for &(s, m) in symbols.iter().rev() {
        coder.encode_symbol(s as usize, flat[m as usize]).map_err(|e| format!("rANS encode: {e:?}"))?;
    }
    let words = coder.into_compressed().map_err(|e| format!("rANS: {e:?}"))?;
    let mut out = side;
    out.reserve(4 * words.len());
    out.extend(words.iter().flat_map(|w| w.to_le_bytes()));
    Ok(out)
}

/// Decodes a payload of [`encode`] into `out`, the [`crate::pack`] bytes of `n` tokens of
/// `alloc` (`out.len()` must be their [`crate::pack::raw_len`]). Corrupt input is an error,
/// never a panic; a stream that is not used up exactly is corrupt.
pub fn decode_into(stored: &[u8], n: usize, alloc: &Allocation, out: &mut [u8]) -> Result<(), String> {
    if !alloc.codable() {
        return Err("the allocation has no entropy models".into());
    }
    if out.len() != crate::pack::raw_len(n, alloc) {
        return Err(format!("{} output bytes for a chunk of {}", out.len(), crate::pack::raw_len(n, alloc)));
    }
    let sl = side_len(n, alloc);
    if stored.len() < sl || (stored.len() - sl) % 4 != 0 {
        return Err(format!("{} stored bytes cannot hold {sl} bytes of scales and whole 32-bit words", stored.len()));
    }
    let models = build_models(alloc)?;
    let words: Vec<u32> = stored[sl..].chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let mut coder = DefaultAnsCoder::from_compressed_slice(&words).map_err(|_| "the rANS stream ends in a zero word".to_string())?;
    let (mut pos, mut spos) = (0, 0);
    for (g, ms) in alloc.groups.iter().zip(&models) {
        if stores_scales(g) {
            out[pos..pos + 4 * n].copy_from_slice(&stored[spos..spos + 4 * n]);
            spos += 4 * n;
        } else {
            let gs = crate::quant::step_scale(alloc.step, g.bits);
            let b = [gs.lo.to_le_bytes(), gs.scale.to_le_bytes()].concat();
            out[pos..pos + 4 * n].chunks_exact_mut(4).for_each(|o| o.copy_from_slice(&b));
        }
        pos += 4 * n;
        let (bits, len) = (g.bits as u32, g.len as usize);
        let count = n * len;
        let bytes = (count * bits as usize).div_ceil(8);
        let mut w = crate::pack::BitWriter::new(&mut out[pos..pos + bytes]);
        for k in 0..count {
            let model = &ms[if ms.len() == 1 { 0 } else { k % len }];
            let s = coder.decode_symbol(model).map_err(|e| format!("rANS decode: {e:?}"))?;
            w.put(s as u32, bits);
        }
        w.flush();
        pos += bytes;
    }
    if !coder.is_empty() {
        return Err("the rANS stream holds more than the chunk's codes".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::Group;
    use crate::quant::Fit;
    use rand::{Rng, SeedableRng};

    #[test]
    fn models_are_exact_and_estimates_match() {
        for hist in [vec![0u32, 0], vec![5, 900, 880, 3], vec![1; 256], (0..16).map(|i| 1000 >> (i as u32).min(12)).collect()] {
            let m = quantised_model(&hist);
            check_model(&m, &Group::new(0, 3, hist.len().trailing_zeros() as u8)).unwrap();
            assert!(m.iter().all(|&p| p >= 1));
        }
        // a peaked histogram costs well under its width, a flat one about its width
        assert!(bits_per_code(&[10, 1000, 1000, 10]) < 1.2);
        assert!((bits_per_code(&[1000; 8]) - 3.0).abs() < 0.01);
    }

    fn coded_alloc(seed: u64) -> (Allocation, usize) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let groups = vec![
            Group { start: 0, len: 1, bits: 8, fit: Fit::Clip },
            Group { start: 1, len: 16, bits: 3, fit: Fit::MinMax },
            Group { start: 20, len: 16, bits: 1, fit: Fit::Clip },
            Group { start: 36, len: 5, bits: 2, fit: Fit::MinMax },
            Group { start: 41, len: 3, bits: 11, fit: Fit::Step },
        ];
        // pooled models, and one per coordinate for the step group
        let models = groups
            .iter()
            .map(|g| {
                let per = if g.fit == Fit::Step { g.len } else { 1 };
                (0..per).flat_map(|_| quantised_model(&(0..1u32 << g.bits).map(|_| rng.gen_range(0..50)).collect::<Vec<_>>())).collect()
            })
            .collect();
        (Allocation { budget_bits: 1000, groups, expected_error: 0.0, models, step: 0.25, dead_zone: 0.0 }, 44)
    }

    proptest::proptest! {
        /// Any bytes at all, of any length, decode to an error or to some codes: never a panic.
        #[test]
        fn arbitrary_payloads_never_panic(seed in 0u64..4, n in 0usize..9, bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600)) {
            let (a, _) = coded_alloc(seed);
            let mut out = vec![0u8; crate::pack::raw_len(n, &a)];
            let _ = decode_into(&bytes, n, &a, &mut out);
        }

        /// A valid payload with one word flipped or cut short: an error or other codes, never a panic.
        #[test]
        fn damaged_payloads_never_panic(seed in 0u64..4, at in proptest::prelude::any::<proptest::sample::Index>(), xor in 1u8..=255, cut in proptest::prelude::any::<proptest::sample::Index>()) {
            let (a, comps) = coded_alloc(seed);
            let n = 9;
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let d: Vec<f64> = (0..n * comps).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let raw = crate::pack::encode(&d, n, comps, &a);
            let stored = encode(&raw, n, &a).unwrap();
            let mut out = vec![0u8; raw.len()];
            let mut bad = stored.clone();
            let i = at.index(bad.len());
            bad[i] ^= xor;
            let _ = decode_into(&bad, n, &a, &mut out);
            let _ = decode_into(&stored[..cut.index(stored.len())], n, &a, &mut out);
        }
    }

    #[test]
    fn round_trips_and_rejects_corruption() {
        for seed in 0..4 {
            let (a, comps) = coded_alloc(seed);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed + 10);
            for n in [0usize, 1, 7, 64] {
                let d: Vec<f64> = (0..n * comps).map(|_| rng.gen_range(-3.0..3.0)).collect();
                assert_eq!(side_len(n, &a), 4 * n * 4, "the step group's scales are not stored");
                let raw = crate::pack::encode(&d, n, comps, &a);
                let stored = encode(&raw, n, &a).unwrap();
                let mut back = vec![0u8; raw.len()];
                decode_into(&stored, n, &a, &mut back).unwrap();
                assert_eq!(back, raw, "seed {seed} n {n}");
                if n > 0 {
                    // truncation and flipped words: an error or other bytes, never a panic
                    let _ = decode_into(&stored[..stored.len() - 4], n, &a, &mut back);
                    let mut bad = stored.clone();
                    let k = bad.len() - 1;
                    bad[k] ^= 0x5a;
                    let _ = decode_into(&bad, n, &a, &mut back);
                    assert!(decode_into(&stored[..stored.len() - 1], n, &a, &mut back).is_err());
                }
            }
        }
    }
}
