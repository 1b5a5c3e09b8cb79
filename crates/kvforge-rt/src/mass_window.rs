//! RDR's importance window on the device.
//!
//! Seed 000 C.2 smooths a page's importance as `EMA_β(max_{s ∈ window} a_s(i))`: every decode
//! step contributes each page's share `a_s(i)` of its (sequence, kv head)'s attention mass.
//! Downloading every step's masses and folding them on the host cost ~150 µs per step at 32K
//! tokens × 8 kv heads (issue 7). Here the window's maximum stays on the device:
//! [`KvCache::decode_tracked`] decodes with the per-page log2 masses recorded
//! (`DecodeParams::page_lse`) and folds them — normalised by the step's total per (sequence,
//! kv head) — into a running per-page maximum; nothing is copied back. The fold runs in
//! extra CTAs of the split-K combine kernel when the decode has one (the usual case at long
//! context and small batch, where a separate ~5 µs launch was 6–8% of the decode kernels on
//! the H100), else as the generated `mass_window` kernel after the decode. [`KvCache::take_mass_window`] downloads one
//! sequence's maxima and resets them, once per controller invocation; the EMA over windows
//! is the controller's (kvforge-control `PagedImportance`).
//!
//! The window is indexed by a page's position in [`KvCache::pages`]. Between two takes those
//! positions are stable — appends add pages at the end, a filled tail page keeps its
//! position, re-coding keeps it — except for drops: [`KvCache::retier_pages`] compacts the
//! rows of a sequence with an open window so that each maximum stays with its page.
//!
//! Layout: one buffer `[sequence slot][kv head][capacity]` of f32 log2 shares (NaN: not
//! observed), slots indexed by sequence id, grown (rows copied on the device) when a
//! sequence id or a head's page count outgrows it.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PinnedHostSlice, PushKernelArg};
use kvforge_spec::VariantId;

use crate::cache::KvCache;
use crate::decode::{DecodeOutput, DecodePlan, DecodeWorkspace, PageMass};
use crate::error::{drv, Result, RtError};
use crate::params::MassWindowParams;

/// f32 quiet NaN: "not observed since the last take" (the kernel's `fmaxf` skips it).
const UNOBSERVED: u32 = 0x7fc0_0000;

/// Smallest row capacity, in pages: a 4K-token sequence at 64-token pages.
const MIN_CAPACITY: usize = 64;

/// The device buffer and its shape.
pub(crate) struct MassWindow {
    buf: CudaSlice<f32>,
    /// Sequence slots (sequence ids `0..slots`).
    slots: usize,
    /// Pages per (sequence, kv head) row.
    capacity: usize,
    /// Per slot: a fold wrote into its rows since they were last reset. Closed rows are all
    /// NaN, so takes, drops and removals of closed sequences touch no device memory.
    open: Vec<bool>,
    /// Page-locked host memory the takes download into (grown to the largest take): a take of
    /// 8 sequences at 32K tokens × 8 kv heads is 256 KB, which a pageable copy staged through
    /// the driver's bounce buffer at a fraction of the link's speed, on the decode thread.
    staging: Option<PinnedHostSlice<f32>>,
}

impl MassWindow {
    fn row(&self, slot: usize, head: usize, heads: usize) -> usize {
        (slot * heads + head) * self.capacity
    }
}

/// A workspace armed to fold its page masses into the importance window
/// ([`KvCache::track_window`]).
pub struct WindowFold {
    /// `[batch]` window slot (sequence id) of every decode entry, on the device.
    slots: CudaSlice<u32>,
    /// The same on the host: the slots a launch opens.
    seqs: Vec<usize>,
}

/// One sequence's importance window as it came from the device
/// ([`KvCache::take_mass_window_rows`]): per kv head a row of `capacity` log2 shares (NaN: not
/// observed), for the `counts[h]` pages the head had when it was taken.
#[derive(Clone, Debug, Default)]
pub struct MassWindowRows {
    counts: Vec<usize>,
    capacity: usize,
    /// `[kv head][capacity]`; empty when no tracked decode saw the sequence.
    log2: Vec<f32>,
}

