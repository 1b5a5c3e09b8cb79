//! Coding schemes as units. Each scheme is one folder here (`dense/`, `int/`, `spherical/`,
//! `mixed/`, `rotated/`, `drop/`) that owns everything the scheme is: the fields of its spec table and
//! their validation, its page-segment arrays and byte cost, its variant-id code and C++ codec
//! type, the side tables it needs on the device, and (with the `reference` feature) its f64
//! reference encode/decode. The generic code (spec validation, [`crate::SegmentLayout`],
//! [`crate::TierCode`], the generator's `TierDef`, the runtime's side tables) asks a scheme
//! through the [`Codec`] trait; [`REGISTRY`] maps the name in `scheme = "..."` to the
//! scheme's parser. `docs/ADDING_A_SCHEME.md` walks through one codec and lists what a new
//! scheme adds.
//!
//! One trait serves keys and values: the C++ side already has one codec struct per (scheme,
//! side) (`IntKey`, `IntValue`), and the two sides of one scheme share neither fields nor
//! arrays (per-channel key blocks, per-token value groups), so each side is its own codec
//! struct and [`Codec::side`] says which it is.
//!
//! # Adding a scheme
//!
//! A new scheme is its folder here, its header `templates/include/kvforge/codecs/<scheme>.cuh`
//! (found by kvforge-gen's build script, included by the generated `codecs.cuh`), and one
//! line in [`REGISTRY`]. Its folder declares a [`Registration`]: the names `scheme = "..."`
//! takes, the `fields` its tables may have (a field no scheme lists is an unknown field of the
//! spec), and its parsers. A parser reads its table through [`ParseCtx`]:
//!
//! - typed accessors by field name, `None` when the field is absent and the TOML reader's
//!   located "invalid type" error when it has another type: [`ParseCtx::int`],
//!   [`ParseCtx::float`], [`ParseCtx::string`], [`ParseCtx::boolean`],
//!   [`ParseCtx::float_table`] (a table of numbers, each entry with its span),
//!   [`ParseCtx::value`] (the [`RawValue`] as written);
//! - [`ParseCtx::only`] rejects the fields this side does not take, [`ParseCtx::need`] turns
//!   an absent field into "scheme `x` needs `f` (what it is)", [`ParseCtx::err`] makes any
//!   other error at a span; [`ParseCtx::block`], [`ParseCtx::scale`],
//!   [`ParseCtx::granularity`] and [`ParseCtx::divisors`] are fields several schemes share;
//! - the spec's `head_dims`, `page_tokens` and `gqa`, and [`ParseCtx::dir`] for files.
//!
//! It returns its codec as [`KeyScheme::Codec`] / [`ValueScheme::Codec`] holding a
//! [`crate::SharedCodec`]; no enum names it. For example (a `seed` would be in the
//! registration's `fields`):
//!
//! ```ignore
//! fn parse_key(ctx: &ParseCtx<'_>) -> Result<KeyScheme, SpecError> {
//!     ctx.only(&["bits", "seed"])?;
//!     let b = ctx.need(ctx.int("bits")?, "bits", "2, 3 or 4")?;
//!     if !(2..=4).contains(b.get_ref()) {
//!         return ctx.err(b.span(), "bits", format!("bits {} is not supported; valid: 2, 3, 4", b.get_ref()));
//!     }
//!     let seed = ctx.int("seed")?.map_or(0, |s| *s.get_ref() as u64);
//!     Ok(KeyScheme::Codec(SharedCodec::new(RotatedKey { bits: *b.get_ref() as u32, seed })))
//! }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use toml::Spanned;

use crate::basis::Basis;
use crate::error::{toml_words, Locator, SpecError, SpecErrorKind};
use crate::raw::RawScheme;
pub use crate::raw::RawValue;
use crate::scheme::{KeyScheme, ScaleDType, ValueScheme};

#[cfg(feature = "reference")]
pub mod bits;
pub mod dense;
pub mod drop;
#[cfg(feature = "reference")]
mod error;
pub mod int;
pub mod mixed;
pub mod rotated;
pub mod spherical;

