//! GPU tests of the controllers on a real `KvCache`: run on the device with
//! `cargo test -p kvforge-control --test gpu -- --ignored --nocapture`. On a machine without a
//! GPU they are ignored; forced with `--ignored` they fail ("needs a CUDA device: ...").
//!
//! Every test drives the same flow: a prefill of ~3000 tokens with planted heavy hitters on a
//! `KvCache` (d 128, gqa 4, 2 kv heads, encoded into tier 1) and the same appends on a
//! [`SimCache`]; a view from a [`PositionMap`] with per-token masses computed on the host keys;
//! a controller's plan, checked and applied to both caches. After every plan the GPU cache must
//! hold exactly the tiers [`simulate`] predicts (and the `SimCache` after `runtime::apply`), pass
//! `verify_pages`, report `plan.cost_after` resident bytes within the budget, and decode within
//! the self-test tolerance of exact f64 attention over its own downloaded, CPU-decoded pages.
//! Output error against attention on the original f32 keys and values is printed per budget
//! and must fall as the budget grows.

use std::sync::Arc;
use std::time::Instant;

use kvforge_control::runtime::{self, PagedCache, PositionMap, Signal, SimCache};
use kvforge_control::*;
use kvforge_control_rt::OfCache;
use kvforge_lab::synth::{self, gauss};
use kvforge_rt::{CacheConfig, Device, KvCache};
use kvforge_spec::{Codebook, KeyScheme, Spec, TierId, HEADER_BYTES, TAIL_TIER};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const D: usize = 128;
const GQA: usize = 4;
const HKV: usize = 2;
const PREFILL: usize = 3000;
const STEPS: usize = 200;
/// Observation queries per kv head (each `GQA` rows): the importance signal.
const OBS: usize = 8;
/// Held-out test queries (each one full decode query `[HKV × GQA][D]`).
const TEST: usize = 4;

fn spec(name: &str) -> Spec {
    kvforge_rt::testing::shipped_spec(&format!("{name}.toml"))
}

fn sm() -> f64 {
    1.0 / (D as f64).sqrt()
}

/// Keys, values and queries of one sequence (all `PREFILL + STEPS` tokens, generated up front).
struct Workload {
    /// `[n][HKV][D]`, as `KvCache::append` takes them.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Per kv head `[n][D]` in f64 (the original f32 values).
    kh: Vec<Vec<f64>>,
    vh: Vec<Vec<f64>>,
    /// Per kv head `[OBS × GQA][D]`.
    q_obs: Vec<Vec<f64>>,
    /// `TEST` decode queries `[HKV × GQA][D]`.
    q_test: Vec<Vec<f32>>,
}

