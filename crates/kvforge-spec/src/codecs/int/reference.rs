//! Asymmetric integer quantisation (KIVI / seed 004 §2.3), shared by per-channel keys and
//! per-token values.
//!
//! One quantisation group (a channel over a block of tokens, or a group of channels of one
//! token) with minimum `mn` and maximum `mx` stores
//!
//! ```text
//! scale_s = S((mx - mn) / (2^bits - 1))      zero_s = S(mn)        S = round to the scale dtype
//! code    = clamp(floor((x - zero_s) / scale_s + 0.5), 0, 2^bits - 1)   (0 when scale_s == 0)
//! x̂       = code · scale_s + zero_s
//! ```
//!
//! As stored (layout version 2), 4-bit groups and 8-bit value groups with fp16 scales keep a
//! *biased* zero and their codes are rounded on the grid it implies: see [`value_bias`] / [`key_bias`],
//! [`biased_step`], [`code_grid`], [`biased_dequant`]. The formulas above are the unbiased case.
//!
//! **Arithmetic.** Encoding runs in f32, operation for operation as the CUDA encode kernel
//! does (`(mx - mn) / qmax`, `(x - zero) / scale`, `floorf(c + 0.5f)`), so that CPU and GPU
//! store the same scale, zero and code bytes. The codes are then computed with the *stored*
//! (rounded) scale and zero, so the decoder's x̂ is the nearest grid point of the grid it
//! actually has. Decoding ([`int_dequant`]) runs in f64. [`int_error_bound`] states the
//! resulting worst-case error of one group.

use crate::ScaleDType;
use half::f16;

use crate::codecs::bits::{pack_codes, pack_key_codes, unpack_code, unpack_key_code};

/// Scale and zero of one quantisation group, as stored (already rounded to the scale dtype).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IntStep {
    pub scale: f32,
    pub zero: f32,
}

/// Largest code of `bits` bits.
pub fn qmax(bits: u32) -> u32 {
    (1 << bits) - 1
}

/// `x` rounded to the scale dtype (fp16: round to nearest even, as `__float2half`).
pub fn round_scale(dtype: ScaleDType, x: f32) -> f32 {
    match dtype {
        ScaleDType::Fp16 => f16::from_f32(x).to_f32(),
        ScaleDType::Fp32 => x,
    }
}

/// Minimum and maximum of a group, in f32 (exact: no rounding is involved).
pub fn min_max(xs: impl IntoIterator<Item = f32>) -> (f32, f32) {
    xs.into_iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(mn, mx), x| (mn.min(x), mx.max(x)))
}

/// The stored scale and zero of a group with range `[mn, mx]`.
pub fn int_step(bits: u32, mn: f32, mx: f32, dtype: ScaleDType) -> IntStep {
    let scale = (mx - mn) / qmax(bits) as f32;
    IntStep { scale: round_scale(dtype, scale), zero: round_scale(dtype, mn) }
}

/// Code of `x` on the stored grid `step` (f32 arithmetic, see the module doc).
pub fn int_code(bits: u32, x: f32, step: IntStep) -> u8 {
    if step.scale == 0.0 {
        return 0;
    }
    let c = ((x - step.zero) / step.scale + 0.5).floor();
    // `as u8` of a NaN is 0; inputs are checked finite before encoding.
    c.clamp(0.0, qmax(bits) as f32) as u8
}

/// Decoded value of `code`, in f64.
pub fn int_dequant(code: u8, step: IntStep) -> f64 {
    f64::from(code) * f64::from(step.scale) + f64::from(step.zero)
}

/// Unit roundoff of f32.
const U32: f64 = 1.0 / (1u64 << 24) as f64;
/// Unit roundoff of f64.
const U64: f64 = 1.0 / (1u64 << 53) as f64;

