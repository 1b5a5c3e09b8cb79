//! `kvforge frontier`: the quality-vs-bytes frontier of the tier controllers and their cost
//! per decode step (issue 7 "Bench"). The work is in `kvforge_lab::frontier`; this file
//! parses arguments, prints tables and writes JSON.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kvforge_lab::frontier::gpu::{gpu_loop, GpuSetup};
use kvforge_lab::frontier::timing::{time_controllers, ControllerTime, TimingSetup};
use kvforge_lab::frontier::{default_methods, summarise, sweep, Scenario, Setup, Summary, Tables, World};
use kvforge_spec::{KeyScheme, Spec};
use serde_json::{json, Value};

use crate::exit::ensure;

#[derive(clap::Args)]
pub struct Args {
    /// Tokens per kv head of the synthetic sequences.
    #[arg(long, value_delimiter = ',', default_value = "4096,16384")]
    contexts: Vec<usize>,
    #[arg(long, default_value_t = 4)]
    kv_heads: usize,
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    seeds: Vec<u64>,
    /// Budgets as fractions of the fp16 bytes of the sequence.
    #[arg(long, value_delimiter = ',', default_value = "0.02,0.03,0.05,0.075,0.1,0.15,0.2,0.25,0.3,0.4,0.5")]
    budgets: Vec<f64>,
    /// Background keys near the spherical `high` codebook's codewords (`codebook`, the keys a
    /// trained codebook fits) or isotropic Gaussian (`isotropic`, the spherical tiers' worst case).
    #[arg(long, default_value = "codebook")]
    keys: String,
    /// Skip the CPU controller timing.
    #[arg(long)]
    no_timing: bool,
    #[arg(long, default_value_t = 32768)]
    timing_context: usize,
    #[arg(long, default_value_t = 8)]
    timing_kv_heads: usize,
    /// Bench JSON with kvforge decode times (batch 1 at the timing context) to compare against.
    #[arg(long, default_value = "benches/results/h100-2026-11-23.json")]
    decode_json: PathBuf,
    /// Also run the controller loop on the GPU (`KvCache`, decode_tracked, retier) and time it.
    #[arg(long)]
    gpu: bool,
    /// Decode steps of the GPU loop.
    #[arg(long, default_value_t = 1024)]
    gpu_steps: usize,
    /// RDR periods (decode steps per decision) of the GPU loop; 0: the controller's default.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    gpu_every: Vec<usize>,
    /// Skip the CPU frontier (with --gpu: only the GPU loop).
    #[arg(long)]
    no_frontier: bool,
    /// RDR's tracker window on the CPU frontier: decode queries per invocation.
    #[arg(long, default_value_t = 16)]
    rdr_window: usize,
    /// RDR's signal sampling on the CPU frontier: one decode query in N is observed (the
    /// runtime tracks one decode step in `RdrController::sample`).
    #[arg(long, default_value_t = 1)]
    rdr_sample: usize,
    /// Decode queries per kv head whose page masses feed RDR (CPU frontier).
    #[arg(long, default_value_t = 32)]
    decode_queries: usize,
    #[arg(long)]
    json: Option<PathBuf>,
}

fn load(root: &Path, name: &str) -> anyhow::Result<Spec> {
    Ok(Spec::load(&root.join("specs").join(format!("{name}.toml")))?)
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|x| x.trim().to_string()))
        .unwrap_or_else(|| "unknown CPU".into())
}

fn summary_json(s: &Summary) -> Value {
    let feasible = s.seeds > s.infeasible_seeds;
    json!({
        "method": s.method.name(),
        "spec": s.method.spec(),
        "uniform": s.method.is_uniform(),
        "context": s.context,
        "kv_heads": s.heads,
        "budget_fraction": s.budget_fraction,
        "matched": s.matched,
        "seeds": s.seeds,
        "infeasible_seeds": s.infeasible_seeds,
        "feasible": feasible,
        "bytes_per_token": if feasible { json!(s.bytes_per_token) } else { Value::Null },
        "max_budget_use": if feasible { json!(s.max_budget_use) } else { Value::Null },
        "rel_error_mean": if feasible { json!(s.errors.mean()) } else { Value::Null },
        "rel_error_p90": if feasible { json!(s.errors.p90()) } else { Value::Null },
        "rel_error_pooled": if feasible { json!(s.errors.pooled()) } else { Value::Null },
        "rows": s.errors.per_row.len(),
        "drops_mean": s.drops,
        "dropped_needle_pages": s.dropped_needle_pages,
        "decide_us_mean": s.decide_us,
    })
}