impl Workload {
    /// Head 0 is peaked (24 heavy hitters, 2 needles with large values, γ 0.9), head 1 diffuse
    /// (4 heavy hitters, γ 0.35); both have a sink at position 0 and one heavy hitter each in
    /// the decode steps. Background keys are N(0, I), or, with `codebook`, point near its
    /// codewords group by group (keys like those a spherical codebook is trained on). Queries
    /// are γ(√d·u + z); planted keys are κ·u + noise for a per-head unit direction u.
    fn new(seed: u64, codebook: Option<&Codebook>) -> Workload {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = PREFILL + STEPS;
        let p = 64;
        let full = PREFILL / p;
        let draw = |rng: &mut ChaCha8Rng, len: usize| synth::draw_key(rng, len, codebook);
        let (mut kh, mut vh, mut q_obs, mut q_rows) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (h, (gamma, heavy, kappa, needles)) in [(0.9, 24, 7.0, 2), (0.35, 4, 5.0, 0)].into_iter().enumerate() {
            let mut u = draw(&mut rng, D);
            let nu = u.iter().map(|x| x * x).sum::<f64>().sqrt();
            u.iter_mut().for_each(|x| *x /= nu);
            let mut k: Vec<f64> = (0..n).flat_map(|_| draw(&mut rng, D)).collect();
            let mut v: Vec<f64> = (0..n * D).map(|_| gauss(&mut rng)).collect();
            let mut plant = |t: usize, kap: f64, vscale: f64, rng: &mut ChaCha8Rng| {
                for c in 0..D {
                    k[t * D + c] = kap * u[c] + 0.02 * gauss(rng);
                    v[t * D + c] *= vscale;
                }
            };
            plant(0, kappa * 1.2, 1.0, &mut rng);
            let pages: Vec<usize> = (0..6).map(|i| 2 + i * full / 6).collect();
            for i in 0..heavy {
                plant(pages[i % pages.len()] * p + (i * 13) % p, kappa, 1.0, &mut rng);
            }
            for i in 0..needles {
                plant((full * (1 + i) / 3 + 1) * p + p / 2, kappa * 1.1, 4.0, &mut rng);
            }
            plant(PREFILL + 40 + 70 * h, kappa, 1.0, &mut rng);
            let mut qs = |count: usize| -> Vec<f64> { (0..count * GQA).flat_map(|_| (0..D).map(|c| gamma * ((D as f64).sqrt() * u[c] + gauss(&mut rng))).collect::<Vec<_>>()).collect() };
            q_obs.push(qs(OBS));
            q_rows.push(qs(TEST));
            // Round the originals to f32 once: the cache gets f32, the reference the same values.
            kh.push(k.iter().map(|&x| f64::from(x as f32)).collect::<Vec<_>>());
            vh.push(v.iter().map(|&x| f64::from(x as f32)).collect::<Vec<_>>());
        }
        let mut k = vec![0f32; n * HKV * D];
        let mut v = vec![0f32; n * HKV * D];
        for t in 0..n {
            for h in 0..HKV {
                for c in 0..D {
                    k[(t * HKV + h) * D + c] = kh[h][t * D + c] as f32;
                    v[(t * HKV + h) * D + c] = vh[h][t * D + c] as f32;
                }
            }
        }
        let q_test = (0..TEST)
            .map(|i| {
                let mut q = Vec::with_capacity(HKV * GQA * D);
                for rows in &q_rows {
                    q.extend(rows[i * GQA * D..(i + 1) * GQA * D].iter().map(|&x| x as f32));
                }
                q
            })
            .collect();
        Workload { k, v, kh, vh, q_obs, q_test }
    }

    /// Rows `a..b` of K and V (`[b − a][HKV][D]`).
    fn rows(&self, a: usize, b: usize) -> (&[f32], &[f32]) {
        (&self.k[a * HKV * D..b * HKV * D], &self.v[a * HKV * D..b * HKV * D])
    }

    /// Per kv head, the attention mass of each of the first `n` tokens summed over the
    /// observation queries (softmax on the host keys).
    fn token_masses(&self, n: usize) -> Vec<Vec<f64>> {
        (0..HKV)
            .map(|h| {
                let mut tok = vec![0.0; n];
                for q in self.q_obs[h].chunks_exact(D) {
                    for (t, a) in kvforge_ref::softmax_weights(q, &self.kh[h][..n * D], sm()).into_iter().enumerate() {
                        tok[t] += a;
                    }
                }
                tok
            })
            .collect()
    }

    /// Exact attention outputs of test query `i` over the first `n` original tokens,
    /// `[HKV × GQA][D]`.
    fn exact(&self, i: usize, n: usize) -> Vec<f64> {
        let mut out = Vec::with_capacity(HKV * GQA * D);
        for h in 0..HKV {
            for g in 0..GQA {
                let row = h * GQA + g;
                let q: Vec<f64> = self.q_test[i][row * D..(row + 1) * D].iter().map(|&x| f64::from(x)).collect();
                out.extend(kvforge_ref::attention(&q, &self.kh[h][..n * D], &self.vh[h][..n * D], sm()).0);
            }
        }
        out
    }
}

/// The GPU cache, its CPU twin and the position map of their one sequence.
struct Run {
    spec: Spec,
    cache: KvCache,
    sim: SimCache,
    seq: usize,
    pos: PositionMap,
    costs: TierCosts,
    /// Tokens appended so far.
    n: usize,
}

