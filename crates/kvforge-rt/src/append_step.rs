//! Decode-step appends on the device (issue 29): one token per listed sequence, from device
//! memory, in one kernel launch for the whole batch.
//!
//! [`KvCache::append`] is a host path (copy the tail page's mirror, write the rows, upload): in
//! a serving loop that is one round trip per sequence per layer per step. Here the host only
//! does the bookkeeping: it checks capacity for the whole batch first (all or nothing), gives
//! sequences without a tail page a new one, lists each (sequence, kv head)'s page and row, and
//! launches the append kernel (templates/include/kvforge/append.cuh), which rotates the rows
//! into the spec's basis where it rotates, writes them and rewrites the page header. The tail
//! mirrors become stale and are downloaded again only where a host path reads them
//! ([`crate::store`]). A tail that fills is encoded into the target tier by the transcode
//! kernel straight from its device page (with a window policy, [`crate::WindowPolicy`], it
//! stays a dense full page and the page it pushes out of the window is encoded instead);
//! only where the encode needs the page's bytes on the host (a spherical tier's first radius
//! calibration, certified decode's originals) is it downloaded, once per filled page, and
//! encoded by the host path's steps.
//!
//! A prompt goes in the same way ([`KvCache::append_external_device`]): many tokens of one
//! sequence, one chunk per (page, kv head) in one launch of the same kernel, then one transcode
//! launch for every filled page, in batches that fit the free tail pages. The host touches no
//! token: it lists the chunks and keeps the page tables, and waits for nothing (the encode's
//! fault flags are read asynchronously).

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use kvforge_spec::{Basis, KeyScheme, VariantId, HEADER_BYTES, TAIL_TIER};

use crate::cache::KvCache;
use crate::error::{drv, Result, RtError};
use crate::external::{ElemType, ExternalTensor};
use crate::kernels::Kernel;
use crate::pool::PageRef;

/// What a decode step does to one sequence, decided before anything changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StepPlan {
    /// Tokens in the tail pages before the step (0: the sequence gets new tail pages).
    pub tail_len: usize,
    /// The step fills the tail pages: they are encoded into the target tier after the launch
    /// (or kept dense, where the cache's window policy says so).
    pub fills: bool,
}

/// Plans one step of every sequence from its tail length (`None`: no tail page) at `page`
/// tokens per page, and the pages it needs: `(new tail pages, new target pages)` per kv head.
/// Host bookkeeping only, so that it can be tested without a device.
pub(crate) fn plan_step(tails: &[Option<usize>], page: usize) -> (Vec<StepPlan>, usize, usize) {
    let mut new_tails = 0;
    let mut filled = 0;
    let plans = tails
        .iter()
        .map(|t| {
            let tail_len = t.unwrap_or(0);
            new_tails += usize::from(t.is_none());
            let fills = tail_len + 1 == page;
            filled += usize::from(fills);
            StepPlan { tail_len, fills }
        })
        .collect();
    (plans, new_tails, filled)
}

/// A run of a bulk append that lands in one page of every kv head: tokens
/// `tok0 .. tok0 + count` of the call into rows `pos0 .. pos0 + count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub pos0: usize,
    pub count: usize,
    pub tok0: usize,
}

impl Chunk {
    /// The chunk ends its page: the page is encoded into the target tier (or kept dense, where
    /// the cache's window policy says so).
    pub(crate) fn fills(&self, page: usize) -> bool {
        self.pos0 + self.count == page
    }
}

/// Splits `n` new tokens of a sequence whose tail page holds `tail` tokens (`None`: no tail
/// page) into page chunks at `page` tokens per page: the first continues the tail (when there
/// is one), every later one starts a fresh page, and only the last may leave a page partly
/// filled (the new tail). Host bookkeeping only, tested without a device.
pub(crate) fn plan_bulk(tail: Option<usize>, n: usize, page: usize) -> Vec<Chunk> {
    let mut chunks = Vec::with_capacity(n.div_ceil(page.max(1)) + 1);
    let (mut tok, mut pos) = (0, tail.unwrap_or(0));
    while tok < n {
        let count = (page - pos).min(n - tok);
        chunks.push(Chunk { pos0: pos, count, tok0: tok });
        tok += count;
        pos = 0;
    }
    chunks
}

