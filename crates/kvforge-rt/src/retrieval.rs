//! ParisKV inside the main cache (seed 001 §4.2, issue 27): one decode step over a GPU region
//! held by a [`KvCache`] of any spec and tier and a retrieval region held by a [`ParisIndex`].
//!
//! A sequence's tokens are in three regions (seed §4.2.1):
//! - **sinks**: its first `sink_pages` pages, on the GPU for good;
//! - **local window**: the newest full pages and the tail page, on the GPU in the cache's own
//!   tiers (its target tier, or dense under a [`crate::WindowPolicy`]);
//! - **retrieval region**: every older page, moved out of the cache into the index as the
//!   window grows — summaries on the GPU, fp16 K/V in pinned host memory — and each step's
//!   top-`k` of it read back over UVA.
//!
//! [`RegionPolicy`] says when pages move: once the window holds `local_pages + update_pages`
//! full pages past the sinks, its oldest pages beyond `local_pages` move together (a prefill
//! moves its bulk in one append, which also fixes the summaries' weight grid from it). A move
//! appends the pages' fp16 rows to the index (kept on the host from the append, since a coded
//! tier no longer has them) and then drops the pages from the cache (the drop tier frees them
//! without a launch; the spec must have one). A move the index cannot take (past its
//! capacity: [`RtError::HostBudget`]) changes nothing: the pages stay on the GPU.
//!
//! [`RetrievalCache::decode`] runs the cache's decode over the GPU region and the index's step
//! (vote, top-C, rerank, top-`k`, fetch, attention) over the retrieval region, and merges the
//! two softmax blocks by their log-sum-exp: the result is one softmax over sinks + window + the
//! retrieved rows (scale 1/√D in both).
//!
//! ```ignore
//! let spec = Spec::load(Path::new("specs/rotated.toml"))?;
//! let r3 = spec.tier("r3").unwrap().id;
//! let cfg = CacheConfig::new(&spec, 128, 4, 8, 1, 8192).target(r3);
//! let geo = ParisGeometry { batch: 1, kv_heads: 8, gqa: 4, per_query_head: false, rank: Rank::GroupMax, layout: SummaryLayout::Whole64, capacity: 1 << 20, dense_capacity: 1, max_candidates: 65536, max_k: 256, host_budget_bytes: 40 << 30 };
//! let mut rc = RetrievalCache::new(Arc::new(Device::open(0)?), spec, cfg, ParisConfig::default_for(128), geo, RegionPolicy::default())?;
//! rc.append(0, &k, &v)?;                  // [n][Hkv][D] f32, prefill then one token a step
//! let out = rc.decode(&q, 256)?;          // [batch][Hq][D] f32, top-256 of the retrieval region
//! ```

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::f16;
use kvforge_paris::{ParisConfig, Schedule};
use kvforge_spec::{DType, Spec, TierId};

use crate::cache::{CacheConfig, KvCache};
use crate::decode::{from_bits, to_bits, DecodeOutput};
use crate::device::Device;
use crate::error::{drv, Result, RtError};
use crate::external::{ElemType, ExternalTensor};
use crate::paris::{DenseBlock, ParisGeometry, ParisIndex};

/// Which pages of a sequence stay on the GPU and when the others move to the retrieval region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionPolicy {
    /// Pages from a sequence's start that never move (attention sinks).
    pub sink_pages: usize,
    /// Full pages past the sinks that stay on the GPU (the local window; the tail page adds to it).
    pub local_pages: usize,
    /// Pages the window may grow by before its oldest move (the update buffer): moves come in
    /// batches of at least this many pages.
    pub update_pages: usize,
}

impl Default for RegionPolicy {
    /// One sink page, a local window of four pages and one page of update buffer: at 64-token
    /// pages 64 sinks and 256–320 local tokens, the seed's §4.2.1 shape at kvforge's page size.
    fn default() -> Self {
        RegionPolicy { sink_pages: 1, local_pages: 4, update_pages: 1 }
    }
}

