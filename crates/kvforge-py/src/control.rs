//! `kvforge.Controller`: kvforge-control's tier policies (RDR, RDKV) on a Python-held cache.
//!
//! The controller reads the page table of one sequence (positions come from the cache, which
//! records them through drops), weighs pages by the caller's per-token attention mass, decides
//! with the policy and applies the plan with the transcode kernels; the plan is checked before
//! the cache is touched and the cache verified after ([`kvforge_control::runtime::apply`]).
//! Every call returns a [`ControlReport`], the controller telemetry as a Python object.

use std::collections::HashMap;
use std::time::Instant;

use kvforge_control::runtime::{self, PositionMap, Signal};
use kvforge_control::{Budget, Controller as Policy, CostModel, DistortionTable, DropPolicy, Limits, PagedImportance, Protection, RdkvController, RdrController, TierCosts};
use kvforge_control_rt::{OfCache, RollCache};
use kvforge_spec::{Spec, TierId};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::{bad, guarded, py_error, tier_id, Cache, OrPy};

enum Kind {
    Rdr(Box<RdrController>),
    Rdkv(RdkvController),
}

impl Kind {
    fn policy(&mut self) -> &mut dyn Policy {
        match self {
            Kind::Rdr(c) => c.as_mut(),
            Kind::Rdkv(c) => c,
        }
    }
}

/// A tier controller for the sequences of one cache (one attention layer).
///
/// Controller(cache, policy="rdr", budget=..., per="token", sinks=4, recent=128, floor=None,
///            cost="resident", every=16, cooldown=64, margin=0.1, drop="penalty",
///            drop_penalty=1.0, eps_k=None, eps_v=None, beta=0.5, sample=8)
///
/// `policy`: "rdr" (seed 000 App. C: knapsack over the ladder with hysteresis, meant to run
/// every `every` decode steps) or "rdkv" (seed 002: Lagrangian allocation once after prefill,
/// at page granularity). `budget`: bytes per token per kv head of the context (`per="token"`,
/// dropped positions included) or bytes of the whole sequence over its kv heads
/// (`per="total"`). `cost`: "resident" charges whole page slots (what the GPU holds),
/// "payload" payload + metadata bytes only. Protection: the first `sinks` and last `recent`
/// positions are never dropped nor re-coded below `floor` (a tier name or id; default the
/// spec's first ladder tier). RDKV's distortion tables `eps_k`, `eps_v` map bit widths to
/// NMSE (default: seed 002's LLaMA-3.1-8B tables); RDR uses the spec's proxy table.
/// `beta`: EMA coefficient of the importance RDR reads from the GPU window
/// (`apply(..., window=True)`; seed 000 C.2 `EMA_β(max over the window)`), fed by the decode
/// steps `tracks()` names (one in `sample`).
#[pyclass(module = "kvforge", name = "Controller", unsendable)]
pub struct Controller {
    kind: Kind,
    name: &'static str,
    limits: Limits,
    costs: TierCosts,
    spec: Spec,
    head_dim: usize,
    applied: usize,
    beta: f64,
    /// Per sequence: the EMA of the device window's maxima (`apply(..., window=True)`).
    importance: HashMap<usize, PagedImportance>,
}

fn parse_table(py: Python<'_>, what: &str, t: &Bound<'_, PyDict>) -> PyResult<Vec<(u32, f64)>> {
    let mut v = Vec::new();
    for (k, x) in t.iter() {
        let bits: u32 = k.extract().map_err(|_| bad(py, format!("{what}: keys are bit widths (int)")))?;
        let e: f64 = x.extract().map_err(|_| bad(py, format!("{what}[{bits}]: values are NMSE (float)")))?;
        if !(e.is_finite() && e >= 0.0) {
            return Err(bad(py, format!("{what}[{bits}] = {e}: NMSE must be finite and >= 0")));
        }
        v.push((bits, e));
    }
    Ok(v)
}