/// The append kernel's chunk word: `pos0` (bits 0..15), `count` (bits 16..31) and the
/// caller's row of the chunk's first token (bits 32..63), as templates/include/kvforge/append.cuh
/// unpacks it. The caller keeps every field in range (pages of at most 65535 tokens, fewer
/// than 2³² rows).
pub(crate) fn chunk_word(pos0: usize, count: usize, src_row: usize) -> u64 {
    debug_assert!(pos0 <= 0xffff && count <= 0xffff && src_row <= u32::MAX as usize);
    pos0 as u64 | (count as u64) << 16 | (src_row as u64) << 32
}

/// Checks that `seqs` names each sequence at most once.
pub(crate) fn check_distinct(seqs: &[usize]) -> Result<()> {
    let mut sorted = seqs.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(RtError::BadInput(format!("append_step: sequence {} is listed twice (one token per sequence per step)", w[0])));
    }
    Ok(())
}

impl KvCache {
    /// Appends one token to every sequence of `seqs` from device memory: `k`, `v` are
    /// `[seqs.len()][num_kv_heads][head_dim]` in the spec dtype, row-major, on this cache's
    /// GPU. The same result as [`KvCache::append`] of each row (byte-identical tail pages for
    /// specs that do not rotate; rotated ones round the rotation computed on the device), in one
    /// launch. Either every sequence gets its token or, on out-of-pages or a bad argument,
    /// nothing changes. Runs on the cache's stream; the launch and any encode of filled tails
    /// are ordered after what the stream ran before.
    pub fn append_step_external(&mut self, seqs: &[usize], k: &ExternalTensor, v: &ExternalTensor) -> Result<()> {
        let (hkv, d) = (self.cfg.num_kv_heads, self.cfg.head_dim);
        for &s in seqs {
            self.seq_len(s)?;
        }
        check_distinct(seqs)?;
        k.check_rank("k", 3, "[n_seqs, num_kv_heads, head_dim]")?;
        v.check_rank("v", 3, "[n_seqs, num_kv_heads, head_dim]")?;
        let elem = ElemType::of(self.spec.geometry.dtype);
        let dims = vec![("n_seqs", seqs.len()), ("num_kv_heads", hkv), ("head_dim", d)];
        self.check_all(&[("k", k, elem.clone(), dims.clone()), ("v", v, elem, dims)])?;
        if seqs.is_empty() {
            return Ok(());
        }
        // SAFETY: both buffers were checked above to be n·hkv·d elements of the spec dtype in
        // device memory of this cache's context.
        unsafe { self.append_step_raw(seqs, k.ptr, v.ptr) }
    }

    /// [`append_step_external`](Self::append_step_external) from buffers of this cache's
    /// device: `k`, `v` hold the 16-bit values of `[seqs.len()][num_kv_heads][head_dim]`.
    pub fn append_step(&mut self, seqs: &[usize], k: &CudaSlice<u16>, v: &CudaSlice<u16>) -> Result<()> {
        let st = self.engine.dev().stream.clone();
        let ordinal = self.engine.dev().ctx.ordinal();
        let elem = ElemType::of(self.spec.geometry.dtype);
        let (hkv, d) = (self.cfg.num_kv_heads, self.cfg.head_dim);
        let want = seqs.len() * hkv * d;
        if k.len() != want || v.len() != want {
            return Err(RtError::ShapeMismatch {
                what: "append_step: k/v".into(),
                expected: format!("{} sequences × {hkv} kv heads × {d} values each ({want})", seqs.len()),
                got: format!("k {} and v {} values", k.len(), v.len()),
            });
        }
        let (kp, _gk) = k.device_ptr(&st);
        let (vp, _gv) = v.device_ptr(&st);
        let shape = [seqs.len(), hkv, d];
        self.append_step_external(seqs, &ExternalTensor::contiguous(kp, elem.clone(), &shape, ordinal), &ExternalTensor::contiguous(vp, elem, &shape, ordinal))
    }

