//! `#[derive(KvTier)]`: a custom tier checked by the spec validator at compile time.

use std::fmt::Write as _;
use std::path::PathBuf;

use kvforge_spec::{Spec, SpecError};
use proc_macro2::TokenStream;
use quote::{format_ident, quote, ToTokens};
use syn::{DeriveInput, Lit};

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Int,
    Str,
}

/// Every `#[kv(...)]` key: name, literal kind, an example value for messages.
const KEYS: &[(&str, Kind, &str)] = &[
    ("name", Kind::Str, "\"my_tier\""),
    ("head_dim", Kind::Int, "128"),
    ("page", Kind::Int, "64"),
    ("alignment", Kind::Int, "128"),
    ("gqa", Kind::Int, "8"),
    ("dtype", Kind::Str, "\"fp16\""),
    ("key", Kind::Str, "\"int\""),
    ("key_bits", Kind::Int, "8"),
    ("key_block", Kind::Int, "16"),
    ("key_scale_dtype", Kind::Str, "\"fp32\""),
    ("key_group", Kind::Int, "16"),
    ("angle_bits", Kind::Int, "6"),
    ("radius_bits", Kind::Int, "8"),
    ("codebook", Kind::Str, "\"codebooks/sph_g16_b6.safetensors\""),
    ("value", Kind::Str, "\"int\""),
    ("value_bits", Kind::Int, "4"),
    ("value_group", Kind::Int, "16"),
    ("value_scale_dtype", Kind::Str, "\"fp16\""),
];

enum Value {
    Int(i64),
    Str(String),
}

struct Setting {
    name: &'static str,
    /// `name = literal`, for spans.
    tokens: TokenStream,
    value: Value,
}

#[derive(Default)]
struct Attrs {
    settings: Vec<Setting>,
    /// The first `#[kv(...)]` attribute, where errors about missing keys point.
    first: Option<TokenStream>,
}

impl Attrs {
    fn get(&self, name: &str) -> Option<&Setting> {
        self.settings.iter().find(|s| s.name == name)
    }
    fn int(&self, name: &str) -> Option<i64> {
        match self.get(name)?.value {
            Value::Int(v) => Some(v),
            Value::Str(_) => None,
        }
    }
    fn str(&self, name: &str) -> Option<&str> {
        match &self.get(name)?.value {
            Value::Str(v) => Some(v),
            Value::Int(_) => None,
        }
    }
}

fn unknown(name: &str) -> String {
    let hint = match name {
        "bits" => " (did you mean `key_bits` or `value_bits`?)".to_string(),
        "group" | "group_size" => " (did you mean `key_group` for a spherical key or `value_group` for int values?)".to_string(),
        "block" => " (did you mean `key_block`?)".to_string(),
        "scale_dtype" | "scale" => " (did you mean `key_scale_dtype` or `value_scale_dtype`?)".to_string(),
        "tokens" | "page_tokens" => " (did you mean `page`?)".to_string(),
        "head_dims" => " (did you mean `head_dim`?)".to_string(),
        _ => String::new(),
    };
    let valid: Vec<&str> = KEYS.iter().map(|k| k.0).collect();
    format!("unknown `kv` attribute `{name}`{hint}; valid: {}", valid.join(", "))
}

