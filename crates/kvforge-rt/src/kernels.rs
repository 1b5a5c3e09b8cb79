//! Loaded kernels of one device: NVRTC (through the disk cache) on first use, then a
//! function handle per variant. Dynamic shared memory above 48 KB is opted into here.

use cudarc::driver::{sys::CUfunction_attribute, CudaFunction};
use kvforge_spec::{Spec, VariantId};
use std::collections::HashMap;
use std::sync::Mutex;

use crate::device::Device;
use crate::error::{drv, Result};

/// A loaded variant and its launch shape.
#[derive(Clone)]
pub struct Kernel {
    pub func: CudaFunction,
    /// Decode variants: the entry point that records per-page masses
    /// ([`VariantId::tracked_symbol`]).
    pub tracked: Option<CudaFunction>,
    /// Decode variants of specs with `kernels.certified`: certified decode's entry point
    /// ([`VariantId::certified_symbol`]).
    pub certified: Option<CudaFunction>,
    pub threads: u32,
    pub smem_bytes: u32,
    /// Decode variants: the certified entry's dynamic shared memory (its block layout's plan).
    pub certified_smem_bytes: u32,
    /// CTAs per page of a transcode launch (grid = pages × this); 1 for other families.
    pub ctas_per_page: u32,
}

/// Loaded kernels; interior mutability so planning (`&self`) can load what it plans.
#[derive(Default)]
pub struct KernelCache {
    loaded: Mutex<HashMap<VariantId, Kernel>>,
}

impl KernelCache {
    pub fn get(&self, dev: &Device, spec: &Spec, v: &VariantId) -> Result<Kernel> {
        if let Some(k) = self.loaded.lock().unwrap().get(v) {
            return Ok(k.clone());
        }
        let source = kvforge_gen::render(spec, v)?;
        let compiled = crate::jit::compile(v, &source, &dev.info.arch(), crate::jit::CompileMode::default())?;
        let module = dev.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin)).map_err(drv(format!("loading {v}")))?;
        let shape = kvforge_gen::launch_shape(spec, v);
        let load = |symbol: &str, smem: usize| -> Result<CudaFunction> {
            let func = module.load_function(symbol).map_err(drv(format!("symbol {symbol}")))?;
            if smem > 48 * 1024 {
                func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).map_err(drv(format!("shared memory opt-in for {symbol}")))?;
            }
            Ok(func)
        };
        let func = load(&v.symbol(), shape.smem_bytes)?;
        let tracked = v.tracked_symbol().map(|s| load(&s, shape.smem_bytes)).transpose()?;
        // Only specs with `kernels.certified` compile the certified entry.
        let certified = v.certified_symbol().filter(|_| spec.kernels.certified).map(|s| load(&s, shape.certified_smem_bytes)).transpose()?;
        let k = Kernel {
            func,
            tracked,
            certified,
            threads: shape.threads as u32,
            smem_bytes: shape.smem_bytes as u32,
            certified_smem_bytes: shape.certified_smem_bytes as u32,
            ctas_per_page: shape.ctas_per_page as u32,
        };
        self.loaded.lock().unwrap().insert(v.clone(), k.clone());
        Ok(k)
    }
}

/// Logs one kernel launch at debug level, inside the caller's span: the kernel symbol, grid,
/// block and dynamic shared memory. `symbol` is built only when the event is enabled.
pub(crate) fn trace_launch(symbol: impl FnOnce() -> String, cfg: &cudarc::driver::LaunchConfig) {
    if tracing::enabled!(tracing::Level::DEBUG) {
        tracing::debug!(symbol = %symbol(), grid = ?cfg.grid_dim, block = ?cfg.block_dim, smem = cfg.shared_mem_bytes, "launch");
    }
}