    /// The step after the arguments were checked.
    ///
    /// # Safety
    /// `k` and `v` must address `seqs.len() · num_kv_heads · head_dim` 16-bit values of device
    /// memory of this cache's context, alive until the stream has run the launch.
    unsafe fn append_step_raw(&mut self, seqs: &[usize], k: u64, v: u64) -> Result<()> {
        let (hkv, d, p) = (self.cfg.num_kv_heads, self.cfg.head_dim, self.spec.page.tokens);
        let target = self.cfg.target_tier;
        let tails: Vec<Option<usize>> = seqs.iter().map(|&s| self.uniform_tail(s)).collect::<Result<_>>()?;
        let (plans, new_tails, filled) = plan_step(&tails, p);
        let mut need = vec![0usize; self.spec.tiers.len()];
        need[TAIL_TIER as usize] = new_tails * hkv;
        need[target as usize] += filled * hkv;
        self.store.pool().reserve(&need)?;
        // Compiled before anything changes, so that a compile error leaves the cache as it was.
        let kernel = self.engine.kernel(&self.spec, &VariantId::append(&self.spec, d))?;
        // Bookkeeping: new tail pages, then every row's page and position.
        let seg = self.spec.segment(TAIL_TIER, d);
        let mut rows: Vec<u64> = Vec::with_capacity(2 * seqs.len() * hkv);
        for (i, (&s, plan)) in seqs.iter().zip(&plans).enumerate() {
            for h in 0..hkv {
                // Tail lengths were checked above: every head has this tail, or none.
                let page = match self.store.tail_page(s, h)? {
                    Some((page, _)) => page,
                    None => self.store.new_device_tail(s, h, seg.page_bytes)?,
                };
                rows.push(page.offset);
                rows.push(chunk_word(plan.tail_len, 1, i * hkv + h));
            }
        }
        // SAFETY: every chunk names a tail page of the pool and one row below the page size
        // (the plan); k / v hold seqs.len() · hkv rows (the caller's contract).
        unsafe { self.launch_append(&kernel, &rows, k, v) }?;

        for &s in seqs {
            for h in 0..hkv {
                self.store.tail_grew_on_device(s, h, 1)?;
            }
        }
        let full: Vec<usize> = seqs.iter().zip(&plans).filter(|(_, pl)| pl.fills).map(|(&s, _)| s).collect();
        if !full.is_empty() {
            self.encode_filled_tails(&full)?;
        }
        for &s in seqs {
            self.store.grow(s, 1)?;
        }
        Ok(())
    }

    /// The tail tokens of `seq` (`None`: no tail page). Every kv head of a sequence holds the
    /// same number (appends write all heads); a mismatch is an error.
    pub(crate) fn uniform_tail(&self, seq: usize) -> Result<Option<usize>> {
        let t = self.store.page_counts(seq, 0)?.1;
        for h in 1..self.cfg.num_kv_heads {
            let th = self.store.page_counts(seq, h)?.1;
            if th != t {
                return Err(RtError::BadInput(format!("sequence {seq}: kv head {h} holds {th:?} tail tokens, head 0 {t:?}")));
            }
        }
        Ok(t)
    }

