//! Page moves on the device: transcode launches whose arguments live in resident buffers.
//!
//! Applying a controller plan is a handful of transcode launches, one per (from, to) tier pair
//! ([`MoveBatch`](crate::MoveBatch)). Each launch used to upload its three argument lists into
//! fresh device allocations and read the error flag back — a stream synchronisation — before
//! the next launch could start, all on the decode thread at every RDR boundary (issue 7).
//! Here a batch uploads every launch's lists in one copy into a buffer the cache keeps, each
//! launch reports into its own flag word, and one download after the last launch says which
//! launches land. The outcome is the one of checking after every launch: launches apply in
//! order up to the first that faulted (or failed to launch); it and the ones after keep their
//! pages' tiers, and their destination pages go back to the pool.
//!
//! That needs the sources to stay allocated until the check, so a batch runs this way only
//! when the pool has a free page for every destination besides them. Otherwise (a nearly full
//! pool, where a deep launch must free pages for a later one) each launch is checked before
//! its sources are freed for the next, as before.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use kvforge_spec::{TierId, VariantId};

use crate::cache::KvCache;
use crate::error::{drv, Result, RtError};
use crate::moves::SeqMove;
use crate::params::TranscodeParams;
use crate::pool::PageRef;

/// The cache's resident buffers for page moves, grown to the largest batch seen.
#[derive(Default)]
pub(crate) struct MoveBuffers {
    /// Per launch: source offsets, destination offsets, kv heads (two u32 per word).
    args: Option<CudaSlice<u64>>,
    /// One error-flag word per launch of a batch; all zero between batches.
    flags: Option<CudaSlice<u32>>,
}

/// One transcode launch: `src[i]` (tier `from`) is re-coded into `dst[i]` (tier `to`) for kv
/// head `heads[i]`.
pub(crate) struct Transcode<'a> {
    pub from: TierId,
    pub to: TierId,
    pub src: &'a [PageRef],
    pub dst: &'a [PageRef],
    pub heads: &'a [u32],
}

/// How a run of launches ended: the first `landed` are good; `error` names why the next is not.
struct Outcome {
    landed: usize,
    error: Option<RtError>,
}

/// Argument words of one launch: `n` source offsets, `n` destination offsets, `⌈n/2⌉` head pairs.
fn arg_words(n: usize) -> usize {
    2 * n + n.div_ceil(2)
}

/// A buffer of at least `len` elements: `buf` when it is large enough, else a new zeroed one
/// (sized to a power of two, so a growing workload reallocates O(log) times).
fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(st: &std::sync::Arc<cudarc::driver::CudaStream>, buf: &mut Option<CudaSlice<T>>, len: usize, what: &'static str) -> Result<()> {
    if buf.as_ref().is_some_and(|b| b.len() >= len) {
        return Ok(());
    }
    *buf = Some(st.alloc_zeros::<T>(len.max(1).next_power_of_two()).map_err(drv(what))?);
    Ok(())
}

