//! `kvforge._native`: the Python face of kvforge-rt.
//!
//! Tensors cross the boundary as what PyTorch says about them (`data_ptr()`, `shape`,
//! `stride()`, `dtype`, `device`), read through ordinary attribute access, so the extension
//! links neither libtorch nor libpython (abi3) and works with any torch build. The runtime
//! validates every claim before a launch ([`kvforge_rt::external`]). Every error, including a
//! Rust panic, reaches Python as `kvforge.KvforgeError` (a `ValueError` and a `RuntimeError`)
//! whose `kind` names the runtime's error variant.
//!
//! Streams: the runtime submits to the context's legacy default stream. Each call makes that
//! stream wait for PyTorch's current stream before touching the inputs and, after its
//! launches, makes PyTorch's current stream wait for it, so the outputs are ordered for
//! whatever PyTorch runs next. (cudarc can wrap a borrowed stream, but the cache's kernels,
//! page uploads and error-flag reads are issued on one stream that it owns for its lifetime;
//! event joins at the boundary keep that invariant and cost no host synchronisation.) The one
//! exception is `Cache.graph_launch`, which launches a prepared decode step straight on the
//! stream it is given (torch's capturing stream) with no join, so that a CUDA graph holds it.
//! A caller that has torch's current `cuda_stream` at hand may pass it as `stream=` to the
//! per-step calls (`step`, `graph_prepare`, `graph_commit`) to save the lookup.
//! PyTorch and kvforge share the device's primary context: cudarc's `CudaContext::new` retains
//! it, as the CUDA runtime under PyTorch does.

mod certified;
mod control;
mod kvtc;
mod paris;

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kvforge_rt::{CacheConfig, DecodePlan, DecodeWorkspace, Device, ElemType, ExternalTensor, KvCache, RtError, TensorDevice};
use kvforge_spec::{Spec, TierId, TAIL_TIER};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

// ---------------------------------------------------------------------------------------------
// Errors

/// The runtime error variant's name, exposed as `KvforgeError.kind`: the leading identifier
/// of the derived `Debug` form, so a variant added to `RtError` needs no change here.
fn kind(e: &RtError) -> String {
    let dbg = format!("{e:?}");
    dbg.split(|c: char| !c.is_alphanumeric() && c != '_').next().filter(|s| !s.is_empty()).unwrap_or("Error").to_string()
}

/// `kvforge.KvforgeError(message, kind)`; defined in Python (`kvforge/_errors.py`) so it can
/// derive from both `ValueError` and `RuntimeError`.
fn py_error(py: Python<'_>, kind: &str, msg: String) -> PyErr {
    let made = py.import("kvforge._errors").and_then(|m| m.getattr("KvforgeError")).and_then(|cls| cls.call1((msg.clone(), kind)));
    match made {
        Ok(inst) => PyErr::from_value(inst),
        // Only when the extension is imported outside its package.
        Err(_) => PyRuntimeError::new_err(format!("{kind}: {msg}")),
    }
}

/// Argument extractors for unsigned parameters (`#[pyo3(from_py_with = ...)]`): a negative,
/// oversized or non-integer value is a `KvforgeError` (kind `BadInput`), not the bare
/// `OverflowError` / `TypeError` of the default conversion. PyO3 adds the note "while
/// processing '<argument>'" to it, which `KvforgeError.__str__` puts in front of the message.
fn unsigned<T: TryFrom<u64>>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<T> {
    let py = obj.py();
    // Whatever the default conversion takes (ints, and objects with `__index__` such as numpy
    // and torch integer scalars) still converts.
    if let Some(v) = obj.extract::<u64>().ok().and_then(|v| T::try_from(v).ok()) {
        return Ok(v);
    }
    let shown = obj.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
    if obj.hasattr("__index__").unwrap_or(false) {
        Err(bad(py, format!("must be {what}, got {shown}")))
    } else {
        let ty = obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
        Err(bad(py, format!("must be {what}, not {ty} {shown}")))
    }
}

pub(crate) fn nat(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    unsigned(obj, "a non-negative integer")
}

pub(crate) fn nat_u64(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    unsigned(obj, "a non-negative integer below 2**64")
}

/// `obj`'s repr and type name, for argument errors.
fn shown(obj: &Bound<'_, PyAny>) -> (String, String) {
    let repr = obj.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
    let ty = obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
    (repr, ty)
}

/// A real number: ints, floats and objects with `__float__` (numpy and torch scalars).
pub(crate) fn real(obj: &Bound<'_, PyAny>) -> PyResult<f64> {
    obj.extract::<f64>().map_err(|_| {
        let (repr, ty) = shown(obj);
        bad(obj.py(), format!("must be a real number, not {ty} {repr}"))
    })
}

/// A real number or None.
pub(crate) fn opt_real(obj: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
    if obj.is_none() {
        Ok(None)
    } else {
        real(obj).map(Some)
    }
}

/// A non-negative integer or None.
pub(crate) fn opt_nat(obj: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    if obj.is_none() {
        Ok(None)
    } else {
        nat(obj).map(Some)
    }
}

/// True or False (not any truthy object: `check="no"` is a mistake, not True).
pub(crate) fn flag(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    obj.extract::<bool>().map_err(|_| {
        let (repr, ty) = shown(obj);
        bad(obj.py(), format!("must be True or False, not {ty} {repr}"))
    })
}

/// A sequence of non-negative integers (`seqs=[...]`).
pub(crate) fn nats(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let py = obj.py();
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(bad(py, "must be a sequence of non-negative integers, not str"));
    }
    let it = obj.try_iter().map_err(|_| bad(py, "must be a sequence of non-negative integers"))?;
    it.enumerate().map(|(i, x)| x.and_then(|x| unsigned::<usize>(&x, "a non-negative integer")).map_err(|e| bad(py, format!("[{i}]: {}", e.value(py))))).collect()
}

fn rt_err(py: Python<'_>, e: RtError) -> PyErr {
    py_error(py, &kind(&e), e.to_string())
}

fn bad(py: Python<'_>, msg: impl Into<String>) -> PyErr {
    py_error(py, "BadInput", msg.into())
}

trait OrPy<T> {
    fn or_py(self, py: Python<'_>) -> PyResult<T>;
}
impl<T> OrPy<T> for Result<T, RtError> {
    fn or_py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| rt_err(py, e))
    }
}

