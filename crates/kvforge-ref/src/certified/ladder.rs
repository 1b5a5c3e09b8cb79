//! One certified decode step of one head, and of one layer: Phase 1, the selector, the
//! fallback ladder, Phase 2, the checks and the certificate (seed 004 §3–§6).
//!
//! The procedure ([`certified_head_step`]), in order:
//!
//! 1. **Preconditions.** An empty cache returns the zero vector with a zero certificate (the
//!    empty sum, as [`crate::attention()`] and the split-K identity). Every full block's
//!    tier-2 original must be resident (P4), else [`CertError::MissingOriginal`]. With
//!    `verify_checksums`, every block's CRC-32 is checked; a mismatch is a fault.
//! 2. **Phase 1.** int8 logits of every full block, exact logits of the partial block;
//!    ℓ_b, Δ_b; Δ = max_b Δ_b; p_b = e^{ℓ_b − LSE} over all blocks.
//! 3. **Selector.** K* ([`super::select::k_star`]); α̂ = Σ of p_b over unpromoted full blocks.
//!    **Rung 1** if E_key > `e_key_rel_tol`·V_max: K* doubled.
//! 4. **Exploration.** ⌈`explore_frac`·blocks⌉ random tail blocks are promoted too.
//! 5. **Rung 2** (threshold policy): values of blocks with p_b η_b > v_tol come from tier 2.
//! 6. **Phase 2.** Promoted blocks are scored with their fp16 originals and *score-checked*:
//!    a token with |s_fp16 − s_int8| > Δ_b + ε_guard is a fault. Weights a' over all tokens,
//!    block masses ρ_b. Budget policy: values promoted greedily by ρ_b η_b until E_val ≤ ε_val.
//! 7. **Checks.** Ranking consistency (eq. 17, top-r over promoted blocks and the partial
//!    block) and boundary (eq. 18, with the per-block Δ_b: ℓ_b^int8 + Δ_b bounds ℓ_b^fp16).
//! 8. **Rung 3** (per head, exact from tier 2) if a check fails, if E_key still exceeds its
//!    tolerance after rung 1, or on a fault. A fault also asks the layer for **rung 4**
//!    ([`certified_layer_step`]: every head of the layer exact), as the paper's score check
//!    does (§6): corrupted data or hardware is not a per-head event.
//!
//! Returned outputs are either certified (`bound` = E_key + E_val + E_round) or exact
//! (`bound` = 0: the very computation of [`crate::attention()`] over the originals).
//!
//! **What the fault mechanisms can and cannot see.** The CRC detects any corruption of ≤ 32
//! contiguous bits of a block's tier-1 bytes after encoding, with certainty (scale, zero,
//! payload bit, η, ν). The score check sees only promoted and explored blocks, and only
//! displacements beyond Δ_b + ε_guard — smaller ones cannot break the certificate except by
//! ε_guard. Exploration turns a persistent fault in a tail block into a detection with
//! probability ≈ explored/tail per step. Nothing here detects tier-2 corruption (tier 2 is
//! the truth) or a fault that precedes the checksum and stays within Δ_b + ε_guard.

use serde::{Deserialize, Serialize};

use super::certificate::{e_key, e_key_paper, e_round, e_val};
use super::score::{block_delta, block_stats, key_channel_error_bound, logits};
use super::select::{expand, explore, explore_count, k_star, rank_blocks, splitmix64};
use super::store::{block_checksum, norm_upper, CertifiedHead};
use crate::error::{CertError, RefError};
use crate::quant::qmax;

/// How rung 2 promotes values (seed 004 §3.4 item 2).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ValuePolicy {
    /// Before Phase 2, promote every block with p_b η_b > `v_tol` (local heuristic; E_val is
    /// whatever results). Paper default, v_tol = 0.05.
    Threshold { v_tol: f64 },
    /// After Phase 2, promote blocks greedily by descending ρ_b η_b until E_val ≤ `eps_val`
    /// (hard value budget). Weights do not depend on values, so only the output sum changes.
    Budget { eps_val: f64 },
}

