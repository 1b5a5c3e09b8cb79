//! Decode benchmark on the GPU: CUDA events, warm-up, L2 flushed between timed runs, median
//! and p10/p90, achieved bandwidth on the bytes the kernels actually read, and the measured
//! device-to-device copy bandwidth of the same run as the ceiling.

use std::sync::Arc;

use cudarc::driver::{sys::CUevent_flags, CudaSlice};
use kvforge_spec::{KeyScheme, Spec, TierId};

use kvforge_rt::Device;
use kvforge_rt::{drv, Result, RtError};
use kvforge_rt::{CacheConfig, KvCache};

/// One measured case, in the JSON schema shared with the peers' driver.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchRow {
    pub system: String,
    pub variant: String,
    pub tier: String,
    pub context: usize,
    pub batch: usize,
    pub splits: usize,
    pub time_us: f64,
    pub p10_us: f64,
    pub p90_us: f64,
    pub bytes_read: usize,
    pub gbps: f64,
    pub bw_fraction: f64,
}

/// Builds `batch` sequences of `len` tokens quickly in a fresh `cache`: a template of up to 16
/// pages per kv head of uniform random keys and values is appended (and encoded) for real,
/// then [`KvCache::tile_sequence`] replicates its page bytes on the device. Page contents
/// repeat; their bytes are real encoded data, never zeros.
pub fn fill_for_bench(cache: &mut KvCache, batch: usize, len: usize, seed: u64) -> Result<Vec<usize>> {
    use rand::{Rng, SeedableRng};
    let (hkv, d, p) = (cache.config().num_kv_heads, cache.config().head_dim, cache.spec().page.tokens);
    if batch == 0 || len == 0 {
        return Err(RtError::BadInput("bench fill needs batch > 0 and len > 0".into()));
    }
    if cache.pool().used_pages(cache.config().target_tier) > 0 {
        return Err(RtError::BadInput("bench fill needs a fresh cache".into()));
    }
    let full = len / p;
    // The template's page count divides `full`, so replication gives every head the same
    // number of pages.
    let tmpl_full = (1..=full.min(16)).rev().find(|t| full % t == 0).unwrap_or(0);
    let tmpl_len = tmpl_full * p + len % p;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = tmpl_len * hkv * d;
    let k: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let s0 = cache.add_sequence();
    cache.append(s0, &k, &v)?;
    cache.tile_sequence(s0, batch, len)
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

/// Times `f` between CUDA events `runs` times after `warmup` runs, flushing L2 (a 256 MB
/// memset) before each timed run. Returns sorted times in microseconds.
pub fn time_us(dev: &Device, flush: &mut CudaSlice<u8>, warmup: usize, runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    let st = &dev.stream;
    for _ in 0..warmup {
        f()?;
    }
    let mut t = Vec::with_capacity(runs);
    for _ in 0..runs {
        st.memset_zeros(flush).map_err(drv("L2 flush"))?;
        let a = dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"))?;
        let b = dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"))?;
        a.record(st).map_err(drv("event"))?;
        f()?;
        b.record(st).map_err(drv("event"))?;
        b.synchronize().map_err(drv("event"))?;
        t.push(a.elapsed_ms(&b).map_err(drv("event"))? as f64 * 1e3);
    }
    t.sort_by(|x, y| x.partial_cmp(y).unwrap());
    Ok(t)
}

/// Device-to-device copy bandwidth (bytes read + written per second) of a 2 GiB copy.
pub fn copy_gbps(dev: &Device, flush: &mut CudaSlice<u8>) -> Result<f64> {
    let n = 1usize << 31;
    let src = dev.stream.alloc_zeros::<u8>(n).map_err(drv("copy bench"))?;
    let mut dst = dev.stream.alloc_zeros::<u8>(n).map_err(drv("copy bench"))?;
    let t = time_us(dev, flush, 2, 10, || dev.stream.memcpy_dtod(&src, &mut dst).map_err(drv("copy bench")))?;
    Ok(2.0 * n as f64 / (percentile(&t, 0.5) * 1e-6) / 1e9)
}

/// Bytes one decode of `plan` reads: every page's header and segment, the queries, the
/// codebooks every CTA reads to build its lookup tables and the channel orders of mixed keys.
pub fn bytes_read(cache: &KvCache, plan: &kvforge_rt::DecodePlan) -> usize {
    let spec = cache.spec();
    let d = plan.head_dim;
    let mut bytes = plan.batch * plan.num_kv_heads * plan.gqa * d * 2;
    let ctas = plan.batch * plan.num_kv_heads * plan.splits;
    for &t in &plan.tiers {
        match &spec.tiers[t as usize].key {
            KeyScheme::Spherical { group, angle_bits, .. } => bytes += ctas * (d / group) * (1 << angle_bits) * group * 4,
            // Mixed keys gather the query through the kv head's channel order (u16 per channel).
            KeyScheme::Mixed { .. } => bytes += ctas * d * 2,
            _ => {}
        }
    }
    bytes + plan.page_bytes_read
}

/// Benchmarks decode of `spec`'s tier `tiers[0]` over `contexts` × `batches`, or, given
/// several tiers, of a *ladder*: every (sequence, head) holds its full pages in the tiers in
/// turn (page i in `tiers[i % n]`, one launch serves the mix), to compare its bandwidth with
/// single-tier sequences of the same bytes.
#[allow(clippy::too_many_arguments)]
pub fn bench_tier(
    dev: &Arc<Device>,
    spec: &Spec,
    tiers: &[TierId],
    d: usize,
    gqa: usize,
    hkv: usize,
    contexts: &[usize],
    batches: &[usize],
    runs: usize,
    copy: f64,
    max_bytes: usize,
    mut progress: impl FnMut(&BenchRow),
) -> Result<Vec<BenchRow>> {
    let Some(&first) = tiers.first() else {
        return Err(kvforge_rt::RtError::BadInput("bench needs at least one tier".into()));
    };
    let label = format!("{}:{}", spec.name, tiers.iter().map(|&t| spec.tiers[t as usize].name.as_str()).collect::<Vec<_>>().join("+"));
    let mut flush = dev.stream.alloc_zeros::<u8>(256 << 20).map_err(drv("L2 flush buffer"))?;
    let mut rows = Vec::new();
    for &ctx in contexts {
        for &batch in batches {
            let mut cfg = CacheConfig::new(spec, d, gqa, hkv, batch, ctx * batch).target(first);
            cfg.verify_headers = false;
            // Only the tail and the measured tiers need pages; the ladder's other tiers take
            // their share of the pages the fill writes in the first.
            let share = (ctx / spec.page.tokens) * hkv * batch / tiers.len() + hkv * batch;
            for (t, n) in cfg.pages.iter_mut().enumerate() {
                if t != 0 && t != first as usize {
                    *n = if tiers.contains(&(t as TierId)) { share } else { 0 };
                }
            }
            cfg.pages[0] = hkv * (batch + 8);
            let bytes: usize = cfg.pages.iter().enumerate().map(|(t, n)| n * spec.segment(t as TierId, d).page_bytes).sum();
            if bytes > max_bytes {
                continue;
            }
            let mut cache = KvCache::new(dev.clone(), spec.clone(), cfg)?;
            let seqs = fill_for_bench(&mut cache, batch, ctx, 7)?;
            if tiers.len() > 1 {
                let full = ctx / spec.page.tokens;
                for &s in &seqs {
                    let moves: Vec<_> = (0..hkv).flat_map(|h| (0..full).map(move |i| (h, i, tiers[i % tiers.len()]))).filter(|m| m.2 != first).collect();
                    cache.retier_pages(s, &moves)?;
                }
            }
            let plan = cache.plan(&seqs)?;
            let mut ws = cache.workspace(&plan)?;
            let q: Vec<u16> = (0..batch * hkv * gqa * d).map(|i| kvforge_rt::to_bits(spec.geometry.dtype, ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)).collect();
            dev.stream.memcpy_htod(&q, &mut ws.q).map_err(drv("queries"))?;
            let t = time_us(dev, &mut flush, 3, runs, || cache.launch(&plan, &mut ws))?;
            cache.check(&plan)?;
            let b = bytes_read(&cache, &plan);
            let med = percentile(&t, 0.5);
            let gbps = b as f64 / (med * 1e-6) / 1e9;
            let row = BenchRow {
                system: "kvforge".into(),
                variant: plan.variant.name(),
                tier: label.clone(),
                context: ctx,
                batch,
                splits: plan.splits,
                time_us: med,
                p10_us: percentile(&t, 0.1),
                p90_us: percentile(&t, 0.9),
                bytes_read: b,
                gbps,
                bw_fraction: gbps / copy,
            };
            progress(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// One certified-decode case: step times (host API wall time, so all include upload, plan
/// and download) of plain quantised decode and of certified decode on the device path and the
/// host path, with the ladder's telemetry (of the device path) and its device-time breakdown.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CertifiedRow {
    pub context: usize,
    pub batch: usize,
    /// "concentrated" (a few heavy keys per head, as in real attention) or "flat" (random).
    pub attention: String,
    pub plain_us: f64,
    /// Device path (selector and certificate on the GPU).
    pub certified_us: f64,
    /// certified_us / plain_us − 1.
    pub overhead: f64,
    /// Host path (selector and certificate on the host between launches).
    pub host_path_us: f64,
    pub host_path_overhead: f64,
    /// Host path with [`kvforge_rt::certified::PageIn::Copy`]: the same steps (same selection) with
    /// the promoted originals copied into device memory (one async DMA per run of consecutive
    /// pages) before phase 2,
    /// instead of read by phase 2 over UVA (`host_path_us`): the page-in comparison.
    pub host_copy_us: f64,
    pub host_copy_overhead: f64,
    /// Median device time of the device path's stages (CUDA events, first round of a step).
    pub kernel_us: kvforge_rt::certified::KernelTimes,
    /// Certificate kernel (E_key, E_val, E_round, score/ranking/boundary checks) over the
    /// device time of the whole first round.
    pub check_share: f64,
    /// Plain quantised decode of the same batch on the device (CUDA events, L2 flushed, median
    /// of 20): what `device_overhead` compares the certified round against.
    pub plain_kernel_us: f64,
    /// Device time of the certified first round (phase 1 + selector + phase 2 + certificate)
    /// ÷ `plain_kernel_us` − 1.
    pub device_overhead: f64,
    /// The ranking-consistency and boundary checks (seed 004 eqs. 17–18) inside the
    /// certificate kernel: its median time with them (rank depth r = 1) minus without
    /// (r = 0), over the same steps.
    pub rank_check_us: f64,
    /// `rank_check_us` over the device time of the first round.
    pub rank_check_share: f64,
    /// Head-steps per final rung 0..=4.
    pub rungs: [usize; 5],
    /// Head-steps whose ranking or boundary check failed.
    pub rank_triggers: usize,
    /// Steps that continued on the host path (rungs 1–2).
    pub host_ladder_steps: usize,
    /// Blocks served from tier 2 (promoted or explored) ÷ quantised blocks, per kv head.
    pub promoted_fraction: f64,
    pub mean_bound: f64,
    pub max_bound: f64,
    pub detections: usize,
    pub paged_in_bytes_per_step: f64,
}

/// Certified decode (seed 004) on `spec`'s quantised tier `tier` (the cache keeps fp16
/// originals): `steps` decode steps per case with fresh queries, timed against plain decode,
/// device path, host path (UVA) and host path (copied page-in) alternating on the same cache. `rank_escalate` as in
/// [`kvforge_rt::certified::CertConfig`].
#[allow(clippy::too_many_arguments)]
pub fn bench_certified(
    dev: &Arc<Device>,
    spec: &Spec,
    tier: TierId,
    d: usize,
    gqa: usize,
    hkv: usize,
    contexts: &[usize],
    batches: &[usize],
    steps: usize,
    rank_escalate: bool,
    mut progress: impl FnMut(&CertifiedRow),
) -> Result<Vec<CertifiedRow>> {
    use kvforge_rt::certified::{CertConfig, CertPath, KernelTimes};
    use rand::{Rng, SeedableRng};
    let mut rows = Vec::new();
    for &ctx in contexts {
        for &batch in batches {
            for concentrated in [true, false] {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(ctx as u64 * 31 + batch as u64);
                let mut cfg = CacheConfig::new(spec, d, gqa, hkv, batch, ctx * batch).target(tier);
                cfg.verify_headers = false;
                let mut cache = KvCache::new(dev.clone(), spec.clone(), cfg.clone())?;
                let mut plain = KvCache::new(dev.clone(), spec.clone(), cfg)?;
                cache.keep_originals()?;
                // Keys: noise plus, when concentrated, 8 heavy tokens per head that the queries
                // point at (the attention of real heads is dominated by a few pages).
                let n = ctx * hkv * d;
                let heavy: Vec<usize> = (0..8).map(|_| rng.gen_range(0..ctx)).collect();
                let dir: Vec<f32> = (0..hkv * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                let mut seqs = Vec::new();
                let mut plain_seqs = Vec::new();
                for _ in 0..batch {
                    let mut k: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                    if concentrated {
                        for &t in &heavy {
                            for i in 0..hkv * d {
                                k[t * hkv * d + i] = 3.0 * dir[i];
                            }
                        }
                    }
                    let s = cache.add_sequence();
                    cache.append(s, &k, &v)?;
                    seqs.push(s);
                    let p = plain.add_sequence();
                    plain.append(p, &k, &v)?;
                    plain_seqs.push(p);
                }
                let mut cg = CertConfig { rank_escalate, profile: true, ..CertConfig::default() };
                let mut ch = CertConfig { rank_escalate, path: CertPath::Host, ..CertConfig::default() };
                let mut cc = CertConfig { page_in: kvforge_rt::certified::PageIn::Copy, ..ch.clone() };
                // The same device path without the ranking and boundary checks: their cost.
                let mut c0 = CertConfig { rank_depth: 0, ..cg.clone() };
                let mut bound0 = Vec::new();
                let (mut tp, mut tc, mut th, mut tx) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                let mut stages: [Vec<f64>; 4] = Default::default();
                let mut rungs = [0usize; 5];
                let (mut promoted, mut blocks, mut bsum, mut bmax, mut det, mut paged) = (0usize, 0usize, 0f64, 0f64, 0usize, 0usize);
                let (mut heads, mut rank_triggers, mut host_ladder_steps) = (0usize, 0usize, 0usize);
                for step in 0..steps + 2 {
                    let q: Vec<f32> =
                        (0..batch).flat_map(|_| (0..hkv * gqa * d).map(|i| if concentrated { dir[(i / (gqa * d)) * d + i % d] * 1.5 } else { 0.0 } + rng.gen_range(-1.0f32..1.0)).collect::<Vec<_>>()).collect();
                    let t0 = std::time::Instant::now();
                    plain.decode(&plain_seqs, &q)?;
                    let t1 = std::time::Instant::now();
                    let r = cache.decode_certified(&seqs, &q, &mut cg)?;
                    let t2 = std::time::Instant::now();
                    cache.decode_certified(&seqs, &q, &mut ch)?;
                    let t3 = std::time::Instant::now();
                    cache.decode_certified(&seqs, &q, &mut cc)?;
                    let t4 = std::time::Instant::now();
                    let r0 = cache.decode_certified(&seqs, &q, &mut c0)?;
                    if step < 2 {
                        continue;
                    }
                    tp.push((t1 - t0).as_secs_f64() * 1e6);
                    tc.push((t2 - t1).as_secs_f64() * 1e6);
                    th.push((t3 - t2).as_secs_f64() * 1e6);
                    tx.push((t4 - t3).as_secs_f64() * 1e6);
                    bound0.push(r0.kernel_us.unwrap_or_default().bound_us);
                    let k = r.kernel_us.unwrap_or_default();
                    for (v, x) in stages.iter_mut().zip([k.phase1_us, k.select_us, k.phase2_us, k.bound_us]) {
                        v.push(x);
                    }
                    paged += r.paged_in_bytes;
                    host_ladder_steps += usize::from(r.host_ladder);
                    for (i, h) in r.heads.iter().enumerate() {
                        rungs[h.rung as usize] += 1;
                        rank_triggers += usize::from(h.ranking || h.boundary > 0);
                        bsum += h.bound;
                        bmax = bmax.max(h.bound);
                        heads += 1;
                        if i % gqa == 0 {
                            promoted += h.promoted + h.explored;
                            blocks += ctx / spec.page.tokens * (spec.page.tokens / kvforge_rt::certified::CERT_BLOCK);
                            det += h.detections;
                        }
                    }
                }
                // Plain decode's kernels on the device, the reference of the device overhead.
                let plain_kernel_us = {
                    let plan = plain.plan(&plain_seqs)?;
                    let mut ws = plain.workspace(&plan)?;
                    let mut flush = dev.stream.alloc_zeros::<u8>(256 << 20).map_err(drv("L2 flush buffer"))?;
                    let t = time_us(dev, &mut flush, 3, 20, || plain.launch(&plan, &mut ws))?;
                    plain.check(&plan)?;
                    percentile(&t, 0.5)
                };
                for v in [&mut tp, &mut tc, &mut th, &mut tx, &mut bound0].into_iter().chain(stages.iter_mut()) {
                    v.sort_by(f64::total_cmp);
                }
                let (p, c, h, x) = (percentile(&tp, 0.5), percentile(&tc, 0.5), percentile(&th, 0.5), percentile(&tx, 0.5));
                let kernel_us = KernelTimes { phase1_us: percentile(&stages[0], 0.5), select_us: percentile(&stages[1], 0.5), phase2_us: percentile(&stages[2], 0.5), bound_us: percentile(&stages[3], 0.5) };
                let rank_check_us = kernel_us.bound_us - percentile(&bound0, 0.5);
                let round = kernel_us.phase1_us + kernel_us.select_us + kernel_us.phase2_us + kernel_us.bound_us;
                let row = CertifiedRow {
                    context: ctx,
                    batch,
                    attention: if concentrated { "concentrated" } else { "flat" }.into(),
                    plain_us: p,
                    certified_us: c,
                    overhead: c / p - 1.0,
                    host_path_us: h,
                    host_path_overhead: h / p - 1.0,
                    host_copy_us: x,
                    host_copy_overhead: x / p - 1.0,
                    kernel_us,
                    check_share: kernel_us.bound_us / round,
                    plain_kernel_us,
                    device_overhead: round / plain_kernel_us - 1.0,
                    rank_check_us,
                    rank_check_share: rank_check_us / round,
                    rungs,
                    rank_triggers,
                    host_ladder_steps,
                    promoted_fraction: promoted as f64 / blocks.max(1) as f64,
                    mean_bound: bsum / heads.max(1) as f64,
                    max_bound: bmax,
                    detections: det,
                    paged_in_bytes_per_step: paged as f64 / steps.max(1) as f64,
                };
                progress(&row);
                rows.push(row);
            }
        }
    }
    Ok(rows)
}

/// One tracked decode step split on the GPU: what the importance window adds to a decode.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct TrackedStep {
    /// The decode kernels (decode + split-K combine) without the fold, CUDA events, L2
    /// flushed before.
    pub decode_us: f64,
    /// The same launch with the fold (`decode_tracked`'s kernels: the fold inside the
    /// combine when the plan has one, else the separate `mass_window` launch), L2 flushed
    /// before. `tracked_us − decode_us` is what the window costs the step.
    pub tracked_us: f64,
    /// The standalone `mass_window` kernel once more after them, CUDA events (what a plan
    /// without a combine pays, and what the fold cost before it moved into the combine).
    pub fold_us: f64,
    /// Whether the plan has a split-K combine (the fold ran inside it).
    pub fused: bool,
    /// Host time of the tracked launch call minus the plain one (no synchronisation).
    pub fold_launch_us: f64,
}

/// Times tracked decode steps ([`KvCache::decode_tracked`]) by parts.
pub struct TrackedStepTimer {
    flush: CudaSlice<u8>,
}

impl TrackedStepTimer {
    pub fn new(dev: &Device) -> Result<TrackedStepTimer> {
        Ok(TrackedStepTimer { flush: dev.stream.alloc_zeros::<u8>(256 << 20).map_err(drv("L2 flush buffer"))? })
    }

    /// Decodes `q` for `seqs` without and with the window fold, with events around each
    /// part. The folds are real: run after `decode_tracked` of the same query they fold the
    /// same masses again and leave the window as it was (a maximum is idempotent).
    pub fn time(&mut self, cache: &mut KvCache, seqs: &[usize], q: &[f32]) -> Result<TrackedStep> {
        let plan = cache.plan(seqs)?;
        let mut plain = cache.workspace(&plan)?;
        let mut ws = cache.mass_workspace(&plan)?;
        cache.track_window(&plan, &mut ws, seqs)?;
        if q.len() != ws.q.len() {
            return Err(kvforge_rt::RtError::BadInput(format!("query has {} values, the plan takes {}", q.len(), ws.q.len())));
        }
        let dtype = cache.spec().geometry.dtype;
        let qh: Vec<u16> = q.iter().map(|&x| kvforge_rt::to_bits(dtype, x)).collect();
        let dev = cache.device().clone();
        let st = &dev.stream;
        st.memcpy_htod(&qh, &mut ws.q).map_err(drv("query upload"))?;
        st.memcpy_htod(&qh, &mut plain.q).map_err(drv("query upload"))?;
        let event = || dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(drv("event"));
        let (a, b, c, d, e) = (event()?, event()?, event()?, event()?, event()?);
        st.memset_zeros(&mut self.flush).map_err(drv("L2 flush"))?;
        a.record(st).map_err(drv("event"))?;
        let t = std::time::Instant::now();
        cache.launch(&plan, &mut plain)?;
        let plain_launch = t.elapsed().as_secs_f64() * 1e6;
        b.record(st).map_err(drv("event"))?;
        st.memset_zeros(&mut self.flush).map_err(drv("L2 flush"))?;
        c.record(st).map_err(drv("event"))?;
        let t = std::time::Instant::now();
        cache.launch(&plan, &mut ws)?;
        let tracked_launch = t.elapsed().as_secs_f64() * 1e6;
        d.record(st).map_err(drv("event"))?;
        cache.fold_mass_window(&plan, &ws)?;
        e.record(st).map_err(drv("event"))?;
        cache.check(&plan)?;
        let ms = |x: &cudarc::driver::CudaEvent, y: &cudarc::driver::CudaEvent| x.elapsed_ms(y).map(|t| f64::from(t) * 1e3).map_err(drv("event"));
        Ok(TrackedStep { decode_us: ms(&a, &b)?, tracked_us: ms(&c, &d)?, fold_us: ms(&d, &e)?, fused: plan.combine.is_some(), fold_launch_us: tracked_launch - plain_launch })
    }
}
