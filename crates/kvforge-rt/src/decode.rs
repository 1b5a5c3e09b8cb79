//! Plan, then run: [`plan`] picks the variant, the split count (from live lengths) and the
//! page table with no CUDA calls, so it is unit-tested on any machine; [`KvCache::run`] only
//! uploads and launches.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use half::{bf16, f16};
use kvforge_gen::schedule::Entry;
use kvforge_spec::{DType, Spec, TierId, VariantId};

use crate::cache::KvCache;
use crate::error::{drv, Result, RtError};
use crate::params::{CombineParams, DecodeParams};
use crate::pool::PageRef;

/// Everything a decode launch needs, computed on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodePlan {
    pub variant: VariantId,
    pub combine: Option<VariantId>,
    pub batch: usize,
    pub num_kv_heads: usize,
    pub gqa: usize,
    pub head_dim: usize,
    pub splits: usize,
    /// Byte offsets of every page, grouped by (sequence, kv head).
    pub page_offsets: Vec<u64>,
    /// [batch * num_kv_heads + 1] into `page_offsets`.
    pub page_indptr: Vec<u32>,
    /// Per page: tier | tokens << 8 (the kernel checks it against the page header).
    pub page_info: Vec<u32>,
    /// Tiers the batch's pages are in.
    pub tiers: Vec<TierId>,
    /// Bytes the kernels read: pages (headers, payload, metadata) + queries.
    pub bytes_read: usize,
    /// Of which page bytes: header + 16-aligned segment of every page (padding to the page
    /// alignment is never read).
    pub page_bytes_read: usize,
}

impl DecodePlan {
    /// Floats of the scratch `DecodeParams::page_warp_lse` that a tracked launch of this plan
    /// needs: every page's per-warp log2 masses when the variant runs the per-warp layout
    /// (the kernel folds them into `page_lse` / `page_head_lse` after its page loop), else 0.
    pub fn warp_lse_floats(&self, spec: &Spec) -> usize {
        kvforge_gen::launch_shape(spec, &self.variant).warp_lse_per_page * self.page_offsets.len()
    }
}

/// Split-K heuristic (flash-decoding). `ctas` (sequence, kv head) CTAs of `max_pages` pages at
/// most run on `slots` resident CTA slots (SMs × CTAs per SM); splitting each into `s` parts
/// (each of at least two pages, so that the staging pipeline has something to overlap; at
/// most 64) costs whole waves of CTAs `1/s` as long: `ceil(ctas·s / slots) / s` unsplit CTA
/// times. The split that just fills one wave (none when the CTAs already do) is kept when its
/// cost is within 5% of the best; otherwise the fewest splits that are: 360 CTAs on 528 slots
/// run one wave at 68% and take 7 splits (five waves at 95%), 88 CTAs on 660 slots fill one wave
/// to 93% in 7 splits and take 15 (two full waves).
pub fn split_count(ctas: usize, max_pages: usize, slots: usize) -> usize {
    if ctas == 0 || slots == 0 || max_pages < 4 {
        return 1;
    }
    let most = (max_pages / 2).clamp(1, 64);
    if let Some(n) = forced_splits() {
        return n.clamp(1, most);
    }
    let cost = |s: usize| (ctas * s).div_ceil(slots) as f64 / s as f64;
    let one_wave = if ctas < slots { (slots / ctas).min(most) } else { 1 };
    let best = (1..=most).map(cost).fold(f64::INFINITY, f64::min);
    if cost(one_wave) <= best * SPLIT_SLACK {
        return one_wave;
    }
    (1..=most).find(|&s| cost(s) <= best * SPLIT_SLACK).unwrap_or(one_wave)
}

/// `KVFORGE_SPLITS=n`: every split-K decode takes `n` splits (clamped as the heuristic's), for
/// schedule experiments; read once.
fn forced_splits() -> Option<usize> {
    static N: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var("KVFORGE_SPLITS").ok().and_then(|v| v.trim().parse().ok()))
}

/// How far above the best wave cost a split count may be and still be preferred for taking
/// fewer splits (each costs a prologue, its partials' writes and the combine's reads).
const SPLIT_SLACK: f64 = 1.05;

