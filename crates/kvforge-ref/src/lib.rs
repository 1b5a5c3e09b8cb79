//! # kvforge-ref: the CPU f64 reference of every kvforge coding scheme
//!
//! Every GPU test compares a kernel against this crate, so it is written for obviousness, not
//! speed, and is byte-exact to the page layout of `kvforge-spec`:
//!
//! * [`encode_segment`] / [`decode_segment`]: one tier's segment (structure-of-arrays
//!   payload of a page), for dense ([`dense`]), integer ([`quant`]) and spherical
//!   ([`spherical`]), per-channel mixed-bit ([`mixed`]) and rotated ([`rotated`]) schemes; [`spherical_logits`] scores spherical keys through the lookup
//!   table as the decode kernel does.
//! * [`encode_page`] / [`decode_page`]: header + segment, with header verification;
//!   [`encode_sequence`] / [`decode_sequence`] page whole sequences (full pages in a tier,
//!   the remainder in the tail tier), in the spec's basis ([`Basis`]: rows of a spec with
//!   `rotated` tiers are rotated as the runtime's append does, [`stored_rows`], and decoded
//!   back).
//! * [`attention()`]: exact softmax attention in f64, with GQA and split-K helpers.
//! * [`train_codebook`]: spherical k-means for the spherical codebooks.
//! * [`certified`]: certified attention (seed 004) — tiers, selector, fallback ladder and the
//!   error certificate, the specification the GPU certified path is checked against.
//!
//! Numerics (the contract the CUDA kernels follow) are documented in each scheme's module, which
//! lives in its codec folder in `kvforge-spec` (`codecs/<scheme>/reference.rs`).
//! Inputs are f32 (the value of an fp16/bf16 activation, or any f32); outputs are f64.

pub mod attention;
pub mod certified;
pub mod codebook;
mod error;
pub mod page;
pub mod segment;

// Each scheme's f64 reference lives in its codec folder (`kvforge_spec::codecs::<scheme>`,
// feature `reference`); these are its historical paths.
pub use kvforge_spec::codecs::bits;
pub use kvforge_spec::codecs::dense::reference as dense;
pub use kvforge_spec::codecs::int::reference as quant;
pub use kvforge_spec::codecs::mixed::reference as mixed;
pub use kvforge_spec::codecs::rotated::reference as rotated;
pub use kvforge_spec::codecs::spherical::reference as spherical;
pub use kvforge_spec::Basis;

pub use attention::{attention, attention_heads, batched_gqa_attention, combine_partials, softmax_weights, KvHead};
pub use codebook::{train_codebook, uniform_unit_samples};
pub use error::{CertError, PageError, RefError};
pub use page::{decode_page, decode_sequence, encode_page, encode_sequence, page_tier, stored_rows, DecodedPage};
pub use quant::{int_error_bound, int_step, IntStep};
pub use segment::{decode_segment, encode_segment, spherical_logits, try_decode_segment, try_encode_segment};
pub use spherical::radius_scales;
