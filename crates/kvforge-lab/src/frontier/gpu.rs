//! The controller loop on a real `KvCache`: what RDR costs next to the decode it steers.
//!
//! One sequence of `context` synthetic tokens × `heads` kv heads is prefilled into the first
//! ladder tier; then every decode step appends one token and decodes one query with
//! `decode_tracked` (the kernels' per-page mass is folded into the importance window on the
//! device), and every `every` steps the window is rolled into the EMA, RDR decides and the
//! plan is applied with the generated transcode kernels (`KvCache::retier_pages`: one launch
//! per tier pair). Timed per step:
//! * on the GPU, with CUDA events on the stream: the decode kernels (decode + split-K
//!   combine) of one step without and with the window fold (inside the combine when the
//!   plan has one) — the fold is the controller's only per-step work, its cost the per-step
//!   difference — and the standalone `mass_window` kernel (what the fold cost as a separate
//!   launch, and still costs a plan without a combine);
//! * with `Instant` around synchronous calls: `decode` and `decode_tracked` through the host
//!   API (planning, uploads, kernels, download) and the host side of the fold launch;
//! * per invocation: roll (window download + reset + EMA), view, decide and apply (the
//!   stream synchronised after it).
//!
//! The controller's cost per decode step is `fold + (roll + view + decide + apply) / every`,
//! reported against the decode kernels' GPU time (`fraction_of_decode`) and, with the host
//! API's fold overhead (`decode_tracked − decode`) in place of the kernel, against the
//! host-API step (`fraction_of_host_decode`). After every plan the resident bytes the cache
//! reports must equal the plan's and stay within the budget.

use std::sync::Arc;
use std::time::Instant;

use crate::bench::TrackedStepTimer;
use kvforge_rt::{CacheConfig, Device, KvCache};
use kvforge_spec::{KeyScheme, Spec, TAIL_TIER};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::timing::median;
use crate::synth::{HeadShape, SynthHead};
use kvforge_control::budget::{Budget, CostModel, TierCosts};
use kvforge_control::distortion::DistortionTable;
use kvforge_control::protect::Protection;
use kvforge_control::runtime::{self, PositionMap};
use kvforge_control::window::PagedImportance;
use kvforge_control::Limits;
use kvforge_control::{Controller, RdrController};
use kvforge_control_rt::RollCache;

/// The GPU loop's setup.
#[derive(Clone, Debug)]
pub struct GpuSetup {
    pub context: usize,
    pub heads: usize,
    pub gqa: usize,
    pub d: usize,
    /// Decode steps after the prefill.
    pub steps: usize,
    /// Budget as a fraction of fp16 bytes.
    pub budget_fraction: f64,
    /// RDR's period (cooldown: two periods); None: the controller's defaults.
    pub every: Option<usize>,
    /// RDR's tracked-step sample (decode steps per tracked one); None: the default.
    pub sample: Option<usize>,
    pub seed: u64,
}

impl Default for GpuSetup {
    fn default() -> Self {
        GpuSetup { context: 32768, heads: 8, gqa: 4, d: 128, steps: 1024, budget_fraction: 0.25, every: None, sample: None, seed: 1 }
    }
}

/// Timings (µs, medians unless said otherwise).
#[derive(Clone, Debug, Default)]
pub struct GpuTime {
    pub device: String,
    pub spec: String,
    pub context: usize,
    pub heads: usize,
    pub gqa: usize,
    pub steps: usize,
    pub every: usize,
    pub budget_bytes_per_token: f64,
    /// `decode` through the host API (wall).
    pub decode_us: f64,
    /// `decode_tracked` through the host API (wall): decode + the fold launch.
    pub decode_tracked_us: f64,
    /// The decode kernels of one step on the GPU (CUDA events), no fold.
    pub decode_gpu_us: f64,
    /// The same with the window fold (`decode_tracked`'s kernels).
    pub tracked_gpu_us: f64,
    /// What the fold adds on the GPU: median over steps of tracked − plain.
    pub fold_gpu_us: f64,
    /// The standalone `mass_window` kernel (CUDA events).
    pub standalone_fold_gpu_us: f64,
    /// Steps whose plan had a split-K combine (the fold ran inside it).
    pub fused_steps: usize,
    /// Host time of the tracked launch call minus the plain one (no synchronisation).
    pub fold_launch_us: f64,
    /// The first decision (after prefill, every page in the first tier).
    pub first_decide_us: f64,
    pub first_apply_us: f64,
    pub first_moves: usize,
    pub first_drops: usize,
    /// Transcode launches of the first plan (one per (from, to) tier pair).
    pub first_launches: usize,
    /// Steady-state invocations (all but the first): window download + reset + EMA.
    pub roll_us: f64,
    pub view_us: f64,
    pub decide_us: f64,
    pub apply_us: f64,
    pub moves_per_invocation: f64,
    /// max(fold_gpu, 0) + (roll + view + decide + apply) / every.
    pub controller_per_step_us: f64,
    /// controller_per_step_us / decode_gpu_us.
    pub fraction_of_decode: f64,
    /// ((decode_tracked − decode) + (roll + view + decide + apply) / every) / decode_tracked.
    pub fraction_of_host_decode: f64,
    pub resident_bytes_per_token: f64,
}