fn parse_attrs(input: &DeriveInput) -> syn::Result<Attrs> {
    let mut out = Attrs::default();
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("kv")) {
        if out.first.is_none() {
            out.first = Some(attr.to_token_stream());
        }
        attr.parse_nested_meta(|meta| {
            let shown = meta.path.to_token_stream().to_string().replace(' ', "");
            let Some(&(name, kind, example)) = KEYS.iter().find(|k| meta.path.is_ident(k.0)) else {
                return Err(meta.error(unknown(&shown)));
            };
            if out.get(name).is_some() {
                return Err(meta.error(format!("`{name}` is given twice")));
            }
            let lit: Lit = meta.value()?.parse().map_err(|e| {
                let what = if kind == Kind::Int { "an integer" } else { "a string" };
                syn::Error::new(e.span(), format!("`{name}` takes {what} literal, e.g. `{name} = {example}`"))
            })?;
            let value = match (kind, &lit) {
                (Kind::Int, Lit::Int(i)) => Value::Int(i.base10_parse::<i64>()?),
                (Kind::Str, Lit::Str(s)) => Value::Str(s.value()),
                (Kind::Int, _) => return Err(syn::Error::new_spanned(&lit, format!("`{name}` takes an integer literal, e.g. `{name} = {example}`"))),
                (Kind::Str, _) => return Err(syn::Error::new_spanned(&lit, format!("`{name}` takes a string literal, e.g. `{name} = {example}`"))),
            };
            let path = &meta.path;
            out.settings.push(Setting { name, tokens: quote!(#path = #lit), value });
            Ok(())
        })?;
    }
    Ok(out)
}

/// `MyTier` → `my_tier`, `Q8K4V` → `q8k4v`, `Int4Tier` → `int4_tier`.
fn snake(s: &str) -> String {
    let s = s.strip_prefix("r#").unwrap_or(s);
    let c: Vec<char> = s.chars().collect();
    let mut out = String::new();
    for (i, &ch) in c.iter().enumerate() {
        if ch.is_uppercase() && i > 0 {
            let prev = c[i - 1];
            let next_lower = c.get(i + 1).is_some_and(|n| n.is_lowercase());
            if prev.is_lowercase() || (prev.is_uppercase() && next_lower) || (prev.is_ascii_digit() && next_lower) {
                out.push('_');
            }
        }
        out.extend(ch.to_lowercase());
    }
    out
}

/// A TOML basic string.
fn toml_str(s: &str) -> String {
    let mut o = String::from('"');
    for ch in s.chars() {
        match ch {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            '\t' => o.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(o, "\\u{:04X}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// An inline scheme table from the settings with the given prefix.
fn scheme_table(a: &Attrs, scheme: &str, fields: &[(&str, &str)]) -> String {
    let mut parts = vec![format!("scheme = {}", toml_str(scheme))];
    for &(attr, key) in fields {
        match a.get(attr).map(|s| &s.value) {
            Some(Value::Int(v)) => parts.push(format!("{key} = {v}")),
            Some(Value::Str(v)) => parts.push(format!("{key} = {}", toml_str(v))),
            None => {}
        }
    }
    format!("{{ {} }}", parts.join(", "))
}

/// The attribute a spec error's field came from, and the one to point at when it is absent.
fn attr_of(field: &str) -> (String, &'static str) {
    if let Some(rest) = field.strip_prefix("tier[0]") {
        let rest = rest.trim_start_matches('.');
        if rest.is_empty() || rest == "name" {
            return ("name".into(), "name");
        }
        let (side, sub) = rest.split_once('.').unwrap_or((rest, "scheme"));
        let side: &'static str = if side == "value" { "value" } else { "key" };
        let attr = match sub {
            "scheme" => side.to_string(),
            "bits" | "group" | "block" | "scale_dtype" => format!("{side}_{sub}"),
            other => other.to_string(),
        };
        return (attr, side);
    }
    let attr = match field {
        "tier" => "key",
        "page.tokens" => "page",
        "page.alignment" => "alignment",
        "geometry.head_dims" => "head_dim",
        "geometry.gqa" => "gqa",
        "geometry.dtype" => "dtype",
        f if f.starts_with("kernels.combinations") => "angle_bits",
        _ => "key",
    };
    (attr.into(), "key")
}

pub fn expand(input: TokenStream) -> TokenStream {
    let input: DeriveInput = match syn::parse2(input) {
        Ok(i) => i,
        Err(e) => return e.to_compile_error(),
    };
    match expand_inner(&input) {
        Ok(t) => t,
        Err(e) => e.to_compile_error(),
    }
}

fn expand_inner(input: &DeriveInput) -> syn::Result<TokenStream> {
    let ident = &input.ident;
    let a = parse_attrs(input)?;
    let at_attr_or_ident = |msg: String| match &a.first {
        Some(t) => syn::Error::new_spanned(t, msg),
        None => syn::Error::new_spanned(ident, msg),
    };
    let Some(key) = a.str("key") else {
        return Err(at_attr_or_ident(format!("`#[derive(KvTier)]` on `{ident}` needs a key scheme: add `#[kv(key = \"...\")]` with one of fp16, bf16, int, spherical, drop")));
    };
    let Some(value) = a.str("value") else {
        return Err(at_attr_or_ident(format!("`#[derive(KvTier)]` on `{ident}` needs a value scheme: add `#[kv(value = \"...\")]` with one of fp16, bf16, int, drop")));
    };

    let tier_name = a.str("name").map(str::to_string).unwrap_or_else(|| snake(&ident.to_string()));
    let head_dim = a.int("head_dim").unwrap_or(128);
    let page = a.int("page").unwrap_or(64);
    let alignment = a.int("alignment").unwrap_or(128);
    let gqa = a.int("gqa").unwrap_or(8);
    let dtype = a.str("dtype").unwrap_or("fp16");

    // Where a spherical codebook is found: the spec text keeps the path as written and the
    // validator resolves it against the directory it was found under.
    let mut dir = PathBuf::from(".");
    let mut deps: Vec<String> = Vec::new();
    if key == "spherical" {
        if let Some(cb) = a.get("codebook") {
            let Value::Str(rel) = &cb.value else { unreachable!() };
            let (file, base) = crate::paths::resolve(rel, "codebook").map_err(|m| syn::Error::new_spanned(&cb.tokens, m))?;
            dir = base;
            deps.push(crate::paths::lit(&file));
        }
    }

    let key_table = scheme_table(
        &a,
        key,
        &[("key_bits", "bits"), ("key_block", "block"), ("key_scale_dtype", "scale_dtype"), ("key_group", "group"), ("angle_bits", "angle_bits"), ("radius_bits", "radius_bits"), ("codebook", "codebook")],
    );
    let value_table = scheme_table(&a, value, &[("value_bits", "bits"), ("value_group", "group"), ("value_scale_dtype", "scale_dtype")]);
    let tier_toml = format!("[[tier]]\nname = {}\nkey = {key_table}\nvalue = {value_table}\n", toml_str(&tier_name));
    let spec_toml = format!(
        "# Generated by #[derive(KvTier)] on `{ident}`.\n[spec]\nname = \"custom\"\n\n[geometry]\nhead_dims = [{head_dim}]\ngqa = [{gqa}]\ndtype = {}\n\n[page]\ntokens = {page}\nalignment = {alignment}\n\n{tier_toml}",
        toml_str(dtype)
    );

    let spec = Spec::parse(&spec_toml, &format!("#[derive(KvTier)] {ident}"), &dir).map_err(|e| spec_error(&a, ident, &e))?;
    let tier = &spec.tiers[1];
    let d = spec.geometry.head_dims[0];
    let seg = spec.segment(tier.id, d);

    let name = &tier.name;
    let code = tier.code(d).0;
    let bpt = tier.bytes_per_token(d, spec.page.tokens);
    let (seg_bytes, page_bytes, payload) = (seg.bytes, seg.page_bytes, seg.payload_bytes);
    let page_tokens = spec.page.tokens;
    let key_desc = tier.key.to_string();
    let value_desc = tier.value.to_string();
    let arrays = seg.arrays.iter().map(|arr| {
        let off = format_ident!("{}_OFFSET", arr.name.to_uppercase());
        let by = format_ident!("{}_BYTES", arr.name.to_uppercase());
        let (o, b) = (arr.offset, arr.bytes);
        let doc_o = format!("Offset of `{}` from the segment start ({} rows x {} B).", arr.name, arr.rows, arr.row_bytes);
        let doc_b = format!("Bytes of `{}`.", arr.name);
        quote! {
            #[doc = #doc_o]
            pub const #off: usize = #o;
            #[doc = #doc_b]
            pub const #by: usize = #b;
        }
    });
    let doc_bpt = format!("Payload + metadata bytes per token per head: K {key_desc}, V {value_desc}.");
    let (ig, tg, wc) = input.generics.split_for_impl();
    Ok(quote! {
        #(const _: &[u8] = include_bytes!(#deps);)*
        #[automatically_derived]
        impl #ig #ident #tg #wc {
            /// Tier name in the spec.
            pub const NAME: &'static str = #name;
            /// Short code of the tier's coding at `HEAD_DIM` (names kernels and files).
            pub const TIER_CODE: &'static str = #code;
            /// Head dim the layout consts are for.
            pub const HEAD_DIM: usize = #d;
            /// Tokens per page.
            pub const PAGE_TOKENS: usize = #page_tokens;
            #[doc = #doc_bpt]
            pub const BYTES_PER_TOKEN: f64 = #bpt;
            /// Payload + metadata bytes of one page segment, before alignment padding.
            pub const PAYLOAD_BYTES: usize = #payload;
            /// Segment bytes (structure of arrays, each array 16-byte aligned).
            pub const SEGMENT_BYTES: usize = #seg_bytes;
            /// Whole page: 16-byte header + segment, padded to the page alignment.
            pub const PAGE_BYTES: usize = #page_bytes;
            #(#arrays)*
            /// The `[[tier]]` table, to paste into a spec.
            pub const TIER_TOML: &'static str = #tier_toml;
            /// The one-tier spec the derive validated.
            pub const SPEC_TOML: &'static str = #spec_toml;
            /// The one-tier spec the derive validated (its `[[tier]]` table can be pasted into a
            /// spec; a `codebook` path there is relative to the spec file).
            pub fn spec_toml() -> &'static str {
                Self::SPEC_TOML
            }
        }
    })
}

fn spec_error(a: &Attrs, ident: &syn::Ident, e: &SpecError) -> syn::Error {
    let (attr, side) = attr_of(&e.field);
    if let Some(s) = a.get(&attr) {
        return syn::Error::new_spanned(&s.tokens, &e.message);
    }
    // The offending setting was left out (a required field, a default): point at the scheme.
    let msg = if KEYS.iter().any(|k| k.0 == attr) && attr != side { format!("{} (set it with `{attr} = ...`)", e.message) } else { e.message.clone() };
    match a.get(side).filter(|_| attr != "name") {
        Some(s) => syn::Error::new_spanned(&s.tokens, msg),
        None => syn::Error::new_spanned(ident, msg),
    }
}