/// Runs `f`, turning a Rust panic into `KvforgeError(kind="Panic")` rather than letting it
/// reach the interpreter (PyO3 would raise `PanicException`, a `BaseException` that ordinary
/// `except Exception` does not catch).
fn guarded<T>(py: Python<'_>, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let what = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "unknown panic".into());
            Err(py_error(py, "Panic", format!("internal error (please report): {what}")))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tensors

/// Reads what a torch tensor (or anything with the same attributes) says about itself.
fn tensor(py: Python<'_>, obj: &Bound<'_, PyAny>, name: &str) -> PyResult<ExternalTensor> {
    let not_tensor = || bad(py, format!("`{name}` must be a torch tensor, got {}", obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())));
    let (Ok(ptr), Ok(shape), Ok(stride), Ok(dtype), Ok(device)) = (obj.call_method0("data_ptr"), obj.getattr("shape"), obj.call_method0("stride"), obj.getattr("dtype"), obj.getattr("device")) else {
        return Err(not_tensor());
    };
    let ptr: u64 = ptr.extract().map_err(|_| not_tensor())?;
    let shape: Vec<usize> = shape.try_iter().and_then(|it| it.map(|d| d.and_then(|d| d.extract::<usize>())).collect::<PyResult<Vec<usize>>>()).map_err(|_| not_tensor())?;
    let strides: Vec<i64> = stride.try_iter().and_then(|it| it.map(|d| d.and_then(|d| d.extract::<i64>())).collect::<PyResult<Vec<i64>>>()).map_err(|_| not_tensor())?;
    let elem = ElemType::parse(&dtype.str()?.to_string());
    let dev_type: String = device.getattr("type").and_then(|t| t.extract()).unwrap_or_else(|_| device.to_string());
    let device = if dev_type == "cuda" {
        let index: Option<usize> = device.getattr("index").ok().and_then(|i| i.extract().ok()).flatten();
        TensorDevice::Cuda(index.unwrap_or(0))
    } else {
        TensorDevice::Other(dev_type)
    };
    Ok(ExternalTensor { ptr, elem, shape, strides, device })
}

/// Lengths as a list of ints, also from a tensor (through `tolist()`).
fn lengths(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let list = if obj.hasattr("tolist")? { obj.call_method0("tolist")? } else { obj.clone() };
    let v: Vec<i64> = list.extract().map_err(|_| bad(py, "`lengths` must be a sequence of ints"))?;
    v.iter().enumerate().map(|(i, &x)| usize::try_from(x).map_err(|_| bad(py, format!("lengths[{i}] = {x} is negative")))).collect()
}

// ---------------------------------------------------------------------------------------------
// Devices

/// One open device per ordinal for the process: every cache on a GPU shares its context
/// handle (the primary context, which PyTorch uses too).
fn device(py: Python<'_>, ordinal: usize) -> PyResult<Arc<Device>> {
    static DEVICES: Mutex<Option<HashMap<usize, Arc<Device>>>> = Mutex::new(None);
    let mut g = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    let map = g.get_or_insert_with(HashMap::new);
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = Arc::new(Device::open(ordinal).or_py(py)?);
    map.insert(ordinal, d.clone());
    Ok(d)
}

/// PyTorch's current stream on `cuda:ordinal` as a raw handle (0 = legacy default stream),
/// or the legacy default stream when torch is not importable (Rust-allocated buffers only).
fn torch_stream(py: Python<'_>, ordinal: usize) -> PyResult<u64> {
    let Ok(torch) = py.import("torch") else { return Ok(0) };
    let s = torch.getattr("cuda")?.call_method1("current_stream", (ordinal,))?;
    s.getattr("cuda_stream")?.extract()
}

fn torch(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("torch").map_err(|e| py_error(py, "NoTorch", format!("outputs are torch tensors, but torch could not be imported: {e}")))
}

/// `torch.empty(shape, dtype=like.dtype or float32, device=like.device)`.
fn empty<'py>(py: Python<'py>, shape: &[usize], like: &Bound<'py, PyAny>, f32: bool) -> PyResult<Bound<'py, PyAny>> {
    let torch = torch(py)?;
    let kw = PyDict::new(py);
    kw.set_item("dtype", if f32 { torch.getattr("float32")? } else { like.getattr("dtype")? })?;
    kw.set_item("device", like.getattr("device")?)?;
    torch.call_method("empty", (PyTuple::new(py, shape)?,), Some(&kw))
}

#[pyfunction]
#[pyo3(signature = (device = 0))]
/// Waits for kvforge's work on GPU `device`, then returns the memory of dropped caches to the
/// driver (like ``torch.cuda.empty_cache()`` for kvforge): freed pages stay in the device's
/// memory pool until a synchronisation, where PyTorch cannot allocate them. Call it after
/// ``del cache`` when PyTorch allocates next.
fn empty_cache(py: Python<'_>, device: usize) -> PyResult<()> {
    let d = self::device(py, device)?;
    guarded(py, || d.release_free_memory().or_py(py))
}

#[pyfunction]
#[pyo3(signature = (device = 0))]
/// Facts about GPU `device` as a dict (name, arch, compute_capability, sm_count, total_mem,
/// l2_bytes, max_smem_per_block); raises KvforgeError (kind NoDriver / NoDevice) without one.
fn device_info(py: Python<'_>, #[pyo3(from_py_with = crate::nat)] device: usize) -> PyResult<Py<PyDict>> {
    guarded(py, || {
        let d = self::device(py, device)?;
        let i = &d.info;
        let out = PyDict::new(py);
        out.set_item("name", &i.name)?;
        out.set_item("arch", i.arch())?;
        out.set_item("compute_capability", i.compute_capability)?;
        out.set_item("sm_count", i.sm_count)?;
        out.set_item("total_mem", i.total_mem)?;
        out.set_item("l2_bytes", i.l2_bytes)?;
        out.set_item("max_smem_per_block", i.max_smem_per_block)?;
        out.set_item("ordinal", device)?;
        Ok(out.unbind())
    })
}

#[pyfunction]
#[pyo3(signature = (spec, root = None))]
/// Tokens per page of spec `spec` (a TOML path, resolved as `Cache`'s: against `root`, then
/// `$KVFORGE_ROOT`), without a device: what page counts such as `RetrievalCache`'s
/// `sink_pages` are in.
fn spec_page_tokens(py: Python<'_>, spec: &str, root: Option<&str>) -> PyResult<usize> {
    let path = crate::resolve_spec(spec, root).map_err(|m| crate::py_error(py, "Spec", m))?;
    let s = Spec::load(&path).map_err(|e| crate::py_error(py, "Spec", e.to_string()))?;
    Ok(s.page.tokens)
}

#[pyfunction]
/// True when libcuda can be loaded.
fn driver_present() -> bool {
    kvforge_rt::driver_present()
}

#[pyfunction]
/// True when libnvrtc can be loaded (kernels are compiled with it at first use).
fn nvrtc_present() -> bool {
    kvforge_rt::nvrtc_present()
}