impl Run {
    /// Fresh caches with the prefill appended to both. Spherical tiers other than the target
    /// get radius scales from the prefill's host keys × 1.25 (the target's are set by the
    /// cache from the first pages it encodes).
    fn new(dev: &Arc<Device>, spec: &Spec, w: &Workload) -> Run {
        let mut cfg = CacheConfig::new(spec, D, GQA, HKV, 1, PREFILL + STEPS + 64).target(1);
        cfg.verify_headers = true;
        let mut cache = KvCache::new(dev.clone(), spec.clone(), cfg).unwrap();
        let seq = cache.add_sequence();
        let mut sim = SimCache::new(spec.clone(), D, HKV, 1);
        assert_eq!(sim.add_sequence(), seq);
        let (k, v) = w.rows(0, PREFILL);
        cache.append(seq, k, v).unwrap();
        sim.append(seq, PREFILL);
        for t in spec.tiers.iter().skip(2) {
            if let KeyScheme::Spherical { group, .. } = &t.key {
                let mut scales = Vec::with_capacity(HKV * D / group);
                for h in 0..HKV {
                    let kf: Vec<f32> = w.kh[h][..PREFILL * D].iter().map(|&x| x as f32).collect();
                    scales.extend(kvforge_ref::radius_scales(&kf, D, *group).into_iter().map(|s| s * 1.25));
                }
                cache.set_radius_scales(t.id, &scales).unwrap();
            }
        }
        let mut pos = PositionMap::new(seq, HKV);
        pos.sync(&cache).unwrap();
        let costs = TierCosts::from_spec(spec, D, CostModel::Resident);
        let r = Run { spec: spec.clone(), cache, sim, seq, pos, costs, n: PREFILL };
        r.assert_twins();
        r
    }

    /// One decode step: token `n` appended to both caches.
    fn append_one(&mut self, w: &Workload) {
        let (k, v) = w.rows(self.n, self.n + 1);
        self.cache.append(self.seq, k, v).unwrap();
        self.sim.append(self.seq, 1);
        self.n += 1;
    }

    fn gpu_tiers(&self, h: usize) -> Vec<(TierId, usize)> {
        self.cache.pages(self.seq, h).unwrap().into_iter().map(|(r, n)| (r.tier, n)).collect()
    }

    fn assert_twins(&self) {
        for h in 0..HKV {
            assert_eq!(self.gpu_tiers(h), self.sim.page_tiers(self.seq, h).unwrap(), "kv head {h}: GPU cache and SimCache disagree");
        }
    }

    /// The controllers' input, with per-token masses from the host keys.
    fn view(&mut self, w: &Workload) -> PageTableView {
        self.pos.sync(&self.cache).unwrap();
        let masses = w.token_masses(self.n);
        let v = self
            .pos
            .view(&self.cache, self.costs.clone(), |key, n| {
                let t = &masses[key.head][key.first_token..key.first_token + n];
                Signal { mass: t.iter().sum(), token_mass: Some(t.to_vec()), pinned: false }
            })
            .unwrap();
        assert_eq!(v.context_tokens, self.n);
        v
    }

    /// Checks and applies a plan to both caches, then asserts every invariant. Returns the
    /// resident bytes and the apply time.
    fn apply(&mut self, view: &PageTableView, plan: &Plan, limits: &Limits) -> (f64, f64) {
        check_plan(view, plan, limits).unwrap_or_else(|e| panic!("plan rejected: {e}"));
        assert!(plan.feasible, "plan infeasible: {} B over a {} B budget", plan.cost_after, plan.budget_bytes);
        let t0 = Instant::now();
        let r = self.pos.apply(&mut self.cache, view, plan, limits).unwrap_or_else(|e| panic!("GPU apply: {e}"));
        let apply_ms = t0.elapsed().as_secs_f64() * 1e3;
        let rs = runtime::apply(&mut self.sim, self.seq, view, plan, limits).unwrap_or_else(|e| panic!("SimCache apply: {e}"));
        assert_eq!(r, rs, "GPU and SimCache apply reports differ");
        self.cache.verify_pages(&[self.seq]).unwrap_or_else(|e| panic!("verify_pages after the plan: {e}"));
        // The cache's own positions (kept through drops) equal the map's bookkeeping.
        assert_eq!(PositionMap::of_cache(&self.cache, self.seq).unwrap(), self.pos, "positions recorded by the cache differ from the PositionMap");
        let after = simulate(view, plan);
        for h in 0..HKV {
            let want: Vec<(TierId, usize)> = after.heads[h].iter().map(|p| (p.tier, p.tokens)).collect();
            assert_eq!(self.gpu_tiers(h), want, "kv head {h}: GPU tiers differ from simulate()");
            assert_eq!(self.sim.page_tiers(self.seq, h).unwrap(), want, "kv head {h}: SimCache tiers differ from simulate()");
        }
        // The cache holds this one sequence, so its memory report is the sequence's.
        let report = self.cache.memory_report();
        for (t, u) in report.iter().enumerate() {
            let pages = after.iter().filter(|(_, p)| p.tier as usize == t).count();
            assert_eq!(u.pages, pages, "tier `{}`: {} pages resident, the plan leaves {pages}", u.tier, u.pages);
        }
        let resident = report.iter().map(|u| u.resident_bytes).sum::<usize>() as f64;
        assert_eq!(resident, plan.cost_after, "resident bytes vs plan.cost_after");
        assert_eq!(resident, r.bytes_after, "resident bytes vs the apply report");
        assert!(resident <= plan.budget_bytes, "{resident} B resident over the {} B budget", plan.budget_bytes);
        (resident, apply_ms)
    }

