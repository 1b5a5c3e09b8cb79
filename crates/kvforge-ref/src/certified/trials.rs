//! Randomised and adversarial workloads that check the certificate: every head-step's
//! ‖O − O_exact‖₂ against its `bound` (and against the paper's eq. 15 for the same inputs),
//! with O_exact = [`crate::attention()`] over the fp16-rounded inputs.
//!
//! A trial is one layer step of 2 kv heads × GQA 2 (four head-steps, counted as four trials),
//! so rung 4 (layer dense) shows up in the rung frequencies. Keys are Gaussian with LLaMA-like
//! per-channel magnitudes (e^{U(−1.5, 1)}), values Gaussian, queries Gaussian times a
//! temperature; each [`Workload`] then bends one thing adversarially.

use std::collections::BTreeMap;

use half::f16;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::ladder::{certified_layer_step, CertConfig, Rung};
use super::store::{CertFormat, CertifiedHead};
use crate::error::CertError;

/// How a trial's cache and queries are drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// 1–320 tokens, temperature U(0.3, 3).
    Random,
    /// 2–4 dominant blocks of near-identical keys (block masses within ~1%): ranking flips.
    NearTied,
    /// 1–4 key channels ×50 (half the time the query is large there too): large Δ.
    OutlierChannels,
    /// 1–3 needle tokens aligned with the query, logit 5–25 above the rest.
    Needle,
    /// Temperature U(0, 0.05): near-uniform attention, K* at the cap, boundary checks.
    Flat,
    /// Temperature U(5, 30): one or few tokens hold the mass.
    Peaked,
    /// 1–5% of value tokens ×20: large η_b, rung 2.
    ValueOutliers,
    /// Lengths 16k + r and 64k + r with r ≢ 0 mod 16 (a partial block always present).
    Ragged,
    /// 0, 1, 2, 3, 15, 16, 17, 31, 32 or 33 tokens.
    Tiny,
    /// 2,048–6,144 tokens (128–384 blocks), temperature U(0.05, 1): K* reaches K_max, rung 1.
    Medium,
    /// 32,000–32,768 tokens (d = 128), temperature U(0.3, 10), a needle (logit 8–30 above
    /// the rest) half the time.
    Long,
}

impl Workload {
    pub const ALL: [Workload; 11] = [
        Workload::Random,
        Workload::NearTied,
        Workload::OutlierChannels,
        Workload::Needle,
        Workload::Flat,
        Workload::Peaked,
        Workload::ValueOutliers,
        Workload::Ragged,
        Workload::Tiny,
        Workload::Medium,
        Workload::Long,
    ];
}

/// Head-steps per workload of the validation run (`tests/certified.rs` and
/// `examples/certified_trials.rs` run the same plan with the same seed): 100,032 in all,
/// whole layer steps of 8 head-steps,
/// sized for CI (2 cores, `--release`).
pub const PLAN: [(Workload, u64); 11] = [
    (Workload::Random, 33_520),
    (Workload::NearTied, 9_000),
    (Workload::OutlierChannels, 9_000),
    (Workload::Needle, 9_000),
    (Workload::Flat, 8_000),
    (Workload::Peaked, 9_000),
    (Workload::ValueOutliers, 8_000),
    (Workload::Ragged, 8_000),
    (Workload::Tiny, 6_000),
    (Workload::Medium, 480),
    (Workload::Long, 32),
];

/// Seed of the validation run.
pub const SEED: u64 = 20_261_123;

/// Query heads per kv head and kv heads of a trial.
pub const GQA: usize = 4;
pub const KV_HEADS: usize = 2;

/// One layer's inputs: per kv head `[n][d]` keys and values, queries `[kv][gqa][d]`.
#[derive(Clone, Debug)]
pub struct Case {
    pub d: usize,
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
    pub q: Vec<f32>,
}

/// `n` approximately standard normal draws: Irwin–Hall sums of four 16-bit uniforms from one
/// 64-bit draw, centred and scaled to unit variance (bounded at ±2√3; the adversarial
/// workloads add their outliers explicitly). Cheap, which keeps 100k trials inside CI.
pub(crate) fn gaussians(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    const SCALE: f32 = 1.732_050_8 / 65_536.0;
    (0..n)
        .map(|_| {
            let x = rng.next_u64();
            let sum = (x & 0xFFFF) + ((x >> 16) & 0xFFFF) + ((x >> 32) & 0xFFFF) + (x >> 48);
            (sum as f32 - 2.0 * 65_535.0) * SCALE
        })
        .collect()
}

