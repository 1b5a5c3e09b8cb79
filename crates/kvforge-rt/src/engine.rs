//! The plan/launch engine of a cache: the device, the JIT-compiled kernels it looks up by
//! variant, the kernels' error-flag word and the resident buffers of page moves. It knows
//! launches, not pages: [`KvCache`](crate::KvCache) builds the parameters from its page store
//! and side tables and launches through it.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
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
    /// The error-flag word's asynchronous watch ([`Engine::watch_flags`]), made at first use.
    watch: Option<FlagWatch>,
    /// While set, decode and append launches go to this stream (a caller's, e.g. one that a
    /// CUDA graph is being captured on) instead of the device's, without programmatic
    /// dependent launch ([`crate::graph`]).
    launch_stream: Option<Arc<CudaStream>>,
}

/// A copy of the error-flag word into pinned host memory, queued behind launches, and the
/// event that says it has landed.
struct FlagWatch {
    host: PinnedHostSlice<u32>,
    landed: CudaEvent,
    /// The variant launched last before the copy, and whether a copy is outstanding.
    pending: Option<String>,
}

impl Engine {
    pub(crate) fn new(dev: Arc<Device>) -> Result<Engine> {
        let flags = dev.stream.alloc_zeros::<u32>(1).map_err(drv("error flags"))?;
        let pdl = dev.info.compute_capability.0 >= 9 && std::env::var_os("KVFORGE_NO_PDL").is_none();
        Ok(Engine { dev, kernels: KernelCache::default(), flags, move_bufs: Default::default(), pdl, watch: None, launch_stream: None })
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

    /// Whether the split-K combine launches with programmatic dependent launch (never on a
    /// caller's launch stream: a captured graph gets plain edges).
    pub(crate) fn pdl(&self) -> bool {
        self.pdl && self.launch_stream.is_none()
    }

    /// The stream decode and append kernels launch on: the caller's while one is set
    /// ([`Engine::set_launch_stream`]), else the device's.
    pub(crate) fn launch_stream(&self) -> Arc<CudaStream> {
        self.launch_stream.clone().unwrap_or_else(|| self.dev.stream.clone())
    }

    /// Sets (or with None clears) the stream of [`Engine::launch_stream`].
    pub(crate) fn set_launch_stream(&mut self, s: Option<Arc<CudaStream>>) {
        self.launch_stream = s;
    }

    pub(crate) fn move_bufs(&mut self) -> &mut MoveBuffers {
        &mut self.move_bufs
    }

    /// Reads and clears the kernels' error flags (synchronises the stream).
    pub(crate) fn check_flags(&mut self, v: &VariantId) -> Result<()> {
        self.check_flags_named(&v.to_string())
    }

    fn check_flags_named(&mut self, v: &str) -> Result<()> {
        let f = self.dev.stream.clone_dtoh(&self.flags).map_err(drv(format!("after {v}")))?;
        // Everything queued so far has run: an outstanding watch copy says nothing new (and
        // must not report this fault a second time).
        if let Some(w) = self.watch.as_mut() {
            w.pending = None;
        }
        if f[0] == 0 {
            return Ok(());
        }
        self.dev.stream.memset_zeros(&mut self.flags).map_err(drv("clear flags"))?;
        Err(RtError::KernelFault { variant: v.to_string(), what: fault_names(f[0]) })
    }

    /// Queues a copy of the error-flag word into pinned host memory behind the launches so
    /// far (after `v`'s), without waiting: [`Engine::poll_flags`] reads it once it has landed.
    /// Flags only accumulate until cleared, so a copy queued later reports every fault an
    /// earlier one would have.
    pub(crate) fn watch_flags(&mut self, v: &VariantId) -> Result<()> {
        if self.watch.is_none() {
            // SAFETY: the buffer is read only after a copy into it has landed (`poll_flags`).
            let host = unsafe { self.dev.ctx.alloc_pinned_with_flags::<u32>(1, 0) }.map_err(drv("pinned error-flag word"))?;
            let landed = self.dev.ctx.new_event(None).map_err(drv("error-flag event"))?;
            self.watch = Some(FlagWatch { host, landed, pending: None });
        }
        let st = self.dev.stream.clone();
        let w = self.watch.as_mut().expect("made above");
        st.memcpy_dtoh(&self.flags, &mut w.host).map_err(drv("error-flag copy"))?;
        w.landed.record(&st).map_err(drv("error-flag event"))?;
        w.pending = Some(v.to_string());
        Ok(())
    }

    /// Reports the faults of launches the last watched copy covers, if it has landed; never
    /// waits. On a fault the flags are cleared (behind what the stream holds now) and the
    /// error names the variant launched last before the copy.
    pub(crate) fn poll_flags(&mut self) -> Result<()> {
        let Some(w) = self.watch.as_mut() else { return Ok(()) };
        let Some(v) = w.pending.clone() else { return Ok(()) };
        if !w.landed.try_is_complete().map_err(drv(format!("after {v}")))? {
            return Ok(());
        }
        w.pending = None;
        let f = w.host.as_slice().map_err(drv("error-flag copy"))?[0];
        if f == 0 {
            return Ok(());
        }
        self.dev.stream.memset_zeros(&mut self.flags).map_err(drv("clear flags"))?;
        Err(RtError::KernelFault { variant: v, what: fault_names(f) })
    }

    /// Waits for everything queued on the stream and reports (and clears) any fault the
    /// kernels flagged since the last check, naming the variant of the last watched launch.
    pub(crate) fn synchronize(&mut self) -> Result<()> {
        let v = self.watch.as_ref().and_then(|w| w.pending.clone()).unwrap_or_else(|| "an earlier launch".into());
        self.dev.stream.synchronize().map_err(drv("synchronize"))?;
        self.check_flags_named(&v)
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
