//! Rotated scalar-codebook keys and values (issue 26; TurboQuant, seed 001 Prop. 4.1): a spec
//! with a `rotated` tier stores every tier's K and V, the tail included, in the basis of a
//! seeded random-sign Hadamard rotation `R` ([`hadamard`], [`crate::Basis`]); a rotated tier
//! codes each row `x` (already rotated) as a norm and one `bits`-bit Lloyd–Max level per
//! channel of the unit direction ([`levels`]). Decode never rotates a key: the query is
//! rotated once per step (`q·k = Rq·Rk`) and the output rotated back once (`Σ p v = Rᵀ Σ p Rv`).
//!
//! One row `x ∈ R^d`, `E = 2^bits` levels `ℓ` (f32, [`levels::LevelTable::levels_f32`]):
//! - `u = x · inv` in f32 with `inv = 1/‖x‖` (f32); `‖x‖ = 0` codes every channel `E/2` with
//!   scale 0;
//! - `code_c = #{i : u_c > τ_i}`, `τ_i = (ℓ_i + ℓ_{i+1})/2` in f32 (a tie takes the lower level);
//! - scale `γ = ⟨x, ℓ̂⟩ / ⟨ℓ̂, ℓ̂⟩` with `ℓ̂_c = ℓ_{code_c}` (the least-squares scale of the
//!   quantised direction), stored fp16 (round to nearest); `x̂_c = γ · ℓ_{code_c}`.
//!
//! Arrays: `k_norm` `[P]` fp16 (γ) and `k_codes` `[P][d·bits/8]` (`v_norm`, `v_codes` for
//! values). A token's code row is `d/8` chunks of 8 channels; channel `c` is in chunk `c/8` at
//! slot `k = c%8`, and the decode's lookup wants a chunk's codes one per nibble (code `k` in
//! nibble `k`). 4 bits: chunk `c/8` is the little-endian u32 at byte `4·(c/8)`, code
//! `(w >> 4k) & 15`. 2 bits: chunks `2q`, `2q + 1` share the little-endian u32 at byte `4q`,
//! code `(w >> (4k + 2·(c/8 mod 2))) & 3` (one shift and one mask per chunk). 3 bits: groups of
//! 4 chunks in 3 little-endian u32 words ([`group3_pack`], [`group3_nibbles`]: one to three
//! instructions per chunk). No side tables: the levels are constants of the
//! C++ type (`RotatedKey<BITS, D, P, OFF_NORM, OFF_CODES, L...>`, `L...` the f32 bit patterns
//! of the `E` levels, ascending) in `codecs/rotated.cuh`; f64 reference in [`reference`].

use std::fmt;

#[cfg(feature = "reference")]
use super::RefError;
use super::{ArraySpec, Codec, ParseCtx, Registration, Side};
use crate::basis::Basis;
use crate::error::SpecError;
use crate::scheme::{KeyScheme, SharedCodec, ValueScheme};

pub mod hadamard;
pub mod levels;
#[cfg(feature = "reference")]
pub mod reference;

pub use hadamard::DEFAULT_SEED;
pub use levels::{levels, LevelTable};

pub const REGISTRATION: Registration = Registration {
    names: &["rotated"],
    fields: &["bits", "seed"],
    key: Some(parse_key),
    value: Some(parse_value),
    examples: &[(r#"{ scheme = "rotated", bits = 3 }"#, r#"{ scheme = "rotated", bits = 2 }"#), (r#"{ scheme = "rotated", bits = 4, seed = 7 }"#, r#"{ scheme = "rotated", bits = 4, seed = 7 }"#)],
};

/// Head dim of the controllers' distortion proxy ([`Codec::nmse`] takes none): the Lloyd–Max
/// distortion changes by under 2% between 64 and 256.
pub const NMSE_HEAD_DIM: usize = 128;

/// `bits` (2, 3 or 4) and `seed` (default [`DEFAULT_SEED`]) of a rotated side.
fn parse(ctx: &ParseCtx<'_>) -> Result<(u32, u32), SpecError> {
    ctx.only(&["bits", "seed"])?;
    let b = ctx.need(ctx.int("bits")?, "bits", "4, 3 or 2")?;
    let bits = match *b.get_ref() {
        v @ 2..=4 => v as u32,
        v => return ctx.err(b.span(), "bits", format!("bits {v} is not supported for `rotated`; valid: 4, 3, 2")),
    };
    // Every head dim the spec accepts today (64, 128, 256) is a whole number of units; this
    // guards a future one.
    let unit = row_unit(bits);
    if let Some(&d) = ctx.head_dims.iter().find(|&&d| !d.is_multiple_of(unit)) {
        return ctx.err(b.span(), "bits", format!("{bits}-bit rotated codes are packed {unit} channels at a time; head_dim {d} is not a multiple of {unit} (4-bit codes need a multiple of 8)"));
    }
    let seed = match ctx.int("seed")? {
        None => DEFAULT_SEED,
        Some(s) => match u32::try_from(*s.get_ref()) {
            Ok(v) => v,
            Err(_) => return ctx.err(s.span(), "seed", format!("seed {} is not supported; valid: 0 to 0xffffffff", s.get_ref())),
        },
    };
    Ok((bits, seed))
}

fn parse_key(ctx: &ParseCtx<'_>) -> Result<KeyScheme, SpecError> {
    let (bits, seed) = parse(ctx)?;
    Ok(KeyScheme::Codec(SharedCodec::new(RotatedKey::new(bits, seed))))
}

fn parse_value(ctx: &ParseCtx<'_>) -> Result<ValueScheme, SpecError> {
    let (bits, seed) = parse(ctx)?;
    Ok(ValueScheme::Codec(SharedCodec::new(RotatedValue::new(bits, seed))))
}

/// Rotated keys: an fp16 scale and `bits`-bit Lloyd–Max codes per token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RotatedKey {
    pub bits: u32,
    pub seed: u32,
    hash: String,
}

/// Rotated values: coded exactly like [`RotatedKey`], in arrays `v_norm`, `v_codes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RotatedValue {
    pub bits: u32,
    pub seed: u32,
    hash: String,
}