/// Worst-case |x − x̂| over a group with range `[mn, mx]` coded with `step`.
///
/// Three cases, by where the code lands:
/// * inside the grid: |x − x̂| = s·|y − code| with y = (x − z)/s exactly. The code is
///   `floor(fl(fl(fl(x − z)/s) + 0.5))`; three f32 roundings of values of size at most
///   `qmax + 1` move the argument of `floor` by at most `3u(qmax + 2)` (u = 2⁻²⁴; the bound
///   uses 4 to absorb the u² terms), so |y − code| ≤ 1/2 + 4u(qmax + 2).
/// * clamped to 0 (x below the stored zero, which fp16 may round above `mn`): x̂ = z,
///   |x − x̂| ≤ z − mn.
/// * clamped to qmax (the rounded scale and zero leave the top grid point below `mx`):
///   |x − x̂| ≤ mx − (qmax·s + z).
///
/// `scale_s == 0` is the last two cases with s = 0. Decoding in f64 adds one rounding of x̂
/// (`code·s` is exact: at most 8 + 24 significant bits), at most 2⁻⁵³·|x̂|, plus one ulp of
/// slack for evaluating this bound itself.
pub fn int_error_bound(bits: u32, mn: f32, mx: f32, step: IntStep) -> f64 {
    let q = qmax(bits) as f64;
    let (s, z, mn, mx) = (f64::from(step.scale), f64::from(step.zero), f64::from(mn), f64::from(mx));
    let inside = s * (0.5 + 4.0 * U32 * (q + 2.0));
    let below = z - mn;
    let above = mx - (q * s + z);
    let magnitude = mn.abs().max(mx.abs()).max(z.abs() + q * s);
    inside.max(below).max(above) + 4.0 * U64 * magnitude
}

pub use super::{key_bias, value_bias};

/// The stored scale and (biased, [`value_bias`] / [`key_bias`]) zero of a group with range `[mn, mx]`.
pub fn biased_step(bits: u32, bias: f32, mn: f32, mx: f32, dtype: ScaleDType) -> IntStep {
    let s = int_step(bits, mn, mx, dtype);
    if bias == 0.0 {
        return s;
    }
    // bias·scale is exact (a power of two times the scale).
    IntStep { scale: s.scale, zero: round_scale(dtype, mn - bias * s.scale) }
}

/// The grid a group's codes are rounded on: the stored step with the effective zero
/// `z̃ + bias·scale` (f32, as the encode kernel computes it). Use it for [`int_code`] and
/// [`int_error_bound`]; [`biased_dequant`] decodes from the stored step.
pub fn code_grid(bias: f32, stored: IntStep) -> IntStep {
    if bias == 0.0 {
        return stored;
    }
    IntStep { scale: stored.scale, zero: stored.zero + bias * stored.scale }
}

/// Worst-case |x − x̂| of a group with range `[mn, mx]` and stored step: the
/// [`int_error_bound`] of its grid ([`code_grid`]) plus the f32 rounding of the effective zero
/// (the grid's zero against the exact `z̃ + bias·scale` that [`biased_dequant`] decodes with).
pub fn biased_error_bound(bits: u32, bias: f32, mn: f32, mx: f32, stored: IntStep) -> f64 {
    let grid = code_grid(bias, stored);
    let exact = f64::from(stored.zero) + f64::from(bias) * f64::from(stored.scale);
    int_error_bound(bits, mn, mx, grid) + (f64::from(grid.zero) - exact).abs()
}

/// Decoded value of `code` with the stored step, in f64: `(code + bias)·scale + z̃`, exact.
pub fn biased_dequant(bias: f32, code: u8, stored: IntStep) -> f64 {
    (f64::from(code) + f64::from(bias)) * f64::from(stored.scale) + f64::from(stored.zero)
}

/// Writes `x` as the scale dtype, little endian.
pub fn store_scale(dtype: ScaleDType, x: f32, out: &mut [u8]) {
    match dtype {
        ScaleDType::Fp16 => out.copy_from_slice(&f16::from_f32(x).to_le_bytes()),
        ScaleDType::Fp32 => out.copy_from_slice(&x.to_le_bytes()),
    }
}

