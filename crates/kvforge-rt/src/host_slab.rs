//! Pinned host memory on huge pages, mapped for kernels over UVA.
//!
//! A kernel reading host memory pays one address translation per host page it touches. With
//! 4 KiB pages, reads of scattered 512-byte rows (ParisKV's fetch) are bound by translations at
//! well under half the host link's throughput; with 2 MiB pages the same reads run at the link's
//! rate. [`HostSlab::new`] maps anonymous memory on explicit huge pages (`MAP_HUGETLB`) where
//! the host has them reserved, else asks for transparent huge pages (`MADV_HUGEPAGE`) on a
//! 2 MiB-aligned mapping, then pins and maps it for the device with `cuMemHostRegister`. Where
//! neither kind of huge page is granted it still works, on 4 KiB pages; [`HostSlab::backing`]
//! says which was asked for and [`HostSlab::huge_bytes`] what the kernel granted.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use crate::error::{drv, Result, RtError};

const HUGE: usize = 2 << 20;

/// How a [`HostSlab`]'s memory was requested.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Backing {
    /// Explicit huge pages from the host's reserved pool (`MAP_HUGETLB`).
    HugeTlb,
    /// Transparent huge pages asked for with `madvise(MADV_HUGEPAGE)`; the kernel may still
    /// back parts with 4 KiB pages.
    Transparent,
}

/// Page-locked host memory, registered with the device (`DEVICEMAP | PORTABLE`), zeroed.
pub struct HostSlab {
    /// Start of the mapping (`munmap` base).
    base: *mut c_void,
    /// Bytes mapped from `base`.
    mapped: usize,
    /// The 2 MiB-aligned registered range.
    ptr: *mut u8,
    bytes: usize,
    backing: Backing,
    ctx: Arc<CudaContext>,
}

// SAFETY: the slab owns its mapping; access is through raw pointers whose users synchronise
// with the device themselves (as with cudarc's pinned slices).
unsafe impl Send for HostSlab {}
// SAFETY: as above; `&HostSlab` exposes only addresses.
unsafe impl Sync for HostSlab {}

impl HostSlab {
    /// Maps, pins and registers at least `bytes` bytes (rounded up to 2 MiB). `what` names the
    /// contents in errors. Memory that cannot be mapped or pinned is [`RtError::PinnedAlloc`]
    /// with nothing left mapped.
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize, what: &str) -> Result<HostSlab> {
        let len = bytes.max(1).next_multiple_of(HUGE);
        let fail = |reason: String| RtError::PinnedAlloc { what: what.to_string(), bytes: len, reason };
        let (base, mapped, ptr, backing) = map(len).map_err(|e| fail(format!("mmap: {e}")))?;
        ctx.bind_to_thread().map_err(drv("binding the context"))?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: [ptr, ptr + len) is a live read-write mapping owned here.
        let rc = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) };
        if rc != sys::cudaError_enum::CUDA_SUCCESS {
            // SAFETY: the mapping made above, not yet shared.
            unsafe { libc::munmap(base, mapped) };
            return Err(fail(format!("cuMemHostRegister: {rc:?}")));
        }
        Ok(HostSlab { base, mapped, ptr, bytes: len, backing, ctx: ctx.clone() })
    }

    /// The registered bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the slab is empty (never: at least 2 MiB are mapped).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// How the memory was requested.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Host address of the first byte; the same address reads the slab from a kernel (UVA).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The device address of the first byte.
    pub fn device_ptr(&self) -> Result<u64> {
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: the range is registered with DEVICEMAP; `d` receives its device address.
        let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, self.ptr.cast(), 0) };
        if rc != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(RtError::PinnedAlloc { what: "device address of a pinned slab".into(), bytes: self.bytes, reason: format!("{rc:?}") });
        }
        Ok(d)
    }

    /// Bytes of the slab the host kernel backs with huge pages (from `/proc/self/smaps`), or
    /// `None` where that cannot be read.
    pub fn huge_bytes(&self) -> Option<usize> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let (lo, hi) = (self.ptr as usize, self.ptr as usize + self.bytes);
        let mut inside = false;
        let mut kib = 0usize;
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = head.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                    inside = a < hi && b > lo;
                    continue;
                }
            }
            if !inside {
                continue;
            }
            let field = |name: &str| line.strip_prefix(name).and_then(|r| r.split_whitespace().next()).and_then(|v| v.parse::<usize>().ok());
            if let Some(v) = field("AnonHugePages:") {
                kib += v;
            }
            if let (Backing::HugeTlb, Some(v)) = (self.backing, field("Private_Hugetlb:")) {
                kib += v;
            }
        }
        Some(kib * 1024)
    }
}

impl Drop for HostSlab {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: registered and mapped in `new`; no kernel runs on it once its owner drops it.
        unsafe {
            sys::cuMemHostUnregister(self.ptr.cast());
            libc::munmap(self.base, self.mapped);
        }
    }
}

/// An anonymous read-write mapping of `len` bytes (a multiple of 2 MiB) on huge pages where
/// the host grants them: `(base, mapped bytes, 2 MiB-aligned start, backing)`.
fn map(len: usize) -> std::io::Result<(*mut c_void, usize, *mut u8, Backing)> {
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    // SAFETY: a fresh anonymous mapping; the result is checked.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, anon | libc::MAP_HUGETLB, -1, 0) };
    if p != libc::MAP_FAILED {
        return Ok((p, len, p.cast(), Backing::HugeTlb));
    }
    // Over-map by 2 MiB so that an aligned start exists, then ask for transparent huge pages.
    let mapped = len + HUGE;
    // SAFETY: as above.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), mapped, prot, anon, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let start = (p as usize).next_multiple_of(HUGE) as *mut u8;
    // SAFETY: [start, start + len) lies inside the mapping; advice failing leaves 4 KiB pages.
    unsafe { libc::madvise(start.cast(), len, libc::MADV_HUGEPAGE) };
    Ok((p, mapped, start, Backing::Transparent))
}
