//! The quality-vs-bytes frontier: attention output error of every tiering policy against
//! exact f64 attention, at byte budgets, on synthetic attention ([`crate::synth`]).
//!
//! A [`World`] is one synthetic sequence (several kv heads, one seed) seen through one spec:
//! every full page is coded as the GPU codes it — encoded byte-exactly by kvforge-ref into the
//! first ladder tier, and for every lower tier *transcoded* from that first-tier page (decoded,
//! re-encoded), as `KvCache::retier` does — and the dense tail page in the tail tier. Rather
//! than keeping decoded keys and values (gigabytes at 16K × several heads), each (page, tier)
//! keeps the split-K partial `(m, l, o)` of every held-out test query over that page: any
//! assignment of tiers to pages is then scored by merging one partial per page, exactly the
//! decode kernel's split-K combine, and compared with attention over the original keys.
//!
//! The controllers see what the runtime would give them:
//! * [`Signal::DecodeMass`]: per-page attention mass of a window of decode queries *over the
//!   coded first-tier pages*, normalised per kv head over Σ_{GQA heads} Σ_tokens e^logit — what
//!   `KvCache::decode_with_mass` reports — folded into an [`ImportanceTracker`] window by
//!   window (RDR's signal). The GPU reports no per-token masses, so RDR's concentration proxy
//!   falls back to page level ([`kvforge_control::distortion::Proxy`]).
//! * [`Signal::ColumnSums`]: seed 002's prefill column sums `w_t = Σ_τ a_τt` of an
//!   observation window of prefill queries over the original keys, per token (RDKV's signal).
//!
//! and decide through the runtime path: a [`SimCache`] holding the sequence, a
//! [`PositionMap`] view, `decide`, [`runtime::apply`] (checked before, verified after). The
//! resident bytes are read back from the cache and must not exceed the budget whenever the
//! plan is feasible (asserted).

pub mod gpu;
pub mod pipeline_gpu;
pub mod timing;

use std::collections::HashMap;

use kvforge_ref::{attention, decode_page, encode_page, radius_scales, softmax_weights, stored_rows};
use kvforge_spec::{Codebook, KeyScheme, Spec, TierId, TAIL_TIER};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::synth::{HeadShape, SynthHead};
use kvforge_control::budget::{Budget, CostModel, TierCosts};
use kvforge_control::check::simulate;
use kvforge_control::protect::Protection;
use kvforge_control::runtime::{self, ControlError, PagedCache, PositionMap, SimCache};
use kvforge_control::signal::{ImportanceTracker, PageKey, PageTableView};
use kvforge_control::Controller;
use kvforge_control::{Limits, Plan};

/// One synthetic sequence.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Tokens per kv head (full pages, then a dense tail of `context % page` tokens).
    pub context: usize,
    pub shapes: Vec<HeadShape>,
    pub d: usize,
    pub gqa: usize,
    pub seed: u64,
    /// Prefill observation queries per kv head (each `gqa` rows): RDKV's column sums.
    pub prefill_queries: usize,
    /// Decode queries per kv head whose page masses feed RDR's tracker.
    pub decode_queries: usize,
    /// Held-out decode queries per kv head the error is measured on.
    pub test_queries: usize,
    /// Background keys near this codebook's codewords (None: isotropic keys).
    pub key_codebook: Option<Codebook>,
    /// Spherical radius scales: the largest radius per group × this headroom
    /// (`CacheConfig::radius_headroom` is 1.25).
    pub radius_headroom: f32,
}

impl Scenario {
    /// The frontier's default: d 128, gqa 4, 16 prefill, 32 decode and 4 test queries per head.
    pub fn new(context: usize, heads: usize, seed: u64) -> Scenario {
        Scenario { context, shapes: HeadShape::mix(heads), d: 128, gqa: 4, seed, prefill_queries: 16, decode_queries: 32, test_queries: 4, key_codebook: None, radius_headroom: 1.25 }
    }