#[pyfunction]
#[pyo3(signature = (tensor, name, shape, dtype = "float16", device = 0))]
/// Checks that `tensor` is a contiguous CUDA tensor on `cuda:device` of `dtype` and `shape`
/// (host-side, no driver call); raises KvforgeError saying what is wrong. The checks every
/// Cache method applies to its tensor arguments.
fn check_tensor(py: Python<'_>, tensor: &Bound<'_, PyAny>, name: &str, #[pyo3(from_py_with = crate::nats)] shape: Vec<usize>, dtype: &str, #[pyo3(from_py_with = crate::nat)] device: usize) -> PyResult<()> {
    guarded(py, || {
        let t = self::tensor(py, tensor, name)?;
        let dims: Vec<(&str, usize)> = shape.iter().map(|&n| ("", n)).collect();
        let want = ElemType::parse(dtype);
        t.check(name, &want, &dims, device).map_err(|e| match e {
            // Unnamed dims read better as a plain list.
            RtError::BadInput(m) => bad(py, m.replace("=", "")),
            e => rt_err(py, e),
        })
    })
}

// ---------------------------------------------------------------------------------------------
// Cache

/// Finds a spec file: as given (absolute, or relative to the working directory), else
/// relative to `root`, else to `$KVFORGE_ROOT` (the kvforge repository, which holds specs/
/// and codebooks/).
fn resolve_spec(spec: &str, root: Option<&str>) -> Result<PathBuf, String> {
    let p = Path::new(spec);
    let mut tried = Vec::new();
    let mut candidates = Vec::new();
    if p.is_absolute() {
        candidates.push(p.to_path_buf());
    } else {
        if let Some(r) = root {
            candidates.push(Path::new(r).join(p));
        }
        if let Ok(r) = std::env::var("KVFORGE_ROOT") {
            candidates.push(Path::new(&r).join(p));
        }
        candidates.push(p.to_path_buf());
    }
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    Err(format!("spec file `{spec}` not found (looked at: {}); pass root= or set KVFORGE_ROOT to the kvforge repository", tried.join(", ")))
}

/// Tier by name or id.
fn tier_id(py: Python<'_>, spec: &Spec, tier: &Bound<'_, PyAny>) -> PyResult<TierId> {
    if let Ok(name) = tier.extract::<String>() {
        return spec.tier(&name).map(|t| t.id).ok_or_else(|| {
            let names: Vec<&str> = spec.tiers.iter().map(|t| t.name.as_str()).collect();
            bad(py, format!("spec `{}` has no tier `{name}` (tiers: {})", spec.name, names.join(", ")))
        });
    }
    let id: usize = tier.extract().map_err(|_| bad(py, "a tier is a name (str) or an id (int)"))?;
    if id >= spec.tiers.len() {
        return Err(bad(py, format!("tier id {id} out of range: spec `{}` has {} tiers", spec.name, spec.tiers.len())));
    }
    Ok(id as TierId)
}

/// A paged, tiered KV cache of one attention layer on the GPU.
///
/// Cache(spec, head_dim, num_kv_heads, gqa, max_tokens, sequences=1, target=None, root=None,
///       device=0, verify_headers=False)
///
/// `spec` is a spec TOML path (relative paths are also looked up under `root` and
/// `$KVFORGE_ROOT`); `max_tokens` is the capacity per kv head summed over `sequences`;
/// `target` names the tier full pages are encoded into (default: the spec's most precise
/// ladder tier). Tensors are torch CUDA tensors in the spec dtype, contiguous.
#[pyclass(module = "kvforge", name = "Cache")]
struct Cache {
    inner: KvCache,
    /// Bumped by every change of the pages (append, retier, remove); plans remember it.
    generation: u64,
    ordinal: usize,
    spec_path: String,
}

/// Per-(layer, kv head, group) spherical codebooks (``kvforge codebook train --per-head``).
///
/// Codebooks(path): loads and checks the file (tensor ``codebooks`` [layers, kv_heads,
/// head_dim/group, entries, group], unit rows); ``Cache.set_codebook(tier, cb, layer=l)``
/// gives layer ``l``'s codebooks to a cache.
#[pyclass(module = "kvforge", name = "Codebooks", frozen)]
struct Codebooks {
    inner: kvforge_spec::codecs::spherical::HeadCodebooks,
}

#[pymethods]
impl Codebooks {
    #[new]
    fn new(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let inner = kvforge_spec::codecs::spherical::HeadCodebooks::load(&path, &path.display().to_string()).map_err(|e| bad(py, e.to_string()))?;
        Ok(Codebooks { inner })
    }
    #[getter]
    fn layers(&self) -> usize {
        self.inner.layers
    }
    #[getter]
    fn kv_heads(&self) -> usize {
        self.inner.kv_heads
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.head_dim
    }
    #[getter]
    fn group(&self) -> usize {
        self.inner.group
    }
    #[getter]
    fn entries(&self) -> usize {
        self.inner.entries
    }
    /// ``identity``, or ``hadamard:<seed>`` for codebooks trained on rotated keys.
    #[getter]
    fn basis(&self) -> String {
        self.inner.basis().to_string()
    }
    #[getter]
    fn metadata(&self) -> std::collections::HashMap<String, String> {
        self.inner.metadata.clone()
    }
    /// Layer ``l``'s codebooks as a flat list ``[kv head][group][codeword][channel]``.
    fn layer(&self, py: Python<'_>, l: usize) -> PyResult<Vec<f32>> {
        self.inner.layer(l).map(<[f32]>::to_vec).ok_or_else(|| bad(py, format!("layer {l}: the file has {} layers", self.inner.layers)))
    }
    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!("Codebooks(layers={}, kv_heads={}, head_dim={}, group={}, entries={}, basis={:?})", c.layers, c.kv_heads, c.head_dim, c.group, c.entries, c.basis())
    }
}

/// A planned decode of a fixed batch of sequences (FlashInfer's plan/run): the page table is
/// on the GPU, and `run(q)` only launches. Valid while the cache is unchanged since `plan()`
/// (an append or retier makes it stale: `run` then raises).
#[pyclass(module = "kvforge", name = "Plan")]
struct Plan {
    cache: Py<Cache>,
    plan: DecodePlan,
    ws: DecodeWorkspace,
    generation: u64,
    seqs: Vec<usize>,
}

impl Cache {
    fn hq(&self) -> usize {
        self.inner.config().num_kv_heads * self.inner.config().gqa
    }

    /// Runs `f` between the two stream joins of the module docs.
    fn on_torch_stream<T>(&mut self, py: Python<'_>, f: impl FnOnce(&mut KvCache) -> Result<T, RtError>) -> PyResult<T> {
        self.on_stream(py, None, f)
    }

