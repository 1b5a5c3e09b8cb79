//! Seed 002's per-channel key bit widths (the K half of TriZone zone A): the channels of a
//! head, in a per-(tier, kv head) *channel order* the controller sets (heaviest first), are
//! stored as consecutive uniform-bit segments (fp16, then int8, int4, int2 codes, each with a
//! per-channel scale and zero per block of `block` tokens) and the channels after the last
//! segment are dropped. Segment sizes are shares of head_dim in eighths, so every segment is
//! whole 8-channel chunks at every head dim ≥ 64. Arrays per segment: [`mixed_arrays`]; side
//! table `channel_order`. C++: `MixedKey` in `codecs/mixed.cuh`; f64 reference in
//! [`reference`].

use std::fmt;

#[cfg(feature = "reference")]
use super::RefError;
use super::{ArraySpec, Codec, ParseCtx, Registration, Side, SideElem, SideInit, SideTable};
use crate::error::SpecError;
use crate::scheme::{KeyScheme, ScaleDType};

#[cfg(feature = "reference")]
pub mod reference;

pub const REGISTRATION: Registration = Registration {
    names: &["mixed"],
    fields: &["channels", "block", "scale_dtype"],
    key: Some(parse_key),
    value: None,
    examples: &[(r#"{ scheme = "mixed", channels = { 16 = 0.125, 8 = 0.25, 4 = 0.25, 2 = 0.125 }, block = 64 }"#, r#"{ scheme = "int", bits = 4, group = 32 }"#)],
};

/// One uniform-bit run of channels of a mixed key: `eighths`/8 of head_dim stored at `bits`
/// bits (16: fp16, 8/4/2: integer codes).
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

/// Array names of one segment of a mixed key: codes (fp16 keys at 16 bits), scale, zero.
pub fn mixed_arrays(bits: u32) -> [&'static str; 3] {
    match bits {
        16 => ["k16", "", ""],
        8 => ["k8_codes", "k8_scale", "k8_zero"],
        4 => ["k4_codes", "k4_scale", "k4_zero"],
        2 => ["k2_codes", "k2_scale", "k2_zero"],
        b => unreachable!("mixed keys have no {b}-bit segment (the spec validates bits)"),
    }
}

/// Why a channel order is not one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OrderError {
    #[error("channel order has {found} entries, expected {expected} (one stored position per channel)")]
    Length { found: usize, expected: usize },
    #[error("channel order is not a permutation of 0..{d}: position {position} holds {channel}")]
    NotPermutation { d: usize, position: usize, channel: usize },
}

/// Checks that `order` is a permutation of `0..d` (the mixed codec's `channel_order` side
/// table of one kv head, stored position → natural channel).
pub fn check_order(order: &[u16], d: usize) -> Result<(), OrderError> {
    if order.len() != d {
        return Err(OrderError::Length { found: order.len(), expected: d });
    }
    let mut seen = vec![false; d];
    for (j, &c) in order.iter().enumerate() {
        let c = c as usize;
        if c >= d || seen[c] {
            return Err(OrderError::NotPermutation { d, position: j, channel: c });
        }
        seen[c] = true;
    }
    Ok(())
}

/// The identity order of `d` channels.
pub fn identity_order(d: usize) -> Vec<u16> {
    (0..d as u16).collect()
}

/// Rows `[tokens][d]` in natural channel order → stored order (`out[t][j] = x[t][order[j]]`).
pub fn to_stored<T: Copy>(x: &[T], d: usize, order: &[u16]) -> Vec<T> {
    x.chunks(d).flat_map(|row| order.iter().map(move |&c| row[c as usize])).collect()
}

/// Rows in stored order → natural order (`out[t][order[j]] = x[t][j]`).
pub fn to_natural(x: &[f64], d: usize, order: &[u16]) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    for (t, row) in x.chunks(d).enumerate() {
        for (j, &c) in order.iter().enumerate() {
            out[t * d + c as usize] = row[j];
        }
    }
    out
}

