//! Issue 7's two cost targets, measured in one process, JSON lines on stdout:
//!
//! * `rdr <spec>... --batch 1,8 [--steps N] [--every 64,256] [--sample 1,8]` (GPU): RDR through `RdrPipeline` on a `KvCache` at
//!   32K tokens × 8 kv heads ([`pipeline_loop`]): the decode thread's work per step against
//!   the decode kernels of a step.
//! * `rdkv specs/rdkv.toml [--reps N] [--pages-only] [--parallel-pages N]` (CPU): RDKV's allocation once after prefill at 32K tokens × 8 kv heads,
//!   the page controller kvforge runs (view with per-token masses + decide), and seed 002's
//!   per-token/per-channel `allocate_head` per kv head, sequential and over threads.
//! * `transcode <spec>... [--pages 1,4,16,256] [--reps 60] [--d 128]` (GPU): one transcode
//!   launch of N pages ([`transcode_cost`]) between CUDA events, per spec the first two ladder
//!   tiers with quantised keys (rdkv b8 → b4, spherical high → mid).
//! * `precompile <spec>...` (NVRTC, no GPU launch): the kernels the loop needs (head dim 128,
//!   gqa 4), compiled in parallel into the kernel cache, so the loop does not JIT them one by one.
//!
//!     cargo run --release -p kvforge-lab --example controller_cost -- rdr specs/rdkv.toml --batch 1,8
#[path = "../../kvforge-control/examples/common/rdkv_case.rs"]
mod rdkv_case;

use std::sync::Arc;
use std::time::Instant;

use kvforge_control::rdkv::{allocate_head, EPS_K_LLAMA31_8B, EPS_V_LLAMA31_8B};
use kvforge_control::runtime::Signal;
use kvforge_control::*;
use kvforge_lab::frontier::gpu::GpuSetup;
use kvforge_lab::frontier::pipeline_gpu::pipeline_loop;
use kvforge_lab::frontier::timing::median;
use kvforge_spec::{Family, Spec};
use rdkv_case::RdkvCase;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn arg<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|s| s.parse().ok())
}

/// `name a,b,c` as a list (None when `name` is absent).
fn list<T: std::str::FromStr>(args: &[String], name: &str) -> Option<Vec<T>> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
}

fn specs(args: &[String]) -> Result<Vec<Spec>, Error> {
    args.iter().filter(|a| a.ends_with(".toml")).map(|p| Spec::load(p.as_ref()).map_err(|e| Error::from(e.to_string()))).collect()
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("precompile") => precompile(&specs(&args)?),
        Some("rdr") => rdr(&args),
        Some("transcode") => transcode_cost(&args),
        Some("rdkv") => {
            let spec = specs(&args)?.into_iter().next().ok_or("rdkv: give the rdkv spec's path")?;
            let reps = arg(&args, "--reps").unwrap_or(7);
            match arg::<usize>(&args, "--layers") {
                Some(layers) => rdkv_layers(spec, reps, layers),
                None => rdkv(spec, reps, !args.iter().any(|a| a == "--pages-only"), arg(&args, "--parallel-pages")),
            }
        }
        _ => Err("usage: controller_cost (precompile|rdr) <spec.toml>... [--batch 1,8] [--steps N] [--every 64,256] [--sample 1,8] | rdkv <rdkv.toml> [--reps N] [--pages-only] [--parallel-pages N] [--layers N] | transcode <spec.toml>... [--pages 1,4,16,256] [--reps 60] [--d 128]".into()),
    }
}

fn precompile(specs: &[Spec]) -> Result<(), Error> {
    let mut work = Vec::new();
    for s in specs {
        for v in kvforge_gen::variants(s) {
            let wanted = matches!(v.head_dim, 0 | 128) && !matches!(&v.family, Family::Decode { gqa, .. } if *gqa != 4);
            if wanted {
                work.push((s, v));
            }
        }
    }
    let t = Instant::now();
    let queue = std::sync::Mutex::new(work.into_iter());
    let failed = std::sync::Mutex::new(Vec::new());
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|sc| {
        for _ in 0..jobs {
            sc.spawn(|| loop {
                let Some((s, v)) = queue.lock().unwrap().next() else { break };
                let r = kvforge_gen::render(s, &v).map_err(|e| e.to_string()).and_then(|src| kvforge_rt::jit::compile(&v, &src, "sm_90", kvforge_rt::jit::CompileMode::default()).map_err(|e| e.to_string()));
                if let Err(e) = r {
                    failed.lock().unwrap().push(format!("{v}: {e}"));
                }
            });
        }
    });
    let failed = failed.into_inner().unwrap();
    eprintln!("precompiled in {:.1} s, {} failures", t.elapsed().as_secs_f64(), failed.len());
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("\n").into())
    }
}

