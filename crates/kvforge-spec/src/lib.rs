//! # kvforge-spec: tier specs → validated IR
//!
//! A spec is a TOML file that says how a KV cache may store each token: a ladder of named
//! **tiers**, each a (key scheme, value scheme) pair, the page geometry, and which tier
//! combinations one decode launch must serve.
//!
//! ```toml
//! [spec]
//! name = "certified"
//!
//! [geometry]
//! head_dims = [128]
//! gqa = [4]
//! dtype = "fp16"
//!
//! [page]
//! tokens = 64
//!
//! [[tier]]
//! name = "q8k4v"
//! key = { scheme = "int", bits = 8, block = 16, scale_dtype = "fp32" }
//! value = { scheme = "int", bits = 4, group = 16, scale_dtype = "fp16" }
//! ```
//!
//! [`Spec::parse`] turns text into a [`Spec`] (parse, don't validate: only a `Spec` reaches the
//! generator and the runtime) or a [`SpecError`] that names file, line, column and field.
//! [`Spec::variants_with`] enumerates every kernel the generator renders (under the schedules
//! kvforge-gen chooses: `kvforge_gen::variants`), each named by one [`VariantId`]; [`SegmentLayout`] documents every tier's bytes.

mod basis;
pub mod codecs;
pub mod constraints;
mod error;
pub mod input;
mod layout;
mod raw;
mod scheme;
mod spec;
mod variant;

pub use basis::Basis;
pub use codecs::mixed::{mixed_arrays, mixed_channels, mixed_shares, mixed_widths, ChannelSegment};
pub use codecs::spherical::{spherical_index_bytes, Codebook, CodebookError, RADIUS_BITS};
pub use codecs::{ArraySpec, Codec, Side, SideElem, SideInit, SideTable, REGISTRY};
pub use error::{SpecError, SpecErrorKind};
pub use layout::{ArrayLayout, PageHeader, SegmentLayout, HEADER_BYTES, PAGE_MAGIC};
pub use scheme::{DType, KeyScheme, ScaleDType, SharedCodec, ValueScheme};
pub use spec::{Geometry, KernelOptions, KernelShape, PageOptions, Spec, Tier, TierId, LUT_BUDGET_BYTES, STAGE_BUDGET_BYTES, TAIL_TIER};
pub use variant::{Family, Schedule, ScheduleChooser, TierCode, VariantId};

/// Version of the generator contract: part of every generated file header and of every
/// disk-cache key, so that a change here invalidates compiled kernels.
pub const GENERATOR_VERSION: &str = concat!("kvforge-", env!("CARGO_PKG_VERSION"), "+layout1");