/// The synthetic kv heads (`HeadShape::mix`) and decode queries both GPU loops run, seeded by
/// the setup, and the rows `KvCache::append` and `decode` take.
pub(super) struct Workload {
    d: usize,
    gqa: usize,
    pub heads: Vec<SynthHead>,
    q_rows: Vec<Vec<f64>>,
}

impl Workload {
    pub fn generate(spec: &Spec, s: &GpuSetup) -> Workload {
        let n = s.context + s.steps;
        let mut rng = ChaCha8Rng::seed_from_u64(s.seed);
        let mut heads = Vec::new();
        let mut q_rows = Vec::new();
        for &sh in &HeadShape::mix(s.heads) {
            let h = SynthHead::generate(&mut rng, s.d, n, spec.page.tokens, sh, None);
            q_rows.push(h.queries(&mut rng, s.steps * s.gqa));
            heads.push(h);
        }
        Workload { d: s.d, gqa: s.gqa, heads, q_rows }
    }

    /// Keys (`which` 0) or values (1) of tokens [a, b), as [t][h][d].
    pub fn rows(&self, a: usize, b: usize, which: usize) -> Vec<f32> {
        let d = self.d;
        (a..b).flat_map(|t| self.heads.iter().flat_map(move |h| if which == 0 { &h.k[t * d..(t + 1) * d] } else { &h.v[t * d..(t + 1) * d] }.iter().copied())).collect()
    }

    /// Decode step `step`'s query of one sequence, [q head][d].
    pub fn query(&self, step: usize) -> Vec<f32> {
        let w = self.gqa * self.d;
        self.q_rows.iter().flat_map(|q| q[step * w..(step + 1) * w].iter().map(|&x| x as f32)).collect()
    }

    /// Appends the first `context` tokens to every sequence in `seqs` (4096 at a time) and sets
    /// the radius scales of every spherical tier from them (the spherical tiers' encode needs
    /// them before any page is down-tiered).
    pub fn prefill(&self, cache: &mut KvCache, spec: &Spec, seqs: &[usize], context: usize) -> Result<(), kvforge_rt::RtError> {
        let d = self.d;
        let mut a = 0;
        while a < context {
            let b = (a + 4096).min(context);
            let (k, v) = (self.rows(a, b, 0), self.rows(a, b, 1));
            for &q in seqs {
                cache.append(q, &k, &v)?;
            }
            a = b;
        }
        for t in spec.tiers.iter().skip(2) {
            if let KeyScheme::Spherical { group, .. } = &t.key {
                let mut scales = Vec::with_capacity(self.heads.len() * d / group);
                for h in &self.heads {
                    scales.extend(kvforge_ref::radius_scales(&h.k[..context * d], d, *group).into_iter().map(|x| x * cache.config().radius_headroom));
                }
                cache.set_radius_scales(t.id, &scales)?;
            }
        }
        Ok(())
    }
}

/// Microseconds since `t`.
pub(super) fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

