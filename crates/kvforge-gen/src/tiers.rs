//! The C++ `TierDef<...>` of each tier: the codec types of
//! `templates/include/kvforge/codecs.cuh` with their segment offsets.

use kvforge_spec::{DType, KeyScheme, ScaleDType, SegmentLayout, Spec, Tier, ValueScheme};

fn elem(t: DType) -> &'static str {
    t.cuda()
}
fn scale(s: ScaleDType) -> &'static str {
    match s {
        ScaleDType::Fp16 => "__half",
        ScaleDType::Fp32 => "float",
    }
}

/// The `TierDef<...>` of one tier at head dim `d`.
pub fn tier_def(spec: &Spec, tier: &Tier, d: usize) -> String {
    let p = spec.page.tokens;
    let seg = SegmentLayout::new(tier, d, p, spec.page.alignment);
    let o = |n: &str| seg.offset(n);
    let key = match &tier.key {
        KeyScheme::Dense(t) => format!("DenseKey<{}, {d}, {p}, {}>", elem(*t), o("k")),
        KeyScheme::Int { bits, block, scale: s } => {
            format!("IntKey<{bits}, {block}, {}, {d}, {p}, {}, {}, {}>", scale(*s), o("k_codes"), o("k_scale"), o("k_zero"))
        }
        KeyScheme::Spherical { group, angle_bits, .. } => {
            format!("SphericalKey<{group}, {angle_bits}, {d}, {p}, {}, {}>", o("k_radius"), o("k_index"))
        }
        KeyScheme::Mixed { segments, block, scale: s } => {
            // Channels, then array offsets, of the 16/8/4/2-bit segments; an absent segment
            // has 0 channels and offsets 0.
            let mut n = Vec::new();
            let mut offs = Vec::new();
            for bits in [16, 8, 4, 2] {
                n.push(segments.iter().find(|g| g.bits == bits).map_or(0, |g| g.channels(d)).to_string());
                let [codes, scale_arr, zero] = kvforge_spec::mixed_arrays(bits);
                offs.push(o(codes).to_string());
                if bits != 16 {
                    offs.extend([o(scale_arr).to_string(), o(zero).to_string()]);
                }
            }
            format!("MixedKey<{block}, {}, {d}, {p}, {}, {}>", scale(*s), n.join(", "), offs.join(", "))
        }
        KeyScheme::Drop => "DropKey".into(),
    };
    let value = match &tier.value {
        ValueScheme::Dense(t) => format!("DenseValue<{}, {d}, {p}, {}>", elem(*t), o("v")),
        ValueScheme::Int { bits, group, scale: s } => {
            format!("IntValue<{bits}, {group}, {}, {d}, {p}, {}, {}, {}>", scale(*s), o("v_codes"), o("v_scale"), o("v_zero"))
        }
        ValueScheme::Drop => "DropValue".into(),
    };
    format!("TierDef<{}, {}, {key}, {value}>", tier.id, seg.bytes)
}

/// (groups, entries) of a spherical tier's codebook, (1, 1) otherwise.
pub fn codebook_shape(tier: &Tier, d: usize) -> (usize, usize) {
    match &tier.key {
        KeyScheme::Spherical { group, angle_bits, .. } => (d / group, 1 << angle_bits),
        _ => (1, 1),
    }
}
