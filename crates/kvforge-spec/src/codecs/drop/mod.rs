//! Eviction: a dropped token has no bytes and is never attended. Both sides of a tier drop or
//! neither (the spec checks). C++: `DropKey` / `DropValue` in `codecs/drop.cuh`.

use std::fmt;

use super::{ArraySpec, Codec, ParseCtx, Registration, Side};
use crate::error::SpecError;
use crate::scheme::{KeyScheme, ValueScheme};

pub const REGISTRATION: Registration = Registration { names: &["drop"], fields: &[], key: Some(parse_key), value: Some(parse_value), examples: &[(r#"{ scheme = "drop" }"#, r#"{ scheme = "drop" }"#)] };

/// The drop codec of one side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Drop {
    pub side: Side,
}

fn parse_key(ctx: &ParseCtx<'_>) -> Result<KeyScheme, SpecError> {
    ctx.only(&[])?;
    Ok(KeyScheme::Drop)
}

fn parse_value(ctx: &ParseCtx<'_>) -> Result<ValueScheme, SpecError> {
    ctx.only(&[])?;
    Ok(ValueScheme::Drop)
}

impl fmt::Display for Drop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("drop")
    }
}

impl Codec for Drop {
    fn scheme(&self) -> &'static str {
        "drop"
    }
    fn side(&self) -> Side {
        self.side
    }
    fn code(&self, _d: usize) -> String {
        "drop".into()
    }
    fn arrays(&self, _d: usize, _tokens: usize) -> Vec<ArraySpec> {
        Vec::new()
    }
    fn page_bytes(&self, _d: usize, _tokens: usize) -> usize {
        0
    }
    fn cpp_type(&self, _d: usize, _p: usize, _o: &dyn Fn(&str) -> usize) -> String {
        match self.side {
            Side::Key => "DropKey".into(),
            Side::Value => "DropValue".into(),
        }
    }
    fn nmse(&self) -> f64 {
        1.0
    }
    fn bit_widths(&self) -> Option<Vec<(u32, f64)>> {
        Some(vec![(0, 1.0)])
    }
    fn is_drop(&self) -> bool {
        true
    }
    #[cfg(feature = "reference")]
    fn encode(&self, _d: usize, _tokens: usize, _x: &[f32], _aux: &[f32], _put: &mut dyn FnMut(&str, &[u8])) {}
    #[cfg(feature = "reference")]
    fn decode<'a>(&self, _d: usize, _tokens: usize, _get: &dyn Fn(&str) -> &'a [u8], _aux: &[f32]) -> Vec<f64> {
        Vec::new()
    }
}