/// Thresholds of the procedure; `Default` is the paper's Table 2 where it has a value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CertConfig {
    /// τ_cov: estimated mass the promoted blocks must cover (0.995).
    pub tau_cov: f64,
    /// K_min, K_max: clamp of K* (2, 128).
    pub k_min: usize,
    pub k_max: usize,
    /// Fraction of blocks explored per step (0.02; the paper uses 1–5%).
    pub explore_frac: f64,
    /// ε_guard of the score check (10⁻⁶, the paper's experiments).
    pub eps_guard: f64,
    /// r of the ranking-consistency and boundary checks (1).
    pub rank_depth: usize,
    /// Rung 1 fires when E_key > this × V_max, rung 3 when it still does after rung 1. The
    /// paper names the threshold but gives no value; 0.02 is ≈3× its operating point
    /// (E_key ≈ 0.006 V_max at τ_cov = 0.995, Δ = 0.18).
    pub e_key_rel_tol: f64,
    pub values: ValuePolicy,
    /// Check every block's CRC-32 in Phase 1.
    pub verify_checksums: bool,
    /// Rung 4 when more than this fraction of a layer's heads fell to rung 3 (0.5; not in the
    /// paper, which takes rung 4 on score-check faults only — so do we, always).
    pub layer_dense_frac: f64,
    /// Seed of the exploration draw of a layer step ([`certified_layer_step`] gives query head
    /// h at step t the draw [`head_seed`]`(seed, t, h)`; [`certified_head_step`] takes its
    /// draw seed as an argument).
    pub seed: u64,
}

impl Default for CertConfig {
    fn default() -> Self {
        CertConfig {
            tau_cov: 0.995,
            k_min: 2,
            k_max: 128,
            explore_frac: 0.02,
            eps_guard: 1e-6,
            rank_depth: 1,
            e_key_rel_tol: 0.02,
            values: ValuePolicy::Threshold { v_tol: 0.05 },
            verify_checksums: true,
            layer_dense_frac: 0.5,
            seed: 0x5eed_0004,
        }
    }
}

impl CertConfig {
    pub fn validate(&self) -> Result<(), CertError> {
        let bad = |what: &str| Err(CertError::Config(what.to_string()));
        let unit = |x: f64| (0.0..=1.0).contains(&x);
        if !(self.tau_cov > 0.0 && self.tau_cov <= 1.0) {
            return bad("tau_cov must be in (0, 1]");
        }
        if self.k_min > self.k_max {
            return bad("k_min must not exceed k_max");
        }
        if !unit(self.explore_frac) || !unit(self.layer_dense_frac) {
            return bad("explore_frac and layer_dense_frac must be in [0, 1]");
        }
        if !(self.eps_guard >= 0.0 && self.e_key_rel_tol >= 0.0) {
            return bad("eps_guard and e_key_rel_tol must be ≥ 0");
        }
        if self.rank_depth == 0 {
            return bad("rank_depth (r) must be ≥ 1");
        }
        match self.values {
            ValuePolicy::Threshold { v_tol: x } | ValuePolicy::Budget { eps_val: x } if x.is_nan() || x < 0.0 => bad("v_tol / eps_val must be ≥ 0"),
            _ => Ok(()),
        }
    }
}

/// The rung a head-step's output came from; a fast-path step reports the highest rung that
/// acted (rung 2 implies nothing about rung 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Rung {
    /// Selector only.
    #[default]
    Fast = 0,
    /// K* doubled.
    ExpandKeys = 1,
    /// Some values from tier 2.
    PromoteValues = 2,
    /// This head recomputed exactly from tier 2.
    HeadExact = 3,
    /// The whole layer recomputed exactly.
    LayerDense = 4,
}

impl Rung {
    pub const ALL: [Rung; 5] = [Rung::Fast, Rung::ExpandKeys, Rung::PromoteValues, Rung::HeadExact, Rung::LayerDense];
    pub fn index(self) -> usize {
        self as usize
    }
}

/// What the monitors saw in one head-step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Detections {
    /// Blocks whose CRC-32 did not match (fault).
    pub checksum: usize,
    /// Promoted/explored blocks with a token outside Δ_b + ε_guard (fault).
    pub score: usize,
    /// Top-r disagreement between fp16 and int8 block log-masses (eq. 17; not a fault).
    pub ranking: bool,
    /// Tail blocks that could enter the top r (eq. 18; not a fault).
    pub boundary: usize,
}