#[pymethods]
impl Controller {
    #[new]
    #[pyo3(signature = (cache, policy = "rdr", budget = None, per = "token", sinks = 4, recent = 128, floor = None, cost = "resident", every = 16, cooldown = 64, margin = 0.1, drop = "penalty", drop_penalty = 1.0, eps_k = None, eps_v = None, beta = 0.5, sample = 8))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        cache: PyRef<'_, Cache>,
        policy: &str,
        #[pyo3(from_py_with = crate::opt_real)] budget: Option<f64>,
        per: &str,
        #[pyo3(from_py_with = crate::nat)] sinks: usize,
        #[pyo3(from_py_with = crate::nat)] recent: usize,
        floor: Option<Bound<'_, PyAny>>,
        cost: &str,
        #[pyo3(from_py_with = crate::nat)] every: usize,
        #[pyo3(from_py_with = crate::nat)] cooldown: usize,
        #[pyo3(from_py_with = crate::real)] margin: f64,
        drop: &str,
        #[pyo3(from_py_with = crate::real)] drop_penalty: f64,
        eps_k: Option<Bound<'_, PyDict>>,
        eps_v: Option<Bound<'_, PyDict>>,
        #[pyo3(from_py_with = crate::real)] beta: f64,
        #[pyo3(from_py_with = crate::nat)] sample: usize,
    ) -> PyResult<Controller> {
        guarded(py, || {
            // Checked here, not at the first windowed apply: a bad β is a construction error.
            PagedImportance::new(beta, cache.inner.spec().page.tokens).map_err(|e| bad(py, format!("Controller: beta: {e}")))?;
            // Controllers read tail-tier pages as the tail: a window policy's dense full pages
            // would be mistaken for it (controllers keep their own sinks and recent pages).
            let w = cache.inner.config().window;
            if !w.is_off() {
                return Err(bad(
                    py,
                    format!(
                        "Controller: the cache has a window policy ({} sink pages, {} recent pages); controllers need a cache without one (use the controller's sinks= and recent=)",
                        w.sink_pages, w.recent_pages
                    ),
                ));
            }
            let spec = cache.inner.spec().clone();
            let d = cache.inner.config().head_dim;
            let budget = budget.ok_or_else(|| bad(py, "Controller: budget= is required (bytes per token per kv head, or per=\"total\" bytes)"))?;
            if !(budget.is_finite() && budget >= 0.0) {
                return Err(bad(py, format!("Controller: budget {budget} must be finite and >= 0")));
            }
            let budget = match per {
                "token" => Budget::PerToken(budget),
                "total" => Budget::Total(budget),
                _ => return Err(bad(py, format!("Controller: per must be \"token\" or \"total\", got {per:?}"))),
            };
            let model = match cost {
                "resident" => CostModel::Resident,
                "payload" => CostModel::Payload,
                _ => return Err(bad(py, format!("Controller: cost must be \"resident\" or \"payload\", got {cost:?}"))),
            };
            let floor: TierId = match floor {
                Some(f) => tier_id(py, &spec, &f)?,
                None => Protection::default().floor,
            };
            let limits = Limits { budget, protection: Protection { sink_tokens: sinks, recent_tokens: recent, floor } };
            let (kind, name) = match policy {
                "rdr" => {
                    if every == 0 || sample == 0 {
                        return Err(bad(py, "Controller: every and sample must be at least 1"));
                    }
                    if !(margin.is_finite() && margin >= 0.0 && drop_penalty.is_finite() && drop_penalty >= 0.0) {
                        return Err(bad(py, "Controller: margin and drop_penalty must be finite and >= 0"));
                    }
                    let mut c = RdrController::with_table(DistortionTable::from_spec(&spec));
                    c.every = every;
                    c.sample = sample;
                    c.cooldown = cooldown;
                    c.margin = margin;
                    c.drop_policy = match drop {
                        "penalty" => DropPolicy::Penalty(drop_penalty),
                        "last_resort" => DropPolicy::LastResort,
                        "joint" => DropPolicy::Joint,
                        _ => return Err(bad(py, format!("Controller: drop must be \"penalty\", \"last_resort\" or \"joint\", got {drop:?}"))),
                    };
                    (Kind::Rdr(Box::new(c)), "rdr")
                }
                "rdkv" => {
                    let k = match &eps_k {
                        Some(t) => parse_table(py, "eps_k", t)?,
                        None => kvforge_control::rdkv::EPS_K_LLAMA31_8B.to_vec(),
                    };
                    let v = match &eps_v {
                        Some(t) => parse_table(py, "eps_v", t)?,
                        None => kvforge_control::rdkv::EPS_V_LLAMA31_8B.to_vec(),
                    };
                    let c = RdkvController::with_tables(&spec, &k, &v).map_err(|e| bad(py, format!("Controller(rdkv): {e}")))?;
                    (Kind::Rdkv(c), "rdkv")
                }
                _ => return Err(bad(py, format!("Controller: policy must be \"rdr\" or \"rdkv\", got {policy:?}"))),
            };
            Ok(Controller { kind, name, limits, costs: TierCosts::from_spec(&spec, d, model), spec, head_dim: d, applied: 0, beta, importance: HashMap::new() })
        })
    }

    /// Whether the next decode step should record page masses (`decode(..., track=True)`):
    /// RDR samples one step in `sample` (at most `every`), the last before each `due()` among
    /// them; the other steps decode without tracking, which is cheaper. RDKV: never.
    fn tracks(&self) -> bool {
        match &self.kind {
            Kind::Rdr(c) => c.tracks(),
            Kind::Rdkv(_) => false,
        }
    }

    /// Counts one decode step; True when the controller should run now (RDR: every `every`
    /// steps; RDKV: until it has run once).
    fn due(&mut self) -> bool {
        match &mut self.kind {
            Kind::Rdr(c) => c.step(),
            Kind::Rdkv(_) => self.applied == 0,
        }
    }

    /// Decides and applies tiers for sequence `seq` of `cache`. `token_mass`: attention mass
    /// per kv head and logical position, `[num_kv_heads][seq_len]` (a list of lists or a
    /// tensor; e.g. prefill column sums Σ_τ a_τt summed over the GQA group); None weighs every
    /// token equally. `window=True` instead takes the sequence's importance window that
    /// tracked decodes kept on the GPU (`cache.decode(..., track=True)`; this resets it) and
    /// rolls it into this controller's EMA of the sequence's page importance (β = `beta`),
    /// which weighs the pages: RDR's signal at no per-step host cost. Returns a ControlReport.
    #[pyo3(signature = (cache, seq, token_mass = None, window = false))]
    fn apply(
        &mut self,
        py: Python<'_>,
        mut cache: PyRefMut<'_, Cache>,
        #[pyo3(from_py_with = crate::nat)] seq: usize,
        token_mass: Option<Bound<'_, PyAny>>,
        #[pyo3(from_py_with = crate::flag)] window: bool,
    ) -> PyResult<ControlReport> {
        guarded(py, || {
            if cache.inner.spec().name != self.spec.name || cache.inner.config().head_dim != self.head_dim {
                return Err(bad(
                    py,
                    format!("Controller was made for spec `{}` at head_dim {}, the cache holds `{}` at {}", self.spec.name, self.head_dim, cache.inner.spec().name, cache.inner.config().head_dim),
                ));
            }
            if window && token_mass.is_some() {
                return Err(bad(py, "Controller.apply: pass token_mass or window=True, not both"));
            }
            let hkv = cache.inner.config().num_kv_heads;
            let len = cache.inner.seq_len(seq).or_py(py)?;
            let mass: Option<Vec<Vec<f64>>> = match token_mass {
                None => None,
                Some(m) => {
                    let m = if m.hasattr("detach")? { m.call_method0("detach")?.call_method0("double")?.call_method0("cpu")? } else { m };
                    let list = if m.hasattr("tolist")? { m.call_method0("tolist")? } else { m };
                    let v: Vec<Vec<f64>> = list.extract().map_err(|_| bad(py, format!("token_mass must be [num_kv_heads={hkv}][seq_len={len}] numbers")))?;
                    if v.len() != hkv || v.iter().any(|r| r.len() != len) {
                        let shape = format!("[{}][{}]", v.len(), v.first().map_or(0, Vec::len));
                        return Err(bad(py, format!("token_mass has shape {shape}, expected [num_kv_heads={hkv}][seq_len={len}]")));
                    }
                    if let Some(x) = v.iter().flatten().find(|x| !(x.is_finite() && **x >= 0.0)) {
                        return Err(bad(py, format!("token_mass holds {x}: masses must be finite and >= 0")));
                    }
                    Some(v)
                }
            };
            let importance = if window {
                let page_tokens = self.spec.page.tokens;
                let beta = self.beta;
                let imp = match self.importance.entry(seq) {
                    std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::hash_map::Entry::Vacant(e) => e.insert(PagedImportance::new(beta, page_tokens).map_err(|e| bad(py, format!("Controller: beta: {e}")))?),
                };
                cache.on_torch_stream(py, |c| Ok(imp.roll_cache(c, seq)))?.map_err(|e| py_error(py, "Control", e.to_string()))?;
                Some(&*imp)
            } else {
                None
            };
            let t0 = Instant::now();
            let control_err = |e: runtime::ControlError| py_error(py, "Control", e.to_string());
            let mut pos = PositionMap::of_cache(&cache.inner, seq).map_err(control_err)?;
            let view = pos
                .view(&cache.inner, self.costs.clone(), |key, tokens| match (&mass, importance) {
                    (Some(m), _) => {
                        let t = m[key.head][key.first_token..(key.first_token + tokens).min(len)].to_vec();
                        Signal { mass: t.iter().sum(), token_mass: Some(t), pinned: false }
                    }
                    (None, Some(imp)) => Signal { mass: imp.get(key), token_mass: None, pinned: false },
                    (None, None) => Signal { mass: tokens as f64, token_mass: None, pinned: false },
                })
                .map_err(control_err)?;
            let plan = self.kind.policy().decide(&view, &self.limits);
            let decide_s = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            // The plan's result rides out of the stream joins; its error is mapped below.
            let r = cache.on_torch_stream(py, |c| Ok(pos.apply(c, &view, &plan, &self.limits)));
            cache.generation += 1;
            let r = r?.map_err(control_err)?;
            self.applied += 1;
            let names = |t: TierId| self.spec.tiers[t as usize].name.clone();
            Ok(ControlReport {
                policy: self.name.to_string(),
                seq,
                context_tokens: view.context_tokens,
                decisions: plan.decisions.iter().map(|d| (d.page.head, d.page.index, names(d.from_tier), names(d.to_tier))).collect(),
                dropped: r.dropped,
                retiered: r.retiered,
                budget_bytes: plan.budget_bytes,
                bytes_before: r.bytes_before,
                bytes_after: r.bytes_after,
                feasible: plan.feasible,
                lam: plan.lambda,
                duality_gap: plan.duality_gap,
                distortion_before: plan.distortion_before,
                distortion_after: plan.distortion_after,
                forced: plan.forced.len(),
                decide_seconds: decide_s,
                apply_seconds: t1.elapsed().as_secs_f64(),
            })
        })
    }

    /// Forgets the importance EMA of `seq` (call when the sequence is removed: its id is
    /// reused by the next `add_sequence`, which must not inherit the old pages' importance).
    fn forget(&mut self, #[pyo3(from_py_with = crate::nat)] seq: usize) {
        self.importance.remove(&seq);
    }

    /// The smoothed importance (EMA of the GPU window's maxima) of every page of `seq`
    /// rolled in so far, per kv head in `cache.pages(seq, head)` order; 0.0 for pages never
    /// observed. Empty before the first `apply(..., window=True)` of `seq`.
    fn importance(&self, py: Python<'_>, cache: PyRef<'_, Cache>, #[pyo3(from_py_with = crate::nat)] seq: usize) -> PyResult<Vec<Vec<f64>>> {
        let Some(imp) = self.importance.get(&seq) else { return Ok(Vec::new()) };
        (0..cache.inner.config().num_kv_heads)
            .map(|h| Ok(cache.inner.positioned_pages(seq, h).or_py(py)?.into_iter().map(|p| imp.get(kvforge_control::PageKey { head: h, first_token: p.2 })).collect()))
            .collect()
    }

    /// "rdr" or "rdkv".
    #[getter]
    fn policy(&self) -> &str {
        self.name
    }

    /// The budget in bytes for a context of `tokens` positions over the cache's kv heads.
    fn budget_bytes(&self, #[pyo3(from_py_with = crate::nat)] tokens: usize, #[pyo3(from_py_with = crate::nat)] kv_heads: usize) -> f64 {
        self.limits.budget.bytes(tokens, kv_heads)
    }

    fn __repr__(&self) -> String {
        format!("kvforge.Controller(policy={:?}, budget={:?}, protection={:?}, applied={})", self.name, self.limits.budget, self.limits.protection, self.applied)
    }
}

