//! # kvforge-rt: the paged, tiered KV cache on the GPU
//!
//! ```no_run
//! use std::sync::Arc;
//! use kvforge_rt::{CacheConfig, Device, KvCache};
//! let spec = kvforge_spec::Spec::load("specs/spherical.toml".as_ref())?;
//! let dev = Arc::new(Device::open(0)?);
//! // head_dim 128, 4 query heads per kv head, 8 kv heads, 1 sequence of up to 4096 tokens.
//! let cfg = CacheConfig::new(&spec, 128, 4, 8, 1, 4096);
//! let mut cache = KvCache::new(dev, spec, cfg)?;
//! let seq = cache.add_sequence();
//! let (k, v) = (vec![0.1f32; 1000 * 8 * 128], vec![0.2f32; 1000 * 8 * 128]);
//! cache.append(seq, &k, &v)?; // prefill: 15 pages encoded into `high`, 40 tokens in the tail
//! let q = vec![0.3f32; 32 * 128];
//! let out = cache.decode(&[seq], &q)?; // [1][32][128] and the log-sum-exp per head
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod append_step;
mod cache;
pub mod certified;
mod channel_order;
mod codebook;
mod decode;
mod device;
mod engine;
mod error;
pub mod external;
pub mod graph;
pub mod host_slab;
pub mod jit;
mod kernels;
pub mod kvtc;
mod mass_window;
mod moves;
pub mod params;
pub mod paris;
mod pool;
pub mod resident;
pub mod retrieval;
mod side_tables;
mod store;
pub mod testing;
mod transcode;
mod window;

pub use cache::{CacheConfig, KvCache};
pub use decode::{choose_combination, from_bits, plan, split_count, to_bits, DecodeOutput, DecodePlan, DecodeWorkspace, QueryElem};
pub use device::{driver_present, nvrtc_present, Device, DeviceInfo};
pub use error::{drv, Result, RtError};
pub use external::{prefix_pages, ElemType, ExternalTensor, TensorDevice};
pub use kvforge_paging::PagedCache;
pub use mass_window::{MassWindowRows, WindowFold};
pub use moves::{MoveBatch, MoveError, PageMove, SeqMove};
pub use pool::{PagePool, PageRef};
pub use side_tables::SideTables;
pub use store::TierUsage;
pub use window::WindowPolicy;

/// The top-level README's Rust quick start, compiled (not run: it needs a GPU) as a doctest,
/// so the user's page cannot drift from the API (`cargo test -p kvforge-rt --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