/// What the spec hash adds for a rotated codec: the seed, which the spec text omits when it
/// is the default.
fn seed_hash(seed: u32) -> String {
    format!("rotated seed {seed:#x}")
}

impl RotatedKey {
    pub fn new(bits: u32, seed: u32) -> RotatedKey {
        RotatedKey { bits, seed, hash: seed_hash(seed) }
    }
}

impl RotatedValue {
    pub fn new(bits: u32, seed: u32) -> RotatedValue {
        RotatedValue { bits, seed, hash: seed_hash(seed) }
    }
}

/// Bytes of one token's code row.
pub fn code_row_bytes(d: usize, bits: u32) -> usize {
    d * bits as usize / 8
}

/// Channels of one 3-bit group: 4 chunks of 8 codes in 12 bytes.
pub const GROUP3_CHANNELS: usize = 32;

/// Channels of one 2-bit word: 2 chunks of 8 codes in 4 bytes.
pub const WORD2_CHANNELS: usize = 16;

/// Channels a row's length must be a multiple of at `bits`: the packing's unit.
pub fn row_unit(bits: u32) -> usize {
    match bits {
        3 => GROUP3_CHANNELS,
        2 => WORD2_CHANNELS,
        _ => 8,
    }
}

/// Bit-3-clear nibbles of a u32 (the PRMT selector bits the decode uses).
const NIB3: u32 = 0x7777_7777;

/// The 3 words of a 3-bit group from its 4 chunks as nibble words (`n[j]`: code `k` of chunk
/// `j` at bits `4k..4k + 3`, bit `4k + 3` clear). The words are defined by what the decode
/// computes from them ([`group3_nibbles`]):
/// `n0 = w0 & 0x77777777`, `n2 = w1 & 0x77777777`,
/// `n1 = ((w0 >> 1) ^ w2) & 0x77777777`, `n3 = ((w1 >> 1) ^ (w2 >> 2)) & 0x77777777`:
/// chunks 0 and 2 stand in bits 0-2 of each nibble of w0 and w1; chunks 1 and 3 are xor-ed
/// into w2 against the shifted w0 / w1, and the nibbles' bit 3 of w0 and w1 carry the bits
/// that a shift moves into bit 2. Every one of the 96 bits is used and the map is one to one.
pub fn group3_pack(n: [u32; 4]) -> [u32; 3] {
    debug_assert!(n.iter().all(|&x| x & !NIB3 == 0));
    // w2's bits 0-1 of each nibble serve chunk 1, bits 2-3 chunk 3.
    let w2 = ((n[1] ^ (n[0] >> 1)) & 0x3333_3333) | (((n[3] ^ (n[2] >> 1)) << 2) & 0xcccc_cccc);
    let w0 = n[0] | (((n[1] ^ w2) << 1) & 0x8888_8888);
    let w1 = n[2] | (((n[3] ^ (w2 >> 2)) << 1) & 0x8888_8888);
    [w0, w1, w2]
}

/// The 4 chunks of a 3-bit group as nibble words (inverse of [`group3_pack`]).
pub fn group3_nibbles(w: [u32; 3]) -> [u32; 4] {
    [w[0] & NIB3, ((w[0] >> 1) ^ w[2]) & NIB3, w[1] & NIB3, ((w[1] >> 1) ^ (w[2] >> 2)) & NIB3]
}

fn arrays(side: Side, d: usize, tokens: usize, bits: u32) -> Vec<ArraySpec> {
    let (norm, codes) = names(side);
    vec![ArraySpec { name: norm, rows: tokens, row_bytes: 2 }, ArraySpec { name: codes, rows: tokens, row_bytes: code_row_bytes(d, bits) }]
}