impl RegionPolicy {
    /// Pages to move from a sequence whose full pages number `full` (every page ever filled,
    /// moved ones included), of which `moved` have moved: the window past the sinks beyond
    /// `local_pages`, once it reaches `update_pages`, else 0.
    pub fn to_move(&self, full: usize, moved: usize) -> usize {
        let window = full.saturating_sub(self.sink_pages).saturating_sub(moved);
        let excess = window.saturating_sub(self.local_pages);
        if excess >= self.update_pages.max(1) {
            excess
        } else {
            0
        }
    }
}

/// Per sequence: its id in the cache, and the fp16 rows of its tokens past the sinks that are
/// still on the GPU (`[rows][Hkv][D]` each), the ones the next move hands to the index.
struct SeqRegions {
    cache_seq: usize,
    appended: usize,
    moved_pages: usize,
    keys: Vec<f16>,
    values: Vec<f16>,
}

/// A [`KvCache`] and a [`ParisIndex`] over the same sequences: module docs.
pub struct RetrievalCache {
    cache: KvCache,
    index: ParisIndex,
    policy: RegionPolicy,
    drop_tier: TierId,
    schedule: Schedule,
    seqs: Vec<SeqRegions>,
    io: Option<DenseIo>,
}

impl RetrievalCache {
    /// A cache for `geo.batch` sequences (ids `0..batch`, the rows of every decode's queries).
    /// `spec` must have a drop tier (the one moves leave behind); `cache_cfg` sizes the GPU
    /// region (its pages need only cover sinks, window and update buffer per sequence), `geo`
    /// the retrieval region. The index's schedule is its layout's default
    /// ([`ParisIndex::default_schedule`], [`RetrievalCache::set_schedule`] changes it).
    pub fn new(dev: Arc<Device>, spec: Spec, cache_cfg: CacheConfig, paris: ParisConfig, geo: ParisGeometry, policy: RegionPolicy) -> Result<RetrievalCache> {
        let drop_tier = spec.tiers.iter().find(|t| t.is_drop()).map(|t| t.id).ok_or_else(|| RtError::NotInSpec {
            spec: spec.name.clone(),
            what: "a drop tier (pages that move to the retrieval region leave the cache through it)".into(),
            fix: "add a tier with key = { scheme = \"drop\" } and value = { scheme = \"drop\" } (specs/rotated.toml and specs/rdkv.toml have one)".into(),
        })?;
        if cache_cfg.head_dim != paris.head_dim || cache_cfg.num_kv_heads != geo.kv_heads || cache_cfg.gqa != geo.gqa {
            return Err(RtError::ShapeMismatch {
                what: "retrieval cache: the cache and the index".into(),
                expected: format!("head_dim {}, {} kv heads, gqa {} (the cache)", cache_cfg.head_dim, cache_cfg.num_kv_heads, cache_cfg.gqa),
                got: format!("head_dim {}, {} kv heads, gqa {} (the index)", paris.head_dim, geo.kv_heads, geo.gqa),
            });
        }
        // The index's own dense rows stay unused (the cache holds the GPU region).
        let geo = ParisGeometry { dense_capacity: geo.dense_capacity.max(1), ..geo };
        // The index works on a stream of its own, so that the cache's decode of the GPU region
        // (on the device's stream) runs beside its retrieval.
        let side = Device { ctx: dev.ctx.clone(), stream: dev.stream.fork().map_err(drv("retrieval cache: index stream"))?, info: dev.info.clone() };
        let index = ParisIndex::new(&side, paris, geo)?;
        let mut cache = KvCache::new(dev, spec, cache_cfg)?;
        let seqs = (0..geo.batch).map(|_| SeqRegions { cache_seq: cache.add_sequence(), appended: 0, moved_pages: 0, keys: Vec::new(), values: Vec::new() }).collect();
        let schedule = index.default_schedule();
        Ok(RetrievalCache { cache, index, policy, drop_tier, schedule, seqs, io: None })
    }

