//! Certified attention (seed 004): the certificate holds on 100,032 seeded head-steps of
//! random and adversarial workloads, fallbacks are exact, faults are detected, edge cases are
//! defined. Run with `--nocapture` for the tightness and rung statistics of every workload.
//!
//! The validation plan (`certified::trials::PLAN`) is the one `examples/certified_trials.rs`
//! runs to write `benches/results/certified-cpu-2026-11-23.json`. In a debug build every
//! workload runs 1/50 of its trials (the full plan is sized for `--release`, as CI runs it).

mod common;

use half::f16;
use kvforge_ref::certified::faults::{campaign, inject, inject_displacing, score_displacement, Fault};
use kvforge_ref::certified::trials::{run_case, run_workload, Case, TrialStats, Workload, GQA, PLAN, SEED};
use kvforge_ref::certified::{certified_head_step, certified_layer_step, e_key, e_key_paper, CertConfig, CertFormat, CertifiedHead, Rung, Telemetry, ValuePolicy};
use kvforge_ref::{attention, CertError};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DEBUG_DIVISOR: u64 = if cfg!(debug_assertions) { 50 } else { 1 };

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&y| f64::from(y)).collect()
}

fn r16(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&y| f16::from_f32(y).to_f64()).collect()
}

/// Exact attention over the fp16-rounded inputs: the truth the certificate is measured against.
fn exact(q: &[f32], k: &[f32], v: &[f32]) -> Vec<f64> {
    attention(&f64s(q), &r16(k), &r16(v), 1.0 / (q.len() as f64).sqrt()).0
}

fn dist(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt()
}

fn report(w: Workload, s: &TrialStats) {
    let q = s.quantiles();
    eprintln!(
        "{w:?}: {} head-steps (≤ {} tokens), {} violations, eq.15 violations {}, over E_key+E_val without E_round {}; \
         tightness min {:.3} p1 {:.3} p10 {:.2} p50 {:.2} p90 {:.1} p99 {:.1}; rungs {:?}; ranking {} boundary {}",
        s.trials, s.max_tokens, s.violations, s.paper_violations, s.without_round_violations, q["min"], q["p1"], q["p10"], q["p50"], q["p90"], q["p99"], s.rungs, s.ranking_triggers, s.boundary_triggers
    );
}

/// The plan's trials of `w`: zero violations of our bound and of eq. 15 (fed with the
/// corrected Δ and V_max), exact fallbacks bit-equal, no fault on clean data.
fn validate(w: Workload) {
    let n = PLAN.iter().find(|p| p.0 == w).unwrap().1;
    let n = (n / DEBUG_DIVISOR).max(1);
    let s = run_workload(w, n, SEED, &CertConfig::default()).unwrap();
    report(w, &s);
    assert!(s.trials >= n);
    assert_eq!(s.violations, 0, "{w:?}: certificate violated");
    assert_eq!(s.paper_violations, 0, "{w:?}: eq. 15 violated");
    assert_eq!(s.faults, 0, "{w:?}: a fault detected on clean data (false positive)");
    assert!(s.worst_ratio <= 1.0);
    // The rounding allowance is an allowance, not a fudge: f64 uses a sliver of it.
    assert!(s.worst_round_share < 0.1, "{w:?}: f64 rounding used {} of E_round", s.worst_round_share);
}

#[test]
fn bound_holds_random() {
    validate(Workload::Random);
}
#[test]
fn bound_holds_near_tied() {
    validate(Workload::NearTied);
}
#[test]
fn bound_holds_outlier_channels() {
    validate(Workload::OutlierChannels);
}
#[test]
fn bound_holds_needle() {
    validate(Workload::Needle);
}
#[test]
fn bound_holds_flat() {
    validate(Workload::Flat);
}
#[test]
fn bound_holds_peaked() {
    validate(Workload::Peaked);
}
#[test]
fn bound_holds_value_outliers() {
    validate(Workload::ValueOutliers);
}
#[test]
fn bound_holds_ragged_lengths() {
    validate(Workload::Ragged);
}
#[test]
fn bound_holds_tiny_caches() {
    validate(Workload::Tiny);
}
#[test]
fn bound_holds_medium_contexts() {
    validate(Workload::Medium);
}
#[test]
fn bound_holds_32k_contexts() {
    validate(Workload::Long);
}

