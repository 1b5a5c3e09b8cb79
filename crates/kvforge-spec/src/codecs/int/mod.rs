//! Asymmetric integer codes (KIVI, seed 004 §2.3): keys per channel with a scale and zero per
//! block of `block` tokens (they fold into the query, one FMA per element), values per token
//! with a scale and zero per group of `group` channels. Arrays `<k|v>_codes`, `_scale`,
//! `_zero`. C++: `IntKey` / `IntValue` in `codecs/int.cuh`; f64 reference in [`reference`].

use std::fmt;

use toml::Spanned;

#[cfg(feature = "reference")]
use super::RefError;
use super::{ArraySpec, Codec, ParseCtx, Registration, Side};
use crate::error::SpecError;
use crate::scheme::{KeyScheme, ScaleDType, ValueScheme};

#[cfg(feature = "reference")]
pub mod reference;

/// Code bias of per-token value codes: groups with a bias B store the *biased* zero
/// `z̃ = S(zero − B·scale)` and decode as `x̂ = (code + B)·scale + z̃`, exactly. B + code is what
/// one LOP3 (4 bits: a code at fp16 mantissa bits 4-7 with the exponent of 64) or one PRMT
/// (8 bits: a code byte beside the exponent byte of 1024) makes of a code, so the per-warp
/// decode dequantises a pair with that one instruction and one HFMA2, without an HSUB2
/// (`templates/include/kvforge/codecs/int.cuh`, `value_bias`). B = 64 for 4 bits, 1024 for 8 bits
/// with fp16 scales, 0 otherwise (2 bits, 8 bits with fp32 scales). Keys: [`key_bias`]. The effective zero `z̃ + B·scale` is within
/// half an ulp of `B·scale` of the group minimum (at most scale/2 for 8 bits, scale/32 for 4);
/// `B·scale` must stay below 65504 for fp16 scales (a group range below about 15000 at 4 bits,
/// 16000 at 8).
pub fn value_bias(bits: u32, dtype: ScaleDType) -> f32 {
    match (bits, dtype) {
        (4, _) => 64.0,
        (8, ScaleDType::Fp16) => 1024.0,
        _ => 0.0,
    }
}

/// Code bias of per-channel key codes: 64 for 4 bits, 0 otherwise (see [`value_bias`]; 8-bit
/// keys stay unbiased: biasing them too pushed a tracked multi-tier decode entry past its
/// register cap).
pub fn key_bias(bits: u32, _dtype: ScaleDType) -> f32 {
    if bits == 4 {
        64.0
    } else {
        0.0
    }
}

pub const REGISTRATION: Registration = Registration {
    names: &["int"],
    fields: &["bits", "block", "group", "scale_dtype", "granularity"],
    key: Some(parse_key),
    value: Some(parse_value),
    examples: &[
        (r#"{ scheme = "int", bits = 8, block = 16, scale_dtype = "fp32" }"#, r#"{ scheme = "int", bits = 4, group = 16 }"#),
        (r#"{ scheme = "int", bits = 2, block = 64 }"#, r#"{ scheme = "int", bits = 2, group = 32, scale_dtype = "fp32" }"#),
    ],
};

/// Integer keys: `bits`-bit codes per channel, a scale and zero per channel per `block` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntKey {
    pub bits: u32,
    pub block: usize,
    pub scale: ScaleDType,
}

/// Integer values: `bits`-bit codes per token, a scale and zero per token per `group` channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntValue {
    pub bits: u32,
    pub group: usize,
    pub scale: ScaleDType,
}

/// `bits`: 8, 4 or 2.
pub(crate) fn bits(ctx: &ParseCtx<'_>, v: &Spanned<i64>) -> Result<u32, SpecError> {
    match *v.get_ref() {
        b @ (2 | 4 | 8) => Ok(b as u32),
        b => ctx.err(v.span(), "bits", format!("bits {b} is not supported for `int`; valid: 8, 4, 2 (use `fp16` for 16 and `drop` for 0)")),
    }
}

fn parse_key(ctx: &ParseCtx<'_>) -> Result<KeyScheme, SpecError> {
    ctx.only(&["bits", "block", "scale_dtype", "granularity"])?;
    ctx.granularity("key", "channel (per-channel scales fold into the query)")?;
    let bits = bits(ctx, &ctx.need(ctx.int("bits")?, "bits", "8, 4 or 2")?)?;
    let block = ctx.block()?;
    Ok(KeyScheme::Int { bits, block, scale: ctx.scale()? })
}