/// The smallest decode combination of `spec` that serves every tier in `present`.
pub fn choose_combination(spec: &Spec, present: &[TierId]) -> Option<Vec<TierId>> {
    spec.kernels.combinations.iter().filter(|c| present.iter().all(|t| c.contains(t))).min_by_key(|c| c.len()).cloned()
}

/// Plans decode over `pages[i][h]` = the (page, tokens) list of sequence i, kv head h.
/// `slots(variant)` is the number of CTAs of that variant the GPU holds at once. Runs in a
/// debug `plan` span and logs the chosen variant and split count.
#[tracing::instrument(name = "plan", level = "debug", skip_all, fields(spec = %spec.name, head_dim = head_dim, gqa = gqa, batch = pages.len()))]
pub fn plan(spec: &Spec, head_dim: usize, gqa: usize, pages: &[Vec<Vec<(PageRef, usize)>>], page_bytes: &dyn Fn(TierId) -> usize, slots: &dyn Fn(&VariantId) -> usize) -> Result<DecodePlan> {
    let read_bytes = |t: TierId| kvforge_spec::HEADER_BYTES + spec.segment(t, head_dim).bytes;
    let mut page_bytes_read = 0;
    let batch = pages.len();
    if batch == 0 {
        return Err(RtError::BadInput("decode of an empty batch".into()));
    }
    let hkv = pages[0].len();
    let mut page_offsets = Vec::new();
    let mut page_info = Vec::new();
    let mut page_indptr = vec![0u32];
    let mut present: Vec<TierId> = Vec::new();
    let mut max_pages = 0;
    let mut bytes_read = 0;
    for (i, seq) in pages.iter().enumerate() {
        if seq.len() != hkv {
            return Err(RtError::ShapeMismatch { what: format!("kv heads of sequence {i}"), expected: hkv.to_string(), got: seq.len().to_string() });
        }
        for head in seq {
            if head.iter().map(|(_, n)| n).sum::<usize>() == 0 {
                return Err(RtError::EmptySequence(i));
            }
            max_pages = max_pages.max(head.len());
            for (p, n) in head {
                page_offsets.push(p.offset);
                page_info.push(p.tier as u32 | (*n as u32) << 8);
                bytes_read += page_bytes(p.tier);
                page_bytes_read += read_bytes(p.tier);
                if !present.contains(&p.tier) {
                    present.push(p.tier);
                }
            }
            page_indptr.push(page_offsets.len() as u32);
        }
    }
    present.sort();
    let combo = choose_combination(spec, &present).ok_or_else(|| RtError::NoVariant { spec: spec.name.clone(), tiers: present.iter().map(|&t| spec.tiers[t as usize].name.clone()).collect(), head_dim, gqa })?;
    let variant = kvforge_gen::decode_variant(spec, &combo, head_dim, gqa);
    let splits = if spec.kernels.split_k { split_count(batch * hkv, max_pages, slots(&variant)) } else { 1 };
    tracing::debug!(%variant, kv_heads = hkv, max_pages, splits, "planned decode");
    bytes_read += batch * hkv * gqa * head_dim * 2;
    Ok(DecodePlan {
        combine: (splits > 1).then(|| VariantId::combine(spec, head_dim)),
        variant,
        batch,
        num_kv_heads: hkv,
        gqa,
        head_dim,
        splits,
        page_offsets,
        page_indptr,
        page_info,
        tiers: present,
        bytes_read,
        page_bytes_read,
    })
}

/// What a host decode does with the per-page log2 masses the kernel can record.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PageMass<'a> {
    /// Not recorded.
    Off,
    /// Downloaded ([`KvCache::decode_with_mass`]).
    Download,
    /// Folded into the importance window of these sequences, the plan's, in order
    /// ([`KvCache::decode_tracked`]); nothing is downloaded.
    Window(&'a [usize]),
}

/// Decode output in f32 with the natural-log log-sum-exp of every (sequence, query head).
#[derive(Clone, Debug)]
pub struct DecodeOutput {
    /// [batch][num_q_heads][head_dim]
    pub out: Vec<f32>,
    /// [batch][num_q_heads]
    pub lse: Vec<f32>,
}

/// Device addresses of a launch's queries `[rows][d]`, output `[rows][d]` (spec dtype) and
/// log-sum-exp `[rows]` (f32).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodeIo {
    pub q: u64,
    pub out: u64,
    pub lse: u64,
}

