//! `kvforge.Certifier`: certified decode (seed 004) on a Python-held cache.
//!
//! Each step returns the output and, per query head, a certificate: a bound on
//! ‖O − O_exact‖₂ (or an exact output after the fallback ladder), with the telemetry the
//! runtime keeps (Δ, achieved tail mass, E_key, E_val, promoted pages, rung, detections).
//! The runtime takes host queries and returns host outputs (its selector and certificate run
//! on the GPU between the two decodes; only rungs 1–2 of the ladder run on the host), so
//! queries and outputs cross the bus here; that is a few KB per step.

use kvforge_rt::certified::{CertConfig, CertPath, HeadCertificate, KernelTimes, PageIn};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::{bad, guarded, Cache, OrPy};

/// Certified decode settings for a cache (defaults from seed 004).
///
/// Certifier(coverage=0.995, min_blocks=1, max_blocks=None, explore=0.02, guard=1e-3,
///           max_error=0.05, v_tol=0.01, layer_fallback=0.5, page_in="uva", seed=0x5eed,
///           path="gpu", rank_depth=1, rank_escalate=True, profile=False)
///
/// ``path``: where the selector and the certificate run, ``"gpu"`` (between the two decodes,
/// no host round trip; needs ``page_in="uva"``, else the step takes the host path) or
/// ``"host"`` (the reference). ``rank_depth``: r of the ranking-consistency and boundary
/// checks (seed 004 eqs. 17-18; 0 skips them); ``rank_escalate``: a failed check sends the kv
/// head to rung 3 (``False`` only reports it). ``profile``: time the device path's stages
/// (``kernel_us`` after a step). ``layer_fallback`` above 1 disables rung 4.
///
/// The cache must keep its fp16 originals: ``cache.keep_originals()`` before appending.
/// ``decode(cache, q, seqs)`` returns ``(out, lse, heads)``: ``out`` like ``q``,
/// ``lse`` float32 ``[batch, q heads]``, ``heads`` a list (batch-major, then q head) of
/// :class:`HeadCertificate`.
#[pyclass(module = "kvforge", name = "Certifier", unsendable)]
pub struct Certifier {
    cfg: CertConfig,
    /// Telemetry of the last step: phase-2 launches and bytes of originals paged in.
    #[pyo3(get)]
    launches: usize,
    #[pyo3(get)]
    paged_in_bytes: usize,
    /// Whether the last step built page tables or certificates on the host (host path, or a
    /// device step that needed rungs 1-2).
    #[pyo3(get)]
    host_ladder: bool,
    /// Device-path stage times of the last step's first round (µs) when ``profile`` is on.
    last_kernel_us: Option<KernelTimes>,
}

