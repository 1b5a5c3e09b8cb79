//! Fault injection, and the campaign that checks every injected fault is detected.
//!
//! Three ways a fault meets the monitors, each with what guarantees the detection:
//!
//! * **After encoding** (bit rot, a stray or stale write): [`inject`] changes tier-1 bytes and
//!   leaves the checksum alone. The CRC-32 detects every change confined to 32 contiguous bits
//!   ([`super::store::block_checksum`]) — a scale, a zero, a code bit — so detection is certain.
//! * **Before checksumming** (an encoder bug, stale metadata sealed with the block):
//!   [`inject_displacing`] corrupts a block so that some logit moves beyond the declared
//!   Δ_b + ε_guard and reseals the checksum. Only the score check can see it, and it does with
//!   certainty when the block is promoted (the campaign promotes every block).
//! * The same sealed fault in a **tail** block is seen only when exploration draws the block:
//!   certain over enough steps, not in any one step ([`steps_to_detection`]).
//! * A **missing tier-2 original** fails the step with [`CertError::MissingOriginal`] (P4).
//!
//! Not detectable here: sealed faults that move no logit beyond Δ_b + ε_guard (harmless to the
//! certificate up to ε_guard), corrupt tier-2 originals (they define the truth), and
//! corruption wider than 32 bits that happens to keep the CRC (probability 2⁻³²).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::ladder::{certified_head_step, exact_head_output, CertConfig, Rung};
use super::score::{block_delta, key_channel_error_bound, logits};
use super::store::{block_checksum, CertFormat, CertifiedHead};
use super::trials::{gaussians, generate, Workload};
use crate::error::CertError;

/// The faults of the fault-injection list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    CorruptScale,
    StaleZero,
    FlipKeyBit,
    MissingOriginal,
}

impl Fault {
    pub const ALL: [Fault; 4] = [Fault::CorruptScale, Fault::StaleZero, Fault::FlipKeyBit, Fault::MissingOriginal];
}

fn set_f32(bytes: &mut [u8], i: usize, x: f32) {
    bytes[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes());
}

/// A post-encoding fault in a random block (checksum untouched). Returns the block.
///
/// * `CorruptScale`: one random bit of one channel's fp32 key scale flipped.
/// * `StaleZero`: one channel's key zero replaced by an older value — the zero of the same
///   channel in another block (a stale pointer), or, when all agree, the block's zero before
///   its last σ-steps of range arrived.
/// * `FlipKeyBit`: one random bit of the int8 key payload flipped.
/// * `MissingOriginal`: the block's tier-2 original marked not resident.
pub fn inject(head: &mut CertifiedHead, fault: Fault, rng: &mut ChaCha8Rng) -> usize {
    let (nb, d) = (head.blocks.len(), head.d);
    assert!(nb > 0, "fault injection needs a full block");
    let b = rng.gen_range(0..nb);
    match fault {
        Fault::CorruptScale => {
            let i = 4 * rng.gen_range(0..d) + rng.gen_range(0..4);
            head.blocks[b].key.scale[i] ^= 1 << rng.gen_range(0..8);
        }
        Fault::StaleZero => {
            let c = rng.gen_range(0..d);
            let step = head.key_step(b, c);
            let other = (0..nb).map(|o| head.key_step(o, c).zero).find(|&z| z != step.zero);
            let stale = other.unwrap_or_else(|| step.zero - if step.scale > 0.0 { step.scale * rng.gen_range(1..=8) as f32 } else { 1.0 });
            set_f32(&mut head.blocks[b].key.zero, c, stale);
        }
        Fault::FlipKeyBit => {
            let i = rng.gen_range(0..head.blocks[b].key.codes.len());
            head.blocks[b].key.codes[i] ^= 1 << rng.gen_range(0..8);
        }
        Fault::MissingOriginal => head.tier2.resident[b] = false,
    }
    b
}

/// (max_t |s_fp16 − s_int8|, Δ_b) of block `b` for query `q`, as the score check sees them.
pub fn score_displacement(head: &CertifiedHead, q: &[f32], b: usize) -> (f64, f64) {
    let d = head.d;
    let sm = 1.0 / (d as f64).sqrt();
    let q: Vec<f64> = q.iter().map(|&x| f64::from(x)).collect();
    let e: Vec<f64> = (0..d).map(|c| key_channel_error_bound(head.format.key_bits, head.key_step(b, c))).collect();
    let k16: Vec<f64> = head.tier2.k[b * head.format.block * d..(b + 1) * head.format.block * d].iter().map(|&x| f64::from(x)).collect();
    let s16 = logits(&q, &k16, sm);
    let s8 = logits(&q, &head.decoded_keys(b), sm);
    let disp = s16.iter().zip(&s8).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
    (disp, block_delta(&q, &e, sm))
}

