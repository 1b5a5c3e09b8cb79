//! The key and value scheme of a tier, whose behaviour all goes through [`Codec`]
//! ([`KeyScheme::codec`], [`ValueScheme::codec`]). The five first schemes have named variants
//! whose fields are public, so that code that needs one scheme's parameters (a test building
//! a spherical tier, the runtime's radius scales) can name them; every scheme added since is
//! a [`SharedCodec`] in the `Codec` variant, which its parser builds and nothing outside its
//! folder names.

use std::fmt;
use std::sync::Arc;

#[cfg(feature = "reference")]
use crate::codecs::RefError;
use crate::codecs::{
    dense::Dense,
    drop::Drop,
    int::{IntKey, IntValue},
    mixed::{ChannelSegment, MixedKey},
    spherical::SphericalKey,
    ArraySpec, Codec, Side, SideTable,
};

/// Element type of queries, outputs and dense (identity-coded) K/V.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Fp16,
    Bf16,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::Fp16 => "fp16",
            DType::Bf16 => "bf16",
        }
    }
    /// The CUDA type of one element.
    pub fn cuda(self) -> &'static str {
        match self {
            DType::Fp16 => "__half",
            DType::Bf16 => "__nv_bfloat16",
        }
    }
}

/// Storage type of quantisation scales and zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScaleDType {
    Fp16,
    Fp32,
}

impl ScaleDType {
    pub fn bytes(self) -> usize {
        match self {
            ScaleDType::Fp16 => 2,
            ScaleDType::Fp32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ScaleDType::Fp16 => "fp16",
            ScaleDType::Fp32 => "fp32",
        }
    }
    /// The CUDA type of one scale.
    pub fn cuda(self) -> &'static str {
        match self {
            ScaleDType::Fp16 => "__half",
            ScaleDType::Fp32 => "float",
        }
    }
}

/// How a key vector is stored.
#[derive(Clone, Debug, PartialEq)]
pub enum KeyScheme {
    /// Identity in the given element type ([`crate::codecs::dense`]).
    Dense(DType),
    /// Per-channel asymmetric integer codes ([`crate::codecs::int`]).
    Int { bits: u32, block: usize, scale: ScaleDType },
    /// Radius code and codeword index per group of channels ([`crate::codecs::spherical`]).
    Spherical { group: usize, angle_bits: u32, codebook: crate::Codebook },
    /// Per-channel bit widths in a channel order ([`crate::codecs::mixed`]).
    Mixed { segments: Vec<ChannelSegment>, block: usize, scale: ScaleDType },
    /// Lloyd–Max codes of the rotated unit direction and an fp16 scale
    /// Evicted: no bytes, never attended ([`crate::codecs::drop`]).
    Drop,
    /// Any other registered scheme, as its codec.
    Codec(SharedCodec),
}

/// How a value vector is stored.
#[derive(Clone, Debug, PartialEq)]
pub enum ValueScheme {
    Dense(DType),
    /// Per-token asymmetric integer codes per group of `group` channels.
    Int {
        bits: u32,
        group: usize,
        scale: ScaleDType,
    },
    Drop,
    /// Any other registered scheme, as its codec.
    Codec(SharedCodec),
}

impl KeyScheme {
    /// The codec that implements this scheme: the one place a key scheme is matched on.
    pub fn codec(&self) -> Box<dyn Codec + '_> {
        match self {
            KeyScheme::Dense(dtype) => Box::new(Dense { dtype: *dtype, side: Side::Key }),
            KeyScheme::Int { bits, block, scale } => Box::new(IntKey { bits: *bits, block: *block, scale: *scale }),
            KeyScheme::Spherical { group, angle_bits, codebook } => Box::new(SphericalKey { group: *group, angle_bits: *angle_bits, codebook }),
            KeyScheme::Mixed { segments, block, scale } => Box::new(MixedKey { segments, block: *block, scale: *scale }),
            KeyScheme::Drop => Box::new(Drop { side: Side::Key }),
            KeyScheme::Codec(c) => Box::new(c.clone()),
        }
    }
    /// Bytes one page segment of `tokens` tokens needs for keys at head dim `d`.
    pub fn page_bytes(&self, d: usize, tokens: usize) -> usize {
        self.codec().page_bytes(d, tokens)
    }
    pub fn is_drop(&self) -> bool {
        self.codec().is_drop()
    }
}