impl KvCache {
    /// Launches the `src → dst` transcode kernel over pages (same-length lists) and checks it.
    pub(crate) fn transcode(&mut self, src: &[PageRef], dst: &[PageRef], heads: &[u32], from: TierId, to: TierId) -> Result<()> {
        match self.run_transcodes(&[Transcode { from, to, src, dst, heads }], false).error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// [`transcode`](Self::transcode) without waiting for the GPU: the kernel raises the
    /// engine's error-flag word, which is watched asynchronously, so a fault is reported by a
    /// later [`KvCache::decode_step_external`] or by [`KvCache::synchronize`]. A decode step's
    /// encode of its filled tails uses it, so that a page boundary does not synchronise.
    pub(crate) fn transcode_watched(&mut self, src: &[PageRef], dst: &[PageRef], heads: &[u32], from: TierId, to: TierId) -> Result<()> {
        match self.run_transcodes(&[Transcode { from, to, src, dst, heads }], true).error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Runs one transcode launch over caller-chosen pages outside any sequence (tests and
    /// timing of the transcode kernels): `src[i]` (a page of tier `from`) re-coded into
    /// `dst[i]` (tier `to`) for kv head `heads[i]`, pages from [`alloc_page`](Self::alloc_page).
    /// A source whose header does not say `from` is the kernel's fault to report
    /// (`KernelFault`, its destination unwritten); the other pages of the launch are coded.
    pub fn transcode_pages(&mut self, from: TierId, to: TierId, src: &[PageRef], dst: &[PageRef], heads: &[u32]) -> Result<()> {
        if src.is_empty() || src.len() != dst.len() || src.len() != heads.len() {
            return Err(RtError::ShapeMismatch {
                what: "transcode_pages".into(),
                expected: "equal, non-zero counts of sources, destinations and heads".into(),
                got: format!("{} sources, {} destinations, {} heads", src.len(), dst.len(), heads.len()),
            });
        }
        if let Some(p) = src.iter().find(|p| p.tier != from).or_else(|| dst.iter().find(|p| p.tier != to)) {
            return Err(RtError::BadInput(format!("transcode_pages: page at {} is in tier {}, not {from} → {to}", p.offset, p.tier)));
        }
        if let Some(h) = heads.iter().find(|&&h| h as usize >= self.cfg.num_kv_heads) {
            return Err(RtError::NoKvHead { head: *h as usize, heads: self.cfg.num_kv_heads });
        }
        for t in [from, to] {
            if let Some(table) = self.side.missing(t) {
                return Err(RtError::BadTier(t, format!("set its {table} side table before coding its pages")));
            }
        }
        self.transcode(src, dst, heads, from, to)
    }

    /// A page of `tier` outside any sequence, for [`transcode_pages`](Self::transcode_pages);
    /// its bytes are whatever the pool left there.
    pub fn alloc_page(&mut self, tier: TierId) -> Result<PageRef> {
        self.store.pool_mut().alloc(tier)
    }

    /// Returns a page from [`alloc_page`](Self::alloc_page) to the pool (never a sequence's
    /// page: the sequence would keep reading it).
    pub fn free_page(&mut self, page: PageRef) {
        self.store.pool_mut().free(page)
    }

    /// Uploads every launch's lists in one copy, launches them in order (launch `i` raises
    /// flag word `i`), then downloads the flags once (the only synchronisation). `watched`:
    /// the launches raise the engine's flag word instead and nothing waits
    /// ([`transcode_watched`](Self::transcode_watched)).
    fn run_transcodes(&mut self, launches: &[Transcode<'_>], watched: bool) -> Outcome {
        for l in launches {
            self.warn_placeholder_codebook(l.to);
        }
        let fail = |error| Outcome { landed: 0, error: Some(error) };
        let mut words: Vec<u64> = Vec::with_capacity(launches.iter().map(|l| arg_words(l.src.len())).sum());
        let mut at = Vec::with_capacity(launches.len());
        for l in launches {
            assert!(l.src.len() == l.dst.len() && l.src.len() == l.heads.len(), "transcode: source, destination and head lists differ in length");
            at.push(words.len());
            words.extend(l.src.iter().map(|p| p.offset));
            words.extend(l.dst.iter().map(|p| p.offset));
            words.extend(l.heads.chunks(2).map(|h| u64::from(h[0]) | u64::from(h.get(1).copied().unwrap_or(0)) << 32));
        }
        let st = self.engine.dev().stream.clone();
        if let Err(e) = ensure(&st, &mut self.engine.move_bufs().args, words.len(), "page move arguments").and_then(|_| ensure(&st, &mut self.engine.move_bufs().flags, launches.len(), "page move flags")) {
            return fail(e);
        }
        let args = self.engine.move_bufs().args.as_mut().expect("ensured above");
        if let Err(e) = st.memcpy_htod(&words, &mut args.slice_mut(0..words.len())).map_err(drv("page move arguments")) {
            return fail(e);
        }
        let base = args.device_ptr(&st).0;
        let flags = if watched { self.engine.flags_ptr() } else { self.engine.move_bufs().flags.as_ref().expect("ensured above").device_ptr(&st).0 };
        let tp = self.tier_pointers();
        let arena = self.store.arena_ptr();
        let mut launched = 0;
        let mut launch_error = None;
        for (i, l) in launches.iter().enumerate() {
            let n = l.src.len();
            let v = VariantId::transcode(&self.spec, l.from, l.to, self.cfg.head_dim);
            let k = match self.engine.kernel(&self.spec, &v) {
                Ok(k) => k,
                Err(e) => {
                    launch_error = Some(e);
                    break;
                }
            };
            let word = |j: usize| base + 8 * (at[i] + j) as u64;
            let error_flags = if watched { flags } else { flags + 4 * i as u64 };
            let params = TranscodeParams { arena, src_offsets: word(0), dst_offsets: word(n), kv_heads: word(2 * n), side: tp.side, error_flags, num_pages: n as i32 };
            // Each page's work is split over `ctas_per_page` CTAs (transcode.cuh).
            let cfg = LaunchConfig { grid_dim: (n as u32 * k.ctas_per_page, 1, 1), block_dim: (k.threads, 1, 1), shared_mem_bytes: k.smem_bytes };
            // SAFETY: params mirror the kernel's struct (rendered from one field list); the
            // arena and tier tables are live allocations of this cache, the argument words
            // were copied above on this stream (n offsets each, then n u32 heads), page
            // offsets come from the pool, and flag word i lies in a buffer of ≥ launches words.
            crate::kernels::trace_launch(|| v.symbol(), &cfg);
            if let Err(e) = unsafe { st.launch_builder(&k.func).arg(&params).launch(cfg) }.map_err(drv(format!("launch {v}"))) {
                launch_error = Some(e);
                break;
            }
            launched += 1;
        }
        if watched {
            if launched > 0 {
                let v = VariantId::transcode(&self.spec, launches[launched - 1].from, launches[launched - 1].to, self.cfg.head_dim);
                if let Err(e) = self.engine.watch_flags(&v) {
                    return fail(e);
                }
            }
            return Outcome { landed: launched, error: launch_error };
        }
        let flags_buf = self.engine.move_bufs().flags.as_mut().expect("ensured above");
        let raised = match st.clone_dtoh(&flags_buf.slice(0..launched)).map_err(drv("page move flags")) {
            Ok(f) => f,
            Err(e) => return fail(e),
        };
        if let Some(i) = raised.iter().position(|&f| f != 0) {
            if let Err(e) = st.memset_zeros(&mut flags_buf.slice_mut(0..launched)).map_err(drv("clear page move flags")) {
                return fail(e);
            }
            let v = VariantId::transcode(&self.spec, launches[i].from, launches[i].to, self.cfg.head_dim);
            return Outcome { landed: i, error: Some(RtError::KernelFault { variant: v.to_string(), what: crate::engine::fault_names(raised[i]) }) };
        }
        Outcome { landed: launched, error: launch_error }
    }

    /// The launches of a [`MoveBatch`](crate::MoveBatch), in order, each swapping its new
    /// pages into their sequences' tables (see the module docs for when they are checked).
    pub(crate) fn launch_moves(&mut self, moves: &[SeqMove], launches: &[(TierId, TierId, Vec<usize>)]) -> Result<()> {
        let mut need = vec![0usize; self.spec.tiers.len()];
        for (_, to, g) in launches {
            need[*to as usize] += g.len();
        }
        let room = need.iter().enumerate().all(|(t, &n)| n <= self.store.pool().free_pages(t as TierId));
        if !room {
            for l in launches {
                self.land(moves, std::slice::from_ref(l))?;
            }
            return Ok(());
        }
        self.land(moves, launches)
    }

    /// Allocates the destinations of `launches`, runs them, and swaps the landed ones into the
    /// page tables (freeing their sources); the others' destinations are freed.
    fn land(&mut self, moves: &[SeqMove], launches: &[(TierId, TierId, Vec<usize>)]) -> Result<()> {
        if launches.is_empty() {
            return Ok(());
        }
        let page = |m: usize| {
            let (s, (h, i, _)) = moves[m];
            self.store.full_page(s, h, i).expect("checked by retier_many")
        };
        let src: Vec<Vec<PageRef>> = launches.iter().map(|(_, _, g)| g.iter().map(|&m| page(m)).collect()).collect();
        let heads: Vec<Vec<u32>> = launches.iter().map(|(_, _, g)| g.iter().map(|&m| moves[m].1 .0 as u32).collect()).collect();
        let mut dst: Vec<Vec<PageRef>> = Vec::with_capacity(launches.len());
        for (_, to, g) in launches {
            let pages: Result<Vec<PageRef>> = g.iter().map(|_| self.store.pool_mut().alloc(*to)).collect();
            match pages {
                Ok(p) => dst.push(p),
                Err(e) => {
                    dst.into_iter().flatten().for_each(|p| self.store.pool_mut().free(p));
                    return Err(e);
                }
            }
        }
        let runs: Vec<Transcode<'_>> = launches.iter().enumerate().map(|(i, (from, to, _))| Transcode { from: *from, to: *to, src: &src[i], dst: &dst[i], heads: &heads[i] }).collect();
        let out = self.run_transcodes(&runs, false);
        drop(runs);
        for (i, ((_, _, g), (src, dst))) in launches.iter().zip(src.into_iter().zip(dst)).enumerate() {
            if i >= out.landed {
                dst.into_iter().for_each(|p| self.store.pool_mut().free(p));
                continue;
            }
            for ((&m, old), new) in g.iter().zip(src).zip(dst) {
                let (s, (h, i, _)) = moves[m];
                self.store.replace_full(s, h, i, new).expect("checked by retier_many");
                self.store.pool_mut().free(old);
            }
        }
        match out.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