fn rdr(args: &[String]) -> Result<(), Error> {
    let batches: Vec<usize> = list(args, "--batch").unwrap_or(vec![1]);
    let steps: usize = arg(args, "--steps").unwrap_or(1024);
    // Absent: one case with the controller's default.
    let options = |name: &str| -> Vec<Option<usize>> { list(args, name).map_or(vec![None], |v| v.into_iter().map(Some).collect()) };
    let (everies, samples) = (options("--every"), options("--sample"));
    let dev = Arc::new(kvforge_rt::Device::open(0)?);
    for spec in specs(args)? {
        let table = DistortionTable::from_spec(&spec);
        let mut cases = Vec::new();
        for &b in &batches {
            for &e in &everies {
                cases.extend(samples.iter().map(|&s| (b, e, s)));
            }
        }
        for (batch, every, sample) in cases {
            let setup = GpuSetup { steps, every, sample, ..GpuSetup::default() };
            let t = Instant::now();
            let r = pipeline_loop(&dev, &spec, &table, &setup, batch)?;
            println!(
                "{{\"kind\":\"rdr_pipeline\",\"device\":{:?},\"spec\":{:?},\"batch\":{},\"context\":{},\"kv_heads\":{},\"gqa\":{},\"steps\":{},\"every\":{},\"sample\":{},\"budget_bytes_per_token\":{},\"decode_gpu_us\":{:.3},\"tracked_gpu_us\":{:.3},\"fold_gpu_us\":{:.3},\"decode_tracked_host_us\":{:.1},\"boundaries\":{},\"boundary_us\":{:.1},\"boundary_max_us\":{:.1},\"boundary_window_us\":{:.1},\"boundary_apply_us\":{:.1},\"waited_total_us\":{:.1},\"plan_us\":{:.1},\"decide_us\":{:.1},\"moves_per_plan\":{:.2},\"launches_per_plan\":{:.2},\"critical_per_step_us\":{:.3},\"fraction_of_decode_gpu\":{:.5},\"fraction_of_host_step\":{:.5},\"worst_budget_ratio\":{:.5},\"loop_seconds\":{:.1}}}",
                r.device, r.spec, r.batch, r.context, r.heads, r.gqa, r.steps, r.every, r.sample, r.budget_bytes_per_token, r.decode_gpu_us, r.tracked_gpu_us, r.fold_gpu_us, r.decode_tracked_host_us, r.boundaries, r.boundary_us, r.boundary_max_us, r.boundary_window_us, r.boundary_apply_us, r.waited_total_us, r.plan_us, r.decide_us, r.moves_per_plan, r.launches_per_plan, r.critical_per_step_us, r.fraction_of_decode_gpu, r.fraction_of_host_step, r.worst_budget_ratio, t.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

/// Σ of a page's token weights in four independent chains (a single chain of 64 dependent
/// additions per page was most of the view's time).
fn page_mass(m: &[f64]) -> f64 {
    let mut acc = [0.0f64; 4];
    let chunks = m.chunks_exact(4);
    let rest: f64 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + rest
}

/// Microseconds with one decimal, `null` when not measured.
fn json_us(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.1}")
    } else {
        "null".into()
    }
}

/// `parallel_pages`: the view's and the decision's heads go to the rayon pool from this many
/// pages on (default: the library's threshold for this host, `runtime::pool_pages`);
/// `--parallel-pages 0` always uses the pool, `--parallel-pages 1000000` never.
fn rdkv(spec: Spec, reps: usize, paper: bool, parallel_pages: Option<usize>) -> Result<(), Error> {
    let RdkvCase { d, heads, ctx, tok, cw, costs, limits, cache, pos, mut rdkv } = RdkvCase::new(&spec)?;
    let view_from = parallel_pages.unwrap_or_else(kvforge_control::runtime::pool_pages);
    rdkv.parallel_pages = view_from;
    let p = spec.page.tokens;
    let (mut tv, mut td, mut ts, mut tp) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut digest = 0u64;
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        // Kv heads on rayon's pool (`view_par`): a page's weight is the sum of its tokens'.
        let per_token = rdkv.proxy.uses_token_mass();
        let view = pos.view_par_from(&cache, costs.clone(), view_from, |key, len| {
            let m = &tok[key.head][key.first_token..key.first_token + len];
            Signal { mass: page_mass(m), token_mass: per_token.then(|| m.to_vec()), pinned: false }
        })?;
        tv.push(t.elapsed().as_secs_f64() * 1e6);
        let mut c = rdkv.clone();
        let t = Instant::now();
        let plan = c.decide(&view, &limits);
        td.push(t.elapsed().as_secs_f64() * 1e6);
        digest = plan.decisions.iter().fold(digest.wrapping_mul(31), |h, x| h.wrapping_mul(1_000_003) ^ ((x.page.head * 100_000 + x.page.index) as u64 * 16 + x.to_tier as u64));
        if !paper {
            continue;
        }
        // Seed 002's own allocation per kv head: 2 bits per element on average.
        let budget_bits = 2.0 * (ctx * d * 2) as f64;
        let t = Instant::now();
        let seq_alloc: Vec<_> = tok.iter().map(|w| allocate_head(w, &cw, &EPS_V_LLAMA31_8B, &EPS_K_LLAMA31_8B, budget_bits, d)).collect();
        ts.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let par_alloc: Vec<_> = std::thread::scope(|sc| {
            let hs: Vec<_> = tok.iter().map(|w| sc.spawn(|| allocate_head(w, &cw, &EPS_V_LLAMA31_8B, &EPS_K_LLAMA31_8B, budget_bits, d))).collect();
            hs.into_iter().map(|h| h.join().expect("allocation thread")).collect()
        });
        tp.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(seq_alloc, par_alloc);
    }
    println!(
        "{{\"kind\":\"rdkv_alloc\",\"context\":{ctx},\"kv_heads\":{heads},\"head_dim\":{d},\"pages\":{},\"reps\":{reps},\"cpu_threads\":{},\"page_view_us\":{:.1},\"page_decide_us\":{:.1},\"page_total_us\":{:.1},\"plan_digest\":\"{digest:016x}\",\"paper_allocate_heads_sequential_us\":{},\"paper_allocate_heads_threads_us\":{}}}",
        heads * ctx / p,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        median(&mut tv.clone()),
        median(&mut td.clone()),
        median(&mut tv) + median(&mut td),
        json_us(median(&mut ts)),
        json_us(median(&mut tp))
    );
    Ok(())
}

/// RDKV after the prefill of `layers` layers, all at once: each layer's view (its page masses
/// from its own token weights) and decision on the rayon pool, one layer per thread
/// (`RdkvController::decide_layers`). Layer 0 has the one-layer case's weights, so its plan
/// digest is the one `rdkv` prints; the others draw their own (distinct memory, as real layers).
fn rdkv_layers(spec: Spec, reps: usize, layers: usize) -> Result<(), Error> {
    use rand::{Rng, SeedableRng};
    use rayon::prelude::*;
    let RdkvCase { d, heads, ctx, tok, costs, limits, cache, pos, rdkv, .. } = RdkvCase::new(&spec)?;
    let per_layer: Vec<Vec<Vec<f64>>> = (0..layers.max(1))
        .map(|l| match l {
            0 => tok.clone(),
            _ => {
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1000 + l as u64);
                (0..heads).map(|_| (0..ctx).map(|_| rng.gen::<f64>().powf(6.0) * 4.0).collect()).collect()
            }
        })
        .collect();
    let (mut tv, mut td, mut tt) = (Vec::new(), Vec::new(), Vec::new());
    let (mut same, mut decisions) = (None, 0);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        let views: Vec<_> = per_layer
            .par_iter()
            .map(|tok| pos.view(&cache, costs.clone(), |key, len| Signal { mass: page_mass(&tok[key.head][key.first_token..key.first_token + len]), ..Default::default() }))
            .collect::<Result<_, _>>()?;
        let tv0 = t.elapsed().as_secs_f64() * 1e6;
        let t1 = Instant::now();
        let plans = rdkv.decide_layers(&views, &limits);
        td.push(t1.elapsed().as_secs_f64() * 1e6);
        tt.push(t.elapsed().as_secs_f64() * 1e6);
        tv.push(tv0);
        if same.is_none() {
            // Every layer's plan is the one `decide` makes for it alone.
            same = Some(views.iter().zip(&plans).all(|(v, p)| rdkv.clone().decide(v, &limits) == *p));
        }
        decisions = plans.iter().map(|p| p.decisions.len()).sum();
    }
    let total = median(&mut tt);
    println!(
        "{{\"kind\":\"rdkv_alloc_layers\",\"context\":{ctx},\"kv_heads\":{heads},\"head_dim\":{d},\"layers\":{layers},\"pages_per_layer\":{},\"reps\":{reps},\"cpu_threads\":{},\"views_us\":{:.1},\"decide_us\":{:.1},\"total_us\":{:.1},\"per_layer_us\":{:.1},\"decisions\":{decisions},\"plans_equal_one_layer_decide\":{}}}",
        heads * ctx / spec.page.tokens,
        rayon::current_num_threads(),
        median(&mut tv),
        median(&mut td),
        total,
        total / layers.max(1) as f64,
        same.unwrap_or(false)
    );
    Ok(())
}

