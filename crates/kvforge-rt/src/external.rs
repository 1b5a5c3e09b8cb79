//! Tensors owned by someone else (PyTorch, another runtime): raw device pointers with shapes,
//! strides, element type and device, validated before anything touches them.
//!
//! A raw pointer carries no proof of what it points to, so every entry point here checks what
//! can be checked: the owner's claims (device, dtype, shape, row-major contiguity, alignment)
//! on the host with specific messages, then — with the driver — that the address is device
//! memory of this cache's GPU and that the whole extent lies inside one allocation. A bad
//! tensor becomes [`RtError::BadInput`] naming the argument, never a launch.
//!
//! Queries, outputs and log-sum-exps are used in place (zero copy): the decode kernel reads
//! `q` and writes `out` / `lse` through the caller's pointers. Appends stage through the host:
//! the cache keeps a host mirror of every tail page (cache.rs), which both the encode path and
//! the spherical radius calibration read, so the new tokens must reach the host anyway; the
//! copy is of the 16-bit values as they are, so nothing is rounded twice. A decode step's
//! one token per sequence goes in without the host instead:
//! [`KvCache::append_step_external`] (`crate::append_step`).
//!
//! Prefix attention ([`KvCache::attend_prefix_external`]) evaluates a prompt causally in one
//! launch: entry `i` of the batch is sequence `seq` cut after `lengths[i]` tokens, i.e. its page
//! list with the last page's length cut ([`prefix_pages`]). The kernel accepts a planned length
//! shorter than the page header's (it never reads past the planned length).

use cudarc::driver::sys::{CUpointer_attribute, CUstream};
use kvforge_spec::DType;

use crate::cache::KvCache;
use crate::decode::{DecodeIo, DecodePlan, DecodeWorkspace};
use crate::error::{drv, Result, RtError};
use crate::pool::PageRef;

/// Element type of an external tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ElemType {
    F16,
    Bf16,
    F32,
    /// Anything else, by the owner's name for it (e.g. `torch.float64`): always rejected.
    Other(String),
}

impl ElemType {
    /// The element type of a spec dtype.
    pub fn of(dtype: DType) -> ElemType {
        match dtype {
            DType::Fp16 => ElemType::F16,
            DType::Bf16 => ElemType::Bf16,
        }
    }

    /// Parses PyTorch's / NumPy's names (`torch.float16`, `float16`, `half`, `bfloat16`, ...).
    pub fn parse(name: &str) -> ElemType {
        match name.strip_prefix("torch.").unwrap_or(name) {
            "float16" | "half" | "f16" => ElemType::F16,
            "bfloat16" | "bf16" => ElemType::Bf16,
            "float32" | "float" | "f32" => ElemType::F32,
            _ => ElemType::Other(name.to_string()),
        }
    }

    pub fn size(&self) -> usize {
        match self {
            ElemType::F16 | ElemType::Bf16 => 2,
            ElemType::F32 => 4,
            ElemType::Other(_) => 0,
        }
    }

    pub fn name(&self) -> &str {
        match self {
            ElemType::F16 => "float16",
            ElemType::Bf16 => "bfloat16",
            ElemType::F32 => "float32",
            ElemType::Other(s) => s,
        }
    }
}

/// Where the owner says a tensor lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorDevice {
    Cuda(usize),
    /// `cpu`, `meta`, ... by the owner's name.
    Other(String),
}

/// A tensor in memory the cache does not own.
#[derive(Clone, Debug, PartialEq)]
pub struct ExternalTensor {
    /// Device address of element 0 (PyTorch's `data_ptr()`).
    pub ptr: u64,
    pub elem: ElemType,
    pub shape: Vec<usize>,
    /// Strides in elements (PyTorch's `stride()`).
    pub strides: Vec<i64>,
    pub device: TensorDevice,
}

