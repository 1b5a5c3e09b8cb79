//! NVRTC compilation with an on-disk cache keyed by everything that changes the binary
//! (generator version, variant, source incl. headers, NVRTC version, arch, flags), as
//! FlashInfer's JIT cache and Triton's cache do. Writes are atomic (temp file + rename), so
//! concurrent processes at worst compile twice. `KVFORGE_JIT_OFFLINE=1` turns a miss into an
//! error for production.

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::time::Instant;

use kvforge_spec::VariantId;

use crate::device::nvrtc_present;
use crate::error::{Result, RtError};

/// Flags every kernel is compiled with.
pub const NVRTC_FLAGS: &[&str] = &["-std=c++17", "-default-device", "-lineinfo"];

/// Where compiled kernels live: `$KVFORGE_CACHE_DIR`, else `$XDG_CACHE_HOME/kvforge`, else
/// `~/.cache/kvforge`.
pub fn cache_dir() -> PathBuf {
    if let Ok(d) = std::env::var("KVFORGE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    let base = std::env::var("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/tmp".into())).join(".cache"));
    base.join("kvforge")
}

/// Finds the directory holding `cuda_fp16.h`: `$KVFORGE_CUDA_INCLUDE`, `$CUDA_HOME/include`,
/// `/usr/local/cuda/include`, or the `nvidia/cu13/include` of a pip-installed NVRTC next to a
/// `lib` dir on `LD_LIBRARY_PATH`.
pub fn cuda_include_dir() -> Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(d) = std::env::var("KVFORGE_CUDA_INCLUDE") {
        candidates.push(d.into());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(d) = std::env::var(var) {
            candidates.push(Path::new(&d).join("include"));
        }
    }
    candidates.push("/usr/local/cuda/include".into());
    if let Ok(ld) = std::env::var("LD_LIBRARY_PATH") {
        for p in ld.split(':').filter(|p| !p.is_empty()) {
            candidates.push(Path::new(p).join("../include"));
            candidates.push(Path::new(p).join("../../include"));
        }
    }
    for c in &candidates {
        if c.join("cuda_fp16.h").is_file() {
            return Ok(c.clone());
        }
    }
    Err(RtError::NoCudaHeaders { searched: candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", ") })
}