/// Device buffers of one planned decode, reusable across runs of the same plan.
pub struct DecodeWorkspace {
    pub page_offsets: CudaSlice<u64>,
    pub page_info: CudaSlice<u32>,
    pub page_indptr: CudaSlice<u32>,
    pub q: CudaSlice<u16>,
    pub out: CudaSlice<u16>,
    pub partial_out: CudaSlice<f32>,
    pub partial_lse: CudaSlice<f32>,
    pub lse: CudaSlice<f32>,
    /// Per page: log2 Σ_heads Σ_tokens 2^logit, written when `page_mass` is requested.
    pub page_lse: Option<CudaSlice<f32>>,
    /// Per page × gqa: log2 Σ_tokens 2^logit of each query head (certified decode).
    pub page_head_lse: Option<CudaSlice<f32>>,
    /// Per page × 16-token block × gqa: the block's key logit error bound Δ_b (certified
    /// decode, phase 1).
    pub block_delta: Option<CudaSlice<f32>>,
    /// Per page × 16-token block × gqa: log2 Σ_tokens 2^logit of each block and query head
    /// (certified decode).
    pub block_head_lse: Option<CudaSlice<f32>>,
    /// Per page: the fp16 original's offset from the arena base, read for pages whose
    /// `page_info` carries a promoted-block mask (certified phase 2).
    pub promoted_offsets: Option<CudaSlice<u64>>,
    /// Scratch of a launch that records page masses with a per-warp-layout variant: per page ×
    /// warp × gqa log2 masses ([`DecodePlan::warp_lse_floats`], see
    /// [`KvCache::warp_lse_scratch`]); None where the variant needs none.
    pub page_warp_lse: Option<CudaSlice<f32>>,
    /// Set by [`KvCache::track_window`]: launches also fold `page_lse` into RDR's
    /// importance window.
    pub window: Option<crate::mass_window::WindowFold>,
}

impl DecodeWorkspace {
    /// Zeroed buffers of a decode over `entries` page-table entries and `indptr` range
    /// pointers, `rows` query rows of `head_dim` values and `splits` splits (the split-K
    /// partials only where `splits` > 1); no page-mass buffers, no importance window. Every
    /// buffer holds at least one element. The one constructor of planned
    /// ([`KvCache::workspace`]) and device-resident ([`crate::resident`]) launches.
    pub fn zeroed(st: &std::sync::Arc<cudarc::driver::CudaStream>, entries: usize, indptr: usize, rows: usize, head_dim: usize, splits: usize) -> Result<DecodeWorkspace> {
        let n = |x: usize| x.max(1);
        Ok(DecodeWorkspace {
            page_offsets: st.alloc_zeros(n(entries)).map_err(drv("page table"))?,
            page_indptr: st.alloc_zeros(n(indptr)).map_err(drv("page table"))?,
            page_info: st.alloc_zeros(n(entries)).map_err(drv("page table"))?,
            q: st.alloc_zeros(n(rows * head_dim)).map_err(drv("queries"))?,
            out: st.alloc_zeros(n(rows * head_dim)).map_err(drv("output"))?,
            partial_out: st.alloc_zeros(if splits > 1 { splits * rows * head_dim } else { 1 }).map_err(drv("split partials"))?,
            partial_lse: st.alloc_zeros(n(splits * rows)).map_err(drv("split lse"))?,
            lse: st.alloc_zeros(n(rows)).map_err(drv("lse"))?,
            page_lse: None,
            page_head_lse: None,
            block_delta: None,
            block_head_lse: None,
            promoted_offsets: None,
            page_warp_lse: None,
            window: None,
        })
    }
}

impl KvCache {
    /// Plans decode of one query token for each of `seqs`.
    pub fn plan(&self, seqs: &[usize]) -> Result<DecodePlan> {
        let hkv = self.cfg.num_kv_heads;
        let pages: Vec<Vec<Vec<(PageRef, usize)>>> = seqs.iter().map(|&s| (0..hkv).map(|h| self.pages(s, h)).collect::<Result<_>>()).collect::<Result<_>>()?;
        if self.cfg.verify_headers {
            self.verify_pages(seqs)?;
        }
        self.plan_pages(&pages)
    }