/// A fault sealed into block `b` (checksum recomputed) that moves some logit beyond
/// Δ_b + `eps` for query `q`, found by growing the corruption until it does: the scale or zero
/// of the channel with the largest |q_c| σ_c is pushed, doubling, in the direction that lowers
/// the block's int8 logits; a code bit is chosen among that channel's high bits. Returns false when no such fault exists within the search (e.g. a
/// constant channel, or a bit flip too small against Δ_b at large d); the block is then
/// left unchanged.
pub fn inject_displacing(head: &mut CertifiedHead, fault: Fault, b: usize, q: &[f32], eps: f64) -> bool {
    let d = head.d;
    let saved = head.blocks[b].clone();
    let c = (0..d).max_by(|&x, &y| {
        let w = |c: usize| f64::from(q[c]).abs() * f64::from(head.key_step(b, c).scale);
        w(x).total_cmp(&w(y))
    });
    let Some(c) = c else { return false };
    let step = head.key_step(b, c);
    let beyond = |h: &CertifiedHead| {
        let (disp, delta) = score_displacement(h, q, b);
        disp > delta + eps
    };
    let mut done = false;
    match fault {
        Fault::CorruptScale | Fault::StaleZero => {
            // Towards lower int8 logits: the block looks lighter in Phase 1, the direction that
            // hides a fault in the tail.
            let unit = if step.scale > 0.0 { step.scale } else { 1e-3 };
            let mut shift = if q[c] > 0.0 { -unit } else { unit };
            for _ in 0..60 {
                let blk = &mut head.blocks[b];
                if fault == Fault::CorruptScale {
                    set_f32(&mut blk.key.scale, c, step.scale + shift);
                } else {
                    set_f32(&mut blk.key.zero, c, step.zero + shift);
                }
                blk.checksum = block_checksum(blk);
                if beyond(head) {
                    done = true;
                    break;
                }
                shift *= 2.0;
            }
        }
        Fault::FlipKeyBit => {
            'search: for bit in (4..8).rev() {
                for t in 0..head.format.block {
                    let blk = &mut head.blocks[b];
                    blk.key.codes[t * d + c] ^= 1 << bit;
                    blk.checksum = block_checksum(blk);
                    if beyond(head) {
                        done = true;
                        break 'search;
                    }
                    head.blocks[b] = saved.clone();
                }
            }
        }
        Fault::MissingOriginal => {
            head.tier2.resident[b] = false;
            return true;
        }
    }
    if !done {
        head.blocks[b] = saved;
    }
    done
}

/// Steps (exploration seeds `seed`, `seed + 1`, …) until the score check fires, at most `max_steps`:
/// `Some((steps, explored))` with `explored` telling whether block `b` was in the explored
/// set (rather than selected) at that step; `None` if it never fires.
pub fn steps_to_detection(head: &CertifiedHead, q: &[f32], b: usize, cfg: &CertConfig, seed: u64, max_steps: u64) -> Result<Option<(u64, bool)>, CertError> {
    for s in 0..max_steps {
        let step = certified_head_step(head, q, cfg, seed.wrapping_add(s))?;
        if step.telemetry.detections.score > 0 {
            return Ok(Some((s + 1, step.explored_keys.contains(&b))));
        }
    }
    Ok(None)
}

/// Injected and detected counts of one fault kind and mechanism.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultCount {
    pub injected: u64,
    pub detected: u64,
}

/// Results of [`campaign`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultStats {
    pub injected: u64,
    pub detected: u64,
    /// Post-encoding faults → checksum, by fault.
    pub checksum: std::collections::BTreeMap<Fault, FaultCount>,
    /// Sealed displacing faults in promoted blocks → score check, by fault.
    pub score_check: std::collections::BTreeMap<Fault, FaultCount>,
    /// Sealed displacing faults the construction could not make (not injected, not counted).
    pub score_not_constructible: u64,
    /// Sealed faults in a tail block → exploration.
    pub exploration: FaultCount,
    /// Tail-block faults that the score check caught because the selector promoted the block
    /// (not counted as detected above; 0 when the fault hides the block, as injected).
    pub exploration_via_selection: u64,
    /// Mean steps until exploration found the fault.
    pub exploration_mean_steps: f64,
    /// Missing tier-2 originals → typed error.
    pub missing_original: FaultCount,
    /// Detected faults whose output was not the exact output (must be 0).
    pub inexact_after_detection: u64,
}