impl Detections {
    /// Corrupt data or hardware: the layer falls back to rung 4.
    pub fn fault(&self) -> bool {
        self.checksum > 0 || self.score > 0
    }
}

/// Per head-step telemetry. Candidate values (Δ, α̂, E_*) describe the fast path as planned,
/// also when a fallback replaced its output; `bound` certifies the output actually returned.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Telemetry {
    pub tokens: usize,
    /// Full (quantised) blocks.
    pub blocks: usize,
    /// Δ_h = max_b Δ_b.
    pub delta: f64,
    /// α̂_T: Phase-1 mass of the full blocks left on int8 keys.
    pub alpha_tail_hat: f64,
    pub v_max: f64,
    pub e_key: f64,
    /// Paper eq. 15 for the same Δ, α̂, V_max (comparison only).
    pub e_key_paper: f64,
    pub e_val: f64,
    pub e_round: f64,
    /// Certificate of the returned output: E_key + E_val + E_round, or 0 when exact.
    pub bound: f64,
    /// K* after clamping and rung 1 (explored blocks not counted).
    pub k_star: usize,
    pub explored: usize,
    pub values_promoted: usize,
    pub rung: Rung,
    pub detections: Detections,
}

/// One head-step's output `[d]` and what produced it.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadStep {
    pub out: Vec<f64>,
    pub telemetry: Telemetry,
    /// Blocks the fast path scored with fp16 keys in Phase 2 (selected and explored),
    /// ascending. Kept when a fallback replaced the output (which reads every block from tier
    /// 2); empty when the step stopped before selection (checksum fault).
    pub promoted_keys: Vec<usize>,
    /// The explored subset of `promoted_keys`, ascending.
    pub explored_keys: Vec<usize>,
    /// Blocks whose values the fast path took from tier 2, ascending (same convention).
    pub promoted_values: Vec<usize>,
}

/// The exact output of a head: [`crate::attention()`] over tier 2 and the partial block,
/// the output of rungs 3 and 4.
pub fn exact_head_output(head: &CertifiedHead, q: &[f64]) -> Result<Vec<f64>, CertError> {
    let (k, v) = head.exact_kv()?;
    Ok(crate::attention(q, &k, &v, 1.0 / (head.d as f64).sqrt()).0)
}

fn query(head: &CertifiedHead, q: &[f32]) -> Result<Vec<f64>, CertError> {
    if q.len() != head.d {
        return Err(RefError::Shape { what: "q", found: q.len(), expected: head.d, why: "one query row of head_dim".into() }.into());
    }
    if let Some((index, &value)) = q.iter().enumerate().find(|(_, x)| !x.is_finite()) {
        return Err(RefError::NonFinite { what: "q", index, value }.into());
    }
    Ok(q.iter().map(|&x| f64::from(x)).collect())
}

fn exact_step(head: &CertifiedHead, q: &[f64], mut telemetry: Telemetry, plan: Plan) -> Result<HeadStep, CertError> {
    telemetry.rung = Rung::HeadExact;
    telemetry.bound = 0.0;
    Ok(HeadStep { out: exact_head_output(head, q)?, telemetry, promoted_keys: plan.keys, explored_keys: plan.explored, promoted_values: plan.values })
}

/// The fast path's block sets.
#[derive(Default)]
struct Plan {
    keys: Vec<usize>,
    explored: Vec<usize>,
    values: Vec<usize>,
}

/// Top `r` of `items` (block, value) by value descending, then block ascending.
fn top(items: &[(usize, f64)], r: usize) -> Vec<usize> {
    let mut v = items.to_vec();
    v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    v.into_iter().take(r).map(|x| x.0).collect()
}

/// Blocks of `head` whose CRC-32 does not match the stored one.
pub fn checksum_mismatches(head: &CertifiedHead) -> usize {
    head.blocks.iter().filter(|b| block_checksum(b) != b.checksum).count()
}