fn parse_value(ctx: &ParseCtx<'_>) -> Result<ValueScheme, SpecError> {
    ctx.only(&["bits", "group", "scale_dtype", "granularity"])?;
    ctx.granularity("value", "token (per-token groups)")?;
    let bits = bits(ctx, &ctx.need(ctx.int("bits")?, "bits", "8, 4 or 2")?)?;
    let g = ctx.need(ctx.int("group")?, "group", "channels per scale group, dividing head_dim")?;
    let group = *g.get_ref();
    if group < 8 || group % 8 != 0 {
        return ctx.err(g.span(), "group", format!("group_size {group} is not a multiple of 8 channels; valid: {}", ctx.divisors(8)));
    }
    for &d in ctx.head_dims {
        if d as i64 % group != 0 {
            return ctx.err(g.span(), "group", format!("group_size {group} does not divide head_dim {d}; valid: {}", ctx.divisors(8)));
        }
    }
    Ok(ValueScheme::Int { bits, group: group as usize, scale: ctx.scale()? })
}

/// NMSE of an asymmetric `bits`-bit quantiser on Gaussian data (range ≈ 6σ).
pub fn int_nmse(bits: u32) -> f64 {
    let levels = ((1u64 << bits) - 1) as f64;
    3.0 / (levels * levels)
}

impl fmt::Display for IntKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "int{} per-channel block {} ({} scales)", self.bits, self.block, self.scale.name())
    }
}

impl fmt::Display for IntValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "int{} per-token group {} ({} scales)", self.bits, self.group, self.scale.name())
    }
}

#[cfg(feature = "reference")]
fn check_bits(bits: u32, side: &str) -> Result<(), RefError> {
    if matches!(bits, 2 | 4 | 8) {
        Ok(())
    } else {
        Err(RefError::Geometry(format!("int {side} are 8, 4 or 2 bits, not {bits}")))
    }
}

impl Codec for IntKey {
    fn scheme(&self) -> &'static str {
        "int"
    }
    fn side(&self) -> Side {
        Side::Key
    }
    fn code(&self, _d: usize) -> String {
        format!("int{}c{}f{}", self.bits, self.block, self.scale.bytes() * 8)
    }
    fn arrays(&self, d: usize, tokens: usize) -> Vec<ArraySpec> {
        vec![
            ArraySpec { name: "k_codes", rows: tokens, row_bytes: d * self.bits as usize / 8 },
            ArraySpec { name: "k_scale", rows: tokens / self.block, row_bytes: d * self.scale.bytes() },
            ArraySpec { name: "k_zero", rows: tokens / self.block, row_bytes: d * self.scale.bytes() },
        ]
    }
    fn page_bytes(&self, d: usize, tokens: usize) -> usize {
        d * tokens * self.bits as usize / 8 + 2 * d * self.scale.bytes() * (tokens / self.block)
    }
    fn cpp_type(&self, d: usize, p: usize, o: &dyn Fn(&str) -> usize) -> String {
        format!("IntKey<{}, {}, {}, {d}, {p}, {}, {}, {}>", self.bits, self.block, self.scale.cuda(), o("k_codes"), o("k_scale"), o("k_zero"))
    }
    fn nmse(&self) -> f64 {
        int_nmse(self.bits)
    }
    fn bit_widths(&self) -> Option<Vec<(u32, f64)>> {
        Some(vec![(self.bits, 1.0)])
    }
    fn per_warp_capable(&self, d: usize, p: usize) -> bool {
        self.block >= p && d * self.bits as usize >= 128
    }
    fn prefers_per_warp(&self) -> bool {
        true
    }
    /// Keys whose block spans several 16-token m-tiles fold the query with the block's scales
    /// once per page (fp16 high and low parts of q · scale in mma fragment order, then the zero
    /// terms per block, channel part, head): `IntKey::bfrag_bytes`.
    fn bfrag_bytes(&self, d: usize, p: usize, gqa: usize, warps: usize) -> usize {
        if self.block >= 32 {
            let kp = if warps >= 2 * (p / 16) { 2 } else { 1 };
            4 * gqa * (p / self.block).max(1) * (d + kp)
        } else {
            0
        }
    }
    fn transcode_scratch(&self, d: usize, p: usize, split: usize) -> usize {
        // Min and max per channel per block of the slice's channels.
        2 * (p / self.block) * (d / split) * 4
    }
    fn slices_channels(&self) -> bool {
        true
    }
    #[cfg(feature = "reference")]
    fn check(&self, _d: usize, tokens: usize, _aux: &[f32]) -> Result<(), RefError> {
        check_bits(self.bits, "keys")?;
        if self.block == 0 || !tokens.is_multiple_of(self.block) {
            return Err(RefError::Geometry(format!("per-channel int keys code whole blocks of {} tokens; {tokens} tokens is not a multiple", self.block)));
        }
        Ok(())
    }
    #[cfg(feature = "reference")]
    fn encode(&self, d: usize, tokens: usize, x: &[f32], _aux: &[f32], put: &mut dyn FnMut(&str, &[u8])) {
        let a = reference::encode_keys(self.bits, self.block, self.scale, d, tokens, x);
        put("k_codes", &a.codes);
        put("k_scale", &a.scale);
        put("k_zero", &a.zero);
    }
    #[cfg(feature = "reference")]
    fn decode<'a>(&self, d: usize, tokens: usize, get: &dyn Fn(&str) -> &'a [u8], _aux: &[f32]) -> Vec<f64> {
        let view = reference::IntView { codes: get("k_codes"), scale: get("k_scale"), zero: get("k_zero") };
        reference::decode_keys(self.bits, self.block, self.scale, d, tokens, view)
    }
}

