//! # kvforge-macros: kernels and tiers at compile time
//!
//! Two macros for crates that use kvforge without running its generator:
//!
//! * [`kernels!`] embeds one spec's kernel table and page layouts, with every kernel's CUDA
//!   source as a string literal. No build script, no `kernels-generated/` directory.
//! * [`#[derive(KvTier)]`](derive@KvTier) describes one custom tier with attributes, validates
//!   it with the spec validator while the crate compiles, and yields its byte costs, page
//!   layout and the TOML to paste into a spec.
//!
//! ## Paths
//!
//! Both macros resolve a relative path (`kernels!`'s spec, `KvTier`'s `codebook`) against the
//! invoking crate's directory (`CARGO_MANIFEST_DIR`), then against each directory above it,
//! and take the first that holds the file. A crate anywhere in the kvforge workspace can
//! therefore write `"specs/spherical.toml"` and reach the workspace's `specs/`. The expansion
//! `include_bytes!`s the files it read, so cargo rebuilds the crate when they change.
//!
//! ## `kernels!`
//!
//! ```
//! mod certified {
//!     kvforge_macros::kernels!("specs/certified.toml");
//! }
//!
//! assert_eq!(certified::SPEC_NAME, "certified");
//! assert_eq!(certified::tiers::q8k4v::d128::BYTES_PER_TOKEN, 288.0);
//! for v in certified::Variant::ALL {
//!     let info = v.info();
//!     assert!(info.source.contains(info.symbol));
//!     println!("{} {} threads, {} B shared", info.name, info.threads, info.smem_bytes);
//! }
//! ```
//!
//! The expansion is what `kvforge generate` writes to `kernels-generated/<spec>/bindings.rs`,
//! with sources inline instead of `include_str!`: `SPEC_NAME`, `SPEC_PATH`, `SPEC_HASH`,
//! `PAGE_TOKENS`, `PAGE_ALIGNMENT`, `HEADER_BYTES`; a module `tiers::<tier>::d<head_dim>` of
//! layout consts per tier (`CODE`, `SEGMENT_BYTES`, `PAGE_BYTES`, `BYTES_PER_TOKEN`,
//! `<ARRAY>_OFFSET`, `<ARRAY>_BYTES`); and `enum Variant` with `Variant::ALL` and
//! `Variant::info() -> &VariantInfo` (name, symbol, kind, head dim, gqa, tiers, threads,
//! shared memory, source). Put it in a module of its own: it defines these names at the call
//! site. A spec that does not validate is a compile error carrying the validator's message
//! (file, line, column, field), pointed at the path literal.
//!
//! ## `#[derive(KvTier)]`
//!
//! ```
//! use kvforge_macros::KvTier;
//!
//! /// Seed 004's tier: int8 keys per channel per block of 16 tokens with fp32 scales, int4
//! /// values per group of 16 channels with fp16 scales.
//! #[derive(KvTier)]
//! #[kv(key = "int", key_bits = 8, key_block = 16, key_scale_dtype = "fp32")]
//! #[kv(value = "int", value_bits = 4, value_group = 16, value_scale_dtype = "fp16")]
//! struct Q8K4V;
//!
//! assert_eq!(Q8K4V::BYTES_PER_TOKEN, 288.0);
//! assert_eq!(Q8K4V::TIER_CODE, "kint8c16f32_vint4g16f16");
//! assert_eq!(Q8K4V::K_CODES_OFFSET, 0);
//! println!("{}", Q8K4V::spec_toml());
//! ```
//!
//! ```
//! # use kvforge_macros::KvTier;
//! /// Spherical keys (seed 000 "High") with dense values, at head dim 64 and 32-token pages.
//! #[derive(KvTier)]
//! #[kv(key = "spherical", key_group = 16, angle_bits = 6, codebook = "codebooks/sph_g16_b6.safetensors")]
//! #[kv(value = "fp16", head_dim = 64, page = 32, name = "high64")]
//! struct High64;
//!
//! assert_eq!(High64::NAME, "high64");
//! assert_eq!(High64::BYTES_PER_TOKEN, 135.0);
//!
//! #[derive(KvTier)]
//! #[kv(key = "fp16", value = "fp16")]
//! struct Dense;
//! assert_eq!(Dense::SEGMENT_BYTES, 2 * 64 * 128 * 2);
//! assert_eq!(Dense::PAGE_BYTES, 32896); // 16-byte header + segment, padded to 128 B
//! ```
//!
//! Attributes, in any number of `#[kv(...)]` lists, each at most once:
//!
//! | attribute | type | default | meaning |
//! |---|---|---|---|
//! | `key` | string | required | key scheme: `fp16`, `bf16`, `int`, `spherical`, `drop` |
//! | `key_bits` | int | | `int` keys: 8, 4 or 2 |
//! | `key_block` | int | | `int` keys: tokens per scale block, dividing `page` |
//! | `key_scale_dtype` | string | `"fp16"` | `int` keys: `fp16` or `fp32` scales and zeros |
//! | `key_group` | int | | `spherical` keys: channels per group, dividing `head_dim` |
//! | `angle_bits` | int | | `spherical` keys: log2 of codebook entries, 1 to 8 |
//! | `radius_bits` | int | 8 | `spherical` keys: must be 8 |
//! | `codebook` | string | | `spherical` keys: safetensors codebook (see *Paths*) |
//! | `value` | string | required | value scheme: `fp16`, `bf16`, `int`, `drop` |
//! | `value_bits` | int | | `int` values: 8, 4 or 2 |
//! | `value_group` | int | | `int` values: channels per scale group, a multiple of 8 dividing `head_dim` |
//! | `value_scale_dtype` | string | `"fp16"` | `int` values: `fp16` or `fp32` |
//! | `head_dim` | int | 128 | 64, 128 or 256 |
//! | `page` | int | 64 | tokens per page: 16, 32, 64 or 128 |
//! | `alignment` | int | 128 | page alignment in bytes |
//! | `gqa` | int | 8 | query heads per kv head (bounds a spherical tier's lookup table) |
//! | `dtype` | string | `"fp16"` | query / tail dtype: `fp16` or `bf16` |
//! | `name` | string | the type's name in snake case | the tier's name in the spec |
//!
//! The derive writes a one-tier spec from these ([`SPEC_TOML`](#generated-items)) and runs the
//! spec validator on it, so every rule of a spec file applies; a rule that fails is a compile
//! error pointed at the attribute that set the value (or at the scheme, when a required value
//! is missing):
//!
//! ```compile_fail
//! # use kvforge_macros::KvTier;
//! #[derive(KvTier)]
//! #[kv(key = "int", key_bits = 3, key_block = 16, value = "fp16")]
//! struct ThreeBit; // error: bits 3 is not supported for `int`; valid: 8, 4, 2 ...
//! ```
//!
//! ```compile_fail
//! # use kvforge_macros::KvTier;
//! #[derive(KvTier)]
//! #[kv(key = "fp16", value = "int", value_bits = 4, value_group = 24)]
//! struct Ragged; // error: group_size 24 does not divide head_dim 128 ...
//! ```
//!
//! ### Generated items
//!
//! An inherent `impl` on the type with `NAME`, `TIER_CODE`, `HEAD_DIM`, `PAGE_TOKENS`,
//! `BYTES_PER_TOKEN: f64` (payload + metadata per token per head), `PAYLOAD_BYTES`,
//! `SEGMENT_BYTES`, `PAGE_BYTES`, `<ARRAY>_OFFSET` and `<ARRAY>_BYTES` for each array of the
//! segment (`K`, `K_CODES`, `K_SCALE`, `K_ZERO`, `K_RADIUS`, `K_INDEX`, `V`, `V_CODES`,
//! `V_SCALE`, `V_ZERO`, as the schemes have them), `TIER_TOML` (the `[[tier]]` table),
//! `SPEC_TOML` and `fn spec_toml() -> &'static str`. When pasting `TIER_TOML` into a spec file,
//! make a `codebook` path relative to that file (`"../codebooks/..."` from `specs/`).

use proc_macro::TokenStream;

mod kernels;
mod paths;
mod tier;

/// Embeds the kernels and bindings of the spec at the given path; see the
/// [crate docs](crate#kernels).
///
/// ```
/// mod baseline {
///     kvforge_macros::kernels!("specs/baseline.toml");
/// }
/// assert_eq!(baseline::tiers::fp16::d128::BYTES_PER_TOKEN, 512.0);
/// ```
#[proc_macro]
pub fn kernels(input: TokenStream) -> TokenStream {
    kernels::expand(input.into()).into()
}

/// Describes a custom tier with `#[kv(...)]` attributes and checks it at compile time; see
/// the [crate docs](crate#derivekvtier).
#[proc_macro_derive(KvTier, attributes(kv))]
pub fn derive_kv_tier(input: TokenStream) -> TokenStream {
    tier::expand(input.into()).into()
}