    /// Draws the heads and their queries (in that order per head): `(heads, prefill rows,
    /// decode rows, test rows)`, queries rounded to `dtype` as the GPU receives them.
    pub fn draw(&self, page_tokens: usize, dtype: kvforge_spec::DType) -> (Vec<SynthHead>, Vec<Vec<f64>>, Vec<Vec<f64>>, Vec<Vec<f64>>) {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let round = |q: Vec<f64>| -> Vec<f64> { q.into_iter().map(|x| kvforge_ref::dense::round(dtype, x as f32)).collect() };
        let (mut hs, mut pre, mut dec, mut test) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for &shape in &self.shapes {
            let h = SynthHead::generate(&mut rng, self.d, self.context, page_tokens, shape, self.key_codebook.as_ref());
            pre.push(round(h.queries(&mut rng, self.prefill_queries * self.gqa)));
            dec.push(round(h.queries(&mut rng, self.decode_queries * self.gqa)));
            test.push(round(h.queries(&mut rng, self.test_queries * self.gqa)));
            hs.push(h);
        }
        (hs, pre, dec, test)
    }
}

/// Tier of every full page of every kv head (`None`: dropped); the tail page is always dense.
pub type Assignment = Vec<Vec<Option<TierId>>>;

/// Per kv head, what the coded pages give the test queries.
#[derive(Clone, Debug)]
struct CodedHead {
    /// `pages[i][tier]`: `[rows][m, l, o_0 … o_{d−1}]` of full page `i` coded in `tier`.
    pages: Vec<Vec<Option<Vec<f64>>>>,
    tail: Option<Vec<f64>>,
    /// Exact outputs `[rows][d]` over the original keys and values.
    exact: Vec<f64>,
    /// `decode_mass[q][page]`: share of decode query `q` (its GQA rows together) of Σ e^logit
    /// over the first-tier pages and the tail page, in page order.
    decode_mass: Vec<Vec<f64>>,
    /// Prefill column sums per token.
    column_sums: Vec<f64>,
    /// Σ‖K − K̂‖², Σ‖K‖², and the same for V, per tier, over all full pages.
    nmse: Vec<[f64; 4]>,
}

/// One synthetic sequence coded through one spec.
#[derive(Clone, Debug)]
pub struct World {
    pub spec: Spec,
    pub scenario: Scenario,
    pub heads: Vec<SynthHead>,
    /// Full pages and tail tokens per kv head.
    pub full: usize,
    pub tail: usize,
    coded: Vec<CodedHead>,
}

/// Split-K partial of each row of `q` (`[rows][d]`) over `k`, `v` (`[n][d]`), appended to `out`.
fn partials(q: &[f64], k: &[f64], v: &[f64], d: usize, sm: f64, out: &mut Vec<f64>) {
    for row in q.chunks_exact(d) {
        let s: Vec<f64> = k.chunks_exact(d).map(|kt| sm * row.iter().zip(kt).map(|(a, b)| a * b).sum::<f64>()).collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let base = out.len();
        out.push(m);
        out.push(0.0);
        out.resize(base + 2 + d, 0.0);
        let mut l = 0.0;
        for (st, vt) in s.iter().zip(v.chunks_exact(d)) {
            let e = (st - m).exp();
            l += e;
            for (o, x) in out[base + 2..].iter_mut().zip(vt) {
                *o += e * x;
            }
        }
        out[base + 1] = l;
    }
}