#[cfg(feature = "reference")]
pub use error::RefError;

/// Which half of a token a codec stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    Key,
    Value,
}

impl Side {
    /// Prefix of the side's segment arrays (`k`, `v`).
    pub fn prefix(self) -> &'static str {
        match self {
            Side::Key => "k",
            Side::Value => "v",
        }
    }
}

/// One array of a codec's part of a page segment: `rows` rows of `row_bytes` bytes.
/// [`crate::SegmentLayout`] places the arrays in order, each 16-byte aligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArraySpec {
    /// Name in the domain (`k_codes`, `v_scale`, ...); unique within a tier's segment.
    pub name: &'static str,
    pub rows: usize,
    pub row_bytes: usize,
}

/// Element type of a side table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SideElem {
    F32,
    U16,
}

impl SideElem {
    pub fn bytes(self) -> usize {
        match self {
            SideElem::F32 => 4,
            SideElem::U16 => 2,
        }
    }
    /// The C++ element type.
    pub fn cuda(self) -> &'static str {
        match self {
            SideElem::F32 => "float",
            SideElem::U16 => "unsigned short",
        }
    }
}

/// Where a side table's contents come from when the cache is created.
#[derive(Clone, Debug, PartialEq)]
pub enum SideInit {
    /// Filled from the spec, the same for every kv head (the spherical codebooks).
    Spec(Vec<f32>),
    /// Set by the caller (or by the runtime from the first pages coded) before any page is
    /// coded into or read from the tier (the spherical radius scales).
    Required,
    /// Set by the caller; until then a null pointer on the device, which the codec's C++ type
    /// reads as its default (the mixed keys' channel order: the identity).
    Optional,
}

/// A per-(tier, kv head) array a codec needs on the device beside the pages: codebooks,
/// radius scales and channel orders today. The decode and transcode kernels find it in the
/// params' `side` table at `[tier][slot]`, where `slot` is its index in
/// [`Codec::side_tables`] (keys first, then values: see [`side_slots`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SideTable {
    /// Name for messages and runtime accessors (`codebook`, `radius_scale`, `channel_order`).
    pub name: &'static str,
    pub elem: SideElem,
    /// Elements per (tier, kv head) at the head dim the codec was asked at.
    pub len: usize,
    pub init: SideInit,
}

/// Side-table slots of a tier: at most this many per tier (keys' then values' tables).
pub const SIDE_SLOTS: usize = 2;

