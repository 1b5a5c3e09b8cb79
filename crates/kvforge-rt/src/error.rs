//! Typed runtime errors: a bad input never becomes a launch, a missing library never a panic.
//!
//! Input errors name what was wrong in a variant of their own where the type says more than
//! the message (an unknown sequence or kv head, a shape, a duplicate, a capacity, a call
//! made out of order); [`RtError::BadInput`] holds the rest. [`RtError::is_input_error`]
//! groups them for callers that only need "the caller's fault or the machine's".

use std::path::PathBuf;

use kvforge_spec::TierId;

#[derive(Debug, thiserror::Error)]
pub enum RtError {
    #[error("no CUDA driver: {0} (is libcuda.so on LD_LIBRARY_PATH? on the GPU machine set LD_LIBRARY_PATH=/usr/local/cuda/lib64)")]
    NoDriver(String),
    #[error("no NVRTC: libnvrtc could not be loaded (install nvidia-cuda-nvrtc==13.0.88 and put its nvidia/cu13/lib on LD_LIBRARY_PATH, or use /usr/local/cuda/lib64)")]
    NoNvrtc,
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA headers (cuda_fp16.h) not found; set KVFORGE_CUDA_INCLUDE or CUDA_HOME (searched: {searched})")]
    NoCudaHeaders { searched: String },
    #[error("CUDA driver error in {what}: {source}")]
    Driver { what: String, source: cudarc::driver::DriverError },
    /// `source_path` is the generated source NVRTC was given, written under the kernel cache
    /// (`failed/`) so it can be opened and recompiled by hand; `None` only if that write failed.
    #[error("NVRTC failed to compile {variant}{}:\n{log}", source_note(.source_path))]
    Compile { variant: String, log: String, source_path: Option<PathBuf> },
    #[error("NVRTC compiled {variant} with warnings (treated as errors){}:\n{log}", source_note(.source_path))]
    CompileWarnings { variant: String, log: String, source_path: Option<PathBuf> },
    #[error("kernel cache miss for {variant} with KVFORGE_JIT_OFFLINE set; run `kvforge precompile`")]
    CacheMiss { variant: String },
    #[error("kernel cache I/O at {path}: {source}")]
    CacheIo { path: String, source: std::io::Error },
    #[error("out of pages for tier `{tier}`: {capacity} pages of {page_bytes} B are all in use; the cache is unchanged")]
    OutOfPages { tier: String, capacity: usize, page_bytes: usize },
    #[error("out of device memory: asked for {bytes} B for {what}")]
    OutOfMemory { what: String, bytes: usize },
    /// Pinned host memory for `what` could not be allocated (ParisKV's retrieval-region K/V).
    #[error("out of pinned host memory: {bytes} B for {what}: {reason}")]
    PinnedAlloc { what: String, bytes: usize, reason: String },
    /// More host memory, or more retrieval-region keys, than the budget allows; nothing was
    /// allocated or offloaded.
    #[error("{what}: needs {need}, the host budget allows {budget}")]
    HostBudget { what: String, need: usize, budget: usize },
    /// A ParisKV configuration or input the retrieval reference rejects.
    #[error("ParisKV: {0}")]
    Paris(#[from] kvforge_paris::ParisError),
    /// A kvtc container, calibration or restore input the codec rejects (names the chunk).
    #[error("kvtc: {0}")]
    Kvtc(#[from] kvforge_kvtc::KvtcError),
    #[error("out of pinned host memory: {bytes} B for the fp16 originals (tier 2): {reason}")]
    OutOfPinnedMemory { bytes: usize, reason: String },
    #[error("the fp16 original (tier 2) of page {page} (offset {offset}) is missing: certified decode can neither bound nor recompute it")]
    MissingOriginal { page: usize, offset: u64 },
    /// An input error that no typed variant describes better.
    #[error("bad input: {0}")]
    BadInput(String),
    #[error("sequence {0} does not exist")]
    NoSequence(usize),
    #[error("kv head {head} out of range: the cache has {heads} kv heads")]
    NoKvHead { head: usize, heads: usize },
    #[error("no full page {index} in sequence {seq} kv head {head}")]
    NoPage { seq: usize, head: usize, index: usize },
    /// A length or shape that is not the one the call needs; `what` names the argument.
    #[error("{what}: expected {expected}, got {got}")]
    ShapeMismatch { what: String, expected: String, got: String },
    /// One item (a sequence, a page) named twice where each may appear once.
    #[error("{what} appears twice in {within}")]
    Duplicate { what: String, within: String },
    #[error("{what}: non-finite value {value}")]
    NonFinite { what: String, value: f32 },
    /// A fixed-size slot or buffer asked for more than it holds.
    #[error("{what}: {requested} exceeds the capacity of {capacity}")]
    CapacityExceeded { what: String, requested: String, capacity: String },
    /// The call is valid, but not in the object's current state: `fix` says what must come
    /// first (e.g. `keep_originals` before the first append).
    #[error("{what}: {fix}")]
    WrongState { what: String, fix: String },
    /// The spec was not built for what was asked (an entry point it does not render, such as
    /// certified decode); `fix` says how to build it.
    #[error("spec `{spec}` does not support {what}: {fix}")]
    NotInSpec { spec: String, what: String, fix: String },
    #[error("sequence {0} is empty: decode needs at least one cached token")]
    EmptySequence(usize),
    #[error("no decode variant of spec `{spec}` serves tiers {tiers:?} at head_dim {head_dim}, gqa {gqa}; add the combination to [kernels] and regenerate")]
    NoVariant { spec: String, tiers: Vec<String>, head_dim: usize, gqa: usize },
    #[error("corrupt page {page} (offset {offset}): {reason}")]
    CorruptPage { page: usize, offset: u64, reason: String },
    #[error("kernel {variant} reported {what}")]
    KernelFault { variant: String, what: String },
    #[error("tier {0} cannot be a page's target here: {1}")]
    BadTier(TierId, String),
    #[error(transparent)]
    Render(#[from] kvforge_gen::RenderError),
}

pub type Result<T> = std::result::Result<T, RtError>;

impl RtError {
    /// True when the caller's input (arguments, call order, spec choice) caused the error
    /// rather than the machine, the driver or the data on the device: the CLI exits 2 on these.
    pub fn is_input_error(&self) -> bool {
        matches!(
            self,
            RtError::BadInput(_)
                | RtError::NoSequence(_)
                | RtError::EmptySequence(_)
                | RtError::NoKvHead { .. }
                | RtError::NoPage { .. }
                | RtError::ShapeMismatch { .. }
                | RtError::Duplicate { .. }
                | RtError::NonFinite { .. }
                | RtError::CapacityExceeded { .. }
                | RtError::HostBudget { .. }
                | RtError::Paris(_)
                | RtError::WrongState { .. }
                | RtError::NotInSpec { .. }
                | RtError::NoVariant { .. }
                | RtError::BadTier(..)
        )
    }
}

fn source_note(path: &Option<PathBuf>) -> String {
    match path {
        Some(p) => format!(" (source: {})", p.display()),
        None => String::new(),
    }
}

/// Maps a CUDA driver error of the operation `what` to [`RtError`]: out-of-memory becomes
/// [`RtError::OutOfMemory`] (callers that know the size fill it in), anything else
/// [`RtError::Driver`]. Public so that crates launching on a cache's stream report alike.
pub fn drv(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> RtError {
    let what = what.into();
    move |source| {
        if source.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            RtError::OutOfMemory { what, bytes: 0 }
        } else {
            RtError::Driver { what, source }
        }
    }
}
