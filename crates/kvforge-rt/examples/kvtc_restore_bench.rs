//! kvtc restore throughput on the device: a synthetic calibration and container of a
//! Llama-8B-shaped cache (default 131072 tokens × 32 layers × 8 kv heads × d 128, random
//! directions, allocations shaped like real ones; quality is measured elsewhere), restored by
//! [`KvtcRestorer`] with CUDA events around the kernels alone, after a warm-up; and the host
//! entropy-decode rate (DEFLATE and zstd payloads of the same chunks, decoded on `--threads`
//! rayon threads); then the whole load end to end: the container saved (entropy-coded, in
//! memory), read back and restored by [`KvtcRestorer::restore_pipelined`] (decode of segment
//! i+1 overlapping the pinned upload of segment i and the kernels of segment i−1), wall clock.
//! Each basis scope of `--scopes` (`all`: one PCA over all layers; `n`: one per n layers, a
//! block-diagonal basis) gets its own synthetic calibration. Prints one JSON object (and
//! writes it to `--json`).
//!
//! ```text
//! kvtc_restore_bench [--tokens 131072] [--layers 32] [--kv-heads 8] [--head-dim 128]
//!     [--ratios 16,64] [--scopes all,1] [--chunk 256] [--threads 16] [--reps 3] [--distinct 16]
//!     [--segment 16384] [--json out.json]
//! ```

use std::time::Instant;