/// A codec: one side of one coding scheme with its parameters. A method added here with a
/// default body must also be forwarded by [`crate::SharedCodec`] (`scheme.rs`), or codecs held
/// in one answer with the default; `shared_codec_forwards_everything` compares them.
pub trait Codec: fmt::Display {
    /// Name in `scheme = "..."` (dense codecs name their element type).
    fn scheme(&self) -> &'static str;
    fn side(&self) -> Side;
    /// This side's part of the tier code in variant ids and file names (`int8c16f32`).
    fn code(&self, d: usize) -> String;
    /// Arrays of the page segment of `tokens` tokens at head dim `d`, in storage order.
    fn arrays(&self, d: usize, tokens: usize) -> Vec<ArraySpec>;
    /// Payload and metadata bytes of a page segment (the scheme's cost, written from its
    /// definition; a registry test checks it against [`Codec::arrays`]).
    fn page_bytes(&self, d: usize, tokens: usize) -> usize;
    /// The C++ codec type of `templates/include/kvforge/codecs/<scheme>.cuh`, with its array
    /// offsets from `offset(name)` (the segment's offsets, 0 for an absent array).
    fn cpp_type(&self, d: usize, tokens: usize, offset: &dyn Fn(&str) -> usize) -> String;
    /// The controllers' distortion proxy: the normalised squared error
    /// `E‖x − x̂‖² / E‖x‖²` this codec adds on Gaussian data (1 for a dropped token).
    fn nmse(&self) -> f64;
    /// The share of the side's elements stored at each bit width, `(bits, share)` (16: dense,
    /// 0: dropped), for controllers whose distortion tables are indexed by width (RDKV);
    /// `None` for a codec that is not a per-element width (spherical).
    fn bit_widths(&self) -> Option<Vec<(u32, f64)>>;
    /// Side tables this codec reads on the device, in slot order.
    fn side_tables(&self, _d: usize) -> Vec<SideTable> {
        Vec::new()
    }
    /// Evicted: no bytes, never attended.
    fn is_drop(&self) -> bool {
        false
    }
    /// Extra bytes that identify the codec beyond its spec text (the codebook's hash), for
    /// the spec hash.
    fn content_hash(&self) -> Option<&str> {
        None
    }
    /// The basis the codec codes rows in: [`Basis::Identity`] for rows as they come; a
    /// rotation the whole spec then stores every tier in ([`crate::Spec::basis`]).
    fn basis(&self) -> Basis {
        Basis::Identity
    }
    /// `(groups, entries)` of the per-query lookup table of one query head, for codecs that
    /// score through one (spherical keys).
    fn lut_shape(&self, _d: usize) -> Option<(usize, usize)> {
        None
    }
    /// Floats of the per-query lookup table one query head needs.
    fn lut_floats_per_head(&self, d: usize) -> usize {
        self.lut_shape(d).map_or(0, |(g, e)| g * e)
    }
    /// Whether the codec takes the per-warp decode layout (`WARP` of its C++ type) at head
    /// dim `d` and `p` page tokens.
    fn per_warp_capable(&self, _d: usize, _p: usize) -> bool {
        false
    }
    /// Whether a decode variant holding this (key) codec should take the per-warp layout when
    /// all its tiers can ([`Codec::per_warp_capable`]): codecs whose dequantisation dominates a
    /// page (integer and rotated keys). Variants of fp16 tiers alone keep the block layout.
    fn prefers_per_warp(&self) -> bool {
        false
    }
    /// Whether the per-warp layout scores this key codec on integer tensor cores (int8 keys
    /// against int8 query fragments, `IMMA` of the C++ type): the variant's shared memory then
    /// holds those fragments beside the fp16 ones.
    fn int8_keys(&self) -> bool {
        false
    }
    /// Whether the codec stores elements as they are (fp16, bf16): variants whose tiers (the
    /// tail aside) are all dense on both sides take the spec's `kernels.dense` launch shape.
    fn is_dense(&self) -> bool {
        false
    }
    /// Shared-memory bytes the block layout's tensor-core scorer of this key codec folds the
    /// query into once per page (`Key::bfrag_bytes<GQA, NWARPS>()` of its C++ type) for head
    /// dim `d`, `p` page tokens, `gqa` query heads and `warps` warps.
    fn bfrag_bytes(&self, _d: usize, _p: usize, _gqa: usize, _warps: usize) -> usize {
        0
    }
    /// Whether the codec codes a transcode slice as whole channels (`SLICE_CHANNELS`: a scale
    /// and zero per channel per block of tokens) rather than whole tokens.
    fn slices_channels(&self) -> bool {
        false
    }
    /// Scratch bytes the codec's `encode` of one transcode slice needs (a page of `p` tokens
    /// cut into `split` slices at head dim `d`; `Key::SCRATCH` of its C++ type).
    fn transcode_scratch(&self, _d: usize, _p: usize, _split: usize) -> usize {
        16
    }
    /// Checks that the codec can code `tokens` tokens at head dim `d` with `aux`, this head's
    /// caller-set f32 side table (the spherical radius scales; ignored by codecs without
    /// one). Side tables the codec fills from the spec (codebooks) it reads from itself.
    #[cfg(feature = "reference")]
    fn check(&self, _d: usize, _tokens: usize, _aux: &[f32]) -> Result<(), RefError> {
        Ok(())
    }
    /// f64 reference encode of `[tokens][d]` rows `x` (checked by [`Codec::check`]), handing
    /// each array of [`Codec::arrays`] to `put`.
    #[cfg(feature = "reference")]
    fn encode(&self, d: usize, tokens: usize, x: &[f32], aux: &[f32], put: &mut dyn FnMut(&str, &[u8]));
    /// f64 reference decode of the arrays `get` returns by name: `[tokens][d]` rows (empty
    /// for drop).
    #[cfg(feature = "reference")]
    fn decode<'a>(&self, d: usize, tokens: usize, get: &dyn Fn(&str) -> &'a [u8], aux: &[f32]) -> Vec<f64>;
}