/// Decode time of `tier` (e.g. `rdkv:b16`) at batch 1 and `context` from a bench JSON.
fn decode_time(path: &Path, tier: &str, context: usize) -> Option<(f64, String)> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    let row = v["results"].as_array()?.iter().find(|r| r["system"] == "kvforge" && r["tier"] == tier && r["batch"] == 1 && r["context"] == context)?;
    Some((row["time_us"].as_f64()?, v["device"].as_str().unwrap_or("?").to_string()))
}

fn timing_json(t: &ControllerTime, decode: Option<(f64, String)>, source: &Path) -> Value {
    let cmp = decode.map(|(us, dev)| {
        json!({
            "decode_step_us": us,
            "decode_device": dev,
            "decode_source": source.display().to_string(),
            "decode_what": format!("kvforge {}:{} decode kernel, batch 1 × {} tokens, {} kv heads (CUDA events, L2 flushed, median)", t.spec, if t.spec == "rdkv" { "b16" } else { "high" }, t.context, t.heads),
            "rdr_per_step_fraction": t.rdr_per_step_us / us,
            "rdr_decision_only_per_step_fraction": (t.rdr_steady_view_us + t.rdr_steady_decide_us) / t.every as f64 / us,
        })
    });
    json!({
        "spec": t.spec, "context": t.context, "kv_heads": t.heads, "pages": t.pages, "every": t.every,
        "budget_bytes_per_token": t.budget_bytes_per_token,
        "rdr_first_view_us": t.rdr_first_view_us, "rdr_first_decide_us": t.rdr_first_decide_us, "rdr_first_moves": t.rdr_first_moves,
        "rdr_steady_view_us": t.rdr_steady_view_us, "rdr_steady_decide_us": t.rdr_steady_decide_us, "rdr_steady_apply_sim_us": t.rdr_steady_apply_us,
        "rdr_steady_moves_per_invocation": t.rdr_steady_moves,
        "roll_us_per_invocation": t.roll_us,
        "rdr_per_step_us": t.rdr_per_step_us,
        "rdkv_view_us": t.rdkv_view_us, "rdkv_decide_us": t.rdkv_decide_us,
        "vs_decode": cmp,
    })
}

/// Every argument, before any work: a value that cannot give a meaningful table is a bad
/// input (exit 2) naming the flag, not a NaN table or a panic.
fn check_args(a: &Args, page_tokens: usize) -> anyhow::Result<()> {
    let min = kvforge_lab::synth::MIN_FULL_PAGES * page_tokens;
    ensure(!a.contexts.is_empty(), || "--contexts: list at least one context".into())?;
    for &c in &a.contexts {
        ensure(c >= min, || format!("--contexts {c}: a synthetic sequence needs at least {min} tokens ({} pages of {page_tokens})", kvforge_lab::synth::MIN_FULL_PAGES))?;
    }
    ensure(a.kv_heads > 0, || "--kv-heads 0: at least 1 kv head".into())?;
    ensure(!a.seeds.is_empty(), || "--seeds: list at least one seed".into())?;
    ensure(!a.budgets.is_empty(), || "--budgets: list at least one budget".into())?;
    for &b in &a.budgets {
        ensure(b.is_finite() && b > 0.0 && b <= 1.0, || format!("--budgets {b}: a budget is a fraction of the fp16 bytes, in (0, 1]"))?;
    }
    ensure(["codebook", "isotropic"].contains(&a.keys.as_str()), || format!("--keys {}: expected `codebook` or `isotropic`", a.keys))?;
    ensure(a.rdr_window > 0, || "--rdr-window 0: at least 1 decode query per invocation".into())?;
    ensure(a.rdr_sample > 0, || "--rdr-sample 0: observe at least one query in N (N >= 1)".into())?;
    ensure(a.decode_queries > 0, || "--decode-queries 0: at least 1 decode query per kv head".into())?;
    if !a.no_timing || a.gpu {
        ensure(a.timing_context >= min, || format!("--timing-context {}: at least {min} tokens ({} pages of {page_tokens})", a.timing_context, kvforge_lab::synth::MIN_FULL_PAGES))?;
        ensure(a.timing_kv_heads > 0, || "--timing-kv-heads 0: at least 1 kv head".into())?;
    }
    if a.gpu {
        ensure(a.gpu_steps > 0, || "--gpu-steps 0: at least 1 decode step".into())?;
        ensure(!a.gpu_every.is_empty(), || "--gpu-every: list at least one period (0: the controller's default)".into())?;
    }
    ensure(!(a.no_frontier && a.no_timing && !a.gpu), || "--no-frontier --no-timing without --gpu: nothing to run".into())?;
    if let Some(path) = &a.json {
        crate::exit::output_path("--json", path)?;
    }
    Ok(())
}

