//! f64 reference of the rotated codes ([`super`] states the format). Rows arrive already in
//! the rotated basis (the runtime rotates on append; `kvforge_ref::encode_sequence` does the
//! same for a whole sequence).
//!
//! **Arithmetic.** The steps that pick a code run in f32 as the CUDA encode does: the norm
//! (summed in f64, rounded once to f32), `inv = 1/‖x‖`, `u_c = x_c · inv` and the comparisons
//! with the f32 thresholds, so that GPU and reference pick the same codes up to the last bit of
//! the GPU's f32 norm. The scale `γ = ⟨x, ℓ̂⟩ / ⟨ℓ̂, ℓ̂⟩` is computed in f64 and rounded to f32,
//! then to fp16 (round to nearest even, as `__float2half_rn` of the kernel's f32 value).
//! Decoding is `γ · ℓ_code` in f64 from the stored fp16 γ and the f32 levels.

use half::f16;

use super::levels::{levels, LevelTable};

/// Coded arrays of rotated rows: the fp16 scales `[tokens]` and the packed codes.
#[derive(Clone, Debug, PartialEq)]
pub struct RotatedArrays {
    pub norm: Vec<u8>,
    pub codes: Vec<u8>,
}

/// The arrays as they lie in a segment.
#[derive(Clone, Copy, Debug)]
pub struct RotatedView<'a> {
    pub norm: &'a [u8],
    pub codes: &'a [u8],
}

impl RotatedArrays {
    pub fn view(&self) -> RotatedView<'_> {
        RotatedView { norm: &self.norm, codes: &self.codes }
    }
}

/// Codes and stored scale (fp16 value as f32) of one row `x` (`[d]`) under `table`.
pub fn code_row(table: &LevelTable, x: &[f32]) -> (Vec<u8>, f32) {
    let e = table.levels_f32.len();
    let norm = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt() as f32;
    let inv = 1.0f32 / norm;
    if norm == 0.0 || !inv.is_finite() {
        return (vec![(e / 2) as u8; x.len()], 0.0);
    }
    let codes: Vec<u8> = x
        .iter()
        .map(|&v| {
            let u = v * inv;
            table.thresholds_f32.iter().filter(|&&t| u > t).count() as u8
        })
        .collect();
    let (mut xl, mut ll) = (0f64, 0f64);
    for (&v, &c) in x.iter().zip(&codes) {
        let l = f64::from(table.levels_f32[c as usize]);
        xl += f64::from(v) * l;
        ll += l * l;
    }
    let gamma = f16::from_f32((xl / ll) as f32).to_f32();
    (codes, gamma)
}

/// Packs one token's codes (each `< 2^bits`, `codes.len()` a multiple of
/// [`super::row_unit`]) into `row` (`codes.len() · bits / 8` bytes), as [`super`] states:
/// 4 bits, chunk `c/8` a little-endian u32, code `k` in nibble `k`; 2 bits, chunks `2q`, `2q + 1`
/// at bits 0-1 and 2-3 of the nibbles of u32 `q`; 3 bits, groups of 32 codes in 3
/// little-endian words ([`super::group3_pack`]).
pub fn pack_row(bits: u32, codes: &[u8], row: &mut [u8]) {
    let b = bits as usize;
    assert_eq!(row.len() * 8, codes.len() * b, "a row of {} {bits}-bit codes is {} bytes", codes.len(), codes.len() * b / 8);
    debug_assert!(codes.iter().all(|&c| u32::from(c) < (1 << bits)));
    if bits == 3 {
        assert!(codes.len().is_multiple_of(super::GROUP3_CHANNELS), "3-bit rows are whole groups of {} codes", super::GROUP3_CHANNELS);
        for (group, cs) in row.chunks_exact_mut(12).zip(codes.chunks_exact(super::GROUP3_CHANNELS)) {
            let n: [u32; 4] = std::array::from_fn(|j| nibbles(&cs[8 * j..8 * j + 8]));
            for (dst, w) in group.chunks_exact_mut(4).zip(super::group3_pack(n)) {
                dst.copy_from_slice(&w.to_le_bytes());
            }
        }
        return;
    }
    if bits == 2 {
        assert!(codes.len().is_multiple_of(super::WORD2_CHANNELS), "2-bit rows are whole words of {} codes", super::WORD2_CHANNELS);
        for (word, cs) in row.chunks_exact_mut(4).zip(codes.chunks_exact(super::WORD2_CHANNELS)) {
            word.copy_from_slice(&(nibbles(&cs[..8]) | nibbles(&cs[8..]) << 2).to_le_bytes());
        }
        return;
    }
    for (chunk, cs) in row.chunks_exact_mut(b).zip(codes.chunks_exact(8)) {
        chunk.copy_from_slice(&nibbles(cs).to_le_bytes());
    }
}

