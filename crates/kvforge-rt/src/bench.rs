//! Decode benchmark on the GPU: CUDA events, warm-up, L2 flushed between timed runs, median
//! and p10/p90, achieved bandwidth on the bytes the kernels actually read, and the measured
//! device-to-device copy bandwidth of the same run as the ceiling.

use std::sync::Arc;

use cudarc::driver::{sys::CUevent_flags, CudaSlice};
use kvforge_spec::{KeyScheme, Spec, TierId};

use crate::cache::{CacheConfig, KvCache};
use crate::device::Device;
use crate::error::{drv, Result};

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

/// Bytes one decode of `plan` reads: every page's header and segment, the queries, and the
/// codebooks every CTA reads to build its lookup tables.
pub fn bytes_read(cache: &KvCache, plan: &crate::DecodePlan) -> usize {
    let spec = cache.spec();
    let d = plan.head_dim;
    let mut bytes = plan.batch * plan.num_kv_heads * plan.gqa * d * 2;
    let ctas = plan.batch * plan.num_kv_heads * plan.splits;
    for &t in &plan.tiers {
        if let KeyScheme::Spherical { group, angle_bits, .. } = &spec.tiers[t as usize].key {
            bytes += ctas * (d / group) * (1 << angle_bits) * group * 4;
        }
    }
    bytes + plan.page_bytes_read
}

/// Benchmarks decode of `spec`'s tier `tier` over `contexts` × `batches`.
#[allow(clippy::too_many_arguments)]
pub fn bench_tier(dev: &Arc<Device>, spec: &Spec, tier: TierId, d: usize, gqa: usize, hkv: usize, contexts: &[usize], batches: &[usize], runs: usize, copy: f64, max_bytes: usize, mut progress: impl FnMut(&BenchRow)) -> Result<Vec<BenchRow>> {
    let mut flush = dev.stream.alloc_zeros::<u8>(256 << 20).map_err(drv("L2 flush buffer"))?;
    let mut rows = Vec::new();
    for &ctx in contexts {
        for &batch in batches {
            let mut cfg = CacheConfig::new(spec, d, gqa, hkv, batch, ctx * batch).target(tier);
            cfg.verify_headers = false;
            // Only the tail and the measured tier need pages.
            for (t, n) in cfg.pages.iter_mut().enumerate() {
                if t != 0 && t != tier as usize {
                    *n = 0;
                }
            }
            cfg.pages[0] = hkv * (batch + 8);
            let bytes: usize = cfg.pages.iter().enumerate().map(|(t, n)| n * spec.segment(t as TierId, d).page_bytes).sum();
            if bytes > max_bytes {
                continue;
            }
            let mut cache = KvCache::new(dev.clone(), spec.clone(), cfg)?;
            let seqs = cache.fill_for_bench(batch, ctx, 7)?;
            let plan = cache.plan(&seqs)?;
            let mut ws = cache.workspace(&plan)?;
            let q: Vec<u16> = (0..batch * hkv * gqa * d).map(|i| crate::to_bits(spec.geometry.dtype, ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)).collect();
            dev.stream.memcpy_htod(&q, &mut ws.q).map_err(drv("queries"))?;
            let t = time_us(dev, &mut flush, 3, runs, || cache.launch(&plan, &mut ws))?;
            cache.check(&plan)?;
            let b = bytes_read(&cache, &plan);
            let med = percentile(&t, 0.5);
            let gbps = b as f64 / (med * 1e-6) / 1e9;
            let row = BenchRow {
                system: "kvforge".into(),
                variant: plan.variant.name(),
                tier: format!("{}:{}", spec.name, spec.tiers[tier as usize].name),
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