    /// Uploads the chunk list `rows` (page offset, [`chunk_word`]) and launches the append
    /// kernel over it, one CTA per chunk.
    ///
    /// # Safety
    /// Every chunk must name a tail-tier page of this cache's pool and rows below the page
    /// size; `k` and `v` must address every row the chunks read (`[tokens][num_kv_heads]
    /// [head_dim]` 16-bit values of this context's device memory), alive until the stream has
    /// run the launch.
    unsafe fn launch_append(&mut self, kernel: &Kernel, rows: &[u64], k: u64, v: u64) -> Result<()> {
        let st = self.engine.dev().stream.clone();
        if self.append_rows.as_ref().is_none_or(|b| b.len() < rows.len()) {
            self.append_rows = Some(st.alloc_zeros::<u64>(rows.len().next_power_of_two()).map_err(drv("append rows"))?);
        }
        let buf = self.append_rows.as_mut().expect("allocated above");
        st.memcpy_htod(rows, &mut buf.slice_mut(0..rows.len())).map_err(drv("append rows"))?;
        let rows_ptr = buf.device_ptr(&st).0;
        // SAFETY: the chunk list was copied above on this stream; the caller vouches for it.
        unsafe { self.launch_append_at(kernel, rows_ptr, rows.len() / 2, k, v) }
    }

    /// Launches the append kernel over `n_rows` chunks already in device memory at `rows_ptr`
    /// (page offset, [`chunk_word`] pairs), on [`Engine::launch_stream`](crate::engine::Engine)
    /// and with no host copy (a CUDA graph may be capturing it).
    ///
    /// # Safety
    /// As [`Self::launch_append`], for the chunks at `rows_ptr`, which must stay alive and
    /// unchanged until the stream has run the launch (or every replay of a captured graph).
    pub(crate) unsafe fn launch_append_at(&mut self, kernel: &Kernel, rows_ptr: u64, n_rows: usize, k: u64, v: u64) -> Result<()> {
        let (hkv, d) = (self.cfg.num_kv_heads, self.cfg.head_dim);
        let seg = self.spec.segment(TAIL_TIER, d);
        let st = self.engine.launch_stream();
        let arena = self.store.arena_ptr();
        let n_rows = n_rows as i32;
        let src_stride = hkv as i32;
        let (k_off, v_off, page_bytes) = ((HEADER_BYTES + seg.offset("k")) as i32, (HEADER_BYTES + seg.offset("v")) as i32, seg.page_bytes as i32);
        let seed: u32 = match self.basis {
            Basis::Hadamard { seed } => seed,
            Basis::Identity => 0,
        };
        let cfg = LaunchConfig { grid_dim: (n_rows as u32, 1, 1), block_dim: (kernel.threads, 1, 1), shared_mem_bytes: 0 };
        let v_id = VariantId::append(&self.spec, d);
        crate::kernels::trace_launch(|| v_id.symbol(), &cfg);
        let mut b = st.launch_builder(&kernel.func);
        b.arg(&arena).arg(&rows_ptr).arg(&k).arg(&v).arg(&n_rows).arg(&src_stride).arg(&k_off).arg(&v_off).arg(&page_bytes).arg(&seed);
        // SAFETY: the argument list mirrors append.cu.tera's signature; the arena is this
        // cache's, and the caller vouches for the chunks, the pages and rows they name and the
        // buffers.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(drv(format!("launch {v_id}")))
    }

