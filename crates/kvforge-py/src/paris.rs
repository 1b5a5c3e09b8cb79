//! ParisKV retrieval decode (seed 001) from Python: one [`ParisIndex`] per attention layer holds
//! the retrieval region of each sequence (summaries on the GPU, fp16 K/V in pinned host
//! memory) and its dense rows (sinks + local window); a decode step retrieves the top-k keys of
//! every query head and attends over dense + retrieved rows with one softmax.
//!
//! ```python
//! ix = kvforge.ParisIndex(head_dim=64, kv_heads=3, gqa=3, capacity=16384)
//! ix.append(0, k_bytes, v_bytes)        # [rows][kv_heads][head_dim] fp16, as bytes
//! ix.set_dense(0, dk_bytes, dv_bytes)   # sinks + local window
//! out, lse = ix.decode(q_bytes, k=256)  # q [batch][Hq][head_dim] fp16 -> f32 bytes
//! ```
//!
//! Tensors cross as bytes (`t.to("cpu", torch.float16).contiguous().numpy().tobytes()`):
//! the index's API is host slices, and `kvforge.retrieval` does the conversions. The
//! retrieval runs on the GPU; the host round trip costs a synchronisation per call.

use half::f16;
use kvforge_paris::{ParisConfig, Rank, Schedule, SummaryLayout};
use kvforge_rt::paris::{ParisGeometry, ParisIndex as Index};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::{bad, guarded, OrPy};

/// fp16 values of a byte string of `[.., head_dim]` halves.
fn halves(py: Python<'_>, b: &[u8], what: &str) -> PyResult<Vec<f16>> {
    if !b.len().is_multiple_of(2) {
        return Err(bad(py, format!("{what}: {} bytes is not a whole number of fp16 values", b.len())));
    }
    Ok(b.chunks_exact(2).map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect())
}

fn f32_bytes<'py>(py: Python<'py>, x: &[f32]) -> Bound<'py, PyBytes> {
    let raw: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    PyBytes::new(py, &raw)
}

/// The retrieval index of one attention layer for `batch` sequences (module docs).
///
/// ParisIndex(head_dim, kv_heads, gqa, capacity, batch=1, dense_capacity=1024, max_k=256,
///            max_candidates=65536, host_budget_gb=64.0, device=0, per_query_head=False, rank="max",
///            layout=None)
///
/// The `gqa` query heads of a kv head share one retrieval (the vote of the sum of their
/// queries) and one fetch of the rows; `rank` orders its candidates: `"max"` (default) by the
/// largest of the heads' own estimates, `"sum"` by the summed query's (kvforge-paris `Rank`).
/// `per_query_head=True` retrieves for each query head (`rank` then has no effect). `layout`
/// picks the GPU summaries (kvforge-paris `SummaryLayout`): `"whole64"` (`head_dim / 2` bytes,
/// 64 B per key and kv head at head dim 128, 1/8 of fp16 K+V; its schedule, ρ 0.30 from 64K
/// keys, replaces the seed's) or `"subspace4"` (the seed's 112 B at head dim 128). `None`
/// (default) takes whole64 where the head dim is a multiple of 64, else subspace4.
#[pyclass(module = "kvforge", name = "ParisIndex", unsendable)]
pub struct ParisIndex {
    inner: Index,
    schedule: Schedule,
}

