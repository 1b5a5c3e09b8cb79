//! A tier's segment: the structure-of-arrays payload of one page, byte-exact to
//! [`SegmentLayout`]. Each scheme codes its arrays; this module checks the inputs, places the
//! arrays at their offsets (padding stays zero) and reads them back.

use kvforge_spec::{KeyScheme, SegmentLayout, Tier, ValueScheme};

use crate::error::RefError;
use crate::quant::IntView;
use crate::spherical::SphericalView;
use crate::{dense, mixed, quant, spherical};

/// Alignment passed to [`SegmentLayout::new`] when only the segment (not the page) matters.
const SEGMENT_ONLY: usize = 16;

/// Layout of `tier`'s segment for `tokens` tokens at head dim `d`.
pub fn layout(tier: &Tier, d: usize, tokens: usize) -> SegmentLayout {
    SegmentLayout::new(tier, d, tokens, SEGMENT_ONLY)
}

fn shape(what: &'static str, found: usize, expected: usize, why: String) -> Result<(), RefError> {
    if found == expected {
        Ok(())
    } else {
        Err(RefError::Shape { what, found, expected, why })
    }
}

/// Checks that `tier` can code `tokens` tokens at head dim `d` with `rscale` radius scales.
fn check_geometry(tier: &Tier, d: usize, tokens: usize, rscale: &[f32]) -> Result<(), RefError> {
    if tokens == 0 {
        return Err(RefError::Empty);
    }
    if d == 0 || d % 8 != 0 {
        return Err(RefError::Geometry(format!("head_dim {d} must be a positive multiple of 8")));
    }
    let bad = |what: String| Err(RefError::Geometry(format!("tier `{}`: {what}", tier.name)));
    match &tier.key {
        KeyScheme::Int { bits, block, .. } => {
            if !matches!(bits, 2 | 4 | 8) {
                return bad(format!("int keys are 8, 4 or 2 bits, not {bits}"));
            }
            if *block == 0 || tokens % block != 0 {
                return bad(format!("per-channel int keys code whole blocks of {block} tokens; {tokens} tokens is not a multiple"));
            }
        }
        KeyScheme::Spherical { group, angle_bits, codebook } => {
            if *group == 0 || d % group != 0 || codebook.group != *group {
                return bad(format!("spherical group {group} (codebook group {}) does not divide head_dim {d}", codebook.group));
            }
            if !(1..=8).contains(angle_bits) || codebook.entries != 1 << angle_bits || codebook.data.len() != codebook.entries * group {
                return bad(format!("{angle_bits} angle bits need a codebook of 2^{angle_bits} words of {group} channels, it has {} entries", codebook.entries));
            }
            shape("rscale", rscale.len(), d / group, format!("one radius scale per group of {group} channels of tier `{}`", tier.name))?;
        }
        KeyScheme::Mixed { segments, block, .. } => {
            if *block == 0 || tokens % block != 0 {
                return bad(format!("mixed keys code whole blocks of {block} tokens; {tokens} tokens is not a multiple"));
            }
            if d % 64 != 0 || segments.iter().map(|s| s.eighths).sum::<u32>() > 8 || segments.iter().any(|s| !matches!(s.bits, 16 | 8 | 4 | 2)) {
                return bad(format!("mixed keys need head_dim a multiple of 64 and segments of 16/8/4/2 bits within head_dim, not {d} and {segments:?}"));
            }
        }
        _ => {}
    }
    if let ValueScheme::Int { bits, group, .. } = &tier.value {
        if !matches!(bits, 2 | 4 | 8) {
            return bad(format!("int values are 8, 4 or 2 bits, not {bits}"));
        }
        if *group == 0 || d % group != 0 {
            return bad(format!("value group {group} does not divide head_dim {d}"));
        }
    }
    Ok(())
}

fn check_finite(what: &'static str, x: &[f32]) -> Result<(), RefError> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(RefError::NonFinite { what, index, value: x[index] }),
        None => Ok(()),
    }
}