/// Side-table slots of a tier: its key codec's tables, then its value codec's.
pub fn side_slots(key: &dyn Codec, value: &dyn Codec, d: usize) -> Vec<SideTable> {
    let mut s = key.side_tables(d);
    s.extend(value.side_tables(d));
    assert!(s.len() <= SIDE_SLOTS, "a tier has at most {SIDE_SLOTS} side tables");
    s
}

/// Parses one side of one scheme's spec table.
pub type KeyParser = fn(&ParseCtx<'_>) -> Result<KeyScheme, SpecError>;
pub type ValueParser = fn(&ParseCtx<'_>) -> Result<ValueScheme, SpecError>;

/// One registered scheme: the names `scheme = "..."` takes for it, the fields its tables may
/// have, and its parsers (`None`: the scheme does not code that side).
pub struct Registration {
    pub names: &'static [&'static str],
    /// Every field its key or value table may have besides `scheme`. A field no scheme lists
    /// is an unknown field of the spec (a TOML error); one another scheme lists is left for
    /// the parser's [`ParseCtx::only`], which names the fields of that side.
    pub fields: &'static [&'static str],
    pub key: Option<KeyParser>,
    pub value: Option<ValueParser>,
    /// Sample `(key, value)` tables of a tier that uses the scheme (paths relative to
    /// `specs/`): the registry test parses each and checks the codecs' layout against their
    /// cost and their reference round trip.
    pub examples: &'static [(&'static str, &'static str)],
}

/// Every scheme, one line each, in the order error messages list them.
pub static REGISTRY: &[Registration] = &[dense::REGISTRATION, int::REGISTRATION, spherical::REGISTRATION, mixed::REGISTRATION, rotated::REGISTRATION, drop::REGISTRATION];

/// `scheme` and every field some registered scheme takes, in registry order: what a scheme
/// table may contain (the spec reader rejects anything else as an unknown field, listing
/// these) and the order [`ParseCtx::only`] checks fields in.
pub fn known_fields() -> &'static [&'static str] {
    static KNOWN: OnceLock<Vec<&'static str>> = OnceLock::new();
    KNOWN.get_or_init(|| {
        let mut known = vec!["scheme"];
        for f in REGISTRY.iter().flat_map(|r| r.fields) {
            if !known.contains(f) {
                known.push(f);
            }
        }
        known
    })
}

fn registered(name: &str) -> Option<&'static Registration> {
    REGISTRY.iter().find(|r| r.names.contains(&name))
}

fn valid_names(side: Side) -> String {
    let names: Vec<&str> = REGISTRY
        .iter()
        .filter(|r| match side {
            Side::Key => r.key.is_some(),
            Side::Value => r.value.is_some(),
        })
        .flat_map(|r| r.names.iter().copied())
        .collect();
    names.join(", ")
}

/// What a scheme parser sees: its spec table, where it is, and the spec's geometry. The
/// typed accessors ([`ParseCtx::int`], [`ParseCtx::string`], ...) read one field by name and
/// answer a located error when it has the wrong TOML type; [`ParseCtx::need`] turns an absent
/// field into the error that names it, [`ParseCtx::err`] makes any other located error.
pub struct ParseCtx<'a> {
    pub(crate) loc: &'a Locator<'a>,
    pub(crate) dir: &'a Path,
    pub(crate) raw: &'a Spanned<RawScheme>,
    /// `tier[i].key` or `tier[i].value`.
    pub field: &'a str,
    pub head_dims: &'a [usize],
    pub page_tokens: usize,
    pub gqa: &'a [usize],
}

type R<T> = Result<T, SpecError>;