/// Reads element `i` of an array of the scale dtype.
pub fn load_scale(dtype: ScaleDType, bytes: &[u8], i: usize) -> f32 {
    let n = dtype.bytes();
    let b = &bytes[i * n..(i + 1) * n];
    match dtype {
        ScaleDType::Fp16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
        ScaleDType::Fp32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

/// Coded arrays of an integer scheme: packed codes and the scale and zero arrays.
#[derive(Clone, Debug, PartialEq)]
pub struct IntArrays {
    pub codes: Vec<u8>,
    pub scale: Vec<u8>,
    pub zero: Vec<u8>,
}

/// The arrays of an integer scheme as they lie in a segment.
#[derive(Clone, Copy, Debug)]
pub struct IntView<'a> {
    pub codes: &'a [u8],
    pub scale: &'a [u8],
    pub zero: &'a [u8],
}

impl IntArrays {
    pub fn view(&self) -> IntView<'_> {
        IntView { codes: &self.codes, scale: &self.scale, zero: &self.zero }
    }
}

/// Per-channel keys: one step per channel per block of `block` tokens. `k` is `[tokens][d]`;
/// `tokens` is a multiple of `block`. Scale and zero arrays are `[tokens/block][d]`; the zero
/// is biased for 4-bit keys ([`biased_step`]) and their codes in the key order
/// ([`crate::codecs::bits::pack_key_codes`]).
pub fn encode_keys(bits: u32, block: usize, dtype: ScaleDType, d: usize, tokens: usize, k: &[f32]) -> IntArrays {
    let row = d * bits as usize / 8;
    let blocks = tokens / block;
    let sb = dtype.bytes();
    let mut out = IntArrays { codes: vec![0u8; tokens * row], scale: vec![0u8; blocks * d * sb], zero: vec![0u8; blocks * d * sb] };
    // Unpacked codes [tokens][d], packed per token row at the end.
    let mut all = vec![0u8; tokens * d];
    for b in 0..blocks {
        for c in 0..d {
            let at = |t: usize| k[(b * block + t) * d + c];
            let (mn, mx) = min_max((0..block).map(at));
            let step = biased_step(bits, key_bias(bits, dtype), mn, mx, dtype);
            let i = b * d + c;
            store_scale(dtype, step.scale, &mut out.scale[i * sb..(i + 1) * sb]);
            store_scale(dtype, step.zero, &mut out.zero[i * sb..(i + 1) * sb]);
            let grid = code_grid(key_bias(bits, dtype), step);
            for t in 0..block {
                all[(b * block + t) * d + c] = int_code(bits, at(t), grid);
            }
        }
    }
    for (t, r) in out.codes.chunks_exact_mut(row).enumerate() {
        pack_key_codes(bits, &all[t * d..(t + 1) * d], r);
    }
    out
}

/// Inverse of [`encode_keys`]: K̂ `[tokens][d]` in f64.
pub fn decode_keys(bits: u32, block: usize, dtype: ScaleDType, d: usize, tokens: usize, a: IntView<'_>) -> Vec<f64> {
    let IntView { codes, scale, zero } = a;
    let row = d * bits as usize / 8;
    let mut k = Vec::with_capacity(tokens * d);
    for t in 0..tokens {
        let r = &codes[t * row..(t + 1) * row];
        for c in 0..d {
            let i = (t / block) * d + c;
            let step = IntStep { scale: load_scale(dtype, scale, i), zero: load_scale(dtype, zero, i) };
            k.push(biased_dequant(key_bias(bits, dtype), unpack_key_code(bits, r, c), step));
        }
    }
    k
}

