//! The device path of a certified step: phase 1, the selector, phase 2 and the certificate run
//! back to back on the stream, with no host round trip between them; the host uploads one page
//! table and downloads the output and a few numbers per query head.
//!
//! 1. **Phase 1** decodes the quantised pages, recording per 16-token block and query head ℓ¹
//!    and Δ.
//! 2. **`cert_select`** (one CTA per (sequence, kv head)) chooses the blocks phase 2 reads from
//!    tier 2 — the reference rule of [`super::select`], bit for bit — and writes phase 2's page
//!    table: a page with every block chosen becomes a tail-format page at its pinned original
//!    (UVA), one with some chosen carries their mask and its original's offset.
//! 3. **Phase 2** decodes that table, recording ℓ² per block.
//! 4. **`cert_bound`** (one CTA per query head) computes the certificate and the score,
//!    ranking and boundary checks of [`super::checks`] and [`super::bound`] in f64.
//!
//! The host then applies the ladder's [`verdict`] to the downloaded certificates. Rungs 3 and
//! 4 stay on the device (the selector re-runs with those groups forced exact, then phase 2 and
//! the certificate); rungs 1–2 order blocks by achieved mass, so a step that needs them
//! continues on the host path from the device's state ([`KvCache::host_ladder`]).
//!
//! [`plan_step`] computes everything a step launches with no CUDA calls (plan, then run).

use cudarc::driver::{sys::CUevent_flags, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use kvforge_gen::schedule::Entry;
use kvforge_spec::{Spec, VariantId, TAIL_TIER};

use super::ladder::{block_indptr, finish, layer_fallback, verdict, Action, Group, PhaseOut};
use super::select::group_seed;
use super::{CertConfig, CertifiedOutput, HeadCertificate, KernelTimes};
use crate::cache::KvCache;
use crate::decode::{choose_combination, from_bits, DecodeIo, DecodePlan, DecodeWorkspace};
use crate::error::{drv, Result, RtError};
use crate::params::{CertBoundParams, CertSelectParams};
use crate::pool::PageRef;

/// Columns of the certificate kernel's f64 and u32 outputs per query head: the numbers the
/// kernel is compiled with (kvforge-gen params.rs).
pub(super) use crate::params::{CERT_F64, CERT_U32, CF_ALPHA, CF_BOUND, CF_DELTA, CF_EKEY, CF_EROUND, CF_EVAL, CF_VMAX, CU_BOUNDARY, CU_DETECT, CU_EXPLORED, CU_PROMOTED, CU_RANKING};

/// Everything a device step launches, computed on the host.
#[derive(Clone, Debug)]
pub(super) struct StepPlan {
    pub phase1: DecodePlan,
    /// Same page ranges and splits; its variant also serves tail-format pages (the originals).
    pub phase2: DecodePlan,
    pub select: VariantId,
    pub bound: VariantId,
    /// Per page: its original's offset from the arena base (wrapping; 0 for tail-tier pages).
    pub orig_offsets: Vec<u64>,
    /// Blocks per page.
    pub bpp: usize,
    /// Per block: η_b (0 for blocks of tail-tier pages, which are exact).
    pub eta: Vec<f64>,
    pub v_max: Vec<f64>,
    pub seeds: Vec<u64>,
    /// Quantised blocks per group.
    pub quantised: Vec<usize>,
    /// Sort buffer of the selector: the largest group's blocks, rounded up to a power of two.
    pub sort_blocks: usize,
}

/// Phase 2's plan: phase 1's, with a variant that also serves the tail tier (every shipped
/// combination does; a spec whose smallest covering combination lacked it would get another).
pub(super) fn phase2_plan(spec: &Spec, p1: &DecodePlan) -> Result<DecodePlan> {
    let mut tiers = p1.tiers.clone();
    if !tiers.contains(&TAIL_TIER) {
        tiers.push(TAIL_TIER);
        tiers.sort();
    }
    let combo = choose_combination(spec, &tiers).ok_or_else(|| RtError::NoVariant {
        spec: spec.name.clone(),
        tiers: tiers.iter().map(|&t| spec.tiers[t as usize].name.clone()).collect(),
        head_dim: p1.head_dim,
        gqa: p1.gqa,
    })?;
    let mut p2 = p1.clone();
    p2.variant = kvforge_gen::decode_variant(spec, &combo, p1.head_dim, p1.gqa);
    p2.tiers = tiers;
    Ok(p2)
}

/// Plans a device step over `groups` (their pages in `phase1`'s order). `address` gives a
/// quantised page's tier-2 address; `arena` is the arena's device address.
pub(super) fn plan_step(spec: &Spec, phase1: DecodePlan, groups: &[Group], address: &dyn Fn(&PageRef) -> Result<u64>, arena: u64, seed: u64) -> Result<StepPlan> {
    let largest = groups.iter().map(|g| g.blocks()).max().unwrap_or(0);
    if largest > kvforge_gen::CERT_MAX_BLOCKS {
        return Err(RtError::BadInput(format!("the device selector sorts at most {} blocks per (sequence, kv head), this batch has {largest}: use CertPath::Host", kvforge_gen::CERT_MAX_BLOCKS)));
    }
    let bpp = groups.first().map_or(1, |g| g.bpp);
    let mut orig_offsets = Vec::with_capacity(phase1.page_offsets.len());
    for g in groups {
        for (i, (p, _)) in g.pages.iter().enumerate() {
            orig_offsets.push(if g.page_quantised(i) { address(p)?.wrapping_sub(arena) } else { 0 });
        }
    }
    let eta = groups.iter().flat_map(|g| (0..g.blocks()).map(|u| g.eta(u))).collect();
    let phase2 = phase2_plan(spec, &phase1)?;
    let gqa = phase1.gqa;
    Ok(StepPlan {
        select: VariantId::cert_select(spec, gqa),
        bound: VariantId::cert_bound(spec, gqa),
        phase1,
        phase2,
        orig_offsets,
        bpp,
        eta,
        v_max: groups.iter().map(|g| g.v_max).collect(),
        seeds: (0..groups.len()).map(|g| group_seed(seed, g)).collect(),
        quantised: groups.iter().map(|g| (0..g.blocks()).filter(|&u| g.quantised(u)).count()).collect(),
        sort_blocks: largest.max(1).next_power_of_two(),
    })
}

/// Sizes a step's device buffers need; a cache keeps its buffers while later steps fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Capacity {
    pages: usize,
    blocks: usize,
    groups: usize,
    rows: usize,
    /// Split-K partial outputs (floats) and log-sum-exps.
    partial: usize,
    partial_lse: usize,
    head_dim: usize,
    gqa: usize,
    /// Per-warp page-mass scratch of either phase's launch (`DecodePlan::warp_lse_floats`).
    warp_lse: usize,
}