/// The key term alone (every value promoted, E_val = 0): the measured error is Σ(a' − a)V_t
/// and must stay within E_key + E_round, ours and eq. 15.
#[test]
fn key_term_alone_holds() {
    let cfg = CertConfig { values: ValuePolicy::Threshold { v_tol: 0.0 }, ..CertConfig::default() };
    for w in [Workload::Random, Workload::OutlierChannels, Workload::Peaked] {
        let s = run_workload(w, 1_000 / DEBUG_DIVISOR.min(10), SEED ^ 0x6b_6579, &cfg).unwrap();
        report(w, &s);
        assert_eq!((s.violations, s.paper_violations), (0, 0), "{w:?}");
    }
}

/// The plan is what the docs and the committed JSON say it is.
#[test]
fn plan_has_100k_head_steps_of_every_workload() {
    assert_eq!(PLAN.iter().map(|p| p.1).sum::<u64>(), 100_032);
    assert!(Workload::ALL.iter().all(|w| PLAN.iter().any(|p| p.0 == *w)));
    assert!(PLAN.iter().all(|p| p.1 % (2 * GQA as u64) == 0), "whole layer steps");
}

fn case(d: usize, n: usize, temp: f32, seed: u64) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut draw = |n: usize, s: f32| (0..n).map(|_| s * (rng.gen::<f32>() + rng.gen::<f32>() + rng.gen::<f32>() - 1.5) * 2.0).collect::<Vec<f32>>();
    let kv = (0..2).map(|_| (draw(n * d, 1.0), draw(n * d, 0.1))).collect();
    let q = draw(2 * GQA * d, temp).into_iter().map(|x| f16::from_f32(x).to_f32()).collect();
    Case { d, kv, q }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(debug_assertions) { 16 } else { 256 }))]

    /// Shape fuzz: any head_dim of the spec, any length (0..300, partial blocks included),
    /// temperatures from flat to very peaked, any config knob in its domain.
    #[test]
    fn bound_holds_for_any_shape(d in prop_oneof![Just(64usize), Just(128), Just(256)], n in 0usize..300, temp in prop_oneof![0f32..0.1, 0.1f32..3.0, 3f32..40.0],
                                 seed in any::<u64>(), tau in 0.5f64..1.0, k_min in 0usize..4, k_extra in 0usize..20, explore in 0f64..0.2,
                                 budget in any::<bool>(), tol in 0f64..0.1) {
        let c = case(d, n, temp, seed);
        let values = if budget { ValuePolicy::Budget { eps_val: tol } } else { ValuePolicy::Threshold { v_tol: tol } };
        let cfg = CertConfig { tau_cov: tau, k_min, k_max: k_min + k_extra, explore_frac: explore, values, ..CertConfig::default() };
        for o in run_case(&c, &cfg, seed).unwrap() {
            prop_assert!(o.actual <= o.telemetry.bound, "actual {} > bound {} ({:?})", o.actual, o.telemetry.bound, o.telemetry);
            if budget && o.telemetry.rung < Rung::HeadExact {
                prop_assert!(o.telemetry.e_val <= tol);
            }
        }
    }
}