/// `ln Σ_rows Σ_t e^{s}` of the rows of `q` over `k`: a page's log-mass for one decode query.
fn log_mass(q: &[f64], k: &[f64], d: usize, sm: f64) -> f64 {
    let s: Vec<f64> = q.chunks_exact(d).flat_map(|row| k.chunks_exact(d).map(move |kt| sm * row.iter().zip(kt).map(|(a, b)| a * b).sum::<f64>())).collect();
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    m + s.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

fn err_sq(a: &[f64], b: &[f64]) -> (f64, f64) {
    a.iter().zip(b).fold((0.0, 0.0), |(e, s), (&x, &y)| (e + (x - y) * (x - y), s + x * x))
}

/// Codes one head: every full page in every live tier (transcoded from the first), the tail.
#[allow(clippy::too_many_arguments)]
fn code_head(spec: &Spec, sc: &Scenario, h: &SynthHead, pre: &[f64], dec: &[f64], test: &[f64]) -> CodedHead {
    let (d, p) = (sc.d, spec.page.tokens);
    let sm = 1.0 / (d as f64).sqrt();
    let n = h.tokens();
    let full = n / p;
    let tail = n % p;
    let rs: Vec<Vec<f32>> = spec
        .tiers
        .iter()
        .map(|t| match &t.key {
            KeyScheme::Spherical { group, .. } => radius_scales(&h.k, d, *group).into_iter().map(|s| s * sc.radius_headroom).collect(),
            _ => Vec::new(),
        })
        .collect();
    let mut nmse = vec![[0.0; 4]; spec.tiers.len()];
    let dec_rows = sc.gqa * d;
    let nq = dec.len() / dec_rows.max(1);
    let mut page_logmass: Vec<Vec<f64>> = vec![Vec::with_capacity(full + 1); nq];
    // Pages hold rows in the spec's basis (a rotated spec: R x rounded to the dtype, as the
    // runtime appends them); what attention sees is mapped back.
    let basis = spec.basis();
    let (hk, hv) = (stored_rows(spec, d, &h.k), stored_rows(spec, d, &h.v));
    let natural = |mut x: Vec<f64>| {
        basis.to_natural(d, &mut x);
        x
    };
    let mut pages = Vec::with_capacity(full);
    for i in 0..full {
        let r = i * p * d..(i + 1) * p * d;
        let first = &spec.tiers[1];
        let bytes = encode_page(first, d, &spec.page, &hk[r.clone()], &hv[r.clone()], &rs[1]).expect("encode first tier");
        let top = decode_page(first, d, &spec.page, &bytes, &rs[1]).expect("decode first tier");
        let (k32, v32): (Vec<f32>, Vec<f32>) = (top.k.iter().map(|&x| x as f32).collect(), top.v.iter().map(|&x| x as f32).collect());
        let (top_k, top_v) = (natural(top.k), natural(top.v));
        for (q, lm) in dec.chunks_exact(dec_rows).zip(page_logmass.iter_mut()) {
            lm.push(log_mass(q, &top_k, d, sm));
        }
        let mut tiers = vec![None; spec.tiers.len()];
        for t in spec.tiers.iter().skip(1).filter(|t| !t.is_drop()) {
            let (kk, vv) = if t.id == 1 {
                (top_k.clone(), top_v.clone())
            } else {
                let b = encode_page(t, d, &spec.page, &k32, &v32, &rs[t.id as usize]).expect("transcode");
                let pg = decode_page(t, d, &spec.page, &b, &rs[t.id as usize]).expect("decode transcoded page");
                (natural(pg.k), natural(pg.v))
            };
            let (ek, sk) = err_sq(&to64(&h.k[r.clone()]), &kk);
            let (ev, sv) = err_sq(&to64(&h.v[r.clone()]), &vv);
            let e = &mut nmse[t.id as usize];
            e[0] += ek;
            e[1] += sk;
            e[2] += ev;
            e[3] += sv;
            let mut out = Vec::with_capacity(test.len() / d * (d + 2));
            partials(test, &kk, &vv, d, sm, &mut out);
            tiers[t.id as usize] = Some(out);
        }
        pages.push(tiers);
    }
    let tail_partials = (tail > 0).then(|| {
        let r = full * p * d..n * d;
        let t = &spec.tiers[TAIL_TIER as usize];
        let b = encode_page(t, d, &spec.page, &hk[r.clone()], &hv[r], &[]).expect("encode tail");
        let pg = decode_page(t, d, &spec.page, &b, &[]).expect("decode tail");
        let (pk, pv) = (natural(pg.k), natural(pg.v));
        for (q, lm) in dec.chunks_exact(dec_rows).zip(page_logmass.iter_mut()) {
            lm.push(log_mass(q, &pk, d, sm));
        }
        let mut out = Vec::new();
        partials(test, &pk, &pv, d, sm, &mut out);
        out
    });
    let decode_mass = page_logmass
        .into_iter()
        .map(|lm| {
            let m = lm.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let tot: f64 = lm.iter().map(|l| (l - m).exp()).sum();
            lm.iter().map(|l| (l - m).exp() / tot).collect()
        })
        .collect();
    let (k, v) = (to64(&h.k), to64(&h.v));
    let exact = test.chunks_exact(d).flat_map(|q| attention(q, &k, &v, sm).0).collect();
    let mut column_sums = vec![0.0; n];
    for q in pre.chunks_exact(d) {
        for (w, a) in column_sums.iter_mut().zip(softmax_weights(q, &k, sm)) {
            *w += a;
        }
    }
    CodedHead { pages, tail: tail_partials, exact, decode_mass, column_sums, nmse }
}

/// Output errors of the test queries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Errors {
    /// ‖o − ô‖ / ‖o‖ per test row (query head × test query), head by head.
    pub per_row: Vec<f64>,
    /// Σ‖o − ô‖² and Σ‖o‖² over all rows.
    pub num: f64,
    pub den: f64,
}

