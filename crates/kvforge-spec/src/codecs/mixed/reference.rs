//! Per-channel mixed-bit keys (seed 002 §3.3, TriZone zone A, K side).
//!
//! A head's channels are put in a *channel order* (the controller's: heaviest channel weight
//! `w_c = ‖Q[:,c]‖‖K[:,c]‖/√d` first) and stored as consecutive uniform-bit segments: fp16,
//! int8, int4, int2 (each integer segment is per-channel asymmetric quantisation per block of
//! tokens, exactly [`crate::codecs::int::reference::encode_keys`] on its columns), and the channels after the
//! last segment are dropped. Every function here works in *stored* channel order; [`to_stored`]
//! and [`to_natural`] move between it and the model's order. A dropped channel decodes to 0,
//! which is what the kernel's score leaves out: `q·k̂ = Σ_{stored j} q[order[j]] · k̂_j`.
//!
//! Seed 002 sorts the channels by bit width and permutes the query to match (App. B); here
//! the order is the controller's and every tier's segments follow it, so pages of different
//! histograms share one order per (tier, kv head) and the query is gathered, not permuted in
//! place.

use crate::{mixed_arrays, mixed_channels, ChannelSegment, DType, ScaleDType};

use crate::codecs::dense::reference as dense;
use crate::codecs::int::reference as quant;
use crate::codecs::RefError;

/// Checks that `order` is a permutation of `0..d` ([`super::check_order`] as a [`RefError`]).
pub fn check_order(order: &[u16], d: usize) -> Result<(), RefError> {
    super::check_order(order, d).map_err(|e| match e {
        super::OrderError::Length { found, expected } => RefError::Shape { what: "channel order", found, expected, why: "one stored position per channel".into() },
        e => RefError::Geometry(e.to_string()),
    })
}

pub use super::{identity_order, to_natural, to_stored};

/// Copies columns `[c0, c0 + n)` of `[tokens][d]` rows.
fn columns(k: &[f32], d: usize, c0: usize, n: usize) -> Vec<f32> {
    k.chunks(d).flat_map(|row| row[c0..c0 + n].iter().copied()).collect()
}

/// Encodes stored-order keys `k` (`[tokens][d]`) into the arrays of every segment, handing
/// each `(name, bytes)` to `put`.
pub fn encode_keys(segments: &[ChannelSegment], block: usize, scale: ScaleDType, d: usize, tokens: usize, k: &[f32], mut put: impl FnMut(&str, &[u8])) {
    for (bits, c0, n) in mixed_channels(segments, d) {
        let cols = columns(k, d, c0, n);
        let [codes, sc, zero] = mixed_arrays(bits);
        if bits == 16 {
            let mut b = vec![0u8; cols.len() * dense::ELEMENT_BYTES];
            dense::encode(DType::Fp16, &cols, &mut b);
            put(codes, &b);
        } else {
            let a = quant::encode_keys(bits, block, scale, n, tokens, &cols);
            put(codes, &a.codes);
            put(sc, &a.scale);
            put(zero, &a.zero);
        }
    }
}

/// Decodes the segments (`get` returns an array by name) into stored-order K̂ `[tokens][d]`,
/// dropped channels 0.
pub fn decode_keys<'a>(segments: &[ChannelSegment], block: usize, scale: ScaleDType, d: usize, tokens: usize, get: impl Fn(&str) -> &'a [u8]) -> Vec<f64> {
    let mut out = vec![0.0; tokens * d];
    for (bits, c0, n) in mixed_channels(segments, d) {
        let [codes, sc, zero] = mixed_arrays(bits);
        let cols = if bits == 16 { dense::decode(DType::Fp16, get(codes)) } else { quant::decode_keys(bits, block, scale, n, tokens, quant::IntView { codes: get(codes), scale: get(sc), zero: get(zero) }) };
        for t in 0..tokens {
            out[t * d + c0..t * d + c0 + n].copy_from_slice(&cols[t * n..(t + 1) * n]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_round_trip_and_bad_orders_are_errors() {
        let d = 8;
        let order: Vec<u16> = vec![3, 1, 7, 0, 2, 6, 5, 4];
        check_order(&order, d).unwrap();
        let x: Vec<f32> = (0..2 * d).map(|i| i as f32).collect();
        let s = to_stored(&x, d, &order);
        assert_eq!(&s[..d], &[3.0, 1.0, 7.0, 0.0, 2.0, 6.0, 5.0, 4.0]);
        let back = to_natural(&s.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(), d, &order);
        assert_eq!(back, x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>());
        assert!(check_order(&[0, 1, 1, 2, 3, 4, 5, 6], d).unwrap_err().to_string().contains("position 2 holds 1"));
        assert!(check_order(&[0, 1, 2], d).is_err());
        assert!(check_order(&[0, 1, 2, 3, 4, 5, 6, 8], d).is_err());
    }
}