    /// [`Cache::on_torch_stream`] with torch's current stream given by the caller (its
    /// `cuda_stream`), which saves looking it up; None looks it up. No join at all where it is
    /// the cache's own stream.
    fn on_stream<T>(&mut self, py: Python<'_>, stream: Option<u64>, f: impl FnOnce(&mut KvCache) -> Result<T, RtError>) -> PyResult<T> {
        let s = match stream {
            Some(s) => s,
            None => torch_stream(py, self.ordinal)?,
        };
        // SAFETY: `s` is PyTorch's current stream of this device, alive during the call; it
        // belongs to the primary context the cache uses.
        unsafe { self.inner.wait_for_stream(s) }.or_py(py)?;
        let r = f(&mut self.inner).or_py(py)?;
        // SAFETY: as above.
        unsafe { self.inner.signal_stream(s) }.or_py(py)?;
        Ok(r)
    }

    /// Outputs: the caller's, or new torch tensors like `q`.
    fn outputs<'py>(&self, py: Python<'py>, q: &Bound<'py, PyAny>, b: usize, out: Option<Bound<'py, PyAny>>, lse: Option<Bound<'py, PyAny>>) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let (hq, d) = (self.hq(), self.inner.config().head_dim);
        let out = match out {
            Some(o) => o,
            None => empty(py, &[b, hq, d], q, false)?,
        };
        let lse = match lse {
            Some(l) => l,
            None => empty(py, &[b, hq], q, true)?,
        };
        Ok((out, lse))
    }

    fn check_q(&self, py: Python<'_>, q: &ExternalTensor, what: &str) -> PyResult<usize> {
        q.check_rank("q", 3, what).or_py(py)?;
        Ok(q.shape[0])
    }
}