impl Errors {
    pub fn mean(&self) -> f64 {
        self.per_row.iter().sum::<f64>() / self.per_row.len().max(1) as f64
    }
    /// The 90th percentile (nearest rank).
    pub fn p90(&self) -> f64 {
        quantile(&self.per_row, 0.9)
    }
    /// √(Σ‖o − ô‖² / Σ‖o‖²): rows with large outputs weigh more.
    pub fn pooled(&self) -> f64 {
        (self.num / self.den).sqrt()
    }
    pub fn extend(&mut self, o: &Errors) {
        self.per_row.extend_from_slice(&o.per_row);
        self.num += o.num;
        self.den += o.den;
    }
}

/// Nearest-rank quantile.
pub fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// Where a controller's importance comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Signal {
    /// Page masses of the decode queries (GPU `decode_with_mass`), `window` queries per
    /// tracker window (RDR's invocation period), EMA coefficient `beta`; only one query in
    /// `sample` is observed (the runtime tracks one decode step in `sample`,
    /// [`RdrController::tracks`](kvforge_control::RdrController::tracks)).
    DecodeMass { window: usize, beta: f64, sample: usize },
    /// Prefill column sums; `per_token` also hands the controller the token masses (RDKV's
    /// token weights), else only their page sums.
    ColumnSums { per_token: bool },
}

/// What a controller did at one budget.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub plan: Plan,
    pub assignment: Assignment,
    pub budget_bytes: f64,
    /// Bytes the cache holds after the plan (pages × page slot bytes), read from the cache.
    pub resident_bytes: f64,
    pub feasible: bool,
    pub errors: Errors,
    pub moves: usize,
    pub drops: usize,
    /// Pages holding a needle that were dropped.
    pub dropped_needle_pages: usize,
    /// Controller decision time.
    pub decide_us: f64,
}