/// One certified decode step of query `q` (`[d]`, fp16 values as f32) over `head`.
/// `explore_seed` draws the explored blocks ([`head_seed`] in a layer).
pub fn certified_head_step(head: &CertifiedHead, q: &[f32], cfg: &CertConfig, explore_seed: u64) -> Result<HeadStep, CertError> {
    let mismatches = if cfg.verify_checksums { checksum_mismatches(head) } else { 0 };
    head_step(head, q, cfg, explore_seed, mismatches)
}

/// [`certified_head_step`] with the checksum verdict given (a layer verifies each kv head
/// once for all its query heads).
fn head_step(head: &CertifiedHead, q: &[f32], cfg: &CertConfig, explore_seed: u64, mismatches: usize) -> Result<HeadStep, CertError> {
    cfg.validate()?;
    let q = query(head, q)?;
    let (d, n, nb, bs) = (head.d, head.len(), head.blocks.len(), head.format.block);
    let mut tel = Telemetry { tokens: n, blocks: nb, ..Telemetry::default() };
    if n == 0 {
        return Ok(HeadStep { out: vec![0.0; d], telemetry: tel, promoted_keys: vec![], explored_keys: vec![], promoted_values: vec![] });
    }
    for b in 0..nb {
        head.originals(b)?;
    }
    tel.detections.checksum = mismatches;
    if mismatches > 0 {
        return exact_step(head, &q, tel, Plan::default());
    }
    let sm = 1.0 / (d as f64).sqrt();
    let bits = head.format.key_bits;
    let qm = f64::from(qmax(bits));

    // Phase 1: int8 scores of every full block, exact scores of the partial block.
    let mut logits8 = Vec::with_capacity(nb);
    let (mut ell8, mut delta_b) = (vec![0f64; nb], vec![0f64; nb]);
    let mut a_max = 0f64;
    for b in 0..nb {
        let mut e = Vec::with_capacity(d);
        let mut mag = 0f64;
        for (c, qc) in q.iter().enumerate() {
            let step = head.key_step(b, c);
            let ec = key_channel_error_bound(bits, step);
            mag += qc.abs() * (f64::from(step.zero).abs() + qm * f64::from(step.scale) + ec);
            e.push(ec);
        }
        a_max = a_max.max(sm * mag);
        delta_b[b] = block_delta(&q, &e, sm);
        let l = logits(&q, &head.decoded_keys(b), sm);
        ell8[b] = block_stats(&l).2;
        logits8.push(l);
    }
    let pk: Vec<f64> = head.partial_k.iter().map(|&x| f64::from(x)).collect();
    let pv: Vec<f64> = head.partial_v.iter().map(|&x| f64::from(x)).collect();
    let lp = logits(&q, &pk, sm);
    for kt in pk.chunks_exact(d) {
        a_max = a_max.max(sm * q.iter().zip(kt).map(|(a, b)| (a * b).abs()).sum::<f64>());
    }
    let ell_p = block_stats(&lp).2;
    let delta = delta_b.iter().copied().fold(0f64, f64::max);
    let lse_max = ell8.iter().copied().fold(ell_p, f64::max);
    let lse = lse_max + (ell8.iter().map(|l| (l - lse_max).exp()).sum::<f64>() + (ell_p - lse_max).exp()).ln();
    let p: Vec<f64> = ell8.iter().map(|l| (l - lse).exp()).collect();
    let p_exact = (ell_p - lse).exp();
    let eta: Vec<f64> = head.blocks.iter().map(|b| f64::from(b.eta)).collect();
    let v_max = pv.chunks_exact(d).map(|vt| norm_upper(vt.iter().copied())).fold(head.blocks.iter().map(|b| f64::from(b.nu)).fold(0f64, f64::max), f64::max);
    let eta_max = eta.iter().copied().fold(0f64, f64::max);
    tel.v_max = v_max;
    tel.delta = delta;

    // Selector and rung 1.
    let order = rank_blocks(&p);
    let mut k = k_star(&p, &order, p_exact, cfg.tau_cov, cfg.k_min, cfg.k_max);
    let tol = cfg.e_key_rel_tol * v_max;
    let tail_mass = |k: usize| order[k..].iter().fold(0.0, |a, &b| a + p[b]);
    if e_key(delta, tail_mass(k), v_max) > tol && k < nb {
        k = expand(k, nb);
        tel.rung = Rung::ExpandKeys;
    }
    // Exploration: promoted too, and score-checked like every promoted block.
    let explored = explore(&order[k..], explore_count(cfg.explore_frac, nb, nb - k), explore_seed);
    let mut promoted = vec![false; nb];
    order[..k].iter().chain(&explored).for_each(|&b| promoted[b] = true);
    let alpha = (0..nb).filter(|&b| !promoted[b]).fold(0.0, |a, b| a + p[b]);
    tel.k_star = k;
    tel.explored = explored.len();
    tel.alpha_tail_hat = alpha;
    tel.e_key = e_key(delta, alpha, v_max);
    tel.e_key_paper = e_key_paper(delta, alpha, v_max);

    // Rung 2, threshold policy: decided from Phase-1 masses.
    let mut vprom = vec![false; nb];
    if let ValuePolicy::Threshold { v_tol } = cfg.values {
        (0..nb).filter(|&b| p[b] * eta[b] > v_tol).for_each(|b| vprom[b] = true);
    }

    // Phase 2 logits: fp16 keys for promoted blocks (score-checked), int8 for the tail.
    let mut s = Vec::with_capacity(n);
    let mut ell16 = vec![f64::NAN; nb];
    for b in 0..nb {
        if promoted[b] {
            let (ko, _) = head.originals(b)?;
            let k64: Vec<f64> = ko.iter().map(|&x| f64::from(x)).collect();
            let l = logits(&q, &k64, sm);
            if l.iter().zip(&logits8[b]).any(|(x, y)| (x - y).abs() > delta_b[b] + cfg.eps_guard) {
                tel.detections.score += 1;
            }
            ell16[b] = block_stats(&l).2;
            s.extend(l);
        } else {
            s.extend_from_slice(&logits8[b]);
        }
    }
    s.extend_from_slice(&lp);
    let mut explored_keys = explored;
    explored_keys.sort_unstable();
    let promoted_keys: Vec<usize> = (0..nb).filter(|&b| promoted[b]).collect();
    if tel.detections.score > 0 {
        let values = (0..nb).filter(|&b| vprom[b]).collect();
        return exact_step(head, &q, tel, Plan { keys: promoted_keys, explored: explored_keys, values });
    }
    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let den: f64 = w.iter().sum();
    let rho: Vec<f64> = w.chunks(bs).take(nb).map(|wb| wb.iter().sum::<f64>() / den).collect();
    let int4_val = |vprom: &[bool]| e_val(&rho, &(0..nb).map(|b| if vprom[b] { 0.0 } else { eta[b] }).collect::<Vec<_>>());
    if let ValuePolicy::Budget { eps_val } = cfg.values {
        let mut cand: Vec<usize> = (0..nb).collect();
        cand.sort_by(|&a, &b| (rho[b] * eta[b]).total_cmp(&(rho[a] * eta[a])).then(a.cmp(&b)));
        for b in cand {
            if int4_val(&vprom) <= eps_val {
                break;
            }
            vprom[b] = true;
        }
    }
    tel.e_val = int4_val(&vprom);
    tel.e_round = e_round(a_max, v_max + eta_max, n, d);
    tel.values_promoted = vprom.iter().filter(|&&x| x).count();
    if tel.values_promoted > 0 {
        tel.rung = Rung::PromoteValues;
    }

    // Output: Σ_t w_t Ṽ_t / Σ_t w_t, in token order as crate::attention().
    let mut out = vec![0f64; d];
    let mut acc = |wt: f64, vt: &[f64]| out.iter_mut().zip(vt).for_each(|(o, &x)| *o += wt * x);
    for b in 0..nb {
        let vals: Vec<f64> = if vprom[b] { head.originals(b)?.1.iter().map(|&x| f64::from(x)).collect() } else { head.decoded_values(b) };
        for (t, vt) in vals.chunks_exact(d).enumerate() {
            acc(w[b * bs + t], vt);
        }
    }
    for (t, vt) in pv.chunks_exact(d).enumerate() {
        acc(w[nb * bs + t], vt);
    }
    out.iter_mut().for_each(|o| *o /= den);

    // Checks: ranking consistency (eq. 17) and boundary (eq. 18) over the exact set.
    let r = cfg.rank_depth;
    let mut f16_set: Vec<(usize, f64)> = (0..nb).filter(|&b| promoted[b]).map(|b| (b, ell16[b])).collect();
    let mut f8_set: Vec<(usize, f64)> = (0..nb).filter(|&b| promoted[b]).map(|b| (b, ell8[b])).collect();
    if !lp.is_empty() {
        f16_set.push((nb, ell_p));
        f8_set.push((nb, ell_p));
    }
    tel.detections.ranking = top(&f16_set, r) != top(&f8_set, r);
    let mut sorted16: Vec<f64> = f16_set.iter().map(|x| x.1).collect();
    sorted16.sort_by(|a, b| b.total_cmp(a));
    let ell_r = sorted16.get(r - 1).copied().unwrap_or(f64::NEG_INFINITY);
    tel.detections.boundary = (0..nb).filter(|&b| !promoted[b] && ell8[b] + delta_b[b] > ell_r).count();

    let promoted_values: Vec<usize> = (0..nb).filter(|&b| vprom[b]).collect();
    let plan = Plan { keys: promoted_keys, explored: explored_keys, values: promoted_values };
    if tel.detections.ranking || tel.detections.boundary > 0 || tel.e_key > tol {
        return exact_step(head, &q, tel, plan);
    }
    tel.bound = tel.e_key + tel.e_val + tel.e_round;
    Ok(HeadStep { out, telemetry: tel, promoted_keys: plan.keys, explored_keys: plan.explored, promoted_values: plan.values })
}