impl Codec for IntValue {
    fn scheme(&self) -> &'static str {
        "int"
    }
    fn side(&self) -> Side {
        Side::Value
    }
    fn code(&self, _d: usize) -> String {
        format!("int{}g{}f{}", self.bits, self.group, self.scale.bytes() * 8)
    }
    fn arrays(&self, d: usize, tokens: usize) -> Vec<ArraySpec> {
        vec![
            ArraySpec { name: "v_codes", rows: tokens, row_bytes: d * self.bits as usize / 8 },
            ArraySpec { name: "v_scale", rows: tokens, row_bytes: (d / self.group) * self.scale.bytes() },
            ArraySpec { name: "v_zero", rows: tokens, row_bytes: (d / self.group) * self.scale.bytes() },
        ]
    }
    fn page_bytes(&self, d: usize, tokens: usize) -> usize {
        tokens * (d * self.bits as usize / 8 + 2 * (d / self.group) * self.scale.bytes())
    }
    fn cpp_type(&self, d: usize, p: usize, o: &dyn Fn(&str) -> usize) -> String {
        format!("IntValue<{}, {}, {}, {d}, {p}, {}, {}, {}>", self.bits, self.group, self.scale.cuda(), o("v_codes"), o("v_scale"), o("v_zero"))
    }
    fn nmse(&self) -> f64 {
        int_nmse(self.bits)
    }
    fn bit_widths(&self) -> Option<Vec<(u32, f64)>> {
        Some(vec![(self.bits, 1.0)])
    }
    fn per_warp_capable(&self, d: usize, _p: usize) -> bool {
        self.group.is_multiple_of(d / 8)
    }
    #[cfg(feature = "reference")]
    fn check(&self, d: usize, _tokens: usize, _aux: &[f32]) -> Result<(), RefError> {
        check_bits(self.bits, "values")?;
        if self.group == 0 || !d.is_multiple_of(self.group) {
            return Err(RefError::Geometry(format!("value group {} does not divide head_dim {d}", self.group)));
        }
        Ok(())
    }
    #[cfg(feature = "reference")]
    fn encode(&self, d: usize, tokens: usize, x: &[f32], _aux: &[f32], put: &mut dyn FnMut(&str, &[u8])) {
        let a = reference::encode_values(self.bits, self.group, self.scale, d, tokens, x);
        put("v_codes", &a.codes);
        put("v_scale", &a.scale);
        put("v_zero", &a.zero);
    }
    #[cfg(feature = "reference")]
    fn decode<'a>(&self, d: usize, tokens: usize, get: &dyn Fn(&str) -> &'a [u8], _aux: &[f32]) -> Vec<f64> {
        let view = reference::IntView { codes: get("v_codes"), scale: get("v_scale"), zero: get("v_zero") };
        reference::decode_values(self.bits, self.group, self.scale, d, tokens, view)
    }
}
