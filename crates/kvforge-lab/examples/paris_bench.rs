//! ParisKV decode-step timing on the GPU: one layer's retrieval + attention (`kvforge_rt::paris`)
//! at a given retrieval-region length, split into vote / top-k / rerank / fetch / attend by
//! CUDA events (median of `--iters` steps after 3 warm-up steps).
//!
//! ```text
//! cargo build --release -p kvforge-lab --example paris_bench
//! LD_LIBRARY_PATH=/usr/local/cuda/lib64 .bin/paris_bench --lengths 131072,1048576 --batch 1 --out $OUT/paris-bench.json
//! .bin/paris_bench --lengths 1048576 --rank sum --out $OUT/paris-bench-sum.json   # the summed-query rerank
//! .bin/paris_bench --lengths 131072,1048576 --layout subspace4 --out $OUT/paris-bench-subspace4.json   # the seed's 112 B summaries
//! ```
//!
//! `--layout` picks the GPU summaries (`kvforge_paris::SummaryLayout`): `whole64` (default,
//! `D/2` bytes: 64 B per key and kv head at head dim 128) or `subspace4` (the seed's 112 B); the schedule is the
//! layout's default (`SummaryLayout::schedule`: ρ 0.30 from 64K keys for `whole64`).
//!
//! `--rank` picks the per-kv-head rerank (`kvforge_paris::Rank`): `max` (default, as the
//! library's: candidates ranked by the largest of the group's head estimates, `rerank_hmax`) or
//! `sum` (the summed query's estimate); the JSON's `rank` and `retrieval` name it, and its
//! `median_us.rerank` is the rerank kernel of that mode.
//!
//! Keys are Gaussian rows around a shared mean direction (fp16), values reuse the keys (the
//! timing does not depend on them); the dense region (sinks + local) has `--dense` rows. The
//! keys cycle through `--pool` distinct 16K-row chunks, so that building a large batch is
//! bound by the appends, not by the random numbers. `--batch` takes a list: one index per
//! (batch, length), each row of the JSON with its throughput (sequences × steps per second of
//! this layer) and the GPU bytes per sequence (to size the largest batch of a GPU budget).

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use half::f16;
use kvforge_paris::{ParisConfig, Rank, SummaryLayout};
use kvforge_rt::paris::{ParisGeometry, ParisIndex, StepTimes};
use kvforge_rt::testing::Xorshift;
use kvforge_rt::Device;
use serde_json::json;

#[derive(Parser)]
struct Args {
    #[arg(long, value_delimiter = ',', default_value = "131072,1048576")]
    lengths: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long, default_value_t = 4)]
    gqa: usize,
    /// One retrieval per query head (default: one per kv head for its group's summed query).
    #[arg(long)]
    per_query_head: bool,
    /// Rerank of a kv head's shared retrieval: `max` (the group's largest head estimate) or
    /// `sum` (the summed query's estimate). Ignored with --per-query-head.
    #[arg(long, default_value = "max", value_parser = parse_rank)]
    rank: Rank,
    /// GPU summaries: `whole64` (`D/2` bytes: whole-vector codes, one 8-bit weight per key) or
    /// `subspace4` (the seed's, 112 B per key at head dim 128).
    #[arg(long, default_value = "whole64", value_parser = parse_layout)]
    layout: SummaryLayout,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    #[arg(long, default_value_t = 100)]
    k: usize,
    /// Dense rows per (sequence, kv head): sinks + local window.
    #[arg(long, default_value_t = 320)]
    dense: usize,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Candidate ratio β of every schedule point instead of the default schedule's (ρ kept).
    #[arg(long)]
    beta: Option<f64>,
    /// Pinned host budget, GiB.
    #[arg(long, default_value_t = 96)]
    host_gib: usize,
    /// Distinct key chunks the build cycles through.
    #[arg(long, default_value_t = 8)]
    pool: usize,
    /// Chunk counts of the pipelined step to time (those ≤ the batch).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    chunks: Vec<usize>,
    /// Fetch grid caps to time, one run each (0: the runtime's default).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    fetch_ctas: Vec<usize>,
    /// Top-k paths to time, one run each: auto (the runtime's choice), on (split over CTAs per
    /// row), off (one CTA per row).
    #[arg(long, value_delimiter = ',', default_value = "auto", value_parser = ["auto", "on", "off"])]
    split_topk: Vec<String>,
    /// The bucket top-C's forms to time, one run each: auto (the runtime's choice), wide (64 keys
    /// a thread), narrow (16).
    #[arg(long, value_delimiter = ',', default_value = "auto", value_parser = ["auto", "wide", "narrow"])]
    bucket: Vec<String>,
    #[arg(long)]
    out: Option<PathBuf>,
}

