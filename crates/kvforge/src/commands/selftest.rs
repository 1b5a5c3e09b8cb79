//! `kvforge selftest`: every decode variant on the GPU against the f64 reference.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use kvforge_lab::selftest::{run_variant, VariantResult};

use crate::exit::{ensure, CliError};

#[derive(clap::Args)]
pub struct Args {
    /// Spec files (default: every spec under specs/).
    specs: Vec<PathBuf>,
    /// Only variants whose name contains this.
    #[arg(long)]
    filter: Option<String>,
    /// Add 32K and 128K contexts to the gqa-4 variants.
    #[arg(long)]
    long: bool,
    /// Write results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Date for the JSON (default: today, UTC, from the system clock).
    #[arg(long)]
    date: Option<String>,
    /// Without a GPU, print "skipped: no GPU" and exit 0 (default: exit 3, so that
    /// `kvforge selftest && deploy` does not deploy untested kernels).
    #[arg(long)]
    allow_no_gpu: bool,
    /// NVRTC worker threads for the kernels missing from the cache, compiled before the first
    /// variant runs (default: every core).
    #[arg(long)]
    jobs: Option<usize>,
}

/// The device, or without one exit 3 (a [`CliError::NoGpu`]), or with `allow` `None` after
/// printing the skip.
pub fn device_or_exit(allow: bool) -> anyhow::Result<Option<Arc<kvforge_rt::Device>>> {
    match kvforge_rt::Device::open(0) {
        Ok(d) => Ok(Some(Arc::new(d))),
        Err(e) if allow => {
            println!("skipped: no GPU ({e})");
            Ok(None)
        }
        Err(e) => Err(CliError::NoGpu(format!("{e} (pass --allow-no-gpu to exit 0 instead)")).into()),
    }
}

/// Compiles, on `jobs` threads, the kernels the selftest of `work` loads and the disk cache
/// lacks: its decode variants and the specs' other kernels (append, transcode) at their head
/// dims, which every decode variant's cache uses. Without it each kernel would compile on first
/// use, one at a time (a cold run of two specs takes minutes). A kernel that fails here is
/// reported by its variant below, where it is loaded again.
fn warm_cache(specs: &[kvforge_spec::Spec], work: &[(&kvforge_spec::Spec, kvforge_spec::VariantId)], arch: &str, jobs: usize) {
    let mut todo: Vec<_> = work.iter().map(|(s, v)| (*s, v.clone(), arch.to_string())).collect();
    for s in specs {
        // Only the head dims under test: a filter such as `d128` should not compile the rest.
        let dims: std::collections::HashSet<usize> = work.iter().filter(|(w, _)| w.name == s.name).map(|(_, v)| v.head_dim).collect();
        todo.extend(kvforge_gen::variants(s).into_iter().filter(|v| v.kind() != "decode" && dims.contains(&v.head_dim)).map(|v| (s, v, arch.to_string())));
    }
    let bar = indicatif::ProgressBar::new(todo.len() as u64);
    bar.set_style(indicatif::ProgressStyle::with_template("compiling {bar:40} {pos}/{len} {elapsed} {msg}").unwrap());
    let (_, errors) = super::precompile::compile_parallel(todo, kvforge_rt::jit::CompileMode::default(), jobs, &bar);
    bar.finish_and_clear();
    if !errors.is_empty() {
        eprintln!("{} kernels did not compile; their variants fail below", errors.len());
    }
}

#[derive(serde::Serialize)]
struct Report<'a> {
    device: String,
    date: String,
    results: &'a [VariantResult],
}

pub fn today() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = secs.div_euclid(86400) + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

pub fn run(root: &Path, a: Args) -> anyhow::Result<ExitCode> {
    let files = if a.specs.is_empty() { crate::spec_files(root)? } else { a.specs.clone() };
    let specs = crate::load_all(&files)?;
    if let Some(path) = &a.json {
        crate::exit::output_path("--json", path)?;
    }
    let mut work = Vec::new();
    for s in &specs {
        for v in kvforge_gen::variants(s).into_iter().filter(|v| v.kind() == "decode") {
            if a.filter.as_ref().is_none_or(|f| v.name().contains(f.as_str())) {
                work.push((s, v));
            }
        }
    }
    ensure(!work.is_empty(), || format!("--filter {}: no decode variant of the specs matches", a.filter.as_deref().unwrap_or("")))?;
    let jobs = super::precompile::jobs(a.jobs)?;
    let Some(dev) = device_or_exit(a.allow_no_gpu)? else { return Ok(ExitCode::SUCCESS) };
    warm_cache(&specs, &work, &dev.info.arch(), jobs);
    let bar = indicatif::ProgressBar::new(work.len() as u64);
    bar.set_style(indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {elapsed} {msg}").unwrap());
    let mut results = Vec::new();
    for (s, v) in work {
        bar.set_message(v.name());
        let long = a.long && v.gqa() == Some(4) && v.head_dim == 128;
        let r = match run_variant(&dev, s, &v, long) {
            Ok(r) => r,
            Err(e) => VariantResult { spec: s.name.clone(), variant: v.name(), cases: 0, max_abs_err: f64::NAN, max_rel_err: f64::NAN, tolerance: 0.0, status: "fail", launched: vec![format!("error: {e}")] },
        };
        bar.println(format!("{:<10} {:<72} {:>3} {:>10.3e} {:>10.3e} {:>10.3e} {}", r.spec, r.variant, r.cases, r.max_abs_err, r.max_rel_err, r.tolerance, r.status.to_uppercase()));
        if r.status != "pass" {
            bar.println(format!("           launched: {:?}", r.launched));
        }
        results.push(r);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let failed = results.iter().filter(|r| r.status != "pass").count();
    println!("{:<10} {:<72} {:>3} {:>10} {:>10} {:>10} status", "spec", "variant", "n", "max_abs", "max_rel", "tol");
    for r in &results {
        println!("{:<10} {:<72} {:>3} {:>10.3e} {:>10.3e} {:>10.3e} {}", r.spec, r.variant, r.cases, r.max_abs_err, r.max_rel_err, r.tolerance, r.status.to_uppercase());
    }
    println!("{} variants, {} passed, {} failed on {}", results.len(), results.len() - failed, failed, dev.info.name);
    if let Some(path) = &a.json {
        let rep = Report { device: dev.info.name.clone(), date: a.date.clone().unwrap_or_else(today), results: &results };
        std::fs::write(path, serde_json::to_string_pretty(&rep)?)?;
    }
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
