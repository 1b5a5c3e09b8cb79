//! ParisKV inside the main cache (`kvforge_rt::retrieval::RetrievalCache`, issue 27): one
//! layer's decode step over a GPU region in any kvforge tier plus a retrieval region of
//! `--lengths` tokens (median of `--iters` steps after 3 warm-up ones): host wall time of the
//! decode and its device time (CUDA events around its GPU work, `StepWall`), and the append of
//! the step's token (with the move to the index when the window fills).
//!
//! ```text
//! cargo build --release -p kvforge-lab --example retrieval_bench
//! LD_LIBRARY_PATH=/usr/local/cuda/lib64 .bin/retrieval_bench --spec rotated.toml --tier r3 --lengths 131072,1048576 --out $OUT/retrieval-bench.json
//! ```
//!
//! The sequence is built as a decode would see it: a prefill appended in `--chunk`-token
//! pieces through [`RetrievalCache::append`] (each moves its pages past the window to the
//! index), then one token per step for `--iters + 3` steps, each followed by a decode (so the
//! step includes the appends' moves when the window fills). Keys and values are fp16-exact
//! pseudo-random rows around a shared direction (the timing does not depend on them).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use kvforge_paris::{ParisConfig, Rank, SummaryLayout};
use kvforge_rt::paris::ParisGeometry;
use kvforge_rt::retrieval::{RegionPolicy, RetrievalCache};
use kvforge_rt::testing::{shipped_spec, Xorshift};
use kvforge_rt::{CacheConfig, Device};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Spec file under specs/ of the GPU region's cache (it needs a drop tier).
    #[arg(long, default_value = "rotated.toml")]
    spec: String,
    /// The cache's target tier (full pages of the window are coded into it).
    #[arg(long, default_value = "r3")]
    tier: String,
    /// The cache's own dense pages: sinks and newest full pages kept fp16 (0,0: none).
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    window: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "131072,1048576")]
    lengths: Vec<usize>,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    #[arg(long, default_value_t = 4)]
    gqa: usize,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    #[arg(long, default_value_t = 100)]
    k: usize,
    /// Region policy: sink pages, local pages, update pages.
    #[arg(long, value_delimiter = ',', default_value = "1,4,1")]
    policy: Vec<usize>,
    #[arg(long, default_value_t = 16384)]
    chunk: usize,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Pinned host budget, GiB.
    #[arg(long, default_value_t = 96)]
    host_gib: usize,
    #[arg(long)]
    out: Option<PathBuf>,
}

fn rows(n: usize, d: usize, salt: u64) -> Vec<f32> {
    let mut rng = Xorshift::new(salt);
    (0..n)
        .map(|i| {
            let s = rng.next_u64();
            let u = ((s >> 40) as f32 + ((s >> 16) & 0xff_ffff) as f32) / (1u64 << 24) as f32 - 1.0;
            half::f16::from_f32(1.5 * ((i % d) as f32 * 0.37).sin() + 1.7 * u).to_f32()
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let [sink, local, update] = a.policy[..] else { return Err("--policy takes sink,local,update pages".into()) };
    let policy = RegionPolicy { sink_pages: sink, local_pages: local, update_pages: update };
    let dev = Arc::new(Device::open(0)?);
    let (d, hkv) = (a.head_dim, a.kv_heads);
    let row = hkv * d;
    let mut runs = Vec::new();
    for &n in &a.lengths {
        let spec = shipped_spec(&a.spec);
        let tier = spec.tier(&a.tier).ok_or_else(|| format!("--tier {}: not a tier of {}", a.tier, a.spec))?.id;
        let p = spec.page.tokens;
        let mut cfg = CacheConfig::new(&spec, d, a.gqa, hkv, 1, RetrievalCache::gpu_tokens(policy, p).max(a.chunk + (sink + local + update + 2) * p)).target(tier);
        if let [s, r] = a.window[..] {
            cfg = cfg.window(s, r, 1);
        }
        let cfg_paris = ParisConfig::default_for(d);
        let layout = SummaryLayout::for_config(&cfg_paris);
        let schedule = layout.schedule();
        let plan = schedule.plan(n, a.k);
        let geo = ParisGeometry {
            batch: 1,
            kv_heads: hkv,
            gqa: a.gqa,
            per_query_head: false,
            rank: Rank::default(),
            layout,
            capacity: n + a.iters + 3,
            dense_capacity: 1,
            max_candidates: plan.candidates,
            max_k: a.k.next_power_of_two().min(1024),
            host_budget_bytes: a.host_gib << 30,
        };
        let t0 = Instant::now();
        let mut rc = RetrievalCache::new(dev.clone(), spec, cfg, cfg_paris, geo, policy)?;
        let bar = ProgressBar::new(n as u64).with_style(ProgressStyle::with_template("{msg} {bar:40} {pos}/{len} tokens ({eta})")?);
        bar.set_message(format!("prefill {n}"));
        let mut done = 0;
        while done < n {
            let m = a.chunk.min(n - done);
            let k = rows(m * row, d, 1 + (done / a.chunk % 8) as u64);
            rc.append(0, &k, &k)?;
            done += m;
            bar.set_position(done as u64);
        }
        bar.finish_and_clear();
        let build_s = t0.elapsed().as_secs_f64();
        let (mut total, mut wall_us, mut device_us, mut append) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for it in 0..a.iters + 3 {
            let kv = rows(row, d, 100 + it as u64);
            let ta = Instant::now();
            rc.append(0, &kv, &kv)?;
            let append_us = ta.elapsed().as_secs_f64() * 1e6;
            let q = rows(hkv * a.gqa * d, d, 1000 + it as u64);
            let t = Instant::now();
            let (_, wall) = rc.decode_timed(&q, a.k)?;
            let us = t.elapsed().as_secs_f64() * 1e6;
            if it >= 3 {
                total.push(us);
                wall_us.push(wall.wall_us);
                device_us.push(wall.device_us);
                append.push(append_us);
            }
        }
        let v = json!({
            "n": n, "spec": a.spec, "tier": a.tier, "window": a.window, "policy": {"sink_pages": sink, "local_pages": local, "update_pages": update},
            "kv_heads": hkv, "gqa": a.gqa, "head_dim": d, "k": a.k, "layout": layout.name(), "plan": plan,
            "retrieval_len": rc.retrieval_len(0)?, "gpu_pages_per_kv_head": rc.cache().page_count(0, 0)?,
            "gpu_region_tiers": rc.cache().page_tiers(0, 0)?.iter().map(|(t, _)| rc.cache().spec().tiers[*t as usize].name.clone()).collect::<Vec<_>>(),
            "build_s": build_s,
            "median_us": {"decode_step": median(total), "decode_wall": median(wall_us), "decode_device": median(device_us), "append_one_token": median(append)},
        });
        eprintln!("n {n}: {}", v["median_us"]);
        runs.push(v);
    }
    let out = json!({
        "what": "ParisKV inside the main cache (kvforge_rt::retrieval): one layer's decode step, host wall time per part, median",
        "device": dev.info.name,
        "runs": runs,
    });
    kvforge_lab::emit_json(a.out.as_deref(), &out)?;
    Ok(())
}