fn pick_d(rng: &mut ChaCha8Rng) -> usize {
    match rng.gen_range(0..20) {
        0..=8 => 64,
        9..=16 => 128,
        _ => 256,
    }
}

/// Draws a case of workload `w`.
pub fn generate(w: Workload, rng: &mut ChaCha8Rng) -> Case {
    let d = if w == Workload::Long { 128 } else { pick_d(rng) };
    let n = match w {
        Workload::Random | Workload::OutlierChannels | Workload::Needle | Workload::Peaked | Workload::ValueOutliers => rng.gen_range(1..=320),
        Workload::NearTied => rng.gen_range(64..=320),
        Workload::Flat => rng.gen_range(1..=600),
        Workload::Ragged => {
            let r = rng.gen_range(1..16);
            if rng.gen_bool(0.5) {
                16 * rng.gen_range(0..25) + r
            } else {
                64 * rng.gen_range(0..6) + 16 * rng.gen_range(0..4) + r
            }
        }
        Workload::Tiny => [0, 1, 2, 3, 15, 16, 17, 31, 32, 33][rng.gen_range(0..10)],
        Workload::Medium => rng.gen_range(2_048..=6_144),
        Workload::Long => rng.gen_range(32_000..=32_768),
    };
    let temp: f32 = match w {
        Workload::Flat => rng.gen_range(0.0..0.05),
        Workload::Peaked => rng.gen_range(5.0..30.0),
        Workload::OutlierChannels => rng.gen_range(0.3..2.0),
        Workload::Medium => rng.gen_range(0.05..1.0),
        Workload::Long => rng.gen_range(0.3..10.0),
        _ => rng.gen_range(0.3..3.0),
    };
    let mut kv = Vec::with_capacity(KV_HEADS);
    let mut q = Vec::with_capacity(KV_HEADS * GQA * d);
    for _ in 0..KV_HEADS {
        let mag: Vec<f32> = (0..d).map(|_| rng.gen_range(-1.5f32..1.0).exp()).collect();
        let mut k = gaussians(rng, n * d);
        k.iter_mut().enumerate().for_each(|(i, x)| *x *= mag[i % d]);
        // Value scale: the paper's η (mean ≈ 0.05, max ≈ 0.18 at d = 128) needs elements of
        // std ≈ 0.05–0.15.
        let v_std = rng.gen_range(0.03f32..0.15);
        let mut v = gaussians(rng, n * d);
        v.iter_mut().for_each(|x| *x *= v_std);
        let mut qs = gaussians(rng, GQA * d);
        qs.iter_mut().for_each(|x| *x *= temp);
        let q0: Vec<f32> = qs[..d].to_vec();
        let q_norm2: f32 = q0.iter().map(|x| x * x).sum::<f32>().max(1e-12);
        let sqrt_d = (d as f32).sqrt();
        match w {
            Workload::NearTied if n >= 64 => {
                // Keys u + small noise in 2–4 whole blocks, u aligned with q0 so they dominate.
                let blocks = n / 16;
                let u: Vec<f32> = gaussians(rng, d).iter().zip(&mag).map(|(g, m)| g * m).collect();
                let beta = rng.gen_range(4.0f32..12.0);
                let along = beta * sqrt_d / q_norm2;
                let noise = rng.gen_range(0.001f32..0.05);
                for _ in 0..rng.gen_range(2..=4) {
                    let b = rng.gen_range(0..blocks);
                    let g = gaussians(rng, 16 * d);
                    for t in 0..16 {
                        for c in 0..d {
                            k[(b * 16 + t) * d + c] = along * q0[c] + 0.3 * u[c] + noise * mag[c] * g[t * d + c];
                        }
                    }
                }
            }
            Workload::OutlierChannels => {
                let chans: Vec<usize> = (0..rng.gen_range(1..=4)).map(|_| rng.gen_range(0..d)).collect();
                let q_too = rng.gen_bool(0.5);
                for &c in &chans {
                    (0..n).for_each(|t| k[t * d + c] *= 50.0);
                    if q_too {
                        (0..GQA).for_each(|g| qs[g * d + c] *= 10.0);
                    }
                }
            }
            Workload::Needle | Workload::Long if w == Workload::Needle || rng.gen_bool(0.5) => {
                for _ in 0..rng.gen_range(1..=3) {
                    let t = rng.gen_range(0..n);
                    let beta = if w == Workload::Long { rng.gen_range(8.0f32..30.0) } else { rng.gen_range(5.0f32..25.0) };
                    for c in 0..d {
                        k[t * d + c] = q0[c] * beta * sqrt_d / q_norm2;
                        v[t * d + c] *= 3.0;
                    }
                }
            }
            Workload::ValueOutliers => {
                for _ in 0..(n / 30).max(1) {
                    let t = rng.gen_range(0..n);
                    (0..d).for_each(|c| v[t * d + c] *= 20.0);
                }
            }
            _ => {}
        }
        kv.push((k, v));
        q.extend(qs);
    }
    // Queries are fp16 activations.
    q.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32());
    Case { d, kv, q }
}

