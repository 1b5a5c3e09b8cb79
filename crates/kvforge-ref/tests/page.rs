//! Pages: headers record tier and length, tail pages hold any 1..=P tokens, sequences page
//! into full pages plus a tail, and every corruption of a header is detected.

mod common;

use common::data;
use kvforge_ref::quant::{self, min_max};
use kvforge_ref::{decode_page, decode_sequence, encode_page, encode_sequence, PageError, RefError};
use kvforge_spec::{KeyScheme, PageHeader, ScaleDType, HEADER_BYTES, TAIL_TIER};
use proptest::prelude::*;

#[test]
fn tail_pages_hold_any_length() {
    let s = common::spec("baseline");
    let tail = &s.tiers[TAIL_TIER as usize];
    let (d, p) = (64, s.page.tokens);
    for len in [1, 2, p / 2 + 3, p - 1, p] {
        let (k, v) = (data(len * d, -2.0, 2.0, len as u64), data(len * d, -2.0, 2.0, 99));
        let page = encode_page(tail, d, &s.page, &k, &v, &[]).unwrap();
        let h = PageHeader::from_bytes(&page).unwrap();
        assert_eq!((h.tier, h.flags, h.length as usize), (TAIL_TIER, 0, len));
        // Rows beyond `length` are zero bytes.
        let lay = s.segment(TAIL_TIER, d);
        for name in ["k", "v"] {
            let a = lay.array(name).unwrap();
            let rows = &page[HEADER_BYTES + a.offset + len * 2 * d..HEADER_BYTES + a.offset + a.bytes];
            assert!(rows.iter().all(|&b| b == 0), "{name} rows beyond {len}");
        }
        let back = decode_page(tail, d, &s.page, &page, &[]).unwrap();
        assert_eq!(back.k.len(), len * d);
        for (x, y) in k.iter().zip(&back.k).chain(v.iter().zip(&back.v)) {
            assert_eq!(half::f16::from_f32(*x).to_f64(), *y);
        }
    }
    let too_long = data((p + 1) * d, 0.0, 1.0, 1);
    assert!(matches!(encode_page(tail, d, &s.page, &too_long, &too_long, &[]), Err(PageError::TooLong { .. })));
}

#[test]
fn ladder_tiers_take_only_full_pages() {
    let s = common::spec("rdkv");
    let b4 = s.tier("b4").unwrap();
    let d = 64;
    let k = data(10 * d, -1.0, 1.0, 1);
    assert!(matches!(encode_page(b4, d, &s.page, &k, &k, &[]), Err(PageError::Partial { length: 10, .. })));
}

#[test]
fn empty_input_is_a_typed_error() {
    let s = common::spec("rdkv");
    let d = 64;
    assert_eq!(encode_page(&s.tiers[0], d, &s.page, &[], &[], &[]), Err(PageError::Coding(RefError::Empty)));
    assert_eq!(encode_sequence(&s, 2, d, &[], &[], &[]), Err(PageError::Coding(RefError::Empty)));
    assert!(matches!(encode_sequence(&s, 2, d, &[0.0; 3], &[0.0; 3], &[]), Err(PageError::Coding(RefError::Shape { .. }))));
    assert_eq!(encode_sequence(&s, 42, d, &[0.0; 64], &[0.0; 64], &[]), Err(PageError::UnknownTier(42)));
    let none: [Vec<u8>; 0] = [];
    assert_eq!(decode_sequence(&s, d, &none, &[]), Ok((vec![], vec![])));
}

/// Paging a sequence of n tokens: ⌊n/P⌋ pages in the target tier, then a tail page with the
/// remainder; decoding the pages gives n tokens, dense ones exact, int ones within bound.
#[test]
fn sequences_page_into_full_pages_and_a_tail() {
    let s = common::spec("rdkv");
    let (d, p) = (64, s.page.tokens);
    let b4 = s.tier("b4").unwrap();
    let KeyScheme::Int { bits, .. } = b4.key else { unreachable!() };
    for n in [1, p - 1, p, p + 1, 2 * p + 5, 3 * p] {
        let (k, v) = (data(n * d, -3.0, 3.0, n as u64), data(n * d, -3.0, 3.0, 7));
        let pages = encode_sequence(&s, b4.id, d, &k, &v, &[]).unwrap();
        assert_eq!(pages.len(), n.div_ceil(p), "n = {n}");
        for (i, page) in pages.iter().enumerate() {
            let h = PageHeader::from_bytes(page).unwrap();
            let expect = if i < n / p { (b4.id, p) } else { (TAIL_TIER, n % p) };
            assert_eq!((h.tier, h.length as usize), expect, "n = {n} page {i}");
        }
        let (kh, vh) = decode_sequence(&s, d, &pages, &[]).unwrap();
        assert_eq!((kh.len(), vh.len()), (n * d, n * d));
        for t in 0..n {
            for c in 0..d {
                let x = f64::from(k[t * d + c]);
                if t >= (n / p) * p {
                    assert_eq!(kh[t * d + c], half::f16::from_f32(k[t * d + c]).to_f64());
                    continue;
                }
                let page = t / p;
                let (mn, mx) = min_max((0..p).map(|u| k[(page * p + u) * d + c]));
                let bias = quant::key_bias(bits, ScaleDType::Fp16);
                let step = quant::biased_step(bits, bias, mn, mx, ScaleDType::Fp16);
                assert!((x - kh[t * d + c]).abs() <= quant::biased_error_bound(bits, bias, mn, mx, step));
            }
        }
    }
}