    /// Keys and values of (seq, head) as the cache holds them: every page downloaded and
    /// decoded on the CPU in its own tier.
    fn decoded_head(&self, h: usize) -> (Vec<f64>, Vec<f64>) {
        let p = self.spec.page.tokens;
        let (mut kk, mut vv) = (Vec::new(), Vec::new());
        for (pg, len) in self.cache.pages(self.seq, h).unwrap() {
            let bytes = self.cache.download_page(pg).unwrap();
            let tier = &self.spec.tiers[pg.tier as usize];
            let rs = match tier.key {
                KeyScheme::Spherical { .. } => {
                    let r = self.cache.radius_scales(pg.tier).unwrap().expect("spherical page without radius scales");
                    let ng = r.len() / HKV;
                    r[h * ng..(h + 1) * ng].to_vec()
                }
                _ => Vec::new(),
            };
            let (k, v) = kvforge_ref::decode_segment(tier, D, p, &bytes[HEADER_BYTES..], &rs);
            kk.extend_from_slice(&k[..len * D]);
            vv.extend_from_slice(&v[..len * D]);
        }
        (kk, vv)
    }

    /// Decodes every test query on the GPU; asserts each output is within the self-test
    /// tolerance `2 · 2^-11 · max|V̂| + 1e-6` of f64 attention over the decoded pages, and
    /// returns (worst error, its tolerance, relative L2 error against exact attention over the
    /// original f32 keys and values of all `n` tokens, dropped ones included).
    fn decode_errors(&mut self, w: &Workload) -> (f64, f64, f64) {
        let dtype = self.spec.geometry.dtype;
        let outs: Vec<Vec<f32>> = w.q_test.iter().map(|q| self.cache.decode(&[self.seq], q).unwrap().out).collect();
        let heads: Vec<(Vec<f64>, Vec<f64>)> = (0..HKV).map(|h| self.decoded_head(h)).collect();
        let vmax = heads.iter().flat_map(|(_, v)| v.iter()).fold(0f64, |m, x| m.max(x.abs()));
        let tol = 2.0 * 2f64.powi(-11) * vmax + 1e-6;
        let (mut worst, mut num, mut den) = (0f64, 0f64, 0f64);
        for (i, out) in outs.iter().enumerate() {
            let exact = w.exact(i, self.n);
            for (h, (kk, vv)) in heads.iter().enumerate() {
                for g in 0..GQA {
                    let row = h * GQA + g;
                    let q: Vec<f64> = w.q_test[i][row * D..(row + 1) * D].iter().map(|&x| f64::from(kvforge_rt::from_bits(dtype, kvforge_rt::to_bits(dtype, x)))).collect();
                    let (o, _) = kvforge_ref::attention(&q, kk, vv, sm());
                    for c in 0..D {
                        let got = f64::from(out[row * D + c]);
                        let e = (got - o[c]).abs();
                        worst = if e.is_finite() { worst.max(e) } else { f64::INFINITY };
                        let x = exact[row * D + c];
                        num += (got - x) * (got - x);
                        den += x * x;
                    }
                }
            }
        }
        assert!(worst <= tol, "GPU decode differs from attention over its decoded pages by {worst:.3e} > tolerance {tol:.3e}");
        (worst, tol, (num / den).sqrt())
    }

    /// "name:pages" for every live tier, from the GPU cache.
    fn histogram(&self) -> String {
        self.spec.tiers.iter().filter(|t| !t.is_drop()).map(|t| format!("{}:{}", t.name, (0..HKV).map(|h| self.gpu_tiers(h).iter().filter(|x| x.0 == t.id).count()).sum::<usize>())).collect::<Vec<_>>().join(" ")
    }
}

/// Decisions of a plan: (re-codes, drops).
fn counts(view: &PageTableView, plan: &Plan) -> (usize, usize) {
    let drops = plan.decisions.iter().filter(|d| view.costs.tiers[d.to_tier as usize].drop).count();
    (plan.decisions.len() - drops, drops)
}