impl World {
    /// Draws the scenario and codes it through `spec` (heads in parallel threads).
    pub fn build(spec: &Spec, scenario: &Scenario) -> World {
        let p = spec.page.tokens;
        assert!(spec.tiers.len() >= 2 && !spec.tiers[1].is_drop(), "spec `{}` has no first ladder tier to encode into", spec.name);
        let (heads, pre, dec, test) = scenario.draw(p, spec.geometry.dtype);
        let coded: Vec<CodedHead> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..heads.len())
                .map(|i| {
                    let (h, pre, dec, test) = (&heads[i], &pre[i], &dec[i], &test[i]);
                    s.spawn(move || code_head(spec, scenario, h, pre, dec, test))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("coding thread")).collect()
        });
        World { spec: spec.clone(), scenario: scenario.clone(), heads, full: scenario.context / p, tail: scenario.context % p, coded }
    }

    /// Id of the tier named `name`.
    ///
    /// # Panics
    /// If the spec has no such tier.
    pub fn tier(&self, name: &str) -> TierId {
        self.spec.tiers.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("spec `{}` has no tier `{name}`", self.spec.name)).id
    }

    pub fn num_heads(&self) -> usize {
        self.heads.len()
    }

    pub fn costs(&self) -> TierCosts {
        TierCosts::from_spec(&self.spec, self.scenario.d, CostModel::Resident)
    }

    /// Resident bytes of the whole sequence with every page (tail included) in fp16 page slots:
    /// the reference the budget fractions are taken of.
    pub fn fp16_bytes(&self) -> f64 {
        let pages = self.full + usize::from(self.tail > 0);
        (pages * self.num_heads()) as f64 * self.costs().cost(TAIL_TIER, self.spec.page.tokens)
    }

    /// Measured NMSE `(K, V)` of each tier over this world's pages (0 for the tail and drop).
    pub fn tier_nmse(&self) -> Vec<(f64, f64)> {
        (0..self.spec.tiers.len())
            .map(|t| {
                let s = self.coded.iter().fold([0.0; 4], |a, c| {
                    let x = c.nmse[t];
                    [a[0] + x[0], a[1] + x[1], a[2] + x[2], a[3] + x[3]]
                });
                if s[1] > 0.0 {
                    (s[0] / s[1], s[2] / s[3])
                } else {
                    (0.0, 0.0)
                }
            })
            .collect()
    }

    /// Errors of the test queries with pages in `a`.
    pub fn errors(&self, a: &Assignment) -> Errors {
        let d = self.scenario.d;
        let w = d + 2;
        let mut e = Errors::default();
        for (h, c) in self.coded.iter().enumerate() {
            let rows = c.exact.len() / d;
            let mut parts: Vec<&[f64]> = a[h].iter().enumerate().filter_map(|(i, t)| t.map(|t| c.pages[i][t as usize].as_deref().expect("live tier coded"))).collect();
            if let Some(t) = &c.tail {
                parts.push(t);
            }
            for r in 0..rows {
                let m = parts.iter().map(|x| x[r * w]).fold(f64::NEG_INFINITY, f64::max);
                let mut l = 0.0;
                let mut o = vec![0.0; d];
                if m > f64::NEG_INFINITY {
                    for x in &parts {
                        let s = (x[r * w] - m).exp();
                        l += s * x[r * w + 1];
                        for (acc, y) in o.iter_mut().zip(&x[r * w + 2..(r + 1) * w]) {
                            *acc += s * y;
                        }
                    }
                    o.iter_mut().for_each(|y| *y /= l);
                }
                let (num, den) = err_sq(&c.exact[r * d..(r + 1) * d], &o);
                e.per_row.push((num / den).sqrt());
                e.num += num;
                e.den += den;
            }
        }
        e
    }

    /// Uniform quantisation: every full page in `tier`, the tail dense. With `keep`, the pages
    /// it protects (sinks, recent window) stay in the first tier, as KIVI-style baselines keep
    /// a full-precision window — the same protection the controllers get. Returns the
    /// assignment and its resident bytes.
    pub fn uniform(&self, tier: TierId, keep: Option<&Protection>) -> (Assignment, f64) {
        let costs = self.costs();
        let p = self.spec.page.tokens;
        let ctx = self.scenario.context;
        let a: Assignment = (0..self.num_heads())
            .map(|_| {
                (0..self.full)
                    .map(|i| {
                        let page = kvforge_control::signal::PageInfo { tier: 1, tokens: p, first_token: i * p, last_token: i * p + p - 1, mass: 0.0, token_mass: None, pinned: false };
                        Some(if keep.is_some_and(|k| k.protects(&page, ctx)) { 1 } else { tier })
                    })
                    .collect()
            })
            .collect();
        let tail = if self.tail > 0 { costs.cost(TAIL_TIER, self.tail) } else { 0.0 };
        let bytes = a.iter().map(|h| h.iter().map(|t| costs.cost(t.unwrap(), p)).sum::<f64>() + tail).sum();
        (a, bytes)
    }

    /// RDR's importance: decode page masses folded into an [`ImportanceTracker`] window by
    /// window, as the runtime does between invocations: of each window's queries only those
    /// the runtime would track (one in `sample`, counted back from the window's last) are
    /// observed.
    pub fn tracker(&self, window: usize, beta: f64, sample: usize) -> ImportanceTracker {
        let p = self.spec.page.tokens;
        let mut tr = ImportanceTracker::new(beta);
        let nq = self.coded.first().map_or(0, |c| c.decode_mass.len());
        for w in (0..nq).collect::<Vec<_>>().chunks(window.max(1)) {
            for (j, &q) in w.iter().enumerate() {
                if !kvforge_control::rdr::sampled(j as u64, w.len(), sample) {
                    continue;
                }
                for (h, c) in self.coded.iter().enumerate() {
                    for (i, &m) in c.decode_mass[q].iter().enumerate() {
                        tr.observe(PageKey { head: h, first_token: i * p }, m);
                    }
                }
            }
            tr.roll();
        }
        tr
    }

    /// A `SimCache` holding the sequence (full pages in the first tier), its position map and
    /// the view a controller gets under `signal`.
    pub fn cache_and_view(&self, signal: &Signal) -> (SimCache, PositionMap, PageTableView) {
        let heads = self.num_heads();
        let mut cache = SimCache::new(self.spec.clone(), self.scenario.d, heads, 1);
        let seq = cache.add_sequence();
        cache.append(seq, self.scenario.context);
        let mut pos = PositionMap::new(seq, heads);
        pos.sync(&cache).expect("sync a fresh cache");
        let tracker = match *signal {
            Signal::DecodeMass { window, beta, sample } => Some(self.tracker(window, beta, sample)),
            Signal::ColumnSums { .. } => None,
        };
        let view = pos
            .view(&cache, self.costs(), |key, n| match *signal {
                Signal::DecodeMass { .. } => runtime::Signal { mass: tracker.as_ref().unwrap().get(key), ..Default::default() },
                Signal::ColumnSums { per_token } => {
                    let t = &self.coded[key.head].column_sums[key.first_token..key.first_token + n];
                    runtime::Signal { mass: t.iter().sum(), token_mass: per_token.then(|| t.to_vec()), pinned: false }
                }
            })
            .expect("view of a fresh cache");
        (cache, pos, view)
    }

    /// One decision of `ctrl` at `limits` through the runtime path, applied to a `SimCache`.
    ///
    /// # Panics
    /// If the cache holds more than the budget after a feasible plan, or a protected page was
    /// dropped or moved below its floor.
    pub fn run(&self, ctrl: &mut dyn Controller, signal: &Signal, limits: &Limits) -> Result<Outcome, ControlError> {
        let (mut cache, mut pos, view) = self.cache_and_view(signal);
        let t0 = std::time::Instant::now();
        let plan = ctrl.decide(&view, limits);
        let decide_us = t0.elapsed().as_secs_f64() * 1e6;
        let report = pos.apply(&mut cache, &view, &plan, limits)?;
        let costs = &view.costs;
        let resident: f64 = (0..self.num_heads()).flat_map(|h| cache.page_tiers(pos.seq, h).expect("pages")).map(|(t, n)| costs.cost(t, n)).sum();
        assert_eq!(resident, report.bytes_after, "the cache holds what apply reported");
        if plan.feasible {
            assert!(resident <= plan.budget_bytes, "{resident} B resident over the {} B budget", plan.budget_bytes);
        }
        let after = simulate(&view, &plan);
        let p = self.spec.page.tokens;
        let mut a: Assignment = vec![vec![None; self.full]; self.num_heads()];
        for (id, pg) in after.iter() {
            if pg.tier != TAIL_TIER {
                a[id.head][pg.first_token / p] = Some(pg.tier);
            }
        }
        // Protection, checked on the outcome rather than trusted from the checker.
        for (id, pg) in view.iter() {
            if pg.tier != TAIL_TIER && limits.protection.protects(pg, view.context_tokens) {
                let t = a[id.head][pg.first_token / p];
                assert!(t.is_some_and(|t| t <= limits.protection.floor.max(pg.tier)), "protected page {id:?} ended in {t:?}");
            }
        }
        let dropped_needle_pages = self.heads.iter().enumerate().flat_map(|(h, hd)| hd.needles.iter().map(move |&t| (h, t / p))).filter(|&(h, i)| a[h][i].is_none()).count();
        let drop = costs.drop_tier();
        let drops = plan.decisions.iter().filter(|d| Some(d.to_tier) == drop).count();
        Ok(Outcome {
            errors: self.errors(&a),
            assignment: a,
            budget_bytes: plan.budget_bytes,
            resident_bytes: resident,
            feasible: plan.feasible,
            moves: plan.decisions.len() - drops,
            drops,
            dropped_needle_pages,
            decide_us,
            plan,
        })
    }
}