/// Exploration seed of query head `h` at decode step `step`.
pub fn head_seed(seed: u64, step: u64, h: usize) -> u64 {
    splitmix64(seed ^ splitmix64(step ^ splitmix64(h as u64)))
}

/// One layer's step: query heads `[kv heads][gqa][d]`, query head h attends `heads[h / gqa]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStep {
    /// `[kv heads · gqa][d]`.
    pub out: Vec<f64>,
    pub telemetry: Vec<Telemetry>,
    /// Rung 4 taken: every head is exact.
    pub dense: bool,
}

/// Certified step of every query head of a layer, with rung 4: if any head saw a fault, or
/// more than `layer_dense_frac` of the heads fell to rung 3, every head is recomputed exactly
/// (the paper stages one layer's fp16 K/V at a time for this; here it is the same function).
pub fn certified_layer_step(heads: &[CertifiedHead], q: &[f32], gqa: usize, cfg: &CertConfig, step: u64) -> Result<LayerStep, CertError> {
    let d = heads.first().map_or(0, |h| h.d);
    if gqa == 0 || q.len() != heads.len() * gqa * d {
        return Err(RefError::Shape { what: "q", found: q.len(), expected: heads.len() * gqa * d, why: format!("[{} kv heads][{gqa}][{d}]", heads.len()) }.into());
    }
    let mismatches: Vec<usize> = heads.iter().map(|h| if cfg.verify_checksums { checksum_mismatches(h) } else { 0 }).collect();
    let mut steps = Vec::with_capacity(heads.len() * gqa);
    for (h, qh) in q.chunks_exact(d.max(1)).enumerate() {
        steps.push(head_step(&heads[h / gqa], qh, cfg, head_seed(cfg.seed, step, h), mismatches[h / gqa])?);
    }
    let exact = steps.iter().filter(|s| s.telemetry.rung >= Rung::HeadExact).count();
    let dense = steps.iter().any(|s| s.telemetry.detections.fault()) || exact as f64 > cfg.layer_dense_frac * steps.len() as f64;
    let mut out = Vec::with_capacity(q.len());
    let mut telemetry = Vec::with_capacity(steps.len());
    for (h, s) in steps.into_iter().enumerate() {
        let mut t = s.telemetry;
        if dense {
            let qh: Vec<f64> = q[h * d..(h + 1) * d].iter().map(|&x| f64::from(x)).collect();
            out.extend(exact_head_output(&heads[h / gqa], &qh)?);
            t.rung = Rung::LayerDense;
            t.bound = 0.0;
        } else {
            out.extend(s.out);
        }
        telemetry.push(t);
    }
    Ok(LayerStep { out, telemetry, dense })
}
