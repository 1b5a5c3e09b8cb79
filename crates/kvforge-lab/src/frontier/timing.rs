//! What the controllers cost on the CPU at long context: the issue's "< 2% of decode step
//! time at 32K" (RDR, per step, decision amortised over its period) and "< 1% of prefill"
//! (RDKV, once).
//!
//! A `SimCache` holds one sequence of `context` tokens × `heads` kv heads (first-tier pages).
//! Masses are real: each page's share of a decode query's attention over the synthetic keys
//! ([`crate::synth`]), 32 decode queries per head, windows of `every` consecutive queries
//! (cycled) per RDR invocation, so scores fluctuate between invocations as they do in decode.
//! The window's per-page maximum is what the GPU keeps (`KvCache::decode_tracked`, timed by
//! [`super::gpu`]); here it is computed untimed and the host's share is timed. Timed
//! separately, medians over repetitions, all once per invocation (no host work per step):
//! * `roll`: the window into the [`PagedImportance`] EMA;
//! * `view`: the [`PositionMap`] view of the cache (page table walk + signal lookup);
//! * `decide`: the controller;
//! * `apply`: [`runtime::apply`] on the `SimCache` (checks and bookkeeping only; the GPU
//!   transcode kernels are timed by [`super::gpu`]).
//!
//! Two regimes: the *first* decision after prefill (every page still in the first tier, the
//! budget forces thousands of moves) and the *steady state* (one decision every `every`
//! decode steps, `every` new tokens since the last one).

use std::time::Instant;

use kvforge_spec::Spec;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::synth::{HeadShape, SynthHead};
use kvforge_control::budget::{Budget, CostModel, TierCosts};
use kvforge_control::distortion::DistortionTable;
use kvforge_control::protect::Protection;
use kvforge_control::runtime::{self, PositionMap, SimCache};
use kvforge_control::window::PagedImportance;
use kvforge_control::Limits;
use kvforge_control::{Controller, RdkvController, RdrController};

/// The timing setup.
#[derive(Clone, Debug)]
pub struct TimingSetup {
    pub context: usize,
    pub heads: usize,
    pub d: usize,
    pub gqa: usize,
    /// Budget as a fraction of fp16 bytes.
    pub budget_fraction: f64,
    /// Repetitions of the first decision.
    pub reps: usize,
    /// Steady-state RDR invocations.
    pub invocations: usize,
    pub seed: u64,
}

impl Default for TimingSetup {
    fn default() -> Self {
        TimingSetup { context: 32768, heads: 8, d: 128, gqa: 4, budget_fraction: 0.25, reps: 15, invocations: 64, seed: 1 }
    }
}

/// Timings of one spec's controllers (µs, medians).
#[derive(Clone, Debug, Default)]
pub struct ControllerTime {
    pub spec: String,
    pub context: usize,
    pub heads: usize,
    pub pages: usize,
    /// RDR's period (decode steps per decision).
    pub every: usize,
    pub budget_bytes_per_token: f64,
    pub rdr_first_view_us: f64,
    pub rdr_first_decide_us: f64,
    pub rdr_first_moves: usize,
    pub rdr_steady_view_us: f64,
    pub rdr_steady_decide_us: f64,
    pub rdr_steady_apply_us: f64,
    /// Mean decisions per steady-state invocation.
    pub rdr_steady_moves: f64,
    /// Rolling the window the GPU kept into the importance EMA, per invocation.
    pub roll_us: f64,
    /// Per decode step: (roll + view + decide + apply) / every.
    pub rdr_per_step_us: f64,
    /// RDKV once after prefill (view with per-token masses, then decide); None for
    /// spherical ladders.
    pub rdkv_view_us: Option<f64>,
    pub rdkv_decide_us: Option<f64>,
}

pub fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        0.5 * (xs[n / 2 - 1] + xs[n / 2])
    }
}

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

