//! `kvforge precompile`: NVRTC over every variant, in parallel, with a progress bar.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

use kvforge_rt::jit::{self, CompileMode, PtxasReport};

#[derive(clap::Args)]
pub struct Args {
    /// Spec files (default: every spec under specs/).
    specs: Vec<PathBuf>,
    /// Target architectures.
    #[arg(long, value_delimiter = ',', default_value = "sm_90")]
    arch: Vec<String>,
    /// Fail on any NVRTC warning.
    #[arg(long)]
    strict: bool,
    /// Compile even when the cache has the kernel, and do not write the cache.
    #[arg(long)]
    no_cache: bool,
    /// Write ptxas register/spill counts of every kernel to this JSON file.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Worker threads (default: available cores).
    #[arg(long)]
    jobs: Option<usize>,
    /// Only the variants whose name contains this (e.g. `transcode`).
    #[arg(long)]
    only: Option<String>,
    /// Compile every decode format under each schedule of its table
    /// (`kvforge_gen::schedule::alternatives`), not only its default one.
    #[arg(long)]
    all_schedules: bool,
}

#[derive(serde::Serialize)]
pub struct Row {
    variant: String,
    arch: String,
    seconds: f64,
    ptxas: Option<PtxasReport>,
}

/// Renders and compiles `work` (spec, variant, arch) on `jobs` threads into the disk cache (as
/// `mode` says), advancing `bar` once per kernel: the rows of the kernels that compiled and one
/// line per kernel that did not.
pub fn compile_parallel(work: Vec<(&kvforge_spec::Spec, kvforge_spec::VariantId, String)>, mode: CompileMode, jobs: usize, bar: &indicatif::ProgressBar) -> (Vec<Row>, Vec<String>) {
    let queue = Mutex::new(work.into_iter());
    let rows = Mutex::new(Vec::new());
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|sc| {
        for _ in 0..jobs.max(1) {
            sc.spawn(|| loop {
                let Some((spec, v, arch)) = queue.lock().unwrap().next() else { break };
                bar.set_message(v.name());
                let res = kvforge_gen::render(spec, &v).map_err(anyhow::Error::from).and_then(|src| jit::compile(&v, &src, &arch, mode).map_err(anyhow::Error::from));
                match res {
                    Ok(c) => rows.lock().unwrap().push(Row { variant: v.to_string(), arch, seconds: c.seconds, ptxas: PtxasReport::parse(&c.log) }),
                    Err(e) => errors.lock().unwrap().push(format!("{v} ({arch}): {e}")),
                }
                bar.inc(1);
            });
        }
    });
    (rows.into_inner().unwrap(), errors.into_inner().unwrap())
}

/// Worker threads for NVRTC from a `--jobs` option: `jobs`, or every available core; 0 is an
/// input error.
pub fn jobs(jobs: Option<usize>) -> anyhow::Result<usize> {
    crate::exit::ensure(jobs != Some(0), || "--jobs 0: at least 1 worker".into())?;
    Ok(jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())))
}

pub fn run(root: &Path, a: Args) -> anyhow::Result<ExitCode> {
    let files = if a.specs.is_empty() { crate::spec_files(root)? } else { a.specs.clone() };
    let specs = crate::load_all(&files)?;
    for arch in &a.arch {
        crate::exit::ensure(arch.strip_prefix("sm_").is_some_and(|n| n.len() >= 2 && n.chars().all(|c| c.is_ascii_digit())), || format!("--arch {arch}: expected sm_<number>, e.g. sm_90"))?;
    }
    let jobs = jobs(a.jobs)?;
    if let Some(path) = &a.report {
        crate::exit::output_path("--report", path)?;
    }
    let mut work = Vec::new();
    for s in &specs {
        let mut variants = Vec::new();
        for v in kvforge_gen::variants(s).into_iter().chain(s.certify_variants()) {
            match &v.family {
                kvforge_spec::Family::Decode { tiers, gqa, .. } if a.all_schedules => {
                    variants.extend(kvforge_gen::schedule::alternatives(s, tiers, v.head_dim, *gqa).into_iter().map(|sc| v.with_schedule(sc)));
                }
                _ => variants.push(v),
            }
        }
        for v in variants.into_iter().filter(|v| a.only.as_ref().is_none_or(|o| v.name().contains(o.as_str()))) {
            for arch in &a.arch {
                work.push((s, v.clone(), arch.clone()));
            }
        }
    }
    crate::exit::ensure(!work.is_empty(), || format!("--only {}: no variant of the specs matches", a.only.as_deref().unwrap_or("")))?;
    jit::nvrtc_version()?;
    jit::cuda_include_dir()?;
    let mode = CompileMode { strict: a.strict, ptxas_report: a.report.is_some(), use_cache: !a.no_cache };
    let bar = indicatif::ProgressBar::new(work.len() as u64);
    bar.set_style(indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {elapsed} {msg}").unwrap());
    let start = Instant::now();
    let (rows, errors) = compile_parallel(work, mode, jobs, &bar);
    bar.finish_and_clear();
    let compiled: f64 = rows.iter().map(|r| r.seconds).sum();
    println!("{} kernels ok, {} failed, {:.1} s wall, {:.1} s of NVRTC time", rows.len(), errors.len(), start.elapsed().as_secs_f64(), compiled);
    if let Some(path) = &a.report {
        let mut sorted: Vec<&Row> = rows.iter().collect();
        sorted.sort_by(|x, y| (&x.variant, &x.arch).cmp(&(&y.variant, &y.arch)));
        std::fs::write(path, serde_json::to_string_pretty(&sorted)?)?;
        let spills = rows.iter().filter(|r| r.ptxas.as_ref().is_some_and(|p| p.spill_stores > 0)).count();
        let maxreg = rows.iter().filter_map(|r| r.ptxas.as_ref().map(|p| p.registers)).max().unwrap_or(0);
        println!("ptxas: max {maxreg} registers, {spills} kernels spill; report in {}", path.display());
    }
    for e in &errors {
        eprintln!("error: {e}");
    }
    Ok(if errors.is_empty() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