/// 8 codes one per nibble, code `i` at bits `4i`.
fn nibbles(cs: &[u8]) -> u32 {
    cs.iter().enumerate().fold(0u32, |w, (i, &c)| w | (u32::from(c) << (4 * i)))
}

/// Code of channel `c` in a packed row.
pub fn unpack_code(bits: u32, row: &[u8], c: usize) -> u8 {
    let b = bits as usize;
    if bits == 3 {
        let g = c / super::GROUP3_CHANNELS;
        let word = |i: usize| u32::from_le_bytes(row[12 * g + 4 * i..12 * g + 4 * i + 4].try_into().unwrap());
        let n = super::group3_nibbles([word(0), word(1), word(2)]);
        return ((n[(c / 8) % 4] >> (4 * (c % 8))) & 7) as u8;
    }
    // 2 bits: chunk pairs share a word; 4 bits: one chunk per word.
    let (per_word, stride) = if bits == 2 { (super::WORD2_CHANNELS, 2) } else { (8, 0) };
    let w = u32::from_le_bytes(row[4 * (c / per_word)..4 * (c / per_word) + 4].try_into().unwrap());
    debug_assert!(b == 2 || b == 4);
    ((w >> (4 * (c % 8) + stride * ((c / 8) % 2))) & ((1 << bits) - 1)) as u8
}

/// Codes `[tokens][d]` rows `x` (rotated basis) with `bits`-bit levels for head dim `d`.
pub fn encode(bits: u32, d: usize, tokens: usize, x: &[f32]) -> RotatedArrays {
    let table = levels(d, bits);
    let row = super::code_row_bytes(d, bits);
    let mut out = RotatedArrays { norm: vec![0u8; tokens * 2], codes: vec![0u8; tokens * row] };
    for t in 0..tokens {
        let (codes, gamma) = code_row(table, &x[t * d..(t + 1) * d]);
        out.norm[t * 2..t * 2 + 2].copy_from_slice(&f16::from_f32(gamma).to_le_bytes());
        pack_row(bits, &codes, &mut out.codes[t * row..(t + 1) * row]);
    }
    out
}

/// The stored scale γ of token `t`.
pub fn scale(a: RotatedView<'_>, t: usize) -> f64 {
    f16::from_le_bytes([a.norm[2 * t], a.norm[2 * t + 1]]).to_f64()
}

/// Inverse of [`encode`]: X̂ `[tokens][d]` in f64 (rotated basis).
pub fn decode(bits: u32, d: usize, tokens: usize, a: RotatedView<'_>) -> Vec<f64> {
    let table = levels(d, bits);
    let row = super::code_row_bytes(d, bits);
    let mut out = Vec::with_capacity(tokens * d);
    for t in 0..tokens {
        let gamma = scale(a, t);
        let r = &a.codes[t * row..(t + 1) * row];
        out.extend((0..d).map(|c| gamma * f64::from(table.levels_f32[unpack_code(bits, r, c) as usize])));
    }
    out
}

