//! Encoded segments and pages of every shipped tier have exactly the bytes of their layout,
//! and the padding between arrays is zero.

mod common;

use common::{data, SPECS};
use kvforge_ref::segment::layout;
use kvforge_ref::{decode_page, decode_segment, encode_page, encode_segment, radius_scales, try_encode_segment, PageError, RefError};
use kvforge_spec::{KeyScheme, SegmentLayout, HEADER_BYTES};

fn rscale_for(tier: &kvforge_spec::Tier, k: &[f32], d: usize) -> Vec<f32> {
    match &tier.key {
        KeyScheme::Spherical { group, .. } => radius_scales(k, d, *group),
        _ => Vec::new(),
    }
}

#[test]
fn every_shipped_tier_encodes_to_its_layout() {
    for name in SPECS {
        let s = common::spec(name);
        let p = s.page.tokens;
        for tier in &s.tiers {
            for &d in &s.geometry.head_dims {
                let lay: SegmentLayout = s.segment(tier.id, d);
                let (k, v) = (data(p * d, -4.0, 4.0, 1), data(p * d, -4.0, 4.0, 2));
                let rs = rscale_for(tier, &k, d);
                let seg = encode_segment(tier, d, p, &k, &v, &rs);
                assert_eq!(seg.len(), lay.bytes, "{name}/{} d{d}", tier.name);
                let arrays: usize = lay.arrays.iter().map(|a| a.bytes).sum();
                assert_eq!(arrays, lay.payload_bytes);
                assert_eq!(arrays as f64, tier.bytes_per_token(d, p) * p as f64, "{name}/{} d{d}", tier.name);
                // Bytes outside every array are zero.
                for (i, b) in seg.iter().enumerate() {
                    if !lay.arrays.iter().any(|a| (a.offset..a.offset + a.bytes).contains(&i)) {
                        assert_eq!(*b, 0, "{name}/{} d{d}: padding byte {i}", tier.name);
                    }
                }
                let (kh, vh) = decode_segment(tier, d, p, &seg, &rs);
                if tier.is_drop() {
                    assert!(seg.is_empty() && kh.is_empty() && vh.is_empty());
                    assert!(matches!(encode_page(tier, d, &s.page, &k, &v, &rs), Err(PageError::DropTier(_))));
                    continue;
                }
                assert_eq!((kh.len(), vh.len()), (p * d, p * d));
                let page = encode_page(tier, d, &s.page, &k, &v, &rs).unwrap();
                assert_eq!(page.len(), lay.page_bytes);
                assert_eq!(page.len() % s.page.alignment, 0);
                assert_eq!(&page[HEADER_BYTES..HEADER_BYTES + seg.len()], &seg[..], "page = header + segment");
                assert!(page[HEADER_BYTES + seg.len()..].iter().all(|&b| b == 0));
                let back = decode_page(tier, d, &s.page, &page, &rs).unwrap();
                assert_eq!((back.k, back.v), (kh, vh));
            }
        }
    }
}

#[test]
fn dense_tiers_hold_the_rounded_inputs() {
    let s = common::spec("baseline");
    let (d, p) = (64, s.page.tokens);
    let k = data(p * d, -1e3, 1e3, 3);
    for tier in &s.tiers {
        let (kh, vh) = decode_segment(tier, d, p, &encode_segment(tier, d, p, &k, &k, &[]), &[]);
        for ((x, a), b) in k.iter().zip(&kh).zip(&vh) {
            let r = half::f16::from_f32(*x).to_f64();
            assert_eq!((*a, *b), (r, r));
        }
    }
}

#[test]
fn single_token_segments_code() {
    let s = common::spec("rdkv");
    let d = 64;
    let (k, v) = (data(d, -1.0, 1.0, 4), data(d, -1.0, 1.0, 5));
    // Values are per token: one token is a valid segment; keys need whole blocks of 64.
    let b8 = s.tier("b8").unwrap();
    assert!(matches!(try_encode_segment(b8, d, 1, &k, &v, &[]), Err(RefError::Geometry(_))));
    let tail = &s.tiers[0];
    let (kh, _) = decode_segment(tail, d, 1, &encode_segment(tail, d, 1, &k, &v, &[]), &[]);
    assert_eq!(kh.len(), d);
    assert_eq!(layout(tail, d, 1).bytes, 2 * 2 * d);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let s = common::spec("certified");
    let t = s.tier("q8k4v").unwrap();
    let d = 64;
    let k = data(16 * d, -1.0, 1.0, 6);
    assert_eq!(try_encode_segment(t, d, 0, &[], &[], &[]), Err(RefError::Empty));
    assert!(matches!(try_encode_segment(t, d, 16, &k, &k[..d], &[]), Err(RefError::Shape { what: "v", .. })));
    assert!(matches!(try_encode_segment(t, 12, 16, &k, &k, &[]), Err(RefError::Geometry(_))));
    let mut bad = k.clone();
    bad[7] = f32::NAN;
    assert!(matches!(try_encode_segment(t, d, 16, &bad, &k, &[]), Err(RefError::NonFinite { what: "k", index: 7, .. })));
    bad[7] = f32::INFINITY;
    assert!(matches!(try_encode_segment(t, d, 16, &k, &bad, &[]), Err(RefError::NonFinite { what: "v", index: 7, .. })));
    let sph = common::spec("spherical");
    let high = sph.tier("high").unwrap();
    assert!(matches!(try_encode_segment(high, d, 1, &k[..d], &k[..d], &[]), Err(RefError::Shape { what: "rscale", .. })));
    assert!(kvforge_ref::try_decode_segment(t, d, 16, &[0u8; 3], &[]).is_err());
}

#[test]
fn impossible_ad_hoc_tiers_are_typed_errors() {
    let d = 64;
    let k = data(4 * d, -1.0, 1.0, 8);
    let f = kvforge_spec::ScaleDType::Fp16;
    for tier in [common::int_tier(3, 4, f, 8, 8, f), common::int_tier(8, 0, f, 8, 8, f), common::int_tier(8, 4, f, 8, 0, f), common::int_tier(8, 4, f, 8, 24, f)] {
        assert!(matches!(try_encode_segment(&tier, d, 4, &k, &k, &[]), Err(RefError::Geometry(_))), "{}", tier.name);
    }
    let mut sph = common::spherical_tier(16, 4, 1);
    if let KeyScheme::Spherical { angle_bits, .. } = &mut sph.key {
        *angle_bits = 5;
    }
    assert!(matches!(try_encode_segment(&sph, d, 4, &k, &k, &[1.0; 4]), Err(RefError::Geometry(_))));
}
