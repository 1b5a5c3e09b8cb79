//! Bytes of one coded chunk of `n` tokens of one side (keys or values), before entropy coding.
//! For every group of the allocation, in order:
//!
//! | bytes | what |
//! |---|---|
//! | `4·n` | per token: fp16 shift (`lo`), fp16 scale, little-endian |
//! | `ceil(n·len·bits / 8)` | codes, token-major then coordinate, LSB-first bit stream, zero-padded to a byte |
//!
//! Grouping the side information and the codes of a group into planes keeps similar bytes
//! together for DEFLATE / zstd. The size depends only on `n` and the allocation
//! ([`raw_len`]), so a reader checks it before decoding.

use half::f16;

use crate::alloc::Allocation;
use crate::quant::{code_with, fit_group_with, GroupScale};

/// Bytes of a chunk of `n` tokens coded with `alloc`.
pub fn raw_len(n: usize, alloc: &Allocation) -> usize {
    alloc.groups.iter().map(|g| 4 * n + (n * g.len as usize * g.bits as usize).div_ceil(8)).sum()
}

/// Writes codes into a group's LSB-first bit stream, `out`, which holds exactly
/// `ceil(codes · bits / 8)` bytes ([`codes`] reads it back).
pub struct BitWriter<'a> {
    out: &'a mut [u8],
    at: usize,
    acc: u64,
    fill: u32,
}

impl<'a> BitWriter<'a> {
    pub fn new(out: &'a mut [u8]) -> Self {
        Self { out, at: 0, acc: 0, fill: 0 }
    }

    pub fn put(&mut self, v: u32, bits: u32) {
        self.acc |= (v as u64) << self.fill;
        self.fill += bits;
        while self.fill >= 8 {
            self.out[self.at] = self.acc as u8;
            self.at += 1;
            self.acc >>= 8;
            self.fill -= 8;
        }
    }

    /// Writes the last, partly filled byte (zero-padded).
    pub fn flush(self) {
        if self.fill > 0 {
            self.out[self.at] = self.acc as u8;
        }
    }
}

/// The `bits`-bit codes of a group's LSB-first bit stream, in order (ends with the bytes).
pub fn codes(bytes: &[u8], bits: u32) -> Codes<'_> {
    Codes { bytes, bits, mask: (1u64 << bits) - 1, acc: 0, fill: 0, at: 0 }
}

/// [`codes`].
pub struct Codes<'a> {
    bytes: &'a [u8],
    bits: u32,
    mask: u64,
    acc: u64,
    fill: u32,
    at: usize,
}

impl Iterator for Codes<'_> {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        while self.fill < self.bits {
            self.acc |= (*self.bytes.get(self.at)? as u64) << self.fill;
            self.at += 1;
            self.fill += 8;
        }
        let c = (self.acc & self.mask) as u32;
        self.acc >>= self.bits;
        self.fill -= self.bits;
        Some(c)
    }
}

/// Codes `n` tokens of decorrelated coordinates (`d[t * comps + j]`) with `alloc`.
pub fn encode(d: &[f64], n: usize, comps: usize, alloc: &Allocation) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw_len(n, alloc));
    let mut scales = Vec::with_capacity(n);
    for g in &alloc.groups {
        let (s, e) = (g.start as usize, (g.start + g.len) as usize);
        scales.clear();
        for t in 0..n {
            let gs = fit_group_with(&d[t * comps + s..t * comps + e], g.bits, g.fit, alloc.step);
            out.extend_from_slice(&gs.lo.to_le_bytes());
            out.extend_from_slice(&gs.scale.to_le_bytes());
            scales.push(gs);
        }
        let at = out.len();
        out.resize(at + (n * g.len as usize * g.bits as usize).div_ceil(8), 0);
        let mut w = BitWriter::new(&mut out[at..]);
        for t in 0..n {
            for j in s..e {
                w.put(code_with(scales[t], d[t * comps + j], g.bits, g.fit, alloc.dead_zone), g.bits as u32);
            }
        }
        w.flush();
    }
    out
}

/// Decodes a chunk made by [`encode`] into `n × comps` coordinates (uncoded ones 0). The
/// caller has checked `bytes.len() == raw_len(n, alloc)`.
pub fn decode(bytes: &[u8], n: usize, comps: usize, alloc: &Allocation) -> Vec<f64> {
    debug_assert_eq!(bytes.len(), raw_len(n, alloc));
    let mut d = vec![0.0; n * comps];
    let mut pos = 0;
    for g in &alloc.groups {
        let (s, len, bits) = (g.start as usize, g.len as usize, g.bits as u32);
        let scales: Vec<GroupScale> = (0..n)
            .map(|t| {
                let b = &bytes[pos + 4 * t..pos + 4 * t + 4];
                GroupScale { lo: f16::from_le_bytes([b[0], b[1]]), scale: f16::from_le_bytes([b[2], b[3]]) }
            })
            .collect();
        pos += 4 * n;
        let mut cs = codes(&bytes[pos..], bits);
        for t in 0..n {
            for (j, c) in (0..len).zip(cs.by_ref()) {
                d[t * comps + s + j] = scales[t].value(c);
            }
        }
        pos += (n * len * bits as usize).div_ceil(8);
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::Group;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn decode_inverts_encode(n in 1usize..9, seed in 0u64..1000) {
            let comps = 40;
            let alloc = Allocation { budget_bits: 10_000, expected_error: 0.0, models: Vec::new(), step: 0.0, dead_zone: 0.0, groups: vec![
                Group::new(0, 1, 8), Group::new(1, 16, 3),
                Group::new(20, 16, 1), Group::new(36, 1, 13)] };
            let d: Vec<f64> = (0..n * comps).map(|k| (((k as u64 * 2654435761 + seed) % 1000) as f64 - 500.0) / 37.0).collect();
            let bytes = encode(&d, n, comps, &alloc);
            prop_assert_eq!(bytes.len(), raw_len(n, &alloc));
            let back = decode(&bytes, n, comps, &alloc);
            for t in 0..n {
                for g in &alloc.groups {
                    let s = g.start as usize..(g.start + g.len) as usize;
                    let gs = fit_group_with(&d[t * comps..][s.clone()], g.bits, g.fit, alloc.step);
                    for j in s {
                        prop_assert_eq!(back[t * comps + j], gs.value(gs.code(d[t * comps + j], g.bits)));
                    }
                }
                for j in [17, 18, 19, 37, 39] {
                    prop_assert_eq!(back[t * comps + j], 0.0);
                }
            }
        }
    }
}