/// One head-step's outcome.
#[derive(Clone, Debug)]
pub struct HeadOutcome {
    /// ‖O − O_exact‖₂.
    pub actual: f64,
    pub telemetry: super::ladder::Telemetry,
}

/// Runs one layer step of `case` and measures every head against exact attention.
pub fn run_case(case: &Case, cfg: &CertConfig, step: u64) -> Result<Vec<HeadOutcome>, CertError> {
    let d = case.d;
    let heads = case.kv.iter().map(|(k, v)| CertifiedHead::encode(CertFormat::Q8K4V, d, k, v)).collect::<Result<Vec<_>, _>>()?;
    let layer = certified_layer_step(&heads, &case.q, GQA, cfg, step)?;
    let sm = 1.0 / (d as f64).sqrt();
    let r16 = |x: &[f32]| x.iter().map(|&y| f16::from_f32(y).to_f64()).collect::<Vec<f64>>();
    let originals: Vec<(Vec<f64>, Vec<f64>)> = case.kv.iter().map(|(k, v)| (r16(k), r16(v))).collect();
    let mut res = Vec::with_capacity(layer.telemetry.len());
    for (h, t) in layer.telemetry.into_iter().enumerate() {
        let (k, v) = &originals[h / GQA];
        let q: Vec<f64> = case.q[h * d..(h + 1) * d].iter().map(|&x| f64::from(x)).collect();
        let exact = crate::attention(&q, k, v, sm).0;
        let actual = layer.out[h * d..(h + 1) * d].iter().zip(&exact).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        res.push(HeadOutcome { actual, telemetry: t });
    }
    Ok(res)
}

/// Counts of head-steps per rung.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RungCounts {
    pub fast: u64,
    pub expand_keys: u64,
    pub promote_values: u64,
    pub head_exact: u64,
    pub layer_dense: u64,
}

impl RungCounts {
    pub fn add(&mut self, r: Rung) {
        *match r {
            Rung::Fast => &mut self.fast,
            Rung::ExpandKeys => &mut self.expand_keys,
            Rung::PromoteValues => &mut self.promote_values,
            Rung::HeadExact => &mut self.head_exact,
            Rung::LayerDense => &mut self.layer_dense,
        } += 1;
    }
    pub fn merge(&mut self, o: &RungCounts) {
        self.fast += o.fast;
        self.expand_keys += o.expand_keys;
        self.promote_values += o.promote_values;
        self.head_exact += o.head_exact;
        self.layer_dense += o.layer_dense;
    }
}

/// Results of many trials of one workload.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TrialStats {
    /// Head-steps.
    pub trials: u64,
    /// ‖O − O_exact‖ > bound (exact outputs: any difference at all).
    pub violations: u64,
    /// Fast-path head-steps with ‖O − O_exact‖ > eq. 15 + E_val + E_round.
    pub paper_violations: u64,
    /// Fast-path head-steps where E_key + E_val alone (no E_round) is exceeded.
    pub without_round_violations: u64,
    pub rungs: RungCounts,
    /// Fast-path head-steps with ‖O − O_exact‖ = 0 (no tightness ratio).
    pub fast_exact: u64,
    /// Head-steps with a detection of each kind.
    pub ranking_triggers: u64,
    pub boundary_triggers: u64,
    pub faults: u64,
    /// bound ÷ actual of fast-path head-steps with actual > 0 (not serialised; see quantiles).
    #[serde(skip)]
    pub tightness: Vec<f64>,
    /// The same ratio with eq. 15 in place of our E_key.
    #[serde(skip)]
    pub tightness_paper: Vec<f64>,
    /// Largest actual ÷ bound seen (fast path).
    pub worst_ratio: f64,
    /// Largest (actual − E_key − E_val) ÷ E_round over fast-path head-steps: how much of the
    /// rounding allowance the f64 arithmetic actually used.
    pub worst_round_share: f64,
    pub max_tokens: usize,
}