    /// The GPU region's cache (its pages, tiers and memory report).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// The retrieval region's index.
    pub fn index(&self) -> &ParisIndex {
        &self.index
    }

    pub fn policy(&self) -> RegionPolicy {
        self.policy
    }

    /// The retrieval's `(ρ, β)` schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The `(ρ, β)` schedule of the retrieval (by length, as [`ParisIndex::retrieve`] takes it).
    pub fn set_schedule(&mut self, schedule: Schedule) -> Result<()> {
        schedule.validate()?;
        self.schedule = schedule;
        Ok(())
    }

    /// Tokens appended to `seq`.
    pub fn len(&self, seq: usize) -> Result<usize> {
        Ok(self.seq(seq)?.appended)
    }

    pub fn is_empty(&self) -> bool {
        self.seqs.iter().all(|s| s.appended == 0)
    }

    /// Tokens of `seq` in the retrieval region.
    pub fn retrieval_len(&self, seq: usize) -> Result<usize> {
        self.seq(seq)?;
        Ok(self.index.len(seq))
    }

    fn seq(&self, seq: usize) -> Result<&SeqRegions> {
        self.seqs.get(seq).ok_or(RtError::NoSequence(seq))
    }

    /// Appends `n` tokens to `seq` (`k`, `v`: `[n][Hkv][D]` f32, as [`KvCache::append`]), then
    /// moves the pages the policy says to the retrieval region. More than
    /// [`RetrievalCache::APPEND_PIECE`] tokens go in pieces of that many, each followed by its
    /// moves, so that the cache holds at most the sinks, the window, the update buffer and one
    /// piece per sequence however long a prefill is ([`RetrievalCache::gpu_tokens`] sizes it).
    ///
    /// On an error nothing of the failing piece is left half-done (pieces before it stay
    /// appended): a failed cache append changes nothing; a move the index refuses leaves the
    /// pages on the GPU (the tokens are appended, and the next append tries the move again).
    pub fn append(&mut self, seq: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.seq(seq)?;
        let row = self.cache.config().num_kv_heads * self.cache.config().head_dim;
        if k.len() != v.len() || !k.len().is_multiple_of(row) {
            // The cache's own check names the shapes.
            return self.cache.append(self.seqs[seq].cache_seq, k, v);
        }
        let piece = Self::APPEND_PIECE * row;
        for (k, v) in k.chunks(piece).zip(v.chunks(piece)) {
            self.append_piece(seq, k, v)?;
        }
        Ok(())
    }

    /// Tokens per piece of a long append ([`RetrievalCache::append`]): large enough that a
    /// prefill's first move fits the index's summaries to many keys (the Whole64 weight grid is
    /// fixed by a kv head's first move).
    pub const APPEND_PIECE: usize = 16384;

    /// Tokens per sequence the cache of the GPU region must hold for `policy` at page size
    /// `page_tokens`: sinks, window, update buffer, the tail page and one append piece.
    pub fn gpu_tokens(policy: RegionPolicy, page_tokens: usize) -> usize {
        (policy.sink_pages + policy.local_pages + policy.update_pages.max(1) + 1) * page_tokens + Self::APPEND_PIECE
    }

    fn append_piece(&mut self, seq: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let row = self.cache.config().num_kv_heads * self.cache.config().head_dim;
        let p = self.cache.spec().page.tokens;
        self.cache.append(self.seqs[seq].cache_seq, k, v)?;
        let s = &mut self.seqs[seq];
        // Rows past the sinks are staged for the moves; the sinks' never move.
        let n = k.len() / row;
        let skip = (self.policy.sink_pages * p).saturating_sub(s.appended).min(n);
        s.keys.extend(k[skip * row..].iter().map(|&x| f16::from_f32(x)));
        s.values.extend(v[skip * row..].iter().map(|&x| f16::from_f32(x)));
        s.appended += n;
        self.move_pages(seq)
    }

