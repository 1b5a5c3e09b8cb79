//! The two tiers of one kv head (seed 004 §2.3, §3.1) and how tokens enter them.
//!
//! * **Tier 1** ([`QuantBlock`]): every full block of `B` tokens as per-channel integer keys
//!   (one fp32 scale/zero per channel per block) and per-token-group integer values, with the
//!   encode-time annotations η_b = max_t ‖V_t − V̂_t‖₂ and ν_b = max_t ‖V_t‖₂ and a CRC-32 over
//!   all of it. The trailing partial block ([`CertifiedHead::partial_k`]) stays fp16 until `B`
//!   tokens have arrived and is then quantised atomically from those tokens alone (P1).
//! * **Tier 2** ([`Tier2`]): the fp16 originals of every full block, the truth the certificate
//!   is measured against and the data of promotion and of the exact fallback (P4).
//!
//! Everything is public plain data so that a test can corrupt exactly one field.

use half::f16;
use kvforge_spec::{KeyScheme, ScaleDType, Tier, ValueScheme};

use crate::bits::{code_row_bytes, unpack_code, unpack_key_code};
use crate::error::{CertError, RefError};
use crate::quant::{self, load_scale, IntArrays, IntStep};

/// The certified tier's coding: keys per channel per block of `block` tokens with fp32
/// scale/zero, values per token per group of `value_group` channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CertFormat {
    pub key_bits: u32,
    /// B: tokens per block, the unit of scoring, promotion and page-in.
    pub block: usize,
    pub value_bits: u32,
    pub value_group: usize,
    pub value_scale: ScaleDType,
}

impl CertFormat {
    /// Seed 004 §2.3 / §5.1 (`specs/certified.toml`, tier `q8k4v`): int8 K, B = 16, fp32
    /// scale/zero; int4 V, groups of 16, fp16 scale/zero.
    pub const Q8K4V: CertFormat = CertFormat { key_bits: 8, block: 16, value_bits: 4, value_group: 16, value_scale: ScaleDType::Fp16 };

    /// The format of an integer tier of a spec. Keys must have fp32 scales: the key error
    /// bound ([`crate::certified::key_channel_error_bound`]) needs the stored zero to equal
    /// the block minimum exactly, which fp16 rounding breaks.
    pub fn from_tier(tier: &Tier) -> Result<CertFormat, CertError> {
        let (key_bits, block) = match tier.key {
            KeyScheme::Int { bits, block, scale: ScaleDType::Fp32 } => (bits, block),
            KeyScheme::Int { scale: ScaleDType::Fp16, .. } => return Err(CertError::Format(format!("tier `{}`: key scales must be fp32 (an fp16 zero is not the block minimum)", tier.name))),
            _ => return Err(CertError::Format(format!("tier `{}`: keys must be per-channel integer codes", tier.name))),
        };
        let (value_bits, value_group, value_scale) = match tier.value {
            ValueScheme::Int { bits, group, scale } => (bits, group, scale),
            _ => return Err(CertError::Format(format!("tier `{}`: values must be integer codes", tier.name))),
        };
        Ok(CertFormat { key_bits, block, value_bits, value_group, value_scale })
    }

    fn check_d(&self, d: usize) -> Result<(), CertError> {
        if d == 0 || d % self.value_group != 0 || d * self.value_bits as usize % 8 != 0 || d * self.key_bits as usize % 8 != 0 {
            return Err(CertError::Format(format!("head_dim {d} is not a positive multiple of the value group {} and of whole code bytes", self.value_group)));
        }
        Ok(())
    }
}

/// One full block in tier 1, exactly as the GPU would hold it.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantBlock {
    /// Codes `[B][d]` (packed), scale and zero `[d]` fp32 little endian.
    pub key: IntArrays,
    /// Codes `[B][d]` (packed), scale and zero `[B][d / group]` in the value scale dtype.
    pub value: IntArrays,
    /// η_b ≥ max_t ‖V_t − V̂_t‖₂ (f64 value rounded up to f32, so still an upper bound).
    pub eta: f32,
    /// ν_b ≥ max_t ‖V_t‖₂ (rounded up likewise); V_max of the key term is built from these.
    pub nu: f32,
    /// [`block_checksum`] at encode time.
    pub checksum: u32,
}

/// The fp16 originals of the full blocks, `[blocks · B][d]` each, in token order.
#[derive(Clone, Debug, PartialEq)]
pub struct Tier2 {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// `resident[b]`: block b's originals are available (pinned host memory on the GPU).
    /// A block that is not resident makes every step fail with [`CertError::MissingOriginal`].
    pub resident: Vec<bool>,
}

