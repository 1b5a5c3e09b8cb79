//! Spherical keys (seed 000 App. B). Each group `j` of `g` channels of a key is stored as an
//! 8-bit radius code and the index of the nearest of `2^angle_bits` unit codewords:
//!
//! ```text
//! r = ‖k_j‖₂     u = k_j / (r + 1e-6)     idx = argmax_i ⟨u, c_i⟩   (ties: lowest i)
//! radius = clamp(floor(r / rscale_j + 0.5), 0, 255)   (0 when rscale_j ≤ 0)
//! k̂_j = r̂ · c_idx with r̂ = radius · rscale_j
//! ```
//!
//! `rscale_j` is a per-(layer, head, group) f32 scale held outside the pages (see
//! [`radius_scales`]). All arithmetic is f64 on the f32 inputs; the GPU encoder works in f32
//! and may pick the other codeword of a near tie or the neighbouring radius code at a
//! rounding boundary.
//!
//! Decoding never rebuilds keys: with the *unnormalised* group query q_j,
//! `⟨q, k̂⟩ = Σ_j r̂_j ⟨q_j, c_idx_j⟩ = Σ_j r̂_j · LUT[j][idx_j]` ([`lut`], [`logits`]). (The
//! paper's normalised q̃ with w_j = 1 would not approximate q·k.)

use crate::Codebook;

use crate::codecs::bits::{index_row_bytes, pack_indices, unpack_index};

/// Radius codes are 8 bits.
pub const RADIUS_MAX: u32 = 255;
/// Added to the radius before normalising so a zero group does not divide by zero.
pub const NORM_EPS: f64 = 1e-6;

/// Euclidean norm in f64.
pub fn norm(x: &[f32]) -> f64 {
    x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt()
}

/// Index of the codeword of largest cosine with `kj` (lowest index on ties; 0 for a zero
/// group, whose dot products are all zero).
pub fn nearest_codeword(kj: &[f32], codebook: &Codebook) -> u32 {
    let inv = 1.0 / (norm(kj) + NORM_EPS);
    let mut best = (0u32, f64::NEG_INFINITY);
    for i in 0..codebook.entries {
        let dot: f64 = kj.iter().zip(codebook.word(i)).map(|(&k, &c)| f64::from(k) * inv * f64::from(c)).sum();
        if dot > best.1 {
            best = (i as u32, dot);
        }
    }
    best.0
}

/// Radius code of a group of norm `r`.
pub fn radius_code(r: f64, rscale: f32) -> u8 {
    if rscale <= 0.0 {
        return 0;
    }
    (r / f64::from(rscale) + 0.5).floor().clamp(0.0, f64::from(RADIUS_MAX)) as u8
}

/// Decoded radius r̂ of a radius code.
pub fn radius(code: u8, rscale: f32) -> f64 {
    f64::from(code) * f64::from(rscale)
}

/// Radius code and codeword index of one group.
pub fn encode_group(kj: &[f32], codebook: &Codebook, rscale: f32) -> (u8, u32) {
    (radius_code(norm(kj), rscale), nearest_codeword(kj, codebook))
}

/// Radius scales that make the largest radius of `k` (`[tokens][d]`) in each group code to
/// 255: `rscale_j = max_t ‖k_{t,j}‖ / 255`, or 1.0 for a group that is zero in every token
/// (any positive scale codes it exactly).
pub fn radius_scales(k: &[f32], d: usize, group: usize) -> Vec<f32> {
    let groups = d / group;
    let mut max = vec![0f64; groups];
    for row in k.chunks_exact(d) {
        for (j, m) in max.iter_mut().enumerate() {
            *m = m.max(norm(&row[j * group..(j + 1) * group]));
        }
    }
    max.iter().map(|&m| if m > 0.0 { (m / f64::from(RADIUS_MAX)) as f32 } else { 1.0 }).collect()
}

/// Coded arrays of spherical keys: radius codes `[tokens][G]` and packed indices
/// `[tokens][ceil(G·angle_bits/8)]`.
#[derive(Clone, Debug, PartialEq)]
pub struct SphericalArrays {
    pub radius: Vec<u8>,
    pub index: Vec<u8>,
}

/// The arrays of spherical keys as they lie in a segment.
#[derive(Clone, Copy, Debug)]
pub struct SphericalView<'a> {
    pub radius: &'a [u8],
    pub index: &'a [u8],
}

impl SphericalArrays {
    pub fn view(&self) -> SphericalView<'_> {
        SphericalView { radius: &self.radius, index: &self.index }
    }
}

