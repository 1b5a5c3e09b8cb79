//! Spherical keys (seed 000 App. B): per group of `group` channels an 8-bit radius code
//! (scaled by a per-(tier, kv head, group) radius scale held beside the pages) and the
//! bit-packed index of the nearest of `2^angle_bits` unit codewords. Decode never rebuilds
//! keys: logits come from a per-query lookup table `LUT[j][i] = ⟨q_j, c_i⟩`. Arrays
//! `k_radius`, `k_index`; side tables `codebook` (from the spec's safetensors file) and
//! `radius_scale` (set by the caller or taken from the first pages coded). C++:
//! `SphericalKey` in `codecs/spherical.cuh`; f64 reference in [`reference`].

use std::fmt;

#[cfg(feature = "reference")]
use super::RefError;
use super::{ArraySpec, Codec, ParseCtx, Registration, Side, SideElem, SideInit, SideTable};
use crate::error::{SpecError, SpecErrorKind};
use crate::scheme::KeyScheme;
use crate::spec::LUT_BUDGET_BYTES;

pub mod codebook;
#[cfg(feature = "reference")]
pub mod reference;
pub mod sampling;

pub use codebook::{Codebook, CodebookError, HeadCodebooks};

pub const REGISTRATION: Registration = Registration {
    names: &["spherical"],
    fields: &["group", "angle_bits", "radius_bits", "codebook"],
    key: Some(parse_key),
    value: None,
    examples: &[(r#"{ scheme = "spherical", group = 16, angle_bits = 4, codebook = "../codebooks/sph_g16_b4.safetensors" }"#, r#"{ scheme = "fp16" }"#)],
};

/// Radius bits of the spherical scheme (seed 000 App. B fixes b_r = 8).
pub const RADIUS_BITS: u32 = 8;

/// Bytes per token of the bit-packed angle indices of `groups` groups (seed 000 packs them
/// with no per-token alignment beyond the byte).
pub fn spherical_index_bytes(groups: usize, angle_bits: u32) -> usize {
    (groups * angle_bits as usize).div_ceil(8)
}

/// Spherical keys with their codebook.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SphericalKey<'a> {
    pub group: usize,
    pub angle_bits: u32,
    pub codebook: &'a Codebook,
}

fn parse_key(ctx: &ParseCtx<'_>) -> Result<KeyScheme, SpecError> {
    ctx.only(&["group", "angle_bits", "radius_bits", "codebook"])?;
    let dims = ctx.head_dims;
    let g = ctx.need(ctx.int("group")?, "group", "channels per group, dividing head_dim")?;
    let group = *g.get_ref();
    for &d in dims {
        if group <= 0 || d as i64 % group != 0 {
            return ctx.err(g.span(), "group", format!("group_size {group} does not divide head_dim {d}; valid: {}", ctx.divisors(1)));
        }
    }
    let a = ctx.need(ctx.int("angle_bits")?, "angle_bits", "1 to 8")?;
    let angle_bits = *a.get_ref();
    if !(1..=8).contains(&angle_bits) {
        return ctx.err(a.span(), "angle_bits", format!("angle_bits {angle_bits} is not supported; valid: 1 to 8"));
    }
    // One tier's lookup table alone must fit the shared-memory budget.
    let max_gqa = ctx.gqa.iter().copied().max().unwrap_or(1);
    for &d in dims {
        let lut = max_gqa * (d / group as usize) * (1usize << angle_bits) * 4;
        if lut > LUT_BUDGET_BYTES {
            let fit = (1..angle_bits).rev().find(|&b| dims.iter().all(|&d| max_gqa * (d / group as usize) * (1usize << b) * 4 <= LUT_BUDGET_BYTES));
            let hint = match fit {
                Some(b) => format!("use angle_bits {b} or less, or a larger group"),
                None => "use a larger group".to_string(),
            };
            return ctx.err(a.span(), "angle_bits", format!(
                "a codebook of 2^{angle_bits} entries needs a {lut} B lookup table at head_dim {d}, gqa {max_gqa} (gqa x head_dim/group x entries x 4 B), more than the {LUT_BUDGET_BYTES} B shared-memory budget: {hint}"));
        }
    }
    if let Some(rb) = ctx.int("radius_bits")? {
        if *rb.get_ref() != RADIUS_BITS as i64 {
            return ctx.err(rb.span(), "radius_bits", format!("radius_bits {} is not supported; valid: 8", rb.get_ref()));
        }
    }
    let c = ctx.need(ctx.string("codebook")?, "codebook", "path of a safetensors codebook, relative to the spec")?;
    let entries = 1usize << angle_bits;
    let cb = Codebook::load(&ctx.dir().join(c.get_ref()), c.get_ref(), entries, group as usize).map_err(|e| ctx.error(SpecErrorKind::Codebook, c.span(), "codebook", e.to_string()))?;
    Ok(KeyScheme::Spherical { group: group as usize, angle_bits: angle_bits as u32, codebook: cb })
}

/// E[2 − 2 cos θ] of the nearest codeword over 4096 deterministic uniform unit directions.
pub fn spherical_direction_nmse(codebook: &Codebook) -> f64 {
    let g = codebook.group;
    let n = 4096;
    let samples = sampling::uniform_unit_samples(n, g, 0x5eed_0000 + g as u64);
    let mut sum = 0.0;
    for u in samples.chunks_exact(g) {
        let best = (0..codebook.entries).map(|i| u.iter().zip(codebook.word(i)).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>()).fold(f64::NEG_INFINITY, f64::max);
        sum += 2.0 - 2.0 * best;
    }
    sum / n as f64
}

impl fmt::Display for SphericalKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "spherical g{} b{}", self.group, self.angle_bits)
    }
}

