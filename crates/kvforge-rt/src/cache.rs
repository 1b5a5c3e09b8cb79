//! The paged, tiered KV cache of one layer on the GPU.
//!
//! Tokens of a (sequence, kv head) live in pages of `spec.page.tokens` tokens. New tokens go
//! to a dense tail page (tier 0); when it fills, the generated encode kernel writes the page
//! into the cache's target tier in one step (a page is never partially re-encoded: seed 004
//! P1). Prefill appends many tokens at once and encodes all filled pages in few launches. A
//! window policy ([`WindowPolicy`], [`CacheConfig::window`]) keeps a sequence's first pages
//! and its newest full pages dense (tier 0) and encodes a page once it leaves the window.

use std::sync::Arc;

use half::{bf16, f16};
use kvforge_spec::{Basis, DType, KeyScheme, PageHeader, Spec, TierId, HEADER_BYTES, TAIL_TIER};

use crate::device::Device;
use crate::engine::Engine;
use crate::error::{Result, RtError};
use crate::moves::{MoveBatch, PageMove};
use crate::pool::{PagePool, PageRef};
use crate::side_tables::SideTables;
use crate::store::{PageStore, TierUsage};
use crate::window::WindowPolicy;

/// The spherical codec's radius-scale side table (`kvforge_spec::codecs::spherical`).
const RADIUS_SCALE: &str = "radius_scale";

/// Shape and capacity of a cache.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    pub head_dim: usize,
    pub gqa: usize,
    pub num_kv_heads: usize,
    /// Pages per tier, indexed by tier id.
    pub pages: Vec<usize>,
    /// Tier that filled tail pages are encoded into.
    pub target_tier: TierId,
    /// Verify every page header (magic, checksum, tier) when a decode maps the pages.
    /// On by default in debug builds.
    pub verify_headers: bool,
    /// Headroom of automatically chosen spherical radius scales over the largest radius seen.
    pub radius_headroom: f32,
    /// Full pages kept dense (tail format) rather than encoded into `target_tier`: the first
    /// pages of a sequence and its newest ones ([`WindowPolicy`]; default none). Set it with
    /// [`window`](Self::window), which also sizes the tail tier for it.
    pub window: WindowPolicy,
}

impl CacheConfig {
    /// A cache for up to `tokens` tokens per (sequence, kv head) summed over `sequences`,
    /// encoding into the first ladder tier.
    pub fn new(spec: &Spec, head_dim: usize, gqa: usize, num_kv_heads: usize, sequences: usize, tokens: usize) -> CacheConfig {
        let per_head_pages = tokens.div_ceil(spec.page.tokens) + sequences;
        let mut pages = vec![per_head_pages * num_kv_heads; spec.tiers.len()];
        pages[TAIL_TIER as usize] = (sequences + 64) * num_kv_heads;
        CacheConfig { head_dim, gqa, num_kv_heads, pages, target_tier: 1, verify_headers: cfg!(debug_assertions), radius_headroom: 1.25, window: WindowPolicy::default() }
    }

    pub fn target(mut self, tier: TierId) -> Self {
        self.target_tier = tier;
        self
    }

    /// Keeps the first `sink_pages` pages of every sequence and its `recent_pages` newest full
    /// pages dense instead of encoding them into the target tier ([`WindowPolicy`]), and adds
    /// the tail-tier pages that takes for `sequences` sequences (up to `sink_pages +
    /// recent_pages` per kv head besides the tail page). The target tier keeps its pages (an
    /// upper bound). Issue 26's 3-bit configuration at 64-token pages is `window(1, 2, n)`:
    /// 64 sink tokens and a dense window of 128 to 191 tokens.
    pub fn window(mut self, sink_pages: usize, recent_pages: usize, sequences: usize) -> Self {
        let per_seq = |w: WindowPolicy| w.dense_pages() * self.num_kv_heads;
        let t = &mut self.pages[TAIL_TIER as usize];
        let new = WindowPolicy::new(sink_pages, recent_pages);
        *t = t.saturating_sub(per_seq(self.window) * sequences) + per_seq(new) * sequences;
        self.window = new;
        self
    }
}