impl ValueScheme {
    /// The codec that implements this scheme: the one place a value scheme is matched on.
    pub fn codec(&self) -> Box<dyn Codec + '_> {
        match self {
            ValueScheme::Dense(dtype) => Box::new(Dense { dtype: *dtype, side: Side::Value }),
            ValueScheme::Int { bits, group, scale } => Box::new(IntValue { bits: *bits, group: *group, scale: *scale }),
            ValueScheme::Drop => Box::new(Drop { side: Side::Value }),
            ValueScheme::Codec(c) => Box::new(c.clone()),
        }
    }
    pub fn page_bytes(&self, d: usize, tokens: usize) -> usize {
        self.codec().page_bytes(d, tokens)
    }
    pub fn is_drop(&self) -> bool {
        self.codec().is_drop()
    }
}

impl fmt::Display for KeyScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.codec(), f)
    }
}

impl fmt::Display for ValueScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.codec(), f)
    }
}

/// A codec held by a [`KeyScheme::Codec`] or [`ValueScheme::Codec`]: what the parser of a
/// scheme without a named variant returns (`KeyScheme::Codec(SharedCodec::new(MyKey { .. }))`).
/// Cloning shares it. Two are equal when they are the same scheme and side with the same
/// `Display` text and content hash: the text names every parameter of the format.
#[derive(Clone)]
pub struct SharedCodec(Arc<dyn Codec + Send + Sync>);

impl SharedCodec {
    pub fn new(codec: impl Codec + Send + Sync + 'static) -> Self {
        SharedCodec(Arc::new(codec))
    }
    /// The codec.
    pub fn get(&self) -> &(dyn Codec + Send + Sync) {
        &*self.0
    }
}

impl fmt::Debug for SharedCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl fmt::Display for SharedCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl PartialEq for SharedCodec {
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.get(), other.get());
        a.scheme() == b.scheme() && a.side() == b.side() && a.to_string() == b.to_string() && a.content_hash() == b.content_hash()
    }
}

