//! `kvforge bench`: decode of every shipped single-tier configuration over contexts × batches,
//! with the measured copy bandwidth as the ceiling. Prints a table and writes JSON.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kvforge_lab::bench::{bench_tier, copy_gbps, BenchRow};

use crate::exit::ensure;

#[derive(clap::Args)]
pub struct Args {
    /// `spec:tier` pairs (default: every non-tail, non-drop tier of every shipped spec).
    #[arg(long, value_delimiter = ',')]
    tiers: Vec<String>,
    /// Ladders to time besides: `spec:tier+tier+...` (full pages cycle through the tiers, e.g.
    /// `rdkv:b8+b4+b2`), for the mixed-tier bandwidth against single-tier sequences.
    #[arg(long, value_delimiter = ',')]
    ladders: Vec<String>,
    #[arg(long, value_delimiter = ',', default_value = "4096,16384,32768,131072")]
    contexts: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    batches: Vec<usize>,
    #[arg(long, default_value_t = 20)]
    runs: usize,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    #[arg(long, default_value_t = 32)]
    q_heads: usize,
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Skip cases whose cache would need more device memory than this many GiB.
    #[arg(long, default_value_t = 60)]
    max_gib: usize,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Certified decode (seed 004) instead: step time against plain quantised decode and the
    /// ladder's rung frequencies, on `spec:tier` (default certified:q8k4v).
    #[arg(long)]
    certified: bool,
    /// Decode steps per certified case.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Certified: failed ranking/boundary checks are only reported, not escalated to rung 3.
    #[arg(long)]
    rank_report_only: bool,
    /// Without a GPU, print "skipped: no GPU" and exit 0 (default: exit 3).
    #[arg(long)]
    allow_no_gpu: bool,
}

/// Argument checks shared by both modes, before any work.
fn check_args(a: &Args) -> anyhow::Result<()> {
    ensure(!a.contexts.is_empty() && a.contexts.iter().all(|&c| c > 0), || format!("--contexts {:?}: every context must be at least 1 token", a.contexts))?;
    ensure(!a.batches.is_empty() && a.batches.iter().all(|&b| b > 0), || format!("--batches {:?}: every batch must be at least 1", a.batches))?;
    ensure(a.runs > 0, || "--runs 0: time at least one run".into())?;
    ensure(a.steps > 0, || "--steps 0: run at least one decode step".into())?;
    ensure([64, 128, 256].contains(&a.head_dim), || format!("--head-dim {}: valid 64, 128, 256", a.head_dim))?;
    ensure(a.kv_heads > 0 && a.q_heads.is_multiple_of(a.kv_heads) && a.q_heads > 0, || format!("--q-heads {} must be a positive multiple of --kv-heads {}", a.q_heads, a.kv_heads))?;
    if let Some(path) = &a.json {
        crate::exit::output_path("--json", path)?;
    }
    Ok(())
}

#[derive(serde::Serialize)]
struct Report<'a> {
    device: String,
    date: String,
    copy_gbps: f64,
    versions: serde_json::Value,
    results: &'a [BenchRow],
}

