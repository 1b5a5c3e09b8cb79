//! Typed runtime errors: a bad input never becomes a launch, a missing library never a panic.

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
    #[error("NVRTC failed to compile {variant}:\n{log}")]
    Compile { variant: String, log: String },
    #[error("NVRTC compiled {variant} with warnings (treated as errors):\n{log}")]
    CompileWarnings { variant: String, log: String },
    #[error("kernel cache miss for {variant} with KVFORGE_JIT_OFFLINE set; run `kvforge precompile`")]
    CacheMiss { variant: String },
    #[error("kernel cache I/O at {path}: {source}")]
    CacheIo { path: String, source: std::io::Error },
    #[error("out of pages for tier `{tier}`: {capacity} pages of {page_bytes} B are all in use; the cache is unchanged")]
    OutOfPages { tier: String, capacity: usize, page_bytes: usize },
    #[error("out of device memory: asked for {bytes} B for {what}")]
    OutOfMemory { what: String, bytes: usize },
    #[error("out of pinned host memory: {bytes} B for the fp16 originals (tier 2): {reason}")]
    OutOfPinnedMemory { bytes: usize, reason: String },
    #[error("the fp16 original (tier 2) of page {page} (offset {offset}) is missing: certified decode can neither bound nor recompute it")]
    MissingOriginal { page: usize, offset: u64 },
    #[error("bad input: {0}")]
    BadInput(String),
    #[error("sequence {0} does not exist")]
    NoSequence(usize),
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

pub(crate) fn drv(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> RtError {
    let what = what.into();
    move |source| {
        if source.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            RtError::OutOfMemory { what, bytes: 0 }
        } else {
            RtError::Driver { what, source }
        }
    }
}