/// Encodes `k` (`[tokens][d]`) with `rscale` (`[d/group]`).
pub fn encode_keys(group: usize, angle_bits: u32, codebook: &Codebook, d: usize, tokens: usize, k: &[f32], rscale: &[f32]) -> SphericalArrays {
    let groups = d / group;
    let ib = index_row_bytes(groups, angle_bits);
    let mut out = SphericalArrays { radius: vec![0u8; tokens * groups], index: vec![0u8; tokens * ib] };
    let mut idx = vec![0u32; groups];
    for t in 0..tokens {
        for j in 0..groups {
            let kj = &k[t * d + j * group..t * d + (j + 1) * group];
            let (r, i) = encode_group(kj, codebook, rscale[j]);
            out.radius[t * groups + j] = r;
            idx[j] = i;
        }
        pack_indices(angle_bits, &idx, &mut out.index[t * ib..(t + 1) * ib]);
    }
    out
}

/// Codeword index of group `j` of token `t`.
pub fn index_of(angle_bits: u32, groups: usize, index: &[u8], t: usize, j: usize) -> u32 {
    let ib = index_row_bytes(groups, angle_bits);
    unpack_index(angle_bits, &index[t * ib..(t + 1) * ib], j)
}

/// K̂ `[tokens][d]` in f64.
pub fn decode_keys(group: usize, angle_bits: u32, codebook: &Codebook, d: usize, tokens: usize, a: SphericalView<'_>, rscale: &[f32]) -> Vec<f64> {
    let SphericalView { radius: radius_codes, index } = a;
    let groups = d / group;
    let mut k = Vec::with_capacity(tokens * d);
    for t in 0..tokens {
        for j in 0..groups {
            let r = radius(radius_codes[t * groups + j], rscale[j]);
            let word = codebook.word(index_of(angle_bits, groups, index, t, j) as usize);
            k.extend(word.iter().map(|&c| r * f64::from(c)));
        }
    }
    k
}

/// Per-query lookup table `LUT[j][i] = ⟨q_j, c_i⟩` (`[G][entries]`) of the unnormalised group
/// queries of one query head `q_head` (`[d]`).
pub fn lut(q_head: &[f64], codebook: &Codebook, group: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(q_head.len() / group * codebook.entries);
    for qj in q_head.chunks_exact(group) {
        for i in 0..codebook.entries {
            out.push(qj.iter().zip(codebook.word(i)).map(|(&q, &c)| q * f64::from(c)).sum());
        }
    }
    out
}

/// Logits ⟨q, k̂_t⟩ of every token through the LUT: `Σ_j r̂_j · LUT[j][idx_j]` over the
/// `rscale.len()` groups. No softmax scale is applied.
pub fn logits(lut: &[f64], entries: usize, angle_bits: u32, tokens: usize, a: SphericalView<'_>, rscale: &[f32]) -> Vec<f64> {
    let SphericalView { radius: radius_codes, index } = a;
    let groups = rscale.len();
    (0..tokens)
        .map(|t| {
            (0..groups)
                .map(|j| {
                    let i = index_of(angle_bits, groups, index, t, j) as usize;
                    radius(radius_codes[t * groups + j], rscale[j]) * lut[j * entries + i]
                })
                .sum()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn axes(group: usize) -> Codebook {
        // ±e_0, ±e_1: 4 entries.
        let mut data = vec![0f32; 4 * group];
        data[0] = 1.0;
        data[group] = -1.0;
        data[2 * group + 1] = 1.0;
        data[3 * group + 1] = -1.0;
        Codebook::new("axes".into(), 4, group, data, HashMap::new())
    }

    #[test]
    fn picks_nearest_axis_and_lowest_on_ties() {
        let cb = axes(2);
        assert_eq!(nearest_codeword(&[3.0, 1.0], &cb), 0);
        assert_eq!(nearest_codeword(&[-3.0, 1.0], &cb), 1);
        assert_eq!(nearest_codeword(&[0.1, -2.0], &cb), 3);
        assert_eq!(nearest_codeword(&[1.0, 1.0], &cb), 0);
        assert_eq!(nearest_codeword(&[0.0, 0.0], &cb), 0);
    }

    #[test]
    fn radius_codes_round_and_clamp() {
        assert_eq!(radius_code(2.5, 1.0), 3);
        assert_eq!(radius_code(2.49, 1.0), 2);
        assert_eq!(radius_code(1e9, 1.0), 255);
        assert_eq!(radius_code(7.0, 0.0), 0);
    }

    #[test]
    fn scales_cover_the_largest_radius() {
        let k = [3.0f32, 4.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        let s = radius_scales(&k, 4, 2);
        assert_eq!(s, vec![(5.0f64 / 255.0) as f32, 1.0]);
        assert_eq!(radius_code(5.0, s[0]), 255);
    }
}