impl Capacity {
    fn of(spec: &Spec, plan: &StepPlan) -> Capacity {
        let p = &plan.phase1;
        let rows = p.batch * p.num_kv_heads * p.gqa;
        Capacity {
            pages: p.page_offsets.len().max(1),
            blocks: p.page_offsets.len().max(1) * plan.bpp,
            groups: p.batch * p.num_kv_heads,
            rows,
            partial: if p.splits > 1 { p.splits * rows * p.head_dim } else { 1 },
            partial_lse: p.splits * rows,
            head_dim: p.head_dim,
            gqa: p.gqa,
            warp_lse: p.warp_lse_floats(spec).max(plan.phase2.warp_lse_floats(spec)),
        }
    }

    fn holds(&self, need: &Capacity) -> bool {
        self.head_dim == need.head_dim
            && self.gqa == need.gqa
            && self.pages >= need.pages
            && self.blocks >= need.blocks
            && self.groups >= need.groups
            && self.rows >= need.rows
            && self.partial >= need.partial
            && self.partial_lse >= need.partial_lse
            && self.warp_lse >= need.warp_lse
    }

    fn max(&self, o: &Capacity) -> Capacity {
        if self.head_dim != o.head_dim || self.gqa != o.gqa {
            return *o;
        }
        Capacity {
            pages: self.pages.max(o.pages),
            blocks: self.blocks.max(o.blocks),
            groups: self.groups.max(o.groups),
            rows: self.rows.max(o.rows),
            partial: self.partial.max(o.partial),
            partial_lse: self.partial_lse.max(o.partial_lse),
            head_dim: o.head_dim,
            gqa: o.gqa,
            warp_lse: self.warp_lse.max(o.warp_lse),
        }
    }
}

/// Byte offsets of the per-step upload: tier-2 offsets per page and seeds (u64), η per block
/// and V_max (f64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PackLayout {
    orig: usize,
    seeds: usize,
    eta: usize,
    v_max: usize,
    bytes: usize,
}

impl PackLayout {
    fn new(pages: usize, blocks: usize, groups: usize) -> PackLayout {
        let seeds = 8 * pages;
        let eta = seeds + 8 * groups;
        let v_max = eta + 8 * blocks;
        PackLayout { orig: 0, seeds, eta, v_max, bytes: v_max + 8 * groups }
    }
}

/// Byte offsets of the step's single download: certificates (f64, u32 columns), the decode
/// kernels' error bits, phase 2's log-sum-exp (f32) and output (spec dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ResultLayout {
    f64s: usize,
    u32s: usize,
    flags: usize,
    lse: usize,
    out: usize,
    bytes: usize,
}

impl ResultLayout {
    fn new(rows: usize, d: usize) -> ResultLayout {
        let u32s = rows * CERT_F64 * 8;
        let flags = u32s + rows * CERT_U32 * 4;
        let lse = flags + 4;
        let out = lse + rows * 4;
        ResultLayout { f64s: 0, u32s, flags, lse, out, bytes: out + rows * d * 2 }
    }
}