impl<'a> ParseCtx<'a> {
    /// The scheme name as written.
    pub fn name(&self) -> &str {
        self.raw.get_ref().scheme.get_ref()
    }
    /// Span of the `scheme = "..."` value.
    pub fn scheme_span(&self) -> Range<usize> {
        self.raw.get_ref().scheme.span()
    }
    /// Span of the whole table (where a missing field is reported).
    pub fn table_span(&self) -> Range<usize> {
        self.raw.span()
    }
    /// Directory spec-relative paths resolve against.
    pub fn dir(&self) -> &Path {
        self.dir
    }

    /// A located error at `span` for `field.<name>` (`name` empty: the table's own field).
    pub fn err<T>(&self, span: Range<usize>, name: &str, msg: impl Into<String>) -> R<T> {
        Err(self.error(SpecErrorKind::Invalid, span, name, msg))
    }

    pub fn error(&self, kind: SpecErrorKind, span: Range<usize>, name: &str, msg: impl Into<String>) -> SpecError {
        let field = if name.is_empty() { self.field.to_string() } else { format!("{}.{name}", self.field) };
        self.loc.error(kind, Some(span), &field, msg)
    }

    /// Rejects fields the scheme does not take (`allowed`, a subset of its registration's
    /// `fields`), in the order [`known_fields`] lists them.
    pub fn only(&self, allowed: &[&str]) -> R<()> {
        debug_assert!(allowed.iter().all(|f| registered(self.name()).is_some_and(|r| r.fields.contains(f))), "scheme `{}` takes {allowed:?}: every field must be in its Registration::fields", self.name());
        let fields = &self.raw.get_ref().fields;
        for &name in known_fields() {
            if let Some(v) = fields.get(name) {
                if !allowed.contains(&name) {
                    let valid = if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") };
                    return self.err(v.span(), name, format!("scheme `{}` takes no `{name}`; its fields: {valid}", self.name()));
                }
            }
        }
        Ok(())
    }

    /// A required field, or the error (at the table) that names it and `what` it is.
    pub fn need<T>(&self, v: Option<T>, name: &str, what: &str) -> R<T> {
        match v {
            Some(v) => Ok(v),
            None => self.err(self.raw.span(), name, format!("scheme `{}` needs `{name}` ({what})", self.name())),
        }
    }