impl ExternalTensor {
    /// A contiguous CUDA tensor (tests and Rust callers holding their own buffers).
    pub fn contiguous(ptr: u64, elem: ElemType, shape: &[usize], ordinal: usize) -> ExternalTensor {
        let mut strides = vec![1i64; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1] as i64;
        }
        ExternalTensor { ptr, elem, shape: shape.to_vec(), strides, device: TensorDevice::Cuda(ordinal) }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn bytes(&self) -> usize {
        self.numel() * self.elem.size()
    }

    /// Row-major contiguous: every stride is the product of the later dims (dims of size 1
    /// may have any stride, as PyTorch allows).
    pub fn is_contiguous(&self) -> bool {
        let mut want = 1i64;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != want {
                return false;
            }
            want *= n as i64;
        }
        true
    }

    /// Checks the owner's claims against what an argument must be: on `cuda:ordinal`, of
    /// element type `elem`, of shape `dims` (named, for the message), contiguous and aligned.
    /// Every problem is named in one error (device first), so that a caller fixes them in one
    /// go rather than one per attempt. Host-only: no driver call.
    pub fn check(&self, name: &str, elem: &ElemType, dims: &[(&str, usize)], ordinal: usize) -> Result<()> {
        let mut problems = Vec::new();
        match &self.device {
            TensorDevice::Cuda(i) if *i == ordinal => {}
            TensorDevice::Cuda(i) => problems.push(format!("`{name}` is on cuda:{i} but the cache is on cuda:{ordinal}")),
            TensorDevice::Other(d) => problems.push(format!("`{name}` is on {d}; kvforge needs a CUDA tensor on cuda:{ordinal} (use .to('cuda:{ordinal}'))")),
        }
        if &self.elem != elem {
            problems.push(format!("`{name}` is {} but must be {}", self.elem.name(), elem.name()));
        }
        let want: Vec<usize> = dims.iter().map(|d| d.1).collect();
        if self.shape != want || self.strides.len() != self.shape.len() {
            let named: Vec<String> = dims.iter().map(|(n, v)| format!("{n}={v}")).collect();
            problems.push(format!("`{name}` has shape {:?}; expected [{}]", self.shape, named.join(", ")));
        }
        if !self.is_contiguous() {
            problems.push(format!("`{name}` is not contiguous (shape {:?}, strides {:?}); pass `{name}.contiguous()`", self.shape, self.strides));
        }
        if self.numel() > 0 {
            if self.ptr == 0 {
                problems.push(format!("`{name}` has a null data pointer"));
            } else if self.elem.size() > 0 && !self.ptr.is_multiple_of(self.elem.size() as u64) {
                problems.push(format!("`{name}` data pointer {:#x} is not aligned to its {}-byte elements", self.ptr, self.elem.size()));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(bad(problems.join("; ")))
        }
    }

    /// Checks the rank before the dims are known (so a later message can name them).
    pub fn check_rank(&self, name: &str, rank: usize, what: &str) -> Result<()> {
        if self.shape.len() != rank {
            return Err(bad(format!("`{name}` has shape {:?}; expected {rank} dims {what}", self.shape)));
        }
        Ok(())
    }

    fn span(&self) -> (u64, u64) {
        (self.ptr, self.ptr + self.bytes() as u64)
    }
}

fn bad(msg: String) -> RtError {
    RtError::BadInput(msg)
}

/// The tokens of a page list at logical positions below `len`: `pages` are
/// `(page, valid tokens, first position)` in order ([`KvCache::positioned_pages`]); pages
/// starting at or after `len` are left out and the page holding position `len - 1` is cut.
/// Dropped pages are simply absent, so a head may attend fewer than `len` tokens (or none,
/// when every earlier page was dropped). Errors when `len` is 0 (a query must attend
/// something) or exceeds the sequence's logical length `total`.
pub fn prefix_pages(pages: &[(PageRef, usize, usize)], len: usize, total: usize) -> Result<Vec<(PageRef, usize)>> {
    if len == 0 || len > total {
        return Err(bad(format!("prefix length {len} must be in 1..={total} (the sequence's cached tokens)")));
    }
    Ok(pages.iter().filter(|&&(_, n, first)| n > 0 && first < len).map(|&(p, n, first)| (p, n.min(len - first))).collect())
}