    /// Moves `seq`'s pages past the window to the index, if the policy asks for it.
    fn move_pages(&mut self, seq: usize) -> Result<()> {
        let p = self.cache.spec().page.tokens;
        let (hkv, d) = (self.cache.config().num_kv_heads, self.cache.config().head_dim);
        let s = &self.seqs[seq];
        let pages = self.policy.to_move(s.appended / p, s.moved_pages);
        if pages == 0 {
            return Ok(());
        }
        let rows = pages * p * hkv * d;
        self.index.append(seq, &s.keys[..rows], &s.values[..rows])?;
        // Full pages past the sinks are listed from index `sink_pages` on (moved ones have left
        // the table); indices name the table before the call.
        let (first, to) = (self.policy.sink_pages, self.drop_tier);
        let moves: Vec<_> = (0..hkv).flat_map(|h| (0..pages).map(move |j| (h, first + j, to))).collect();
        self.cache.retier_pages(s.cache_seq, &moves)?;
        let s = &mut self.seqs[seq];
        s.keys.drain(..rows);
        s.values.drain(..rows);
        s.moved_pages += pages;
        Ok(())
    }

    /// One decode step of every sequence: `q` is `[batch][Hkv·gqa][D]` f32; the retrieval
    /// attends each retrieval's top-`k` keys (module docs). Sequences with an empty retrieval
    /// region attend their GPU region only; the index is not launched when every region is.
    pub fn decode(&mut self, q: &[f32], k: usize) -> Result<DecodeOutput> {
        Ok(self.decode_timed(q, k)?.0)
    }

    /// [`RetrievalCache::decode`] with its host wall time and device time. The index's step
    /// queues the inputs' upload and the first span's retrieval on the index's stream; then the
    /// query's upload and the cache's decode of the GPU region go on the device's stream, on the
    /// device-resident plan ([`KvCache::decode_step_external`]: no host copy of the plan, no
    /// wait) into buffers of this cache, so they run beside the retrieval; the index's attention
    /// waits for them and folds the block into its epilogue before the one download
    /// ([`ParisIndex::step_merged`]).
    pub fn decode_timed(&mut self, q: &[f32], k: usize) -> Result<(DecodeOutput, StepWall)> {
        let t0 = Instant::now();
        let (hq, d) = (self.cache.config().num_kv_heads * self.cache.config().gqa, self.cache.config().head_dim);
        let batch = self.seqs.len();
        if q.len() != batch * hq * d {
            return Err(RtError::ShapeMismatch { what: "retrieval cache: query".into(), expected: format!("{batch} sequences × {hq} q heads × {d} values"), got: format!("{} values", q.len()) });
        }
        let dtype = self.cache.spec().geometry.dtype;
        let dev = self.cache.device().clone();
        let st = dev.stream.clone();
        let bits: Vec<u16> = q.iter().map(|&x| to_bits(dtype, x)).collect();
        if self.io.is_none() {
            self.io = Some(DenseIo::new(&st, batch * hq, d)?);
        }
        let io = self.io.as_mut().expect("set above");
        let (elem, ord) = (ElemType::of(dtype), dev.ctx.ordinal());
        let ext = |ptr: u64, e: ElemType, shape: &[usize]| ExternalTensor::contiguous(ptr, e, shape, ord);
        let (qp, op, lp) = (io.q.device_ptr(&st).0, io.out.device_ptr(&st).0, io.lse.device_ptr(&st).0);
        let ids: Vec<usize> = self.seqs.iter().map(|s| s.cache_seq).collect();
        let cache = &mut self.cache;
        // The query's upload and the decode, on the device's stream.
        let mut launch_dense = || {
            st.memcpy_htod(&bits, &mut io.q).map_err(drv("retrieval cache: query upload"))?;
            cache.decode_step_external(&ids, &ext(qp, elem.clone(), &[batch, hq, d]), &ext(op, elem.clone(), &[batch, hq, d]), &ext(lp, ElemType::F32, &[batch, hq]))
        };
        let (out, device_us) = if (0..batch).all(|s| self.index.len(s) == 0) {
            let e0 = st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"))?;
            launch_dense()?;
            let e1 = st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"))?;
            let io = self.io.as_ref().expect("set above");
            let out = st.clone_dtoh(&io.out).map_err(drv("retrieval cache: output"))?;
            let lse = st.clone_dtoh(&io.lse).map_err(drv("retrieval cache: lse"))?;
            let us = f64::from(e0.elapsed_ms(&e1).map_err(drv("event"))?) * 1e3;
            (DecodeOutput { out: out.into_iter().map(|b| from_bits(dtype, b)).collect(), lse }, us)
        } else {
            let qh: Vec<f16> = q.iter().map(|&x| f16::from_f32(x)).collect();
            let chunks = self.index.default_chunks();
            let bf16 = dtype == DType::Bf16;
            let (out, lse, us) = self.index.step_merged(&qh, k, &self.schedule, chunks, || {
                launch_dense()?;
                let ready = st.record_event(None).map_err(drv("event"))?;
                Ok(DenseBlock { out: op, lse: lp, bf16, ready })
            })?;
            (DecodeOutput { out, lse }, us)
        };
        // Faults the cache's kernel flagged (reported asynchronously by the resident path).
        self.cache.synchronize()?;
        Ok((out, StepWall { wall_us: t0.elapsed().as_secs_f64() * 1e6, device_us }))
    }
}