impl Codec for SphericalKey<'_> {
    fn scheme(&self) -> &'static str {
        "spherical"
    }
    fn side(&self) -> Side {
        Side::Key
    }
    fn code(&self, d: usize) -> String {
        format!("sph{}x{}b{}", self.group, d / self.group, self.angle_bits)
    }
    fn arrays(&self, d: usize, tokens: usize) -> Vec<ArraySpec> {
        let g = d / self.group;
        vec![ArraySpec { name: "k_radius", rows: tokens, row_bytes: g * RADIUS_BITS as usize / 8 }, ArraySpec { name: "k_index", rows: tokens, row_bytes: spherical_index_bytes(g, self.angle_bits) }]
    }
    fn page_bytes(&self, d: usize, tokens: usize) -> usize {
        let g = d / self.group;
        tokens * (g * RADIUS_BITS as usize / 8 + spherical_index_bytes(g, self.angle_bits))
    }
    fn cpp_type(&self, d: usize, p: usize, o: &dyn Fn(&str) -> usize) -> String {
        format!("SphericalKey<{}, {}, {d}, {p}, {}, {}>", self.group, self.angle_bits, o("k_radius"), o("k_index"))
    }
    /// The direction error plus an 8-bit radius.
    fn nmse(&self) -> f64 {
        spherical_direction_nmse(self.codebook) + super::int::int_nmse(RADIUS_BITS)
    }
    fn bit_widths(&self) -> Option<Vec<(u32, f64)>> {
        None
    }
    fn side_tables(&self, d: usize) -> Vec<SideTable> {
        vec![
            // One copy of the codebook per group ([groups][entries][group]): the layout a
            // per-group codebook will fill.
            SideTable { name: "codebook", elem: SideElem::F32, len: (d / self.group) * self.codebook.data.len(), init: SideInit::Spec(self.codebook.data.repeat(d / self.group)) },
            SideTable { name: "radius_scale", elem: SideElem::F32, len: d / self.group, init: SideInit::Required },
        ]
    }
    fn content_hash(&self) -> Option<&str> {
        Some(&self.codebook.hash)
    }
    fn transcode_scratch(&self, d: usize, p: usize, split: usize) -> usize {
        // A codeword index per group of the slice's tokens.
        (p / split) * (d / self.group) * 4
    }
    fn lut_shape(&self, d: usize) -> Option<(usize, usize)> {
        Some((d / self.group, 1 << self.angle_bits))
    }
    #[cfg(feature = "reference")]
    fn check(&self, d: usize, _tokens: usize, aux: &[f32]) -> Result<(), RefError> {
        let (group, angle_bits, codebook) = (self.group, self.angle_bits, self.codebook);
        if group == 0 || !d.is_multiple_of(group) || codebook.group != group {
            return Err(RefError::Geometry(format!("spherical group {group} (codebook group {}) does not divide head_dim {d}", codebook.group)));
        }
        if !(1..=8).contains(&angle_bits) || codebook.entries != 1 << angle_bits || codebook.data.len() != codebook.entries * group {
            return Err(RefError::Geometry(format!("{angle_bits} angle bits need a codebook of 2^{angle_bits} words of {group} channels, it has {} entries", codebook.entries)));
        }
        if aux.len() != d / group {
            return Err(RefError::Shape { what: "rscale", found: aux.len(), expected: d / group, why: format!("one radius scale per group of {group} channels") });
        }
        Ok(())
    }
    #[cfg(feature = "reference")]
    fn encode(&self, d: usize, tokens: usize, x: &[f32], aux: &[f32], put: &mut dyn FnMut(&str, &[u8])) {
        let a = reference::encode_keys(self.group, self.angle_bits, self.codebook, d, tokens, x, aux);
        put("k_radius", &a.radius);
        put("k_index", &a.index);
    }
    #[cfg(feature = "reference")]
    fn decode<'a>(&self, d: usize, tokens: usize, get: &dyn Fn(&str) -> &'a [u8], aux: &[f32]) -> Vec<f64> {
        let view = reference::SphericalView { radius: get("k_radius"), index: get("k_index") };
        reference::decode_keys(self.group, self.angle_bits, self.codebook, d, tokens, view, aux)
    }
}