/// Per kv head, per decode query, every page's share of the query's attention (GQA rows
/// together, as `decode_with_mass` reports it), over all `tokens` synthetic tokens; and the
/// per-token masses of the same queries summed (RDKV's weights in the timing).
fn masses(setup: &TimingSetup, tokens: usize, page: usize, queries: usize) -> (Vec<Vec<Vec<f64>>>, Vec<Vec<f64>>) {
    let mut rng = ChaCha8Rng::seed_from_u64(setup.seed);
    let shapes = HeadShape::mix(setup.heads);
    let heads: Vec<(SynthHead, Vec<f64>)> = shapes
        .iter()
        .map(|&s| {
            let h = SynthHead::generate(&mut rng, setup.d, tokens, page, s, None);
            let q = h.queries(&mut rng, queries * setup.gqa);
            (h, q)
        })
        .collect();
    let d = setup.d;
    let sm = 1.0 / (d as f64).sqrt();
    let work = |(h, q): &(SynthHead, Vec<f64>)| -> (Vec<Vec<f64>>, Vec<f64>) {
        let k: Vec<f64> = h.k.iter().map(|&x| f64::from(x)).collect();
        let mut tok = vec![0.0; tokens];
        let mut per_query = Vec::with_capacity(queries);
        for rows in q.chunks_exact(setup.gqa * d) {
            // e^logit per token summed over the GQA rows, against one shared maximum.
            let s: Vec<Vec<f64>> = rows.chunks_exact(d).map(|r| k.chunks_exact(d).map(|kt| sm * r.iter().zip(kt).map(|(a, b)| a * b).sum::<f64>()).collect()).collect();
            let m = s.iter().flatten().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut e = vec![0.0; tokens];
            for row in &s {
                let z: f64 = row.iter().map(|x| (x - m).exp()).sum();
                for ((et, x), w) in e.iter_mut().zip(row).zip(tok.iter_mut()) {
                    let a = (x - m).exp();
                    *et += a;
                    *w += a / z;
                }
            }
            let tot: f64 = e.iter().sum();
            per_query.push(e.chunks(page).map(|c| c.iter().sum::<f64>() / tot).collect());
        }
        (per_query, tok)
    };
    let out: Vec<(Vec<Vec<f64>>, Vec<f64>)> = std::thread::scope(|s| {
        let hs: Vec<_> = heads.iter().map(|h| s.spawn(move || work(h))).collect();
        hs.into_iter().map(|h| h.join().expect("mass thread")).collect()
    });
    out.into_iter().unzip()
}