/// NVRTC's version, e.g. `13.0`.
pub fn nvrtc_version() -> Result<String> {
    if !nvrtc_present() {
        return Err(RtError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: library presence checked above; out-pointers are valid.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    Ok(format!("{major}.{minor}"))
}

/// Writes the kvforge device headers (hand-written + generated params) into a
/// content-addressed dir under the cache and returns it.
pub fn kvforge_include_dir() -> Result<PathBuf> {
    // Once per process: compile threads must not race on the temporary directory.
    static DIR: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
    let mut done = DIR.lock().unwrap();
    if let Some(d) = done.as_ref() {
        return Ok(d.clone());
    }
    let d = write_include_dir()?;
    *done = Some(d.clone());
    Ok(d)
}

fn write_include_dir() -> Result<PathBuf> {
    let headers = kvforge_gen::all_headers();
    let mut h = blake3::Hasher::new();
    for (p, s) in &headers {
        h.update(p.as_bytes());
        h.update(s.as_bytes());
    }
    let dir = cache_dir().join(format!("include-{}", &h.finalize().to_hex()[..16]));
    if !dir.join("kvforge/decode.cuh").is_file() {
        let tmp = cache_dir().join(format!("include-tmp-{}", std::process::id()));
        for (p, s) in &headers {
            let f = tmp.join(p);
            std::fs::create_dir_all(f.parent().unwrap()).map_err(|e| io(&f, e))?;
            std::fs::write(&f, s).map_err(|e| io(&f, e))?;
        }
        if std::fs::rename(&tmp, &dir).is_err() {
            // Another process won the race; use its copy.
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    Ok(dir)
}

fn io(p: &Path, source: std::io::Error) -> RtError {
    RtError::CacheIo { path: p.display().to_string(), source }
}

/// Result of compiling one variant.
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub from_cache: bool,
    pub seconds: f64,
    pub log: String,
}

/// How to compile.
#[derive(Clone, Copy, Debug)]
pub struct CompileMode {
    /// Any NVRTC diagnostic other than ptxas info fails the compile.
    pub strict: bool,
    /// Ask ptxas for its register / spill report (returned in `Compiled::log`).
    pub ptxas_report: bool,
    /// Read and write the disk cache.
    pub use_cache: bool,
}

impl Default for CompileMode {
    fn default() -> Self {
        CompileMode { strict: false, ptxas_report: false, use_cache: true }
    }
}

/// ptxas' report of one module: registers and spill bytes of its worst kernel (decode modules
/// hold two entry points; the tracked one is the heavier).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct PtxasReport {
    pub registers: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_frame: u32,
}

impl PtxasReport {
    /// Parses the `ptxas info` lines of an NVRTC log; each figure is the largest over the
    /// module's functions (the last function's alone hid a spilling tracked entry point).
    pub fn parse(log: &str) -> Option<PtxasReport> {
        let num_before = |line: &str, word: &str| -> Option<u32> {
            let i = line.find(word)?;
            line[..i].split_whitespace().last()?.parse().ok()
        };
        let mut r = PtxasReport::default();
        let mut seen = false;
        for line in log.lines() {
            if let Some(n) = num_before(line, "registers") {
                r.registers = r.registers.max(n);
                seen = true;
            }
            if let Some(n) = num_before(line, "bytes spill stores") {
                r.spill_stores = r.spill_stores.max(n);
            }
            if let Some(n) = num_before(line, "bytes spill loads") {
                r.spill_loads = r.spill_loads.max(n);
            }
            if let Some(n) = num_before(line, "bytes stack frame") {
                r.stack_frame = r.stack_frame.max(n);
            }
        }
        seen.then_some(r)
    }
}

/// Diagnostics of a log other than ptxas' info lines.
fn diagnostics(log: &str) -> String {
    log.lines().filter(|l| !l.trim().is_empty() && !l.contains("ptxas info") && !l.trim_start().starts_with("ptxas") && !l.contains("bytes stack frame")).collect::<Vec<_>>().join("\n")
}

/// Compiles `source` for `arch` (e.g. `sm_90`) with NVRTC to a cubin, through the disk cache.
/// Needs no GPU: CI compiles every generated kernel with it.
///
/// Runs in a `jit` span (variant, arch); logs a cache hit at debug, a compile with its NVRTC
/// time at info. A failed compile keeps its source under `failed/` of the cache (the error's
/// `source_path`).
#[tracing::instrument(name = "jit", level = "debug", skip_all, fields(variant = %variant, arch = %arch))]
pub fn compile(variant: &VariantId, source: &str, arch: &str, mode: CompileMode) -> Result<Compiled> {
    let version = nvrtc_version()?;
    let headers: String = kvforge_gen::all_headers().into_iter().map(|(p, s)| p + &s).collect();
    let key = variant.cache_key(&(source.to_string() + &headers), arch, &format!("nvrtc{version} {}", NVRTC_FLAGS.join(" ")));
    let path = cache_dir().join("cubin").join(format!("{key}.cubin"));
    if mode.use_cache {
        if let Ok(cubin) = std::fs::read(&path) {
            tracing::debug!(cache = "hit", path = %path.display(), "kernel cache hit");
            // A hit marks the cubin used (best effort): stale entries of older headers are the
            // ones not touched since, so a cache can be pruned by age.
            let _ = std::fs::File::options().write(true).open(&path).and_then(|f| f.set_modified(std::time::SystemTime::now()));
            return Ok(Compiled { cubin, from_cache: true, seconds: 0.0, log: String::new() });
        }
    }
    if std::env::var("KVFORGE_JIT_OFFLINE").is_ok_and(|v| v == "1") {
        tracing::warn!(cache = "miss", "kernel cache miss with KVFORGE_JIT_OFFLINE=1");
        return Err(RtError::CacheMiss { variant: variant.to_string() });
    }
    tracing::debug!(cache = if mode.use_cache { "miss" } else { "off" }, nvrtc = %version, "compiling kernel");
    let start = Instant::now();
    let (cubin, log) = nvrtc_cubin(&variant.to_string(), source, arch, mode.ptxas_report).map_err(|e| match e {
        RtError::Compile { variant, log, .. } => {
            let source_path = keep_failed_source(&key, source);
            tracing::error!(source_path = ?source_path, "NVRTC failed");
            RtError::Compile { variant, log, source_path }
        }
        e => e,
    })?;
    let nvrtc_seconds = start.elapsed().as_secs_f64();
    let diag = diagnostics(&log);
    if mode.strict && !diag.is_empty() {
        return Err(RtError::CompileWarnings { variant: variant.to_string(), log: diag, source_path: keep_failed_source(&key, source) });
    }
    if !mode.use_cache {
        tracing::info!(cache = "off", nvrtc_seconds, "compiled kernel");
        return Ok(Compiled { cubin, from_cache: false, seconds: nvrtc_seconds, log });
    }
    std::fs::create_dir_all(path.parent().unwrap()).map_err(|e| io(&path, e))?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, &cubin).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
    let seconds = start.elapsed().as_secs_f64();
    tracing::info!(cache = "miss", nvrtc_seconds, seconds, path = %path.display(), "compiled kernel");
    Ok(Compiled { cubin, from_cache: false, seconds, log })
}

/// Compiles a module that is not a spec variant (the ParisKV retrieval module,
/// `kvforge_gen::render_paris`) for `arch`, without the disk cache (its source names its
/// whole geometry; it compiles once per process). `strict`: any diagnostic fails.
pub fn compile_module(name: &str, source: &str, arch: &str, strict: bool) -> Result<Compiled> {
    let start = Instant::now();
    let (cubin, log) = nvrtc_cubin(name, source, arch, false)?;
    let diag = diagnostics(&log);
    if strict && !diag.is_empty() {
        return Err(RtError::CompileWarnings { variant: name.to_string(), log: diag, source_path: None });
    }
    Ok(Compiled { cubin, from_cache: false, seconds: start.elapsed().as_secs_f64(), log })
}

/// Writes the source of a failed compile to `failed/<cache key>.cu` under the kernel cache
/// (the headers it includes are in the cache's `include-*` directory) and returns the path;
/// `None` if the cache is not writable, since the compile error matters more than this copy.
fn keep_failed_source(key: &str, source: &str) -> Option<PathBuf> {
    let path = cache_dir().join("failed").join(format!("{key}.cu"));
    let written = std::fs::create_dir_all(path.parent()?).and_then(|()| std::fs::write(&path, source));
    match written {
        Ok(()) => Some(path),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "could not keep the failed kernel source");
            None
        }
    }
}

