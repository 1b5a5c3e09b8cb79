//! The kvforge CLI: thin glue over the library crates. Exit codes: [`exit`] (0 ok, 1 failure,
//! 2 bad input, 3 no GPU), the same for every command.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvforge_spec::{Spec, SpecError};

mod commands;
mod exit;

#[derive(Parser)]
#[command(name = "kvforge", version, about = "Compressed-KV-cache decode attention: specs → CUDA kernels → runtime", after_help = exit::HELP)]
struct Cli {
    /// Repository root holding specs/ and kernels-generated/.
    #[arg(long, global = true, default_value = ".")]
    root: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Render every spec under specs/ into kernels-generated/.
    Generate,
    /// Validate spec files (exit 2 with the located error); without files, fail (exit 1) if
    /// kernels-generated/ differs from what the specs under specs/ render.
    Check {
        /// Spec files to validate (default: the freshness check of kernels-generated/).
        specs: Vec<PathBuf>,
    },
    /// Print every variant with bytes per token per head of its tiers.
    List {
        /// Only these spec files (default: every spec under specs/).
        specs: Vec<PathBuf>,
    },
    /// Compile every variant with NVRTC (no GPU needed) and fill the kernel cache.
    Precompile(commands::precompile::Args),
    /// Run every decode variant on the GPU against the CPU f64 reference.
    Selftest(commands::selftest::Args),
    /// Time decode of every tier on the GPU (prints a table, writes JSON).
    Bench(commands::bench::Args),
    /// Quality-vs-bytes frontier of the tier controllers on synthetic attention, and their
    /// cost per decode step (CPU; `--gpu` also on a GPU cache).
    Frontier(commands::frontier::Args),
    /// Report the CUDA device and libraries.
    Probe,
    /// Spherical codebooks.
    Codebook {
        #[command(subcommand)]
        cmd: commands::codebook::Cmd,
    },
    /// kvtc: PCA and per-ratio bit allocations from captured K/V (a calibration file).
    Calibrate(commands::kvtc::CalibrateArgs),
    /// kvtc: compress a K/V cache dump into a .kvtc container.
    Pack(commands::kvtc::PackArgs),
    /// kvtc: restore a .kvtc container into a K/V cache dump.
    Unpack(commands::kvtc::UnpackArgs),
}

pub(crate) fn spec_files(root: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let dir = root.join("specs");
    let rd = std::fs::read_dir(&dir).map_err(|e| kvforge_rt::RtError::BadInput(format!("cannot read {}: {e}; run from the repository root or pass --root", dir.display())))?;
    let mut v: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|e| e == "toml")).collect();
    v.sort();
    Ok(v)
}

/// Loads and validates spec files: the field rules (`Spec::load`) and the device limits of
/// their schedule (`kvforge_gen::limits`), so that every command refuses the same specs.
pub(crate) fn load_all(files: &[PathBuf]) -> Result<Vec<Spec>, SpecError> {
    files
        .iter()
        .map(|f| {
            let spec = Spec::load(f)?;
            kvforge_gen::limits::check(&spec)?;
            Ok(spec)
        })
        .collect()
}

/// Logs on stderr, filtered by `KVFORGE_LOG` (else `RUST_LOG`), a `tracing` filter such as
/// `debug` or `kvforge_rt::jit=debug` (plan, kernel compile with cache hit/miss, launches);
/// warnings only when neither is set.
fn init_logs() {
    let filter = ["KVFORGE_LOG", "RUST_LOG"].iter().find_map(|v| std::env::var(v).ok().filter(|s| !s.trim().is_empty())).unwrap_or_else(|| "warn".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("warning: ignoring the log filter `{filter}`: {e}");
        tracing_subscriber::EnvFilter::new("warn")
    });
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
}

fn main() -> ExitCode {
    init_logs();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            match e.downcast_ref::<SpecError>() {
                Some(se) => eprintln!("error: {se}"),
                None => eprintln!("error: {e:#}"),
            }
            exit::exit(exit::code_of(&e))
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let out_dir = cli.root.join("kernels-generated");
    match cli.cmd {
        Cmd::Generate => {
            let specs = load_all(&spec_files(&cli.root)?)?;
            let files = kvforge_gen::render_all(&specs)?;
            let n = kvforge_gen::write(&files, &out_dir)?;
            let lines: usize = files.iter().map(|f| f.contents.lines().count()).sum();
            println!("{} specs, {} files ({} lines), {} written to {}", specs.len(), files.len(), lines, n, out_dir.display());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Check { specs } if !specs.is_empty() => {
            for spec in load_all(&specs)? {
                let kernels = kvforge_gen::variants(&spec).len() + spec.certify_variants().len();
                println!("{}: ok (spec `{}`, {} tiers, {kernels} kernels)", spec.path, spec.name, spec.ladder().len());
            }
            Ok(exit::exit(exit::OK))
        }
        Cmd::Check { .. } => {
            let specs = load_all(&spec_files(&cli.root)?)?;
            let files = kvforge_gen::render_all(&specs)?;
            let s = kvforge_gen::check(&files, &out_dir);
            if s.is_fresh() {
                println!("kernels-generated/ is up to date ({} files)", files.len());
                return Ok(ExitCode::SUCCESS);
            }
            for (what, list) in [("missing", &s.missing), ("changed", &s.changed), ("orphaned", &s.orphaned)] {
                for p in list.iter().take(20) {
                    eprintln!("  {what}: kernels-generated/{p}");
                }
                if list.len() > 20 {
                    eprintln!("  ... and {} more {what}", list.len() - 20);
                }
            }
            eprintln!("kernels-generated/ is stale: run `kvforge generate` and commit");
            Ok(ExitCode::FAILURE)
        }
        Cmd::List { specs } => {
            let files = if specs.is_empty() { spec_files(&cli.root)? } else { specs };
            for spec in load_all(&files)? {
                println!("{} ({}): {}", spec.name, spec.path, spec.description);
                for &d in &spec.geometry.head_dims {
                    for t in &spec.tiers {
                        let seg = spec.segment(t.id, d);
                        println!(
                            "  tier {:>2} {:<6} d{:<3} {:>8.2} B/token/head payload, {:>8.2} resident (page {} B)   K {}, V {}",
                            t.id,
                            t.name,
                            d,
                            t.bytes_per_token(d, spec.page.tokens),
                            seg.page_bytes as f64 / spec.page.tokens as f64,
                            seg.page_bytes,
                            t.key,
                            t.value
                        );
                    }
                }
                for v in kvforge_gen::variants(&spec).into_iter().chain(spec.certify_variants()) {
                    let sh = kvforge_gen::launch_shape(&spec, &v);
                    println!("  {:<9} {:<64} {:>4} threads {:>7} B smem", v.kind(), v.name(), sh.threads, sh.smem_bytes);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Precompile(a) => commands::precompile::run(&cli.root, a),
        Cmd::Selftest(a) => commands::selftest::run(&cli.root, a),
        Cmd::Bench(a) => commands::bench::run(&cli.root, a),
        Cmd::Frontier(a) => commands::frontier::run(&cli.root, a),
        Cmd::Probe => commands::probe(),
        Cmd::Codebook { cmd } => commands::codebook::run(cmd),
        Cmd::Calibrate(a) => commands::kvtc::calibrate_cmd(a),
        Cmd::Pack(a) => commands::kvtc::pack_cmd(a),
        Cmd::Unpack(a) => commands::kvtc::unpack_cmd(a),
    }
}