/// Mixed keys.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MixedKey<'a> {
    pub segments: &'a [ChannelSegment],
    pub block: usize,
    pub scale: ScaleDType,
}

/// `channels = { 16 = 0.125, 8 = 0.25, 4 = 0.25 }` (share of head_dim per width, in eighths;
/// the rest of the channels is dropped).
fn parse_key(ctx: &ParseCtx<'_>) -> Result<KeyScheme, SpecError> {
    ctx.only(&["channels", "block", "scale_dtype"])?;
    let ch = ctx.need(ctx.float_table("channels")?, "channels", "share of head_dim per bit width, e.g. { 8 = 0.25, 4 = 0.5 }")?;
    let mut segments = Vec::new();
    for (k, share) in ch.get_ref() {
        let bits = match k.as_str() {
            "16" => 16,
            "8" => 8,
            "4" => 4,
            "2" => 2,
            o => return ctx.err(share.span(), "channels", format!("bit width `{o}` is not supported for mixed keys; valid: 16, 8, 4, 2 (channels not listed are dropped)")),
        };
        let x = *share.get_ref() * 8.0;
        if !(x > 0.0 && x <= 8.0 && (x - x.round()).abs() < 1e-9) {
            return ctx.err(
                share.span(),
                "channels",
                format!("share {} of {bits}-bit channels must be a positive multiple of 1/8 of head_dim (0.125, 0.25, ..., 1), so that every segment is whole 8-channel chunks", share.get_ref()),
            );
        }
        segments.push(ChannelSegment { bits, eighths: x.round() as u32 });
    }
    segments.sort_by_key(|s| std::cmp::Reverse(s.bits));
    let total: u32 = segments.iter().map(|s| s.eighths).sum();
    if segments.is_empty() || total > 8 {
        return ctx.err(ch.span(), "channels", format!("channel shares add up to {}/8 of head_dim; they must be between 1/8 and 1 (the rest is dropped)", total));
    }
    // Eighths of head_dim are whole 8-channel chunks because every supported head_dim
    // (64, 128, 256) is a multiple of 64.
    debug_assert!(ctx.head_dims.iter().all(|d| d % 64 == 0), "head_dims {:?}", ctx.head_dims);
    let block = ctx.block()?;
    Ok(KeyScheme::Mixed { segments, block, scale: ctx.scale()? })
}

impl fmt::Display for MixedKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let segs: Vec<String> = self.segments.iter().map(|s| format!("{}/8 at {} bits", s.eighths, s.bits)).collect();
        let kept: u32 = self.segments.iter().map(|s| s.eighths).sum();
        let dropped = if kept < 8 { format!(", {}/8 dropped", 8 - kept) } else { String::new() };
        write!(f, "mixed per-channel [{}{dropped}] block {} ({} scales)", segs.join(", "), self.block, self.scale.name())
    }
}