/// The per-tier pointer tables of the kernel parameter structs.
pub(crate) struct TierPointers {
    /// `[tier][slot]` side tables ([`SideTables::pointers`]).
    pub side: [[u64; 2]; 16],
}

pub struct KvCache {
    pub(crate) spec: Spec,
    pub(crate) cfg: CacheConfig,
    /// Sequences, their page tables and the page bytes.
    pub(crate) store: PageStore,
    /// Every tier's side tables (codebooks, radius scales, channel orders), as its codecs
    /// declare them.
    pub(crate) side: SideTables,
    /// The device, kernels, error flags and page-move buffers launches go through.
    pub(crate) engine: Engine,
    /// Certified decode's originals and reused buffers ([`KvCache::keep_originals`]).
    pub(crate) cert: crate::certified::CertifiedState,
    /// RDR's importance window, once a tracked decode ran ([`KvCache::decode_tracked`]).
    pub(crate) mass_window: Option<crate::mass_window::MassWindow>,
    /// The spec's storage basis ([`Spec::basis`]), taken once: appends and decode launches read
    /// it, and deriving it builds every tier's codec.
    pub(crate) basis: Basis,
    /// Device rows (page offset, position) of the last decode-step append, grown as needed
    /// ([`crate::append_step`]).
    pub(crate) append_rows: Option<cudarc::driver::CudaSlice<u64>>,
    /// The device-resident plan of [`KvCache::decode_step_external`], from its first call.
    pub(crate) resident: Option<crate::resident::Resident>,
    /// The chunk list of CUDA-graph decode steps ([`crate::graph`]), from the first one.
    pub(crate) graph: Option<crate::graph::GraphStep>,
}

fn dense_bytes(dtype: DType, x: f32) -> [u8; 2] {
    match dtype {
        DType::Fp16 => f16::from_f32(x).to_le_bytes(),
        DType::Bf16 => bf16::from_f32(x).to_le_bytes(),
    }
}

fn dense_value(dtype: DType, b: [u8; 2]) -> f32 {
    match dtype {
        DType::Fp16 => f16::from_le_bytes(b).to_f32(),
        DType::Bf16 => bf16::from_le_bytes(b).to_f32(),
    }
}

impl KvCache {
    pub fn new(dev: Arc<Device>, spec: Spec, cfg: CacheConfig) -> Result<KvCache> {
        let d = cfg.head_dim;
        if !spec.geometry.head_dims.contains(&d) {
            return Err(RtError::BadInput(format!("head_dim {d} is not in spec `{}` (head_dims {:?})", spec.name, spec.geometry.head_dims)));
        }
        if !spec.geometry.gqa.contains(&cfg.gqa) {
            return Err(RtError::BadInput(format!("gqa {} is not in spec `{}` (gqa {:?})", cfg.gqa, spec.name, spec.geometry.gqa)));
        }
        if cfg.num_kv_heads == 0 {
            return Err(RtError::BadInput("num_kv_heads must be at least 1".into()));
        }
        let target = spec.tiers.get(cfg.target_tier as usize).ok_or_else(|| RtError::BadTier(cfg.target_tier, "no such tier".into()))?;
        if target.is_drop() || target.id == TAIL_TIER {
            return Err(RtError::BadTier(cfg.target_tier, format!("`{}` cannot hold encoded pages", target.name)));
        }
        let store = PageStore::new(dev.stream.clone(), &spec, d, cfg.num_kv_heads, &cfg.pages, cfg.window)?;
        let side = SideTables::new(&spec, d, cfg.num_kv_heads, &dev.stream)?;
        let engine = Engine::new(dev)?;
        let basis = spec.basis();
        Ok(KvCache { spec, cfg, store, side, engine, cert: Default::default(), mass_window: None, basis, append_rows: None, resident: None, graph: None })
    }

