//! What RDR costs the decode critical path when its decisions run on planner threads
//! ([`kvforge_control::pipeline::RdrPipeline`]), on a real `KvCache`, at batch 1 or more.
//!
//! `batch` sequences of `context` synthetic tokens × `heads` kv heads (the same keys and values
//! in each: the page tables and controllers are independent) are prefilled into the first
//! ladder tier; then every decode step appends one token per sequence and decodes the batch,
//! with `decode_tracked` on the steps RDR samples (one in `sample`; the window fold runs inside
//! the split-K combine) and the plain decode on the others. Every `every`
//! steps every sequence's pipeline runs its boundary: take the window (all sequences' in one download), apply
//! the plan made at the previous boundary (transcode launches), hand a snapshot to its
//! planner thread. The first boundary is primed (its plan, thousands of moves after prefill,
//! lands at once) and not counted. Timed:
//! * per step, on the GPU (CUDA events, L2 flushed; [`TrackedStepTimer`]), on every second
//!   step: the decode kernels without and with the fold; the fold's cost is the difference;
//! * per step, wall: the loop's decode through the host API;
//! * per boundary, wall on the decode thread: every sequence's boundary and then a stream
//!   synchronisation, so the transcode kernels' GPU time is inside;
//! * per plan, on its planner thread (off the critical path): the whole job and the decision.
//!
//! Per step on the critical path: `fold / sample + boundary / every`, against the plain decode
//! kernels of a step. After every boundary each sequence's resident bytes must be within its budget
//! (feasible plans, arrival headroom) or the loop fails.

use std::sync::Arc;
use std::time::Instant;

use crate::bench::TrackedStepTimer;
use kvforge_rt::{CacheConfig, Device, KvCache};
use kvforge_spec::{Spec, TAIL_TIER};

use super::gpu::{us, GpuSetup, Workload};
use super::timing::median;
use kvforge_control::budget::{Budget, CostModel, TierCosts};
use kvforge_control::distortion::DistortionTable;
use kvforge_control::pipeline::{Headroom, Planning, RdrPipeline};
use kvforge_control::protect::Protection;
use kvforge_control::window::PagedImportance;
use kvforge_control::Limits;
use kvforge_control::RdrController;
use kvforge_control_rt::invoke_all;

/// Timings of one (spec, batch), µs (medians unless said otherwise).
#[derive(Clone, Debug, Default)]
pub struct PipelineTime {
    pub device: String,
    pub spec: String,
    pub batch: usize,
    pub context: usize,
    pub heads: usize,
    pub gqa: usize,
    pub steps: usize,
    pub every: usize,
    /// One tracked decode step in `sample` (`RdrController::sample`).
    pub sample: usize,
    pub budget_bytes_per_token: f64,
    /// Decode kernels of one step, no fold / with the fold (CUDA events).
    pub decode_gpu_us: f64,
    pub tracked_gpu_us: f64,
    /// Median over steps of tracked − plain.
    pub fold_gpu_us: f64,
    /// The loop's decode (tracked on sampled steps) through the host API (wall).
    pub decode_tracked_host_us: f64,
    /// Boundaries timed (the primed first one excluded).
    pub boundaries: usize,
    /// Decode-thread wall time of a boundary (all sequences + stream sync): median and max.
    pub boundary_us: f64,
    pub boundary_max_us: f64,
    /// Parts of a boundary (medians, all sequences): taking the windows, applying the plans.
    pub boundary_window_us: f64,
    pub boundary_apply_us: f64,
    /// Time the decode thread waited for a plan, summed over boundaries and sequences.
    pub waited_total_us: f64,
    /// Planner-thread time per plan (off the critical path): whole job and decision.
    pub plan_us: f64,
    pub decide_us: f64,
    pub moves_per_plan: f64,
    pub launches_per_plan: f64,
    /// max(fold, 0) / sample + boundary / every.
    pub critical_per_step_us: f64,
    /// critical_per_step / decode_gpu (the plain decode kernels of a step).
    pub fraction_of_decode_gpu: f64,
    /// critical_per_step / decode_tracked_host.
    pub fraction_of_host_step: f64,
    /// Largest resident bytes / budget bytes of a sequence right after a boundary.
    pub worst_budget_ratio: f64,
}