    /// Plans decode over explicit page lists `pages[entry][kv head]` of this cache's pages
    /// (e.g. prefixes of one sequence, see `external::prefix_pages`).
    pub fn plan_pages(&self, pages: &[Vec<Vec<(PageRef, usize)>>]) -> Result<DecodePlan> {
        self.plan_entry(pages, Entry::Decode)
    }

    /// Plans like [`KvCache::plan_pages`] for a launch of `entry`: the split count follows
    /// that entry point's occupancy (the certified entry runs the block layout with its own
    /// shared memory and registers: sized by the plain entry's three CTAs per SM, certified
    /// q8k4v's phase 1 ran 1.5 waves, 94 → 127 µs at 1 × 32K on the H100).
    pub(crate) fn plan_entry(&self, pages: &[Vec<Vec<(PageRef, usize)>>], entry: Entry) -> Result<DecodePlan> {
        let page_bytes: Vec<usize> = (0..self.spec.tiers.len()).map(|t| self.store.pool().page_bytes(t as TierId)).collect();
        // Occupancy needs the kernel: load (or compile) it while planning.
        let slots = std::cell::RefCell::new(Ok(0usize));
        let p = plan(&self.spec, self.cfg.head_dim, self.cfg.gqa, pages, &|t| page_bytes[t as usize], &|v| match self.slots(v, entry) {
            Ok(n) => n,
            Err(e) => {
                *slots.borrow_mut() = Err(e);
                self.engine.dev().info.sm_count
            }
        })?;
        slots.into_inner()?;
        Ok(p)
    }

    /// CTAs of `v`'s `entry` the device holds at once: occupancy × SMs.
    pub(crate) fn slots(&self, v: &VariantId, entry: Entry) -> Result<usize> {
        let sms = self.engine.dev().info.sm_count;
        let k = self.engine.kernel(&self.spec, v)?;
        let (func, smem) = match (entry, &k.certified) {
            (Entry::Certified, Some(f)) => (f, k.certified_smem_bytes),
            _ => (&k.func, k.smem_bytes),
        };
        Ok(func.occupancy_max_active_blocks_per_multiprocessor(k.threads, smem as usize, None).map_or(sms, |n| n.max(1) as usize * sms))
    }

    /// Allocates the buffers of `plan` and uploads its page table.
    pub fn workspace(&self, plan: &DecodePlan) -> Result<DecodeWorkspace> {
        let st = &self.engine.dev().stream;
        let rows = plan.batch * plan.num_kv_heads * plan.gqa;
        let mut ws = DecodeWorkspace::zeroed(st, plan.page_offsets.len(), plan.page_indptr.len(), rows, plan.head_dim, plan.splits)?;
        st.memcpy_htod(&plan.page_offsets, &mut ws.page_offsets.slice_mut(0..plan.page_offsets.len())).map_err(drv("page table"))?;
        st.memcpy_htod(&plan.page_indptr, &mut ws.page_indptr.slice_mut(0..plan.page_indptr.len())).map_err(drv("page table"))?;
        st.memcpy_htod(&plan.page_info, &mut ws.page_info.slice_mut(0..plan.page_info.len())).map_err(drv("page table"))?;
        Ok(ws)
    }

    /// The scratch a launch of `plan` that records page masses needs beside `page_lse` /
    /// `page_head_lse` ([`DecodeWorkspace::page_warp_lse`]); None when the variant needs none.
    pub fn warp_lse_scratch(&self, plan: &DecodePlan) -> Result<Option<CudaSlice<f32>>> {
        match plan.warp_lse_floats(&self.spec) {
            0 => Ok(None),
            n => Ok(Some(self.engine.dev().stream.alloc_zeros::<f32>(n).map_err(drv("per-warp page masses"))?)),
        }
    }

    /// Launches the planned kernels on the workspace (queries already in `ws.q`).
    pub fn launch(&mut self, plan: &DecodePlan, ws: &mut DecodeWorkspace) -> Result<()> {
        let st = self.engine.dev().stream.clone();
        let io = DecodeIo { q: ws.q.device_ptr(&st).0, out: ws.out.device_ptr(&st).0, lse: ws.lse.device_ptr(&st).0 };
        self.launch_io(plan, ws, io)
    }