/// A tiering policy on the frontier.
#[derive(Clone, Debug, PartialEq)]
pub enum Method {
    /// RDR (defaults) on `spec`'s ladder with decode page masses.
    Rdr { spec: String },
    /// RDKV's page controller with prefill column sums; `concentration` uses
    /// [`kvforge_control::distortion::Proxy::Concentration`] instead of the paper's linear weights.
    Rdkv { spec: String, concentration: bool },
    /// Every full page in one tier; with `keep_protected`, protected pages in the first.
    Uniform { spec: String, tier: String, keep_protected: bool },
}

impl Method {
    pub fn spec(&self) -> &str {
        match self {
            Method::Rdr { spec } | Method::Rdkv { spec, .. } | Method::Uniform { spec, .. } => spec,
        }
    }
    pub fn name(&self) -> String {
        match self {
            Method::Rdr { spec } => format!("RDR ({spec} ladder)"),
            Method::Rdkv { concentration: false, .. } => "RDKV (pages, paper weights)".into(),
            Method::Rdkv { concentration: true, .. } => "RDKV (pages, concentration)".into(),
            Method::Uniform { spec, tier, keep_protected: false } => format!("uniform {spec}:{tier}"),
            Method::Uniform { spec, tier, keep_protected: true } => format!("uniform {spec}:{tier} + protected in first tier"),
        }
    }
    pub fn is_uniform(&self) -> bool {
        matches!(self, Method::Uniform { .. })
    }
}