/// Runs the pipelined loop on `spec` with `batch` sequences.
pub fn pipeline_loop(dev: &Arc<Device>, spec: &Spec, table: &DistortionTable, s: &GpuSetup, batch: usize) -> Result<PipelineTime, Box<dyn std::error::Error + Send + Sync>> {
    let (d, hkv, gqa) = (s.d, s.heads, s.gqa);
    let p = spec.page.tokens;
    let n = s.context + s.steps;
    let work = Workload::generate(spec, s);
    // One query per sequence, the same for all: [seq][q head][d].
    let query = |step: usize| -> Vec<f32> {
        let one = work.query(step);
        (0..batch).flat_map(|_| one.iter().copied()).collect()
    };

    // `tokens` counts all sequences together.
    let cfg = CacheConfig::new(spec, d, gqa, hkv, batch, batch * (n + 64)).target(1);
    let mut cache = KvCache::new(dev.clone(), spec.clone(), cfg)?;
    let seqs: Vec<usize> = (0..batch).map(|_| cache.add_sequence()).collect();
    work.prefill(&mut cache, spec, &seqs, s.context)?;
    dev.stream.synchronize()?;

    let costs = TierCosts::from_spec(spec, d, CostModel::Resident);
    let fp16_per_token = costs.cost(TAIL_TIER, p) / p as f64;
    let budget = Budget::PerToken(s.budget_fraction * fp16_per_token);
    let limits = Limits { budget, protection: Protection::default() };
    let mut pipes = Vec::with_capacity(batch);
    for &q in &seqs {
        let mut rdr = RdrController::with_table(table.clone());
        if let Some(every) = s.every {
            rdr.every = every.max(1);
            rdr.cooldown = 2 * rdr.every;
        }
        if let Some(sample) = s.sample {
            rdr.sample = sample.max(1);
        }
        pipes.push(RdrPipeline::new(rdr, PagedImportance::new(0.5, p)?, spec, q, hkv, Planning { costs: costs.clone(), limits, headroom: Headroom::Arrivals { tier: 1 } })?);
    }
    let every = pipes[0].every();
    let sample = pipes[0].sample();
    let mut r = PipelineTime {
        device: dev.info.name.clone(),
        spec: spec.name.clone(),
        batch,
        context: s.context,
        heads: hkv,
        gqa,
        steps: s.steps,
        every,
        sample,
        budget_bytes_per_token: s.budget_fraction * fp16_per_token,
        ..Default::default()
    };

    let q0 = query(0);
    cache.decode(&seqs, &q0)?;
    cache.decode_tracked(&seqs, &q0)?;
    for &q in &seqs {
        cache.take_mass_window(q)?;
    }
    let mut timer = TrackedStepTimer::new(dev)?;
    let (mut host, mut dgpu, mut tgpu, mut fgpu) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut bound, mut plan_t, mut decide_t) = (Vec::new(), Vec::new(), Vec::new());
    let (mut window_t, mut apply_t) = (Vec::new(), Vec::new());
    let (mut moves, mut launches, mut plans) = (0usize, 0usize, 0usize);
    let mut primed = false;
    for step in 0..s.steps {
        let t = s.context + step;
        let (k, v) = (work.rows(t, t + 1, 0), work.rows(t, t + 1, 1));
        for &q in &seqs {
            cache.append(q, &k, &v)?;
        }
        let q = query(step);
        // All sequences' pipelines count the same steps: one decides for the batch.
        let t0 = Instant::now();
        if pipes[0].tracks() {
            cache.decode_tracked(&seqs, &q)?;
        } else {
            cache.decode(&seqs, &q)?;
        }
        host.push(us(t0));
        if step % 2 == 0 {
            let parts = timer.time(&mut cache, &seqs, &q)?;
            dgpu.push(parts.decode_us);
            tgpu.push(parts.tracked_us);
            fgpu.push(parts.tracked_us - parts.decode_us);
        }
        let mut go = false;
        for pipe in pipes.iter_mut() {
            go = pipe.step();
        }
        if !go {
            continue;
        }
        // The primed first boundary (thousands of moves after prefill) is not counted.
        let counted = primed;
        let t0 = Instant::now();
        let mut landed = Vec::new();
        let (mut window_us, mut apply_us) = (0.0, 0.0);
        let boundaries = if primed {
            invoke_all(&mut pipes, &mut cache)?
        } else {
            let mut bs = Vec::with_capacity(batch);
            for (pipe, &q) in pipes.iter_mut().zip(&seqs) {
                let w = cache.take_mass_window(q)?;
                bs.push(pipe.prime(&mut cache, w)?);
            }
            bs
        };
        for b in boundaries {
            r.waited_total_us += b.waited_us;
            window_us += b.window_us;
            apply_us += b.apply_us;
            landed.push(b.applied);
        }
        dev.stream.synchronize()?;
        let wall = us(t0);
        if primed {
            bound.push(wall);
            window_t.push(window_us);
            apply_t.push(apply_us);
        }
        primed = true;
        for (i, a) in landed.into_iter().enumerate() {
            let Some((planned, report)) = a else { continue };
            let plan = planned.checked.plan();
            if plan.feasible {
                let resident: f64 = (0..hkv).map(|h| cache.pages(seqs[i], h).map(|ps| ps.iter().map(|(pr, len)| costs.cost(pr.tier, *len)).sum::<f64>())).sum::<Result<f64, _>>()?;
                let ratio = resident / budget.bytes(t + 1, hkv);
                r.worst_budget_ratio = r.worst_budget_ratio.max(ratio);
                if ratio > 1.0 + 1e-9 {
                    return Err(format!("sequence {i}: {resident} B resident over the budget at {} tokens", t + 1).into());
                }
            }
            if !counted {
                continue;
            }
            plan_t.push(planned.plan_us);
            decide_t.push(planned.decide_us);
            moves += plan.decisions.len();
            launches += report.launches;
            plans += 1;
        }
    }
    r.decode_gpu_us = median(&mut dgpu);
    r.tracked_gpu_us = median(&mut tgpu);
    r.fold_gpu_us = median(&mut fgpu);
    r.decode_tracked_host_us = median(&mut host);
    r.boundaries = bound.len();
    r.boundary_max_us = bound.iter().copied().fold(0.0, f64::max);
    r.boundary_us = median(&mut bound);
    r.boundary_window_us = median(&mut window_t);
    r.boundary_apply_us = median(&mut apply_t);
    r.plan_us = median(&mut plan_t);
    r.decide_us = median(&mut decide_t);
    r.moves_per_plan = moves as f64 / plans.max(1) as f64;
    r.launches_per_plan = launches as f64 / plans.max(1) as f64;
    r.critical_per_step_us = r.fold_gpu_us.max(0.0) / sample as f64 + r.boundary_us / every as f64;
    r.fraction_of_decode_gpu = r.critical_per_step_us / r.decode_gpu_us;
    r.fraction_of_host_step = r.critical_per_step_us / r.decode_tracked_host_us;
    Ok(r)
}