/// Per-token values: one step per token per group of `group` channels. `v` is `[tokens][d]`;
/// scale and zero arrays are `[tokens][d/group]`; the zero is biased for 4-bit values
/// ([`biased_step`]).
pub fn encode_values(bits: u32, group: usize, dtype: ScaleDType, d: usize, tokens: usize, v: &[f32]) -> IntArrays {
    let row = d * bits as usize / 8;
    let groups = d / group;
    let sb = dtype.bytes();
    let mut out = IntArrays { codes: vec![0u8; tokens * row], scale: vec![0u8; tokens * groups * sb], zero: vec![0u8; tokens * groups * sb] };
    let mut codes = vec![0u8; d];
    for t in 0..tokens {
        for j in 0..groups {
            let xs = &v[t * d + j * group..t * d + (j + 1) * group];
            let (mn, mx) = min_max(xs.iter().copied());
            let step = biased_step(bits, value_bias(bits, dtype), mn, mx, dtype);
            let i = t * groups + j;
            store_scale(dtype, step.scale, &mut out.scale[i * sb..(i + 1) * sb]);
            store_scale(dtype, step.zero, &mut out.zero[i * sb..(i + 1) * sb]);
            let grid = code_grid(value_bias(bits, dtype), step);
            for (c, &x) in xs.iter().enumerate() {
                codes[j * group + c] = int_code(bits, x, grid);
            }
        }
        pack_codes(bits, &codes, &mut out.codes[t * row..(t + 1) * row]);
    }
    out
}

/// Inverse of [`encode_values`]: V̂ `[tokens][d]` in f64.
pub fn decode_values(bits: u32, group: usize, dtype: ScaleDType, d: usize, tokens: usize, a: IntView<'_>) -> Vec<f64> {
    let IntView { codes, scale, zero } = a;
    let row = d * bits as usize / 8;
    let groups = d / group;
    let mut v = Vec::with_capacity(tokens * d);
    for t in 0..tokens {
        let r = &codes[t * row..(t + 1) * row];
        for c in 0..d {
            let i = t * groups + c / group;
            let step = IntStep { scale: load_scale(dtype, scale, i), zero: load_scale(dtype, zero, i) };
            v.push(biased_dequant(value_bias(bits, dtype), unpack_code(bits, r, c), step));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_use_the_stored_grid() {
        // mn = 0.1 is not an fp16 value: the stored zero differs and codes follow it.
        let step = int_step(8, 0.1, 1.1, ScaleDType::Fp16);
        assert_eq!(step.zero, f16::from_f32(0.1).to_f32());
        assert_ne!(step.zero, 0.1);
        assert_eq!(int_code(8, step.zero, step), 0);
        let top = int_dequant(255, step) as f32;
        assert_eq!(int_code(8, top, step), 255);
    }

    #[test]
    fn constant_group_codes_zero() {
        let step = int_step(4, 2.5, 2.5, ScaleDType::Fp32);
        assert_eq!(step.scale, 0.0);
        assert_eq!(int_code(4, 2.5, step), 0);
        assert_eq!(int_dequant(0, step), 2.5);
        assert!(int_error_bound(4, 2.5, 2.5, step) < 1e-14);
    }

    #[test]
    fn rounds_half_up() {
        let step = IntStep { scale: 1.0, zero: 0.0 };
        assert_eq!(int_code(2, 0.5, step), 1);
        assert_eq!(int_code(2, 1.49, step), 1);
        assert_eq!(int_code(2, 2.5, step), 3);
        assert_eq!(int_code(2, 7.0, step), 3);
        assert_eq!(int_code(2, -3.0, step), 0);
    }

    #[test]
    fn key_layout_is_block_major() {
        // 2 blocks of 2 tokens, d = 8: block 1 channel 0 sees tokens 2 and 3 only.
        let d = 8;
        let mut k = vec![0f32; 4 * d];
        k[2 * d] = 10.0;
        k[3 * d] = 20.0;
        let a = encode_keys(8, 2, ScaleDType::Fp32, d, 4, &k);
        assert_eq!(load_scale(ScaleDType::Fp32, &a.zero, d), 10.0);
        assert_eq!(load_scale(ScaleDType::Fp32, &a.scale, d), 10.0 / 255.0);
        assert_eq!(load_scale(ScaleDType::Fp32, &a.scale, 0), 0.0);
        let back = decode_keys(8, 2, ScaleDType::Fp32, d, 4, a.view());
        assert_eq!(back[2 * d], 10.0);
        assert!((back[3 * d] - 20.0).abs() < 1e-5);
    }
}