    /// Launches the planned kernels reading queries from and writing outputs to `io`, which
    /// may be memory the cache does not own (see `external`); the workspace supplies the page
    /// table and the split-K partials only.
    pub(crate) fn launch_io(&mut self, plan: &DecodePlan, ws: &DecodeWorkspace, io: DecodeIo) -> Result<()> {
        let _span = tracing::debug_span!("launch", variant = %plan.variant, batch = plan.batch, splits = plan.splits).entered();
        let k = self.engine.kernel(&self.spec, &plan.variant)?;
        let st = self.engine.launch_stream();
        let tp = self.tier_pointers();
        let rows = plan.batch * plan.num_kv_heads * plan.gqa;
        for (i, t) in plan.tiers.iter().enumerate() {
            if let Some(table) = self.side.missing(*t) {
                return Err(RtError::BadTier(plan.tiers[i], format!("its {table} side table is not set")));
            }
        }
        // Page masses come from the module's tracked entry point (the plain one compiles them
        // out); in the per-warp layout it needs the per-warp scratch. The certified entry
        // (block masses) runs the block layout, which needs none.
        let certified = ws.block_head_lse.is_some();
        let tracked = certified || ws.page_lse.is_some() || ws.page_head_lse.is_some();
        let warp_lse = match (tracked && !certified, plan.warp_lse_floats(&self.spec), &ws.page_warp_lse) {
            (false, _, _) | (true, 0, _) => 0,
            (true, need, Some(b)) if b.len() >= need => b.device_ptr(&st).0,
            (true, need, have) => {
                return Err(RtError::CapacityExceeded {
                    what: format!("{}: per-warp scratch for page masses (`KvCache::warp_lse_scratch`)", plan.variant),
                    requested: format!("{need} floats"),
                    capacity: format!("the workspace's {}", have.as_ref().map_or(0, |b| b.len())),
                })
            }
        };
        let params = DecodeParams {
            q: io.q,
            out: io.out,
            partial_out: ws.partial_out.device_ptr(&st).0,
            partial_lse: if plan.splits > 1 { ws.partial_lse.device_ptr(&st).0 } else { io.lse },
            arena: self.store.arena_ptr(),
            page_offsets: ws.page_offsets.device_ptr(&st).0,
            page_indptr: ws.page_indptr.device_ptr(&st).0,
            page_info: ws.page_info.device_ptr(&st).0,
            side: tp.side,
            page_lse: ws.page_lse.as_ref().map_or(0, |b| b.device_ptr(&st).0),
            page_head_lse: ws.page_head_lse.as_ref().map_or(0, |b| b.device_ptr(&st).0),
            page_warp_lse: warp_lse,
            block_delta: ws.block_delta.as_ref().map_or(0, |b| b.device_ptr(&st).0),
            block_head_lse: ws.block_head_lse.as_ref().map_or(0, |b| b.device_ptr(&st).0),
            promoted_offsets: ws.promoted_offsets.as_ref().map_or(0, |b| b.device_ptr(&st).0),
            error_flags: self.engine.flags_ptr(),
            sm_scale: 1.0 / (plan.head_dim as f32).sqrt(),
            batch: plan.batch as i32,
            num_kv_heads: plan.num_kv_heads as i32,
            num_splits: plan.splits as i32,
            rot_seed: match self.basis {
                kvforge_spec::Basis::Hadamard { seed } => seed,
                kvforge_spec::Basis::Identity => 0,
            },
        };
        let cfg = LaunchConfig {
            grid_dim: (plan.splits as u32, plan.num_kv_heads as u32, plan.batch as u32),
            block_dim: (k.threads, 1, 1),
            // The certified entry runs the block layout, whose shared-memory plan is its own.
            shared_mem_bytes: if certified { k.certified_smem_bytes } else { k.smem_bytes },
        };
        let func = if certified {
            k.certified.as_ref().ok_or_else(|| crate::certified::uncertified_spec(&self.spec))?
        } else if tracked {
            k.tracked.as_ref().ok_or_else(|| RtError::BadInput(format!("{} has no entry point that records page masses", plan.variant)))?
        } else {
            &k.func
        };
        // SAFETY: params mirror the kernel struct; buffers are sized by `workspace` for this
        // plan (the per-warp scratch checked above); page offsets come from the pool and lie
        // inside the arena.
        crate::kernels::trace_launch(
            || {
                if certified {
                    plan.variant.certified_symbol()
                } else if tracked {
                    plan.variant.tracked_symbol()
                } else {
                    Some(plan.variant.symbol())
                }
                .unwrap_or_default()
            },
            &cfg,
        );
        unsafe { st.launch_builder(func).arg(&params).launch(cfg) }.map_err(drv(format!("launch {}", plan.variant)))?;
        let fold = self.window_fold_params(plan, ws)?;
        match (&plan.combine, fold) {
            (Some(cv), fold) => {
                let ck = self.engine.kernel(&self.spec, cv)?;
                let groups = if fold.is_some() { plan.batch * plan.num_kv_heads } else { 0 };
                let cp = CombineParams {
                    partial_out: ws.partial_out.device_ptr(&st).0,
                    partial_lse: ws.partial_lse.device_ptr(&st).0,
                    out: io.out,
                    lse: io.lse,
                    rows: rows as i32,
                    num_splits: plan.splits as i32,
                    fold_groups: groups as i32,
                    fold: fold.unwrap_or_default(),
                };
                let ccfg = LaunchConfig { grid_dim: ((rows + groups) as u32, 1, 1), block_dim: (ck.threads, 1, 1), shared_mem_bytes: 0 };
                crate::kernels::trace_launch(|| cv.symbol(), &ccfg);
                if self.engine.pdl() {
                    // SAFETY: as below; the combine's first instruction waits for the decode.
                    unsafe { launch_programmatic(&st, &ck.func, ccfg, &cp) }.map_err(drv(format!("launch {cv}")))?;
                } else {
                    // SAFETY: as above; partial buffers hold `splits × rows` entries; the fold's
                    // buffers are as `launch_fold` states, one CTA per (entry, kv head).
                    unsafe { st.launch_builder(&ck.func).arg(&cp).launch(ccfg) }.map_err(drv(format!("launch {cv}")))?;
                }
            }
            (None, Some(fold)) => self.launch_fold(plan, &fold)?,
            (None, None) => {}
        }
        Ok(())
    }

