//! Device probe. cudarc's dynamic loading panics when a library is missing, so every entry
//! point checks for the library first and returns a typed error instead.

use std::sync::Arc;

use cudarc::driver::{sys::CUdevice_attribute, CudaContext};

use crate::error::{drv, Result, RtError};

/// What the runtime needs to know about the GPU.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceInfo {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: usize,
    pub total_mem: usize,
    pub l2_bytes: usize,
    pub max_smem_per_block: usize,
}

impl DeviceInfo {
    /// `sm_90` style architecture name.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

/// True when libcuda can be loaded (without panicking).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// True when libnvrtc can be loaded (without panicking).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// An open device: context, its stream and facts.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<cudarc::driver::CudaStream>,
    pub info: DeviceInfo,
}

impl Device {
    /// Opens device `ordinal`, or says why not.
    pub fn open(ordinal: usize) -> Result<Device> {
        if !driver_present() {
            return Err(RtError::NoDriver("libcuda.so could not be loaded".into()));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| RtError::NoDevice(format!("device {ordinal}: {e}")))?;
        // One stream does all work; raw pointers inside parameter structs are not tracked.
        // SAFETY: every launch and copy of the runtime goes through `stream`.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let attr = |a| ctx.attribute(a).map_err(drv("device attribute"));
        let info = DeviceInfo {
            name: ctx.name().map_err(drv("device name"))?,
            compute_capability: ctx.compute_capability().map_err(drv("compute capability"))?,
            sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
            total_mem: ctx.total_mem().map_err(drv("total memory"))?,
            l2_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
            max_smem_per_block: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)? as usize,
        };
        tracing::info!(name = %info.name, arch = %info.arch(), sms = info.sm_count, "opened device");
        Ok(Device { ctx, stream, info })
    }

    /// Waits for the device's work, then returns the memory that dropped caches freed to the
    /// driver. Freed device memory goes back to the device's default memory pool, which keeps it
    /// until a later synchronisation; other allocators in the process (PyTorch's) cannot use it
    /// until then. Call this after dropping large caches when another library allocates next.
    pub fn release_free_memory(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("bind context"))?;
        self.ctx.synchronize().map_err(drv("synchronize"))?;
        let mut pool: cudarc::driver::sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer and the device handle comes from the open context.
        unsafe { cudarc::driver::sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }.result().map_err(drv("default memory pool"))?;
        // SAFETY: `pool` is the device's default pool; trimming to 0 only releases unused memory.
        unsafe { cudarc::driver::sys::cuMemPoolTrimTo(pool, 0) }.result().map_err(drv("trim memory pool"))?;
        Ok(())
    }
}