impl Codec for MixedKey<'_> {
    fn scheme(&self) -> &'static str {
        "mixed"
    }
    fn side(&self) -> Side {
        Side::Key
    }
    fn code(&self, _d: usize) -> String {
        let segs: Vec<String> = self.segments.iter().map(|s| format!("{}x{}", s.bits, s.eighths)).collect();
        format!("mix{}c{}f{}", segs.join("_"), self.block, self.scale.bytes() * 8)
    }
    fn arrays(&self, d: usize, tokens: usize) -> Vec<ArraySpec> {
        let mut out = Vec::new();
        for s in self.segments {
            let n = s.channels(d);
            let [codes, sc, zero] = mixed_arrays(s.bits);
            out.push(ArraySpec { name: codes, rows: tokens, row_bytes: n * s.bits as usize / 8 });
            if s.bits != 16 {
                out.push(ArraySpec { name: sc, rows: tokens / self.block, row_bytes: n * self.scale.bytes() });
                out.push(ArraySpec { name: zero, rows: tokens / self.block, row_bytes: n * self.scale.bytes() });
            }
        }
        out
    }
    fn page_bytes(&self, d: usize, tokens: usize) -> usize {
        self.segments
            .iter()
            .map(|s| {
                let n = s.channels(d);
                let meta = if s.bits == 16 { 0 } else { 2 * n * self.scale.bytes() * (tokens / self.block) };
                tokens * n * s.bits as usize / 8 + meta
            })
            .sum()
    }
    fn cpp_type(&self, d: usize, p: usize, o: &dyn Fn(&str) -> usize) -> String {
        // Channels, then array offsets, of the 16/8/4/2-bit segments; an absent segment has 0
        // channels and offsets 0.
        let mut n = Vec::new();
        let mut offs = Vec::new();
        for bits in [16, 8, 4, 2] {
            n.push(self.segments.iter().find(|g| g.bits == bits).map_or(0, |g| g.channels(d)).to_string());
            let [codes, scale_arr, zero] = mixed_arrays(bits);
            offs.push(o(codes).to_string());
            if bits != 16 {
                offs.extend([o(scale_arr).to_string(), o(zero).to_string()]);
            }
        }
        format!("MixedKey<{}, {}, {d}, {p}, {}, {}>", self.block, self.scale.cuda(), n.join(", "), offs.join(", "))
    }
    /// Each segment's share of the channels at its width; dropped channels lose everything
    /// (uniform channel energy: the proxy cannot see the channel order's weighting).
    fn nmse(&self) -> f64 {
        mixed_shares(self.segments)
            .into_iter()
            .map(|(bits, share)| {
                share
                    * match bits {
                        16 => super::dense::dense_nmse(crate::DType::Fp16),
                        0 => 1.0,
                        b => super::int::int_nmse(b),
                    }
            })
            .sum()
    }
    fn bit_widths(&self) -> Option<Vec<(u32, f64)>> {
        Some(mixed_shares(self.segments))
    }
    fn side_tables(&self, d: usize) -> Vec<SideTable> {
        // The stored→natural order, then its inverse ([2][D]).
        vec![SideTable { name: "channel_order", elem: SideElem::U16, len: 2 * d, init: SideInit::Optional }]
    }
    fn transcode_scratch(&self, d: usize, p: usize, split: usize) -> usize {
        // Min and max per channel per block of the slice's channels.
        2 * (p / self.block) * (d / split) * 4
    }
    fn slices_channels(&self) -> bool {
        true
    }
    #[cfg(feature = "reference")]
    fn check(&self, d: usize, tokens: usize, _aux: &[f32]) -> Result<(), RefError> {
        if self.block == 0 || !tokens.is_multiple_of(self.block) {
            return Err(RefError::Geometry(format!("mixed keys code whole blocks of {} tokens; {tokens} tokens is not a multiple", self.block)));
        }
        let segments = self.segments;
        if !d.is_multiple_of(64) || segments.iter().map(|s| s.eighths).sum::<u32>() > 8 || segments.iter().any(|s| !matches!(s.bits, 16 | 8 | 4 | 2)) {
            return Err(RefError::Geometry(format!("mixed keys need head_dim a multiple of 64 and segments of 16/8/4/2 bits within head_dim, not {d} and {segments:?}")));
        }
        Ok(())
    }
    #[cfg(feature = "reference")]
    fn encode(&self, d: usize, tokens: usize, x: &[f32], _aux: &[f32], put: &mut dyn FnMut(&str, &[u8])) {
        reference::encode_keys(self.segments, self.block, self.scale, d, tokens, x, put)
    }
    #[cfg(feature = "reference")]
    fn decode<'a>(&self, d: usize, tokens: usize, get: &dyn Fn(&str) -> &'a [u8], _aux: &[f32]) -> Vec<f64> {
        reference::decode_keys(self.segments, self.block, self.scale, d, tokens, get)
    }
}