/// Device buffers of certified steps, kept by the cache and reused while steps fit.
pub(crate) struct CertScratch {
    cap: Capacity,
    /// Phase 1: page table uploaded every step; its masses, Δ and (unused) output.
    ws1: DecodeWorkspace,
    /// Phase 2: page table written by the selector; masses.
    ws2: DecodeWorkspace,
    pack: CudaSlice<u8>,
    state: CudaSlice<u8>,
    weights: CudaSlice<u64>,
    result: CudaSlice<u8>,
    force: CudaSlice<u8>,
}

/// What a step's download holds, parsed.
pub(super) struct StepResult {
    pub f64s: Vec<f64>,
    pub u32s: Vec<u32>,
    pub lse: Vec<f32>,
    pub out: Vec<f32>,
}

impl StepResult {
    pub fn head(&self, row: usize) -> (HeadCertificate, usize) {
        let f = &self.f64s[row * CERT_F64..(row + 1) * CERT_F64];
        let u = &self.u32s[row * CERT_U32..(row + 1) * CERT_U32];
        let c = HeadCertificate {
            delta: f[CF_DELTA],
            alpha_tail: f[CF_ALPHA],
            v_max: f[CF_VMAX],
            e_key: f[CF_EKEY],
            e_val: f[CF_EVAL],
            e_round: f[CF_EROUND],
            bound: f[CF_BOUND],
            promoted: u[CU_PROMOTED] as usize,
            explored: u[CU_EXPLORED] as usize,
            rung: 0,
            detections: 0,
            ranking: u[CU_RANKING] != 0,
            boundary: u[CU_BOUNDARY] as usize,
        };
        (c, u[CU_DETECT] as usize)
    }
}

impl KvCache {
    /// Plans a device step over `groups`.
    pub(super) fn plan_device_step(&self, groups: &[Group], seed: u64) -> Result<StepPlan> {
        let hkv = self.cfg.num_kv_heads;
        let lists: Vec<Vec<Vec<(PageRef, usize)>>> = groups.chunks(hkv).map(|seq| seq.iter().map(|g| g.pages.clone()).collect()).collect();
        let phase1 = self.plan_entry(&lists, Entry::Certified)?;
        let arena = self.store.arena_ptr();
        let orig = self.cert.originals.as_ref().expect("checked by decode_certified");
        plan_step(&self.spec, phase1, groups, &|p| orig.address(p), arena, seed)
    }

    fn alloc_scratch(&self, cap: Capacity) -> Result<CertScratch> {
        let st = &self.engine.dev().stream;
        let f32s = |n: usize, what: &str| st.alloc_zeros::<f32>(n).map_err(drv(what.to_string()));
        let table = |what: &str| -> Result<(CudaSlice<u64>, CudaSlice<u32>, CudaSlice<u32>)> {
            Ok((
                st.alloc_zeros::<u64>(cap.pages).map_err(drv(what.to_string()))?,
                st.alloc_zeros::<u32>(cap.pages).map_err(drv(what.to_string()))?,
                st.alloc_zeros::<u32>(cap.groups + 1).map_err(drv(what.to_string()))?,
            ))
        };
        let workspace = |phase1: bool| -> Result<DecodeWorkspace> {
            let (page_offsets, page_info, page_indptr) = table("page table")?;
            let io = if phase1 { cap.rows * cap.head_dim } else { 1 };
            Ok(DecodeWorkspace {
                page_offsets,
                page_info,
                page_indptr,
                q: st.alloc_zeros::<u16>(io).map_err(drv("queries"))?,
                out: st.alloc_zeros::<u16>(io).map_err(drv("output"))?,
                partial_out: f32s(cap.partial, "split partials")?,
                partial_lse: f32s(cap.partial_lse, "split lse")?,
                lse: f32s(if phase1 { cap.rows } else { 1 }, "lse")?,
                page_lse: None,
                page_head_lse: None,
                block_head_lse: Some(f32s(cap.blocks * cap.gqa, "block masses")?),
                block_delta: if phase1 { Some(f32s(cap.blocks * cap.gqa, "block bounds")?) } else { None },
                promoted_offsets: if phase1 { None } else { Some(st.alloc_zeros::<u64>(cap.pages).map_err(drv("promoted blocks"))?) },
                page_warp_lse: if cap.warp_lse > 0 { Some(f32s(cap.warp_lse, "per-warp page masses")?) } else { None },
                window: None,
            })
        };
        Ok(CertScratch {
            cap,
            ws1: workspace(true)?,
            ws2: workspace(false)?,
            pack: st.alloc_zeros::<u8>(PackLayout::new(cap.pages, cap.blocks, cap.groups).bytes).map_err(drv("certificate inputs"))?,
            state: st.alloc_zeros::<u8>(cap.blocks).map_err(drv("block states"))?,
            weights: st.alloc_zeros::<u64>(cap.blocks * cap.gqa).map_err(drv("block weights"))?,
            result: st.alloc_zeros::<u8>(ResultLayout::new(cap.rows, cap.head_dim).bytes).map_err(drv("certificates"))?,
            force: st.alloc_zeros::<u8>(cap.groups).map_err(drv("forced groups"))?,
        })
    }