/// The query, output and log-sum-exp buffers of the GPU region's decode, `[rows][D]` in the
/// spec dtype and `[rows]` f32, allocated by the first decode.
struct DenseIo {
    q: CudaSlice<u16>,
    out: CudaSlice<u16>,
    lse: CudaSlice<f32>,
}

impl DenseIo {
    fn new(st: &Arc<CudaStream>, rows: usize, d: usize) -> Result<DenseIo> {
        let z16 = |n: usize| st.alloc_zeros::<u16>(n).map_err(drv("retrieval cache: decode buffers"));
        Ok(DenseIo { q: z16(rows * d)?, out: z16(rows * d)?, lse: st.alloc_zeros::<f32>(rows).map_err(drv("retrieval cache: decode buffers"))? })
    }
}

/// A [`RetrievalCache::decode_timed`] step, µs: host wall time of the call, and device time
/// (CUDA events on the cache's stream around all of the step's GPU work, the GPU's idle gaps
/// waiting for the host included).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct StepWall {
    pub wall_us: f64,
    pub device_us: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_start_when_the_window_passes_local_plus_update() {
        let p = RegionPolicy { sink_pages: 1, local_pages: 4, update_pages: 2 };
        // Sinks and a growing window: nothing moves until 1 + 4 + 2 full pages.
        for full in 0..7 {
            assert_eq!(p.to_move(full, 0), 0, "full {full}");
        }
        assert_eq!(p.to_move(7, 0), 2);
        // After that move the window is back at four pages.
        assert_eq!(p.to_move(7, 2), 0);
        assert_eq!(p.to_move(8, 2), 0);
        assert_eq!(p.to_move(9, 2), 2);
    }

    #[test]
    fn a_prefill_moves_its_bulk_at_once() {
        let p = RegionPolicy::default();
        // 1000 pages of prefill: all but the sink and the four local pages move together.
        assert_eq!(p.to_move(1000, 0), 995);
        assert_eq!(p.to_move(1000, 995), 0);
        // A zero update buffer still moves page by page.
        let q = RegionPolicy { update_pages: 0, ..p };
        assert_eq!(q.to_move(6, 0), 1);
        assert_eq!(q.to_move(5, 0), 0);
    }
}
