//! Coding schemes for keys and values and their exact byte costs.

use std::fmt;

/// Element type of queries, outputs and dense (identity-coded) K/V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Fp16,
    Bf16,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::Fp16 => "fp16",
            DType::Bf16 => "bf16",
        }
    }
    /// The CUDA type of one element.
    pub fn cuda(self) -> &'static str {
        match self {
            DType::Fp16 => "__half",
            DType::Bf16 => "__nv_bfloat16",
        }
    }
}

/// Storage type of quantisation scales and zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleDType {
    Fp16,
    Fp32,
}

impl ScaleDType {
    pub fn bytes(self) -> usize {
        match self {
            ScaleDType::Fp16 => 2,
            ScaleDType::Fp32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ScaleDType::Fp16 => "fp16",
            ScaleDType::Fp32 => "fp32",
        }
    }
}

/// How a key vector is stored.
#[derive(Clone, Debug, PartialEq)]
pub enum KeyScheme {
    /// Identity in the given element type.
    Dense(DType),
    /// Asymmetric integer codes with one scale and zero per channel per block of `block`
    /// tokens (KIVI, seed 004 §2.3): x̂ = code · scale_c + zero_c. Per-channel scales fold
    /// into the query, so decode costs one FMA per element.
    Int { bits: u32, block: usize, scale: ScaleDType },
    /// Seed 000 App. B: per group of `group` channels an 8-bit radius (scaled by a
    /// per-(layer, head, group) scale held outside the pages) and the index of the nearest
    /// unit codeword among `2^angle_bits`. Decode never rebuilds keys: logits come from a
    /// per-query lookup table LUT[j][i] = ⟨q_j, c_i⟩ (unnormalised q_j).
    Spherical { group: usize, angle_bits: u32, codebook: super::Codebook },
    /// Seed 002's per-channel key bit widths (the K half of TriZone zone A): the channels of
    /// a head, in a per-(tier, kv head) *channel order* the controller sets (heaviest first),
    /// are stored as consecutive uniform-bit segments — fp16, then int8, int4, int2 codes, each
    /// with per-channel scale and zero per block of `block` tokens — and the channels after the
    /// last segment are dropped (b_c = 0: they contribute nothing to q·k). One dequantisation
    /// path per segment, never per element. Segment sizes are shares of head_dim in eighths so
    /// every segment is whole 8-channel chunks at every head dim ≥ 64.
    Mixed { segments: Vec<ChannelSegment>, block: usize, scale: ScaleDType },
    /// Evicted: no bytes, never attended.
    Drop,
}

/// One uniform-bit run of channels of a [`KeyScheme::Mixed`] key: `eighths`/8 of head_dim
/// stored at `bits` bits (16: fp16, 8/4/2: integer codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChannelSegment {
    pub bits: u32,
    pub eighths: u32,
}

impl ChannelSegment {
    /// Channels of this segment at head dim `d`.
    pub fn channels(self, d: usize) -> usize {
        self.eighths as usize * d / 8
    }
}

/// Share of head_dim stored at each width of a mixed key, `(bits, share)`, with the dropped
/// channels as `(0, share)` when there are any: what a per-width table averages over.
pub fn mixed_shares(segments: &[ChannelSegment]) -> Vec<(u32, f64)> {
    let kept: u32 = segments.iter().map(|s| s.eighths).sum();
    let mut out: Vec<(u32, f64)> = segments.iter().map(|s| (s.bits, f64::from(s.eighths) / 8.0)).collect();
    if kept < 8 {
        out.push((0, f64::from(8 - kept) / 8.0));
    }
    out
}

/// The width of every stored position of a mixed key at head dim `d` (0: dropped).
pub fn mixed_widths(segments: &[ChannelSegment], d: usize) -> Vec<u32> {
    let mut widths = vec![0u32; d];
    for (bits, c0, n) in mixed_channels(segments, d) {
        widths[c0..c0 + n].fill(bits);
    }
    widths
}