/// Encodes `tokens` keys and values (`k`, `v` row-major `[tokens][d]`, f32) into `tier`'s
/// segment: a `layout(tier, d, tokens).bytes` vector with every array at its offset.
/// `rscale` holds the spherical radius scales of this head (one per group), and is ignored by
/// other key schemes. Mixed keys are coded in stored channel order: pass `k` through
/// [`mixed::to_stored`] first (and decoded keys through [`mixed::to_natural`]).
pub fn try_encode_segment(tier: &Tier, d: usize, tokens: usize, k: &[f32], v: &[f32], rscale: &[f32]) -> Result<Vec<u8>, RefError> {
    check_geometry(tier, d, tokens, rscale)?;
    shape("k", k.len(), tokens * d, format!("{tokens} tokens of head_dim {d}"))?;
    shape("v", v.len(), tokens * d, format!("{tokens} tokens of head_dim {d}"))?;
    check_finite("k", k)?;
    check_finite("v", v)?;
    let lay = layout(tier, d, tokens);
    let mut seg = vec![0u8; lay.bytes];
    let mut put = |name: &str, bytes: &[u8]| {
        let a = lay.array(name).unwrap_or_else(|| panic!("layout of tier `{}` has no array `{name}`", tier.name));
        assert_eq!(a.bytes, bytes.len(), "array `{name}` of tier `{}`", tier.name);
        seg[a.offset..a.offset + a.bytes].copy_from_slice(bytes);
    };
    match &tier.key {
        KeyScheme::Dense(t) => {
            let mut b = vec![0u8; k.len() * dense::ELEMENT_BYTES];
            dense::encode(*t, k, &mut b);
            put("k", &b);
        }
        KeyScheme::Int { bits, block, scale } => {
            let a = quant::encode_keys(*bits, *block, *scale, d, tokens, k);
            put("k_codes", &a.codes);
            put("k_scale", &a.scale);
            put("k_zero", &a.zero);
        }
        KeyScheme::Spherical { group, angle_bits, codebook } => {
            let a = spherical::encode_keys(*group, *angle_bits, codebook, d, tokens, k, rscale);
            put("k_radius", &a.radius);
            put("k_index", &a.index);
        }
        KeyScheme::Mixed { segments, block, scale } => mixed::encode_keys(segments, *block, *scale, d, tokens, k, &mut put),
        KeyScheme::Drop => {}
    }
    match &tier.value {
        ValueScheme::Dense(t) => {
            let mut b = vec![0u8; v.len() * dense::ELEMENT_BYTES];
            dense::encode(*t, v, &mut b);
            put("v", &b);
        }
        ValueScheme::Int { bits, group, scale } => {
            let a = quant::encode_values(*bits, *group, *scale, d, tokens, v);
            put("v_codes", &a.codes);
            put("v_scale", &a.scale);
            put("v_zero", &a.zero);
        }
        ValueScheme::Drop => {}
    }
    Ok(seg)
}

fn int_view<'a>(get: &impl Fn(&str) -> &'a [u8], side: &str) -> IntView<'a> {
    IntView { codes: get(&format!("{side}_codes")), scale: get(&format!("{side}_scale")), zero: get(&format!("{side}_zero")) }
}

fn spherical_view<'a>(get: &impl Fn(&str) -> &'a [u8]) -> SphericalView<'a> {
    SphericalView { radius: get("k_radius"), index: get("k_index") }
}