#[pymethods]
impl Cache {
    #[new]
    #[pyo3(signature = (spec, head_dim, num_kv_heads, gqa, max_tokens, sequences = 1, target = None, root = None, device = 0, verify_headers = false, target_only = false, sink_pages = 0, recent_pages = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        spec: &str,
        #[pyo3(from_py_with = crate::nat)] head_dim: usize,
        #[pyo3(from_py_with = crate::nat)] num_kv_heads: usize,
        #[pyo3(from_py_with = crate::nat)] gqa: usize,
        #[pyo3(from_py_with = crate::nat)] max_tokens: usize,
        #[pyo3(from_py_with = crate::nat)] sequences: usize,
        target: Option<Bound<'_, PyAny>>,
        root: Option<&str>,
        #[pyo3(from_py_with = crate::nat)] device: usize,
        #[pyo3(from_py_with = crate::flag)] verify_headers: bool,
        #[pyo3(from_py_with = crate::flag)] target_only: bool,
        #[pyo3(from_py_with = crate::nat)] sink_pages: usize,
        #[pyo3(from_py_with = crate::nat)] recent_pages: usize,
    ) -> PyResult<Cache> {
        guarded(py, || {
            let path = resolve_spec(spec, root).map_err(|m| py_error(py, "Spec", m))?;
            let s = Spec::load(&path).map_err(|e| py_error(py, "Spec", e.to_string()))?;
            // Everything checkable without a GPU is checked before the device is opened.
            if !s.geometry.head_dims.contains(&head_dim) {
                return Err(bad(py, format!("head_dim {head_dim} is not in spec `{}` (head_dims {:?})", s.name, s.geometry.head_dims)));
            }
            if !s.geometry.gqa.contains(&gqa) {
                return Err(bad(py, format!("gqa {gqa} is not in spec `{}` (gqa {:?})", s.name, s.geometry.gqa)));
            }
            if num_kv_heads == 0 || max_tokens == 0 || sequences == 0 {
                return Err(bad(py, format!("num_kv_heads ({num_kv_heads}), max_tokens ({max_tokens}) and sequences ({sequences}) must be at least 1")));
            }
            let tid = match &target {
                Some(t) => tier_id(py, &s, t)?,
                None => 1,
            };
            let tier = s.tiers.get(tid as usize).ok_or_else(|| bad(py, format!("spec `{}` has no ladder tier", s.name)))?;
            if tid == TAIL_TIER || tier.is_drop() {
                return Err(bad(py, format!("tier `{}` cannot be the target: full pages are encoded into a ladder tier that keeps bytes", tier.name)));
            }
            // The window policy (issue 26): the first `sink_pages` pages of a sequence and its
            // `recent_pages` newest full pages stay dense (the tail tier sized for them).
            let mut cfg = CacheConfig::new(&s, head_dim, gqa, num_kv_heads, sequences, max_tokens).target(tid).window(sink_pages, recent_pages, sequences);
            cfg.verify_headers = verify_headers;
            if target_only {
                // A serving pool of one format: no pages for the other ladder tiers, so the
                // arena is the tail pages plus `max_tokens` of the target (re-tiering then
                // runs out of pages).
                for (t, n) in cfg.pages.iter_mut().enumerate() {
                    if t != tid as usize && t != TAIL_TIER as usize {
                        *n = 0;
                    }
                }
            }
            let dev = self::device(py, device)?;
            let inner = KvCache::new(dev, s, cfg).or_py(py)?;
            Ok(Cache { inner, generation: 0, ordinal: device, spec_path: path.display().to_string() })
        })
    }

    /// Adds an empty sequence; returns its id.
    fn add_sequence(&mut self) -> usize {
        self.generation += 1;
        self.inner.add_sequence()
    }

    /// Tiles sequence `s0` into `batch` sequences of `length` tokens on the device (the page
    /// bytes of `s0` repeated: real encoded data, repeating content); returns the ids, `s0`
    /// first. `s0` must be the only sequence of a fresh cache, appended with `t` full pages per
    /// kv head plus `length % page_tokens` tokens, `t` the largest divisor of
    /// `length // page_tokens` up to 16. Benchmarks build large batches with it without
    /// staging every token through the host.
    fn tile_sequence(
        &mut self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::nat)] s0: usize,
        #[pyo3(from_py_with = crate::nat)] batch: usize,
        #[pyo3(from_py_with = crate::nat)] length: usize,
    ) -> PyResult<Vec<usize>> {
        self.generation += 1;
        guarded(py, || self.inner.tile_sequence(s0, batch, length).or_py(py))
    }

    /// Frees every page of a sequence.
    fn remove_sequence(&mut self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize) -> PyResult<()> {
        self.generation += 1;
        self.inner.remove_sequence(seq).or_py(py)
    }

    /// Appends k, v ([T, num_kv_heads, head_dim], spec dtype, CUDA, contiguous) to `seq`.
    /// Full pages are encoded into the target tier; all or nothing.
    fn append(&mut self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize, k: &Bound<'_, PyAny>, v: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(py, || {
            let (k, v) = (tensor(py, k, "k")?, tensor(py, v, "v")?);
            let r = self.on_torch_stream(py, |c| c.append_external(seq, &k, &v));
            self.generation += 1;
            r
        })
    }

    /// Appends k, v ([T, num_kv_heads, head_dim], spec dtype, CUDA, contiguous) to `seq` as
    /// `append` does, written on the GPU without staging through the host: the tokens go into
    /// tail-format pages in one launch and the full pages are encoded into the target tier in one
    /// more (a prompt's prefill write). Non-finite values are stored as given (`append` refuses
    /// them). Where encoding needs the pages on the host (an uncalibrated spherical target,
    /// `keep_originals`) this is `append`. All or nothing on out-of-pages. Nothing waits for
    /// the GPU: a fault the encode kernel flags is raised by a later `decode` / `step` or by
    /// `synchronize()`.
    fn append_device(&mut self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize, k: &Bound<'_, PyAny>, v: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(py, || {
            let (k, v) = (tensor(py, k, "k")?, tensor(py, v, "v")?);
            let r = self.on_torch_stream(py, |c| c.append_external_device(seq, &k, &v));
            self.generation += 1;
            r
        })
    }

    /// Appends one token to every sequence of `seqs` on the GPU, in one kernel launch: k, v
    /// [len(seqs), num_kv_heads, head_dim] (spec dtype, CUDA, contiguous), row i for seqs[i].
    /// What `append` of each row does (rotated into the spec's basis where it rotates; a tail
    /// that fills is encoded into the target tier), without staging through the host: the
    /// serving loop's per-step write. Runs ordered after torch's current stream and before its
    /// later work. A sequence may appear once; all or nothing (out of pages changes nothing).
    fn append_step(&mut self, py: Python<'_>, #[pyo3(from_py_with = crate::nats)] seqs: Vec<usize>, k: &Bound<'_, PyAny>, v: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(py, || {
            let (k, v) = (tensor(py, k, "k")?, tensor(py, v, "v")?);
            let r = self.on_torch_stream(py, |c| c.append_step_external(&seqs, &k, &v));
            self.generation += 1;
            r
        })
    }

    /// One decode step: q [B, num_q_heads, head_dim] for B = len(seqs) sequences.
    /// Returns (out [B, num_q_heads, head_dim] spec dtype, lse [B, num_q_heads] float32,
    /// natural log). `out` / `lse` may be passed preallocated. `track=True` also folds every
    /// page's share of the step's attention mass into the sequences' importance window on
    /// the GPU (RDR's signal; no transfer): read it with `take_mass_window`, or let
    /// `Controller.apply(..., window=True)` roll it in. A sequence may appear once then.
    ///
    /// Untracked steps go through the cache's device-resident plan: called again with the same
    /// `seqs` (tokens appended in between, e.g. by `append_step`), only the page-table entries
    /// that changed are uploaded and nothing waits for the GPU. A fault the kernel flags (a
    /// corrupt page) is then raised as KvforgeError by a later `decode` or by `synchronize()`,
    /// one step late at worst unless the host runs further ahead of the GPU. `replan=True`
    /// plans every page afresh and checks the flags before returning (the previous behaviour).
    #[pyo3(signature = (q, seqs, out = None, lse = None, track = false, replan = false))]
    #[allow(clippy::too_many_arguments)]
    fn decode<'py>(
        &mut self,
        py: Python<'py>,
        q: &Bound<'py, PyAny>,
        #[pyo3(from_py_with = crate::nats)] seqs: Vec<usize>,
        out: Option<Bound<'py, PyAny>>,
        lse: Option<Bound<'py, PyAny>>,
        #[pyo3(from_py_with = crate::flag)] track: bool,
        #[pyo3(from_py_with = crate::flag)] replan: bool,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        guarded(py, || {
            let qt = tensor(py, q, "q")?;
            self.check_q(py, &qt, "[B, num_q_heads, head_dim]")?;
            if qt.shape[0] != seqs.len() {
                return Err(bad(py, format!("`q` has {} rows but {} sequences were given", qt.shape[0], seqs.len())));
            }
            let (out, lse) = self.outputs(py, q, seqs.len(), out, lse)?;
            let (ot, lt) = (tensor(py, &out, "out")?, tensor(py, &lse, "lse")?);
            if track {
                self.on_torch_stream(py, |c| c.decode_tracked_external(&seqs, &qt, &ot, &lt))?;
            } else if replan {
                self.on_torch_stream(py, |c| c.decode_external(&seqs, &qt, &ot, &lt))?;
            } else {
                self.on_torch_stream(py, |c| c.decode_step_external(&seqs, &qt, &ot, &lt))?;
            }
            Ok((out, lse))
        })
    }

    /// One decode step of a layer in one call: `append_step(seqs, k, v)` then
    /// `decode(q, seqs)` (the device-resident plan), with one stream join around both.
    /// k, v [B, num_kv_heads, head_dim], q [B, num_q_heads, head_dim] for B = len(seqs);
    /// returns (out, lse) as `decode` does, into `out` / `lse` where given (a caller that
    /// keeps them per layer saves two allocations per step). `stream`: torch's current
    /// stream's `cuda_stream` if the caller has it (saves a lookup per call).
    #[pyo3(signature = (seqs, k, v, q, out = None, lse = None, stream = None))]
    #[allow(clippy::too_many_arguments)]
    fn step<'py>(
        &mut self,
        py: Python<'py>,
        #[pyo3(from_py_with = crate::nats)] seqs: Vec<usize>,
        k: &Bound<'py, PyAny>,
        v: &Bound<'py, PyAny>,
        q: &Bound<'py, PyAny>,
        out: Option<Bound<'py, PyAny>>,
        lse: Option<Bound<'py, PyAny>>,
        stream: Option<u64>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        guarded(py, || {
            let (kt, vt, qt) = (tensor(py, k, "k")?, tensor(py, v, "v")?, tensor(py, q, "q")?);
            self.check_q(py, &qt, "[B, num_q_heads, head_dim]")?;
            if qt.shape[0] != seqs.len() {
                return Err(bad(py, format!("`q` has {} rows but {} sequences were given", qt.shape[0], seqs.len())));
            }
            let (out, lse) = self.outputs(py, q, seqs.len(), out, lse)?;
            let (ot, lt) = (tensor(py, &out, "out")?, tensor(py, &lse, "lse")?);
            let r = self.on_stream(py, stream, |c| c.step_external(&seqs, &kt, &vt, &qt, &ot, &lt));
            self.generation += 1;
            r.map(|_| (out, lse))
        })
    }

    /// Prepares the next CUDA-graph decode step of `seqs` (see `graph_launch`): new tail pages
    /// where needed, the resident page table brought up to date, the append chunk list
    /// written, every kernel loaded. Returns an int key: a graph captured after a
    /// `graph_prepare` that returned the same key replays this step correctly; capture again
    /// when it changes (a page filled into a larger table, another split count). Returns None,
    /// changing nothing, when the step fills a tail page: run that step with `step` (the page
    /// is encoded before the decode reads it, which a replay cannot do). Raises
    /// KvforgeError where the step cannot run in a graph (out of pages, a full tail, a target
    /// tier that encodes on the host). Ordered after torch's current stream.
    #[pyo3(signature = (seqs, stream = None))]
    fn graph_prepare(&mut self, py: Python<'_>, #[pyo3(from_py_with = crate::nats)] seqs: Vec<usize>, stream: Option<u64>) -> PyResult<Option<u64>> {
        guarded(py, || self.on_stream(py, stream, |c| c.graph_prepare(&seqs)))
    }

    /// Launches the prepared step's append of k, v [B, num_kv_heads, head_dim] and decode of
    /// q [B, num_q_heads, head_dim] into out [B, num_q_heads, head_dim] and lse [B, num_q_heads]
    /// (float32) directly on `stream` (torch's capturing stream's `cuda_stream`): no host copy,
    /// allocation, synchronisation or stream join, so `torch.cuda.graph` can capture it. The
    /// tensors must stay alive at their addresses while the graph is replayed. After each run
    /// (every replay) call `graph_commit(seqs)`, and `graph_prepare(seqs)` before the next.
    #[pyo3(signature = (seqs, k, v, q, out, lse, stream))]
    #[allow(clippy::too_many_arguments)]
    fn graph_launch(
        &mut self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::nats)] seqs: Vec<usize>,
        k: &Bound<'_, PyAny>,
        v: &Bound<'_, PyAny>,
        q: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        lse: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        guarded(py, || {
            let (kt, vt, qt) = (tensor(py, k, "k")?, tensor(py, v, "v")?, tensor(py, q, "q")?);
            let (ot, lt) = (tensor(py, out, "out")?, tensor(py, lse, "lse")?);
            // SAFETY: `stream` is torch's stream of this device (the caller's contract, as for
            // every torch stream this module joins); the tensors are the caller's to keep.
            unsafe { self.inner.graph_launch(stream, &seqs, &kt, &vt, &qt, &ot, &lt) }.or_py(py)
        })
    }

    /// The host side of one replayed graph step of `seqs`: lengths grown (ordered after
    /// torch's current stream, where the replay was queued).
    #[pyo3(signature = (seqs, stream = None))]
    fn graph_commit(&mut self, py: Python<'_>, #[pyo3(from_py_with = crate::nats)] seqs: Vec<usize>, stream: Option<u64>) -> PyResult<()> {
        guarded(py, || {
            let r = self.on_stream(py, stream, |c| c.graph_commit(&seqs));
            self.generation += 1;
            r
        })
    }

    /// Waits for the cache's GPU work and raises KvforgeError for any fault the kernels
    /// flagged since the last check (untracked `decode` steps report theirs asynchronously).
    fn synchronize(&mut self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || self.inner.synchronize().or_py(py))
    }

    /// (rebuilds, incremental updates) of the device-resident decode plan so far, or None
    /// before the first untracked `decode`: a steady batch rebuilds every few pages of tokens.
    fn resident_stats(&self) -> Option<(u64, u64)> {
        self.inner.resident_stats()
    }

    /// The importance window of `seq` since the last call, and resets it: per kv head, per
    /// page (in `pages(seq, head)` order), the largest share of the head's attention mass the
    /// page had in a tracked decode (`decode(..., track=True)` or a tracked plan's `run`),
    /// None where no tracked decode saw the page. Synchronises with the GPU.
    fn take_mass_window(&mut self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize) -> PyResult<Vec<Vec<Option<f64>>>> {
        guarded(py, || self.on_torch_stream(py, |c| c.take_mass_window(seq)))
    }

    /// Query i of q [N, num_q_heads, head_dim] attends the first lengths[i] cached tokens of
    /// `seq` (one launch). `lengths` defaults to causal over the sequence's last N tokens:
    /// lengths[i] = seq_len - N + i + 1 (append a prompt's k, v, then attend_prefix(seq, q)
    /// gives causal attention of the prompt against the cache as stored). Returns (out, lse)
    /// as decode.
    #[pyo3(signature = (seq, q, lengths = None, out = None, lse = None))]
    fn attend_prefix<'py>(
        &mut self,
        py: Python<'py>,
        #[pyo3(from_py_with = crate::nat)] seq: usize,
        q: &Bound<'py, PyAny>,
        lengths: Option<Bound<'py, PyAny>>,
        out: Option<Bound<'py, PyAny>>,
        lse: Option<Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        guarded(py, || {
            let qt = tensor(py, q, "q")?;
            let n = self.check_q(py, &qt, "[N, num_q_heads, head_dim]")?;
            let lens = match &lengths {
                Some(l) => self::lengths(py, l)?,
                None => {
                    let len = self.inner.seq_len(seq).or_py(py)?;
                    if n > len {
                        return Err(bad(py, format!("causal attend_prefix: {n} queries but sequence {seq} holds {len} tokens")));
                    }
                    (len - n + 1..=len).collect()
                }
            };
            if lens.len() != n {
                return Err(bad(py, format!("`q` has {n} rows but `lengths` has {} entries", lens.len())));
            }
            let (out, lse) = self.outputs(py, q, n, out, lse)?;
            let (ot, lt) = (tensor(py, &out, "out")?, tensor(py, &lse, "lse")?);
            self.on_torch_stream(py, |c| c.attend_prefix_external(seq, &lens, &qt, &ot, &lt))?;
            Ok((out, lse))
        })
    }

    /// Plans decode of `seqs` (page table uploaded once); `plan.run(q)` launches.
    /// `track=True`: every run also folds the page masses into the importance window (as
    /// `decode(..., track=True)`), with nothing uploaded per run.
    #[pyo3(signature = (seqs, track = false))]
    fn plan(slf: Bound<'_, Self>, #[pyo3(from_py_with = crate::nats)] seqs: Vec<usize>, #[pyo3(from_py_with = crate::flag)] track: bool) -> PyResult<Plan> {
        let py = slf.py();
        guarded(py, || {
            let mut c = slf.borrow_mut();
            let plan = c.inner.plan(&seqs).or_py(py)?;
            let ws = if track {
                let mut ws = c.inner.mass_workspace(&plan).or_py(py)?;
                c.inner.track_window(&plan, &mut ws, &seqs).or_py(py)?;
                ws
            } else {
                c.inner.workspace(&plan).or_py(py)?
            };
            let generation = c.generation;
            drop(c);
            Ok(Plan { cache: slf.unbind(), plan, ws, generation, seqs })
        })
    }

    /// Resident bytes per cached token per kv head over all tiers (headers and padding
    /// included); 0.0 when empty.
    fn bytes_per_token(&self) -> f64 {
        let r = self.inner.memory_report();
        let tokens: usize = r.iter().map(|u| u.tokens).sum();
        let bytes: usize = r.iter().map(|u| u.resident_bytes).sum();
        if tokens == 0 {
            0.0
        } else {
            bytes as f64 / tokens as f64
        }
    }

    /// Per tier: {tier, pages, tokens, resident_bytes, payload_bytes_per_token,
    /// resident_bytes_per_token}.
    fn memory_report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for u in self.inner.memory_report() {
            let d = PyDict::new(py);
            d.set_item("tier", &u.tier)?;
            d.set_item("pages", u.pages)?;
            d.set_item("tokens", u.tokens)?;
            d.set_item("resident_bytes", u.resident_bytes)?;
            d.set_item("payload_bytes_per_token", u.payload_bytes_per_token)?;
            d.set_item("resident_bytes_per_token", u.resident_bytes_per_token)?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// Re-codes full page `page` of (seq, kv head `head`) into `tier` (name or id; down the
    /// ladder only; a drop tier frees it).
    fn retier(
        &mut self,
        py: Python<'_>,
        #[pyo3(from_py_with = crate::nat)] seq: usize,
        #[pyo3(from_py_with = crate::nat)] head: usize,
        #[pyo3(from_py_with = crate::nat)] page: usize,
        tier: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        guarded(py, || {
            let to = tier_id(py, self.inner.spec(), tier)?;
            let r = self.on_torch_stream(py, |c| c.retier(seq, head, page, to));
            self.generation += 1;
            r
        })
    }

    /// Sets the channel order of mixed-key tier `tier` (seed 002 TriZone): `order` is a
    /// sequence of `num_kv_heads * head_dim` ints (e.g. a list or a CPU tensor's ``tolist()``),
    /// each head's row a permutation of ``range(head_dim)`` naming the natural channel held at
    /// each stored position, heaviest first (see :func:`kvforge.hf.channel_order`). Call
    /// before the tier's first page is coded; raises KvforgeError otherwise.
    fn set_channel_order(&mut self, py: Python<'_>, tier: &Bound<'_, PyAny>, order: Vec<u16>) -> PyResult<()> {
        guarded(py, || {
            let t = tier_id(py, self.inner.spec(), tier)?;
            self.inner.set_channel_order(t, &order).or_py(py)
        })
    }

    /// Sets the codebooks of spherical tier `tier` before its first page is coded: either a
    /// :class:`Codebooks` file (``kvforge codebook train --per-head``) and ``layer=``, whose
    /// group, codeword count, head_dim and kv heads must be the tier's and the cache's, or a
    /// flat sequence of ``num_kv_heads * (head_dim / group) * 2**angle_bits * group`` floats
    /// (unit codewords, ``[kv head][group][codeword][channel]``). Raises KvforgeError otherwise.
    #[pyo3(signature = (tier, codebook, layer = None))]
    fn set_codebook(&mut self, py: Python<'_>, tier: &Bound<'_, PyAny>, codebook: &Bound<'_, PyAny>, layer: Option<usize>) -> PyResult<()> {
        guarded(py, || {
            let t = tier_id(py, self.inner.spec(), tier)?;
            if let Ok(cb) = codebook.cast::<Codebooks>() {
                let l = layer.ok_or_else(|| bad(py, "set_codebook: pass layer= with a Codebooks file (one codebook per layer, kv head and group)"))?;
                return self.inner.set_head_codebooks(t, &cb.get().inner, l).or_py(py);
            }
            let data: Vec<f32> = codebook.extract().map_err(|_| bad(py, "set_codebook: codebook is a kvforge.Codebooks or a sequence of floats"))?;
            self.inner.set_codebook(t, &data).or_py(py)
        })
    }

    /// The codebooks of spherical tier `tier` as a flat list (see :meth:`set_codebook`).
    fn codebook(&self, py: Python<'_>, tier: &Bound<'_, PyAny>) -> PyResult<Option<Vec<f32>>> {
        let t = tier_id(py, self.inner.spec(), tier)?;
        self.inner.codebook(t).or_py(py)
    }

    /// The tiers that store spherical keys (they take codebooks): name → (group, codewords).
    /// The window policy: `(sink_pages, recent_pages)` full pages kept dense (tail format)
    /// instead of encoded into the target tier.
    #[getter]
    fn window(&self) -> (usize, usize) {
        let w = self.inner.config().window;
        (w.sink_pages, w.recent_pages)
    }

    #[getter]
    fn spherical_tiers(&self) -> std::collections::BTreeMap<String, (usize, usize)> {
        self.inner
            .spec()
            .tiers
            .iter()
            .filter_map(|t| match t.key {
                kvforge_spec::KeyScheme::Spherical { group, angle_bits, .. } => Some((t.name.clone(), (group, 1usize << angle_bits))),
                _ => None,
            })
            .collect()
    }

    /// Names of the spherical tiers still on the spec's uniform placeholder codebook (trained
    /// on random unit vectors, not on keys: expect a large quality loss).
    #[getter]
    fn placeholder_codebook_tiers(&self) -> Vec<String> {
        let spec = self.inner.spec();
        self.inner.placeholder_codebook_tiers().into_iter().map(|t| spec.tiers[t as usize].name.clone()).collect()
    }

    /// The channel order of mixed-key tier `tier` as a flat list, or None while unset.
    fn channel_order(&self, py: Python<'_>, tier: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u16>>> {
        let t = tier_id(py, self.inner.spec(), tier)?;
        self.inner.channel_order(t).or_py(py)
    }

    /// Names of the tiers that store mixed per-channel keys (they take a channel order).
    #[getter]
    fn mixed_key_tiers(&self) -> Vec<String> {
        self.inner.spec().tiers.iter().filter(|t| matches!(t.key, kvforge_spec::KeyScheme::Mixed { .. })).map(|t| t.name.clone()).collect()
    }

    /// Keeps the fp16 original of every page encoded from now on in pinned host memory (tier 2
    /// of certified decode, see :class:`Certifier`). Call before appending; raises
    /// KvforgeError when the pinned memory cannot be allocated.
    fn keep_originals(&mut self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || self.inner.keep_originals().or_py(py))
    }

    /// Logical length of `seq`: tokens appended so far (those of dropped pages included).
    fn seq_len(&self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize) -> PyResult<usize> {
        self.inner.seq_len(seq).or_py(py)
    }

    /// Pages of (seq, kv head) in token order: [(tier name, tokens, first position)], the
    /// tail page last. Positions are logical: a dropped page leaves a gap.
    fn pages(&self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize, #[pyo3(from_py_with = crate::nat)] head: usize) -> PyResult<Vec<(String, usize, usize)>> {
        let spec = self.inner.spec();
        Ok(self.inner.positioned_pages(seq, head).or_py(py)?.into_iter().map(|(p, n, f)| (spec.tiers[p.tier as usize].name.clone(), n, f)).collect())
    }

    #[getter]
    fn spec_name(&self) -> String {
        self.inner.spec().name.clone()
    }
    #[getter]
    fn spec_path(&self) -> String {
        self.spec_path.clone()
    }
    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.config().head_dim
    }
    #[getter]
    fn num_kv_heads(&self) -> usize {
        self.inner.config().num_kv_heads
    }
    #[getter]
    fn gqa(&self) -> usize {
        self.inner.config().gqa
    }
    #[getter]
    fn num_q_heads(&self) -> usize {
        self.hq()
    }
    #[getter]
    fn page_tokens(&self) -> usize {
        self.inner.spec().page.tokens
    }
    /// The spec dtype as torch names it (`float16` / `bfloat16`).
    #[getter]
    fn dtype(&self) -> String {
        ElemType::of(self.inner.spec().geometry.dtype).name().to_string()
    }
    /// Tier names by id (id 0 is the dense tail).
    #[getter]
    fn tiers(&self) -> Vec<String> {
        self.inner.spec().tiers.iter().map(|t| t.name.clone()).collect()
    }
    #[getter]
    fn target(&self) -> String {
        self.inner.spec().tiers[self.inner.config().target_tier as usize].name.clone()
    }
    #[getter]
    fn device(&self) -> usize {
        self.ordinal
    }

    fn __repr__(&self) -> String {
        let c = self.inner.config();
        format!("kvforge.Cache(spec={:?}, head_dim={}, num_kv_heads={}, gqa={}, target={:?})", self.inner.spec().name, c.head_dim, c.num_kv_heads, c.gqa, self.target())
    }
}