    /// Appends `k`, `v` (`[T][num_kv_heads][head_dim]` in the spec dtype, device memory of this
    /// cache's GPU, contiguous) to `seq` without staging them through the host: what
    /// [`KvCache::append_external`] does (full pages encoded into the target tier, the rest in
    /// the tail page; rotated specs round the rotation computed on the device, as
    /// [`append_step_external`](Self::append_step_external)), in one append launch and one
    /// transcode launch per batch of pages that fits the free tail pages (usually one).
    /// Non-finite values are stored as given (the host path refuses them). Where encoding
    /// needs the pages on the host ([`Self::encode_needs_host`]: an uncalibrated spherical
    /// target, kept originals) this is `append_external`. All or nothing on out-of-pages and
    /// bad arguments; a device error part way leaves the sequence in an unspecified state.
    /// Nothing waits for the GPU: the transcode kernel's fault flags are watched
    /// asynchronously, as a decode step's encode of its filled tails is, so a fault (a staged
    /// page not in the tail tier) is raised by a later decode or by [`KvCache::synchronize`].
    /// A prompt written into every layer of a model therefore costs the host no
    /// synchronisation per layer, and the host queues the next layer while the GPU encodes.
    pub fn append_external_device(&mut self, seq: usize, k: &ExternalTensor, v: &ExternalTensor) -> Result<()> {
        let (hkv, p) = (self.cfg.num_kv_heads, self.spec.page.tokens);
        let n = self.check_append(seq, k, v)?;
        if n == 0 {
            return Ok(());
        }
        if self.encode_needs_host(self.cfg.target_tier) || p > 0xffff {
            return self.append_external(seq, k, v);
        }
        if n.checked_mul(hkv).is_none_or(|rows| rows > u32::MAX as usize) {
            return Err(RtError::BadInput(format!("append: {n} tokens × {hkv} kv heads is more rows than one device append takes (2^32)")));
        }
        // SAFETY: both buffers were checked above to be n·hkv·d elements of the spec dtype in
        // device memory of this cache's context.
        unsafe { self.append_device_raw(seq, n, k.ptr, v.ptr) }
    }

    /// [`append_external_device`](Self::append_external_device) from buffers of this cache's
    /// device: `k`, `v` hold the 16-bit values of `[T][num_kv_heads][head_dim]`.
    pub fn append_device(&mut self, seq: usize, k: &CudaSlice<u16>, v: &CudaSlice<u16>) -> Result<()> {
        let st = self.engine.dev().stream.clone();
        let ordinal = self.engine.dev().ctx.ordinal();
        let elem = ElemType::of(self.spec.geometry.dtype);
        let (hkv, d) = (self.cfg.num_kv_heads, self.cfg.head_dim);
        if k.len() != v.len() || !k.len().is_multiple_of(hkv * d) {
            return Err(RtError::ShapeMismatch { what: "append_device: k/v".into(), expected: format!("T × {hkv} kv heads × {d} values each"), got: format!("k {} and v {} values", k.len(), v.len()) });
        }
        let (kp, _gk) = k.device_ptr(&st);
        let (vp, _gv) = v.device_ptr(&st);
        let shape = [k.len() / (hkv * d), hkv, d];
        self.append_external_device(seq, &ExternalTensor::contiguous(kp, elem.clone(), &shape, ordinal), &ExternalTensor::contiguous(vp, elem, &shape, ordinal))
    }