/// Logits `⟨q_rot, k̂_t⟩ = γ_t Σ_c q_rot[c] ℓ_{code_{t,c}}` of the keys of a segment, as the
/// decode kernel scores them (no key rebuilt): `q_rot` is the query already rotated (`[d]`).
pub fn logits(bits: u32, d: usize, tokens: usize, a: RotatedView<'_>, q_rot: &[f64]) -> Vec<f64> {
    let table = levels(d, bits);
    let row = super::code_row_bytes(d, bits);
    (0..tokens)
        .map(|t| {
            let r = &a.codes[t * row..(t + 1) * row];
            scale(a, t) * (0..d).map(|c| q_rot[c] * f64::from(table.levels_f32[unpack_code(bits, r, c) as usize])).sum::<f64>()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_follows_the_chunk_layout() {
        for bits in [2, 3, 4] {
            let n = 64;
            let codes: Vec<u8> = (0..n).map(|c| ((c * 7 + 3) % (1 << bits)) as u8).collect();
            let mut row = vec![0u8; n * bits as usize / 8];
            pack_row(bits, &codes, &mut row);
            assert!((0..n).all(|c| unpack_code(bits, &row, c) == codes[c]), "{bits} bits");
        }
        // 4 bits: code k in nibble k; 2 bits: the even chunk at bits 0-1 of the nibbles, the
        // odd one at bits 2-3.
        let mut row = [0u8; 4];
        pack_row(4, &[1, 2, 3, 4, 5, 6, 7, 15], &mut row);
        assert_eq!(u32::from_le_bytes(row), 0xf765_4321);
        pack_row(2, &[1, 2, 3, 0, 0, 0, 0, 1, 3, 0, 1, 2, 0, 0, 0, 3], &mut row);
        assert_eq!(u32::from_le_bytes(row), 0xd000_872d);
    }

    #[test]
    fn three_bit_groups_decode_as_the_kernel_computes() {
        // Chunk j's codes 0o0..0o7 shifted by j: the words are what group3_pack defines, and
        // the decode's formulas (rotated_lut.cuh) give back every chunk.
        let codes: Vec<u8> = (0..32).map(|c| ((c % 8 + c / 8) % 8) as u8).collect();
        let mut row = [0u8; 12];
        pack_row(3, &codes, &mut row);
        let w: [u32; 3] = std::array::from_fn(|i| u32::from_le_bytes(row[4 * i..4 * i + 4].try_into().unwrap()));
        let m = 0x7777_7777u32;
        let n = [w[0] & m, ((w[0] >> 1) ^ w[2]) & m, w[1] & m, ((w[1] >> 1) ^ (w[2] >> 2)) & m];
        for (j, nj) in n.iter().enumerate() {
            assert_eq!(*nj, (0..8).fold(0u32, |x, k| x | (((k + j as u32) % 8) << (4 * k))), "chunk {j}");
        }
        // Every 96-bit group is the image of exactly one set of codes: random words round trip.
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1000 {
            let w: [u32; 3] = std::array::from_fn(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 32) as u32
            });
            assert_eq!(crate::codecs::rotated::group3_pack(crate::codecs::rotated::group3_nibbles(w)), w);
        }
    }

    #[test]
    fn zero_row_codes_the_middle_level_with_scale_zero() {
        let t = levels(64, 3);
        let (codes, gamma) = code_row(t, &[0.0; 64]);
        assert!(codes.iter().all(|&c| c == 4));
        assert_eq!(gamma, 0.0);
    }

    #[test]
    fn a_tie_takes_the_lower_level() {
        let t = levels(64, 2);
        // A row whose normalised channel 0 lands exactly on the middle threshold 0.
        let mut x = vec![1.0f32; 64];
        x[0] = 0.0;
        let (codes, _) = code_row(t, &x);
        assert_eq!(codes[0], 1);
        assert!(codes[1..].iter().all(|&c| c >= 2));
    }
}