/// The paper builds V_max from the annotations ν_b of quantised blocks. Weights of the exact
/// fp16 partial block move too (through the normaliser), so a large value there breaks that
/// bound; ours takes V_max over every token.
///
/// Construction (d = 64, q = 1): 4 full blocks whose middle tokens sit 0.375 σ above a grid
/// point in every channel (int8 rounds every such logit down by 0.047 < Δ_b = 0.0625), zero
/// values (η = ν = 0); one partial token holding half the mass with ‖V‖ = 800.
#[test]
fn v_max_must_cover_the_partial_block() {
    let d = 64;
    let mut k = Vec::new();
    for _block in 0..4 {
        for t in 0..16 {
            for c in 0..d {
                let x: f32 = match t {
                    0 => {
                        if c % 2 == 0 {
                            0.0
                        } else {
                            255.0 / 64.0
                        }
                    }
                    1 => {
                        if c % 2 == 0 {
                            255.0 / 64.0
                        } else {
                            0.0
                        }
                    }
                    _ => 1019.0 / 512.0, // code 127.375 → 127
                };
                k.push(x);
            }
        }
    }
    let tail_lse = (1019.0f64 / 64.0) + (64f64).ln();
    let kp = f16::from_f64(tail_lse / 8.0).to_f32();
    k.extend(std::iter::repeat_n(kp, d));
    let mut v = vec![0f32; 64 * d];
    v.extend(std::iter::repeat_n(100f32, d));
    let q = vec![1f32; d];
    let head = CertifiedHead::encode(CertFormat::Q8K4V, d, &k, &v).unwrap();
    let cfg = CertConfig { k_min: 0, k_max: 0, explore_frac: 0.0, e_key_rel_tol: f64::INFINITY, ..CertConfig::default() };
    let step = certified_head_step(&head, &q, &cfg, 0).unwrap();
    let t = &step.telemetry;
    assert_eq!(t.rung, Rung::Fast, "{t:?}");
    assert_eq!((t.k_star, t.e_val), (0, 0.0));
    let actual = dist(&step.out, &exact(&q, &k, &v));
    let blocks_only = head.blocks.iter().map(|b| f64::from(b.nu)).fold(0f64, f64::max);
    assert_eq!(blocks_only, 0.0);
    eprintln!("partial-block V_max: actual {actual:.3}, bound {:.3}, with V_max of quantised blocks only {}", t.bound, e_key_paper(t.delta, t.alpha_tail_hat, blocks_only));
    assert!(actual > 1.0, "construction lost its bite: {actual}");
    assert!(actual <= t.bound);
    assert!(actual > e_key(t.delta, t.alpha_tail_hat, blocks_only) + e_key_paper(t.delta, t.alpha_tail_hat, blocks_only) + t.e_val);
}

/// Rung 3 (E_key over a zero tolerance after rung 1) returns exactly what
/// `attention()` over the fp16 originals returns, for every shape.
#[test]
fn rung3_is_exact_attention() {
    let cfg = CertConfig { e_key_rel_tol: 0.0, k_max: 0, k_min: 0, explore_frac: 0.0, ..CertConfig::default() };
    let mut seen = 0;
    for (i, (d, n)) in [(64, 40), (64, 100), (128, 33), (256, 48), (128, 1000), (64, 63)].into_iter().enumerate() {
        let c = case(d, n, 2.0, i as u64);
        let (k, v) = &c.kv[0];
        let head = CertifiedHead::encode(CertFormat::Q8K4V, d, k, v).unwrap();
        let step = certified_head_step(&head, &c.q[..d], &cfg, 3).unwrap();
        assert_eq!(step.telemetry.rung, Rung::HeadExact, "{:?}", step.telemetry);
        assert_eq!(step.telemetry.bound, 0.0);
        assert_eq!(step.out, exact(&c.q[..d], k, v), "rung 3 output differs from exact attention");
        seen += 1;
    }
    assert_eq!(seen, 6);
}

