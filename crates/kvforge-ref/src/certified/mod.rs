//! # Certified attention (seed 004): the CPU f64 specification
//!
//! Every decode step returns either an output whose distance to exact attention over the fp16
//! originals is bounded by a certificate computed in the step, or the exact output; a step
//! that can do neither (a tier-2 original is missing) is a typed error. A GPU implementation
//! is checked against this module: same blocks promoted, same rungs, same certificate, output
//! within its own arithmetic tolerance of [`HeadStep::out`].
//!
//! ```
//! use kvforge_ref::certified::{certified_head_step, CertConfig, CertFormat, CertifiedHead};
//! let d = 64;
//! let k: Vec<f32> = (0..40 * d).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
//! let v: Vec<f32> = (0..40 * d).map(|i| ((i * 104729) % 89) as f32 / 89.0 - 0.5).collect();
//! let head = CertifiedHead::encode(CertFormat::Q8K4V, d, &k, &v)?;   // 2 int8/int4 blocks + 8 fp16 tokens
//! let q = vec![0.25f32; d];
//! let step = certified_head_step(&head, &q, &CertConfig::default(), 1)?;
//! let exact = kvforge_ref::attention(&q.iter().map(|&x| x as f64).collect::<Vec<_>>(),
//!     &head.exact_kv()?.0, &head.exact_kv()?.1, 1.0 / (d as f64).sqrt()).0;
//! let err: f64 = step.out.iter().zip(&exact).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
//! assert!(err <= step.telemetry.bound || step.telemetry.bound == 0.0 && err == 0.0);
//! # Ok::<(), kvforge_ref::CertError>(())
//! ```
//!
//! Modules, one job each: [`store`] (tiers 1 and 2, annotations, checksum), [`score`]
//! (Phase-1 block scoring and Δ_b), [`select`] (K*, rung 1, exploration), [`certificate`] (the
//! bound and its derivation — read this first), [`ladder`] (the procedure and rungs 1–4),
//! [`trials`] (randomised and adversarial workloads that check the bound), [`faults`]
//! (fault injection).
//!
//! ## What a GPU implementation must reproduce
//!
//! * Encode: [`crate::quant`] f32 arithmetic for codes/scales/zeros; η_b, ν_b rounded *up*
//!   to f32; the CRC-32 of [`store::block_checksum`] over the same byte order; the partial
//!   block fp16 until full.
//! * Δ_b from [`score::key_channel_error_bound`] (not σ/2), Δ = max over all full blocks.
//! * Selector order (p desc, index asc), K* by coverage including the partial block's mass,
//!   clamp, rung 1 doubling, exploration by the splitmix64 hash, α̂ over unpromoted blocks.
//! * E_key = 2 V_max min{(e^Δ − 1) ᾱ, tanh(Δ/2)} with V_max over every token (partial block
//!   included), E_val from Phase-2 ρ_b, score check |s16 − s8| ≤ Δ_b + ε_guard, ranking and
//!   boundary checks as in [`ladder`], and its own arithmetic term in place of E_round.

pub mod certificate;
pub mod faults;
pub mod ladder;
pub mod score;
pub mod select;
pub mod store;
pub mod trials;

pub use certificate::{e_key, e_key_paper, e_round, e_val, tail_mass_bound};
pub use ladder::{certified_head_step, certified_layer_step, checksum_mismatches, exact_head_output, head_seed, CertConfig, Detections, HeadStep, LayerStep, Rung, Telemetry, ValuePolicy};
pub use score::{block_delta, key_channel_error_bound};
pub use store::{block_checksum, CertFormat, CertifiedHead, QuantBlock, Tier2};
