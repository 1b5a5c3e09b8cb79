//! Subcommands that need the runtime.

pub mod bench;
pub mod codebook;
pub mod frontier;
pub mod kvtc;
pub mod precompile;
pub mod selftest;

use std::process::ExitCode;

pub fn probe() -> anyhow::Result<ExitCode> {
    println!("libcuda: {}", if kvforge_rt::driver_present() { "found" } else { "missing" });
    println!(
        "libnvrtc: {}",
        match kvforge_rt::jit::nvrtc_version() {
            Ok(v) => format!("found (NVRTC {v})"),
            Err(e) => e.to_string(),
        }
    );
    match kvforge_rt::jit::cuda_include_dir() {
        Ok(d) => println!("CUDA headers: {}", d.display()),
        Err(e) => println!("CUDA headers: {e}"),
    }
    println!("kernel cache: {}", kvforge_rt::jit::cache_dir().display());
    let dev = kvforge_rt::Device::open(0)?;
    let i = &dev.info;
    println!("device: {} ({}), {} SMs, {:.1} GiB, L2 {} MB, {} KB shared memory per block", i.name, i.arch(), i.sm_count, i.total_mem as f64 / (1u64 << 30) as f64, i.l2_bytes >> 20, i.max_smem_per_block >> 10);
    Ok(ExitCode::SUCCESS)
}