/// What one `Controller.apply` decided and did (controller telemetry).
#[pyclass(module = "kvforge", name = "ControlReport", get_all, frozen)]
#[derive(Clone)]
pub struct ControlReport {
    pub policy: String,
    pub seq: usize,
    /// Logical positions of the sequence (dropped ones included).
    pub context_tokens: usize,
    /// (kv head, page index, from tier, to tier) per re-coded or dropped page.
    pub decisions: Vec<(usize, usize, String, String)>,
    pub dropped: usize,
    pub retiered: usize,
    pub budget_bytes: f64,
    pub bytes_before: f64,
    pub bytes_after: f64,
    /// bytes_after <= budget_bytes (false only when protected pages alone exceed it).
    pub feasible: bool,
    /// The knapsack's Lagrange multiplier λ (distortion per byte at the margin).
    pub lam: f64,
    pub duality_gap: f64,
    /// Predicted distortion before and after (the policy's proxy).
    pub distortion_before: f64,
    pub distortion_after: f64,
    /// Pages moved inside their hysteresis cooldown because the budget forced it (RDR).
    pub forced: usize,
    pub decide_seconds: f64,
    pub apply_seconds: f64,
}

#[pymethods]
impl ControlReport {
    /// The report as a plain dict (JSON-ready).
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("policy", &self.policy)?;
        d.set_item("decisions", self.decisions.clone())?;
        d.set_item("feasible", self.feasible)?;
        for (k, v) in [("seq", self.seq), ("context_tokens", self.context_tokens), ("dropped", self.dropped), ("retiered", self.retiered), ("forced", self.forced)] {
            d.set_item(k, v)?;
        }
        let reals = [
            ("budget_bytes", self.budget_bytes),
            ("bytes_before", self.bytes_before),
            ("bytes_after", self.bytes_after),
            ("lam", self.lam),
            ("duality_gap", self.duality_gap),
            ("distortion_before", self.distortion_before),
            ("distortion_after", self.distortion_after),
            ("decide_seconds", self.decide_seconds),
            ("apply_seconds", self.apply_seconds),
        ];
        for (k, v) in reals {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "kvforge.ControlReport(policy={:?}, dropped={}, retiered={}, bytes {:.0} -> {:.0} (budget {:.0}, feasible {}), gap {:.3e})",
            self.policy, self.dropped, self.retiered, self.bytes_before, self.bytes_after, self.budget_bytes, self.feasible, self.duality_gap
        )
    }
}