    /// Checks the kernels' error flags after launches (synchronises).
    pub fn check(&mut self, plan: &DecodePlan) -> Result<()> {
        self.engine.check_flags(&plan.variant)
    }

    /// Decodes one query token per sequence: `q` is [len(seqs)][num_kv_heads × gqa][head_dim]
    /// in f32 (rounded to the spec dtype on upload).
    pub fn decode(&mut self, seqs: &[usize], q: &[f32]) -> Result<DecodeOutput> {
        let plan = self.plan(seqs)?;
        self.decode_planned(&plan, q)
    }

    /// Decodes with a plan made by [`KvCache::plan`], whose variant the caller may have swapped
    /// for the same format under another schedule ([`VariantId::with_schedule`]): how tests and
    /// the selftest run every schedule of a format.
    pub fn decode_planned(&mut self, plan: &DecodePlan, q: &[f32]) -> Result<DecodeOutput> {
        Ok(self.decode_host(plan, q, PageMass::Off)?.0)
    }

    /// Uploads host queries, launches `plan`, checks the error flags and downloads the output,
    /// and handles the per-page log2 masses the kernel records as `mass` says.
    pub(crate) fn decode_host(&mut self, plan: &DecodePlan, q: &[f32], mass: PageMass<'_>) -> Result<(DecodeOutput, Vec<f32>)> {
        let rows = plan.batch * plan.num_kv_heads * plan.gqa;
        if q.len() != rows * plan.head_dim {
            return Err(RtError::ShapeMismatch {
                what: "query".into(),
                expected: format!("{} sequences × {} q heads × {} values", plan.batch, plan.num_kv_heads * plan.gqa, plan.head_dim),
                got: format!("{} values", q.len()),
            });
        }
        let mut ws = match mass {
            PageMass::Off => self.workspace(plan)?,
            PageMass::Download | PageMass::Window(_) => self.mass_workspace(plan)?,
        };
        if let PageMass::Window(seqs) = mass {
            self.track_window(plan, &mut ws, seqs)?;
        }
        let dtype = self.spec.geometry.dtype;
        let qh: Vec<u16> = q.iter().map(|&x| to_bits(dtype, x)).collect();
        self.engine.dev().stream.memcpy_htod(&qh, &mut ws.q).map_err(drv("query upload"))?;
        self.launch(plan, &mut ws)?;
        self.check(plan)?;
        let out = self.engine.dev().stream.clone_dtoh(&ws.out).map_err(drv("output download"))?;
        let lse = self.engine.dev().stream.clone_dtoh(&ws.lse).map_err(drv("lse download"))?;
        let plse = match (&ws.page_lse, mass) {
            (Some(b), PageMass::Download) => self.engine.dev().stream.clone_dtoh(b).map_err(drv("page masses"))?,
            _ => Vec::new(),
        };
        Ok((DecodeOutput { out: out.into_iter().map(|b| from_bits(dtype, b)).collect(), lse }, plse))
    }
}