/// One kv head's certified cache: tier 1 (full blocks + fp16 partial block) and tier 2.
#[derive(Clone, Debug, PartialEq)]
pub struct CertifiedHead {
    pub format: CertFormat,
    pub d: usize,
    pub blocks: Vec<QuantBlock>,
    /// The trailing partial block, fp16 values as f32, `[len % B][d]`.
    pub partial_k: Vec<f32>,
    pub partial_v: Vec<f32>,
    pub tier2: Tier2,
}

impl CertifiedHead {
    /// An empty cache of head dimension `d`.
    pub fn new(format: CertFormat, d: usize) -> Result<CertifiedHead, CertError> {
        format.check_d(d)?;
        if format.block == 0 {
            return Err(CertError::Format("block of 0 tokens".into()));
        }
        Ok(CertifiedHead { format, d, blocks: Vec::new(), partial_k: Vec::new(), partial_v: Vec::new(), tier2: Tier2 { k: Vec::new(), v: Vec::new(), resident: Vec::new() } })
    }

    /// A cache holding `k`, `v` (`[n][d]`, any finite f32; rounded to fp16 as the cache
    /// stores them), appended token by token.
    pub fn encode(format: CertFormat, d: usize, k: &[f32], v: &[f32]) -> Result<CertifiedHead, CertError> {
        let mut head = CertifiedHead::new(format, d)?;
        if k.len() % d != 0 || v.len() != k.len() {
            return Err(RefError::Shape { what: "k/v", found: v.len(), expected: k.len(), why: format!("k and v must both be [n][{d}]") }.into());
        }
        for (kt, vt) in k.chunks_exact(d).zip(v.chunks_exact(d)) {
            head.append(kt, vt)?;
        }
        Ok(head)
    }

    /// Appends one token (`[d]` each). Values are rounded to fp16; when the partial block
    /// reaches `B` tokens it is quantised atomically and its originals move to tier 2 (P1).
    pub fn append(&mut self, k: &[f32], v: &[f32]) -> Result<(), CertError> {
        let d = self.d;
        for (what, x) in [("k", k), ("v", v)] {
            if x.len() != d {
                return Err(RefError::Shape { what, found: x.len(), expected: d, why: "one token row".into() }.into());
            }
        }
        let (nk, nv) = (self.partial_k.len(), self.partial_v.len());
        self.partial_k.extend(k.iter().map(|&x| f16::from_f32(x).to_f32()));
        self.partial_v.extend(v.iter().map(|&x| f16::from_f32(x).to_f32()));
        let bad = [("k", k, &self.partial_k[nk..]), ("v", v, &self.partial_v[nv..])]
            .into_iter()
            .find_map(|(what, x, rounded)| rounded.iter().position(|r| !r.is_finite()).map(|index| RefError::NonFinite { what, index, value: x[index] }));
        if let Some(e) = bad {
            // fp16 overflow (|x| > 65504) or a non-finite input: the token is not appended.
            self.partial_k.truncate(nk);
            self.partial_v.truncate(nv);
            return Err(e.into());
        }
        if self.partial_k.len() == self.format.block * d {
            let (pk, pv) = (std::mem::take(&mut self.partial_k), std::mem::take(&mut self.partial_v));
            self.blocks.push(seal_block(&self.format, d, &pk, &pv));
            self.tier2.k.extend(pk);
            self.tier2.v.extend(pv);
            self.tier2.resident.push(true);
        }
        Ok(())
    }