/// Every method forwards to the held codec (the defaults of [`Codec`] included, so that a
/// codec's own answers are never replaced by them).
impl Codec for SharedCodec {
    fn scheme(&self) -> &'static str {
        self.0.scheme()
    }
    fn side(&self) -> Side {
        self.0.side()
    }
    fn code(&self, d: usize) -> String {
        self.0.code(d)
    }
    fn arrays(&self, d: usize, tokens: usize) -> Vec<ArraySpec> {
        self.0.arrays(d, tokens)
    }
    fn page_bytes(&self, d: usize, tokens: usize) -> usize {
        self.0.page_bytes(d, tokens)
    }
    fn cpp_type(&self, d: usize, tokens: usize, offset: &dyn Fn(&str) -> usize) -> String {
        self.0.cpp_type(d, tokens, offset)
    }
    fn nmse(&self) -> f64 {
        self.0.nmse()
    }
    fn bit_widths(&self) -> Option<Vec<(u32, f64)>> {
        self.0.bit_widths()
    }
    fn side_tables(&self, d: usize) -> Vec<SideTable> {
        self.0.side_tables(d)
    }
    fn is_drop(&self) -> bool {
        self.0.is_drop()
    }
    fn content_hash(&self) -> Option<&str> {
        self.0.content_hash()
    }
    fn basis(&self) -> crate::Basis {
        self.0.basis()
    }
    fn prefers_per_warp(&self) -> bool {
        self.0.prefers_per_warp()
    }
    fn int8_keys(&self) -> bool {
        self.0.int8_keys()
    }
    fn is_dense(&self) -> bool {
        self.0.is_dense()
    }
    fn bfrag_bytes(&self, d: usize, p: usize, gqa: usize, warps: usize) -> usize {
        self.0.bfrag_bytes(d, p, gqa, warps)
    }
    fn lut_shape(&self, d: usize) -> Option<(usize, usize)> {
        self.0.lut_shape(d)
    }
    fn lut_floats_per_head(&self, d: usize) -> usize {
        self.0.lut_floats_per_head(d)
    }
    fn per_warp_capable(&self, d: usize, p: usize) -> bool {
        self.0.per_warp_capable(d, p)
    }
    fn slices_channels(&self) -> bool {
        self.0.slices_channels()
    }
    fn transcode_scratch(&self, d: usize, p: usize, split: usize) -> usize {
        self.0.transcode_scratch(d, p, split)
    }
    #[cfg(feature = "reference")]
    fn check(&self, d: usize, tokens: usize, aux: &[f32]) -> Result<(), RefError> {
        self.0.check(d, tokens, aux)
    }
    #[cfg(feature = "reference")]
    fn encode(&self, d: usize, tokens: usize, x: &[f32], aux: &[f32], put: &mut dyn FnMut(&str, &[u8])) {
        self.0.encode(d, tokens, x, aux, put)
    }
    #[cfg(feature = "reference")]
    fn decode<'a>(&self, d: usize, tokens: usize, get: &dyn Fn(&str) -> &'a [u8], aux: &[f32]) -> Vec<f64> {
        self.0.decode(d, tokens, get, aux)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scheme held as a [`SharedCodec`] answers as the codec itself, defaults included.
    #[test]
    fn shared_codec_forwards_everything() {
        let named = [KeyScheme::Int { bits: 4, block: 64, scale: ScaleDType::Fp16 }, KeyScheme::Int { bits: 8, block: 16, scale: ScaleDType::Fp32 }, KeyScheme::Dense(DType::Fp16), KeyScheme::Drop];
        let shared = [
            SharedCodec::new(IntKey { bits: 4, block: 64, scale: ScaleDType::Fp16 }),
            SharedCodec::new(IntKey { bits: 8, block: 16, scale: ScaleDType::Fp32 }),
            SharedCodec::new(Dense { dtype: DType::Fp16, side: Side::Key }),
            SharedCodec::new(Drop { side: Side::Key }),
        ];
        for (n, s) in named.iter().zip(shared) {
            let k = KeyScheme::Codec(s.clone());
            let (a, b) = (n.codec(), k.codec());
            assert_eq!(n.to_string(), k.to_string());
            assert_eq!(format!("{s:?}"), n.to_string());
            assert_eq!((a.scheme(), a.side(), a.is_drop(), a.content_hash()), (b.scheme(), b.side(), b.is_drop(), b.content_hash()));
            assert_eq!((a.nmse(), a.bit_widths(), a.slices_channels()), (b.nmse(), b.bit_widths(), b.slices_channels()));
            for (d, p) in [(64, 32), (128, 64)] {
                let o = |name: &str| name.len();
                assert_eq!((a.code(d), a.arrays(d, p), a.page_bytes(d, p), a.cpp_type(d, p, &o)), (b.code(d), b.arrays(d, p), b.page_bytes(d, p), b.cpp_type(d, p, &o)));
                assert_eq!((a.side_tables(d), a.lut_shape(d), a.lut_floats_per_head(d)), (b.side_tables(d), b.lut_shape(d), b.lut_floats_per_head(d)));
                assert_eq!((a.per_warp_capable(d, p), a.transcode_scratch(d, p, 2)), (b.per_warp_capable(d, p), b.transcode_scratch(d, p, 2)));
            }
            assert_eq!(k.page_bytes(128, 64), n.page_bytes(128, 64));
            assert_eq!(k.is_drop(), n.is_drop());
            assert_eq!((a.basis(), a.prefers_per_warp(), a.is_dense(), a.bfrag_bytes(128, 64, 4, 4)), (b.basis(), b.prefers_per_warp(), b.is_dense(), b.bfrag_bytes(128, 64, 4, 4)));
        }
        // A method a codec overrides reaches it through the wrapper (a forward left out would
        // answer with the trait's default: the identity basis).
        let rotated = KeyScheme::Codec(SharedCodec::new(crate::codecs::rotated::RotatedKey::new(3, 7)));
        assert_eq!(rotated.codec().basis(), crate::Basis::Hadamard { seed: 7 });
        // So do the integer-key fragments the shared-memory plan reserves (a missing forward
        // once let the int8 query fragments overwrite the first stage).
        for bits in [2, 3, 4] {
            let direct = crate::codecs::rotated::RotatedKey::new(bits, 7);
            let held = KeyScheme::Codec(SharedCodec::new(crate::codecs::rotated::RotatedKey::new(bits, 7)));
            assert_eq!((held.codec().int8_keys(), held.codec().prefers_per_warp()), (direct.int8_keys(), direct.prefers_per_warp()), "{bits} bits");
            assert_eq!(direct.int8_keys(), bits <= 3);
        }
        assert!(!KeyScheme::Codec(SharedCodec::new(IntKey { bits: 4, block: 64, scale: ScaleDType::Fp16 })).codec().int8_keys());
    }

    #[test]
    fn shared_codecs_are_equal_by_format() {
        let a = ValueScheme::Codec(SharedCodec::new(IntValue { bits: 4, group: 32, scale: ScaleDType::Fp16 }));
        let b = ValueScheme::Codec(SharedCodec::new(IntValue { bits: 4, group: 32, scale: ScaleDType::Fp16 }));
        let c = ValueScheme::Codec(SharedCodec::new(IntValue { bits: 4, group: 16, scale: ScaleDType::Fp16 }));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(KeyScheme::Codec(SharedCodec::new(Drop { side: Side::Key })), KeyScheme::Drop);
        assert_ne!(SharedCodec::new(Drop { side: Side::Key }), SharedCodec::new(Drop { side: Side::Value }));
    }
}
