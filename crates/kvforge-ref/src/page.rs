//! Pages: a 16-byte [`PageHeader`] (magic, tier id, valid-token count, checksum) followed by
//! the tier's segment, padded to the spec's alignment (`SegmentLayout::page_bytes`).
//!
//! Every tier but the tail codes full pages of `P` tokens. The tail tier (`TAIL_TIER`, dense
//! in the spec dtype) takes 1 to `P` tokens; its rows beyond the header's `length` are zero.
//! Decoding verifies the header against the tier before reading the segment, so a torn or
//! stale page is an error, never garbage attention.

use kvforge_spec::{PageHeader, PageOptions, SegmentLayout, Spec, Tier, TierId, HEADER_BYTES, TAIL_TIER};

use crate::dense;

use crate::error::{PageError, RefError};
use crate::segment::{try_decode_segment, try_encode_segment};

/// Keys and values of one page's valid tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedPage {
    pub header: PageHeader,
    /// K̂ `[header.length][d]`.
    pub k: Vec<f64>,
    /// V̂ `[header.length][d]`.
    pub v: Vec<f64>,
}

fn page_layout(tier: &Tier, d: usize, page: &PageOptions) -> SegmentLayout {
    SegmentLayout::new(tier, d, page.tokens, page.alignment)
}

/// Checks that a page of `tier` may hold `length` tokens.
fn check_length(tier: &Tier, length: usize, page: &PageOptions) -> Result<(), PageError> {
    if length > page.tokens {
        return Err(PageError::TooLong { length, tokens: page.tokens });
    }
    if tier.id != TAIL_TIER && length != page.tokens {
        return Err(PageError::Partial { tier: tier.name.clone(), length, tokens: page.tokens });
    }
    Ok(())
}

/// Encodes the tokens of `k` and `v` (`[length][d]`, f32) as one page of `tier`. The header
/// records `length`; a tail page is zero-padded to `P` rows.
pub fn encode_page(tier: &Tier, d: usize, page: &PageOptions, k: &[f32], v: &[f32], rscale: &[f32]) -> Result<Vec<u8>, PageError> {
    if tier.is_drop() {
        return Err(PageError::DropTier(tier.name.clone()));
    }
    if d == 0 || k.len() % d != 0 || v.len() != k.len() {
        return Err(RefError::Shape { what: "v", found: v.len(), expected: k.len(), why: format!("k and v are [tokens][{d}] with the same token count (k has {})", k.len()) }.into());
    }
    let length = k.len() / d;
    if length == 0 {
        return Err(RefError::Empty.into());
    }
    check_length(tier, length, page)?;
    let pad = |x: &[f32]| {
        let mut p = x.to_vec();
        p.resize(page.tokens * d, 0.0);
        p
    };
    let seg = try_encode_segment(tier, d, page.tokens, &pad(k), &pad(v), rscale)?;
    let header = PageHeader { tier: tier.id, flags: 0, length: length as u32 };
    let mut out = vec![0u8; page_layout(tier, d, page).page_bytes];
    out[..HEADER_BYTES].copy_from_slice(&header.to_bytes());
    out[HEADER_BYTES..HEADER_BYTES + seg.len()].copy_from_slice(&seg);
    Ok(out)
}

/// Verifies `bytes`' header against `tier` and decodes the page's valid tokens. Bytes beyond
/// `page_bytes` (a pool's slot stride) are ignored.
pub fn decode_page(tier: &Tier, d: usize, page: &PageOptions, bytes: &[u8], rscale: &[f32]) -> Result<DecodedPage, PageError> {
    if tier.is_drop() {
        return Err(PageError::DropTier(tier.name.clone()));
    }
    let expected = page_layout(tier, d, page).page_bytes;
    let size = || PageError::Size { tier: tier.name.clone(), d, found: bytes.len(), expected };
    if bytes.len() < HEADER_BYTES {
        return Err(size());
    }
    // The header first: a page of another tier is reported as such, not as a size mismatch.
    let header = PageHeader::from_bytes(bytes).map_err(PageError::Header)?;
    if header.tier != tier.id {
        return Err(PageError::WrongTier { found: header.tier, expected: tier.id, name: tier.name.clone() });
    }
    let length = header.length as usize;
    check_length(tier, length, page)?;
    if bytes.len() < expected {
        return Err(size());
    }
    let (mut k, mut v) = try_decode_segment(tier, d, page.tokens, &bytes[HEADER_BYTES..], rscale)?;
    k.truncate(length * d);
    v.truncate(length * d);
    Ok(DecodedPage { header, k, v })
}

