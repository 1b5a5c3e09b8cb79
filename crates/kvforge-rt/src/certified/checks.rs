//! What one query head's step achieved, from the two phases' per-block outputs: the inputs of
//! its certificate ([`super::bound`]) and its monitors. This is the f64 reference of the
//! device's `cert_bound` (`templates/include/kvforge/certify.cuh`), which computes the same
//! quantities from the same arrays; the GPU tests compare the two.
//!
//! * **Masses.** ρ_i = 2^(ℓ²_i − max ℓ²) / Σ 2^(ℓ²_j − max ℓ²) from phase 2's log2 masses.
//! * **Tail.** Over quantised blocks phase 2 did not serve exactly: α̂ = Σ ρ, Δ = max Δ_i,
//!   E_val = Σ ρ η.
//! * **Score check.** Every quantised block phase 2 served from its original: the exact and the
//!   quantised log-mass of the same tokens differ by at most Δ_i (+ ε_guard), or the block is
//!   corrupt — one detection per (block, head).
//! * **Ranking consistency** (seed 004 eq. 17, depth r): over the exact set F (served blocks and
//!   tail-tier blocks), order by phase-2 ℓ² and by phase-1 ℓ¹ (descending, then block index;
//!   IEEE total order, so NaN ranks first); at every position j < r the block ℓ¹ puts there must
//!   have an exact log-mass within ε_guard of the exact j-th: ℓ²(a_j) ≥ ℓ²(b_j) − ε_guard.
//!   Seed 004 compares the index sequences; blocks whose exact masses tie (identical keys, as in
//!   repeated heavy tokens) have no exact order to disagree with, and the strict rule sent such
//!   heads to rung 3 on most steps for a reordering that changes nothing. A swap of blocks whose
//!   exact masses differ by more than ε_guard (near ties included) still fails.
//! * **Boundary** (eq. 18): no quantised block left in the tail may satisfy ℓ¹ + Δ > ℓ²_(r), the
//!   r-th largest exact log-mass (−∞ when F has fewer than r blocks): else the exact top r could
//!   hold a block phase 2 never scored exactly.
//!
//! Log-masses enter the comparisons in natural-log units, ℓ·ln 2, as products rounded once.

use std::f64::consts::LN_2;

use super::select::{EXPLORED, PROMOTED, QUANTISED};

/// Per-block data of one query head's group, in block order.
#[derive(Clone, Copy, Debug)]
pub struct HeadView<'a> {
    pub quantised: &'a [bool],
    /// [`QUANTISED`], [`PROMOTED`] or [`EXPLORED`] (the selector's, or the ladder's).
    pub state: &'a [u8],
    pub tokens: &'a [usize],
    /// η of quantised blocks (unused for tail-tier blocks).
    pub eta: &'a [f64],
    /// Phase-1 log2 masses and key logit bounds Δ, phase-2 log2 masses, of this head.
    pub l1: &'a [f32],
    pub d1: &'a [f32],
    pub l2: &'a [f32],
}

/// What the head's step achieved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HeadChecks {
    pub delta: f64,
    pub alpha: f64,
    pub e_val: f64,
    pub tokens: usize,
    /// Score checks that failed.
    pub detections: usize,
    pub ranking: bool,
    pub boundary: usize,
    pub promoted: usize,
    pub explored: usize,
}

/// Normalised block masses from log2 masses.
pub fn masses(l: &[f32]) -> Vec<f64> {
    let mx = l.iter().map(|&x| x as f64).fold(f64::NEG_INFINITY, f64::max);
    let tot: f64 = l.iter().map(|&x| (x as f64 - mx).exp2()).sum();
    l.iter().map(|&x| (x as f64 - mx).exp2() / tot).collect()
}

/// IEEE total order of an f32 as an unsigned key (`f32::total_cmp`'s order).
pub fn total_order_key(x: f32) -> u32 {
    let s = x.to_bits() as i32;
    ((s ^ (((s >> 31) as u32) >> 1) as i32) as u32) ^ 0x8000_0000
}

/// The first `r` blocks of `set` by `value` descending (total order), then index ascending.
fn top(set: &[usize], value: &[f32], r: usize) -> Vec<usize> {
    let mut v = set.to_vec();
    v.sort_by(|&a, &b| total_order_key(value[b]).cmp(&total_order_key(value[a])).then(a.cmp(&b)));
    v.truncate(r);
    v
}