    /// The field `name` as written, any type (`None`: absent).
    pub fn value(&self, name: &str) -> Option<&'a Spanned<RawValue>> {
        debug_assert!(known_fields().contains(&name), "field `{name}` is in no Registration::fields");
        self.raw.get_ref().fields.get(name)
    }

    /// An integer field.
    pub fn int(&self, name: &str) -> R<Option<Spanned<i64>>> {
        self.value(name).map(|v| self.typed(name, v, "i64", |x| if let RawValue::Integer(i) = x { Some(*i) } else { None })).transpose()
    }

    /// A number field (an integer reads as a float, as TOML's reader does).
    pub fn float(&self, name: &str) -> R<Option<Spanned<f64>>> {
        self.value(name).map(|v| self.typed(name, v, "f64", as_f64)).transpose()
    }

    /// A string field.
    pub fn string(&self, name: &str) -> R<Option<Spanned<String>>> {
        self.value(name).map(|v| self.typed(name, v, "a string", |x| if let RawValue::String(s) = x { Some(s.clone()) } else { None })).transpose()
    }

    /// A boolean field.
    pub fn boolean(&self, name: &str) -> R<Option<Spanned<bool>>> {
        self.value(name).map(|v| self.typed(name, v, "a boolean", |x| if let RawValue::Boolean(b) = x { Some(*b) } else { None })).transpose()
    }

    /// A table of numbers (`channels = { 8 = 0.25, 4 = 0.5 }`), keys in string order, each
    /// entry with its own span.
    pub fn float_table(&self, name: &str) -> R<Option<Spanned<BTreeMap<String, Spanned<f64>>>>> {
        let Some(v) = self.value(name) else { return Ok(None) };
        let RawValue::Table(t) = v.get_ref() else { return Err(self.type_error(name, v, "a map")) };
        let mut out = BTreeMap::new();
        for (k, x) in t {
            out.insert(k.clone(), self.typed(&format!("{name}.{k}"), x, "f64", as_f64)?);
        }
        Ok(Some(Spanned::new(v.span(), out)))
    }

    /// `v` as a `T`, or the TOML reader's "invalid type" error for `expected` (serde's word for
    /// the type, turned into TOML's).
    fn typed<T>(&self, name: &str, v: &Spanned<RawValue>, expected: &str, get: impl Fn(&RawValue) -> Option<T>) -> R<Spanned<T>> {
        match get(v.get_ref()) {
            Some(x) => Ok(Spanned::new(v.span(), x)),
            None => Err(self.type_error(name, v, expected)),
        }
    }

    fn type_error(&self, name: &str, v: &Spanned<RawValue>, expected: &str) -> SpecError {
        self.error(SpecErrorKind::Syntax, v.span(), name, toml_words(&format!("invalid type: {}, expected {expected}", v.get_ref().unexpected())))
    }

    /// `scale_dtype` (default fp16).
    pub fn scale(&self) -> R<ScaleDType> {
        match self.string("scale_dtype")? {
            None => Ok(ScaleDType::Fp16),
            Some(v) => match v.get_ref().as_str() {
                "fp16" => Ok(ScaleDType::Fp16),
                "fp32" => Ok(ScaleDType::Fp32),
                o => self.err(v.span(), "scale_dtype", format!("scale_dtype `{o}` is not supported; valid: fp16, fp32")),
            },
        }
    }

    /// `block`, as a divisor of the page's tokens.
    pub fn block(&self) -> R<usize> {
        let b = self.need(self.int("block")?, "block", "tokens per scale block, dividing the page")?;
        let block = *b.get_ref();
        let tokens = self.page_tokens;
        if block <= 0 || tokens as i64 % block != 0 {
            let valid: Vec<String> = (1..=tokens).filter(|b| tokens.is_multiple_of(*b)).map(|b| b.to_string()).collect();
            return self.err(b.span(), "block", format!("block {block} does not divide page tokens {tokens}; valid: {}", valid.join(", ")));
        }
        Ok(block as usize)
    }

    /// The one granularity kvforge's kernels support for this side (`valid`'s first word),
    /// if given.
    pub fn granularity(&self, side: &str, valid: &str) -> R<()> {
        match self.string("granularity")? {
            Some(g) if valid.split_whitespace().next() != Some(g.get_ref().as_str()) => self.err(g.span(), "granularity", format!("{side} granularity `{}` is not supported; valid: {valid}", g.get_ref())),
            _ => Ok(()),
        }
    }

    /// Group sizes that divide every head dim and are multiples of `multiple`, for messages.
    pub fn divisors(&self, multiple: usize) -> String {
        let dims = self.head_dims;
        let min = dims.iter().copied().min().unwrap_or(0);
        let valid: Vec<String> = (multiple..=min).step_by(multiple).filter(|g| dims.iter().all(|d| d % g == 0)).map(|g| g.to_string()).collect();
        valid.join(", ")
    }
}

fn as_f64(x: &RawValue) -> Option<f64> {
    match x {
        RawValue::Float(f) => Some(*f),
        RawValue::Integer(i) => Some(*i as f64),
        _ => None,
    }
}

/// Parses a tier's key table through the registry.
pub(crate) fn parse_key(ctx: &ParseCtx<'_>) -> R<KeyScheme> {
    let name = ctx.name();
    match registered(name).and_then(|r| r.key) {
        Some(parse) => parse(ctx),
        None => ctx.err(ctx.scheme_span(), "scheme", format!("unknown key scheme `{name}`; valid: {}", valid_names(Side::Key))),
    }
}

/// Parses a tier's value table through the registry.
pub(crate) fn parse_value(ctx: &ParseCtx<'_>) -> R<ValueScheme> {
    let name = ctx.name();
    match registered(name) {
        Some(Registration { value: Some(parse), .. }) => parse(ctx),
        Some(_) => ctx.err(ctx.scheme_span(), "scheme", format!("{name} coding is for keys; valid value schemes: {}", valid_names(Side::Value))),
        None => ctx.err(ctx.scheme_span(), "scheme", format!("unknown value scheme `{name}`; valid: {}", valid_names(Side::Value))),
    }
}