    pub fn spec(&self) -> &Spec {
        &self.spec
    }
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }
    pub fn device(&self) -> &Arc<Device> {
        self.engine.dev()
    }
    pub fn pool(&self) -> &PagePool {
        self.store.pool()
    }

    /// Adds an empty sequence and returns its id.
    pub fn add_sequence(&mut self) -> usize {
        self.store.add_sequence()
    }

    /// Frees every page of a sequence.
    pub fn remove_sequence(&mut self, seq: usize) -> Result<()> {
        self.store.remove_sequence(seq)?;
        // The id is reused by the next `add_sequence`: its window must start unobserved.
        self.reset_mass_window(seq)
    }

    /// A number that changes whenever the pages of `seq` change other than by appends (re-codes,
    /// a window policy's encode of a page leaving the window included, drops, a new sequence
    /// under a reused id), never repeating within this cache. A controller
    /// that planned from a snapshot with the same epoch knows the pages it named are still
    /// there, in the same tiers, without walking the page table (issue 7: that walk was ~26 µs
    /// of the decode thread per sequence and RDR boundary on the H100 host).
    pub fn layout_epoch(&self, seq: usize) -> Result<u64> {
        self.store.layout_epoch(seq)
    }

    /// Logical length of `seq`: tokens appended so far, including those of dropped pages.
    pub fn seq_len(&self, seq: usize) -> Result<usize> {
        self.store.seq_len(seq)
    }

    /// Like [`pages`](Self::pages), with each page's logical first token:
    /// `(page, valid tokens, first token)`. Positions skip the tokens of dropped pages.
    pub fn positioned_pages(&self, seq: usize, head: usize) -> Result<Vec<(PageRef, usize, usize)>> {
        self.store.positioned_pages(seq, head)
    }

    /// Pages of one (sequence, kv head) in token order, the tail page last.
    pub fn pages(&self, seq: usize, head: usize) -> Result<Vec<(PageRef, usize)>> {
        self.store.map_pages(seq, head, |r, n| (r, n))
    }

    /// `(tier, valid tokens)` of every page of one (sequence, kv head), the tail last: what a
    /// controller compares its view with. One pass, no intermediate list (an RDR boundary
    /// walks the page table of every kv head several times).
    pub fn page_tiers(&self, seq: usize, head: usize) -> Result<Vec<(TierId, usize)>> {
        self.store.map_pages(seq, head, |r, n| (r.tier, n))
    }

    /// Full pages of one (sequence, kv head), and the tail page's tokens if it has one: what
    /// appends change, without walking the pages.
    pub fn page_counts(&self, seq: usize, head: usize) -> Result<(usize, Option<usize>)> {
        self.store.page_counts(seq, head)
    }

    /// Number of pages of one (sequence, kv head), the tail included.
    pub fn page_count(&self, seq: usize, head: usize) -> Result<usize> {
        let (full, tail) = self.store.page_counts(seq, head)?;
        Ok(full + usize::from(tail.is_some()))
    }

    /// Appends `n` tokens: `k`, `v` are row-major [n][num_kv_heads][head_dim], rounded to the
    /// spec dtype. Either every token is appended or, on out-of-pages, nothing changes.
    pub fn append(&mut self, seq: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let (hkv, d, p) = (self.cfg.num_kv_heads, self.cfg.head_dim, self.spec.page.tokens);
        if k.len() != v.len() || !k.len().is_multiple_of(hkv * d) {
            return Err(RtError::ShapeMismatch { what: "append: k/v".into(), expected: format!("n × {hkv} kv heads × {d} values each"), got: format!("k {} and v {} values", k.len(), v.len()) });
        }
        if let Some(bad) = k.iter().chain(v.iter()).find(|x| !x.is_finite()) {
            return Err(RtError::NonFinite { what: "append: k/v".into(), value: *bad });
        }
        let n = k.len() / (hkv * d);
        // Every tier stores rows in the spec's basis: rotate them once, here (decode rotates
        // the query and rotates the output back).
        let basis = self.basis;
        let stored = |x: &[f32]| {
            let mut x = x.to_vec();
            basis.to_stored(d, &mut x);
            x
        };
        let rotated = (!basis.is_identity()).then(|| (stored(k), stored(v)));
        let (k, v) = rotated.as_ref().map_or((k, v), |(k, v)| (k.as_slice(), v.as_slice()));
        let target = self.cfg.target_tier;
        // A device-side append (append_step) may have written the tail pages since their
        // mirrors were taken.
        self.store.refresh_tails(seq)?;
        let tails: Vec<Option<(Vec<u8>, usize)>> = (0..hkv).map(|h| Ok(self.store.tail_bytes(seq, h)?.map(|(b, n)| (b.to_vec(), n)))).collect::<Result<_>>()?;
        let tail_len = tails[0].as_ref().map_or(0, |t| t.1);
        let full_per_head = (tail_len + n) / p;
        let rest = (tail_len + n) % p;
        // The window policy: which of the new full pages are encoded now (the others stay
        // dense), and which older dense pages this append pushes out of the window.
        let before = self.store.seq_len(seq)? / p;
        let encode = self.cfg.window.to_encode(before, before + full_per_head);
        let encoded_per_head = self.cfg.window.encodes_new(before, before + full_per_head);
        let old = self.window_encodes(seq, before, before + full_per_head)?;
        // All-or-nothing capacity check before touching anything.
        let existing_tails = tails.iter().filter(|t| t.is_some()).count();
        let mut need = vec![0usize; self.spec.tiers.len()];
        need[target as usize] = encoded_per_head * hkv + old.len();
        let tails_needed = if rest > 0 { hkv } else { 0 } + usize::from(encoded_per_head > 0) + (full_per_head - encoded_per_head) * hkv;
        need[TAIL_TIER as usize] = tails_needed.saturating_sub(existing_tails);
        self.store.pool().reserve(&need)?;

        let seg = self.spec.segment(TAIL_TIER, d);
        let (koff, voff) = (HEADER_BYTES + seg.offset("k"), HEADER_BYTES + seg.offset("v"));
        let dtype = self.spec.geometry.dtype;
        let mut full_pages: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut new_tails: Vec<Option<(Vec<u8>, usize)>> = Vec::new();
        for h in 0..hkv {
            let (mut bytes, mut len) = match tails[h].clone() {
                Some(t) => t,
                None => (vec![0u8; seg.page_bytes], 0),
            };
            for i in 0..n {
                let r = (i * hkv + h) * d..(i * hkv + h + 1) * d;
                for (c, (&kx, &vx)) in k[r.clone()].iter().zip(&v[r]).enumerate() {
                    bytes[koff + (len * d + c) * 2..][..2].copy_from_slice(&dense_bytes(dtype, kx));
                    bytes[voff + (len * d + c) * 2..][..2].copy_from_slice(&dense_bytes(dtype, vx));
                }
                len += 1;
                if len == p {
                    bytes[..HEADER_BYTES].copy_from_slice(&PageHeader { tier: TAIL_TIER, flags: 0, length: p as u32 }.to_bytes());
                    full_pages.push((h, std::mem::replace(&mut bytes, vec![0u8; seg.page_bytes])));
                    len = 0;
                }
            }
            if len > 0 {
                bytes[..HEADER_BYTES].copy_from_slice(&PageHeader { tier: TAIL_TIER, flags: 0, length: len as u32 }.to_bytes());
                new_tails.push(Some((bytes, len)));
            } else {
                new_tails.push(None);
            }
        }
        // Old tail pages are superseded: free them, then allocate what is needed.
        self.store.free_tails(seq)?;
        if !full_pages.is_empty() {
            // Head-major: page k of a head is logical page `before + k`.
            let mut k_of = vec![0usize; hkv];
            let now: Vec<bool> = full_pages
                .iter()
                .map(|(h, _)| {
                    k_of[*h] += 1;
                    encode.contains(&(before + k_of[*h] - 1))
                })
                .collect();
            let heads: Vec<usize> = full_pages.iter().map(|(h, _)| *h).collect();
            let (to_code, dense): (Vec<_>, Vec<_>) = full_pages.into_iter().zip(&now).partition(|(_, &now)| now);
            let to_code: Vec<(usize, Vec<u8>)> = to_code.into_iter().map(|(pg, _)| pg).collect();
            let mut coded = Vec::new().into_iter();
            if !to_code.is_empty() {
                self.ensure_radius_scales(target, &to_code, koff)?;
                let encoded = self.encode_pages(&to_code, target)?;
                if self.cert.keeps_originals() {
                    self.record_originals(&to_code, &encoded)?;
                }
                coded = encoded.into_iter();
            }
            // Dense pages keep their tail-format bytes (header: tier 0, a full page).
            let mut kept = Vec::with_capacity(dense.len());
            for ((_, bytes), _) in &dense {
                let page = self.store.pool_mut().alloc(TAIL_TIER)?;
                self.store.upload(page, bytes)?;
                kept.push(page);
            }
            let mut kept = kept.into_iter();
            let pages: Vec<(usize, PageRef)> = heads.into_iter().zip(&now).map(|(h, &c)| (h, if c { coded.next() } else { kept.next() }.expect("one page per full page"))).collect();
            self.store.push_full(seq, pages)?;
        }
        self.encode_dense_pages(&old)?;
        for (h, t) in new_tails.into_iter().enumerate() {
            if let Some((bytes, len)) = t {
                self.store.set_tail(seq, h, bytes, len)?;
            }
        }
        self.store.grow(seq, n)
    }

    /// Tiles sequence `s0` into `batch` sequences of `len` tokens by replicating its page bytes
    /// on the device with a doubling copy: page contents repeat, their bytes are real encoded
    /// data. `s0` must be the only sequence of a fresh cache, appended with `t` full pages per
    /// kv head and `len % P` more tokens, where `t` is the largest divisor of `len / P` up to
    /// 16 (pages are allocated in region order, the template first). Returns the sequence ids,
    /// `s0` first. Benchmarks build large batches with it (kvforge-lab's `fill_for_bench`).
    pub fn tile_sequence(&mut self, s0: usize, batch: usize, len: usize) -> Result<Vec<usize>> {
        self.store.tile_sequence(s0, batch, len, self.cfg.target_tier, self.spec.tiers.len())
    }

    /// The tail page of (seq, head): its bytes (the host mirror, or the page downloaded if a
    /// device append made the mirror stale) and token count.
    pub(crate) fn tail_bytes(&self, seq: usize, head: usize) -> Result<Option<(std::borrow::Cow<'_, [u8]>, usize)>> {
        self.store.tail_bytes_current(seq, head)
    }

    /// Overwrites bytes of a page (low level: tools and corruption tests).
    pub fn write_page_bytes(&mut self, page: PageRef, at: usize, bytes: &[u8]) -> Result<()> {
        self.store.write_page_bytes(page, at, bytes)
    }

    /// Turns host-side header verification on or off.
    pub fn set_verify_headers(&mut self, on: bool) {
        self.cfg.verify_headers = on;
    }

    /// Downloads one page's bytes (header + segment + padding).
    pub fn download_page(&self, page: PageRef) -> Result<Vec<u8>> {
        self.store.download_page(page)
    }

    /// Spherical tiers need per-(kv head, group) radius scales before the first encode: unless
    /// set with [`KvCache::set_radius_scales`], they are taken from the first pages encoded
    /// (largest radius × headroom / 255; larger radii later clip to code 255).
    pub(crate) fn ensure_radius_scales(&mut self, tier: TierId, pages: &[(usize, Vec<u8>)], koff: usize) -> Result<()> {
        let KeyScheme::Spherical { group, .. } = self.spec.tiers[tier as usize].key else { return Ok(()) };
        if self.side.is_set(tier, RADIUS_SCALE) {
            return Ok(());
        }
        let (d, p, hkv) = (self.cfg.head_dim, self.spec.page.tokens, self.cfg.num_kv_heads);
        let ng = d / group;
        let mut max_r = vec![0f32; hkv * ng];
        let dtype = self.spec.geometry.dtype;
        for (h, bytes) in pages {
            for t in 0..p {
                for j in 0..ng {
                    let r2: f32 = (0..group)
                        .map(|c| {
                            let at = koff + (t * d + j * group + c) * 2;
                            let x = dense_value(dtype, [bytes[at], bytes[at + 1]]);
                            x * x
                        })
                        .sum();
                    max_r[h * ng + j] = max_r[h * ng + j].max(r2.sqrt());
                }
            }
        }
        let scales: Vec<f32> = max_r.iter().map(|&r| if r > 0.0 { r * self.cfg.radius_headroom / 255.0 } else { 1.0 }).collect();
        self.set_radius_scales(tier, &scales)
    }

    /// Sets the radius scales [num_kv_heads][groups] of spherical tier `tier`.
    pub fn set_radius_scales(&mut self, tier: TierId, scales: &[f32]) -> Result<()> {
        let Some(per_head) = self.side.len_per_head(tier, RADIUS_SCALE) else {
            return Err(RtError::BadTier(tier, "radius scales belong to spherical tiers".into()));
        };
        let want = self.cfg.num_kv_heads * per_head;
        if scales.len() != want || scales.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
            return Err(RtError::ShapeMismatch { what: "radius scales".into(), expected: format!("{want} positive finite values"), got: format!("{} values", scales.len()) });
        }
        self.side.set_f32(&self.engine.dev().stream, tier, RADIUS_SCALE, scales)
    }

    /// Radius scales of a spherical tier, once set.
    pub fn radius_scales(&self, tier: TierId) -> Result<Option<Vec<f32>>> {
        self.side.get_f32(&self.engine.dev().stream, tier, RADIUS_SCALE)
    }

    /// Device pointers of the per-tier tables the kernels index by tier (null where unset).
    pub(crate) fn tier_pointers(&self) -> TierPointers {
        TierPointers { side: self.side.pointers(&self.engine.dev().stream) }
    }

    /// Encodes full tail-format pages (host bytes) into `target`, in batches that fit the
    /// free tail pages. Returns the new pages in order.
    pub(crate) fn encode_pages(&mut self, pages: &[(usize, Vec<u8>)], target: TierId) -> Result<Vec<PageRef>> {
        let mut out = Vec::with_capacity(pages.len());
        let mut at = 0;
        while at < pages.len() {
            let batch = (pages.len() - at).min(self.store.pool().free_pages(TAIL_TIER).max(1));
            let mut staged = Vec::with_capacity(batch);
            for (_, bytes) in &pages[at..at + batch] {
                let page = self.store.pool_mut().alloc(TAIL_TIER)?;
                self.store.upload(page, bytes)?;
                staged.push(page);
            }
            let dst: Vec<PageRef> = (0..batch).map(|_| self.store.pool_mut().alloc(target)).collect::<Result<_>>()?;
            let heads: Vec<u32> = pages[at..at + batch].iter().map(|(h, _)| *h as u32).collect();
            self.transcode(&staged, &dst, &heads, TAIL_TIER, target)?;
            for p in staged {
                self.store.pool_mut().free(p);
            }
            out.extend(dst);
            at += batch;
        }
        Ok(out)
    }

    /// Checks every mapped page's header against the bookkeeping; names the first bad page.
    pub fn verify_pages(&self, seqs: &[usize]) -> Result<()> {
        self.store.verify_pages(seqs)
    }

    /// Resident bytes per tier over all sequences.
    pub fn memory_report(&self) -> Vec<TierUsage> {
        self.store.memory_report(&self.spec, self.cfg.head_dim)
    }

    /// Re-codes page `index` of (seq, head) into tier `to` (drop frees it): the one-move case of
    /// [`retier_pages`](Self::retier_pages).
    pub fn retier(&mut self, seq: usize, head: usize, index: usize, to: TierId) -> Result<()> {
        self.retier_pages(seq, &[(head, index, to)]).map(|_| ())
    }

    /// Applies page moves `(kv head, index, to)` to one sequence: [`retier_many`](Self::retier_many)
    /// of one sequence. Returns the number of launches.
    pub fn retier_pages(&mut self, seq: usize, moves: &[PageMove]) -> Result<usize> {
        Ok(self.retier_many(&[(seq, moves)])?[0])
    }

    /// Applies page moves `(kv head, index, to)` to several sequences with one transcode
    /// launch per (from tier, to tier) pair for all of them, not one per page or per sequence
    /// (issue 7): at an RDR boundary of a batch every sequence's plan lands at once, and the
    /// launches end in one synchronisation. Returns, per sequence, the launches that carried
    /// its pages. A sequence may appear once.
    ///
    /// `index` counts the head's full pages as they are *before* the call (what
    /// [`pages`](Self::pages) lists, tail excluded): dropped pages leave the tables only at the
    /// end, so callers never shift indices. Pages only move down the ladder; the drop tier frees
    /// the page without a launch, and the other pages keep their logical positions.
    ///
    /// Everything is checked before anything changes ([`MoveBatch::plan`]): a missing sequence
    /// or page, or a page named twice (`BadInput`), an unknown tier, a move up, a spherical
    /// tier without radius scales (`BadTier`), too few free pages (`OutOfPages`) leave the cache
    /// as it was. Then drops free their pages and the launches run deepest source tier first,
    /// each freeing its sources. A device error in a launch stops the batch: the drops and the
    /// launches before it are applied, the failing launch's pages keep their tier (nothing
    /// leaks).
    pub fn retier_many(&mut self, batch: &[(usize, &[PageMove])]) -> Result<Vec<usize>> {
        let seqs: Vec<usize> = batch.iter().map(|b| b.0).collect();
        for &s in &seqs {
            self.store.seq_len(s)?;
        }
        let moves = MoveBatch::seq_moves(batch)?;
        let tier_of = |seq: usize, head: usize, index: usize| self.store.full_page(seq, head, index).map(|p| p.tier);
        let pool = self.store.pool();
        let free: Vec<usize> = (0..self.spec.tiers.len()).map(|t| pool.free_pages(t as TierId)).collect();
        let plan = MoveBatch::plan(&self.spec, &moves, tier_of, &free, |t| pool.out_of_pages(t))?;
        for &(_, to, _) in &plan.launches {
            if let Some(table) = self.side.missing(to) {
                return Err(RtError::BadTier(to, format!("set its {table} side table before re-coding into it")));
            }
        }
        for &s in &seqs {
            self.store.bump_epoch(s)?;
        }
        for &m in &plan.drops {
            let (s, (h, i, _)) = moves[m];
            let page = self.store.full_page(s, h, i)?;
            self.store.pool_mut().free(page);
        }
        let launched = self.launch_moves(&moves, &plan.launches);
        for &s in &seqs {
            let dropped: Vec<(usize, usize)> = plan.drops.iter().map(|&m| moves[m]).filter(|m| m.0 == s).map(|(_, (h, i, _))| (h, i)).collect();
            if dropped.is_empty() {
                continue;
            }
            self.store.remove_full(s, &dropped)?;
            self.mass_window_dropped(s, &dropped)?;
        }
        launched?;
        Ok(plan.launches_of(&moves, &seqs))
    }
}