    /// Tokens held (full blocks and the partial block).
    pub fn len(&self) -> usize {
        self.blocks.len() * self.format.block + self.partial_len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn partial_len(&self) -> usize {
        self.partial_k.len() / self.d
    }

    /// The fp16 originals of block `b` (`[B][d]` keys, values), or [`CertError::MissingOriginal`].
    pub fn originals(&self, b: usize) -> Result<(&[f32], &[f32]), CertError> {
        if !self.tier2.resident.get(b).copied().unwrap_or(false) {
            return Err(CertError::MissingOriginal { block: b });
        }
        let n = self.format.block * self.d;
        Ok((&self.tier2.k[b * n..(b + 1) * n], &self.tier2.v[b * n..(b + 1) * n]))
    }

    /// K̂ of block `b`, `[B][d]` f64: [`crate::quant::decode_keys`]' values (code·σ + z in
    /// f64), with each channel's step loaded once.
    pub fn decoded_keys(&self, b: usize) -> Vec<f64> {
        let (f, d) = (&self.format, self.d);
        let key = &self.blocks[b].key;
        let steps: Vec<IntStep> = (0..d).map(|c| self.key_step(b, c)).collect();
        let row = code_row_bytes(d, f.key_bits);
        let mut k = Vec::with_capacity(f.block * d);
        for r in key.codes.chunks_exact(row) {
            k.extend(steps.iter().enumerate().map(|(c, &s)| quant::biased_dequant(quant::key_bias(f.key_bits, ScaleDType::Fp32), unpack_key_code(f.key_bits, r, c), s)));
        }
        k
    }

    /// V̂ of block `b`, `[B][d]` f64: [`crate::quant::decode_values`]' values, with each
    /// group's step loaded once.
    pub fn decoded_values(&self, b: usize) -> Vec<f64> {
        decode_values(&self.format, self.d, &self.blocks[b].value)
    }

    /// Stored scale and zero of channel `c` of block `b`'s keys.
    pub fn key_step(&self, b: usize, c: usize) -> IntStep {
        let key = &self.blocks[b].key;
        IntStep { scale: load_scale(ScaleDType::Fp32, &key.scale, c), zero: load_scale(ScaleDType::Fp32, &key.zero, c) }
    }

    /// All keys and values in token order as the exact path sees them: tier-2 originals of
    /// the full blocks, then the partial block. `[n][d]` f64 each.
    pub fn exact_kv(&self) -> Result<(Vec<f64>, Vec<f64>), CertError> {
        let mut k = Vec::with_capacity(self.len() * self.d);
        let mut v = Vec::with_capacity(self.len() * self.d);
        for b in 0..self.blocks.len() {
            let (kb, vb) = self.originals(b)?;
            k.extend(kb.iter().map(|&x| f64::from(x)));
            v.extend(vb.iter().map(|&x| f64::from(x)));
        }
        k.extend(self.partial_k.iter().map(|&x| f64::from(x)));
        v.extend(self.partial_v.iter().map(|&x| f64::from(x)));
        Ok((k, v))
    }
}

fn decode_values(f: &CertFormat, d: usize, value: &IntArrays) -> Vec<f64> {
    let (g, row) = (f.value_group, code_row_bytes(d, f.value_bits));
    let mut v = Vec::with_capacity(f.block * d);
    for (t, r) in value.codes.chunks_exact(row).enumerate() {
        for j in 0..d / g {
            let i = t * (d / g) + j;
            let s = IntStep { scale: load_scale(f.value_scale, &value.scale, i), zero: load_scale(f.value_scale, &value.zero, i) };
            v.extend((j * g..(j + 1) * g).map(|c| quant::biased_dequant(quant::value_bias(f.value_bits, f.value_scale), unpack_code(f.value_bits, r, c), s)));
        }
    }
    v
}

/// Quantises one full block and annotates it (η, ν, checksum).
fn seal_block(f: &CertFormat, d: usize, k: &[f32], v: &[f32]) -> QuantBlock {
    let key = quant::encode_keys(f.key_bits, f.block, ScaleDType::Fp32, d, f.block, k);
    let value = quant::encode_values(f.value_bits, f.value_group, f.value_scale, d, f.block, v);
    let vhat = decode_values(f, d, &value);
    let (mut eta, mut nu) = (0f64, 0f64);
    for (vt, ht) in v.chunks_exact(d).zip(vhat.chunks_exact(d)) {
        eta = eta.max(norm_upper(vt.iter().zip(ht).map(|(&x, &y)| f64::from(x) - y)));
        nu = nu.max(norm_upper(vt.iter().map(|&x| f64::from(x))));
    }
    let mut block = QuantBlock { key, value, eta: f32_up(eta), nu: f32_up(nu), checksum: 0 };
    block.checksum = block_checksum(&block);
    block
}

/// An upper bound of ‖x‖₂ for x given in f64: the f64 sum of squares and square root are
/// within (n + 2)·2⁻⁵³ relative of the exact norm (each element difference in the caller adds
/// one more rounding), so the result is inflated by (n + 4)·2⁻⁵³ relative.
pub(crate) fn norm_upper(x: impl Iterator<Item = f64>) -> f64 {
    let (mut s, mut n) = (0f64, 0usize);
    for e in x {
        s += e * e;
        n += 1;
    }
    s.sqrt() * (1.0 + (n as f64 + 4.0) * f64::EPSILON)
}

/// The least f32 ≥ `x` (x ≥ 0, finite): an annotation stored as f32 stays an upper bound.
pub fn f32_up(x: f64) -> f32 {
    let y = x as f32;
    if f64::from(y) >= x {
        y
    } else {
        f32::from_bits(y.to_bits() + 1)
    }
}

/// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, init and final xor 0xFFFFFFFF) over a
/// block's bytes in this order: key codes, key scales, key zeros, value codes, value scales,
/// value zeros, η (f32 LE), ν (f32 LE).
///
/// Why CRC-32: it detects **every** error burst of at most 32 bits. A corrupted scale or a
/// stale zero (one 4-byte fp32 field), a bad value scale (2 bytes), a flipped bit anywhere are
/// all such bursts, so those faults are detected with certainty, not with probability; wider
/// corruption escapes it with probability 2⁻³². What it cannot see: data that was already
/// wrong when the checksum was computed (an encoder bug, corrupt tier-2 originals) — the
/// score check on promoted and explored blocks is the defence there (see `ladder`).
pub fn block_checksum(b: &QuantBlock) -> u32 {
    let mut crc = !0u32;
    for part in [&b.key.codes[..], &b.key.scale, &b.key.zero, &b.value.codes, &b.value.scale, &b.value.zero, &b.eta.to_le_bytes(), &b.nu.to_le_bytes()] {
        crc = crc32_update(crc, part);
    }
    !crc
}

/// CRC-32 register update over `bytes`, four bytes per step ("slicing by 4"; the same
/// function as the byte-at-a-time loop `crc = T0[(crc ^ byte) & 0xFF] ^ (crc >> 8)`).
fn crc32_update(mut crc: u32, bytes: &[u8]) -> u32 {
    let mut words = bytes.chunks_exact(4);
    for w in &mut words {
        let x = crc ^ u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        crc = CRC_TABLES[3][(x & 0xFF) as usize] ^ CRC_TABLES[2][((x >> 8) & 0xFF) as usize] ^ CRC_TABLES[1][((x >> 16) & 0xFF) as usize] ^ CRC_TABLES[0][(x >> 24) as usize];
    }
    for &byte in words.remainder() {
        crc = CRC_TABLES[0][((crc ^ u32::from(byte)) & 0xFF) as usize] ^ (crc >> 8);
    }
    crc
}

/// `CRC_TABLES[0]`: the byte-at-a-time table of the reflected polynomial; `CRC_TABLES[k][i]`:
/// the register after byte i followed by k zero bytes.
const CRC_TABLES: [[u32; 256]; 4] = {
    let mut t = [[0u32; 256]; 4];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 == 1 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut i = 0;
    while i < 256 {
        let mut k = 1;
        while k < 4 {
            t[k][i] = t[0][(t[k - 1][i] & 0xFF) as usize] ^ (t[k - 1][i] >> 8);
            k += 1;
        }
        i += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_check_value() {
        // The standard check value of CRC-32/ISO-HDLC: "123456789" → 0xCBF43926.
        assert_eq!(!crc32_update(!0, b"123456789"), 0xCBF4_3926);
        // Slicing by 4 equals the bitwise definition on every split.
        let bytes: Vec<u8> = (0..203u32).map(|i| (i * 37 % 251) as u8).collect();
        let mut bitwise = !0u32;
        for &byte in &bytes {
            bitwise ^= u32::from(byte);
            for _ in 0..8 {
                bitwise = (bitwise >> 1) ^ (0xEDB8_8320 & (bitwise & 1).wrapping_neg());
            }
        }
        assert_eq!(crc32_update(!0, &bytes), bitwise);
        assert_eq!(crc32_update(crc32_update(!0, &bytes[..7]), &bytes[7..]), bitwise);
    }

    #[test]
    fn f32_up_is_an_upper_bound() {
        for x in [0.0, 1e-30, 0.1, 1.0 / 3.0, 7.0, 1e20] {
            let y = f32_up(x);
            assert!(f64::from(y) >= x);
            assert!(f64::from(y) - x <= x * 2f64.powi(-23) + 1e-45);
        }
    }

    /// The fast decoders are the crate's decoders.
    #[test]
    fn decoders_match_quant() {
        let f = CertFormat::Q8K4V;
        let d = 64;
        let x: Vec<f32> = (0..16 * d).map(|i| ((i * 7919 % 1013) as f32 / 101.3 - 5.0) * if i % 64 == 3 { 40.0 } else { 1.0 }).collect();
        let h = CertifiedHead::encode(f, d, &x, &x).unwrap();
        let b = &h.blocks[0];
        assert_eq!(h.decoded_keys(0), quant::decode_keys(8, 16, ScaleDType::Fp32, d, 16, b.key.view()));
        assert_eq!(h.decoded_values(0), quant::decode_values(4, 16, ScaleDType::Fp16, d, 16, b.value.view()));
    }

    #[test]
    fn partial_block_stays_fp16_until_full() {
        let f = CertFormat::Q8K4V;
        let d = 32;
        let mut h = CertifiedHead::new(f, d).unwrap();
        let row: Vec<f32> = (0..d).map(|c| c as f32 * 0.1).collect();
        for t in 0..15 {
            h.append(&row, &row).unwrap();
            assert_eq!(h.blocks.len(), 0);
            assert_eq!(h.partial_len(), t + 1);
        }
        h.append(&row, &row).unwrap();
        assert_eq!((h.blocks.len(), h.partial_len(), h.len()), (1, 0, 16));
        assert_eq!(h.tier2.k.len(), 16 * d);
        assert_eq!(h.blocks[0].checksum, block_checksum(&h.blocks[0]));
    }
}