    /// The bulk append after the arguments were checked.
    ///
    /// # Safety
    /// `k` and `v` must address `n · num_kv_heads · head_dim` 16-bit values of device memory of
    /// this cache's context, alive until the stream has run the launches.
    unsafe fn append_device_raw(&mut self, seq: usize, n: usize, k: u64, v: u64) -> Result<()> {
        let (hkv, d, p) = (self.cfg.num_kv_heads, self.cfg.head_dim, self.spec.page.tokens);
        let target = self.cfg.target_tier;
        let tail = self.uniform_tail(seq)?;
        let chunks = plan_bulk(tail, n, p);
        let filled = chunks.iter().filter(|c| c.fills(p)).count();
        let fresh = chunks.len() - usize::from(tail.is_some());
        // The window policy: filling chunk i ends logical page `before + i` (only the last
        // chunk may not fill); the pages outside `encode` stay dense. Older dense pages this
        // append pushes out of the window are encoded first.
        let before = self.store.seq_len(seq)? / p;
        let encode = self.cfg.window.to_encode(before, before + filled);
        let kept = filled - self.cfg.window.encodes_new(before, before + filled);
        let old = self.window_encodes(seq, before, before + filled)?;
        // Fresh pages are staged a batch at a time in free tail pages; one page per kv head is
        // enough to make progress (and to hold the new tail), besides the pages kept dense.
        let mut need = vec![0usize; self.spec.tiers.len()];
        need[TAIL_TIER as usize] = if fresh > 0 { hkv } else { 0 } + kept * hkv;
        need[target as usize] += (filled - kept) * hkv + old.len();
        self.store.pool().reserve(&need)?;
        let kernel = self.engine.kernel(&self.spec, &VariantId::append(&self.spec, d))?;
        self.encode_dense_pages(&old)?;
        let seg = self.spec.segment(TAIL_TIER, d);
        let mut at = 0;
        while at < chunks.len() {
            // This batch: the tail's chunk (first batch only), then as many fresh chunks as
            // there are free tail pages for every kv head.
            let mut room = self.store.pool().free_pages(TAIL_TIER) / hkv;
            let mut take = 0;
            for i in at..chunks.len() {
                if i == 0 && tail.is_some() {
                    take += 1;
                } else if room > 0 {
                    room -= 1;
                    take += 1;
                } else {
                    break;
                }
            }
            if take == 0 {
                // Unreachable after the reserve above (each batch frees its staging pages);
                // an error rather than a loop that never advances.
                return Err(self.store.pool().out_of_pages(TAIL_TIER));
            }
            let batch = &chunks[at..at + take];
            let mut rows: Vec<u64> = Vec::with_capacity(2 * take * hkv);
            // (kv head, page, kept dense) of every page the batch fills, in order.
            let mut staged: Vec<(usize, PageRef, bool)> = Vec::new();
            for (j, c) in batch.iter().enumerate() {
                let on_tail = at + j == 0 && tail.is_some();
                for h in 0..hkv {
                    let page = if on_tail {
                        let page = self.store.tail_page(seq, h)?.ok_or(RtError::NoPage { seq, head: h, index: usize::MAX })?.0;
                        // A tail this batch fills leaves the table now: the batch's last chunk
                        // may put a new tail in its place below.
                        if c.fills(p) {
                            self.store.take_tail(seq, h)?;
                        }
                        page
                    } else if c.fills(p) {
                        self.store.pool_mut().alloc(TAIL_TIER)?
                    } else {
                        // The last chunk, partly filling a fresh page: the new tail.
                        self.store.new_device_tail(seq, h, seg.page_bytes)?
                    };
                    rows.push(page.offset);
                    rows.push(chunk_word(c.pos0, c.count, c.tok0 * hkv + h));
                    if c.fills(p) {
                        staged.push((h, page, !encode.contains(&(before + at + j))));
                    }
                }
            }
            // SAFETY: every chunk names a tail page of the pool (the tail, or one allocated
            // above) and rows pos0 .. pos0 + count ≤ page size (plan_bulk); its source rows lie
            // below n · hkv (the caller's contract).
            unsafe { self.launch_append(&kernel, &rows, k, v) }?;
            for c in batch {
                if !c.fills(p) {
                    for h in 0..hkv {
                        self.store.tail_grew_on_device(seq, h, c.count)?;
                    }
                }
            }
            if !staged.is_empty() {
                let coded: Vec<&(usize, PageRef, bool)> = staged.iter().filter(|s| !s.2).collect();
                let src: Vec<PageRef> = coded.iter().map(|s| s.1).collect();
                let heads: Vec<u32> = coded.iter().map(|s| s.0 as u32).collect();
                let dst: Vec<PageRef> = (0..src.len()).map(|_| self.store.pool_mut().alloc(target)).collect::<Result<_>>()?;
                if !src.is_empty() {
                    let r = self.transcode_watched(&src, &dst, &heads, TAIL_TIER, target);
                    for &page in &src {
                        self.store.pool_mut().free(page);
                    }
                    if let Err(e) = r {
                        dst.into_iter().for_each(|page| self.store.pool_mut().free(page));
                        return Err(e);
                    }
                }
                // Chunk-major, heads in order: each head's pages follow its last one. A kept
                // page stays where the kernel wrote it (its header: tier 0, a full page).
                let mut dst = dst.into_iter();
                self.store.push_full(seq, staged.iter().map(|&(h, page, kept)| (h, if kept { page } else { dst.next().expect("one per coded page") })))?;
            }
            self.store.grow(seq, batch.iter().map(|c| c.count).sum())?;
            at += take;
        }
        Ok(())
    }

