//! Read throughput of pinned host memory over UVA from a kernel, by access pattern: what bounds
//! the ParisKV fetch (`paris.cuh` `fetch`), which reads the top-k tokens' K/V rows (a run of
//! `4 D` bytes per token, interleaved) at random places in a slab of tens of GiB.
//!
//! ```text
//! cargo build --release -p kvforge-lab --example uva_read
//! uva_read --region-gib 0.25,8,32 --run-bytes 256,512,4096 --total-mib 26 --out uva.json
//! ```
//!
//! One pinned slab (`CU_MEMHOSTALLOC_DEVICEMAP`) of the largest region; per (region, run
//! bytes, pattern) the kernel reads `total` bytes as runs of `run` bytes whose starts are
//! `random` (uniform over the region, run-aligned), `sorted` (the same starts ascending, as a
//! fetch of index-sorted top-k would issue them) or `sequential` (consecutive runs), with the
//! fetch's shape: 128-thread CTAs, each thread loads its run indices, then `unroll` 16-byte
//! host reads, then stores them to device memory. Median of `iters` timed launches (CUDA
//! events). If random runs over a large region read far slower than over 256 MiB, or 256-byte
//! runs far slower per byte than 4 KiB ones, page translation (4 KiB host pages), not the bus,
//! bounds the fetch.

use std::path::PathBuf;

use clap::Parser;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{sys, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use kvforge_rt::testing::Xorshift;
use kvforge_rt::Device;
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Regions the runs are spread over, GiB (the slab is the largest).
    #[arg(long, value_delimiter = ',', default_value = "0.25,8,32")]
    region_gib: Vec<f64>,
    /// Bytes per run (a multiple of 16): 256 = one K row at D 128, 512 = a token's K and V.
    #[arg(long, value_delimiter = ',', default_value = "256,512,4096")]
    run_bytes: Vec<usize>,
    /// Bytes read per launch, MiB (26: the 128K × batch 64 fetch).
    #[arg(long, default_value_t = 26.0)]
    total_mib: f64,
    /// 16-byte host reads per thread.
    #[arg(long, default_value_t = 8)]
    unroll: u32,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// CTAs of the grid (0: one per `128 × unroll` pieces, all resident at once); fewer CTAs
    /// stride over the pieces, which bounds the reads in flight and so the address range they
    /// span at any moment.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    ctas: Vec<u32>,
    /// Runs per cluster of the `clustered` pattern: random runs inside consecutive
    /// `cluster_mib` sub-regions, cluster by cluster (a fetch's rows of one sequence and kv head
    /// lie in one such sub-region); 0 leaves the pattern out.
    #[arg(long, default_value_t = 100)]
    per_cluster: usize,
    /// Sub-region of one cluster, MiB (64: 128K tokens × 512 bytes).
    #[arg(long, default_value_t = 64.0)]
    cluster_mib: f64,
    /// The slab on huge pages (kvforge_rt::host_slab) instead of cuMemHostAlloc's 4 KiB pages.
    #[arg(long)]
    huge: bool,
    /// The slab from the virtual memory API: host-located pinned memory (`cuMemCreate`, location
    /// host) mapped at its allocation granularity (`cuMemMap`), read by the device only.
    #[arg(long)]
    vmm: bool,
    #[arg(long)]
    out: Option<PathBuf>,
}

const SOURCE: &str = r#"
struct P { const uint4* host; const unsigned long long* start; uint4* out; unsigned pieces; unsigned run_v; unsigned per_cta; unsigned unroll; };
extern "C" __global__ void __launch_bounds__(128) uva_read(const P p) {
  for (unsigned base = blockIdx.x * p.per_cta; base < p.pieces; base += gridDim.x * p.per_cta) {
    const unsigned lo = base + threadIdx.x;
    unsigned long long s[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      const unsigned e = lo + u * 128;
      s[u] = (u < p.unroll && e < p.pieces) ? __ldg(p.start + e / p.run_v) : 0ull;
    }
    uint4 x[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      const unsigned e = lo + u * 128;
      x[u] = make_uint4(0, 0, 0, 0);
      if (u < p.unroll && e < p.pieces) x[u] = p.host[s[u] + e % p.run_v];
    }
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      const unsigned e = lo + u * 128;
      if (u < p.unroll && e < p.pieces) p.out[e] = x[u];
    }
  }
}
"#;