fn parse_layout(s: &str) -> Result<SummaryLayout, String> {
    SummaryLayout::parse(s).ok_or_else(|| format!("--layout {s}: subspace4 or whole64"))
}

fn parse_rank(s: &str) -> Result<Rank, String> {
    Rank::parse(s).ok_or_else(|| format!("--rank {s}: sum or max"))
}

fn fill(buf: &mut [f16], salt: u64, d: usize) {
    let mut rng = Xorshift::new(salt);
    for (i, x) in buf.iter_mut().enumerate() {
        let s = rng.next_u64();
        // Sum of two uniforms, centred: cheap, roughly bell-shaped.
        let u = ((s >> 40) as f32 + ((s >> 16) & 0xff_ffff) as f32) / (1u64 << 24) as f32 - 1.0;
        *x = f16::from_f32(1.5 * ((i % d) as f32 * 0.37).sin() + 1.7 * u);
    }
}

/// `step`'s results for `iters` fresh queries after 3 warm-up steps (queries `[..]` refilled per step).
fn timed<T>(iters: usize, q: &mut [f16], d: usize, mut step: impl FnMut(&[f16]) -> Result<T, Box<dyn std::error::Error>>) -> Result<Vec<T>, Box<dyn std::error::Error>> {
    let mut out = Vec::with_capacity(iters);
    for it in 0..iters + 3 {
        fill(q, 1000 + it as u64, d);
        let t = step(q)?;
        if it >= 3 {
            out.push(t);
        }
    }
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let dev = Device::open(0)?;
    let cfg = ParisConfig::default_for(a.head_dim);
    a.layout.validate(&cfg)?;
    let mut schedule = a.layout.schedule();
    if let Some(beta) = a.beta {
        schedule.points.iter_mut().for_each(|p| p.beta = beta);
        schedule.validate()?;
    }
    let d = a.head_dim;
    let mut runs = Vec::new();
    for &batch in &a.batch {
        for &n in &a.lengths {
            let plan = schedule.plan(n, a.k);
            let geo = ParisGeometry {
                batch,
                kv_heads: a.kv_heads,
                gqa: a.gqa,
                per_query_head: a.per_query_head,
                rank: a.rank,
                layout: a.layout,
                capacity: n,
                dense_capacity: a.dense,
                max_candidates: plan.candidates,
                max_k: a.k.next_power_of_two().min(1024),
                host_budget_bytes: a.host_gib << 30,
            };
            let t0 = Instant::now();
            let mut ix = ParisIndex::new(&dev, cfg, geo)?;
            let chunk = 16384;
            let pool: Vec<Vec<f16>> = (0..a.pool.max(1))
                .map(|i| {
                    let mut b = vec![f16::ZERO; chunk * a.kv_heads * d];
                    fill(&mut b, i as u64 + 1, d);
                    b
                })
                .collect();
            let mut next = 0;
            for s in 0..batch {
                let mut done = 0;
                while done < n {
                    let rows = chunk.min(n - done);
                    let b = &pool[next % pool.len()][..rows * a.kv_heads * d];
                    next += 1;
                    ix.append(s, b, b)?;
                    done += rows;
                }
                let mut dense = vec![f16::ZERO; a.dense * a.kv_heads * d];
                fill(&mut dense, 7 + s as u64, d);
                ix.set_dense(s, &dense, &dense)?;
            }
            let build_s = t0.elapsed().as_secs_f64();
            let mut q = vec![f16::ZERO; batch * a.kv_heads * a.gqa * d];
            let mut modes = Vec::new();
            for f in &a.fetch_ctas {
                for s in &a.split_topk {
                    modes.extend(a.bucket.iter().map(|b| (f, s, b)));
                }
            }
            for (&fetch_ctas, split, bucket) in modes {
                ix.set_fetch_ctas((fetch_ctas > 0).then_some(fetch_ctas));
                ix.set_wide_bucket(match bucket.as_str() {
                    "wide" => Some(true),
                    "narrow" => Some(false),
                    _ => None,
                });
                ix.set_split_topk(match split.as_str() {
                    "on" => Some(true),
                    "off" => Some(false),
                    _ => None,
                });
                let times = timed(a.iters, &mut q, d, |q| Ok(ix.step_timed(q, a.k, &schedule)?.1))?;
                // The pipelined step (fetch + attend of one span beside the retrieval of the next)
                // for each chunk count that splits this batch.
                let mut pipelined = serde_json::Map::new();
                for &chunks in a.chunks.iter().filter(|&&c| c <= batch) {
                    let us = timed(a.iters, &mut q, d, |q| Ok(ix.step_pipelined_timed(q, a.k, &schedule, chunks)?.1))?;
                    pipelined.insert(chunks.to_string(), json!(median(us)));
                }
                let med = |f: fn(&StepTimes) -> f64| median(times.iter().map(f).collect());
                let total = med(|t| t.vote_us + t.topk_us + t.rerank_us + t.fetch_us + t.attend_us);
                let total_fused = med(|t| t.vote_us + t.topk_us + t.rerank_us + t.attend_fused_us);
                let mode = match (a.per_query_head, geo.ranks_by_group_max()) {
                    (true, _) => "per query head",
                    (false, true) => "per kv head (summed group query's vote, ranked by the largest head estimate)",
                    (false, false) => "per kv head (summed group query)",
                };
                let v = json!({
                    "n": n, "batch": batch, "kv_heads": a.kv_heads, "gqa": a.gqa, "retrieval": mode, "rank": a.rank.name(), "layout": a.layout.name(), "head_dim": d, "k": a.k, "dense_rows": a.dense,
                    "plan": plan, "config": cfg,
                    "gpu_bytes_per_token_per_kv_head": ix.device_bytes_per_key(), "fp16_kv_bytes_per_token_per_kv_head": 4 * d,
                    "gpu_bytes_per_sequence": ix.device_bytes_per_sequence(), "fp16_kv_bytes_per_sequence": 4 * d * a.kv_heads * n,
                    "build_s": build_s, "fetch_ctas": fetch_ctas, "split_topk": split, "bucket": bucket,
                    "median_us": {"vote": med(|t| t.vote_us), "topk": med(|t| t.topk_us), "rerank": med(|t| t.rerank_us), "fetch": med(|t| t.fetch_us), "attend": med(|t| t.attend_us), "total": total,
                                  "attend_fused": med(|t| t.attend_fused_us), "total_fused": total_fused},
                    "sequences_per_s": batch as f64 / total * 1e6,
                    "pipelined_total_us_by_chunks": pipelined, "default_chunks": ix.default_chunks(),
                    "sequences_per_s_pipelined": pipelined.values().filter_map(|v| v.as_f64()).fold(f64::INFINITY, f64::min).recip() * batch as f64 * 1e6,
                });
                eprintln!("batch {batch} n {n} fetch_ctas {fetch_ctas} split_topk {split} bucket {bucket} ({mode}): {} pipelined {}", v["median_us"], v["pipelined_total_us_by_chunks"]);
                runs.push(v);
            }
        }
    }
    let out = json!({
        "what": "ParisKV one-layer decode step on the GPU (kvforge_rt::paris), CUDA events per phase, median",
        "device": dev.info.name,
        "runs": runs,
    });
    kvforge_lab::emit_json(a.out.as_deref(), &out)?;
    Ok(())
}
