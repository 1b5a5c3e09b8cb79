//! The plan/launch engine of a cache: the device, the JIT-compiled kernels it looks up by
//! variant, the kernels' error-flag word and the resident buffers of page moves. It knows
//! launches, not pages: [`KvCache`](crate::KvCache) builds the parameters from its page store
//! and side tables and launches through it.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr};
use kvforge_spec::{Spec, VariantId};

use crate::device::Device;
use crate::error::{drv, Result, RtError};
use crate::kernels::{Kernel, KernelCache};
use crate::transcode::MoveBuffers;

pub(crate) struct Engine {
    dev: Arc<Device>,
    kernels: KernelCache,
    /// The error-flag word decode and certify kernels raise (`ERR_*` of `common.cuh`).
    flags: CudaSlice<u32>,
    /// Resident device buffers of page moves (offsets, heads, per-launch flags), grown when
    /// a batch outgrows them ([`crate::transcode`]).
    move_bufs: MoveBuffers,
    /// Launch the split-K combine with programmatic dependent launch: on sm_90+ unless the
    /// environment variable `KVFORGE_NO_PDL` is set (for A/B timing).
    pdl: bool,
}

impl Engine {
    pub(crate) fn new(dev: Arc<Device>) -> Result<Engine> {
        let flags = dev.stream.alloc_zeros::<u32>(1).map_err(drv("error flags"))?;
        let pdl = dev.info.compute_capability.0 >= 9 && std::env::var_os("KVFORGE_NO_PDL").is_none();
        Ok(Engine { dev, kernels: KernelCache::default(), flags, move_bufs: Default::default(), pdl })
    }

    pub(crate) fn dev(&self) -> &Arc<Device> {
        &self.dev
    }

    /// The kernel of variant `v`, compiled on first use.
    pub(crate) fn kernel(&self, spec: &Spec, v: &VariantId) -> Result<Kernel> {
        self.kernels.get(&self.dev, spec, v)
    }

    /// Device address of the error-flag word, for kernel parameters.
    pub(crate) fn flags_ptr(&self) -> u64 {
        self.flags.device_ptr(&self.dev.stream).0
    }

    /// Whether the split-K combine launches with programmatic dependent launch.
    pub(crate) fn pdl(&self) -> bool {
        self.pdl
    }

    pub(crate) fn move_bufs(&mut self) -> &mut MoveBuffers {
        &mut self.move_bufs
    }

    /// Reads and clears the kernels' error flags.
    pub(crate) fn check_flags(&mut self, v: &VariantId) -> Result<()> {
        let f = self.dev.stream.clone_dtoh(&self.flags).map_err(drv(format!("after {v}")))?;
        if f[0] == 0 {
            return Ok(());
        }
        self.dev.stream.memset_zeros(&mut self.flags).map_err(drv("clear flags"))?;
        Err(RtError::KernelFault { variant: v.to_string(), what: fault_names(f[0]) })
    }
}

/// The faults a kernel's error-flag word names (the `ERR_*` bits of `common.cuh`).
pub(crate) fn fault_names(flags: u32) -> String {
    let mut what = Vec::new();
    for (bit, name) in [(1, "a page in a tier it does not serve"), (2, "a page header with a bad magic"), (4, "a page longer than a page"), (8, "a source page not in the expected tier")] {
        if flags & bit != 0 {
            what.push(name);
        }
    }
    what.join(", ")
}