    /// The cache's step buffers, grown to `plan` if needed, with the step's tables, inputs and
    /// queries uploaded.
    fn step_buffers(&mut self, plan: &StepPlan, qh: &[u16]) -> Result<CertScratch> {
        let need = Capacity::of(&self.spec, plan);
        let mut b = match self.cert.scratch.take() {
            Some(s) if s.cap.holds(&need) => s,
            old => self.alloc_scratch(old.map_or(need, |o| o.cap.max(&need)))?,
        };
        let st = self.engine.dev().stream.clone();
        let p1 = &plan.phase1;
        st.memcpy_htod(&p1.page_offsets, &mut b.ws1.page_offsets).map_err(drv("page table"))?;
        st.memcpy_htod(&p1.page_info, &mut b.ws1.page_info).map_err(drv("page table"))?;
        st.memcpy_htod(&p1.page_indptr, &mut b.ws1.page_indptr).map_err(drv("page table"))?;
        st.memcpy_dtod(&b.ws1.page_indptr, &mut b.ws2.page_indptr).map_err(drv("page table"))?;
        st.memcpy_htod(qh, &mut b.ws1.q).map_err(drv("query upload"))?;
        let l = PackLayout::new(b.cap.pages, b.cap.blocks, b.cap.groups);
        let mut pack = vec![0u8; l.bytes];
        let mut put = |at: usize, xs: &mut dyn Iterator<Item = [u8; 8]>| xs.enumerate().for_each(|(i, x)| pack[at + 8 * i..at + 8 * i + 8].copy_from_slice(&x));
        put(l.orig, &mut plan.orig_offsets.iter().map(|x| x.to_le_bytes()));
        put(l.seeds, &mut plan.seeds.iter().map(|x| x.to_le_bytes()));
        put(l.eta, &mut plan.eta.iter().map(|x| x.to_le_bytes()));
        put(l.v_max, &mut plan.v_max.iter().map(|x| x.to_le_bytes()));
        st.memcpy_htod(&pack, &mut b.pack).map_err(drv("certificate inputs"))?;
        Ok(b)
    }

    fn launch_select(&mut self, plan: &StepPlan, b: &mut CertScratch, cfg: &CertConfig, force: bool) -> Result<()> {
        let k = self.engine.kernel(&self.spec, &plan.select)?;
        let st = self.engine.dev().stream.clone();
        let groups = plan.phase1.batch * plan.phase1.num_kv_heads;
        let l = PackLayout::new(b.cap.pages, b.cap.blocks, b.cap.groups);
        let pack = b.pack.device_ptr(&st).0;
        let p = CertSelectParams {
            block_head_lse: b.ws1.block_head_lse.as_ref().map_or(0, |x| x.device_ptr(&st).0),
            page_indptr: b.ws1.page_indptr.device_ptr(&st).0,
            page_info: b.ws1.page_info.device_ptr(&st).0,
            page_offsets: b.ws1.page_offsets.device_ptr(&st).0,
            orig_offsets: pack + l.orig as u64,
            group_seeds: pack + l.seeds as u64,
            force_exact: if force { b.force.device_ptr(&st).0 } else { 0 },
            out_page_offsets: b.ws2.page_offsets.device_ptr(&st).0,
            out_page_info: b.ws2.page_info.device_ptr(&st).0,
            out_promoted_offsets: b.ws2.promoted_offsets.as_ref().map_or(0, |x| x.device_ptr(&st).0),
            block_state: b.state.device_ptr(&st).0,
            weights: b.weights.device_ptr(&st).0,
            coverage: cfg.coverage,
            explore: cfg.explore,
            min_blocks: cfg.min_blocks.min(u32::MAX as usize) as u32,
            max_blocks: cfg.max_blocks.min(u32::MAX as usize) as u32,
            groups: groups as i32,
            blocks_per_page: plan.bpp as i32,
        };
        let lc = LaunchConfig { grid_dim: (groups as u32, 1, 1), block_dim: (k.threads, 1, 1), shared_mem_bytes: (plan.sort_blocks * 8) as u32 };
        // SAFETY: the params mirror the kernel's struct (one field list); every array holds the
        // plan's pages and groups (`step_buffers` grows them); the sort buffer holds the largest
        // group (`plan_step` bounds it by the opt-in of `launch_shape`).
        crate::kernels::trace_launch(|| plan.select.symbol(), &lc);
        unsafe { st.launch_builder(&k.func).arg(&p).launch(lc) }.map_err(drv(format!("launch {}", plan.select)))?;
        Ok(())
    }