#[pymethods]
impl Certifier {
    #[new]
    #[pyo3(signature = (coverage = 0.995, min_blocks = 1, max_blocks = None, explore = 0.02, guard = 1e-3, max_error = 0.05, v_tol = 0.01, layer_fallback = 0.5, page_in = "uva", seed = 0x5eed, path = "gpu", rank_depth = 1, rank_escalate = true, profile = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        #[pyo3(from_py_with = crate::real)] coverage: f64,
        #[pyo3(from_py_with = crate::nat)] min_blocks: usize,
        #[pyo3(from_py_with = crate::opt_nat)] max_blocks: Option<usize>,
        #[pyo3(from_py_with = crate::real)] explore: f64,
        #[pyo3(from_py_with = crate::real)] guard: f64,
        #[pyo3(from_py_with = crate::real)] max_error: f64,
        #[pyo3(from_py_with = crate::real)] v_tol: f64,
        #[pyo3(from_py_with = crate::real)] layer_fallback: f64,
        page_in: &str,
        #[pyo3(from_py_with = crate::nat_u64)] seed: u64,
        path: &str,
        #[pyo3(from_py_with = crate::nat)] rank_depth: usize,
        #[pyo3(from_py_with = crate::flag)] rank_escalate: bool,
        #[pyo3(from_py_with = crate::flag)] profile: bool,
    ) -> PyResult<Certifier> {
        let frac = |name: &str, x: f64| if (0.0..=1.0).contains(&x) { Ok(()) } else { Err(bad(py, format!("Certifier: {name} = {x} must be in [0, 1]"))) };
        frac("coverage", coverage)?;
        frac("explore", explore)?;
        // As CertConfig::validate: above 1 means rung 4 never fires.
        if !(layer_fallback >= 0.0) {
            return Err(bad(py, format!("Certifier: layer_fallback = {layer_fallback} must be >= 0 (above 1: never)")));
        }
        for (name, x) in [("guard", guard), ("max_error", max_error), ("v_tol", v_tol)] {
            if !(x.is_finite() && x >= 0.0) {
                return Err(bad(py, format!("Certifier: {name} = {x} must be finite and >= 0")));
            }
        }
        let page_in = match page_in {
            "uva" => PageIn::Uva,
            "copy" => PageIn::Copy,
            _ => return Err(bad(py, format!("Certifier: page_in must be \"uva\" or \"copy\", got {page_in:?}"))),
        };
        let path = match path {
            "gpu" => CertPath::Gpu,
            "host" => CertPath::Host,
            _ => return Err(bad(py, format!("Certifier: path must be \"gpu\" or \"host\", got {path:?}"))),
        };
        let max_blocks = max_blocks.unwrap_or(usize::MAX);
        if min_blocks > max_blocks {
            return Err(bad(py, format!("Certifier: min_blocks {min_blocks} > max_blocks {max_blocks}")));
        }
        let cfg = CertConfig { coverage, min_blocks, max_blocks, explore, guard, max_error, v_tol, layer_fallback, page_in, seed, path, rank_depth, rank_escalate, profile };
        cfg.validate().or_py(py)?;
        Ok(Certifier { cfg, launches: 0, paged_in_bytes: 0, host_ladder: false, last_kernel_us: None })
    }

    /// The settings as a dict (``path`` and ``page_in`` as given; ``effective_path``: where a
    /// step runs, ``"host"`` when the device path cannot serve ``page_in``; ``seed``: the next
    /// step's, advanced every step).
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.cfg;
        let d = PyDict::new(py);
        for (k, v) in [("coverage", c.coverage), ("explore", c.explore), ("guard", c.guard), ("max_error", c.max_error), ("v_tol", c.v_tol), ("layer_fallback", c.layer_fallback)] {
            d.set_item(k, v)?;
        }
        d.set_item("min_blocks", c.min_blocks)?;
        d.set_item("max_blocks", (c.max_blocks != usize::MAX).then_some(c.max_blocks))?;
        d.set_item(
            "page_in",
            match c.page_in {
                PageIn::Uva => "uva",
                PageIn::Copy => "copy",
            },
        )?;
        d.set_item("path", path_name(c.path))?;
        d.set_item("effective_path", path_name(c.effective_path()))?;
        d.set_item("rank_depth", c.rank_depth)?;
        d.set_item("rank_escalate", c.rank_escalate)?;
        d.set_item("profile", c.profile)?;
        d.set_item("seed", c.seed)?;
        Ok(d)
    }

    /// Device time of the last step's stages (``phase1_us``, ``select_us``, ``phase2_us``,
    /// ``bound_us``; CUDA events, first round), or ``None`` (``profile`` off or host path).
    #[getter]
    fn kernel_us<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(t) = self.last_kernel_us else { return Ok(None) };
        let d = PyDict::new(py);
        for (k, v) in [("phase1_us", t.phase1_us), ("select_us", t.select_us), ("phase2_us", t.phase2_us), ("bound_us", t.bound_us)] {
            d.set_item(k, v)?;
        }
        Ok(Some(d))
    }

    /// One certified decode step: `q` `[batch, q heads, head_dim]` (one token per sequence of
    /// `seqs`), a CUDA tensor in the spec dtype.
    fn decode<'py>(&mut self, py: Python<'py>, mut cache: PyRefMut<'py, Cache>, q: &Bound<'py, PyAny>, #[pyo3(from_py_with = crate::nats)] seqs: Vec<usize>) -> PyResult<Bound<'py, PyTuple>> {
        guarded(py, || {
            let t = crate::tensor(py, q, "q")?;
            let (hq, d) = (cache.hq(), cache.inner.config().head_dim);
            let want = kvforge_rt::ElemType::of(cache.inner.spec().geometry.dtype);
            t.check("q", &want, &[("batch", seqs.len()), ("q_heads", hq), ("head_dim", d)], cache.ordinal).or_py(py)?;
            let host: Vec<f32> = q.call_method0("detach")?.call_method0("float")?.call_method0("cpu")?.call_method1("reshape", (-1,))?.call_method0("tolist")?.extract()?;
            let r = cache.inner.decode_certified(&seqs, &host, &mut self.cfg).or_py(py)?;
            self.launches = r.launches;
            self.paged_in_bytes = r.paged_in_bytes;
            self.host_ladder = r.host_ladder;
            self.last_kernel_us = r.kernel_us;
            let torch = crate::torch(py)?;
            let kw = PyDict::new(py);
            kw.set_item("dtype", torch.getattr("float32")?)?;
            let out = torch.call_method("tensor", (r.out,), Some(&kw))?.call_method1("reshape", (seqs.len(), hq, d))?;
            let out = out.call_method1("to", (q.getattr("device")?, q.getattr("dtype")?))?;
            let lse = torch.call_method("tensor", (r.lse,), Some(&kw))?.call_method1("reshape", (seqs.len(), hq))?.call_method1("to", (q.getattr("device")?,))?;
            let heads: Vec<HeadCert> = r.heads.into_iter().map(HeadCert).collect();
            PyTuple::new(py, [out, lse, heads.into_pyobject(py)?.into_any()])
        })
    }

    fn __repr__(&self) -> String {
        format!("kvforge.Certifier({:?})", self.cfg)
    }
}

