//! The values of a coded page, read back on the host.
//!
//! Certified decode records, for every freshly encoded page, the value error η of each block
//! against the page's tier-2 original. That needs the page's values only, and values are
//! either dense (fp16/bf16) or asymmetric integer codes with one scale and zero per token per
//! group. This is the runtime's own reader of those two layouts, so that the production path
//! does not call the f64 reference crate (which stays the oracle of the tests; the GPU tests
//! compare both).

use half::{bf16, f16};
use kvforge_spec::{DType, PageHeader, ScaleDType, Spec, TierId, ValueScheme, HEADER_BYTES, TAIL_TIER};

/// The valid tokens' values `[length][d]` of a page of tier `tier` (`bytes` starts at its
/// header; bytes past the page are ignored). `Err` says what is wrong with the page.
pub(crate) fn page_values(spec: &Spec, tier: TierId, d: usize, bytes: &[u8]) -> Result<Vec<f64>, String> {
    let t = spec.tiers.get(tier as usize).ok_or_else(|| format!("no tier {tier}"))?;
    let header = PageHeader::from_bytes(bytes)?;
    if header.tier != tier {
        return Err(format!("page header names tier {}, expected tier {tier} (`{}`)", header.tier, t.name));
    }
    let tokens = spec.page.tokens;
    let length = header.length as usize;
    if length > tokens || (tier != TAIL_TIER && length != tokens) {
        return Err(format!("page of tier `{}` holds {length} tokens of {tokens}", t.name));
    }
    let seg = spec.segment(tier, d);
    if bytes.len() < HEADER_BYTES + seg.bytes {
        return Err(format!("page of tier `{}` is {} bytes, expected {}", t.name, bytes.len(), HEADER_BYTES + seg.bytes));
    }
    let body = &bytes[HEADER_BYTES..];
    let get = |name: &str| -> Result<&[u8], String> {
        let a = seg.array(name).ok_or_else(|| format!("layout of tier `{}` has no array `{name}`", t.name))?;
        Ok(&body[a.offset..a.offset + a.bytes])
    };
    let mut v = match &t.value {
        ValueScheme::Dense(dt) => dense(*dt, get("v")?),
        ValueScheme::Int { bits, group, scale } => int(*bits, *group, *scale, d, tokens, get("v_codes")?, get("v_scale")?, get("v_zero")?)?,
        ValueScheme::Drop => return Err(format!("tier `{}` drops its values", t.name)),
        ValueScheme::Codec(c) => return Err(format!("tier `{}` codes its values as {c}; certified decode reads dense or integer values", t.name)),
    };
    v.truncate(length * d);
    Ok(v)
}

fn dense(dt: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(2)
        .map(|b| match dt {
            DType::Fp16 => f16::from_le_bytes([b[0], b[1]]).to_f64(),
            DType::Bf16 => bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        })
        .collect()
}

fn load_scale(dt: ScaleDType, bytes: &[u8], i: usize) -> f64 {
    let n = dt.bytes();
    let b = &bytes[i * n..(i + 1) * n];
    match dt {
        ScaleDType::Fp16 => f64::from(f16::from_le_bytes([b[0], b[1]]).to_f32()),
        ScaleDType::Fp32 => f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
    }
}

/// `(code + B) · scale + zero` per channel, B the layout's value code bias
/// ([`kvforge_spec::codecs::int::value_bias`]: the stored zero is biased); codes are packed
/// LSB-first, `8 / bits` per byte.
#[allow(clippy::too_many_arguments)]
fn int(bits: u32, group: usize, dt: ScaleDType, d: usize, tokens: usize, codes: &[u8], scale: &[u8], zero: &[u8]) -> Result<Vec<f64>, String> {
    if !matches!(bits, 2 | 4 | 8) || group == 0 || !d.is_multiple_of(group) {
        return Err(format!("int values of {bits} bits in groups of {group} do not fit head_dim {d}"));
    }
    let (row, groups, per, mask) = (d * bits as usize / 8, d / group, 8 / bits as usize, ((1u32 << bits) - 1) as u8);
    let bias = f64::from(kvforge_spec::codecs::int::value_bias(bits, dt));
    let mut v = Vec::with_capacity(tokens * d);
    for t in 0..tokens {
        let r = &codes[t * row..(t + 1) * row];
        for c in 0..d {
            let i = t * groups + c / group;
            let code = (r[c / per] >> ((c % per) * bits as usize)) & mask;
            v.push((f64::from(code) + bias) * load_scale(dt, scale, i) + load_scale(dt, zero, i));
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runtime's reader gives the reference decoder's values, for every tier of every
    /// shipped spec whose values are coded.
    #[test]
    fn matches_the_reference() {
        let d = 128;
        for name in ["baseline.toml", "certified.toml", "rdkv.toml", "spherical.toml", "trizone.toml"] {
            let spec = crate::testing::shipped_spec(name);
            let p = spec.page.tokens;
            for t in &spec.tiers {
                if t.is_drop() || matches!(t.value, ValueScheme::Drop) {
                    continue;
                }
                let rs = match &t.key {
                    kvforge_spec::KeyScheme::Spherical { group, .. } => vec![1.0f32; d / group],
                    _ => Vec::new(),
                };
                let length = if t.id == TAIL_TIER { p - 3 } else { p };
                let k: Vec<f32> = (0..length * d).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
                let v: Vec<f32> = (0..length * d).map(|i| ((i * 53) % 97) as f32 / 40.0 - 1.2).collect();
                let bytes = kvforge_ref::encode_page(t, d, &spec.page, &k, &v, &rs).unwrap();
                let want = kvforge_ref::decode_page(t, d, &spec.page, &bytes, &rs).unwrap().v;
                assert_eq!(page_values(&spec, t.id, d, &bytes).unwrap(), want, "{name} tier `{}`", t.name);
            }
        }
    }
}
