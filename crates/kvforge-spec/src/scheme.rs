//! The key and value scheme of a tier: one variant per registered codec (`codecs/`), whose
//! behaviour all goes through [`Codec`] ([`KeyScheme::codec`], [`ValueScheme::codec`]). The
//! variants keep their fields public so that code that needs one scheme's parameters (a
//! test building a spherical tier, the runtime's radius scales) can name them.

use std::fmt;

use crate::codecs::{
    dense::Dense,
    drop::Drop,
    int::{IntKey, IntValue},
    mixed::{ChannelSegment, MixedKey},
    rotated::{RotatedKey, RotatedValue},
    spherical::SphericalKey,
    Codec, Side,
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
    /// ([`crate::codecs::rotated`]).
    Rotated { bits: u32, seed: u32 },
    /// Evicted: no bytes, never attended ([`crate::codecs::drop`]).
    Drop,
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
    /// Lloyd–Max codes of the rotated unit direction and an fp16 scale.
    Rotated {
        bits: u32,
        seed: u32,
    },
    Drop,
}

impl KeyScheme {
    /// The codec that implements this scheme: the one place a key scheme is matched on.
    pub fn codec(&self) -> Box<dyn Codec + '_> {
        match self {
            KeyScheme::Dense(dtype) => Box::new(Dense { dtype: *dtype, side: Side::Key }),
            KeyScheme::Int { bits, block, scale } => Box::new(IntKey { bits: *bits, block: *block, scale: *scale }),
            KeyScheme::Spherical { group, angle_bits, codebook } => Box::new(SphericalKey { group: *group, angle_bits: *angle_bits, codebook }),
            KeyScheme::Mixed { segments, block, scale } => Box::new(MixedKey { segments, block: *block, scale: *scale }),
            KeyScheme::Rotated { bits, seed } => Box::new(RotatedKey::new(*bits, *seed)),
            KeyScheme::Drop => Box::new(Drop { side: Side::Key }),
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
            ValueScheme::Rotated { bits, seed } => Box::new(RotatedValue::new(*bits, *seed)),
            ValueScheme::Drop => Box::new(Drop { side: Side::Value }),
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