/// Runs the loop on `spec` with RDR (`table`: the spec's distortion table).
pub fn gpu_loop(dev: &Arc<Device>, spec: &Spec, table: &DistortionTable, s: &GpuSetup) -> Result<GpuTime, Box<dyn std::error::Error + Send + Sync>> {
    let (d, hkv, gqa) = (s.d, s.heads, s.gqa);
    let p = spec.page.tokens;
    let n = s.context + s.steps;
    let work = Workload::generate(spec, s);

    let cfg = CacheConfig::new(spec, d, gqa, hkv, 1, n + 64).target(1);
    let mut cache = KvCache::new(dev.clone(), spec.clone(), cfg)?;
    let seq = cache.add_sequence();
    work.prefill(&mut cache, spec, &[seq], s.context)?;
    dev.stream.synchronize()?;

    let costs = TierCosts::from_spec(spec, d, CostModel::Resident);
    let fp16_per_token = costs.cost(TAIL_TIER, p) / p as f64;
    let limits = Limits { budget: Budget::PerToken(s.budget_fraction * fp16_per_token), protection: Protection::default() };
    let mut rdr = RdrController::with_table(table.clone());
    if let Some(every) = s.every {
        rdr.every = every.max(1);
        rdr.cooldown = 2 * rdr.every;
    }
    let mut importance = PagedImportance::new(0.5, p)?;
    let mut pos = PositionMap::new(seq, hkv);
    pos.sync(&cache)?;
    let mut r = GpuTime {
        device: dev.info.name.clone(),
        spec: spec.name.clone(),
        context: s.context,
        heads: hkv,
        gqa,
        steps: s.steps,
        every: rdr.every,
        budget_bytes_per_token: s.budget_fraction * fp16_per_token,
        ..Default::default()
    };
    let (mut dec, mut dect, mut dgpu, mut fgpu, mut fl) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut tgpu, mut sgpu) = (Vec::new(), Vec::new());
    let (mut tr, mut tv, mut td, mut ta) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut moves, mut invocations) = (0usize, 0usize);
    // Warm the kernels (JIT, first launches) before timing, then start the window afresh.
    let q0 = work.query(0);
    cache.decode(&[seq], &q0)?;
    cache.decode_tracked(&[seq], &q0)?;
    cache.take_mass_window(seq)?;
    let mut timer = TrackedStepTimer::new(dev)?;
    for step in 0..s.steps {
        let t = s.context + step;
        cache.append(seq, &work.rows(t, t + 1, 0), &work.rows(t, t + 1, 1))?;
        let q = work.query(step);
        let t0 = Instant::now();
        cache.decode(&[seq], &q)?;
        dec.push(us(t0));
        let t0 = Instant::now();
        cache.decode_tracked(&[seq], &q)?;
        dect.push(us(t0));
        // The same step once more, split by events (the fold leaves the window as it is).
        let parts = timer.time(&mut cache, &[seq], &q)?;
        dgpu.push(parts.decode_us);
        tgpu.push(parts.tracked_us);
        fgpu.push(parts.tracked_us - parts.decode_us);
        sgpu.push(parts.fold_us);
        fl.push(parts.fold_launch_us);
        r.fused_steps += usize::from(parts.fused);
        if !rdr.step() {
            continue;
        }
        let t0 = Instant::now();
        importance.roll_cache(&mut cache, seq)?;
        let roll_us = us(t0);
        let t0 = Instant::now();
        pos.sync(&cache)?;
        let view = pos.view(&cache, costs.clone(), |k, _| runtime::Signal { mass: importance.get(k), ..Default::default() })?;
        let view_us = us(t0);
        let t0 = Instant::now();
        let plan = rdr.decide(&view, &limits);
        let decide_us = us(t0);
        let t0 = Instant::now();
        let applied = pos.apply(&mut cache, &view, &plan, &limits)?;
        dev.stream.synchronize()?;
        let apply_us = us(t0);
        let resident = cache.memory_report().iter().map(|u| u.resident_bytes).sum::<usize>() as f64;
        if resident != plan.cost_after {
            return Err(format!("resident {resident} B differs from the plan's {} B", plan.cost_after).into());
        }
        if plan.feasible && resident > plan.budget_bytes {
            return Err(format!("resident {resident} B over the {} B budget", plan.budget_bytes).into());
        }
        r.resident_bytes_per_token = resident / (view.context_tokens * hkv) as f64;
        if invocations == 0 {
            let drop = costs.drop_tier();
            r.first_decide_us = decide_us;
            r.first_apply_us = apply_us;
            r.first_drops = plan.decisions.iter().filter(|x| Some(x.to_tier) == drop).count();
            r.first_moves = plan.decisions.len() - r.first_drops;
            r.first_launches = applied.launches;
        } else {
            tr.push(roll_us);
            tv.push(view_us);
            td.push(decide_us);
            ta.push(apply_us);
            moves += plan.decisions.len();
        }
        invocations += 1;
    }
    r.decode_us = median(&mut dec);
    r.decode_tracked_us = median(&mut dect);
    r.decode_gpu_us = median(&mut dgpu);
    r.tracked_gpu_us = median(&mut tgpu);
    r.fold_gpu_us = median(&mut fgpu);
    r.standalone_fold_gpu_us = median(&mut sgpu);
    r.fold_launch_us = median(&mut fl);
    r.roll_us = median(&mut tr);
    r.view_us = median(&mut tv);
    r.decide_us = median(&mut td);
    r.apply_us = median(&mut ta);
    r.moves_per_invocation = moves as f64 / invocations.saturating_sub(1).max(1) as f64;
    let invocation = (r.roll_us + r.view_us + r.decide_us + r.apply_us) / r.every as f64;
    r.controller_per_step_us = r.fold_gpu_us.max(0.0) + invocation;
    r.fraction_of_decode = r.controller_per_step_us / r.decode_gpu_us;
    r.fraction_of_host_decode = ((r.decode_tracked_us - r.decode_us).max(0.0) + invocation) / r.decode_tracked_us;
    Ok(r)
}