/// Rung 4: a layer whose heads fall to rung 3 (or one of which sees a fault) is recomputed
/// exactly, every head.
#[test]
fn rung4_is_exact_attention_for_every_head() {
    for fault in [false, true] {
        let c = case(128, 200, 1.0, 9);
        let mut heads: Vec<CertifiedHead> = c.kv.iter().map(|(k, v)| CertifiedHead::encode(CertFormat::Q8K4V, c.d, k, v).unwrap()).collect();
        let cfg = if fault {
            heads[1].blocks[3].key.codes[5] ^= 0x10;
            CertConfig::default()
        } else {
            CertConfig { e_key_rel_tol: 0.0, k_max: 0, k_min: 0, ..CertConfig::default() }
        };
        let layer = certified_layer_step(&heads, &c.q, GQA, &cfg, 1).unwrap();
        assert!(layer.dense);
        for (h, t) in layer.telemetry.iter().enumerate() {
            assert_eq!((t.rung, t.bound), (Rung::LayerDense, 0.0));
            let (k, v) = &c.kv[h / GQA];
            assert_eq!(&layer.out[h * c.d..(h + 1) * c.d], &exact(&c.q[h * c.d..(h + 1) * c.d], k, v)[..]);
        }
        assert_eq!(layer.telemetry.iter().filter(|t| t.detections.checksum > 0).count(), if fault { GQA } else { 0 });
    }
}

/// 0 tokens: the zero vector, a zero certificate, no rung — the empty sum, as `attention()`
/// and the split-K identity define it. Not an error: an empty sequence is a valid state.
#[test]
fn empty_cache_is_the_zero_output() {
    for d in [64, 128, 256] {
        let head = CertifiedHead::new(CertFormat::Q8K4V, d).unwrap();
        let q = vec![0.5f32; d];
        let step = certified_head_step(&head, &q, &CertConfig::default(), 0).unwrap();
        assert_eq!(step.out, vec![0.0; d]);
        assert_eq!(step.out, exact(&q, &[], &[]));
        assert_eq!((step.telemetry.bound, step.telemetry.rung, step.telemetry.tokens), (0.0, Rung::Fast, 0));
        let layer = certified_layer_step(&[head.clone(), head], &[q.clone(), q.clone(), q.clone(), q.clone(), q.clone(), q.clone(), q.clone(), q].concat(), GQA, &CertConfig::default(), 0).unwrap();
        assert!(layer.out.iter().all(|&x| x == 0.0) && !layer.dense);
    }
}

/// 1 token (and any cache shorter than a block) is a partial fp16 block: the output is
/// exact attention bit for bit, the certificate only E_round.
#[test]
fn sub_block_caches_are_exact() {
    for n in [1, 2, 15] {
        let c = case(64, n, 3.0, n as u64);
        let (k, v) = &c.kv[0];
        let head = CertifiedHead::encode(CertFormat::Q8K4V, 64, k, v).unwrap();
        assert_eq!((head.blocks.len(), head.partial_len()), (0, n));
        let step = certified_head_step(&head, &c.q[..64], &CertConfig::default(), 0).unwrap();
        assert_eq!(step.out, exact(&c.q[..64], k, v));
        let t = &step.telemetry;
        assert_eq!((t.e_key, t.e_val, t.k_star, t.rung), (0.0, 0.0, 0, Rung::Fast));
        assert!(t.bound == t.e_round && t.e_round < 1e-10 * t.v_max, "{t:?}");
    }
}

/// P4: a missing tier-2 original is a typed error, whether or not the step would read it,
/// for a head and for a layer — never an output.
#[test]
fn missing_original_is_a_typed_error() {
    let c = case(64, 160, 1.0, 5);
    let (k, v) = &c.kv[0];
    let mut head = CertifiedHead::encode(CertFormat::Q8K4V, 64, k, v).unwrap();
    head.tier2.resident[7] = false;
    let r = certified_head_step(&head, &c.q[..64], &CertConfig::default(), 0);
    assert_eq!(r, Err(CertError::MissingOriginal { block: 7 }));
    let other = CertifiedHead::encode(CertFormat::Q8K4V, 64, &c.kv[1].0, &c.kv[1].1).unwrap();
    let r = certified_layer_step(&[other, head], &c.q, GQA, &CertConfig::default(), 0);
    assert_eq!(r.unwrap_err(), CertError::MissingOriginal { block: 7 });
    assert!(CertError::MissingOriginal { block: 7 }.to_string().contains("P4"));
}