    /// Whether encoding into `tier` reads the page's bytes on the host: a spherical tier's
    /// first pages calibrate its radius scales, and certified decode keeps originals.
    pub(crate) fn encode_needs_host(&self, tier: kvforge_spec::TierId) -> bool {
        let spherical_uncalibrated = matches!(self.spec.tiers[tier as usize].key, KeyScheme::Spherical { .. }) && !self.side.is_set(tier, "radius_scale");
        spherical_uncalibrated || self.cert.keeps_originals()
    }

    /// Puts the filled tail pages of `seqs` (every kv head) after each head's full pages,
    /// encoded into the target tier, or as they are where the window policy keeps them dense
    /// (then the dense page the fill pushes out of the window, if any, is encoded); the
    /// sequences' lengths are not yet grown.
    pub(crate) fn encode_filled_tails(&mut self, seqs: &[usize]) -> Result<()> {
        let (hkv, p) = (self.cfg.num_kv_heads, self.spec.page.tokens);
        let mut coded: Vec<usize> = Vec::with_capacity(seqs.len());
        let mut old = Vec::new();
        for &s in seqs {
            let page = self.store.seq_len(s)? / p;
            if self.cfg.window.to_encode(page, page + 1).contains(&page) {
                coded.push(s);
            } else {
                for h in 0..hkv {
                    let tail = self.store.take_tail(s, h)?.ok_or(RtError::NoPage { seq: s, head: h, index: usize::MAX })?;
                    self.store.push_full(s, [(h, tail)])?;
                }
            }
            old.extend(self.window_encodes(s, page, page + 1)?);
        }
        self.encode_tails_now(&coded)?;
        self.encode_dense_pages(&old)
    }