#[repr(C)]
#[derive(Clone, Copy)]
struct P {
    host: u64,
    start: u64,
    out: u64,
    pieces: u32,
    run_v: u32,
    per_cta: u32,
    unroll: u32,
}

// SAFETY: plain-old-data mirror of the kernel's `P`.
unsafe impl DeviceRepr for P {}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    if a.unroll == 0 || a.unroll > 16 || a.run_bytes.iter().any(|&b| b == 0 || b % 16 != 0) {
        return Err("unroll must be 1 to 16 and run bytes a positive multiple of 16".into());
    }
    let dev = Device::open(0)?;
    let (ctx, st) = (dev.ctx.clone(), dev.stream.clone());
    let compiled = kvforge_rt::jit::compile_module("uva_read", SOURCE, &dev.info.arch(), false)?;
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin))?;
    let f = module.load_function("uva_read")?;
    let most = a.region_gib.iter().copied().fold(0.0, f64::max);
    let slab_bytes = ((most * (1u64 << 30) as f64) as usize).next_multiple_of(1 << 21);
    let t0 = std::time::Instant::now();
    // The kernel reads bytes below slab_bytes only (starts are drawn within each region ≤ the
    // slab), whatever they hold.
    let (_pinned, _slab, host, backing) = if a.vmm {
        let (ptr, what) = vmm_host(&ctx, slab_bytes)?;
        (None, None, ptr, what)
    } else if a.huge {
        let slab = kvforge_rt::host_slab::HostSlab::new(&ctx, slab_bytes, "uva_read slab")?;
        let host = slab.device_ptr()?;
        let backing = format!("{:?}, {:.1} GiB on huge pages", slab.backing(), slab.huge_bytes().unwrap_or(0) as f64 / (1u64 << 30) as f64);
        (None, Some(slab), host, backing)
    } else {
        // SAFETY: a plain u8 slab, read as bytes whatever they hold.
        let pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(slab_bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE) }?;
        let host = pinned.as_ptr()? as u64;
        (Some(pinned), None, host, "cuMemHostAlloc".to_string())
    };
    eprintln!("pinned {:.1} GiB in {:.1} s ({backing})", slab_bytes as f64 / (1u64 << 30) as f64, t0.elapsed().as_secs_f64());
    let total = ((a.total_mib * (1 << 20) as f64) as usize).next_multiple_of(4096);
    let out = st.alloc_zeros::<u8>(total)?;
    let mut runs = Vec::new();
    let mut rng = Xorshift::new(7);
    for &gib in &a.region_gib {
        let region = ((gib * (1u64 << 30) as f64) as usize).min(slab_bytes);
        for &rb in &a.run_bytes {
            let n = total / rb;
            let slots = (region / rb) as u64;
            let random: Vec<u64> = (0..n).map(|_| (rng.next_u64() % slots) * (rb / 16) as u64).collect();
            let mut sorted = random.clone();
            sorted.sort_unstable();
            let sequential: Vec<u64> = (0..n as u64).map(|i| (i % slots) * (rb / 16) as u64).collect();
            let mut patterns = vec![("random", random), ("sorted", sorted), ("sequential", sequential)];
            if a.per_cluster > 0 {
                let cluster_slots = (((a.cluster_mib * (1 << 20) as f64) as usize / rb) as u64).clamp(1, slots);
                let clusters = slots / cluster_slots;
                let clustered = (0..n)
                    .map(|i| {
                        let c = (i / a.per_cluster) as u64 % clusters;
                        (c * cluster_slots + rng.next_u64() % cluster_slots) * (rb / 16) as u64
                    })
                    .collect();
                patterns.push(("clustered", clustered));
            }
            for &ctas in &a.ctas {
                for (pattern, starts) in &patterns {
                    let sd = st.clone_htod(starts)?;
                    let pieces = (n * rb / 16) as u32;
                    let per_cta = 128 * a.unroll;
                    let p = P { host, start: sd.device_ptr(&st).0, out: out.device_ptr(&st).0, pieces, run_v: (rb / 16) as u32, per_cta, unroll: a.unroll };
                    let full = pieces.div_ceil(per_cta);
                    let grid = if ctas == 0 { full } else { ctas.min(full) };
                    let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
                    let mut us = Vec::new();
                    for i in 0..a.iters + 2 {
                        let e0 = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                        let e1 = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                        e0.record(&st)?;
                        // SAFETY: P as above; pieces index `out` (total bytes) and runs within the slab.
                        unsafe { st.launch_builder(&f).arg(&p).launch(cfg) }?;
                        e1.record(&st)?;
                        e1.synchronize()?;
                        if i >= 2 {
                            us.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3);
                        }
                    }
                    us.sort_by(f64::total_cmp);
                    let med = us[us.len() / 2];
                    let gbs = (n * rb) as f64 / med / 1e3;
                    println!("region {gib:>6} GiB  run {rb:>5} B  {pattern:<10}  ctas {grid:>5}  {med:>9.1} us  {gbs:>6.1} GB/s");
                    runs.push(json!({"region_gib": gib, "run_bytes": rb, "pattern": pattern, "ctas": grid, "bytes": n * rb, "median_us": med, "gb_per_s": gbs}));
                }
            }
        }
    }
    let doc = json!({
        "what": "pinned host memory read over UVA by a kernel (kvforge-lab example uva_read): median of timed launches",
        "device": dev.info.name, "backing": backing, "unroll": a.unroll, "threads_per_cta": 128, "runs": runs,
    });
    if let Some(p) = a.out {
        std::fs::write(p, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}

/// Host-located pinned memory from the virtual memory API, mapped for device 0 (never freed:
/// the example exits after the measurement). Returns the device address and a description.
fn vmm_host(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, bytes: usize) -> Result<(u64, String), Box<dyn std::error::Error>> {
    ctx.bind_to_thread()?;
    let ok = |rc: sys::CUresult, what: &str| -> Result<(), Box<dyn std::error::Error>> {
        if rc == sys::cudaError_enum::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{what}: {rc:?}").into())
        }
    };
    let mut last = String::new();
    for (kind, name) in [(sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, "host"), (sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA, "host NUMA 0")] {
        // SAFETY: plain C structs, zero is a valid start; every call's result is checked.
        unsafe {
            let mut prop: sys::CUmemAllocationProp = std::mem::zeroed();
            prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
            prop.location.type_ = kind;
            prop.location.id = 0;
            let mut gran = 0usize;
            if let Err(e) = ok(sys::cuMemGetAllocationGranularity(&mut gran, &prop, sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "granularity") {
                last = format!("{name}: {e}");
                continue;
            }
            let size = bytes.next_multiple_of(gran.max(1));
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            if let Err(e) = ok(sys::cuMemCreate(&mut handle, size, &prop, 0), "cuMemCreate") {
                last = format!("{name}: {e}");
                continue;
            }
            let mut ptr: sys::CUdeviceptr = 0;
            ok(sys::cuMemAddressReserve(&mut ptr, size, gran, 0, 0), "cuMemAddressReserve")?;
            ok(sys::cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")?;
            let mut desc: sys::CUmemAccessDesc = std::mem::zeroed();
            desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
            desc.location.id = 0;
            desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            ok(sys::cuMemSetAccess(ptr, size, &desc, 1), "cuMemSetAccess (device)")?;
            // CPU access as well, where the driver allows it (not needed for the reads timed).
            let mut cpu = desc;
            cpu.location.type_ = kind;
            let cpu_rc = sys::cuMemSetAccess(ptr, size, &cpu, 1);
            return Ok((ptr, format!("VMM {name}, granularity {} KiB, CPU access {cpu_rc:?}", gran >> 10)));
        }
    }
    Err(format!("no host-located VMM allocation: {last}").into())
}