/// The segments of a mixed key at head dim `d`: (bits, first stored channel, channels), in
/// storage order.
pub fn mixed_channels(segments: &[ChannelSegment], d: usize) -> Vec<(u32, usize, usize)> {
    let mut at = 0;
    segments
        .iter()
        .map(|s| {
            let n = s.channels(d);
            at += n;
            (s.bits, at - n, n)
        })
        .collect()
}

/// How a value vector is stored.
#[derive(Clone, Debug, PartialEq)]
pub enum ValueScheme {
    Dense(DType),
    /// Asymmetric integer codes with one scale and zero per token per group of `group`
    /// channels.
    Int { bits: u32, group: usize, scale: ScaleDType },
    Drop,
}

/// Radius bits of the spherical scheme (seed 000 App. B fixes b_r = 8).
pub const RADIUS_BITS: u32 = 8;

impl KeyScheme {
    /// Bytes one page segment of `tokens` tokens needs for keys at head dim `d`.
    pub fn page_bytes(&self, d: usize, tokens: usize) -> usize {
        match self {
            KeyScheme::Dense(_) => 2 * d * tokens,
            KeyScheme::Int { bits, block, scale } => {
                d * tokens * *bits as usize / 8 + 2 * d * scale.bytes() * (tokens / block)
            }
            KeyScheme::Spherical { group, angle_bits, .. } => {
                let g = d / group;
                tokens * (g * RADIUS_BITS as usize / 8 + spherical_index_bytes(g, *angle_bits))
            }
            KeyScheme::Mixed { segments, block, scale } => segments
                .iter()
                .map(|s| {
                    let n = s.channels(d);
                    let meta = if s.bits == 16 { 0 } else { 2 * n * scale.bytes() * (tokens / block) };
                    tokens * n * s.bits as usize / 8 + meta
                })
                .sum(),
            KeyScheme::Drop => 0,
        }
    }
    pub fn is_drop(&self) -> bool {
        matches!(self, KeyScheme::Drop)
    }
}

/// Bytes per token of the bit-packed angle indices of `groups` groups (seed 000 packs them
/// with no per-token alignment beyond the byte).
pub fn spherical_index_bytes(groups: usize, angle_bits: u32) -> usize {
    (groups * angle_bits as usize).div_ceil(8)
}

impl ValueScheme {
    pub fn page_bytes(&self, d: usize, tokens: usize) -> usize {
        match self {
            ValueScheme::Dense(_) => 2 * d * tokens,
            ValueScheme::Int { bits, group, scale } => {
                tokens * (d * *bits as usize / 8 + 2 * (d / group) * scale.bytes())
            }
            ValueScheme::Drop => 0,
        }
    }
}

impl fmt::Display for KeyScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyScheme::Dense(t) => write!(f, "{}", t.name()),
            KeyScheme::Int { bits, block, scale } => {
                write!(f, "int{bits} per-channel block {block} ({} scales)", scale.name())
            }
            KeyScheme::Spherical { group, angle_bits, .. } => {
                write!(f, "spherical g{group} b{angle_bits}")
            }
            KeyScheme::Mixed { segments, block, scale } => {
                let segs: Vec<String> = segments.iter().map(|s| format!("{}/8 at {} bits", s.eighths, s.bits)).collect();
                let kept: u32 = segments.iter().map(|s| s.eighths).sum();
                write!(f, "mixed per-channel [{}{}] block {block} ({} scales)", segs.join(", "), if kept < 8 { format!(", {}/8 dropped", 8 - kept) } else { String::new() }, scale.name())
            }
            KeyScheme::Drop => write!(f, "drop"),
        }
    }
}

impl fmt::Display for ValueScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueScheme::Dense(t) => write!(f, "{}", t.name()),
            ValueScheme::Int { bits, group, scale } => {
                write!(f, "int{bits} per-token group {group} ({} scales)", scale.name())
            }
            ValueScheme::Drop => write!(f, "drop"),
        }
    }
}