/// Every injected fault is detected: post-encoding faults by the CRC (certain: a burst of
/// ≤ 32 bits), sealed faults by the score check when promoted (certain: the construction
/// moves a logit beyond Δ_b + ε_guard), sealed faults in the tail by exploration (within
/// 20,000 steps; ≈ tail/explored steps expected), missing originals by a typed error. A
/// detected fault's output is the exact output.
#[test]
fn every_injected_fault_is_detected() {
    let per_kind = if cfg!(debug_assertions) { 4 } else { 50 };
    let st = campaign(per_kind, SEED).unwrap();
    eprintln!("faults: {st:?}");
    assert_eq!(st.detected, st.injected);
    assert_eq!(st.inexact_after_detection, 0);
    assert_eq!(st.exploration_via_selection, 0, "the injected fault must stay in the tail");
    for f in [Fault::CorruptScale, Fault::StaleZero, Fault::FlipKeyBit] {
        assert_eq!(st.checksum[&f].injected, per_kind);
        assert!(st.score_check[&f].injected > 0);
    }
    let sealed: u64 = st.score_check.values().map(|c| c.injected).sum();
    assert_eq!(sealed + st.score_not_constructible, 3 * per_kind);
    assert_eq!(st.missing_original.injected, per_kind);
    assert!(st.exploration.injected >= per_kind / 8);
    // With a handful of tail faults (debug builds inject 4 per kind) finding each at its first
    // step is plausible; with 50 per kind it would mean the draw is not random.
    if st.exploration.injected >= 8 {
        assert!(st.exploration_mean_steps > 1.0, "exploration found every fault at once: the draw is not random");
    }
}

/// The score check itself: for a sealed fault, detection happens exactly when some token of
/// a promoted block moved beyond Δ_b + ε_guard — no false alarms on clean blocks.
#[test]
fn score_check_fires_iff_a_logit_leaves_its_interval() {
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    let (mut fired, mut clean) = (0, 0);
    for i in 0..60u64 {
        let c = case(64, 64, 1.5, 100 + i);
        let (k, v) = &c.kv[0];
        let mut head = CertifiedHead::encode(CertFormat::Q8K4V, 64, k, v).unwrap();
        let q = &c.q[..64];
        let all = CertConfig { k_min: 4, k_max: 4, ..CertConfig::default() };
        let b = rng.gen_range(0..4);
        if i % 2 == 0 {
            let fault = [Fault::CorruptScale, Fault::StaleZero, Fault::FlipKeyBit][(i / 2 % 3) as usize];
            assert!(inject_displacing(&mut head, fault, b, q, all.eps_guard), "d = 64: every displacing fault is constructible");
        }
        let beyond = (0..4).any(|b| {
            let (disp, delta) = score_displacement(&head, q, b);
            disp > delta + all.eps_guard
        });
        let step = certified_head_step(&head, q, &all, i).unwrap();
        assert_eq!(step.telemetry.detections.score > 0, beyond);
        assert_eq!(step.telemetry.detections.checksum, 0, "sealed faults pass the CRC");
        if beyond {
            fired += 1;
        } else {
            clean += 1;
        }
    }
    assert_eq!((fired, clean), (30, 30));
}

/// A post-encoding fault of each kind flips the CRC verdict (and the head falls back).
#[test]
fn post_encoding_faults_break_the_checksum() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for fault in [Fault::CorruptScale, Fault::StaleZero, Fault::FlipKeyBit] {
        for i in 0..200 {
            let c = case(128, 16 * (1 + i % 5) + i % 3, 1.0, i as u64);
            let mut head = CertifiedHead::encode(CertFormat::Q8K4V, 128, &c.kv[0].0, &c.kv[0].1).unwrap();
            let before = head.clone();
            inject(&mut head, fault, &mut rng);
            assert_ne!(head, before, "{fault:?} changed nothing");
            let step = certified_head_step(&head, &c.q[..128], &CertConfig::default(), 0).unwrap();
            assert_eq!(step.telemetry.detections.checksum, 1);
            assert_eq!(step.telemetry.rung, Rung::HeadExact);
        }
    }
}