/// Prefill, one decision per budget (a fresh cache each), invariants, and output error
/// falling as the budget grows. `fracs` are fractions of the prefill's cost (all full pages in
/// tier 1), increasing.
fn prefill_budgets(name: &str, label: &str, make: &dyn Fn(&Spec) -> Box<dyn Controller>, fracs: &[f64]) {
    let dev = kvforge_rt::testing::device();
    let spec = spec(name);
    let cb = match &spec.tiers[1].key {
        KeyScheme::Spherical { codebook, .. } => Some(codebook.clone()),
        _ => None,
    };
    let w = Workload::new(42, cb.as_ref());
    let fp16_page = spec.segment(TAIL_TIER, D).page_bytes as f64;
    println!("\n[{name}] {label} after a prefill of {PREFILL} tokens ({HKV} kv heads, d {D}, gqa {GQA})");
    let mut errs = Vec::new();
    for &f in fracs {
        let mut run = Run::new(&dev, &spec, &w);
        let view = run.view(&w);
        let full_cost = view.cost();
        let fp16_cost = view.num_pages() as f64 * fp16_page;
        if errs.is_empty() {
            let (worst, tol, err) = run.decode_errors(&w);
            println!(
                "  all pages in `{}`: {full_cost:.0} B ({:.1}% of fp16 {fp16_cost:.0} B), error vs exact {err:.4e}, decode vs decoded pages {worst:.2e} (tol {tol:.2e})",
                spec.tiers[1].name,
                100.0 * full_cost / fp16_cost
            );
        }
        let limits = Limits { budget: Budget::Total(f * full_cost), protection: Protection::default() };
        let mut ctrl = make(&spec);
        let t0 = Instant::now();
        let plan = ctrl.decide(&view, &limits);
        let decide_us = t0.elapsed().as_secs_f64() * 1e6;
        let (moves, drops) = counts(&view, &plan);
        let (resident, apply_ms) = run.apply(&view, &plan, &limits);
        let (worst, tol, err) = run.decode_errors(&w);
        println!(
            "  budget {:>3.0}% ({:.0} B, {:.1}% of fp16): resident {resident:.0} B, {moves} re-codes + {drops} drops, decide {decide_us:.0} us, apply {apply_ms:.1} ms, \
             predicted D {:.3e}, gap {:.2e}; decode vs decoded pages {worst:.2e} (tol {tol:.2e}); error vs exact {err:.4e}; pages [{}]",
            f * 100.0,
            plan.budget_bytes,
            100.0 * plan.budget_bytes / fp16_cost,
            plan.distortion_after,
            plan.duality_gap,
            run.histogram()
        );
        assert!(err.is_finite());
        errs.push(err);
    }
    for (i, e) in errs.windows(2).enumerate() {
        assert!(e[1] <= e[0] * 1.02 + 1e-4, "{label}: error rises from {:.4e} to {:.4e} between budgets {} and {}", e[0], e[1], fracs[i], fracs[i + 1]);
    }
    assert!(errs.last() < errs.first(), "{label}: more budget must lower the error ({errs:?})");
}