impl KvCache {
    /// Decodes like [`KvCache::decode`] and also returns the attention mass of every page, the
    /// importance signal controllers use: `mass[i][h][p]` is page `p`'s share (pages in
    /// [`KvCache::pages`] order) of Σ_{query heads of kv head h} Σ_tokens e^logit for sequence
    /// `seqs[i]`; each (sequence, head) sums to 1. At gqa 1 it is exactly the page's softmax
    /// mass; at gqa > 1 heads with larger logits weigh more. The kernel records it as a
    /// by-product (one log-sum per page), so it costs one extra store per page.
    pub fn decode_with_mass(&mut self, seqs: &[usize], q: &[f32]) -> Result<(DecodeOutput, Vec<Vec<Vec<f64>>>)> {
        let plan = self.plan(seqs)?;
        let (output, plse) = self.decode_host(&plan, q, PageMass::Download)?;
        let mut mass = Vec::with_capacity(plan.batch);
        for i in 0..plan.batch {
            let mut heads = Vec::with_capacity(plan.num_kv_heads);
            for h in 0..plan.num_kv_heads {
                let r = plan.page_indptr[i * plan.num_kv_heads + h] as usize..plan.page_indptr[i * plan.num_kv_heads + h + 1] as usize;
                let ls: Vec<f64> = plse[r].iter().map(|&x| x as f64).collect();
                let mx = ls.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let tot: f64 = ls.iter().map(|l| (l - mx).exp2()).sum();
                heads.push(ls.iter().map(|l| (l - mx).exp2() / tot).collect());
            }
            mass.push(heads);
        }
        Ok((output, mass))
    }
}

/// Query element types a caller may pass as they are (no conversion): fp16 and bf16.
pub trait QueryElem: Copy {
    const DTYPE: DType;
    fn to_bits(self) -> u16;
}
impl QueryElem for f16 {
    const DTYPE: DType = DType::Fp16;
    fn to_bits(self) -> u16 {
        f16::to_bits(self)
    }
}
impl QueryElem for bf16 {
    const DTYPE: DType = DType::Bf16;
    fn to_bits(self) -> u16 {
        bf16::to_bits(self)
    }
}

impl KvCache {
    /// Decodes queries already in a 16-bit type; a type that is not the spec's dtype is a typed
    /// error before anything is launched.
    pub fn decode_typed<Q: QueryElem>(&mut self, seqs: &[usize], q: &[Q]) -> Result<DecodeOutput> {
        let want = self.spec.geometry.dtype;
        if Q::DTYPE != want {
            return Err(RtError::BadInput(format!("queries are {} but spec `{}` decodes {} queries", Q::DTYPE.name(), self.spec.name, want.name())));
        }
        let qf: Vec<f32> = q.iter().map(|x| from_bits(want, x.to_bits())).collect();
        self.decode(seqs, &qf)
    }
}

pub fn to_bits(dtype: DType, x: f32) -> u16 {
    match dtype {
        DType::Fp16 => f16::from_f32(x).to_bits(),
        DType::Bf16 => bf16::from_f32(x).to_bits(),
    }
}

pub fn from_bits(dtype: DType, b: u16) -> f32 {
    match dtype {
        DType::Fp16 => f16::from_bits(b).to_f32(),
        DType::Bf16 => bf16::from_bits(b).to_f32(),
    }
}