/// Decodes `tier`'s segment of `tokens` tokens into K̂ and V̂ (`[tokens][d]`, f64). `seg` may be
/// longer than the segment (a page's alignment padding). A dropped token has no key or value:
/// the drop tier decodes to empty vectors, never to zeros that could be attended.
pub fn try_decode_segment(tier: &Tier, d: usize, tokens: usize, seg: &[u8], rscale: &[f32]) -> Result<(Vec<f64>, Vec<f64>), RefError> {
    check_geometry(tier, d, tokens, rscale)?;
    let lay = layout(tier, d, tokens);
    if seg.len() < lay.bytes {
        return Err(RefError::Shape { what: "segment", found: seg.len(), expected: lay.bytes, why: format!("tier `{}` with {tokens} tokens of head_dim {d}", tier.name) });
    }
    let get = |name: &str| {
        let a = lay.array(name).unwrap_or_else(|| panic!("layout of tier `{}` has no array `{name}`", tier.name));
        &seg[a.offset..a.offset + a.bytes]
    };
    let k = match &tier.key {
        KeyScheme::Dense(t) => dense::decode(*t, get("k")),
        KeyScheme::Int { bits, block, scale } => quant::decode_keys(*bits, *block, *scale, d, tokens, int_view(&get, "k")),
        KeyScheme::Spherical { group, angle_bits, codebook } => {
            spherical::decode_keys(*group, *angle_bits, codebook, d, tokens, spherical_view(&get), rscale)
        }
        KeyScheme::Mixed { segments, block, scale } => mixed::decode_keys(segments, *block, *scale, d, tokens, get),
        KeyScheme::Drop => Vec::new(),
    };
    let v = match &tier.value {
        ValueScheme::Dense(t) => dense::decode(*t, get("v")),
        ValueScheme::Int { bits, group, scale } => quant::decode_values(*bits, *group, *scale, d, tokens, int_view(&get, "v")),
        ValueScheme::Drop => Vec::new(),
    };
    Ok((k, v))
}

/// [`try_encode_segment`] for test oracles, where bad inputs are a bug of the test.
///
/// # Panics
/// On any [`RefError`], with its message.
pub fn encode_segment(tier: &Tier, d: usize, tokens: usize, k: &[f32], v: &[f32], rscale: &[f32]) -> Vec<u8> {
    try_encode_segment(tier, d, tokens, k, v, rscale).unwrap_or_else(|e| panic!("encode_segment: {e}"))
}

/// [`try_decode_segment`] for test oracles, where bad inputs are a bug of the test.
///
/// # Panics
/// On any [`RefError`], with its message.
pub fn decode_segment(tier: &Tier, d: usize, tokens: usize, seg: &[u8], rscale: &[f32]) -> (Vec<f64>, Vec<f64>) {
    try_decode_segment(tier, d, tokens, seg, rscale).unwrap_or_else(|e| panic!("decode_segment: {e}"))
}

/// Logits ⟨q_head, k̂_t⟩ of the `tokens` keys of a spherical segment, computed the way the
/// decode kernel does, through the per-query lookup table (no key is rebuilt, no softmax
/// scale applied). `q_head` is one query head `[d]`.
pub fn spherical_logits(q_head: &[f64], tier: &Tier, d: usize, tokens: usize, seg: &[u8], rscale: &[f32]) -> Result<Vec<f64>, RefError> {
    let KeyScheme::Spherical { group, angle_bits, codebook } = &tier.key else {
        return Err(RefError::Geometry(format!("tier `{}` stores keys as {}, not spherical codes", tier.name, tier.key)));
    };
    check_geometry(tier, d, tokens, rscale)?;
    shape("q_head", q_head.len(), d, "one query head".into())?;
    let lay = layout(tier, d, tokens);
    if seg.len() < lay.bytes {
        return Err(RefError::Shape { what: "segment", found: seg.len(), expected: lay.bytes, why: format!("tier `{}` with {tokens} tokens of head_dim {d}", tier.name) });
    }
    let get = |name: &str| {
        let a = lay.array(name).expect("spherical layout");
        &seg[a.offset..a.offset + a.bytes]
    };
    let table = spherical::lut(q_head, codebook, *group);
    Ok(spherical::logits(&table, codebook.entries, *angle_bits, tokens, spherical_view(&get), rscale))
}