/// `(norm, codes)` array names of a side.
pub fn names(side: Side) -> (&'static str, &'static str) {
    match side {
        Side::Key => ("k_norm", "k_codes"),
        Side::Value => ("v_norm", "v_codes"),
    }
}

/// The `L...` parameters of the C++ type: the levels' f32 bit patterns, ascending.
fn cpp_levels(d: usize, bits: u32) -> String {
    levels(d, bits).levels_f32.iter().map(|l| format!("{:#010x}u", l.to_bits())).collect::<Vec<_>>().join(", ")
}

#[cfg(feature = "reference")]
fn check(d: usize, bits: u32) -> Result<(), RefError> {
    if !matches!(bits, 2..=4) {
        return Err(RefError::Geometry(format!("rotated codes are 4, 3 or 2 bits, not {bits}")));
    }
    if d < 8 || !d.is_multiple_of(8) {
        return Err(RefError::Geometry(format!("rotated codes pack 8 channels per chunk; head_dim {d} is not a positive multiple of 8")));
    }
    if !d.is_multiple_of(row_unit(bits)) {
        return Err(RefError::Geometry(format!("{bits}-bit rotated codes are packed {} channels at a time; head_dim {d} is not a multiple of that", row_unit(bits))));
    }
    Ok(())
}

/// One side's `impl Codec`: the two sides differ only in their array names and C++ type.
macro_rules! rotated_codec {
    ($ty:ident, $side:expr) => {
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "rotated {}-bit (Hadamard seed {:#x})", self.bits, self.seed)
            }
        }

        impl Codec for $ty {
            fn scheme(&self) -> &'static str {
                "rotated"
            }
            fn side(&self) -> Side {
                $side
            }
            fn code(&self, _d: usize) -> String {
                format!("rot{}", self.bits)
            }
            fn arrays(&self, d: usize, tokens: usize) -> Vec<ArraySpec> {
                arrays($side, d, tokens, self.bits)
            }
            fn page_bytes(&self, d: usize, tokens: usize) -> usize {
                tokens * (2 + code_row_bytes(d, self.bits))
            }
            fn cpp_type(&self, d: usize, p: usize, o: &dyn Fn(&str) -> usize) -> String {
                let (norm, codes) = names($side);
                format!("{}<{}, {d}, {p}, {}, {}, {}>", stringify!($ty), self.bits, o(norm), o(codes), cpp_levels(d, self.bits))
            }
            /// The Lloyd–Max distortion of the unit direction at [`NMSE_HEAD_DIM`] (the
            /// least-squares scale keeps the relative error at about that).
            fn nmse(&self) -> f64 {
                levels(NMSE_HEAD_DIM, self.bits).nmse()
            }
            fn bit_widths(&self) -> Option<Vec<(u32, f64)>> {
                Some(vec![(self.bits, 1.0)])
            }
            fn content_hash(&self) -> Option<&str> {
                Some(&self.hash)
            }
            fn basis(&self) -> Basis {
                Basis::Hadamard { seed: self.seed }
            }
            /// The per-warp layout's fragments are whole 8-channel chunks: a lane's key slice
            /// (d/4 channels) and value channels (d/8) (`WARP` of the C++ types).
            fn per_warp_capable(&self, d: usize, _p: usize) -> bool {
                match $side {
                    Side::Key => d.is_multiple_of(32),
                    Side::Value => d.is_multiple_of(64),
                }
            }
            /// Keys: the per-warp layout scores the bare levels on tensor cores and scales the
            /// scores per token; its values fold their scales into the probabilities.
            fn prefers_per_warp(&self) -> bool {
                matches!($side, Side::Key)
            }
            /// Keys of up to 3 bits: their levels are an int8 grid ([`levels::INT8_GRID_BITS`]).
            fn int8_keys(&self) -> bool {
                matches!($side, Side::Key) && self.bits <= levels::INT8_GRID_BITS
            }
            #[cfg(feature = "reference")]
            fn check(&self, d: usize, _tokens: usize, _aux: &[f32]) -> Result<(), RefError> {
                check(d, self.bits)
            }
            #[cfg(feature = "reference")]
            fn encode(&self, d: usize, tokens: usize, x: &[f32], _aux: &[f32], put: &mut dyn FnMut(&str, &[u8])) {
                let a = reference::encode(self.bits, d, tokens, x);
                let (norm, codes) = names($side);
                put(norm, &a.norm);
                put(codes, &a.codes);
            }
            #[cfg(feature = "reference")]
            fn decode<'a>(&self, d: usize, tokens: usize, get: &dyn Fn(&str) -> &'a [u8], _aux: &[f32]) -> Vec<f64> {
                let (norm, codes) = names($side);
                reference::decode(self.bits, d, tokens, reference::RotatedView { norm: get(norm), codes: get(codes) })
            }
        }
    };
}

rotated_codec!(RotatedKey, Side::Key);
rotated_codec!(RotatedValue, Side::Value);