    fn launch_bound(&mut self, plan: &StepPlan, b: &mut CertScratch, cfg: &CertConfig) -> Result<()> {
        let k = self.engine.kernel(&self.spec, &plan.bound)?;
        let st = self.engine.dev().stream.clone();
        let groups = plan.phase1.batch * plan.phase1.num_kv_heads;
        let l = PackLayout::new(b.cap.pages, b.cap.blocks, b.cap.groups);
        let r = ResultLayout::new(b.cap.rows, b.cap.head_dim);
        let (pack, result) = (b.pack.device_ptr(&st).0, b.result.device_ptr(&st).0);
        let p = CertBoundParams {
            block_head_lse: b.ws1.block_head_lse.as_ref().map_or(0, |x| x.device_ptr(&st).0),
            block_delta: b.ws1.block_delta.as_ref().map_or(0, |x| x.device_ptr(&st).0),
            block_head_lse2: b.ws2.block_head_lse.as_ref().map_or(0, |x| x.device_ptr(&st).0),
            page_indptr: b.ws1.page_indptr.device_ptr(&st).0,
            page_info: b.ws1.page_info.device_ptr(&st).0,
            block_state: b.state.device_ptr(&st).0,
            block_eta: pack + l.eta as u64,
            group_v_max: pack + l.v_max as u64,
            out: result + r.out as u64,
            head_f64: result + r.f64s as u64,
            head_u32: result + r.u32s as u64,
            error_flags: self.engine.flags_ptr(),
            flags_out: result + r.flags as u64,
            guard: cfg.guard,
            head_dim: plan.phase1.head_dim as i32,
            rank_depth: cfg.rank_depth.min(i32::MAX as usize) as i32,
            groups: groups as i32,
            blocks_per_page: plan.bpp as i32,
        };
        let lc = LaunchConfig { grid_dim: ((groups * plan.phase1.gqa) as u32, 1, 1), block_dim: (k.threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: as in `launch_select`; one CTA per query head; the result buffer holds
        // CERT_F64 / CERT_U32 entries and an output row per query head of the plan.
        crate::kernels::trace_launch(|| plan.bound.symbol(), &lc);
        unsafe { st.launch_builder(&k.func).arg(&p).launch(lc) }.map_err(drv(format!("launch {}", plan.bound)))?;
        Ok(())
    }

    /// Phase 2 from the selector's table into the result buffer.
    fn launch_phase2(&mut self, plan: &StepPlan, b: &CertScratch) -> Result<()> {
        let st = self.engine.dev().stream.clone();
        let r = ResultLayout::new(b.cap.rows, b.cap.head_dim);
        let result = b.result.device_ptr(&st).0;
        let io = DecodeIo { q: b.ws1.q.device_ptr(&st).0, out: result + r.out as u64, lse: result + r.lse as u64 };
        self.launch_io(&plan.phase2, &b.ws2, io)
    }

    /// Runs the first round of a device step: phase 1, selector, phase 2, certificate.
    /// With `profile`, returns each stage's device time.
    fn device_round(&mut self, plan: &StepPlan, b: &mut CertScratch, cfg: &CertConfig, profile: bool) -> Result<Option<KernelTimes>> {
        let st = self.engine.dev().stream.clone();
        let events = if profile {
            let mut e = Vec::with_capacity(5);
            for _ in 0..5 {
                e.push(self.engine.dev().ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"))?);
            }
            Some(e)
        } else {
            None
        };
        let mark = |i: usize| -> Result<()> { events.as_ref().map_or(Ok(()), |e| e[i].record(&st).map_err(drv("event"))) };
        mark(0)?;
        let io = DecodeIo { q: b.ws1.q.device_ptr(&st).0, out: b.ws1.out.device_ptr(&st).0, lse: b.ws1.lse.device_ptr(&st).0 };
        self.launch_io(&plan.phase1, &b.ws1, io)?;
        mark(1)?;
        self.launch_select(plan, b, cfg, false)?;
        mark(2)?;
        self.launch_phase2(plan, b)?;
        mark(3)?;
        self.launch_bound(plan, b, cfg)?;
        mark(4)?;
        let Some(e) = events else { return Ok(None) };
        e[4].synchronize().map_err(drv("event"))?;
        let ms = |a: usize, z: usize| -> Result<f64> { Ok(e[a].elapsed_ms(&e[z]).map_err(drv("event"))? as f64 * 1e3) };
        Ok(Some(KernelTimes { phase1_us: ms(0, 1)?, select_us: ms(1, 2)?, phase2_us: ms(2, 3)?, bound_us: ms(3, 4)? }))
    }

    /// The step's single download; a kernel fault is its typed error.
    fn download_result(&mut self, plan: &StepPlan, b: &CertScratch) -> Result<StepResult> {
        let p = &plan.phase1;
        let (rows, d) = (p.batch * p.num_kv_heads * p.gqa, p.head_dim);
        let r = ResultLayout::new(b.cap.rows, b.cap.head_dim);
        let bytes = self.engine.dev().stream.clone_dtoh(&b.result.slice(0..r.bytes)).map_err(drv("step download"))?;
        let word = |at: usize, i: usize, w: usize| &bytes[at + i * w..at + (i + 1) * w];
        let flags = u32::from_le_bytes(word(r.flags, 0, 4).try_into().expect("4 bytes"));
        if flags != 0 {
            self.engine.check_flags(&plan.phase2.variant)?;
        }
        let dtype = self.spec.geometry.dtype;
        Ok(StepResult {
            f64s: (0..rows * CERT_F64).map(|i| f64::from_le_bytes(word(r.f64s, i, 8).try_into().expect("8 bytes"))).collect(),
            u32s: (0..rows * CERT_U32).map(|i| u32::from_le_bytes(word(r.u32s, i, 4).try_into().expect("4 bytes"))).collect(),
            lse: (0..rows).map(|i| f32::from_le_bytes(word(r.lse, i, 4).try_into().expect("4 bytes"))).collect(),
            out: (0..rows * d).map(|i| from_bits(dtype, u16::from_le_bytes(word(r.out, i, 2).try_into().expect("2 bytes")))).collect(),
        })
    }

    /// The phase outputs a host continuation needs, and the device's page states.
    fn download_phases(&self, plan: &StepPlan, b: &CertScratch, res: &StepResult) -> Result<(PhaseOut, PhaseOut, Vec<u8>)> {
        let st = &self.engine.dev().stream;
        let n = plan.phase1.page_offsets.len() * plan.bpp;
        let m = n * plan.phase1.gqa;
        let get = |x: &Option<CudaSlice<f32>>, what: &str| -> Result<Vec<f32>> { st.clone_dtoh(&x.as_ref().expect("allocated by alloc_scratch").slice(0..m)).map_err(drv(what.to_string())) };
        let indptr = block_indptr(&plan.phase1.page_indptr, plan.bpp);
        let p1 = PhaseOut { out: Vec::new(), lse: Vec::new(), head_lse: get(&b.ws1.block_head_lse, "phase-1 block masses")?, delta: get(&b.ws1.block_delta, "phase-1 block bounds")?, indptr: indptr.clone() };
        let p2 = PhaseOut { out: res.out.clone(), lse: res.lse.clone(), head_lse: get(&b.ws2.block_head_lse, "phase-2 block masses")?, delta: Vec::new(), indptr };
        let state = st.clone_dtoh(&b.state.slice(0..n)).map_err(drv("block states"))?;
        Ok((p1, p2, state))
    }

    /// A certified step on the device path (see the module doc).
    pub(super) fn device_step(&mut self, groups: &mut [Group], qh: &[u16], cfg: &CertConfig) -> Result<CertifiedOutput> {
        let plan = self.plan_device_step(groups, cfg.seed)?;
        let mut b = self.step_buffers(&plan, qh)?;
        let out = self.device_ladder(&plan, &mut b, groups, qh, cfg);
        self.cert.scratch = Some(b);
        out
    }

    fn device_ladder(&mut self, plan: &StepPlan, b: &mut CertScratch, groups: &mut [Group], qh: &[u16], cfg: &CertConfig) -> Result<CertifiedOutput> {
        let gqa = self.cfg.gqa;
        let block_bytes = self.cert_block_bytes();
        let kernel_us = self.device_round(plan, b, cfg, cfg.profile)?;
        let (mut launches, mut paged) = (1usize, 0usize);
        // Groups the selector serves wholly from tier 2 (rungs 3 and 4), kept across rounds.
        let mut force = vec![0u8; groups.len()];
        loop {
            let res = self.download_result(plan, b)?;
            let mut certs = Vec::with_capacity(groups.len() * gqa);
            let mut actions = Vec::with_capacity(groups.len());
            let mut found = Vec::with_capacity(groups.len());
            for (gi, g) in groups.iter_mut().enumerate() {
                let heads: Vec<(HeadCertificate, usize)> = (0..gqa).map(|h| res.head(gi * gqa + h)).collect();
                let det: usize = heads.iter().map(|h| h.1).sum();
                g.detections += det;
                found.push(det);
                let served = heads[0].0.promoted + heads[0].0.explored;
                paged += served * block_bytes;
                let mut heads: Vec<HeadCertificate> = heads.into_iter().map(|h| h.0).collect();
                heads.iter_mut().for_each(|h| h.rung = g.rung);
                actions.push(verdict(g, &heads, plan.quantised[gi] - served, cfg));
                certs.extend(heads);
            }
            if actions.contains(&Action::Climb) {
                // Rungs 1–2 order blocks by achieved mass: the host path continues from this
                // phase 2 (it re-checks it, so its detections are not counted twice).
                let (p1, p2, state) = self.download_phases(plan, b, &res)?;
                for (gi, g) in groups.iter_mut().enumerate() {
                    let r = p1.indptr[gi] as usize..p1.indptr[gi + 1] as usize;
                    g.state.copy_from_slice(&state[r]);
                    g.detections -= found[gi];
                }
                let (p2, heads) = self.host_ladder(groups, &p1, qh, cfg, Some(p2), &mut launches, &mut paged)?;
                return Ok(CertifiedOutput { out: p2.out, lse: p2.lse, heads, launches, paged_in_bytes: paged, host_ladder: true, kernel_us });
            }
            let before = force.clone();
            for (gi, g) in groups.iter_mut().enumerate() {
                if actions[gi] == Action::Exact {
                    g.rung = 3;
                    force[gi] = 1;
                }
            }
            if layer_fallback(groups, cfg) {
                for (gi, g) in groups.iter_mut().enumerate() {
                    g.rung = 4;
                    force[gi] = 1;
                }
            }
            if force == before {
                return Ok(CertifiedOutput { out: res.out, lse: res.lse, heads: finish(groups, certs, gqa), launches, paged_in_bytes: paged, host_ladder: false, kernel_us });
            }
            // Rungs 3–4 on the device: the selector serves the forced groups wholly from tier 2.
            self.engine.dev().stream.memcpy_htod(&force, &mut b.force).map_err(drv("forced groups"))?;
            self.launch_select(plan, b, cfg, true)?;
            self.launch_phase2(plan, b)?;
            self.launch_bound(plan, b, cfg)?;
            launches += 1;
        }
    }
}

/// The first round of a device step next to the host reference run on the same phase
/// outputs: what the GPU tests compare (`KvCache::certified_crosscheck`).
#[derive(Clone, Debug)]
pub struct CrossCheck {
    /// Per (sequence, kv head): block states the device selector wrote.
    pub device_state: Vec<Vec<u8>>,
    /// Per (sequence, kv head): block states of the host selector on the device's phase-1 masses.
    pub host_state: Vec<Vec<u8>>,
    /// Per query head: the device's certificate (rung 0, detections of this head).
    pub device: Vec<HeadCertificate>,
    /// Per query head: the f64 host reference on the device's selection and phase outputs.
    pub host: Vec<HeadCertificate>,
}

impl KvCache {
    /// Runs one device round (phase 1, selector, phase 2, certificate: no ladder) and the host
    /// reference selector and certificate on its downloaded phase outputs. `cfg.seed` is used
    /// as is (not advanced).
    pub fn certified_crosscheck(&mut self, seqs: &[usize], q: &[f32], cfg: &CertConfig) -> Result<CrossCheck> {
        let (gqa, d) = (self.cfg.gqa, self.cfg.head_dim);
        let (mut groups, qh) = self.cert_groups(seqs, q)?;
        let plan = self.plan_device_step(&groups, cfg.seed)?;
        let mut b = self.step_buffers(&plan, &qh)?;
        let round = self.device_round(&plan, &mut b, cfg, false).and_then(|_| self.download_result(&plan, &b)).and_then(|res| Ok((self.download_phases(&plan, &b, &res)?, res)));
        self.cert.scratch = Some(b);
        let ((p1, p2, state), dc) = round?;
        let (mut device_state, mut host_state, mut device, mut host) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (gi, g) in groups.iter_mut().enumerate() {
            let r = p1.indptr[gi] as usize..p1.indptr[gi + 1] as usize;
            let sp = super::select::SelectParams { coverage: cfg.coverage, min_blocks: cfg.min_blocks, max_blocks: cfg.max_blocks, explore: cfg.explore, seed: plan.seeds[gi] };
            host_state.push(g.select(p1.rows(&p1.head_lse, gi, gqa), gqa, &sp).state);
            device_state.push(state[r.clone()].to_vec());
            g.state.copy_from_slice(&state[r]);
            for (h, (mut c, det)) in super::ladder::head_certificates(g, &p1, &p2, gi, gqa, d, cfg).into_iter().enumerate() {
                c.detections = det;
                host.push(c);
                let (mut c, det) = dc.head(gi * gqa + h);
                c.detections = det;
                device.push(c);
            }
        }
        Ok(CrossCheck { device_state, host_state, device, host })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certified::PageErrors;

    fn spec() -> Spec {
        crate::testing::shipped_spec("certified.toml")
    }

    fn group(tiers: &[u8], base: u32) -> Group {
        let pages = tiers.iter().enumerate().map(|(i, &t)| (PageRef { tier: t, index: base + i as u32, offset: 4096 * (base + i as u32) as u64 }, if t == TAIL_TIER { 5 } else { 64 })).collect();
        let errors = tiers.iter().enumerate().map(|(i, &t)| (t != TAIL_TIER).then_some(PageErrors::uniform(0.01 * i as f64, 1.0))).collect();
        Group::new(pages, errors, 2.0, 4)
    }

    fn phase1(s: &Spec, groups: &[Group], hkv: usize) -> DecodePlan {
        let lists: Vec<Vec<Vec<(PageRef, usize)>>> = groups.chunks(hkv).map(|c| c.iter().map(|g| g.pages.clone()).collect()).collect();
        crate::decode::plan(s, 128, 4, &lists, &|_| 1000, &|_| 264).unwrap()
    }

    #[test]
    fn plan_serves_originals_through_a_variant_with_the_tail_tier() {
        let s = spec();
        let q8 = s.tier("q8k4v").unwrap().id;
        // Lengths that are multiples of the page: phase 1 has no tail page at all.
        let groups = vec![group(&[q8, q8], 0), group(&[q8, q8, q8], 2)];
        let p1 = phase1(&s, &groups, 2);
        assert!(!p1.tiers.contains(&TAIL_TIER));
        let arena = 1u64 << 40;
        let plan = plan_step(&s, p1.clone(), &groups, &|p| Ok(0x7000_0000 + p.index as u64 * 100), arena, 9).unwrap();
        assert!(plan.phase2.tiers.contains(&TAIL_TIER));
        assert!(matches!(&plan.phase2.variant.family, kvforge_spec::Family::Decode { tiers, .. } if tiers.contains(&TAIL_TIER) && tiers.contains(&q8)));
        assert_eq!((plan.phase2.page_offsets.clone(), plan.phase2.splits), (p1.page_offsets, p1.splits));
        // Originals below the arena: wrapping offsets that the kernel's base + offset undoes.
        assert_eq!(plan.orig_offsets[3], (0x7000_0000u64 + 300).wrapping_sub(arena));
        assert_eq!(arena.wrapping_add(plan.orig_offsets[3]), 0x7000_0000 + 300);
        // η per block: group 1's third page (i = 2) starts at block 2·4 + 2·4.
        assert_eq!((plan.eta.len(), plan.eta[16], plan.eta[19], plan.eta[4]), (20, 0.02, 0.02, 0.01));
        assert_eq!((plan.quantised.clone(), plan.sort_blocks, plan.v_max.clone(), plan.bpp), (vec![8, 12], 16, vec![2.0, 2.0], 4));
        assert_eq!(plan.seeds, vec![group_seed(9, 0), group_seed(9, 1)]);
        assert_eq!((plan.select.name(), plan.bound.name()), ("certselect_g4".to_string(), "certbound_g4".to_string()));
    }

    #[test]
    fn tail_pages_have_no_original_and_missing_ones_are_errors() {
        let s = spec();
        let q8 = s.tier("q8k4v").unwrap().id;
        let groups = vec![group(&[q8, TAIL_TIER], 0)];
        let p1 = phase1(&s, &groups, 1);
        let plan = plan_step(&s, p1.clone(), &groups, &|p| Ok(p.offset + 7), 0, 1).unwrap();
        assert_eq!((plan.orig_offsets.clone(), plan.eta.clone(), plan.quantised.clone()), (vec![7, 0], vec![0.0; 8], vec![4]));
        let missing = plan_step(&s, p1, &groups, &|p| Err(RtError::MissingOriginal { page: p.index as usize, offset: p.offset }), 0, 1);
        assert!(matches!(missing, Err(RtError::MissingOriginal { page: 0, .. })));
    }

    #[test]
    fn groups_beyond_the_sort_buffer_are_a_typed_error() {
        let s = spec();
        let q8 = s.tier("q8k4v").unwrap().id;
        let groups = vec![group(&vec![q8; kvforge_gen::CERT_MAX_BLOCKS / 4 + 1], 0)];
        let p1 = phase1(&s, &groups, 1);
        assert!(matches!(plan_step(&s, p1, &groups, &|_| Ok(0), 0, 1), Err(RtError::BadInput(_))));
    }

    #[test]
    fn upload_and_download_layouts_are_aligned_and_disjoint() {
        for (pages, groups) in [(1, 1), (3, 2), (129, 8), (16384, 64)] {
            let blocks = 4 * pages;
            let l = PackLayout::new(pages, blocks, groups);
            let parts = [(l.orig, 8 * pages), (l.seeds, 8 * groups), (l.eta, 8 * blocks), (l.v_max, 8 * groups)];
            assert!(parts.iter().all(|&(at, _)| at % 8 == 0));
            assert!(parts.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
            assert_eq!(l.v_max + 8 * groups, l.bytes);
        }
        for (rows, d) in [(1, 64), (32, 128), (8 * 64 * 8, 256)] {
            let r = ResultLayout::new(rows, d);
            let parts = [(r.f64s, 8 * CERT_F64 * rows), (r.u32s, 4 * CERT_U32 * rows), (r.flags, 4), (r.lse, 4 * rows), (r.out, 2 * rows * d)];
            assert!(parts.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
            assert!(r.f64s.is_multiple_of(8) && r.u32s.is_multiple_of(4) && r.flags.is_multiple_of(4) && r.lse.is_multiple_of(4) && r.out.is_multiple_of(2));
            assert_eq!(r.out + 2 * rows * d, r.bytes);
        }
    }

    #[test]
    fn scratch_grows_and_is_reused_while_steps_fit() {
        let c = Capacity { pages: 100, blocks: 400, groups: 8, rows: 32, partial: 1, partial_lse: 32, head_dim: 128, gqa: 4, warp_lse: 0 };
        assert!(c.holds(&Capacity { pages: 50, ..c }));
        assert!(!c.holds(&Capacity { pages: 101, ..c }));
        assert!(!c.holds(&Capacity { blocks: 401, ..c }));
        assert!(!c.holds(&Capacity { partial: 4096, ..c }));
        assert!(!c.holds(&Capacity { gqa: 8, ..c }));
        assert!(!c.holds(&Capacity { warp_lse: 1600, ..c }));
        let g = c.max(&Capacity { pages: 10, partial: 4096, ..c });
        assert_eq!((g.pages, g.partial, g.rows), (100, 4096, 32));
        assert_eq!(c.max(&Capacity { head_dim: 64, pages: 10, ..c }).pages, 10);
    }
}
