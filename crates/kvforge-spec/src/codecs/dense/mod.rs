//! Dense (identity) coding in fp16 or bf16: `[tokens][d]` elements of the side's array `k` or
//! `v`. The tail tier stores every new token this way. C++: `DenseKey` / `DenseValue` in
//! `codecs/dense.cuh`.

use std::fmt;

use super::{ArraySpec, Codec, ParseCtx, Registration, Side};
use crate::error::SpecError;
use crate::scheme::{DType, KeyScheme, ValueScheme};

#[cfg(feature = "reference")]
pub mod reference;

pub const REGISTRATION: Registration = Registration {
    names: &["fp16", "bf16"],
    fields: &[],
    key: Some(parse_key),
    value: Some(parse_value),
    examples: &[(r#"{ scheme = "fp16" }"#, r#"{ scheme = "bf16" }"#), (r#"{ scheme = "bf16" }"#, r#"{ scheme = "fp16" }"#)],
};

/// Dense keys or values in `dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dense {
    pub dtype: DType,
    pub side: Side,
}

fn dtype(ctx: &ParseCtx<'_>) -> Result<DType, SpecError> {
    ctx.only(&[])?;
    Ok(if ctx.name() == "bf16" { DType::Bf16 } else { DType::Fp16 })
}

fn parse_key(ctx: &ParseCtx<'_>) -> Result<KeyScheme, SpecError> {
    Ok(KeyScheme::Dense(dtype(ctx)?))
}

fn parse_value(ctx: &ParseCtx<'_>) -> Result<ValueScheme, SpecError> {
    Ok(ValueScheme::Dense(dtype(ctx)?))
}

/// NMSE of rounding to a float type.
pub fn dense_nmse(dtype: DType) -> f64 {
    let p = match dtype {
        DType::Fp16 => 11,
        DType::Bf16 => 8,
    };
    let u = 2f64.powi(-p);
    u * u / 3.0
}

impl fmt::Display for Dense {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.dtype.name())
    }
}

impl Codec for Dense {
    fn scheme(&self) -> &'static str {
        self.dtype.name()
    }
    fn side(&self) -> Side {
        self.side
    }
    fn code(&self, _d: usize) -> String {
        self.dtype.name().to_string()
    }
    fn arrays(&self, d: usize, tokens: usize) -> Vec<ArraySpec> {
        vec![ArraySpec { name: self.side.prefix(), rows: tokens, row_bytes: 2 * d }]
    }
    fn page_bytes(&self, d: usize, tokens: usize) -> usize {
        2 * d * tokens
    }
    fn cpp_type(&self, d: usize, p: usize, o: &dyn Fn(&str) -> usize) -> String {
        let (ty, arr) = match self.side {
            Side::Key => ("DenseKey", "k"),
            Side::Value => ("DenseValue", "v"),
        };
        format!("{ty}<{}, {d}, {p}, {}>", self.dtype.cuda(), o(arr))
    }
    fn nmse(&self) -> f64 {
        dense_nmse(self.dtype)
    }
    fn bit_widths(&self) -> Option<Vec<(u32, f64)>> {
        Some(vec![(16, 1.0)])
    }
    fn per_warp_capable(&self, _d: usize, _p: usize) -> bool {
        self.dtype == DType::Fp16
    }
    fn is_dense(&self) -> bool {
        true
    }
    #[cfg(feature = "reference")]
    fn encode(&self, _d: usize, _tokens: usize, x: &[f32], _aux: &[f32], put: &mut dyn FnMut(&str, &[u8])) {
        let mut b = vec![0u8; x.len() * reference::ELEMENT_BYTES];
        reference::encode(self.dtype, x, &mut b);
        put(self.side.prefix(), &b);
    }
    #[cfg(feature = "reference")]
    fn decode<'a>(&self, _d: usize, _tokens: usize, get: &dyn Fn(&str) -> &'a [u8], _aux: &[f32]) -> Vec<f64> {
        reference::decode(self.dtype, get(self.side.prefix()))
    }
}