/// One point of the frontier (one method, budget, context and seed).
#[derive(Clone, Debug)]
pub struct Point {
    pub method: Method,
    pub context: usize,
    pub heads: usize,
    pub seed: u64,
    /// Budget as a fraction of fp16 bytes (for uniform methods: the bytes they use).
    pub budget_fraction: f64,
    pub budget_bytes: f64,
    /// For controller points placed at a uniform method's bytes: that method's name.
    pub matched: Option<String>,
    pub feasible: bool,
    pub resident_bytes: f64,
    /// Resident bytes per token per kv head.
    pub bytes_per_token: f64,
    pub errors: Errors,
    pub moves: usize,
    pub drops: usize,
    pub dropped_needle_pages: usize,
    pub decide_us: f64,
}

/// The controllers' knobs on the frontier.
#[derive(Clone, Debug)]
pub struct Setup {
    pub protection: Protection,
    /// RDR's decode signal: window (= invocation period), EMA β, and one tracked query in
    /// `sample`.
    pub window: usize,
    pub beta: f64,
    pub sample: usize,
}

impl Default for Setup {
    fn default() -> Self {
        Setup { protection: Protection::default(), window: 16, beta: 0.5, sample: 1 }
    }
}

/// Distortion tables are costly to build for spherical specs (codebook sampling): one per spec.
#[derive(Default)]
pub struct Tables(HashMap<String, kvforge_control::distortion::DistortionTable>);

impl Tables {
    pub fn get(&mut self, spec: &Spec) -> kvforge_control::distortion::DistortionTable {
        self.0.entry(spec.name.clone()).or_insert_with(|| kvforge_control::distortion::DistortionTable::from_spec(spec)).clone()
    }
}

/// Runs `method` on `world` at `budget` bytes (ignored by uniform methods).
pub fn evaluate(world: &World, method: &Method, budget_bytes: f64, setup: &Setup, tables: &mut Tables) -> Point {
    let ctx = world.scenario.context;
    let tokens = (ctx * world.num_heads()) as f64;
    let fp16 = world.fp16_bytes();
    let limits = Limits { budget: Budget::Total(budget_bytes), protection: setup.protection };
    let base = |errors: Errors, budget: f64, resident: f64, feasible: bool| Point {
        method: method.clone(),
        context: ctx,
        heads: world.num_heads(),
        seed: world.scenario.seed,
        budget_fraction: budget / fp16,
        budget_bytes: budget,
        matched: None,
        feasible,
        resident_bytes: resident,
        bytes_per_token: resident / tokens,
        errors,
        moves: 0,
        drops: 0,
        dropped_needle_pages: 0,
        decide_us: 0.0,
    };
    let outcome = match method {
        Method::Uniform { tier, keep_protected, .. } => {
            let (a, bytes) = world.uniform(world.tier(tier), keep_protected.then_some(&setup.protection));
            return base(world.errors(&a), bytes, bytes, true);
        }
        Method::Rdr { .. } => {
            let mut c = kvforge_control::RdrController::with_table(tables.get(&world.spec));
            world.run(&mut c, &Signal::DecodeMass { window: setup.window, beta: setup.beta, sample: setup.sample }, &limits)
        }
        Method::Rdkv { concentration, .. } => {
            let mut c = kvforge_control::RdkvController::new(&world.spec).expect("RDKV needs an integer ladder");
            if *concentration {
                c.proxy = kvforge_control::distortion::Proxy::Concentration;
            }
            world.run(&mut c, &Signal::ColumnSums { per_token: true }, &limits)
        }
    };
    let o = outcome.unwrap_or_else(|e| panic!("{}: {e}", method.name()));
    let mut pt = base(o.errors, o.budget_bytes, o.resident_bytes, o.feasible);
    pt.moves = o.moves;
    pt.drops = o.drops;
    pt.dropped_needle_pages = o.dropped_needle_pages;
    pt.decide_us = o.decide_us;
    pt
}