#[pymethods]
impl ParisIndex {
    #[new]
    #[pyo3(signature = (head_dim, kv_heads, gqa, capacity, batch = 1, dense_capacity = 1024, max_k = 256, max_candidates = 65536, host_budget_gb = 64.0, device = 0, per_query_head = false, rank = "max", layout = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        #[pyo3(from_py_with = crate::nat)] head_dim: usize,
        #[pyo3(from_py_with = crate::nat)] kv_heads: usize,
        #[pyo3(from_py_with = crate::nat)] gqa: usize,
        #[pyo3(from_py_with = crate::nat)] capacity: usize,
        #[pyo3(from_py_with = crate::nat)] batch: usize,
        #[pyo3(from_py_with = crate::nat)] dense_capacity: usize,
        #[pyo3(from_py_with = crate::nat)] max_k: usize,
        #[pyo3(from_py_with = crate::nat)] max_candidates: usize,
        #[pyo3(from_py_with = crate::real)] host_budget_gb: f64,
        #[pyo3(from_py_with = crate::nat)] device: usize,
        per_query_head: bool,
        rank: &str,
        layout: Option<&str>,
    ) -> PyResult<Self> {
        if !(host_budget_gb > 0.0) {
            return Err(bad(py, format!("host_budget_gb must be positive, got {host_budget_gb}")));
        }
        let Some(rank) = Rank::parse(rank) else {
            return Err(bad(py, format!("rank must be \"max\" or \"sum\", got {rank:?}")));
        };
        let cfg = ParisConfig::default_for(head_dim);
        let layout = match layout {
            None => SummaryLayout::for_config(&cfg),
            Some(name) => match SummaryLayout::parse(name) {
                Some(l) => l,
                None => return Err(bad(py, format!("layout must be \"whole64\", \"subspace4\" or None, got {name:?}"))),
            },
        };
        guarded(py, || {
            let dev = crate::device(py, device)?;
            let geo = ParisGeometry { batch, kv_heads, gqa, per_query_head, rank, layout, capacity, dense_capacity, max_candidates, max_k, host_budget_bytes: (host_budget_gb * 1e9) as usize };
            let inner = Index::new(&dev, cfg, geo).or_py(py)?;
            let schedule = inner.default_schedule();
            Ok(ParisIndex { inner, schedule })
        })
    }

    /// Retrieval-region keys of `seq`.
    fn len(&self, #[pyo3(from_py_with = crate::nat)] seq: usize) -> usize {
        self.inner.len(seq)
    }

    /// GPU-resident bytes per retrieval-region key and kv head (the summary).
    #[getter]
    fn device_bytes_per_key(&self) -> usize {
        self.inner.device_bytes_per_key()
    }

    /// Below this many retrieval-region keys the schedule attends densely (the caller's choice:
    /// `kvforge.retrieval` attends exactly there).
    #[getter]
    fn dense_below(&self) -> usize {
        self.schedule.dense_below
    }

    /// Appends keys and values (`[rows][kv_heads][head_dim]` fp16 bytes each) to the retrieval
    /// region of `seq`: K/V into pinned host memory, summaries encoded on the GPU.
    fn append(&mut self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize, k: &[u8], v: &[u8]) -> PyResult<()> {
        let (k, v) = (halves(py, k, "k")?, halves(py, v, "v")?);
        guarded(py, || self.inner.append(seq, &k, &v).or_py(py))
    }

    /// Replaces the dense rows of `seq` (sinks + local window): `[rows][kv_heads][head_dim]`.
    fn set_dense(&mut self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize, k: &[u8], v: &[u8]) -> PyResult<()> {
        let (k, v) = (halves(py, k, "k")?, halves(py, v, "v")?);
        guarded(py, || self.inner.set_dense(seq, &k, &v).or_py(py))
    }

    /// The top-`k` retrieval-region keys each (sequence, query head) attends for `q`
    /// (`[batch][Hq][head_dim]` fp16 bytes), ascending: one list per kv head, repeated for its
    /// query heads (unless `per_query_head`).
    fn retrieve(&mut self, py: Python<'_>, q: &[u8], #[pyo3(from_py_with = crate::nat)] k: usize) -> PyResult<Vec<Vec<u32>>> {
        let q = halves(py, q, "q")?;
        guarded(py, || self.inner.retrieve(&q, k, &self.schedule).or_py(py))
    }

    /// One decode step: retrieve the top-`k` keys, fetch their rows from pinned host memory,
    /// then attend over the dense rows and the retrieved rows, one softmax, scale
    /// 1/sqrt(head_dim); large batches pipeline the fetch of one part beside the retrieval of
    /// the next (`ParisIndex::default_chunks`). Returns `(out, lse)` as f32 bytes:
    /// `[batch][Hq][head_dim]`, `[batch][Hq]`.
    fn decode<'py>(&mut self, py: Python<'py>, q: &[u8], #[pyo3(from_py_with = crate::nat)] k: usize) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let q = halves(py, q, "q")?;
        let (out, lse) = guarded(py, || {
            let chunks = self.inner.default_chunks();
            self.inner.step(&q, k, &self.schedule, chunks).or_py(py)
        })?;
        Ok((f32_bytes(py, &out), f32_bytes(py, &lse)))
    }
}