pub fn run(root: &Path, a: Args) -> anyhow::Result<ExitCode> {
    let rdkv = load(root, "rdkv")?;
    let sph = load(root, "spherical")?;
    check_args(&a, rdkv.page.tokens.max(sph.page.tokens))?;
    // The GPU first: without one, exit 3 before any table (the timing table compares against
    // a stored decode figure of another machine).
    let dev = if a.gpu {
        match kvforge_rt::Device::open(0) {
            Ok(d) => Some(std::sync::Arc::new(d)),
            Err(e) => return Err(crate::exit::CliError::NoGpu(format!("--gpu: {e}")).into()),
        }
    } else {
        None
    };
    let mut tables = Tables::default();
    let mut out = json!({
        "device": format!("cpu: {} ({} threads)", cpu_name(), std::thread::available_parallelism().map_or(1, |n| n.get())),
        "date": super::selftest::today(),
        "budgets": a.budgets,
    });
    if !a.no_frontier {
        let codebook = match (&a.keys[..], &sph.tiers[1].key) {
            ("codebook", KeyScheme::Spherical { codebook, .. }) => Some(codebook.clone()),
            ("isotropic", _) => None,
            (k, _) => return Err(crate::exit::bad_input(format!("--keys {k}: the spherical spec's first tier has no codebook; use `isotropic`"))),
        };
        let setup = Setup { window: a.rdr_window, sample: a.rdr_sample, ..Setup::default() };
        let methods = default_methods();
        let mut points = Vec::new();
        let mut nmse = Vec::new();
        for &ctx in &a.contexts {
            for &seed in &a.seeds {
                let mut sc = Scenario::new(ctx, a.kv_heads, seed);
                sc.decode_queries = a.decode_queries;
                sc.key_codebook = codebook.clone();
                let t0 = std::time::Instant::now();
                let wr = World::build(&rdkv, &sc);
                let ws = World::build(&sph, &sc);
                let built = t0.elapsed().as_secs_f64();
                let t0 = std::time::Instant::now();
                points.extend(sweep(&[&wr, &ws], &methods, &a.budgets, &setup, &mut tables));
                eprintln!("context {ctx} seed {seed}: coded in {built:.1} s, swept in {:.1} s", t0.elapsed().as_secs_f64());
                if seed == a.seeds[0] {
                    for w in [&wr, &ws] {
                        for (t, (k, v)) in w.spec.tiers.iter().zip(w.tier_nmse()) {
                            if t.id > 0 && !t.is_drop() {
                                nmse.push(json!({"spec": w.spec.name, "tier": t.name, "context": ctx, "k_nmse": k, "v_nmse": v}));
                            }
                        }
                    }
                }
            }
        }
        let sums = summarise(&points);
        println!("{:<34} {:>6} {:>7} {:>9} {:>8} {:>10} {:>10} {:>6}  matched", "method", "ctx", "budget", "B/tok/hd", "use", "err mean", "err p90", "drops");
        for s in &sums {
            if s.seeds == s.infeasible_seeds {
                println!("{:<34} {:>6} {:>6.1}% {:>9} {:>8} {:>10} {:>10} {:>6}  (protected pages alone exceed the budget)", s.method.name(), s.context, 100.0 * s.budget_fraction, "-", "-", "-", "-", "-");
                continue;
            }
            println!(
                "{:<34} {:>6} {:>6.1}% {:>9.1} {:>8.3} {:>10.3e} {:>10.3e} {:>6.1}  {}",
                s.method.name(),
                s.context,
                100.0 * s.budget_fraction,
                s.bytes_per_token,
                s.max_budget_use,
                s.errors.mean(),
                s.errors.p90(),
                s.drops,
                s.matched.clone().unwrap_or_default()
            );
        }
        out["setup"] = json!({
            "kv_heads": a.kv_heads, "head_dim": 128, "gqa": 4, "page_tokens": rdkv.page.tokens, "seeds": a.seeds, "contexts": a.contexts,
            "keys": a.keys,
            "head_shapes": kvforge_lab::synth::HeadShape::mix(a.kv_heads).iter().map(|h| json!({"gamma": h.gamma, "heavy": h.heavy, "kappa": h.kappa, "needles": h.needles})).collect::<Vec<_>>(),
            "queries_per_head": {"prefill": 16, "decode": a.decode_queries, "test": 4},
            "protection": {"sink_tokens": setup.protection.sink_tokens, "recent_tokens": setup.protection.recent_tokens, "floor_tier": setup.protection.floor},
            "rdr_signal": format!("decode page masses over first-tier pages, tracker window {} queries (one in {} observed), EMA beta {}", setup.window, setup.sample, setup.beta),
            "rdkv_signal": "prefill column sums per token (16 observation queries per kv head)",
            "budget_reference": "fp16 page slots of the whole sequence (514 B per token per kv head at d 128)",
            "error": "per test query row: ||o - o_hat|| / ||o|| vs exact f64 attention over the original keys and values; mean and p90 over rows of all seeds and heads",
        });
        out["tier_nmse"] = json!(nmse);
        out["results"] = json!(sums.iter().map(summary_json).collect::<Vec<_>>());
    }
    if !a.no_timing {
        let ts = TimingSetup { context: a.timing_context, heads: a.timing_kv_heads, ..Default::default() };
        let mut tj = Vec::new();
        for (spec, tier) in [(&rdkv, "rdkv:b16"), (&sph, "spherical:high")] {
            let table = tables.get(spec);
            let t = time_controllers(spec, &table, &ts);
            let dec = decode_time(&root.join(&a.decode_json), tier, ts.context);
            println!(
                "[{}] {} tokens × {} kv heads ({} pages), budget {:.0} B/token/head: RDR first decision {:.0} us ({} moves; view {:.0} us); steady roll {:.0} + view {:.0} + decide {:.0} + apply {:.0} us every {} steps ({:.1} moves) → {:.2} us per decode step (host){}; RDKV after prefill: view {} decide {}",
                t.spec, t.context, t.heads, t.pages, t.budget_bytes_per_token, t.rdr_first_decide_us, t.rdr_first_moves, t.rdr_first_view_us, t.roll_us, t.rdr_steady_view_us, t.rdr_steady_decide_us, t.rdr_steady_apply_us, t.every, t.rdr_steady_moves, t.rdr_per_step_us,
                dec.as_ref().map_or(String::new(), |(us, dev)| format!(" = {:.1}% of the {us:.1} us {tier} decode step on {dev}", 100.0 * t.rdr_per_step_us / us)),
                t.rdkv_view_us.map_or("-".into(), |x| format!("{x:.0} us")),
                t.rdkv_decide_us.map_or("-".into(), |x| format!("{x:.0} us")),
            );
            tj.push(timing_json(&t, dec, &a.decode_json));
        }
        out["controller_time"] = json!({
            "what": "CPU, std::time::Instant, medians; per decode step = (window roll + view + decide + SimCache apply) / every; the per-step window fold runs on the GPU and GPU transcode time is not included (see --gpu)",
            "timing_context": ts.context, "kv_heads": ts.heads, "budget_fraction": ts.budget_fraction, "invocations": ts.invocations, "reps": ts.reps,
            "specs": tj,
        });
    }
    if let Some(dev) = dev {
        let mut gj = Vec::new();
        for ((spec, frac, tier), &every) in [(&rdkv, 0.25, "rdkv:b16"), (&sph, 0.45, "spherical:high")].into_iter().flat_map(|x| a.gpu_every.iter().map(move |e| (x, e))) {
            let table = tables.get(spec);
            let gs = GpuSetup { context: a.timing_context, heads: a.timing_kv_heads, steps: a.gpu_steps, budget_fraction: frac, every: (every > 0).then_some(every), ..Default::default() };
            let g = gpu_loop(&dev, spec, &table, &gs).map_err(|e| anyhow::anyhow!("GPU loop on `{}`: {e}", spec.name))?;
            let bench = decode_time(&root.join(&a.decode_json), tier, gs.context);
            println!(
                "[gpu {}] {}: {} tokens × {} kv heads, {} steps: decode kernels {:.1} us, with the window fold {:.1} us: fold {:.2} us on the GPU ({} of {} steps fused into the combine; standalone fold kernel {:.2} us; launch +{:.1} us host); host API decode {:.1} us, decode_tracked {:.1} us; first decision {:.0} us + apply {:.0} us ({} re-codes, {} drops); steady roll {:.0} + view {:.0} + decide {:.0} + apply {:.0} us every {} steps ({:.1} moves) → controller {:.2} us per step = {:.2}% of the decode kernels ({:.2}% of the host-API step)",
                g.device, g.spec, g.context, g.heads, g.steps, g.decode_gpu_us, g.tracked_gpu_us, g.fold_gpu_us, g.fused_steps, g.steps, g.standalone_fold_gpu_us, g.fold_launch_us, g.decode_us, g.decode_tracked_us, g.first_decide_us, g.first_apply_us, g.first_moves, g.first_drops, g.roll_us, g.view_us, g.decide_us, g.apply_us, g.every, g.moves_per_invocation, g.controller_per_step_us, 100.0 * g.fraction_of_decode, 100.0 * g.fraction_of_host_decode
            );
            gj.push(json!({
                "device": g.device, "spec": g.spec, "context": g.context, "kv_heads": g.heads, "gqa": g.gqa, "steps": g.steps, "every": g.every,
                "budget_fraction": frac, "budget_bytes_per_token": g.budget_bytes_per_token, "resident_bytes_per_token": g.resident_bytes_per_token,
                "decode_us": g.decode_us, "decode_tracked_us": g.decode_tracked_us, "decode_gpu_us": g.decode_gpu_us, "tracked_gpu_us": g.tracked_gpu_us, "fold_gpu_us": g.fold_gpu_us, "standalone_fold_gpu_us": g.standalone_fold_gpu_us, "fused_steps": g.fused_steps, "fold_launch_us": g.fold_launch_us,
                "first_decide_us": g.first_decide_us, "first_apply_us": g.first_apply_us, "first_moves": g.first_moves, "first_drops": g.first_drops, "first_launches": g.first_launches,
                "roll_us": g.roll_us, "view_us": g.view_us, "decide_us": g.decide_us, "apply_us": g.apply_us, "moves_per_invocation": g.moves_per_invocation,
                "controller_per_step_us": g.controller_per_step_us, "fraction_of_decode_gpu": g.fraction_of_decode, "fraction_of_host_decode": g.fraction_of_host_decode,
                "bench_decode_kernel_us": bench.map(|b| b.0),
                "what": "decode_gpu (no fold) / tracked_gpu (with the fold, inside the split-K combine on fused steps): CUDA events, L2 flushed before each; fold_gpu = median over steps of tracked − decode; standalone_fold_gpu: the separate mass_window kernel; the rest wall time (Instant) of synchronous calls: host-API decode includes planning and transfers, roll = window download + reset + EMA, apply = retier_pages (one transcode launch per tier pair) + stream sync; controller per step = max(fold_gpu, 0) + (roll + view + decide + apply) / every",
            }));
        }
        out["gpu_controller_time"] = json!(gj);
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&out)? + "\n")?;
        println!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}