/// Hard value budget: every certified output meets E_val ≤ ε_val, and the bound still holds.
#[test]
fn value_budget_mode_meets_its_budget() {
    let cfg = CertConfig { values: ValuePolicy::Budget { eps_val: 2e-3 }, ..CertConfig::default() };
    let s = run_workload(Workload::ValueOutliers, 2_000 / DEBUG_DIVISOR.min(10), SEED + 1, &cfg).unwrap();
    assert_eq!(s.violations, 0);
    let c = case(128, 300, 1.0, 2);
    for o in run_case(&c, &cfg, 0).unwrap() {
        assert!(o.telemetry.rung >= Rung::HeadExact || o.telemetry.e_val <= 2e-3);
    }
}

/// The rungs act as specified: the threshold policy promotes the values of heavy blocks, rung 1
/// doubles K* when E_key is over its tolerance, and a forced exploration promotes tail blocks.
#[test]
fn ladder_rungs_act() {
    let c = case(64, 2048, 0.2, 4);
    let (k, v) = &c.kv[0];
    let head = CertifiedHead::encode(CertFormat::Q8K4V, 64, k, v).unwrap();
    let q = &c.q[..64];
    let base = CertConfig { k_max: 8, e_key_rel_tol: f64::INFINITY, explore_frac: 0.0, ..CertConfig::default() };
    let s0 = certified_head_step(&head, q, &base, 0).unwrap();
    assert_eq!(s0.telemetry.k_star, 8);
    let s1 = certified_head_step(&head, q, &CertConfig { e_key_rel_tol: 0.0, ..base.clone() }, 0).unwrap();
    assert_eq!(s1.telemetry.k_star, 16, "rung 1 doubles K*");
    let s2 = certified_head_step(&head, q, &CertConfig { explore_frac: 0.1, ..base.clone() }, 0).unwrap();
    assert_eq!((s2.telemetry.explored, s2.explored_keys.len()), (13, 13));
    assert!(s2.telemetry.alpha_tail_hat < s0.telemetry.alpha_tail_hat);
    let s3 = certified_head_step(&head, q, &CertConfig { values: ValuePolicy::Threshold { v_tol: 0.0 }, ..base }, 0).unwrap();
    assert_eq!(s3.telemetry.values_promoted, 128, "v_tol = 0 promotes every block with η > 0");
}

/// Boundary check (eq. 18): a tail block that is a twin of the top block (same keys) could
/// hold as much mass as the top, so the certificate is refused (rung 3) — and only then.
#[test]
fn boundary_check_fires_on_a_hidden_twin() {
    let c = case(64, 16 * 12, 1.0, 21);
    let (mut k, v) = c.kv[0].clone();
    let q = &c.q[..64];
    let d = 64;
    // Block 0 aligned with q (the top block); block 9 its exact twin.
    for t in 0..16 {
        for ch in 0..d {
            k[t * d + ch] = q[ch] * (2.0 + 0.01 * t as f32);
        }
    }
    let (top, rest) = k.split_at_mut(16 * d);
    rest[8 * 16 * d..9 * 16 * d].copy_from_slice(top);
    let head = CertifiedHead::encode(CertFormat::Q8K4V, d, &k, &v).unwrap();
    let cfg = CertConfig { k_min: 1, k_max: 1, explore_frac: 0.0, e_key_rel_tol: f64::INFINITY, ..CertConfig::default() };
    let step = certified_head_step(&head, q, &cfg, 0).unwrap();
    assert_eq!(step.promoted_keys, vec![0], "ties rank by index: block 0 is promoted, its twin is not");
    assert_eq!(step.telemetry.detections.boundary, 1);
    assert_eq!(step.telemetry.rung, Rung::HeadExact);
    let with_twin = certified_head_step(&head, q, &CertConfig { k_min: 2, k_max: 2, ..cfg }, 0).unwrap();
    assert_eq!(with_twin.promoted_keys, vec![0, 9]);
    assert_eq!(with_twin.telemetry.detections.boundary, 0);
}