    /// Encodes the filled tail pages of `seqs` (every kv head) into the target tier and puts
    /// them after each head's full pages.
    fn encode_tails_now(&mut self, seqs: &[usize]) -> Result<()> {
        if seqs.is_empty() {
            return Ok(());
        }
        let hkv = self.cfg.num_kv_heads;
        let target = self.cfg.target_tier;
        let mut src: Vec<(usize, usize, PageRef)> = Vec::with_capacity(seqs.len() * hkv);
        for &s in seqs {
            for h in 0..hkv {
                let page = self.store.take_tail(s, h)?.ok_or(RtError::NoPage { seq: s, head: h, index: usize::MAX })?;
                src.push((s, h, page));
            }
        }
        if self.encode_needs_host(target) {
            // The host path's steps on the downloaded pages (once per filled page).
            let d = self.cfg.head_dim;
            let seg = self.spec.segment(TAIL_TIER, d);
            let mut pages: Vec<(usize, Vec<u8>)> = Vec::with_capacity(src.len());
            for &(_, h, page) in &src {
                let mut bytes = self.store.download_page(page)?;
                bytes.truncate(seg.page_bytes);
                pages.push((h, bytes));
                self.store.pool_mut().free(page);
            }
            let koff = HEADER_BYTES + seg.offset("k");
            self.ensure_radius_scales(target, &pages, koff)?;
            let encoded = self.encode_pages(&pages, target)?;
            if self.cert.keeps_originals() {
                self.record_originals(&pages, &encoded)?;
            }
            for (i, &s) in seqs.iter().enumerate() {
                self.store.push_full(s, (0..hkv).zip(encoded[i * hkv..(i + 1) * hkv].iter().copied()))?;
            }
            return Ok(());
        }
        // Straight from the device pages: the kernel wrote their headers (tier 0, full).
        let staged: Vec<PageRef> = src.iter().map(|t| t.2).collect();
        let heads: Vec<u32> = src.iter().map(|t| t.1 as u32).collect();
        let dst: Vec<PageRef> = (0..src.len()).map(|_| self.store.pool_mut().alloc(target)).collect::<Result<_>>()?;
        let r = self.transcode_watched(&staged, &dst, &heads, TAIL_TIER, target);
        for p in staged {
            self.store.pool_mut().free(p);
        }
        if let Err(e) = r {
            dst.into_iter().for_each(|p| self.store.pool_mut().free(p));
            return Err(e);
        }
        for (i, &s) in seqs.iter().enumerate() {
            self.store.push_full(s, (0..hkv).zip(dst[i * hkv..(i + 1) * hkv].iter().copied()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_new_filling_and_plain_steps() {
        let (plans, new_tails, filled) = plan_step(&[None, Some(3), Some(63), Some(62)], 64);
        assert_eq!(plans, vec![StepPlan { tail_len: 0, fills: false }, StepPlan { tail_len: 3, fills: false }, StepPlan { tail_len: 63, fills: true }, StepPlan { tail_len: 62, fills: false }]);
        assert_eq!((new_tails, filled), (1, 1));
    }

    #[test]
    fn a_one_token_page_fills_on_its_first_row() {
        let (plans, new_tails, filled) = plan_step(&[None, None], 1);
        assert!(plans.iter().all(|p| p.fills && p.tail_len == 0));
        assert_eq!((new_tails, filled), (2, 2));
    }

    #[test]
    fn bulk_plans_continue_the_tail_then_fill_fresh_pages() {
        assert_eq!(plan_bulk(None, 0, 64), vec![]);
        assert_eq!(plan_bulk(Some(5), 0, 64), vec![]);
        assert_eq!(plan_bulk(None, 1, 64), vec![Chunk { pos0: 0, count: 1, tok0: 0 }]);
        assert_eq!(plan_bulk(None, 64, 64), vec![Chunk { pos0: 0, count: 64, tok0: 0 }]);
        assert_eq!(plan_bulk(Some(60), 70, 64), vec![Chunk { pos0: 60, count: 4, tok0: 0 }, Chunk { pos0: 0, count: 64, tok0: 4 }, Chunk { pos0: 0, count: 2, tok0: 68 }]);
        assert_eq!(plan_bulk(Some(3), 2, 64), vec![Chunk { pos0: 3, count: 2, tok0: 0 }]);
        for tail in [None, Some(0), Some(1), Some(63)] {
            for n in [1usize, 2, 63, 64, 65, 127, 128, 129, 2047, 2048] {
                let c = plan_bulk(tail, n, 64);
                assert_eq!(c.iter().map(|c| c.count).sum::<usize>(), n);
                assert!(c.windows(2).all(|w| w[0].fills(64) && w[1].pos0 == 0 && w[1].tok0 == w[0].tok0 + w[0].count));
                assert!(c.iter().all(|c| c.count > 0 && c.pos0 + c.count <= 64));
                assert_eq!(c[0].pos0, tail.unwrap_or(0));
            }
        }
    }

    #[test]
    fn chunk_words_pack_what_the_kernel_unpacks() {
        let w = chunk_word(63, 1, 7);
        assert_eq!((w & 0xffff, (w >> 16) & 0xffff, w >> 32), (63, 1, 7));
        let w = chunk_word(0, 64, u32::MAX as usize);
        assert_eq!((w & 0xffff, (w >> 16) & 0xffff, w >> 32), (0, 64, u32::MAX as u64));
    }

    #[test]
    fn a_sequence_listed_twice_is_rejected() {
        assert!(check_distinct(&[3, 1, 2]).is_ok());
        assert!(matches!(check_distinct(&[3, 1, 3]), Err(RtError::BadInput(m)) if m.contains("sequence 3")));
    }
}