/// The tier a page's header names, verified (magic and checksum) and looked up in `spec`.
pub fn page_tier<'s>(spec: &'s Spec, bytes: &[u8]) -> Result<&'s Tier, PageError> {
    let header = PageHeader::from_bytes(bytes).map_err(PageError::Header)?;
    spec.tiers.get(header.tier as usize).ok_or(PageError::UnknownTier(header.tier))
}

/// The rows `[n][d]` a spec's cache codes for appended rows `x`: in a rotated basis
/// ([`Spec::basis`]), each row rotated in f32 (`Basis::to_stored`, the function the runtime's
/// append calls) and rounded to the spec dtype (the tail page every token passes through
/// before a full page is coded into its tier); in the identity basis, `x` unchanged (the
/// reference codes the f32 values as given).
pub fn stored_rows(spec: &Spec, d: usize, x: &[f32]) -> Vec<f32> {
    let basis = spec.basis();
    let mut rows = x.to_vec();
    if !basis.is_identity() {
        basis.to_stored(d, &mut rows);
        rows.iter_mut().for_each(|r| *r = dense::round(spec.geometry.dtype, *r) as f32);
    }
    rows
}

/// Pages a sequence of `k`, `v` (`[n][d]`) as the cache does: every full page of `P` tokens in
/// `target`, the remainder (if any) in a tail page, all in the spec's basis ([`stored_rows`]).
/// `rscale` is `target`'s radius scales.
pub fn encode_sequence(spec: &Spec, target: TierId, d: usize, k: &[f32], v: &[f32], rscale: &[f32]) -> Result<Vec<Vec<u8>>, PageError> {
    let tier = spec.tiers.get(target as usize).ok_or(PageError::UnknownTier(target))?;
    if d == 0 || k.len() % d != 0 || v.len() != k.len() {
        return Err(RefError::Shape { what: "v", found: v.len(), expected: k.len(), why: format!("k and v are [tokens][{d}] with the same token count (k has {})", k.len()) }.into());
    }
    if k.is_empty() {
        return Err(RefError::Empty.into());
    }
    if !spec.basis().is_identity() && !kvforge_spec::codecs::rotated::hadamard::rotatable(d) {
        return Err(RefError::Geometry(format!("spec `{}` stores rows in the {} basis, which needs a power-of-two head_dim, not {d}", spec.name, spec.basis())).into());
    }
    let (k, v) = (&stored_rows(spec, d, k)[..], &stored_rows(spec, d, v)[..]);
    let rows = spec.page.tokens * d;
    let full = k.len() / rows;
    let mut pages = Vec::new();
    for p in 0..full {
        pages.push(encode_page(tier, d, &spec.page, &k[p * rows..(p + 1) * rows], &v[p * rows..(p + 1) * rows], rscale)?);
    }
    if k.len() > full * rows {
        pages.push(encode_page(&spec.tiers[TAIL_TIER as usize], d, &spec.page, &k[full * rows..], &v[full * rows..], &[])?);
    }
    Ok(pages)
}

/// Decodes a sequence's pages (any mix of tiers) into K̂ and V̂ (`[n][d]`), mapped back from
/// the spec's basis (f64): `attention(q, K̂, V̂)` then equals the runtime's decode, which
/// rotates q and rotates the output back (`q·Rᵀk̂ = Rq·k̂`). `rscales[t]` are the radius
/// scales of tier `t` (missing or empty for tiers without spherical keys).
pub fn decode_sequence<P: AsRef<[u8]>>(spec: &Spec, d: usize, pages: &[P], rscales: &[&[f32]]) -> Result<(Vec<f64>, Vec<f64>), PageError> {
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for bytes in pages {
        let bytes = bytes.as_ref();
        let tier = page_tier(spec, bytes)?;
        let rs = rscales.get(tier.id as usize).copied().unwrap_or(&[]);
        let p = decode_page(tier, d, &spec.page, bytes, rs)?;
        k.extend_from_slice(&p.k);
        v.extend_from_slice(&p.v);
    }
    let basis = spec.basis();
    basis.to_natural(d, &mut k);
    basis.to_natural(d, &mut v);
    Ok((k, v))
}