#[test]
fn config_and_format_are_validated() {
    let head = CertifiedHead::encode(CertFormat::Q8K4V, 64, &[0.5; 64 * 20], &[0.5; 64 * 20]).unwrap();
    for bad in [
        CertConfig { tau_cov: 0.0, ..CertConfig::default() },
        CertConfig { k_min: 5, k_max: 4, ..CertConfig::default() },
        CertConfig { explore_frac: 1.5, ..CertConfig::default() },
        CertConfig { rank_depth: 0, ..CertConfig::default() },
        CertConfig { values: ValuePolicy::Threshold { v_tol: f64::NAN }, ..CertConfig::default() },
    ] {
        assert!(matches!(certified_head_step(&head, &[0.1; 64], &bad, 0), Err(CertError::Config(_))));
    }
    assert!(matches!(certified_head_step(&head, &[0.1; 32], &CertConfig::default(), 0), Err(CertError::Coding(_))));
    assert!(matches!(certified_head_step(&head, &[f32::NAN; 64], &CertConfig::default(), 0), Err(CertError::Coding(_))));
    assert!(matches!(CertifiedHead::encode(CertFormat::Q8K4V, 64, &[1e6; 64], &[0.0; 64]), Err(CertError::Coding(_))));
    assert!(matches!(CertifiedHead::new(CertFormat::Q8K4V, 24), Err(CertError::Format(_))));
    // The shipped spec's certified tier is exactly seed 004's format; fp16 key zeros are refused.
    let spec = common::spec("certified");
    assert_eq!(CertFormat::from_tier(spec.tier("q8k4v").unwrap()).unwrap(), CertFormat::Q8K4V);
    let fp16_keys = common::int_tier(8, 16, kvforge_spec::ScaleDType::Fp16, 4, 16, kvforge_spec::ScaleDType::Fp16);
    assert!(matches!(CertFormat::from_tier(&fp16_keys), Err(CertError::Format(_))));
    assert!(matches!(CertFormat::from_tier(spec.tier("fp16").unwrap()), Err(CertError::Format(_))));
}

/// Telemetry is plain serialisable data (the GPU path will emit the same fields).
#[test]
fn telemetry_round_trips_through_json() {
    let c = case(64, 100, 1.0, 1);
    let t = run_case(&c, &CertConfig::default(), 0).unwrap().remove(0).telemetry;
    let json = serde_json::to_string(&t).unwrap();
    assert!(json.contains("\"alpha_tail_hat\"") && json.contains("\"rung\""));
    // serde_json parses floats to within an ulp (no `float_roundtrip` feature): compare so.
    let mut back: Telemetry = serde_json::from_str(&json).unwrap();
    for (a, b) in [
        (&mut back.delta, t.delta),
        (&mut back.alpha_tail_hat, t.alpha_tail_hat),
        (&mut back.v_max, t.v_max),
        (&mut back.e_key, t.e_key),
        (&mut back.e_key_paper, t.e_key_paper),
        (&mut back.e_val, t.e_val),
        (&mut back.e_round, t.e_round),
        (&mut back.bound, t.bound),
    ] {
        assert!((*a - b).abs() <= 2.0 * f64::EPSILON * b.abs());
        *a = b;
    }
    assert_eq!(back, t);
    let cfg: CertConfig = serde_json::from_str(&serde_json::to_string(&CertConfig::default()).unwrap()).unwrap();
    assert_eq!(cfg, CertConfig::default());
}