/// Launches `func` with one parameter struct and programmatic stream serialisation: the kernel
/// may begin while the previous kernel of the stream finishes (sm_90 programmatic dependent
/// launch); it must wait (`griddepcontrol.wait`) before reading that kernel's output.
///
/// # Safety
/// As `LaunchArgs::launch`: `P` mirrors the kernel's parameter struct and every buffer it
/// points to is alive and sized for the launch until the stream has run it.
pub(crate) unsafe fn launch_programmatic<P>(st: &cudarc::driver::CudaStream, func: &cudarc::driver::CudaFunction, cfg: LaunchConfig, params: &P) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let lc = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: st.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    let mut args = [params as *const P as *mut std::ffi::c_void];
    sys::cuLaunchKernelEx(&lc, func.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()).result()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_heuristic_fills_the_machine_only_when_needed() {
        assert_eq!(split_count(8, 512, 264), 33);
        assert_eq!(split_count(64, 512, 264), 4);
        assert_eq!(split_count(8 * 64, 512, 264), 1);
        assert_eq!(split_count(8, 2, 264), 1);
        assert_eq!(split_count(1, 10, 264), 5);
        // A partial second wave: 360 CTAs on 528 slots, one wave at 68% → 7 splits, five waves
        // at 95%; 512 on 528 stays one wave; 88 CTAs fill 528 slots in 6 splits, and 660 slots
        // in 15 (two waves) rather than 93% of one in 7.
        assert_eq!(split_count(360, 512, 528), 7);
        assert_eq!(split_count(512, 2048, 528), 1);
        assert_eq!(split_count(88, 2048, 528), 6);
        assert_eq!(split_count(88, 2048, 660), 15);
        assert_eq!(split_count(400, 512, 528), 9);
    }

    #[test]
    fn plan_picks_smallest_covering_combination_and_rejects_empty() {
        let spec = Spec::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/spherical.toml")).unwrap();
        let pr = |tier, offset| PageRef { tier, index: 0, offset };
        let pages = vec![vec![vec![(pr(1, 0), 64), (pr(0, 4096), 3)]]];
        let p = plan(&spec, 128, 4, &pages, &|_| 1000, &|_| 264).unwrap();
        assert_eq!(p.variant.name(), "decode_ksph16x8b6_vfp16_d128_g4_p64_w4c4s2t");
        assert_eq!(p.page_indptr, vec![0, 2]);
        let mixed = vec![vec![vec![(pr(1, 0), 64), (pr(3, 8192), 64)]]];
        assert!(plan(&spec, 128, 4, &mixed, &|_| 1000, &|_| 264).unwrap().variant.name().contains("__"));
        let empty = vec![vec![vec![]]];
        assert!(matches!(plan(&spec, 128, 4, &empty, &|_| 1000, &|_| 264), Err(RtError::EmptySequence(0))));
        assert!(matches!(plan(&spec, 128, 4, &[], &|_| 1000, &|_| 264), Err(RtError::BadInput(_))));
    }

    #[test]
    fn tracked_launches_size_the_per_warp_scratch_by_the_variant_layout() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs");
        let pr = |tier, offset| PageRef { tier, index: 0, offset };
        // rdkv's integer ladder runs the per-warp layout (4 warps): a float per page, warp and
        // query head.
        let rdkv = Spec::load(&root.join("rdkv.toml")).unwrap();
        let (b8, b4) = (rdkv.tier("b8").unwrap().id, rdkv.tier("b4").unwrap().id);
        let pages = vec![vec![vec![(pr(b8, 0), 64), (pr(b4, 4096), 64), (pr(0, 8192), 3)]]; 2];
        let p = plan(&rdkv, 128, 3, &pages, &|_| 1000, &|_| 264).unwrap();
        assert!(kvforge_gen::launch_shape(&rdkv, &p.variant).warp_lse_per_page > 0, "{}", p.variant);
        assert_eq!(p.warp_lse_floats(&rdkv), 6 * 4 * 3);
        // Spherical keys keep the block layout, which folds a page's heads in place.
        let sph = Spec::load(&root.join("spherical.toml")).unwrap();
        let p = plan(&sph, 128, 4, &[vec![vec![(pr(1, 0), 64), (pr(0, 4096), 3)]]], &|_| 1000, &|_| 264).unwrap();
        assert_eq!(p.warp_lse_floats(&sph), 0);
    }
}