use kvforge_kvtc::restore::{device_layout, synthetic_calibration, synthetic_container};
use kvforge_kvtc::{Entropy, Rope};
use kvforge_rt::kvtc::KvtcRestorer;
use kvforge_rt::Device;
use rayon::prelude::*;

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let tokens: usize = arg(&args, "--tokens", 131072);
    let layers: usize = arg(&args, "--layers", 32);
    let heads: usize = arg(&args, "--kv-heads", 8);
    let hd: usize = arg(&args, "--head-dim", 128);
    let chunk: usize = arg(&args, "--chunk", 256);
    let threads: usize = arg(&args, "--threads", 16);
    let reps: usize = arg(&args, "--reps", 3);
    let distinct: usize = arg(&args, "--distinct", 16);
    let ratios: Vec<f64> = arg(&args, "--ratios", "16,64".to_string()).split(',').map(|s| s.parse().expect("--ratios: numbers")).collect();
    let scopes: Vec<String> = arg(&args, "--scopes", "all,1".to_string()).split(',').map(str::to_string).collect();
    let segment: usize = arg(&args, "--segment", 16384);
    let json_path: Option<String> = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).cloned();
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global()?;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    let mut dev: Option<Device> = None;
    let mut rows = Vec::new();
    for scope in &scopes {
        let lpb: usize = if scope == "all" { 0 } else { scope.parse().expect("--scopes: all or a layer count") };
        let t0 = Instant::now();
        let cal = pool.install(|| synthetic_calibration(layers, heads, hd, Some(Rope { theta: 500000.0, dim: hd }), &ratios, lpb, 1));
        eprintln!("scope {scope}: synthetic calibration ({} blocks): {:.1} s", cal.k.blocks.len(), t0.elapsed().as_secs_f64());
        // the device is opened after the first host measurement, so the host part runs anywhere
        let mut gpu: Option<KvtcRestorer> = None;
        let p = cal.features();
        for (ri, &ratio) in ratios.iter().enumerate() {
            let t0 = Instant::now();
            let dc = pool.install(|| synthetic_container(&cal, ri, tokens, chunk, distinct, 7 + ri as u64));
            eprintln!("ratio {ratio}: synthetic container {:.1} s", t0.elapsed().as_secs_f64());
            // host entropy decode: compress the distinct chunks once, decode every chunk's payload
            let mut host = serde_json::Map::new();
            let raw_total: usize = dc.chunks.iter().map(|c| c.raw.len()).sum();
            for e in [Entropy::Deflate, Entropy::Zstd] {
                let stored: Vec<Vec<u8>> = pool.install(|| dc.chunks.iter().take(2 * distinct).collect::<Vec<_>>().par_iter().map(|c| e.compress(&c.raw)).collect());
                let lens: Vec<usize> = dc.chunks.iter().take(2 * distinct).map(|c| c.raw.len()).collect();
                let m = stored.len();
                let run = || {
                    pool.install(|| {
                        (0..dc.chunks.len())
                            .into_par_iter()
                            .map(|i| {
                                let j = if dc.chunks[i].raw.len() == lens[i % m] { i % m } else { usize::MAX };
                                if j == usize::MAX {
                                    dc.chunks[i].raw.len()
                                } else {
                                    e.decompress(&stored[j], lens[j]).expect("round trip").len()
                                }
                            })
                            .sum::<usize>()
                    })
                };
                run();
                let t = Instant::now();
                let bytes = run();
                let s = t.elapsed().as_secs_f64();
                let stored_total: usize = stored.iter().map(Vec::len).sum();
                let fp16_coded = 4 * p * dc.coded.len();
                host.insert(
                    e.name().into(),
                    serde_json::json!({
                        "seconds": s, "raw_bytes": bytes, "raw_gb_per_s": bytes as f64 / s / 1e9,
                        "fp16_equivalent_gb_per_s": fp16_coded as f64 / s / 1e9,
                        "entropy_gain": lens.iter().sum::<usize>() as f64 / stored_total as f64,
                    }),
                );
            }
            eprintln!("ratio {ratio}: host entropy decode {}", serde_json::Value::Object(host.clone()));
            if gpu.is_none() {
                if dev.is_none() {
                    dev = Some(Device::open(0)?);
                }
                let t0 = Instant::now();
                let r = KvtcRestorer::new(dev.as_ref().expect("opened above"), &cal)?;
                eprintln!("restorer (compile + upload): {:.1} s", t0.elapsed().as_secs_f64());
                gpu = Some(r);
            }
            let r = gpu.as_ref().expect("made above");
            // GPU restore: warm-up, then `reps` timed runs
            let (_, warm) = r.restore_timed(&dc)?;
            eprintln!("ratio {ratio}: warm-up kernels {:.1} ms", warm.kernels_ms);
            let mut times = Vec::new();
            for _ in 0..reps {
                let (kv, t) = r.restore_timed(&dc)?;
                drop(kv);
                times.push(t);
            }
            let best = times.iter().map(|t| t.kernels_ms).fold(f64::INFINITY, f64::min);
            let median = {
                let mut v: Vec<f64> = times.iter().map(|t| t.kernels_ms).collect();
                v.sort_by(|a, b| a.partial_cmp(b).unwrap());
                v[v.len() / 2]
            };
            let out_bytes = times[0].coded_output_bytes;
            let (lk, lv) = (device_layout(&cal.k, &cal.k.allocations[ri]), device_layout(&cal.v, &cal.v.allocations[ri]));
            let (ldc_k, ldc_v) = (lk.ldc, lv.ldc);
            let macs = lk.macs_per_token(&cal.k) + lv.macs_per_token(&cal.v);
            let flops = 2.0 * dc.coded.len() as f64 * macs as f64;
            // the whole load: save (entropy-code, in memory), then read + pipelined restore
            let mut load = serde_json::Map::new();
            for e in [Entropy::Zstd, Entropy::Deflate] {
                let t = Instant::now();
                let mut bytes = Vec::new();
                pool.install(|| kvforge_kvtc::write_container(&dc, e, &mut bytes))?;
                let save_s = t.elapsed().as_secs_f64();
                let mut walls = Vec::new();
                let mut reads = Vec::new();
                let mut last = None;
                for rep in 0..2 {
                    let t = Instant::now();
                    // on this thread (the CUDA context's); the decode runs on the global pool of `--threads`
                    let sc = kvforge_kvtc::read_container(&mut bytes.as_slice(), &cal)?;
                    let read_s = t.elapsed().as_secs_f64();
                    let (kv, pt) = r.restore_pipelined(&sc, segment)?;
                    let wall = t.elapsed().as_secs_f64();
                    let t_drop = Instant::now();
                    drop(kv);
                    drop(sc);
                    eprintln!("  load rep {rep}: read {read_s:.3} s, restore {:.3} s (setup {:.1} ms, pipeline {:.1} ms), drop {:.3} s", wall - read_s, pt.setup_ms, pt.wall_ms, t_drop.elapsed().as_secs_f64());
                    if rep > 0 {
                        reads.push(read_s);
                        walls.push(wall);
                        last = Some(pt);
                    }
                }
                let pt = last.expect("one timed rep");
                let wall = walls.iter().copied().fold(f64::INFINITY, f64::min);
                load.insert(
                    e.name().into(),
                    serde_json::json!({
                        "container_bytes": bytes.len(), "save_s": save_s, "load_wall_s": wall, "read_s": reads.iter().copied().fold(f64::INFINITY, f64::min),
                        "load_gb_per_s_fp16": 4.0 * p as f64 * tokens as f64 / wall / 1e9,
                        "pipeline": pt,
                        "stage_sum_s": (pt.decode_ms + pt.copy_ms + pt.kernels_ms) / 1e3,
                    }),
                );
                eprintln!("scope {scope} ratio {ratio} {}: save {save_s:.3} s, load {wall:.3} s end to end ({pt:?})", e.name());
            }
            let row = serde_json::json!({
                "scope": scope, "layers_per_basis": lpb, "blocks": cal.k.blocks.len(),
                "restore_gflop_per_token": 2.0 * macs as f64 / 1e9,
                "pipelined_load": load, "segment_tokens": segment,
                "ratio": ratio, "tokens": tokens, "coded_tokens": dc.coded.len(), "features": p,
                "components_k": cal.k.allocations[ri].used_components(), "components_v": cal.v.allocations[ri].used_components(),
                "padded_components": [ldc_k, ldc_v],
                "packed_bytes": raw_total,
                "gpu_kernels_ms_median": median, "gpu_kernels_ms_best": best,
                "gpu_upload_ms_median": times.iter().map(|t| t.upload_ms).sum::<f64>() / times.len() as f64,
                "fp16_output_bytes": out_bytes,
                "restore_gb_per_s": out_bytes as f64 / (median * 1e-3) / 1e9,
                "matmul_tflops": flops / (median * 1e-3) / 1e12,
                "host_entropy_decode": host, "host_threads": threads,
            });
            eprintln!("{row}");
            rows.push(row);
        }
    }
    let out = serde_json::json!({
        "what": "kvtc GPU restore (dequant + inverse projection + mean + RoPE, kernels only, CUDA events, after warm-up), host entropy decode, and the pipelined load end to end (read + decode + pinned upload + kernels, wall clock); synthetic calibrations (per basis scope) and chunks",
        "device": dev.as_ref().map(|d| d.info.name.clone()), "layers": layers, "kv_heads": heads, "head_dim": hd, "chunk_tokens": chunk, "rows": rows,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    if let Some(p) = json_path {
        std::fs::write(p, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}