pub fn run(root: &Path, a: Args) -> anyhow::Result<ExitCode> {
    check_args(&a)?;
    if a.certified {
        return certified(root, a);
    }
    let specs = crate::load_all(&crate::spec_files(root)?)?;
    let mut todo = Vec::new();
    for s in &specs {
        for t in s.ladder().iter().filter(|t| !t.is_drop()) {
            let key = format!("{}:{}", s.name, t.name);
            if (a.tiers.is_empty() && a.ladders.is_empty()) || a.tiers.contains(&key) {
                todo.push((s, vec![t.id]));
            }
        }
    }
    for t in &a.tiers {
        ensure(specs.iter().any(|s| s.ladder().iter().any(|x| !x.is_drop() && format!("{}:{}", s.name, x.name) == *t)), || format!("--tiers {t}: no servable `spec:tier` of that name"))?;
    }
    for l in &a.ladders {
        let (spec_name, names) = l.split_once(':').ok_or_else(|| crate::exit::bad_input(format!("--ladders takes spec:tier+tier+..., got `{l}`")))?;
        let s = specs.iter().find(|s| s.name == spec_name).ok_or_else(|| crate::exit::bad_input(format!("--ladders `{l}`: no spec named `{spec_name}`")))?;
        let ids = names
            .split('+')
            .map(|n| {
                s.tier(n)
                    .filter(|t| !t.is_drop() && t.id != kvforge_spec::TAIL_TIER)
                    .map(|t| t.id)
                    .ok_or_else(|| crate::exit::bad_input(format!("--ladders `{l}`: spec `{spec_name}` has no servable tier `{n}`")))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        todo.push((s, ids));
    }
    if a.kv_heads == 0 || !a.q_heads.is_multiple_of(a.kv_heads) {
        return Err(kvforge_rt::RtError::BadInput(format!("q_heads {} must be a multiple of kv_heads {}", a.q_heads, a.kv_heads)).into());
    }
    let gqa = a.q_heads / a.kv_heads;
    let Some(dev) = super::selftest::device_or_exit(a.allow_no_gpu)? else { return Ok(ExitCode::SUCCESS) };
    let mut flush = dev.stream.alloc_zeros::<u8>(256 << 20)?;
    let copy = copy_gbps(&dev, &mut flush)?;
    println!("{}: device-to-device copy {:.0} GB/s", dev.info.name, copy);
    let total = todo.len() * a.contexts.len() * a.batches.len();
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {elapsed} {msg}").unwrap());
    let mut rows = Vec::new();
    println!("{:<22} {:>7} {:>5} {:>6} {:>10} {:>10} {:>8} {:>6}", "tier", "context", "batch", "splits", "time_us", "MB read", "GB/s", "of copy");
    for (s, ts) in todo {
        let name = format!("{}:{}", s.name, ts.iter().map(|&t| s.tiers[t as usize].name.as_str()).collect::<Vec<_>>().join("+"));
        bar.set_message(name.clone());
        let r = bench_tier(&dev, s, &ts, a.head_dim, gqa, a.kv_heads, &a.contexts, &a.batches, a.runs, copy, a.max_gib << 30, |r| {
            bar.inc(1);
            bar.suspend(|| println!("{:<22} {:>7} {:>5} {:>6} {:>10.1} {:>10.2} {:>8.0} {:>6.2}", name, r.context, r.batch, r.splits, r.time_us, r.bytes_read as f64 / 1e6, r.gbps, r.bw_fraction));
        })?;
        rows.extend(r);
    }
    bar.finish_and_clear();
    if let Some(path) = &a.json {
        let versions = serde_json::json!({
            "kvforge": env!("CARGO_PKG_VERSION"),
            "generator": kvforge_spec::GENERATOR_VERSION,
            "nvrtc": kvforge_rt::jit::nvrtc_version().unwrap_or_default(),
        });
        let rep = Report { device: dev.info.name.clone(), date: super::selftest::today(), copy_gbps: copy, versions, results: &rows };
        std::fs::write(path, serde_json::to_string_pretty(&rep)?)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `kvforge bench --certified`: rung frequencies and step time of certified decode.
fn certified(root: &Path, a: Args) -> anyhow::Result<ExitCode> {
    let key = a.tiers.first().cloned().unwrap_or_else(|| "certified:q8k4v".into());
    let (spec_name, tier_name) = key.split_once(':').ok_or_else(|| crate::exit::bad_input(format!("--tiers takes spec:tier, got `{key}`")))?;
    let spec = kvforge_spec::Spec::load(&root.join("specs").join(format!("{spec_name}.toml")))?;
    let tier = spec.tier(tier_name).ok_or_else(|| crate::exit::bad_input(format!("--tiers {key}: spec `{spec_name}` has no tier `{tier_name}`")))?.id;
    if a.kv_heads == 0 || !a.q_heads.is_multiple_of(a.kv_heads) {
        return Err(kvforge_rt::RtError::BadInput(format!("q_heads {} must be a multiple of kv_heads {}", a.q_heads, a.kv_heads)).into());
    }
    let Some(dev) = super::selftest::device_or_exit(a.allow_no_gpu)? else { return Ok(ExitCode::SUCCESS) };
    let bar = indicatif::ProgressBar::new((a.contexts.len() * a.batches.len() * 2) as u64);
    println!(
        "{:<8} {:>5} {:<12} {:>9} {:>9} {:>8} {:>9} {:>8} {:>9} {:>30} {:>8} {:>8} {:>6} {:>7} {:>18} {:>6} {:>8} {:>9} {:>5}",
        "context",
        "batch",
        "attention",
        "plain_us",
        "gpu_us",
        "overhead",
        "host_us",
        "overhead",
        "hcopy_us",
        "device us p1/select/p2/bound",
        "plain_dev",
        "dev_ovh",
        "check",
        "rankchk",
        "rungs 0/1/2/3/4",
        "rank",
        "promoted",
        "max bound",
        "det"
    );
    let rows = kvforge_lab::bench::bench_certified(&dev, &spec, tier, a.head_dim, a.q_heads / a.kv_heads, a.kv_heads, &a.contexts, &a.batches, a.steps, !a.rank_report_only, |r| {
        bar.inc(1);
        let rungs = r.rungs.iter().map(|x| x.to_string()).collect::<Vec<_>>().join("/");
        let k = &r.kernel_us;
        let stages = format!("{:.0}/{:.1}/{:.0}/{:.1}", k.phase1_us, k.select_us, k.phase2_us, k.bound_us);
        bar.suspend(|| {
            println!(
                "{:<8} {:>5} {:<12} {:>9.0} {:>9.0} {:>7.0}% {:>9.0} {:>7.0}% {:>9.0} {:>30} {:>8.1} {:>7.0}% {:>5.1}% {:>6.2}% {:>18} {:>6} {:>7.1}% {:>9.2e} {:>5}",
                r.context,
                r.batch,
                r.attention,
                r.plain_us,
                r.certified_us,
                100.0 * r.overhead,
                r.host_path_us,
                100.0 * r.host_path_overhead,
                r.host_copy_us,
                stages,
                r.plain_kernel_us,
                100.0 * r.device_overhead,
                100.0 * r.check_share,
                100.0 * r.rank_check_share,
                rungs,
                r.rank_triggers,
                100.0 * r.promoted_fraction,
                r.max_bound,
                r.detections
            )
        });
    })?;
    bar.finish_and_clear();
    if let Some(path) = &a.json {
        let rep = serde_json::json!({"device": dev.info.name, "date": super::selftest::today(), "tier": key, "timing": "host API wall time per step, median; kernel_us: CUDA-event device time of the device path's stages, median; plain_kernel_us: plain decode kernels, CUDA events, L2 flushed, median of 20; device_overhead = stage sum / plain_kernel_us - 1; rank_check_us: certificate kernel with the ranking and boundary checks (rank depth 1) minus without (0); host_copy_us: host path with page_in Copy (async DMA per run of consecutive pages into a device buffer) vs host_path_us (UVA)", "rank_escalate": !a.rank_report_only, "results": rows});
        std::fs::write(path, serde_json::to_string_pretty(&rep)?)?;
    }
    Ok(ExitCode::SUCCESS)
}