fn path_name(p: CertPath) -> &'static str {
    match p {
        CertPath::Gpu => "gpu",
        CertPath::Host => "host",
    }
}

/// The certificate and telemetry of one query head in one certified step.
#[pyclass(module = "kvforge", name = "HeadCertificate", frozen)]
#[derive(Clone)]
pub struct HeadCert(HeadCertificate);

#[pymethods]
impl HeadCert {
    /// Largest key logit error Δ over pages left quantised (natural log).
    #[getter]
    fn delta(&self) -> f64 {
        self.0.delta
    }
    /// Achieved attention mass on pages left quantised.
    #[getter]
    fn alpha_tail(&self) -> f64 {
        self.0.alpha_tail
    }
    #[getter]
    fn v_max(&self) -> f64 {
        self.0.v_max
    }
    #[getter]
    fn e_key(&self) -> f64 {
        self.0.e_key
    }
    #[getter]
    fn e_val(&self) -> f64 {
        self.0.e_val
    }
    /// fp16 output rounding and fp32 arithmetic.
    #[getter]
    fn e_round(&self) -> f64 {
        self.0.e_round
    }
    /// e_key + e_val + e_round: the certified bound on ‖O − O_exact‖₂ (0 at rungs 3–4).
    #[getter]
    fn bound(&self) -> f64 {
        self.0.bound
    }
    #[getter]
    fn promoted(&self) -> usize {
        self.0.promoted
    }
    #[getter]
    fn explored(&self) -> usize {
        self.0.explored
    }
    /// 0: none; 1: K* doubled; 2: values promoted; 3: exact kv head; 4: exact layer.
    #[getter]
    fn rung(&self) -> u8 {
        self.0.rung
    }
    /// Failed score checks (faults detected) on this head's kv head.
    #[getter]
    fn detections(&self) -> usize {
        self.0.detections
    }
    /// The exact and quantised top-r page rankings disagreed (seed 004 eq. 17).
    #[getter]
    fn ranking(&self) -> bool {
        self.0.ranking
    }
    /// Quantised tail pages whose bounded exact mass could enter the top r (eq. 18).
    #[getter]
    fn boundary(&self) -> usize {
        self.0.boundary
    }

    /// The certificate as a plain dict.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.0;
        let d = PyDict::new(py);
        for (k, v) in [("delta", c.delta), ("alpha_tail", c.alpha_tail), ("v_max", c.v_max), ("e_key", c.e_key), ("e_val", c.e_val), ("e_round", c.e_round), ("bound", c.bound)] {
            d.set_item(k, v)?;
        }
        d.set_item("promoted", c.promoted)?;
        d.set_item("explored", c.explored)?;
        d.set_item("rung", c.rung)?;
        d.set_item("detections", c.detections)?;
        d.set_item("ranking", c.ranking)?;
        d.set_item("boundary", c.boundary)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let c = &self.0;
        format!("kvforge.HeadCertificate(bound={:.3e}, e_key={:.3e}, e_val={:.3e}, delta={:.3e}, alpha_tail={:.3e}, promoted={}, rung={})", c.bound, c.e_key, c.e_val, c.delta, c.alpha_tail, c.promoted, c.rung)
    }
}