#[test]
fn spherical_sequences_decode_with_per_tier_scales() {
    let s = common::spec("spherical");
    let (d, p) = (128, s.page.tokens);
    let mid = s.tier("mid").unwrap();
    let k = data((p + 3) * d, -1.0, 1.0, 3);
    let rs = kvforge_ref::radius_scales(&k, d, 16);
    let pages = encode_sequence(&s, mid.id, d, &k, &k, &rs).unwrap();
    let mut rscales: Vec<&[f32]> = vec![&[]; s.tiers.len()];
    rscales[mid.id as usize] = &rs;
    let (kh, _) = decode_sequence(&s, d, &pages, &rscales).unwrap();
    assert_eq!(kh.len(), (p + 3) * d);
    assert!(decode_sequence(&s, d, &pages, &[]).is_err(), "missing radius scales are an error");
}

fn certified_page() -> (kvforge_spec::Spec, Vec<u8>) {
    let s = common::spec("certified");
    let t = s.tier("q8k4v").unwrap();
    let d = 64;
    let k = data(s.page.tokens * d, -1.0, 1.0, 1);
    let page = encode_page(t, d, &s.page, &k, &k, &[]).unwrap();
    (s, page)
}

proptest! {
    /// Any single-bit flip in the 16 header bytes is caught (magic or FNV-1a checksum).
    #[test]
    fn header_corruption_is_detected(bit in 0usize..128) {
        let (s, mut page) = certified_page();
        let t = s.tier("q8k4v").unwrap();
        page[bit / 8] ^= 1 << (bit % 8);
        let r = decode_page(t, 64, &s.page, &page, &[]);
        prop_assert!(matches!(r, Err(PageError::Header(_))), "bit {}: {:?}", bit, r.map(|p| p.header));
    }
}

#[test]
fn consistent_but_wrong_headers_are_rejected() {
    let (s, page) = certified_page();
    let t = s.tier("q8k4v").unwrap();
    let d = 64;
    let with = |h: PageHeader| {
        let mut b = page.clone();
        b[..HEADER_BYTES].copy_from_slice(&h.to_bytes());
        b
    };
    let fp16 = s.tier("fp16").unwrap();
    assert!(matches!(decode_page(fp16, d, &s.page, &page, &[]), Err(PageError::WrongTier { found: 2, expected: 1, .. })));
    let dense = encode_page(fp16, d, &s.page, &data(64 * d, 0.0, 1.0, 2), &data(64 * d, 0.0, 1.0, 3), &[]).unwrap();
    assert!(matches!(decode_page(t, d, &s.page, &dense, &[]), Err(PageError::WrongTier { found: 1, expected: 2, .. })));
    let long = with(PageHeader { tier: t.id, flags: 0, length: 65 });
    assert!(matches!(decode_page(t, d, &s.page, &long, &[]), Err(PageError::TooLong { length: 65, tokens: 64 })));
    let short = with(PageHeader { tier: t.id, flags: 0, length: 10 });
    assert!(matches!(decode_page(t, d, &s.page, &short, &[]), Err(PageError::Partial { length: 10, .. })));
    assert!(matches!(decode_page(t, d, &s.page, &page[..page.len() - 1], &[]), Err(PageError::Size { .. })));
    let unknown = with(PageHeader { tier: 9, flags: 0, length: 64 });
    assert_eq!(decode_sequence(&s, d, &[unknown], &[]), Err(PageError::UnknownTier(9)));
    // Trailing slot padding is ignored.
    let mut padded = page.clone();
    padded.extend_from_slice(&[0xaa; 256]);
    assert_eq!(decode_page(t, d, &s.page, &padded, &[]).unwrap(), decode_page(t, d, &s.page, &page, &[]).unwrap());
}