/// The methods of the frontier for the shipped `rdkv` and `spherical` specs.
pub fn default_methods() -> Vec<Method> {
    let mut m = vec![
        Method::Rdr { spec: "spherical".into() },
        Method::Rdr { spec: "rdkv".into() },
        Method::Rdkv { spec: "rdkv".into(), concentration: false },
        Method::Rdkv { spec: "rdkv".into(), concentration: true },
    ];
    for keep_protected in [false, true] {
        for t in ["b8", "b4", "b2"] {
            m.push(Method::Uniform { spec: "rdkv".into(), tier: t.into(), keep_protected });
        }
        for t in ["high", "mid", "low"].into_iter().skip(usize::from(keep_protected)) {
            m.push(Method::Uniform { spec: "spherical".into(), tier: t.into(), keep_protected });
        }
    }
    m
}

/// Every method at every budget fraction, and every controller also at the bytes of every
/// uniform method of its spec (`matched`), on one world per spec.
pub fn sweep(worlds: &[&World], methods: &[Method], fractions: &[f64], setup: &Setup, tables: &mut Tables) -> Vec<Point> {
    let mut out = Vec::new();
    for m in methods {
        let Some(w) = worlds.iter().find(|w| w.spec.name == m.spec()) else { continue };
        if m.is_uniform() {
            out.push(evaluate(w, m, 0.0, setup, tables));
            continue;
        }
        for &f in fractions {
            out.push(evaluate(w, m, f * w.fp16_bytes(), setup, tables));
        }
        for u in methods.iter().filter(|u| u.is_uniform() && u.spec() == m.spec()) {
            let Method::Uniform { tier, keep_protected, .. } = u else { unreachable!() };
            let bytes = w.uniform(w.tier(tier), keep_protected.then_some(&setup.protection)).1;
            let mut pt = evaluate(w, m, bytes, setup, tables);
            pt.matched = Some(u.name());
            out.push(pt);
        }
    }
    out
}

/// Points of one method, context and budget, pooled over seeds.
#[derive(Clone, Debug)]
pub struct Summary {
    pub method: Method,
    pub context: usize,
    pub heads: usize,
    pub budget_fraction: f64,
    pub matched: Option<String>,
    pub seeds: usize,
    /// Seeds at which protection alone exceeded the budget (those are not pooled).
    pub infeasible_seeds: usize,
    pub bytes_per_token: f64,
    /// Largest resident/budget ratio among feasible seeds (≤ 1).
    pub max_budget_use: f64,
    pub errors: Errors,
    pub drops: f64,
    pub dropped_needle_pages: usize,
    pub decide_us: f64,
}

/// Pools points that differ only by seed.
pub fn summarise(points: &[Point]) -> Vec<Summary> {
    let mut out: Vec<Summary> = Vec::new();
    for p in points {
        let same = |s: &Summary| s.method == p.method && s.context == p.context && s.matched == p.matched && (s.budget_fraction - p.budget_fraction).abs() < 1e-9;
        let i = match out.iter().position(same) {
            Some(i) => i,
            None => {
                out.push(Summary {
                    method: p.method.clone(),
                    context: p.context,
                    heads: p.heads,
                    budget_fraction: p.budget_fraction,
                    matched: p.matched.clone(),
                    seeds: 0,
                    infeasible_seeds: 0,
                    bytes_per_token: 0.0,
                    max_budget_use: 0.0,
                    errors: Errors::default(),
                    drops: 0.0,
                    dropped_needle_pages: 0,
                    decide_us: 0.0,
                });
                out.len() - 1
            }
        };
        let s = &mut out[i];
        s.seeds += 1;
        if !p.feasible {
            s.infeasible_seeds += 1;
            continue;
        }
        let k = (s.seeds - s.infeasible_seeds) as f64;
        s.bytes_per_token += (p.bytes_per_token - s.bytes_per_token) / k;
        s.drops += (p.drops as f64 - s.drops) / k;
        s.decide_us += (p.decide_us - s.decide_us) / k;
        s.max_budget_use = s.max_budget_use.max(if p.method.is_uniform() { 1.0 } else { p.resident_bytes / p.budget_bytes });
        s.dropped_needle_pages += p.dropped_needle_pages;
        s.errors.extend(&p.errors);
    }
    out
}