/// The head's checks and tail quantities; `rank_depth` 0 skips ranking and boundary.
pub fn head_checks(v: &HeadView, guard: f64, rank_depth: usize) -> HeadChecks {
    let rho = masses(v.l2);
    let mut c = HeadChecks { tokens: v.tokens.iter().sum(), ..HeadChecks::default() };
    let mut exact = Vec::new();
    for i in 0..v.quantised.len() {
        if !v.quantised[i] {
            exact.push(i);
            continue;
        }
        match v.state[i] {
            QUANTISED => {
                c.alpha += rho[i];
                c.delta = c.delta.max(v.d1[i] as f64);
                c.e_val += rho[i] * v.eta[i];
            }
            s => {
                c.promoted += usize::from(s == PROMOTED);
                c.explored += usize::from(s == EXPLORED);
                let (a, b) = (v.l1[i] as f64 * LN_2, v.l2[i] as f64 * LN_2);
                if !((a - b).abs() <= v.d1[i] as f64 + guard) {
                    c.detections += 1;
                }
                exact.push(i);
            }
        }
    }
    if rank_depth > 0 {
        exact.sort_unstable();
        let by2 = top(&exact, v.l2, rank_depth);
        let nat = |i: usize| v.l2[i] as f64 * LN_2;
        c.ranking = by2.iter().zip(top(&exact, v.l1, rank_depth)).any(|(&b, a)| nat(a) < nat(b) - guard);
        let lr = if by2.len() == rank_depth { v.l2[by2[rank_depth - 1]] as f64 * LN_2 } else { f64::NEG_INFINITY };
        c.boundary = (0..v.quantised.len()).filter(|&i| v.quantised[i] && v.state[i] == QUANTISED && v.l1[i] as f64 * LN_2 + v.d1[i] as f64 > lr).count();
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Case {
        quantised: Vec<bool>,
        state: Vec<u8>,
        tokens: Vec<usize>,
        eta: Vec<f64>,
        l1: Vec<f32>,
        d1: Vec<f32>,
        l2: Vec<f32>,
    }

    impl Case {
        fn view(&self) -> HeadView<'_> {
            HeadView { quantised: &self.quantised, state: &self.state, tokens: &self.tokens, eta: &self.eta, l1: &self.l1, d1: &self.d1, l2: &self.l2 }
        }
    }

    /// Blocks 0..3 quantised (0 promoted, 1 explored), block 4 the exact tail block.
    fn case() -> Case {
        Case {
            quantised: vec![true, true, true, true, false],
            state: vec![PROMOTED, EXPLORED, QUANTISED, QUANTISED, QUANTISED],
            tokens: vec![64, 64, 64, 64, 5],
            eta: vec![0.1, 0.2, 0.3, 0.4, 0.0],
            l1: vec![4.0, 1.0, 0.0, 0.0, 2.0],
            d1: vec![0.01, 0.01, 0.02, 0.03, 0.0],
            l2: vec![4.001, 1.0, 0.0, 1.0, 2.0],
        }
    }

    #[test]
    fn tail_quantities_and_counts() {
        let k = case();
        let c = head_checks(&k.view(), 1e-3, 1);
        let rho = masses(&k.l2);
        assert!((c.alpha - (rho[2] + rho[3])).abs() < 1e-15);
        assert!((c.e_val - (0.3 * rho[2] + 0.4 * rho[3])).abs() < 1e-15);
        assert_eq!(c.delta, 0.03f32 as f64);
        assert_eq!((c.tokens, c.promoted, c.explored, c.detections), (261, 1, 1, 0));
        assert!(!c.ranking);
        assert_eq!(c.boundary, 0);
    }

    #[test]
    fn score_check_counts_pages_outside_delta() {
        let mut k = case();
        k.l2[0] = 4.1; // 0.1 · ln 2 ≈ 0.069 > 0.01 + 0.001
        assert_eq!(head_checks(&k.view(), 1e-3, 1).detections, 1);
        k.l2[1] = f32::NAN;
        assert_eq!(head_checks(&k.view(), 1e-3, 1).detections, 2);
    }

    #[test]
    fn ranking_compares_the_exact_sets_top_r() {
        let mut k = case();
        // Phase 2 lifts the tail page above page 0: the top-1 differs by (5 − 4.001)·ln 2.
        k.l2[4] = 5.0;
        let c = head_checks(&k.view(), 1e-3, 1);
        assert!(c.ranking);
        // Depth 2: orders (4, 0) vs (0, 4).
        assert!(head_checks(&k.view(), 1e-3, 2).ranking);
        // A swap within ε_guard is not a disagreement.
        assert!(!head_checks(&k.view(), 1.0, 2).ranking);
        // Exact ties: ℓ¹ puts page 4 first, ℓ² ranks page 0 first by index; same exact mass.
        let mut k = case();
        k.l1[4] = 4.5;
        k.l2[0] = 4.0;
        k.l2[4] = 4.0;
        assert!(!head_checks(&k.view(), 1e-3, 1).ranking);
        k.l2[4] = 3.99;
        assert!(head_checks(&k.view(), 1e-3, 1).ranking);
        assert!(!head_checks(&k.view(), 1e-3, 0).ranking);
    }

    #[test]
    fn boundary_counts_tail_pages_that_could_enter_the_top_r() {
        let mut k = case();
        // r = 3: exact set {0: 4.001, 1: 1, 4: 2} → ℓ_(3) = 1 · ln 2; page 3 (ℓ¹ 0 + 0.03)
        // stays below, unless its Δ reaches ln 2.
        assert_eq!(head_checks(&k.view(), 1.0, 3).boundary, 0);
        k.d1[3] = 0.7;
        assert_eq!(head_checks(&k.view(), 1.0, 3).boundary, 1);
        // r larger than the exact set: ℓ_(r) = −∞, every tail page counts.
        assert_eq!(head_checks(&k.view(), 1.0, 4).boundary, 2);
        assert_eq!(head_checks(&k.view(), 1.0, 0).boundary, 0);
    }

    #[test]
    fn total_order_matches_total_cmp() {
        let xs = [f32::NEG_INFINITY, -1.0, -0.0, 0.0, 1e-30, 1.0, f32::INFINITY, f32::NAN, -f32::NAN];
        for a in xs {
            for b in xs {
                assert_eq!(total_order_key(a).cmp(&total_order_key(b)), a.total_cmp(&b), "{a} {b}");
            }
        }
    }
}