/// Prefill, an optional one-off decision right after it (`first`), then `STEPS` decode
/// steps with RDR deciding whenever `rdr.step()` says so; invariants after every decision.
/// The budget is `frac` of the prefill's bytes per token and kv head.
fn decode_loop(name: &str, first: Option<(&str, Box<dyn Controller>)>, frac: f64) {
    let dev = kvforge_rt::testing::device();
    let spec = spec(name);
    let cb = match &spec.tiers[1].key {
        KeyScheme::Spherical { codebook, .. } => Some(codebook.clone()),
        _ => None,
    };
    let w = Workload::new(7, cb.as_ref());
    let mut run = Run::new(&dev, &spec, &w);
    let per_token = frac * spec.segment(1, D).page_bytes as f64 / spec.page.tokens as f64;
    let limits = Limits { budget: Budget::PerToken(per_token), protection: Protection::default() };
    let mut rdr = RdrController::new(&spec);
    let label = first.as_ref().map_or("RDR".to_string(), |(l, _)| format!("{l} once after prefill, then RDR"));
    println!("\n[{name}] {label}: {STEPS} decode steps after {PREFILL} tokens, budget {per_token:.1} B per token per kv head ({:.0}% of `{}`), RDR every {} steps", frac * 100.0, spec.tiers[1].name, rdr.every);
    if let Some((l, mut ctrl)) = first {
        let view = run.view(&w);
        let t0 = Instant::now();
        let plan = ctrl.decide(&view, &limits);
        let us = t0.elapsed().as_secs_f64() * 1e6;
        let (moves, drops) = counts(&view, &plan);
        let (resident, apply_ms) = run.apply(&view, &plan, &limits);
        let (worst, tol, err) = run.decode_errors(&w);
        println!("  {l} at {} tokens: {moves} re-codes + {drops} drops, {resident:.0}/{:.0} B, decide {us:.0} us, apply {apply_ms:.1} ms, decode vs decoded pages {worst:.2e} (tol {tol:.2e}), error vs exact {err:.4e}, pages [{}]", run.n, plan.budget_bytes, run.histogram());
    }
    let (mut decisions, mut decide_total, mut apply_total) = (0u64, 0f64, 0f64);
    for _ in 0..STEPS {
        run.append_one(&w);
        run.assert_twins();
        if !rdr.step() {
            continue;
        }
        let view = run.view(&w);
        let t0 = Instant::now();
        let plan = rdr.decide(&view, &limits);
        let us = t0.elapsed().as_secs_f64() * 1e6;
        let (moves, drops) = counts(&view, &plan);
        let (resident, apply_ms) = run.apply(&view, &plan, &limits);
        let (worst, tol, err) = run.decode_errors(&w);
        decisions += 1;
        decide_total += us;
        apply_total += apply_ms;
        println!(
            "  step {:>3} ({} tokens): {moves} re-codes + {drops} drops ({} forced), {resident:.0}/{:.0} B, decide {us:.0} us, apply {apply_ms:.1} ms, decode vs decoded pages {worst:.2e} (tol {tol:.2e}), error vs exact {err:.4e}, pages [{}]",
            rdr.steps(),
            run.n,
            plan.forced.len(),
            plan.budget_bytes,
            run.histogram()
        );
    }
    let s = rdr.stats;
    println!(
        "  {decisions} RDR decisions: {} moves, {} drops, {} forced; mean decide {:.0} us, mean apply {:.1} ms",
        s.moves,
        s.drops,
        s.forced,
        decide_total / decisions.max(1) as f64,
        apply_total / decisions.max(1) as f64
    );
    assert_eq!(decisions, (STEPS / rdr.every) as u64);
    assert_eq!(s.invocations, decisions);
    assert_eq!(run.n, PREFILL + STEPS);
}

const RDKV_FRACS: [f64; 3] = [0.25, 0.5, 0.8];
/// The spherical ladder's tiers differ little in bytes (values are fp16 in all of them), so
/// its budgets are fractions of the all-`high` cost; the lower two force drops.
const SPHERICAL_FRACS: [f64; 3] = [0.6, 0.8, 0.98];

#[test]
#[ignore = "needs a CUDA device"]
fn rdr_prefill_on_rdkv_three_budgets() {
    prefill_budgets("rdkv", "RDR", &|s| Box::new(RdrController::new(s)), &RDKV_FRACS);
}

#[test]
#[ignore = "needs a CUDA device"]
fn rdkv_prefill_on_rdkv_three_budgets() {
    prefill_budgets("rdkv", "RDKV (pages, linear weights)", &|s| Box::new(RdkvController::new(s).unwrap()), &RDKV_FRACS);
}

#[test]
#[ignore = "needs a CUDA device"]
fn rdr_decode_loop_on_rdkv() {
    decode_loop("rdkv", None, 0.4);
}

#[test]
#[ignore = "needs a CUDA device"]
fn rdkv_after_prefill_then_rdr_decode_loop_on_rdkv() {
    let s = spec("rdkv");
    decode_loop("rdkv", Some(("RDKV", Box::new(RdkvController::new(&s).unwrap()))), 0.4);
}

#[test]
#[ignore = "needs a CUDA device"]
fn rdr_prefill_on_spherical_three_budgets() {
    // The spherical proxy table samples the codebooks (slow in debug builds): build it once.
    let table = std::sync::OnceLock::new();
    prefill_budgets("spherical", "RDR", &|s| Box::new(RdrController::with_table(table.get_or_init(|| DistortionTable::from_spec(s)).clone())), &SPHERICAL_FRACS);
}

#[test]
#[ignore = "needs a CUDA device"]
fn rdr_decode_loop_on_spherical() {
    decode_loop("spherical", None, 0.75);
}
