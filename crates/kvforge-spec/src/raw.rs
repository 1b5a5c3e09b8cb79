//! The TOML shape of a spec, exactly as written. Fields that are cross-checked keep their
//! spans so errors can point at them. Only `validate` turns this into a [`crate::Spec`].

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use toml::Spanned;

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RawSpec {
    pub spec: RawMeta,
    pub geometry: RawGeometry,
    #[serde(default)]
    pub page: RawPage,
    #[serde(rename = "tier")]
    pub tiers: Spanned<Vec<RawTier>>,
    #[serde(default)]
    pub kernels: RawKernels,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RawMeta {
    pub name: Spanned<String>,
    #[serde(default)]
    pub description: String,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RawGeometry {
    pub head_dims: Spanned<Vec<Spanned<i64>>>,
    pub gqa: Spanned<Vec<Spanned<i64>>>,
    #[serde(default = "fp16")]
    pub dtype: Spanned<String>,
}

fn fp16() -> Spanned<String> {
    Spanned::new(0..0, "fp16".to_string())
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct RawPage {
    pub tokens: Option<Spanned<i64>>,
    pub alignment: Option<Spanned<i64>>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct RawTier {
    pub name: Spanned<String>,
    pub key: Spanned<RawScheme>,
    pub value: Spanned<RawScheme>,
}

/// One scheme table: `scheme` and every other field by name, each with its span, so that a
/// codec's parser reads the fields it takes (`ParseCtx::int("bits")`, ...) and errors point at
/// them. A field no registered scheme takes ([`crate::codecs::known_fields`]) is rejected here
/// as an unknown field, with the same message and location as any other table's; a field
/// another scheme takes is left for the parser's `ParseCtx::only`.
///
/// Deserialized by hand: serde's `flatten` buffers the values, and a `Spanned` field then
/// fails to deserialize (see the test `flatten_loses_spans`).
#[derive(Debug)]
pub struct RawScheme {
    pub scheme: Spanned<String>,
    pub fields: BTreeMap<String, Spanned<RawValue>>,
}

impl RawScheme {
    /// Span of the value of field `name`, if given.
    pub fn span_of(&self, name: &str) -> Option<std::ops::Range<usize>> {
        self.fields.get(name).map(|v| v.span())
    }
}

/// A TOML value whose elements keep their spans (`toml::Value` keeps none), so that an error
/// about one entry of `channels = { 8 = 0.3 }` points at that entry.
#[derive(Debug, Clone, PartialEq)]
pub enum RawValue {
    Integer(i64),
    Float(f64),
    String(String),
    Boolean(bool),
    Array(Vec<Spanned<RawValue>>),
    /// A table (and a datetime, which the TOML reader hands over as a one-entry table).
    Table(BTreeMap<String, Spanned<RawValue>>),
}

impl RawValue {
    /// What the value is, in serde's words (`string "8"`, `integer `3``): the start of an
    /// "invalid type" message, like the TOML reader's.
    pub fn unexpected(&self) -> de::Unexpected<'_> {
        match self {
            RawValue::Integer(i) => de::Unexpected::Signed(*i),
            RawValue::Float(f) => de::Unexpected::Float(*f),
            RawValue::String(s) => de::Unexpected::Str(s),
            RawValue::Boolean(b) => de::Unexpected::Bool(*b),
            RawValue::Array(_) => de::Unexpected::Seq,
            RawValue::Table(_) => de::Unexpected::Map,
        }
    }
}

impl<'de> Deserialize<'de> for RawValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawValue;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a TOML value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<RawValue, E> {
                Ok(RawValue::Boolean(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<RawValue, E> {
                Ok(RawValue::Integer(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawValue, E> {
                i64::try_from(v).map(RawValue::Integer).map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &"an integer"))
            }
            fn visit_f64<E>(self, v: f64) -> Result<RawValue, E> {
                Ok(RawValue::Float(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<RawValue, E> {
                Ok(RawValue::String(v.to_string()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<RawValue, A::Error> {
                let mut out = Vec::new();
                while let Some(x) = a.next_element()? {
                    out.push(x);
                }
                Ok(RawValue::Array(out))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<RawValue, A::Error> {
                let mut out = BTreeMap::new();
                while let Some((k, v)) = a.next_entry()? {
                    out.insert(k, v);
                }
                Ok(RawValue::Table(out))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for RawScheme {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        /// A field name, rejected while it is read (so the error carries the key's span)
        /// unless some registered scheme takes it.
        struct Key;
        impl<'de> DeserializeSeed<'de> for Key {
            type Value = String;
            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
                d.deserialize_str(self)
            }
        }
        impl Visitor<'_> for Key {
            type Value = String;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
                let known = crate::codecs::known_fields();
                if known.contains(&v) {
                    Ok(v.to_string())
                } else {
                    Err(E::unknown_field(v, known))
                }
            }
        }
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawScheme;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                // The words the spec reader turns into "a scheme is a table like ...".
                f.write_str("struct RawScheme")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<RawScheme, A::Error> {
                let mut scheme = None;
                let mut fields = BTreeMap::new();
                while let Some(k) = a.next_key_seed(Key)? {
                    if k == "scheme" {
                        scheme = Some(a.next_value()?);
                    } else {
                        fields.insert(k, a.next_value()?);
                    }
                }
                let scheme = scheme.ok_or_else(|| de::Error::missing_field("scheme"))?;
                Ok(RawScheme { scheme, fields })
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct RawKernels {
    pub combinations: Option<Spanned<Vec<Spanned<Vec<Spanned<String>>>>>>,
    pub split_k: Option<bool>,
    pub warps: Option<Spanned<i64>>,
    pub tensor_core_values: Option<bool>,
    pub certified: Option<Spanned<bool>>,
    pub ctas_per_sm: Option<Spanned<i64>>,
    pub stage_kib: Option<Spanned<i64>>,
    pub dense: Option<Spanned<RawShape>>,
    pub ladder: Option<Spanned<RawShape>>,
}

/// `kernels.dense` / `kernels.ladder`: the launch shape of decode variants whose tiers are all
/// dense / of launches of several tiers.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct RawShape {
    pub warps: Option<Spanned<i64>>,
    pub ctas_per_sm: Option<Spanned<i64>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize, Debug)]
    struct Doc {
        key: Spanned<RawScheme>,
    }

    #[test]
    fn scheme_fields_keep_their_spans() {
        let src = "key = { scheme = \"mixed\", block = 64, channels = { 8 = 0.25, 4 = 0.5 } }";
        let d: Doc = toml::from_str(src).unwrap();
        let k = d.key.get_ref();
        assert_eq!(&src[k.scheme.span()], "\"mixed\"");
        assert_eq!(&src[k.span_of("block").unwrap()], "64");
        let RawValue::Table(ch) = k.fields["channels"].get_ref() else { panic!("{k:?}") };
        assert_eq!(&src[ch["4"].span()], "0.5");
        assert_eq!(ch["8"].get_ref(), &RawValue::Float(0.25));
    }

    #[test]
    fn unknown_and_missing_fields_are_toml_errors() {
        let e = toml::from_str::<Doc>("key = { scheme = \"int\", blocks = 2 }").unwrap_err();
        assert!(e.message().starts_with("unknown field `blocks`, expected one of `scheme`, `bits`"), "{e}");
        assert_eq!(e.span(), Some(24..30));
        let e = toml::from_str::<Doc>("key = { bits = 2 }").unwrap_err();
        assert!(e.message().contains("missing field `scheme`"), "{e}");
    }

    /// Why [`RawScheme`] is deserialized by hand: `#[serde(flatten)]` buffers the values
    /// through serde's own content type, where toml's spans cannot be read.
    #[test]
    fn flatten_loses_spans() {
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct Flat {
            scheme: String,
            #[serde(flatten)]
            rest: BTreeMap<String, Spanned<toml::Value>>,
        }
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct FlatDoc {
            key: Flat,
        }
        // The span wrapper meets a buffered value: "invalid type: integer `8`, expected a
        // spanned value".
        let e = toml::from_str::<FlatDoc>("key = { scheme = \"int\", bits = 8 }").err().expect("flatten kept toml's spans: RawScheme could derive Deserialize");
        assert!(e.message().contains("expected a spanned value"), "{e}");
    }
}