/// One page move launch as the RDR controller issues it: a `retier_pages` of N full pages of
/// one kv head from tier `from` into tier `to` (one transcode launch), timed between CUDA
/// events on the cache's stream — the argument upload, the kernel, and the error-flag
/// download that ends the call. Each repetition codes fresh pages (a new sequence appended in
/// `from`, outside the timed span); 3 warm-up launches load the kernels. Only `KvCache`'s
/// public page moves are used, so the same file times main's one-CTA-per-page kernels too.
/// Kernel time alone: run it under `ncu --kernel-name regex:transcode`.
fn transcode_cost(args: &[String]) -> Result<(), Error> {
    use cudarc::driver::sys::CUevent_flags;
    use kvforge_rt::{CacheConfig, KvCache};
    use kvforge_spec::KeyScheme;
    let pages: Vec<usize> = list(args, "--pages").unwrap_or(vec![1, 4, 16, 256]);
    let reps: usize = arg(args, "--reps").unwrap_or(60);
    let d: usize = arg(args, "--d").unwrap_or(128);
    let dev = Arc::new(kvforge_rt::Device::open(0)?);
    let data = |n: usize, seed: u32| -> Vec<f32> { (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed * 97)) % 2000) as f32 / 1000.0 - 1.0).collect() };
    for s in specs(args)? {
        let quantised: Vec<_> = s.tiers.iter().filter(|t| matches!(t.key, KeyScheme::Int { .. } | KeyScheme::Spherical { .. } | KeyScheme::Mixed { .. })).collect();
        let [from, to] = [quantised.first(), quantised.get(1)].map(|t| t.map(|t| t.id));
        let (Some(from), Some(to)) = (from, to) else { return Err(format!("{}: fewer than two tiers with quantised keys", s.name).into()) };
        let p = s.page.tokens;
        for &n in &pages {
            let cfg = CacheConfig::new(&s, d, s.geometry.gqa[0], 1, 1, (n + 1) * p).target(from);
            let mut c = KvCache::new(dev.clone(), s.clone(), cfg)?;
            if let KeyScheme::Spherical { group, .. } = s.tiers[to as usize].key {
                // Keys in [-1, 1): group radii up to sqrt(group) stay below code 255.
                c.set_radius_scales(to, &vec![(group as f32).sqrt() / 250.0; d / group])?;
            }
            // n full pages and one token in the tail.
            let (k, v) = (data((n * p + 1) * d, 1), data((n * p + 1) * d, 2));
            let moves: Vec<(usize, usize, u8)> = (0..n).map(|i| (0, i, to)).collect();
            let (mut gpu, mut host) = (Vec::with_capacity(reps), Vec::with_capacity(reps));
            for rep in 0..reps + 3 {
                let a = c.add_sequence();
                c.append(a, &k, &v)?;
                dev.stream.synchronize()?;
                let e0 = dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                let e1 = dev.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                let t0 = Instant::now();
                e0.record(&dev.stream)?;
                let launches = c.retier_pages(a, &moves)?;
                e1.record(&dev.stream)?;
                e1.synchronize()?;
                let wall = t0.elapsed().as_secs_f64() * 1e6;
                if launches != 1 {
                    return Err(format!("{}: {n} moves took {launches} launches", s.name).into());
                }
                if rep >= 3 {
                    gpu.push(f64::from(e0.elapsed_ms(&e1)?) * 1e3);
                    host.push(wall);
                }
                c.remove_sequence(a)?;
            }
            gpu.sort_by(f64::total_cmp);
            let pct = |q: f64| gpu[((gpu.len() - 1) as f64 * q).round() as usize];
            println!(
                "{{\"kind\":\"transcode_launch\",\"device\":{:?},\"spec\":{:?},\"from\":{:?},\"to\":{:?},\"head_dim\":{d},\"pages\":{n},\"reps\":{reps},\"event_us_median\":{:.2},\"event_us_p10\":{:.2},\"event_us_p90\":{:.2},\"host_us_median\":{:.2}}}",
                dev.info.name,
                s.name,
                s.tiers[from as usize].name,
                s.tiers[to as usize].name,
                median(&mut gpu.clone()),
                pct(0.1),
                pct(0.9),
                median(&mut host)
            );
        }
    }
    Ok(())
}