/// Times RDR (and RDKV for integer ladders) on `spec`. `table` is the spec's distortion table.
pub fn time_controllers(spec: &Spec, table: &DistortionTable, setup: &TimingSetup) -> ControllerTime {
    let p = spec.page.tokens;
    let mut rdr0 = RdrController::with_table(table.clone());
    let every = rdr0.every;
    let total = setup.context + every * setup.invocations;
    let queries = 32;
    let (page_mass, tok_mass) = masses(setup, total, p, queries);
    let costs = TierCosts::from_spec(spec, setup.d, CostModel::Resident);
    let fp16_per_token = costs.cost(kvforge_spec::TAIL_TIER, p) / p as f64;
    let limits = Limits { budget: Budget::PerToken(setup.budget_fraction * fp16_per_token), protection: Protection::default() };
    let mut cache = SimCache::new(spec.clone(), setup.d, setup.heads, 1);
    let seq = cache.add_sequence();
    cache.append(seq, setup.context);
    let mut pos = PositionMap::new(seq, setup.heads);
    pos.sync(&cache).expect("sync");
    let mut importance = PagedImportance::new(0.5, p).expect("β 0.5 and pages of at least one token");
    // The window the GPU keeps over `n` decode queries from `q0`: each live page's largest
    // share (pages named by their first token, so drops do not shuffle them).
    let window = |firsts: &[Vec<usize>], q0: usize, n: usize| -> Vec<Vec<Option<f64>>> {
        firsts.iter().enumerate().map(|(h, fs)| fs.iter().map(|&f| Some((q0..q0 + n).map(|q| page_mass[h][q % queries][f / p]).fold(0.0, f64::max))).collect()).collect()
    };
    let mut roll_t = Vec::new();
    let firsts = pos.first_tokens(&cache).expect("positions");
    importance.roll(&firsts, &window(&firsts, 0, every)).expect("roll");
    let mut r = ControllerTime { spec: spec.name.clone(), context: setup.context, heads: setup.heads, every, budget_bytes_per_token: setup.budget_fraction * fp16_per_token, ..Default::default() };

    // The first decision after prefill.
    let (mut tv, mut td) = (Vec::new(), Vec::new());
    let mut first = None;
    for _ in 0..setup.reps.max(1) {
        let t = Instant::now();
        let view = pos.view(&cache, costs.clone(), |k, _| runtime::Signal { mass: importance.get(k), ..Default::default() }).expect("view");
        tv.push(us(t));
        let mut c = rdr0.clone();
        let t = Instant::now();
        let plan = c.decide(&view, &limits);
        td.push(us(t));
        first = Some((c, view, plan));
    }
    let (c, view, plan) = first.unwrap();
    r.pages = view.num_pages();
    r.rdr_first_view_us = median(&mut tv);
    r.rdr_first_decide_us = median(&mut td);
    r.rdr_first_moves = plan.decisions.len();
    pos.apply(&mut cache, &view, &plan, &limits).expect("apply the first plan");
    rdr0 = c;
    for _ in 0..every {
        rdr0.step();
    }

    // Steady state.
    let (mut sv, mut sd, mut sa) = (Vec::new(), Vec::new(), Vec::new());
    let mut moves = 0usize;
    for i in 0..setup.invocations {
        cache.append(seq, every);
        let mut go = false;
        for _ in 0..every {
            go = rdr0.step();
        }
        assert!(go, "RDR runs every {every} steps");
        pos.sync(&cache).expect("sync");
        let firsts = pos.first_tokens(&cache).expect("positions");
        let win = window(&firsts, (i + 1) * every, every);
        let t = Instant::now();
        importance.roll(&firsts, &win).expect("roll");
        roll_t.push(us(t));
        let t = Instant::now();
        let view = pos.view(&cache, costs.clone(), |k, _| runtime::Signal { mass: importance.get(k), ..Default::default() }).expect("view");
        sv.push(us(t));
        let t = Instant::now();
        let plan = rdr0.decide(&view, &limits);
        sd.push(us(t));
        let t = Instant::now();
        pos.apply(&mut cache, &view, &plan, &limits).expect("apply");
        sa.push(us(t));
        moves += plan.decisions.len();
    }
    r.rdr_steady_view_us = median(&mut sv);
    r.rdr_steady_decide_us = median(&mut sd);
    r.rdr_steady_apply_us = median(&mut sa);
    r.rdr_steady_moves = moves as f64 / setup.invocations.max(1) as f64;
    r.roll_us = median(&mut roll_t);
    r.rdr_per_step_us = (r.roll_us + r.rdr_steady_view_us + r.rdr_steady_decide_us + r.rdr_steady_apply_us) / every as f64;

    // RDKV once after prefill, on a fresh cache, with per-token masses.
    if let Ok(rdkv) = RdkvController::new(spec) {
        let mut cache = SimCache::new(spec.clone(), setup.d, setup.heads, 1);
        let seq = cache.add_sequence();
        cache.append(seq, setup.context);
        let mut pos = PositionMap::new(seq, setup.heads);
        pos.sync(&cache).expect("sync");
        let (mut tv, mut td) = (Vec::new(), Vec::new());
        for _ in 0..setup.reps.max(1) {
            let t = Instant::now();
            let view = pos
                .view(&cache, costs.clone(), |k, len| {
                    let t = &tok_mass[k.head][k.first_token..k.first_token + len];
                    runtime::Signal { mass: t.iter().sum(), token_mass: Some(t.to_vec()), pinned: false }
                })
                .expect("view");
            tv.push(us(t));
            let mut c = rdkv.clone();
            let t = Instant::now();
            let plan = c.decide(&view, &limits);
            td.push(us(t));
            assert!(!plan.feasible || plan.cost_after <= plan.budget_bytes);
        }
        r.rdkv_view_us = Some(median(&mut tv));
        r.rdkv_decide_us = Some(median(&mut td));
    }
    r
}