#[pymethods]
impl Plan {
    /// Launches the plan: q [B, num_q_heads, head_dim] → (out, lse) as Cache.decode.
    /// `check=False` skips the synchronising read of the kernels' page-fault flags (faults are
    /// then reported by the next checked call).
    #[pyo3(signature = (q, out = None, lse = None, check = true))]
    fn run<'py>(
        &mut self,
        py: Python<'py>,
        q: &Bound<'py, PyAny>,
        out: Option<Bound<'py, PyAny>>,
        lse: Option<Bound<'py, PyAny>>,
        #[pyo3(from_py_with = crate::flag)] check: bool,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        guarded(py, || {
            let cache = self.cache.bind(py);
            let mut c = cache.try_borrow_mut().map_err(|_| bad(py, "the cache is in use"))?;
            if c.generation != self.generation {
                return Err(bad(py, "stale plan: the cache changed (append, retier or sequence change) since plan(); call cache.plan(seqs) again"));
            }
            let qt = tensor(py, q, "q")?;
            c.check_q(py, &qt, "[B, num_q_heads, head_dim]")?;
            let (out, lse) = c.outputs(py, q, self.plan.batch, out, lse)?;
            let (ot, lt) = (tensor(py, &out, "out")?, tensor(py, &lse, "lse")?);
            let (plan, ws) = (&self.plan, &self.ws);
            c.on_torch_stream(py, |k| {
                k.run_external(plan, ws, &qt, &ot, &lt)?;
                if check {
                    k.check(plan)?;
                }
                Ok(())
            })?;
            Ok((out, lse))
        })
    }

    #[getter]
    fn batch(&self) -> usize {
        self.plan.batch
    }
    #[getter]
    fn seqs(&self) -> Vec<usize> {
        self.seqs.clone()
    }
    /// The decode kernel's variant name.
    #[getter]
    fn variant(&self) -> String {
        self.plan.variant.name()
    }
    #[getter]
    fn splits(&self) -> usize {
        self.plan.splits
    }
    /// Bytes the kernels read per run (pages and queries).
    #[getter]
    fn bytes_read(&self) -> usize {
        self.plan.bytes_read
    }
    /// False once the cache has changed since the plan was made.
    fn is_valid(&self, py: Python<'_>) -> bool {
        self.cache.bind(py).try_borrow().map(|c| c.generation == self.generation).unwrap_or(false)
    }

    /// True when runs fold into the importance window (`plan(seqs, track=True)`).
    #[getter]
    fn tracked(&self) -> bool {
        self.ws.window.is_some()
    }

    fn __repr__(&self) -> String {
        format!("kvforge.Plan(batch={}, variant={:?}, splits={}, tracked={})", self.plan.batch, self.plan.variant.name(), self.plan.splits, self.ws.window.is_some())
    }
}