impl MassWindowRows {
    /// Per kv head, per page: the page's largest share of the head's attention mass, `None`
    /// where no tracked decode saw it (what [`KvCache::take_mass_window`] returns).
    pub fn shares(&self) -> Vec<Vec<Option<f64>>> {
        self.counts
            .iter()
            .enumerate()
            .map(|(h, &n)| (0..n).map(|i| if i < self.capacity { Some(self.log2[h * self.capacity + i]).filter(|x| !x.is_nan()).map(|x| f64::from(x).exp2()) } else { None }).collect())
            .collect()
    }
}

impl KvCache {
    /// Decodes like [`KvCache::decode`] and folds every page's share of its (sequence, kv
    /// head)'s attention mass (as [`KvCache::decode_with_mass`] defines it) into the
    /// sequence's importance window on the device, keeping each page's maximum since the
    /// last [`take_mass_window`](Self::take_mass_window). No transfer; no launch of its own
    /// when the decode has a split-K combine (extra CTAs of the combine fold), one small
    /// launch otherwise. A sequence may appear once per call.
    pub fn decode_tracked(&mut self, seqs: &[usize], q: &[f32]) -> Result<DecodeOutput> {
        // Plan first: it refuses unknown sequence ids, which size `distinct`'s table.
        let plan = self.plan(seqs)?;
        distinct(seqs)?;
        Ok(self.decode_host(&plan, q, PageMass::Window(seqs))?.0)
    }

    /// A workspace for `plan` whose launch also records the per-page log2 masses (what
    /// [`track_window`](Self::track_window) folds).
    pub fn mass_workspace(&self, plan: &DecodePlan) -> Result<DecodeWorkspace> {
        let mut ws = self.workspace(plan)?;
        ws.page_lse = Some(self.engine.dev().stream.alloc_zeros::<f32>(plan.page_offsets.len().max(1)).map_err(drv("page masses"))?);
        ws.page_warp_lse = self.warp_lse_scratch(plan)?;
        Ok(ws)
    }

    /// Arms `ws` (a [`mass_workspace`](Self::mass_workspace) of `plan`) so that every
    /// [`launch`](Self::launch) of it also folds its page masses into the windows of `seqs`
    /// (the plan's sequences, in plan order): inside the split-K combine when the plan has
    /// one, else as a separate `mass_window` launch. Uploads the slot list once, so a
    /// workspace reused across steps costs nothing more per step.
    pub fn track_window(&mut self, plan: &DecodePlan, ws: &mut DecodeWorkspace, seqs: &[usize]) -> Result<()> {
        let hkv = self.cfg.num_kv_heads;
        if seqs.len() != plan.batch || plan.num_kv_heads != hkv {
            return Err(RtError::ShapeMismatch {
                what: "mass window".into(),
                expected: format!("the plan's {} sequences × {} kv heads", plan.batch, plan.num_kv_heads),
                got: format!("{} sequences of a cache with {hkv} kv heads", seqs.len()),
            });
        }
        if ws.page_lse.is_none() {
            return Err(RtError::BadInput("mass window: the workspace records no page masses (make it with `mass_workspace`)".into()));
        }
        if ws.page_indptr.len() != plan.page_indptr.len() {
            return Err(RtError::ShapeMismatch { what: "mass window: the workspace's page ranges".into(), expected: format!("the plan's {}", plan.page_indptr.len()), got: ws.page_indptr.len().to_string() });
        }
        for &s in seqs {
            self.seq_len(s)?;
        }
        distinct(seqs)?;
        let ids: Vec<u32> = seqs.iter().map(|&s| s as u32).collect();
        let slots = self.engine.dev().stream.clone_htod(&ids).map_err(drv("mass window slots"))?;
        ws.window = Some(WindowFold { slots, seqs: seqs.to_vec() });
        Ok(())
    }

