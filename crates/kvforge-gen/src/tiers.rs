//! The C++ `TierDef<...>` of each tier: the codec types of
//! `templates/include/kvforge/codecs/<scheme>.cuh` with their segment offsets, as each codec
//! renders itself ([`kvforge_spec::Codec::cpp_type`]).

use kvforge_spec::{SegmentLayout, Spec, Tier};

/// The `TierDef<...>` of one tier at head dim `d`.
pub fn tier_def(spec: &Spec, tier: &Tier, d: usize) -> String {
    let p = spec.page.tokens;
    let seg = SegmentLayout::new(tier, d, p, spec.page.alignment);
    let o = |n: &str| seg.offset(n);
    let key = tier.key.codec().cpp_type(d, p, &o);
    let value = tier.value.codec().cpp_type(d, p, &o);
    format!("TierDef<{}, {}, {key}, {value}>", tier.id, seg.bytes)
}

/// (groups, entries) of a tier's key lookup table (spherical codebooks), (1, 1) without one.
pub fn codebook_shape(tier: &Tier, d: usize) -> (usize, usize) {
    tier.key.codec().lut_shape(d).unwrap_or((1, 1))
}