impl TrialStats {
    pub fn record(&mut self, o: &HeadOutcome) {
        let t = &o.telemetry;
        self.trials += 1;
        self.rungs.add(t.rung);
        self.max_tokens = self.max_tokens.max(t.tokens);
        self.ranking_triggers += u64::from(t.detections.ranking);
        self.boundary_triggers += u64::from(t.detections.boundary > 0);
        self.faults += u64::from(t.detections.fault());
        // A NaN bound certifies nothing: it counts as a violation.
        let exceeds = |bound: f64| o.actual > bound || bound.is_nan() || o.actual.is_nan();
        if exceeds(t.bound) {
            self.violations += 1;
        }
        if t.rung < Rung::HeadExact {
            if exceeds(t.e_key_paper + t.e_val + t.e_round) {
                self.paper_violations += 1;
            }
            if o.actual > t.e_key + t.e_val {
                self.without_round_violations += 1;
                self.worst_round_share = self.worst_round_share.max((o.actual - t.e_key - t.e_val) / t.e_round);
            }
            if o.actual > 0.0 {
                self.tightness.push(t.bound / o.actual);
                self.tightness_paper.push((t.e_key_paper + t.e_val + t.e_round) / o.actual);
                self.worst_ratio = self.worst_ratio.max(o.actual / t.bound);
            } else {
                self.fast_exact += 1;
            }
        }
    }

    pub fn merge(&mut self, o: &TrialStats) {
        self.trials += o.trials;
        self.violations += o.violations;
        self.paper_violations += o.paper_violations;
        self.without_round_violations += o.without_round_violations;
        self.rungs.merge(&o.rungs);
        self.fast_exact += o.fast_exact;
        self.ranking_triggers += o.ranking_triggers;
        self.boundary_triggers += o.boundary_triggers;
        self.faults += o.faults;
        self.tightness.extend_from_slice(&o.tightness);
        self.tightness_paper.extend_from_slice(&o.tightness_paper);
        self.worst_ratio = self.worst_ratio.max(o.worst_ratio);
        self.worst_round_share = self.worst_round_share.max(o.worst_round_share);
        self.max_tokens = self.max_tokens.max(o.max_tokens);
    }

    /// Tightness quantiles p1, p10, p50, p90, p99 and min (nearest rank).
    pub fn quantiles(&self) -> BTreeMap<&'static str, f64> {
        quantiles(&self.tightness)
    }

    /// The same quantiles for eq. 15.
    pub fn quantiles_paper(&self) -> BTreeMap<&'static str, f64> {
        quantiles(&self.tightness_paper)
    }
}

/// min, p1, p10, p50, p90, p99 of `v` (nearest rank; NaN when empty).
fn quantiles(v: &[f64]) -> BTreeMap<&'static str, f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let q = |p: f64| if v.is_empty() { f64::NAN } else { v[((p * (v.len() - 1) as f64).round()) as usize] };
    [("min", q(0.0)), ("p1", q(0.01)), ("p10", q(0.1)), ("p50", q(0.5)), ("p90", q(0.9)), ("p99", q(0.99))].into_iter().collect()
}

/// Runs at least `head_steps` head-steps of workload `w` (whole layer steps), seeded: layer
/// step i draws its case from ChaCha8 stream i of a key derived from (`seed`, `w`), so the
/// steps are independent and are spread over the available cores without changing any
/// result (the statistics are order-free).
pub fn run_workload(w: Workload, head_steps: u64, seed: u64, cfg: &CertConfig) -> Result<TrialStats, CertError> {
    let per_step = (KV_HEADS * GQA) as u64;
    let steps = head_steps.div_ceil(per_step);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(steps.max(1) as usize) as u64;
    let key = seed ^ (w as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let run = |part: u64| -> Result<TrialStats, CertError> {
        let mut stats = TrialStats::default();
        for step in (part..steps).step_by(threads as usize) {
            let mut rng = ChaCha8Rng::seed_from_u64(key);
            rng.set_stream(step);
            let case = generate(w, &mut rng);
            for o in run_case(&case, cfg, step)? {
                stats.record(&o);
            }
        }
        Ok(stats)
    };
    let parts: Vec<Result<TrialStats, CertError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..threads).map(|part| s.spawn(move || run(part))).collect();
        let mut parts = vec![run(0)];
        parts.extend(handles.into_iter().map(|h| h.join().expect("trial thread panicked")));
        parts
    });
    let mut stats = TrialStats::default();
    for p in parts {
        stats.merge(&p?);
    }
    Ok(stats)
}