    /// The fold of an armed workspace as kernel arguments, the window grown first if a
    /// sequence id or a head's page count of `plan` needs it; marks the slots open (a launch
    /// follows). None when `ws` is not armed.
    pub(crate) fn window_fold_params(&mut self, plan: &DecodePlan, ws: &DecodeWorkspace) -> Result<Option<MassWindowParams>> {
        let (Some(fold), Some(page_lse)) = (&ws.window, &ws.page_lse) else { return Ok(None) };
        let hkv = self.cfg.num_kv_heads;
        if fold.seqs.len() != plan.batch || plan.num_kv_heads != hkv || ws.page_indptr.len() != plan.page_indptr.len() {
            return Err(RtError::BadInput("mass window: the workspace was armed for another plan".into()));
        }
        let slots = fold.seqs.iter().max().map_or(0, |&s| s + 1);
        let most_pages = plan.page_indptr.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
        self.grow_mass_window(slots, most_pages)?;
        let st = self.engine.dev().stream.clone();
        let Some(w) = self.mass_window.as_mut() else { return Err(RtError::BadInput("mass window: not allocated".into())) };
        for &s in &fold.seqs {
            w.open[s] = true;
        }
        let params = MassWindowParams {
            page_lse: page_lse.device_ptr(&st).0,
            page_indptr: ws.page_indptr.device_ptr(&st).0,
            window: w.buf.device_ptr(&st).0,
            slots: fold.slots.device_ptr(&st).0,
            num_kv_heads: hkv as i32,
            capacity: w.capacity as i32,
        };
        Ok(Some(params))
    }

    /// Launches the standalone fold of an armed workspace after a launch of `plan` (what
    /// [`launch`](Self::launch) does itself when the plan has no split-K combine). Launches
    /// only (no synchronisation). Folding the same masses twice leaves the window as it was
    /// (a maximum is idempotent), so timing it after a launch is harmless.
    pub fn fold_mass_window(&mut self, plan: &DecodePlan, ws: &DecodeWorkspace) -> Result<()> {
        let Some(params) = self.window_fold_params(plan, ws)? else {
            return Err(RtError::WrongState { what: "mass window".into(), fix: "the workspace is not armed (call `track_window` first)".into() });
        };
        self.launch_fold(plan, &params)
    }

