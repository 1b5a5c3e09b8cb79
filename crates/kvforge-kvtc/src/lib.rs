//! kvtc (KV cache transform coding, seed 003): compress a sequence's KV cache for storage,
//! reuse or transfer, and restore it.
//!
//! Calibration, once per model: PCA of keys (RoPE undone) and values concatenated across
//! layers and heads, and a dynamic program that allocates bits to groups of principal
//! components for each compression ratio ([`calibrate`], [`Calibration::save`]). Packing
//! projects each token, quantises it per the allocation (fp16 shift and scale per group),
//! packs and entropy-codes chunks of tokens into a checksummed container ([`pack_into`]);
//! attention-sink tokens and the recent window stay fp16. Unpacking reverses it
//! ([`unpack_from`]).
//!
//! ```no_run
//! use kvforge_kvtc::{calibrate, pack_into, unpack_from, CalibConfig, Entropy, KvDump, PackOptions, Rope};
//! let calib_dump = KvDump::load("data/keys/kv-emma-per-layer.safetensors".as_ref())?;
//! let cfg = CalibConfig { rope: Some(Rope { theta: 100000.0, dim: 64 }), ..CalibConfig::default() };
//! let cal = calibrate(&calib_dump, &cfg, |step| eprintln!("{step}"))?;
//! let cache = KvDump::load("cache.safetensors".as_ref())?;
//! let mut bytes = Vec::new();
//! let opts = PackOptions { ratio_index: cal.ratio_index(16.0).unwrap(), entropy: Entropy::Deflate, chunk_tokens: 256 };
//! let stats = pack_into(&cache, &cal, &opts, &mut bytes)?;
//! let restored = unpack_from(&mut bytes.as_slice(), &cal)?;
//! # Ok::<(), kvforge_kvtc::KvtcError>(())
//! ```

pub mod alloc;
pub mod calib;
mod calibfile;
pub mod codec;
pub mod container;
pub mod dump;
pub mod entropy;
pub mod error;
pub mod model;
pub mod pack;
pub mod quant;
pub mod restore;
pub mod rope;
pub mod step;

pub use alloc::{Allocation, DpConfig, Group};
pub use calib::{calibrate, calibrate_grid, BasisBlock, CalibConfig, Calibration, Side, SideCalib};
pub use codec::{decode_container, pack_into, read_container, unpack_from, write_container, Container, DecodedChunk, DecodedContainer, PackOptions, PackStats, StoredChunk, StoredContainer};
pub use dump::KvDump;
pub use entropy::Entropy;
pub use error::KvtcError;
pub use rope::Rope;
