//! Model coding (the container coder `rans`): each group of a coded allocation
//! ([`crate::alloc::DpConfig::coded`]) carries a static distribution of its codes, measured on
//! the calibration rows, and a chunk's codes are range-coded against it with rANS
//! (`constriction`'s 12-bit ANS coder). A byte coder (DEFLATE, zstd) sees packed 1–8-bit codes
//! as near-uniform bytes; a model per group sees each code as the symbol it is, so a code of
//! entropy 1.3 bits costs about 1.3 bits, below one bit too.
//!
//! Chunk payload: every group's per-token fp16 shift and scale (`4·n` bytes per group, in
//! group order, as [`crate::pack`] lays them out), then the ANS words (`u16`, little-endian) of
//! all codes, group after group, token-major. The decoder writes the [`crate::pack`] layout, so
//! everything after the entropy stage (CPU unpack, GPU restore) is unchanged.

use constriction::stream::model::{SmallContiguousCategoricalEntropyModel, SmallContiguousLookupDecoderModel};
use constriction::stream::stack::SmallAnsCoder;
use constriction::stream::{Decode, Encode};

use crate::alloc::Allocation;

/// Fixed-point precision of the models' probabilities (they sum to `2^PRECISION`).
pub const PRECISION: usize = 12;

/// Pseudo-count added to every code of a histogram (the model must give every code a non-zero
/// probability, and a few rows should not make a rare code look impossible).
pub const SMOOTHING: f64 = 0.5;

/// Widest code a model-coded group may use (`2^8` symbols fit a 12-bit model).
pub const MAX_CODED_BITS: u8 = 8;

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
pub fn quantised_model(hist: &[u32]) -> Vec<u16> {
    let total = 1u32 << PRECISION;
    let k = hist.len();
    assert!(k >= 1 && k <= total as usize / 2, "{k} symbols do not fit a {PRECISION}-bit model");
    let n: f64 = hist.iter().map(|&c| c as f64).sum::<f64>() + SMOOTHING * k as f64;
    let mut q: Vec<u32> = hist.iter().map(|&c| (((c as f64 + SMOOTHING) / n * total as f64).round() as u32).max(1)).collect();
    // settle the rounding on the largest entries (they lose the least by a unit)
    let mut sum: i64 = q.iter().map(|&x| x as i64).sum();
    while sum != total as i64 {
        let i = (0..k).filter(|&i| sum < total as i64 || q[i] > 1).max_by_key(|&i| q[i]).expect("a symbol");
        if sum > total as i64 {
            q[i] -= 1;
            sum -= 1;
        } else {
            q[i] += 1;
            sum += 1;
        }
    }
    q.into_iter().map(|x| x as u16).collect()
}

/// Checks a stored model: `2^bits` entries, each ≥ 1, summing to `2^PRECISION`.
pub fn check_model(probs: &[u16], bits: u8) -> Result<(), String> {
    if bits > MAX_CODED_BITS || probs.len() != 1 << bits {
        return Err(format!("a model of {} entries for {bits}-bit codes", probs.len()));
    }
    if probs.contains(&0) || probs.iter().map(|&p| p as u32).sum::<u32>() != 1 << PRECISION {
        return Err(format!("model probabilities must be ≥ 1 and sum to {}", 1 << PRECISION));
    }
    Ok(())
}

/// Expected coded bits per code of a model on data distributed as the model.
pub fn model_bits_per_code(probs: &[u16]) -> f64 {
    let t = (1u32 << PRECISION) as f64;
    -probs.iter().map(|&p| p as f64 / t * (p as f64 / t).log2()).sum::<f64>()
}

fn side_len(n: usize, alloc: &Allocation) -> usize {
    4 * n * alloc.groups.len()
}