    /// One `mass_window` launch over every (entry, kv head) of `plan`.
    pub(crate) fn launch_fold(&mut self, plan: &DecodePlan, params: &MassWindowParams) -> Result<()> {
        let k = self.engine.kernel(&self.spec, &VariantId::mass_window(&self.spec))?;
        let cfg = LaunchConfig { grid_dim: (plan.num_kv_heads as u32, plan.batch as u32, 1), block_dim: (k.threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: params mirror the kernel struct (`window_fold_params`): `page_lse` and
        // `page_indptr` are the plan's buffers (one entry per page, batch × heads + 1
        // ranges), `slots` holds `batch` ids below the window's slots and every range is at
        // most `capacity` pages (grown there).
        crate::kernels::trace_launch(|| VariantId::mass_window(&self.spec).symbol(), &cfg);
        unsafe { self.engine.dev().stream.launch_builder(&k.func).arg(params).launch(cfg) }.map_err(drv("launch mass_window"))?;
        Ok(())
    }

    /// Per kv head, per page of [`pages(seq, head)`](Self::pages): the largest share of the
    /// head's attention mass the page had in a tracked decode since the last call, `None`
    /// where no tracked decode saw the page. Resets the sequence's window (synchronises).
    pub fn take_mass_window(&mut self, seq: usize) -> Result<Vec<Vec<Option<f64>>>> {
        Ok(self.take_mass_windows(&[seq])?.pop().expect("one window per sequence"))
    }

    /// [`take_mass_window`](Self::take_mass_window) of several sequences with one download
    /// (the rows from the lowest to the highest open slot asked for) and one synchronisation:
    /// at an RDR boundary of a batch every sequence's window is due at once, and a download
    /// each cost ~50 µs of the decode thread per sequence on the H100 machine. A sequence may
    /// appear once.
    pub fn take_mass_windows(&mut self, seqs: &[usize]) -> Result<Vec<Vec<Vec<Option<f64>>>>> {
        Ok(self.take_mass_window_rows(seqs)?.iter().map(MassWindowRows::shares).collect())
    }

    /// [`take_mass_windows`](Self::take_mass_windows) as downloaded, for a thread other than
    /// the decode thread to turn into shares ([`MassWindowRows::shares`]: one exp2 per page,
    /// ~26 µs per sequence at 32K tokens × 8 kv heads on the H100 host).
    pub fn take_mass_window_rows(&mut self, seqs: &[usize]) -> Result<Vec<MassWindowRows>> {
        let hkv = self.cfg.num_kv_heads;
        let counts: Vec<Vec<usize>> = seqs.iter().map(|&s| (0..hkv).map(|h| self.page_count(s, h)).collect::<Result<_>>()).collect::<Result<_>>()?;
        distinct(seqs)?;
        let open: Vec<usize> = match self.mass_window.as_ref() {
            Some(w) => seqs.iter().copied().filter(|&s| s < w.slots && w.open[s]).collect(),
            None => Vec::new(),
        };
        let unobserved = |counts: Vec<usize>| MassWindowRows { counts, capacity: 0, log2: Vec::new() };
        let (Some(lo), Some(hi)) = (open.iter().min().copied(), open.iter().max().copied()) else {
            return Ok(counts.into_iter().map(unobserved).collect());
        };
        let st = self.engine.dev().stream.clone();
        let w = self.mass_window.as_mut().expect("open slots imply a window");
        let (base, cap, end) = (w.row(lo, 0, hkv), w.capacity, w.row(hi + 1, 0, hkv));
        if w.staging.as_ref().is_none_or(|h| h.len() < end - base) {
            // SAFETY: the download below writes the elements read from it. Flags 0: cached
            // (the default write-combined memory is slow for the host to read).
            w.staging = Some(unsafe { self.engine.dev().ctx.alloc_pinned_with_flags::<f32>(end - base, 0) }.map_err(drv("mass window staging"))?);
        }
        let host = &mut w.staging.as_mut().expect("allocated above").as_mut_slice().map_err(drv("mass window staging"))?[..end - base];
        {
            let src = w.buf.slice(base..end);
            let (ptr, _read) = src.device_ptr(&st);
            // SAFETY: `host` is page-locked memory of exactly the view's length; the copy is
            // ordered on the buffer's stream and waited for below before `host` is read.
            // (cudarc's `memcpy_dtoh` into a `PinnedHostSlice` copies the whole slice, and its
            // completion event is recorded only under multi-stream tracking.)
            unsafe { cudarc::driver::result::memcpy_dtoh_async(host, ptr, st.cu_stream()) }.map_err(drv("mass window download"))?;
        }
        st.synchronize().map_err(drv("mass window download"))?;
        let host = &*host;
        let rows: Vec<MassWindowRows> = seqs
            .iter()
            .zip(counts)
            .map(|(&s, counts)| match open.contains(&s) {
                true => MassWindowRows { counts, capacity: cap, log2: host[(s - lo) * hkv * cap..(s - lo + 1) * hkv * cap].to_vec() },
                false => unobserved(counts),
            })
            .collect();
        // One reset of the downloaded rows when no other open sequence's rows lie among them
        // (a batch's sequences usually are consecutive ids), else one per sequence.
        if (lo..=hi).all(|s| !w.open[s] || open.contains(&s)) {
            fill_unobserved(&st, &mut w.buf, base, end - base)?;
            (lo..=hi).for_each(|s| w.open[s] = false);
        } else {
            for &s in &open {
                self.reset_mass_window(s)?;
            }
        }
        Ok(rows)
    }

    /// Keeps the window of `seq` with its pages after `dropped` (kv head, index before the
    /// drop) left the page table: every later page's maximum moves down with it.
    pub(crate) fn mass_window_dropped(&mut self, seq: usize, dropped: &[(usize, usize)]) -> Result<()> {
        let hkv = self.cfg.num_kv_heads;
        let Some(w) = self.mass_window.as_mut().filter(|w| seq < w.slots && w.open[seq]) else { return Ok(()) };
        if dropped.is_empty() {
            return Ok(());
        }
        let (base, cap) = (w.row(seq, 0, hkv), w.capacity);
        let st = self.engine.dev().stream.clone();
        let mut rows = st.clone_dtoh(&w.buf.slice(base..base + hkv * cap)).map_err(drv("mass window download"))?;
        for (h, row) in rows.chunks_mut(cap).enumerate() {
            let mut gone: Vec<usize> = dropped.iter().filter(|d| d.0 == h).map(|d| d.1).filter(|&i| i < cap).collect();
            if gone.is_empty() {
                continue;
            }
            gone.sort_unstable();
            let mut kept: Vec<f32> = row.iter().enumerate().filter(|(i, _)| gone.binary_search(i).is_err()).map(|(_, &x)| x).collect();
            kept.resize(cap, f32::from_bits(UNOBSERVED));
            row.copy_from_slice(&kept);
        }
        st.memcpy_htod(&rows, &mut w.buf.slice_mut(base..base + hkv * cap)).map_err(drv("mass window upload"))
    }

    /// Resets the window rows of `seq` to "not observed" (a removed sequence's id is reused).
    pub(crate) fn reset_mass_window(&mut self, seq: usize) -> Result<()> {
        let hkv = self.cfg.num_kv_heads;
        let st = self.engine.dev().stream.clone();
        let Some(w) = self.mass_window.as_mut().filter(|w| seq < w.slots && w.open[seq]) else { return Ok(()) };
        let (base, cap) = (w.row(seq, 0, hkv), w.capacity);
        fill_unobserved(&st, &mut w.buf, base, hkv * cap)?;
        w.open[seq] = false;
        Ok(())
    }

    /// Makes room for sequence ids below `slots` and `pages` pages per (sequence, kv head):
    /// both dimensions at least double, open rows are copied on the device.
    fn grow_mass_window(&mut self, slots: usize, pages: usize) -> Result<()> {
        let hkv = self.cfg.num_kv_heads;
        let (old_slots, old_cap) = self.mass_window.as_ref().map_or((0, 0), |w| (w.slots, w.capacity));
        if slots <= old_slots && pages <= old_cap {
            return Ok(());
        }
        let new_slots = if slots > old_slots { slots.max(2 * old_slots) } else { old_slots };
        let capacity = if pages > old_cap { pages.max(2 * old_cap).max(MIN_CAPACITY).next_power_of_two() } else { old_cap };
        let len = new_slots * hkv * capacity;
        let st = self.engine.dev().stream.clone();
        // SAFETY: every element is written by `fill_unobserved` below before any read.
        let mut buf = unsafe { st.alloc::<f32>(len) }.map_err(|e| match drv("mass window")(e) {
            RtError::OutOfMemory { what, .. } => RtError::OutOfMemory { what, bytes: len * 4 },
            e => e,
        })?;
        fill_unobserved(&st, &mut buf, 0, len)?;
        let mut open = vec![false; new_slots];
        let mut staging = None;
        if let Some(mut old) = self.mass_window.take() {
            staging = old.staging.take();
            for s in (0..old.slots).filter(|&s| old.open[s]) {
                for h in 0..hkv {
                    let (from, to) = (old.row(s, h, hkv), (s * hkv + h) * capacity);
                    st.memcpy_dtod(&old.buf.slice(from..from + old_cap), &mut buf.slice_mut(to..to + old_cap)).map_err(drv("mass window growth"))?;
                }
                open[s] = true;
            }
        }
        self.mass_window = Some(MassWindow { buf, slots: new_slots, capacity, open, staging });
        Ok(())
    }
}

/// Checks that no sequence appears twice (two CTAs would race on its rows); returns the
/// window slots the batch needs (largest id + 1).
fn distinct(seqs: &[usize]) -> Result<usize> {
    let mut seen = vec![false; seqs.iter().max().map_or(0, |&s| s + 1)];
    for &s in seqs {
        if std::mem::replace(&mut seen[s], true) {
            return Err(RtError::Duplicate { what: format!("sequence {s}"), within: "one tracked decode (mass window)".into() });
        }
    }
    Ok(seen.len())
}

/// Sets `len` floats of `buf` from `at` to [`UNOBSERVED`] (asynchronously).
fn fill_unobserved(st: &std::sync::Arc<cudarc::driver::CudaStream>, buf: &mut CudaSlice<f32>, at: usize, len: usize) -> Result<()> {
    let (ptr, _sync) = buf.device_ptr_mut(st);
    // SAFETY: `at..at + len` lies inside `buf` (callers pass whole rows of it); the memset
    // is ordered on the stream that owns the buffer.
    unsafe { cudarc::driver::sys::cuMemsetD32Async(ptr + (at * 4) as u64, UNOBSERVED, len, st.cu_stream()) }.result().map_err(drv("mass window reset"))
}
