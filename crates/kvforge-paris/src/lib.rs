//! ParisKV retrieval (seed 001 §4): the GPU keeps compact per-key summaries of the retrieval
//! region; each decode step votes, reranks and keeps the top-`k` keys, whose full-precision K/V
//! rows are then read from pinned host memory.
//!
//! ```
//! use kvforge_paris::{ParisConfig, Query, Schedule, Summaries, retrieve};
//! let cfg = ParisConfig::default_for(64); // B = 8 subspaces of m = 8, 6 collision tiers
//! let keys: Vec<f32> = (0..64 * 3000).map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0).collect();
//! let s = Summaries::encode(cfg, &keys)?;
//! let q: Vec<f64> = (0..64).map(|c| (c as f64 * 0.3).sin()).collect();
//! let plan = Schedule::default().plan(s.n, 100);
//! let r = retrieve(&s, &Query::new(&cfg, &q)?, plan.rho, plan.candidates, plan.k)?;
//! assert_eq!(r.top.len(), 100);
//! # Ok::<(), kvforge_paris::ParisError>(())
//! ```
//!
//! **Why a crate and not a codec folder.** A `kvforge-spec` codec is a tier of the page
//! store: it encodes K or V rows into page-segment arrays and decodes them back
//! ([`kvforge_spec::codecs::Codec`]'s `encode`/`decode`, `cpp_type` read by the decode
//! kernel). ParisKV summaries are an index next to the store: they never decode to a key,
//! the keys they index stay fp16 in host memory, and what reads them is a retrieval
//! pipeline (vote, top-`C`, rerank, top-`k`), not the decode kernel's tier loop. So the
//! summaries live here and reuse the rotated tier's ingredients instead of duplicating them:
//! its seeded Hadamard rotation (`codecs::rotated::hadamard`) and its Prop. 4.1 Lloyd–Max
//! levels (`codecs::rotated::levels` at the subspace dim `m`).
//!
//! - [`summary`]: the per-key summaries (byte layout in its docs);
//! - [`retrieval`]: vote, top-`C`, rerank (eq. 10), top-`k`, exact top-`k` and recall; one
//!   retrieval per GQA group ([`group_query`]), ranked by the summed or the heads' largest
//!   estimate ([`Rank`]);
//! - [`compact`]: rerank layouts of 1/8 of fp16 (`D/2` bytes per key), a study of the f64
//!   reference (3-bit codes, or whole-vector codes with one weight per key);
//! - [`config`]: the geometry and the adaptive `(ρ, β)` schedule;
//! - [`window`]: the sinks / retrieval / local / update-buffer regions of a sequence (§4.2.1).

pub mod compact;
pub mod config;
pub mod error;
pub mod retrieval;
pub mod summary;
pub mod window;

/// Test keys: `d` uniform values in [−1, 1) from a xorshift stream seeded by `salt`.
#[cfg(test)]
pub(crate) fn test_uniform(d: usize, salt: u64) -> impl Iterator<Item = f64> {
    let mut s = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..d).map(move |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    })
}

pub use compact::{compact_key, CompactKey, CompactKeys, CompactQuery, CompactSummaries, Layout, LogGrid, WholeRow};
pub use config::{ParisConfig, RetrievalPlan, Schedule, SchedulePoint, SummaryLayout, CODE_BITS};
pub use error::ParisError;
pub use retrieval::{exact_top_k, exact_top_k_group_max, group_query, recall, retrieve, retrieve_group, retrieve_group_compact, retrieve_group_max, top_candidates, Query, Rank, Retrieval};
pub use summary::{summarize_key, KeySummary, Summaries};
pub use window::{Regions, WindowConfig};