/// Model-codes a chunk of `n` tokens packed with `alloc` ([`crate::pack`] layout). The
/// allocation must be coded (one model per group).
pub fn encode(raw: &[u8], n: usize, alloc: &Allocation) -> Result<Vec<u8>, String> {
    if !alloc.codable() {
        return Err("the allocation has no entropy models (calibrate with `--coded`)".into());
    }
    let models = alloc
        .models
        .iter()
        .map(|p| SmallContiguousCategoricalEntropyModel::<Vec<u16>>::from_nonzero_fixed_point_probabilities(p, false).map_err(|()| "invalid model".to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut side = Vec::with_capacity(side_len(n, alloc));
    let mut symbols: Vec<(u16, u16)> = Vec::new(); // (code, group)
    let mut pos = 0;
    for (gi, g) in alloc.groups.iter().enumerate() {
        side.extend_from_slice(&raw[pos..pos + 4 * n]);
        pos += 4 * n;
        let (bits, count) = (g.bits as u32, n * g.len as usize);
        let (mut acc, mut fill, mut at) = (0u64, 0u32, pos);
        let mask = (1u64 << bits) - 1;
        for _ in 0..count {
            while fill < bits {
                acc |= (raw[at] as u64) << fill;
                at += 1;
                fill += 8;
            }
            symbols.push(((acc & mask) as u16, gi as u16));
            acc >>= bits;
            fill -= bits;
        }
        pos += (count * bits as usize).div_ceil(8);
    }
    let mut coder = SmallAnsCoder::new();
    for &(s, gi) in symbols.iter().rev() {
        coder.encode_symbol(s as usize, &models[gi as usize]).map_err(|e| format!("rANS encode: {e:?}"))?;
    }
    let words = coder.into_compressed().map_err(|e| format!("rANS: {e:?}"))?;
    let mut out = side;
    out.reserve(2 * words.len());
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
    if stored.len() < sl || (stored.len() - sl) % 2 != 0 {
        return Err(format!("{} stored bytes cannot hold {sl} bytes of scales and whole 16-bit words", stored.len()));
    }
    let models = alloc
        .models
        .iter()
        .map(|p| SmallContiguousLookupDecoderModel::from_nonzero_fixed_point_probabilities(p, false).map_err(|()| "invalid model".to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let words: Vec<u16> = stored[sl..].chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
    let mut coder = SmallAnsCoder::from_compressed_slice(&words).map_err(|_| "the rANS stream ends in a zero word".to_string())?;
    let (mut pos, mut spos) = (0, 0);
    for (g, model) in alloc.groups.iter().zip(&models) {
        out[pos..pos + 4 * n].copy_from_slice(&stored[spos..spos + 4 * n]);
        pos += 4 * n;
        spos += 4 * n;
        let (bits, count) = (g.bits as u32, n * g.len as usize);
        let bytes = (count * bits as usize).div_ceil(8);
        let dst = &mut out[pos..pos + bytes];
        let (mut acc, mut fill, mut at) = (0u64, 0u32, 0usize);
        for _ in 0..count {
            let s = coder.decode_symbol(model).map_err(|e| format!("rANS decode: {e:?}"))?;
            acc |= (s as u64) << fill;
            fill += bits;
            while fill >= 8 {
                dst[at] = acc as u8;
                at += 1;
                acc >>= 8;
                fill -= 8;
            }
        }
        if fill > 0 {
            dst[at] = acc as u8;
        }
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
            check_model(&m, hist.len().trailing_zeros() as u8).unwrap();
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
        ];
        let models = groups.iter().map(|g| quantised_model(&(0..1u32 << g.bits).map(|_| rng.gen_range(0..50)).collect::<Vec<_>>())).collect();
        (Allocation { budget_bits: 1000, groups, expected_error: 0.0, models }, 41)
    }

    #[test]
    fn round_trips_and_rejects_corruption() {
        for seed in 0..4 {
            let (a, comps) = coded_alloc(seed);
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed + 10);
            for n in [0usize, 1, 7, 64] {
                let d: Vec<f64> = (0..n * comps).map(|_| rng.gen_range(-3.0..3.0)).collect();
                let raw = crate::pack::encode(&d, n, comps, &a);
                let stored = encode(&raw, n, &a).unwrap();
                let mut back = vec![0u8; raw.len()];
                decode_into(&stored, n, &a, &mut back).unwrap();
                assert_eq!(back, raw, "seed {seed} n {n}");
                if n > 0 {
                    // truncation and flipped words: an error or other bytes, never a panic
                    let _ = decode_into(&stored[..stored.len() - 2], n, &a, &mut back);
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