/// A head of `n ≥ 16` tokens from the random workload.
fn random_head(rng: &mut ChaCha8Rng, min_tokens: usize) -> (CertifiedHead, Vec<f32>) {
    loop {
        let case = generate(Workload::Random, rng);
        let (k, v) = &case.kv[0];
        if k.len() / case.d >= min_tokens {
            let head = CertifiedHead::encode(CertFormat::Q8K4V, case.d, k, v).expect("finite case");
            return (head, case.q[..case.d].to_vec());
        }
    }
}

/// Injects `per_kind` faults of every kind through every mechanism and counts detections.
pub fn campaign(per_kind: u64, seed: u64) -> Result<FaultStats, CertError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut st = FaultStats::default();
    let cfg = CertConfig::default();
    for _ in 0..per_kind {
        for fault in Fault::ALL {
            // Post-encoding: checksum (or P4's typed error).
            let (mut head, q) = random_head(&mut rng, 16);
            let q64: Vec<f64> = q.iter().map(|&x| f64::from(x)).collect();
            let block = inject(&mut head, fault, &mut rng);
            let outcome = certified_head_step(&head, &q, &cfg, rng.gen());
            if fault == Fault::MissingOriginal {
                st.missing_original.injected += 1;
                if outcome == Err(CertError::MissingOriginal { block }) {
                    st.missing_original.detected += 1;
                }
                continue;
            }
            let e = st.checksum.entry(fault).or_default();
            e.injected += 1;
            let step = outcome?;
            if step.telemetry.detections.checksum > 0 {
                e.detected += 1;
                let clean = {
                    let mut h = head.clone();
                    h.blocks[block].checksum = 0; // exact output does not read tier 1
                    exact_head_output(&h, &q64)?
                };
                if step.telemetry.rung != Rung::HeadExact || step.out != clean {
                    st.inexact_after_detection += 1;
                }
            }
            // Sealed, every block promoted: score check.
            let (mut head, q) = random_head(&mut rng, 16);
            let b = rng.gen_range(0..head.blocks.len());
            if !inject_displacing(&mut head, fault, b, &q, cfg.eps_guard) {
                st.score_not_constructible += 1;
                continue;
            }
            let all = CertConfig { k_min: head.blocks.len(), k_max: head.blocks.len(), ..cfg.clone() };
            let e = st.score_check.entry(fault).or_default();
            e.injected += 1;
            let step = certified_head_step(&head, &q, &all, rng.gen())?;
            if step.telemetry.detections.score > 0 {
                e.detected += 1;
                if step.telemetry.rung != Rung::HeadExact || step.out != exact_head_output(&head, &q.iter().map(|&x| f64::from(x)).collect::<Vec<_>>())? {
                    st.inexact_after_detection += 1;
                }
            }
        }
    }
    // Exploration: a sealed scale fault in a tail block of a 40-block head, the selector
    // capped at 2 blocks (and rung 1 off) so that the block stays in the tail.
    let mut total_steps = 0u64;
    for _ in 0..per_kind.div_ceil(4) {
        let (d, n) = (64, 40 * 16);
        let k = gaussians(&mut rng, n * d);
        let v = gaussians(&mut rng, n * d);
        let q = gaussians(&mut rng, d);
        let mut head = CertifiedHead::encode(CertFormat::Q8K4V, d, &k, &v)?;
        let tail_cfg = CertConfig { k_min: 2, k_max: 2, e_key_rel_tol: f64::INFINITY, ..cfg.clone() };
        let probe = certified_head_step(&head, &q, &tail_cfg, u64::MAX)?;
        let tail: Vec<usize> = (0..head.blocks.len()).filter(|b| !probe.promoted_keys.contains(b)).collect();
        let b = tail[rng.gen_range(0..tail.len())];
        if !inject_displacing(&mut head, Fault::CorruptScale, b, &q, cfg.eps_guard) {
            continue;
        }
        st.exploration.injected += 1;
        match steps_to_detection(&head, &q, b, &tail_cfg, rng.gen(), 20_000)? {
            Some((s, true)) => {
                st.exploration.detected += 1;
                total_steps += s;
            }
            Some((_, false)) => st.exploration_via_selection += 1,
            None => {}
        }
    }
    st.exploration_mean_steps = total_steps as f64 / st.exploration.detected.max(1) as f64;
    let all = st.checksum.values().chain(st.score_check.values()).chain([&st.exploration, &st.missing_original]);
    for c in all {
        st.injected += c.injected;
        st.detected += c.detected;
    }
    Ok(st)
}
