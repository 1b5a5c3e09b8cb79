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
use kvforge_rt::retrieval::{RegionPolicy, RetrievalCache as Regions};
use kvforge_rt::CacheConfig;
use kvforge_spec::{Spec, TAIL_TIER};
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

fn parse_rank(py: Python<'_>, rank: &str) -> PyResult<Rank> {
    Rank::parse(rank).ok_or_else(|| bad(py, format!("rank must be \"max\" or \"sum\", got {rank:?}")))
}

fn parse_layout(py: Python<'_>, layout: Option<&str>, cfg: &ParisConfig) -> PyResult<SummaryLayout> {
    match layout {
        None => Ok(SummaryLayout::for_config(cfg)),
        Some(name) => SummaryLayout::parse(name).ok_or_else(|| bad(py, format!("layout must be \"whole64\", \"subspace4\" or None, got {name:?}"))),
    }
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
        let rank = parse_rank(py, rank)?;
        let cfg = ParisConfig::default_for(head_dim);
        let layout = parse_layout(py, layout, &cfg)?;
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

/// ParisKV inside the main cache (`kvforge_rt::retrieval::RetrievalCache`): sinks and the local
/// window are pages of a kvforge cache of any spec and tier, older pages move into a retrieval
/// index as the window fills, and a decode step attends both with one softmax.
///
/// RetrievalCache(spec, head_dim, kv_heads, gqa, capacity, target=None, batch=1, sink_pages=1,
///                local_pages=4, update_pages=1, dense_sink_pages=0, dense_recent_pages=0,
///                max_k=256, max_candidates=65536, host_budget_gb=64.0, device=0,
///                per_query_head=False, rank="max", layout=None, root=None)
///
/// `spec` is a spec TOML path (as `Cache`'s; it needs a drop tier) and `target` the tier the
/// window's full pages are coded into (default the spec's first ladder tier);
/// `dense_sink_pages` / `dense_recent_pages` keep pages of the window fp16 (the cache's own
/// window policy). `sink_pages`, `local_pages` and `update_pages` place the regions (pages of
/// the spec's page size): once the window past the sinks holds `local_pages + update_pages`
/// full pages, its pages beyond `local_pages` move to the index. `capacity` is the retrieval
/// region's keys per sequence; appends of any length go through the cache in pieces of 16384
/// tokens. The other arguments are `ParisIndex`'s.
///
/// ```python
/// rc = kvforge.RetrievalCache("specs/rotated.toml", 64, 3, 3, 16384, target="r3")
/// rc.append(0, k_bytes, v_bytes)        # [rows][kv_heads][head_dim] fp16 bytes: prefill, then a token a step
/// out, lse = rc.decode(q_bytes, k=256)  # q [batch][Hq][head_dim] fp16 -> f32 bytes
/// ```
#[pyclass(module = "kvforge", name = "RetrievalCache", unsendable)]
pub struct RetrievalCache {
    inner: Regions,
}

#[pymethods]
impl RetrievalCache {
    #[new]
    #[pyo3(signature = (spec, head_dim, kv_heads, gqa, capacity, target = None, batch = 1, sink_pages = 1, local_pages = 4, update_pages = 1, dense_sink_pages = 0, dense_recent_pages = 0, max_k = 256, max_candidates = 65536, host_budget_gb = 64.0, device = 0, per_query_head = false, rank = "max", layout = None, root = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        spec: &str,
        #[pyo3(from_py_with = crate::nat)] head_dim: usize,
        #[pyo3(from_py_with = crate::nat)] kv_heads: usize,
        #[pyo3(from_py_with = crate::nat)] gqa: usize,
        #[pyo3(from_py_with = crate::nat)] capacity: usize,
        target: Option<Bound<'_, PyAny>>,
        #[pyo3(from_py_with = crate::nat)] batch: usize,
        #[pyo3(from_py_with = crate::nat)] sink_pages: usize,
        #[pyo3(from_py_with = crate::nat)] local_pages: usize,
        #[pyo3(from_py_with = crate::nat)] update_pages: usize,
        #[pyo3(from_py_with = crate::nat)] dense_sink_pages: usize,
        #[pyo3(from_py_with = crate::nat)] dense_recent_pages: usize,
        #[pyo3(from_py_with = crate::nat)] max_k: usize,
        #[pyo3(from_py_with = crate::nat)] max_candidates: usize,
        #[pyo3(from_py_with = crate::real)] host_budget_gb: f64,
        #[pyo3(from_py_with = crate::nat)] device: usize,
        per_query_head: bool,
        rank: &str,
        layout: Option<&str>,
        root: Option<&str>,
    ) -> PyResult<Self> {
        if !(host_budget_gb > 0.0) {
            return Err(bad(py, format!("host_budget_gb must be positive, got {host_budget_gb}")));
        }
        if kv_heads == 0 || capacity == 0 || batch == 0 {
            return Err(bad(py, format!("kv_heads ({kv_heads}), capacity ({capacity}) and batch ({batch}) must be at least 1")));
        }
        let rank = parse_rank(py, rank)?;
        let pcfg = ParisConfig::default_for(head_dim);
        let layout = parse_layout(py, layout, &pcfg)?;
        guarded(py, || {
            let path = crate::resolve_spec(spec, root).map_err(|m| crate::py_error(py, "Spec", m))?;
            let s = Spec::load(&path).map_err(|e| crate::py_error(py, "Spec", e.to_string()))?;
            if !s.geometry.head_dims.contains(&head_dim) || !s.geometry.gqa.contains(&gqa) {
                return Err(bad(py, format!("head_dim {head_dim} / gqa {gqa} is not in spec `{}` (head_dims {:?}, gqa {:?})", s.name, s.geometry.head_dims, s.geometry.gqa)));
            }
            let tid = match &target {
                Some(t) => crate::tier_id(py, &s, t)?,
                None => 1,
            };
            let tier = s.tiers.get(tid as usize).ok_or_else(|| bad(py, format!("spec `{}` has no ladder tier", s.name)))?;
            if tid == TAIL_TIER || tier.is_drop() {
                return Err(bad(py, format!("tier `{}` cannot be the target: the window's full pages are coded into a ladder tier that keeps bytes", tier.name)));
            }
            // The cache holds the window and one append piece per sequence.
            let policy = RegionPolicy { sink_pages, local_pages, update_pages };
            let tokens = Regions::gpu_tokens(policy, s.page.tokens);
            let cfg = CacheConfig::new(&s, head_dim, gqa, kv_heads, batch, tokens * batch).target(tid).window(dense_sink_pages, dense_recent_pages, batch);
            let geo = ParisGeometry { batch, kv_heads, gqa, per_query_head, rank, layout, capacity, dense_capacity: 1, max_candidates, max_k, host_budget_bytes: (host_budget_gb * 1e9) as usize };
            let dev = crate::device(py, device)?;
            let inner = Regions::new(dev, s, cfg, pcfg, geo, policy).or_py(py)?;
            Ok(RetrievalCache { inner })
        })
    }

    /// Tokens appended to `seq`.
    fn len(&self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize) -> PyResult<usize> {
        self.inner.len(seq).or_py(py)
    }

    /// Tokens of `seq` in the retrieval region.
    fn retrieval_len(&self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize) -> PyResult<usize> {
        self.inner.retrieval_len(seq).or_py(py)
    }

    /// GPU-resident summary bytes per retrieval-region key and kv head.
    #[getter]
    fn device_bytes_per_key(&self) -> usize {
        self.inner.index().device_bytes_per_key()
    }

    /// Below this many retrieval-region keys the schedule would attend densely (the caller's
    /// choice, as `ParisIndex.dense_below`).
    #[getter]
    fn dense_below(&self) -> usize {
        self.inner.schedule().dense_below
    }

    /// Tier names of the pages of (`seq`, kv head `head`) on the GPU, the tail last.
    fn gpu_tiers(&self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize, #[pyo3(from_py_with = crate::nat)] head: usize) -> PyResult<Vec<String>> {
        let c = self.inner.cache();
        let tiers = c.page_tiers(seq, head).or_py(py)?;
        Ok(tiers.iter().map(|(t, _)| c.spec().tiers[*t as usize].name.clone()).collect())
    }

    /// Appends tokens to `seq` (`[rows][kv_heads][head_dim]` fp16 bytes each), then moves the
    /// pages past the window to the index.
    fn append(&mut self, py: Python<'_>, #[pyo3(from_py_with = crate::nat)] seq: usize, k: &[u8], v: &[u8]) -> PyResult<()> {
        let (k, v) = (halves(py, k, "k")?, halves(py, v, "v")?);
        let (k, v): (Vec<f32>, Vec<f32>) = (k.iter().map(|x| x.to_f32()).collect(), v.iter().map(|x| x.to_f32()).collect());
        guarded(py, || self.inner.append(seq, &k, &v).or_py(py))
    }

    /// One decode step of every sequence: `q` `[batch][Hq][head_dim]` fp16 bytes attends the
    /// GPU region and the top-`k` keys of its retrieval region with one softmax, scale
    /// 1/sqrt(head_dim). Returns `(out, lse)` as f32 bytes: `[batch][Hq][head_dim]`, `[batch][Hq]`.
    fn decode<'py>(&mut self, py: Python<'py>, q: &[u8], #[pyo3(from_py_with = crate::nat)] k: usize) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let q: Vec<f32> = halves(py, q, "q")?.iter().map(|x| x.to_f32()).collect();
        let out = guarded(py, || self.inner.decode(&q, k).or_py(py))?;
        Ok((f32_bytes(py, &out.out), f32_bytes(py, &out.lse)))
    }
}