/// The largest batch one decode launch takes: the batch is the grid's z dimension.
pub const MAX_BATCH: usize = 65535;

impl KvCache {
    /// Checks, with the driver, that `[t.ptr, t.ptr + bytes)` is device memory of this cache's
    /// GPU inside one allocation. Call after [`ExternalTensor::check`].
    pub fn check_device_memory(&self, name: &str, t: &ExternalTensor) -> Result<()> {
        if t.numel() == 0 {
            return Ok(());
        }
        let ordinal = self.engine.dev().ctx.ordinal();
        let get = |attr: CUpointer_attribute, out: *mut std::ffi::c_void| {
            self.engine.dev().ctx.bind_to_thread().map_err(drv("bind context"))?;
            // SAFETY: `out` points at a live local of the attribute's size (u32 memory type,
            // i32 ordinal, u64 range start and size); the driver only reads `t.ptr` as a number.
            unsafe { cudarc::driver::sys::cuPointerGetAttribute(out, attr, t.ptr).result() }.map_err(|e| bad(format!("`{name}` (address {:#x}) is not CUDA device memory: {e}", t.ptr)))
        };
        let mut mem_type: u32 = 0;
        get(CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, &mut mem_type as *mut u32 as *mut _)?;
        if mem_type != cudarc::driver::sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(bad(format!("`{name}` (address {:#x}) is not CUDA device memory (memory type {mem_type})", t.ptr)));
        }
        let mut dev_ordinal: i32 = -1;
        get(CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, &mut dev_ordinal as *mut i32 as *mut _)?;
        if dev_ordinal != ordinal as i32 {
            return Err(bad(format!("`{name}` is memory of cuda:{dev_ordinal} but the cache is on cuda:{ordinal}")));
        }
        let (mut start, mut size) = (0u64, 0u64);
        // Range queries are not answered for every kind of mapping (e.g. some virtual-memory
        // mappings); where they are, the tensor must fit inside its allocation.
        if get(CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, &mut start as *mut u64 as *mut _).is_ok()
            && get(CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE, &mut size as *mut u64 as *mut _).is_ok()
            && size > 0
        {
            let (a, b) = t.span();
            if a < start || b > start + size {
                return Err(bad(format!("`{name}` spans [{a:#x}, {b:#x}) but its allocation is [{start:#x}, {:#x}): shape or strides overstate the storage", start + size)));
            }
        }
        Ok(())
    }

    pub(crate) fn check_all(&self, args: &[(&str, &ExternalTensor, ElemType, Vec<(&str, usize)>)]) -> Result<()> {
        let ordinal = self.engine.dev().ctx.ordinal();
        for (name, t, elem, dims) in args {
            t.check(name, elem, dims, ordinal)?;
        }
        for (name, t, ..) in args {
            self.check_device_memory(name, t)?;
        }
        Ok(())
    }

    /// Checks an append's arguments (`seq` exists; `k`, `v` are `[T][num_kv_heads][head_dim]`
    /// in the spec dtype on this cache's device) and returns T.
    pub(crate) fn check_append(&self, seq: usize, k: &ExternalTensor, v: &ExternalTensor) -> Result<usize> {
        self.seq_len(seq)?;
        k.check_rank("k", 3, "[T, num_kv_heads, head_dim]")?;
        let n = k.shape[0];
        let elem = ElemType::of(self.spec.geometry.dtype);
        let dims = vec![("T", n), ("num_kv_heads", self.cfg.num_kv_heads), ("head_dim", self.cfg.head_dim)];
        self.check_all(&[("k", k, elem.clone(), dims.clone()), ("v", v, elem, dims)])?;
        Ok(n)
    }

    /// Appends `k`, `v` (`[n][num_kv_heads][head_dim]` in the spec dtype, device memory) to
    /// `seq`; the same semantics as [`KvCache::append`] (all or nothing; full pages are
    /// encoded into the target tier). Synchronises the cache's stream.
    pub fn append_external(&mut self, seq: usize, k: &ExternalTensor, v: &ExternalTensor) -> Result<()> {
        let (hkv, d) = (self.cfg.num_kv_heads, self.cfg.head_dim);
        let n = self.check_append(seq, k, v)?;
        if n == 0 {
            return Ok(());
        }
        let dtype = self.spec.geometry.dtype;
        let mut kh = vec![0u16; n * hkv * d];
        let mut vh = vec![0u16; n * hkv * d];
        let st = self.engine.dev().stream.clone();
        // SAFETY: both sources were checked to be `n·hkv·d` 16-bit elements of device memory
        // of this context; the host buffers have exactly that size; the synchronize below
        // keeps them alive until the copies land.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut kh, k.ptr, st.cu_stream()).map_err(drv("k download"))?;
            cudarc::driver::result::memcpy_dtoh_async(&mut vh, v.ptr, st.cu_stream()).map_err(drv("v download"))?;
        }
        st.synchronize().map_err(drv("k/v download"))?;
        let kf: Vec<f32> = kh.iter().map(|&b| crate::from_bits(dtype, b)).collect();
        let vf: Vec<f32> = vh.iter().map(|&b| crate::from_bits(dtype, b)).collect();
        self.append(seq, &kf, &vf)
    }

    /// Plans one entry per `lengths[i]`: sequence `seq` cut after `lengths[i]` tokens.
    pub fn plan_prefix(&self, seq: usize, lengths: &[usize]) -> Result<DecodePlan> {
        if lengths.is_empty() || lengths.len() > MAX_BATCH {
            return Err(bad(format!("attend_prefix takes 1..={MAX_BATCH} queries, got {}", lengths.len())));
        }
        let hkv = self.cfg.num_kv_heads;
        let heads: Vec<Vec<(PageRef, usize, usize)>> = (0..hkv).map(|h| self.positioned_pages(seq, h)).collect::<Result<_>>()?;
        let total = self.seq_len(seq)?;
        let pages: Vec<Vec<Vec<(PageRef, usize)>>> = lengths
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                heads
                    .iter()
                    .map(|h| {
                        prefix_pages(h, len, total).map_err(|e| match e {
                            RtError::BadInput(m) => bad(format!("lengths[{i}]: {m}")),
                            e => e,
                        })
                    })
                    .collect::<Result<_>>()
            })
            .collect::<Result<_>>()?;
        if self.cfg.verify_headers {
            self.verify_pages(&[seq])?;
        }
        self.plan_pages(&pages)
    }

    /// Launches `plan` on external tensors: `q`, `out` `[batch][q heads][head_dim]` in the spec
    /// dtype, `lse` `[batch][q heads]` f32 (natural log). Does not synchronise; call
    /// [`KvCache::check`] to turn kernel-reported page faults into errors.
    pub fn run_external(&mut self, plan: &DecodePlan, ws: &DecodeWorkspace, q: &ExternalTensor, out: &ExternalTensor, lse: &ExternalTensor) -> Result<()> {
        self.check_decode_io(plan.batch, q, out, lse)?;
        if ws.page_offsets.len() != plan.page_offsets.len() || ws.page_indptr.len() != plan.page_indptr.len() {
            return Err(bad("workspace was made for another plan".into()));
        }
        self.launch_io(plan, ws, DecodeIo { q: q.ptr, out: out.ptr, lse: lse.ptr })
    }

    /// Checks a decode launch's tensors for `batch` entries: `q`, `out` `[batch][q heads]
    /// [head_dim]` in the spec dtype, `lse` `[batch][q heads]` f32, device memory of this
    /// cache's GPU, pairwise disjoint.
    pub(crate) fn check_decode_io(&self, batch: usize, q: &ExternalTensor, out: &ExternalTensor, lse: &ExternalTensor) -> Result<()> {
        if batch > MAX_BATCH {
            return Err(bad(format!("a decode launch takes at most {MAX_BATCH} entries, the plan has {batch}")));
        }
        let hq = self.cfg.num_kv_heads * self.cfg.gqa;
        let elem = ElemType::of(self.spec.geometry.dtype);
        let rows = vec![("batch", batch), ("num_q_heads", hq), ("head_dim", self.cfg.head_dim)];
        self.check_all(&[("q", q, elem.clone(), rows.clone()), ("out", out, elem, rows), ("lse", lse, ElemType::F32, vec![("batch", batch), ("num_q_heads", hq)])])?;
        let overlap = |a: &ExternalTensor, b: &ExternalTensor| a.span().0 < b.span().1 && b.span().0 < a.span().1;
        for (x, y, nx, ny) in [(q, out, "q", "out"), (q, lse, "q", "lse"), (out, lse, "out", "lse")] {
            if overlap(x, y) {
                return Err(bad(format!("`{nx}` and `{ny}` overlap in memory; pass separate tensors")));
            }
        }
        Ok(())
    }

    /// Plans, launches and checks one decode step of `seqs` on external tensors.
    pub fn decode_external(&mut self, seqs: &[usize], q: &ExternalTensor, out: &ExternalTensor, lse: &ExternalTensor) -> Result<()> {
        let plan = self.plan(seqs)?;
        let ws = self.workspace(&plan)?;
        self.run_external(&plan, &ws, q, out, lse)?;
        self.check(&plan)
    }

    /// [`decode_external`](Self::decode_external) that also folds every page's share of the
    /// attention mass into RDR's importance window on the device, as
    /// [`KvCache::decode_tracked`] does (read it with [`KvCache::take_mass_window`]).
    pub fn decode_tracked_external(&mut self, seqs: &[usize], q: &ExternalTensor, out: &ExternalTensor, lse: &ExternalTensor) -> Result<()> {
        let plan = self.plan(seqs)?;
        let mut ws = self.mass_workspace(&plan)?;
        self.track_window(&plan, &mut ws, seqs)?;
        self.run_external(&plan, &ws, q, out, lse)?;
        self.check(&plan)
    }

    /// Query `i` of `q` (`[lengths.len()][q heads][head_dim]`) attends the first `lengths[i]`
    /// cached tokens of `seq`, in one launch; outputs as [`KvCache::run_external`]. With
    /// `lengths[i] = i + 1` over a freshly appended prompt this is causal self-attention of
    /// the prompt against the cache as stored (every full page in the target tier).
    pub fn attend_prefix_external(&mut self, seq: usize, lengths: &[usize], q: &ExternalTensor, out: &ExternalTensor, lse: &ExternalTensor) -> Result<()> {
        let plan = self.plan_prefix(seq, lengths)?;
        let ws = self.workspace(&plan)?;
        self.run_external(&plan, &ws, q, out, lse)?;
        self.check(&plan)
    }

    /// Makes the cache's stream wait for the work submitted so far to `stream` (e.g. PyTorch's
    /// current stream, which wrote the inputs). No-op when `stream` is the cache's own stream.
    ///
    /// # Safety
    /// `stream` must be a live CUDA stream of this cache's context (or 0, the legacy default
    /// stream) for the duration of the call.
    pub unsafe fn wait_for_stream(&self, stream: u64) -> Result<()> {
        if stream as CUstream == self.engine.dev().stream.cu_stream() {
            return Ok(());
        }
        // SAFETY: the caller guarantees `stream` is a live stream of this context.
        let other = unsafe { self.engine.dev().ctx.wrap_borrowed_stream(stream as CUstream) };
        self.engine.dev().stream.join(&other).map_err(drv("wait for the caller's stream"))
    }

    /// Makes `stream` wait for the work submitted so far to the cache's stream (so the
    /// caller's later work sees the outputs). No-op when `stream` is the cache's own stream.
    ///
    /// # Safety
    /// As [`KvCache::wait_for_stream`].
    pub unsafe fn signal_stream(&self, stream: u64) -> Result<()> {
        if stream as CUstream == self.engine.dev().stream.cu_stream() {
            return Ok(());
        }
        // SAFETY: the caller guarantees `stream` is a live stream of this context.
        let other = unsafe { self.engine.dev().ctx.wrap_borrowed_stream(stream as CUstream) };
        other.join(&self.engine.dev().stream).map_err(drv("order the caller's stream after the cache"))
    }

    /// The raw stream the cache submits to (0: the legacy default stream).
    pub fn stream_handle(&self) -> u64 {
        self.engine.dev().stream.cu_stream() as u64
    }

    /// Device address of the page arena (tests: external tensors must not alias it).
    pub fn arena_ptr(&self) -> u64 {
        self.store.arena_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pr(tier: u8, offset: u64) -> PageRef {
        PageRef { tier, index: 0, offset }
    }

    #[test]
    fn prefix_cuts_the_last_page() {
        let pages = vec![(pr(1, 0), 64, 0), (pr(1, 100), 64, 64), (pr(0, 200), 10, 128)];
        let two = |v: &[(PageRef, usize, usize)]| v.iter().map(|&(p, n, _)| (p, n)).collect::<Vec<_>>();
        assert_eq!(prefix_pages(&pages, 1, 138).unwrap(), vec![(pr(1, 0), 1)]);
        assert_eq!(prefix_pages(&pages, 64, 138).unwrap(), vec![(pr(1, 0), 64)]);
        assert_eq!(prefix_pages(&pages, 65, 138).unwrap(), vec![(pr(1, 0), 64), (pr(1, 100), 1)]);
        assert_eq!(prefix_pages(&pages, 130, 138).unwrap(), vec![(pr(1, 0), 64), (pr(1, 100), 64), (pr(0, 200), 2)]);
        assert_eq!(prefix_pages(&pages, 138, 138).unwrap(), two(&pages));
        assert!(matches!(prefix_pages(&pages, 0, 138), Err(RtError::BadInput(_))));
        assert!(matches!(prefix_pages(&pages, 139, 138), Err(RtError::BadInput(_))));
        for len in 1..=138 {
            let p = prefix_pages(&pages, len, 138).unwrap();
            assert_eq!(p.iter().map(|x| x.1).sum::<usize>(), len);
            assert!(p.iter().all(|x| x.1 > 0));
            assert_eq!(p[..p.len() - 1], two(&pages)[..p.len() - 1]);
        }
    }

    #[test]
    fn prefix_skips_dropped_pages_by_position() {
        // Page [64, 128) was dropped: positions keep counting past it.
        let pages = vec![(pr(1, 0), 64, 0), (pr(2, 300), 64, 128), (pr(0, 200), 10, 192)];
        assert_eq!(prefix_pages(&pages, 64, 202).unwrap(), vec![(pr(1, 0), 64)]);
        // A query inside the dropped range sees only what precedes it.
        assert_eq!(prefix_pages(&pages, 100, 202).unwrap(), vec![(pr(1, 0), 64)]);
        assert_eq!(prefix_pages(&pages, 129, 202).unwrap(), vec![(pr(1, 0), 64), (pr(2, 300), 1)]);
        assert_eq!(prefix_pages(&pages, 202, 202).unwrap().iter().map(|x| x.1).sum::<usize>(), 138);
        // Every early page dropped: the head attends nothing (empty list, not an error).
        let late = vec![(pr(2, 300), 64, 128)];
        assert!(prefix_pages(&late, 100, 192).unwrap().is_empty());
    }

    #[test]
    fn prefix_plans_one_entry_per_length() {
        let spec = kvforge_spec::Spec::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/rdkv.toml")).unwrap();
        let head = vec![(pr(3, 0), 64, 0), (pr(3, 8192), 64, 64), (pr(0, 65536), 5, 128)];
        let lengths = [1usize, 64, 65, 133];
        let pages: Vec<Vec<Vec<(PageRef, usize)>>> = lengths.iter().map(|&l| vec![prefix_pages(&head, l, 133).unwrap(); 3]).collect();
        let p = crate::plan(&spec, 64, 3, &pages, &|_| 1000, &|_| 264).unwrap();
        assert_eq!(p.batch, 4);
        // Per (entry, head): 1, 1, 2, 3 pages.
        let per: Vec<u32> = p.page_indptr.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(per, [[1; 3], [1; 3], [2; 3], [3; 3]].concat());
        // The cut page's info carries the cut length.
        assert_eq!(p.page_info[0], 3 | 1 << 8);
        assert_eq!(p.page_info[p.page_indptr[6] as usize + 1], 3 | 1 << 8);
        assert_eq!(*p.page_info.last().unwrap(), 5 << 8);
    }

    fn t(shape: &[usize]) -> ExternalTensor {
        ExternalTensor::contiguous(0x7f00_0000_0000, ElemType::F16, shape, 0)
    }

    #[test]
    fn tensor_checks_name_what_is_wrong() {
        let dims = [("T", 5), ("num_kv_heads", 3), ("head_dim", 64)];
        assert!(t(&[5, 3, 64]).check("k", &ElemType::F16, &dims, 0).is_ok());
        let msg = |r: Result<()>| r.unwrap_err().to_string();
        assert!(msg(t(&[5, 3, 32]).check("k", &ElemType::F16, &dims, 0)).contains("expected [T=5, num_kv_heads=3, head_dim=64]"));
        assert!(msg(t(&[5, 3, 64]).check("k", &ElemType::Bf16, &dims, 0)).contains("is float16 but must be bfloat16"));
        assert!(msg(t(&[5, 3, 64]).check("k", &ElemType::F16, &dims, 1)).contains("cuda:0 but the cache is on cuda:1"));
        let mut cpu = t(&[5, 3, 64]);
        cpu.device = TensorDevice::Other("cpu".into());
        assert!(msg(cpu.check("k", &ElemType::F16, &dims, 0)).contains("is on cpu"));
        // A transposed view: same shape, wrong strides.
        let mut tr = t(&[5, 3, 64]);
        tr.strides = vec![64, 320, 1];
        assert!(msg(tr.check("k", &ElemType::F16, &dims, 0)).contains("not contiguous"));
        // Several problems are named together, the device first.
        tr.device = TensorDevice::Other("cpu".into());
        let both = msg(tr.check("k", &ElemType::Bf16, &dims, 0));
        assert!(both.contains("`k` is on cpu") && both.contains("is float16 but must be bfloat16") && both.contains("not contiguous"), "{both}");
        assert!(both.find("is on cpu") < both.find("not contiguous"), "{both}");
        // Size-1 dims may have any stride.
        let mut one = t(&[1, 3, 64]);
        one.strides[0] = 12345;
        assert!(one.check("k", &ElemType::F16, &[("T", 1), ("num_kv_heads", 3), ("head_dim", 64)], 0).is_ok());
        let mut odd = t(&[5, 3, 64]);
        odd.ptr += 1;
        assert!(msg(odd.check("k", &ElemType::F16, &dims, 0)).contains("not aligned"));
        let mut null = t(&[5, 3, 64]);
        null.ptr = 0;
        assert!(msg(null.check("k", &ElemType::F16, &dims, 0)).contains("null"));
        assert!(msg(t(&[5, 3]).check_rank("k", 3, "[T, Hkv, D]")).contains("expected 3 dims"));
        assert_eq!(ElemType::parse("torch.float16"), ElemType::F16);
        assert_eq!(ElemType::parse("torch.bfloat16"), ElemType::Bf16);
        assert_eq!(ElemType::parse("torch.float64"), ElemType::Other("torch.float64".into()));
        assert!(msg(ExternalTensor { elem: ElemType::parse("torch.float64"), ..t(&[5, 3, 64]) }.check("k", &ElemType::F16, &dims, 0)).contains("torch.float64 but must be float16"));
    }
}