#[pyfunction]
#[pyo3(signature = (filter = "debug"))]
/// Turns on kvforge's logs on stderr: decode plans (variant, batch, splits), kernel compiles
/// (cache hit or miss, NVRTC time) and launches (symbol, grid, block, shared memory).
/// `filter` is a `tracing` filter (`"debug"`, `"info"`, `"kvforge_rt::jit=debug"`).
/// `import kvforge` calls it with `$KVFORGE_LOG` when that is set. Returns False when logging
/// was already set up (the first filter stays).
fn enable_logs(py: Python<'_>, filter: &str) -> PyResult<bool> {
    let f = tracing_subscriber::EnvFilter::try_new(filter).map_err(|e| bad(py, format!("log filter `{filter}`: {e}")))?;
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    Ok(tracing_subscriber::fmt().with_env_filter(f).with_writer(std::io::stderr).with_ansi(ansi).try_init().is_ok())
}

#[pymodule]
#[pyo3(name = "_native")]
fn kvforge_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Cache>()?;
    m.add_class::<Plan>()?;
    m.add_class::<Codebooks>()?;
    m.add_class::<control::Controller>()?;
    m.add_class::<control::ControlReport>()?;
    m.add_class::<certified::Certifier>()?;
    m.add_class::<certified::HeadCert>()?;
    m.add_class::<kvtc::KvtcCalibration>()?;
    m.add_class::<paris::ParisIndex>()?;
    m.add_class::<paris::RetrievalCache>()?;
    m.add_function(wrap_pyfunction!(kvtc::kvtc_save, m)?)?;
    m.add_function(wrap_pyfunction!(kvtc::kvtc_load, m)?)?;
    m.add_function(wrap_pyfunction!(device_info, m)?)?;
    m.add_function(wrap_pyfunction!(empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(spec_page_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_present, m)?)?;
    m.add_function(wrap_pyfunction!(check_tensor, m)?)?;
    m.add_function(wrap_pyfunction!(enable_logs, m)?)?;
    Ok(())
}