fn nvrtc_cubin(name: &str, source: &str, arch: &str, ptxas_report: bool) -> Result<(Vec<u8>, String)> {
    use cudarc::nvrtc::{result, sys};
    let cuda_inc = cuda_include_dir()?;
    let kv_inc = kvforge_include_dir()?;
    let mut opts: Vec<String> = NVRTC_FLAGS.iter().map(|s| s.to_string()).collect();
    opts.push(format!("--gpu-architecture={arch}"));
    opts.push(format!("-I{}", kv_inc.display()));
    opts.push(format!("-I{}", cuda_inc.display()));
    if ptxas_report {
        opts.push("--ptxas-options=-v".into());
    }
    let fail = |log: String| RtError::Compile { variant: name.to_string(), log, source_path: None };
    let src = CString::new(source).map_err(|_| fail("source contains a NUL byte".into()))?;
    let cname = CString::new(format!("{}.cu", name.replace('/', "_"))).unwrap();
    let prog = result::create_program(&src, Some(&cname)).map_err(|e| fail(format!("{e:?}")))?;
    // SAFETY: `prog` was created above and is destroyed once at the end.
    unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log_raw = result::get_program_log(prog).unwrap_or_default();
        let log = String::from_utf8_lossy(&log_raw.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect::<Vec<u8>>()).into_owned();
        if compiled.is_err() {
            let _ = result::destroy_program(prog);
            return Err(fail(log));
        }
        let mut size = 0usize;
        sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}")))?;
        let mut cubin = vec![0u8; size];
        sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char).result().map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))?;
        let _ = result::destroy_program(prog);
        Ok((cubin, log))
    }
}

#[cfg(test)]
mod tests {
    use super::{compile, CompileMode, PtxasReport};
    use crate::error::RtError;

    /// A source NVRTC rejects comes back as `Compile` with its log and the path of a file
    /// holding that source (skipped, visibly, where NVRTC or the CUDA headers are missing).
    #[test]
    fn failed_compile_keeps_its_source() {
        if !crate::nvrtc_present() || super::cuda_include_dir().is_err() {
            println!("skipped: no NVRTC or CUDA headers");
            return;
        }
        let spec = crate::testing::shipped_spec("baseline.toml");
        let v = kvforge_spec::VariantId::mass_window(&spec);
        let source = "this is not C++ (failed_compile_keeps_its_source)\n";
        match compile(&v, source, "sm_90", CompileMode { use_cache: false, ..CompileMode::default() }) {
            Err(RtError::Compile { variant, log, source_path: Some(p) }) => {
                assert_eq!(variant, v.to_string());
                assert!(!log.is_empty());
                assert_eq!(std::fs::read_to_string(&p).unwrap(), source);
                let e = RtError::Compile { variant, log, source_path: Some(p.clone()) }.to_string();
                assert!(e.contains(&p.display().to_string()), "{e}");
                let _ = std::fs::remove_file(&p);
            }
            other => panic!("expected a compile error with a source path, got {:?}", other.map(|_| ())),
        }
    }

    /// A module of two kernels reports the worse of each figure, not the last kernel's.
    #[test]
    fn ptxas_report_takes_the_worst_kernel() {
        let log = "ptxas info    : Compiling entry function 'k_tracked' for 'sm_90'
ptxas info    : Function properties for k_tracked
    16 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers
ptxas info    : Compiling entry function 'k' for 'sm_90'
ptxas info    : Function properties for k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 120 registers, used 1 barriers
";
        assert_eq!(PtxasReport::parse(log), Some(PtxasReport { registers: 128, spill_stores: 16, spill_loads: 12, stack_frame: 16 }));
        assert_eq!(PtxasReport::parse("no ptxas here"), None);
    }
}
