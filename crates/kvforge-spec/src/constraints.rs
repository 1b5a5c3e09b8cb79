//! What the generated kernels `static_assert` about a spec, declared once here and checked by
//! the validator, so that a spec the validator accepts compiles: a violation is a located
//! [`SpecError`] that names the fields involved and what would be valid, not an NVRTC error
//! at JIT time on the GPU.
//!
//! Each rule mirrors one assertion of the device headers (templates/include/kvforge/); the
//! property test `crates/kvforge-rt/tests/spec_compiles.rs` draws specs from the grammar and
//! compiles their kernels with NVRTC, so a rule missing here shows up there.

use std::ops::Range;

use crate::error::{Locator, SpecError, SpecErrorKind};
use crate::raw::RawSpec;
use crate::scheme::{KeyScheme, ValueScheme};
use crate::spec::{Spec, TierId};

/// Page sizes the validator accepts (`page.tokens`).
pub(crate) const PAGE_TOKENS: [usize; 4] = [16, 32, 64, 128];

/// Warps per CTA of the decode launch serving `combo`: `kernels.dense` for launches whose
/// tiers (the tail aside) are all dense, else `kernels.warps` (kvforge-gen `decode_shape`).
pub fn decode_warps(spec: &Spec, combo: &[TierId]) -> usize {
    let dense = |t: TierId| {
        let t = &spec.tiers[t as usize];
        matches!(t.key, KeyScheme::Dense(_)) && matches!(t.value, ValueScheme::Dense(_))
    };
    let own: Vec<TierId> = combo.iter().copied().filter(|&t| t != crate::spec::TAIL_TIER).collect();
    match spec.kernels.dense {
        Some(shape) if !own.is_empty() && own.iter().all(|&t| dense(t)) => shape.warps,
        _ => spec.kernels.warps,
    }
}

/// A decode kernel's page geometry at one head dim: why it cannot compile, if it cannot.
/// `decode.cuh` `DecodeCta`:
/// - "tensor-core value tiles": the warps split the page's 16-token blocks, and what is left
///   of them splits head_dim into value parts of whole 16-channel m16n8k16 tiles;
/// - "the OUT region holds a second score part": integer keys score a page in two channel
///   parts, and part 1 lands in the output region of head_dim floats per head.
pub fn decode_geometry(tokens: usize, head_dim: usize, warps: usize) -> Result<(), String> {
    let blocks = tokens / 16;
    let value_parts = warps / warps.min(blocks.max(1));
    if !tokens.is_multiple_of(16) || !(head_dim / value_parts).is_multiple_of(16) {
        return Err(format!(
            "{warps} warps split a page of {tokens} tokens into {value_parts} value parts of {} channels of head_dim {head_dim}; the tensor-core value tiles need a multiple of 16 channels",
            head_dim / value_parts
        ));
    }
    if head_dim < tokens {
        return Err(format!("a page of {tokens} tokens has more tokens than head_dim {head_dim}: the decode kernel keeps a second score part of the page in its output region of head_dim floats per head"));
    }
    Ok(())
}

/// Checks every rule against a spec the field checks accepted.
pub(crate) fn check(spec: &Spec, raw: &RawSpec, loc: &Locator<'_>) -> Result<(), SpecError> {
    let err = |span: Option<Range<usize>>, field: &str, msg: String| Err(loc.error(SpecErrorKind::Invalid, span, field, msg));
    for combo in &spec.kernels.combinations {
        let warps = decode_warps(spec, combo);
        for &d in &spec.geometry.head_dims {
            if let Err(why) = decode_geometry(spec.page.tokens, d, warps) {
                let tokens: Vec<String> = PAGE_TOKENS.iter().filter(|&&p| decode_geometry(p, d, warps).is_ok()).map(|p| p.to_string()).collect();
                let names: Vec<&str> = combo.iter().skip(1).map(|&t| spec.tiers[t as usize].name.as_str()).collect();
                let warps_from = if spec.kernels.dense.is_some_and(|s| s.warps == warps) && warps != spec.kernels.warps { "kernels.dense.warps" } else { "kernels.warps" };
                let other_warps = if warps == 8 { 4 } else { 8 };
                let hint = if decode_geometry(spec.page.tokens, d, other_warps).is_ok() { format!(", or `{warps_from}` = {other_warps}") } else { String::new() };
                let (span, field) = match &raw.page.tokens {
                    Some(t) => (Some(t.span()), "page.tokens"),
                    None => (Some(raw.geometry.head_dims.span()), "geometry.head_dims"),
                };
                return err(
                    span,
                    field,
                    format!(
                        "page.tokens {} does not compile at head_dim {d} for the decode of tiers {} ({warps} warps, `{warps_from}`): {why}; valid page.tokens at head_dim {d}: {}{hint}",
                        spec.page.tokens,
                        names.join(", "),
                        tokens.join(", ")
                    ),
                );
            }
        }
    }
    for (i, t) in spec.tiers.iter().skip(1).enumerate() {
        // `SphericalKey::build_lut` reads codewords as float4s ("codewords load as float4s").
        if let KeyScheme::Spherical { group, .. } = &t.key {
            if group % 4 != 0 {
                let span = raw.tiers.get_ref().get(i).and_then(|r| r.key.get_ref().span_of("group"));
                return err(
                    span,
                    &format!("tier[{i}].key.group"),
                    format!("spherical group {group} is not a multiple of 4 channels (the lookup table reads codewords as float4s); valid: 4, 8, 16, 32, ... dividing every head_dim"),
                );
            }
        }
        // Integer keys score on tensor cores in 16-token m-tiles ("mma tiles" of
        // `IntKey::Mma`): a scale block is whole m-tiles. (Mixed keys score on CUDA cores.)
        if let KeyScheme::Int { block, .. } = &t.key {
            if block % 16 != 0 {
                let span = raw.tiers.get_ref().get(i).and_then(|r| r.key.get_ref().span_of("block"));
                let valid: Vec<String> = (16..=spec.page.tokens).step_by(16).filter(|b| spec.page.tokens.is_multiple_of(*b)).map(|b| b.to_string()).collect();
                return err(
                    span,
                    &format!("tier[{i}].key.block"),
                    format!("key block {block} is not a multiple of 16 tokens (integer keys score on tensor cores in 16-token tiles); valid at page.tokens {}: {}", spec.page.tokens, valid.join(", ")),
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_geometry_matches_the_kernel_asserts() {
        // The two cases issue 24 found: 16 tokens at d64 with 8 warps, 128 tokens at d64.
        assert!(decode_geometry(16, 64, 8).is_err());
        assert!(decode_geometry(16, 64, 4).is_ok());
        assert!(decode_geometry(128, 64, 4).is_err());
        assert!(decode_geometry(128, 128, 8).is_ok());
        for p in PAGE_TOKENS {
            for w in [4, 8] {
                assert!(decode_geometry(p, 256, w).is_ok() || p > 256);
            }
        }
    }
}
