//! The selector of one (sequence, kv head) group: which quantised blocks phase 2 reads from
//! their fp16 originals. This is the reference the device selector (`cert_select` in
//! `templates/include/kvforge/certify.cuh`) reproduces **bit for bit**, so the rule is stated
//! in exact arithmetic:
//!
//! 1. **Weights.** Per query head h, M_h = the largest finite phase-1 log2 mass of the group;
//!    a block's weight is W = ⌊2^(ℓ − M_h) · 2³²⌋ ([`block_weight`]: a fixed polynomial with
//!    fused multiply-adds, only correctly rounded operations, so both sides compute the same
//!    u64). A non-finite ℓ (NaN, +∞: corrupt scores) weighs the most, so it is promoted and its
//!    score check fails; −∞ weighs 0.
//! 2. **Order.** Quantised blocks by key = max_h ⌊W_h · 2³¹ / T_h⌋ (T_h = Σ_blocks W_h, the
//!    block's largest normalised share) descending, then block index ascending: a total order.
//! 3. **K\*.** The least k whose first k blocks, with the tail-tier (exact) blocks, give every
//!    head C_h ≥ τ_cov · T_h (u64 sums, compared in f64: both exact below 2⁵³), clamped to
//!    [K_min, K_max] and to the quantised blocks.
//! 4. **Exploration.** c = min(⌈explore · quantised⌉, unpromoted) of the unpromoted quantised
//!    blocks, by systematic sampling with a random start: with rank ρ among them (block order),
//!    t of them and s = hash mod t, block ρ is explored iff ⌊(ρc + s)/t⌋ ≠ ⌊((ρ+1)c + s)/t⌋.
//!    Exactly c blocks, each with probability c/t, from integer arithmetic a GPU thread per block
//!    computes after one prefix count.
//!
//! Integer weights make every sum independent of its order, so a parallel reduction and this
//! sequential loop agree exactly; only ties below 2⁻³¹ of a head's mass resolve by index.

/// The exploration count (⌈frac · blocks⌉, at most the tail) and the SplitMix64 finaliser, the
/// counter hash `certify.cuh` uses too: the reference ladder's own, so the two cannot drift.
pub use kvforge_ref::certified::select::{explore_count, splitmix64};

/// Fixed-point bits of a block weight (the heaviest block of a head weighs 2^WEIGHT_BITS).
pub const WEIGHT_BITS: i32 = 32;
/// Heaviest weight: ℓ = M_h, or a non-finite ℓ.
pub const MAX_WEIGHT: u64 = 1 << WEIGHT_BITS;

/// Taylor coefficients (ln 2)^k / k!, k = 0..=12, as bit patterns: the ones the certificate
/// kernel is compiled with (kvforge-gen params.rs).
pub use crate::params::EXP2_COEFFS;

/// 2^f for f ∈ [0, 1): Horner with fused multiply-adds (relative error < 10⁻¹²).
pub fn exp2_unit(f: f64) -> f64 {
    EXP2_COEFFS[..12].iter().rev().fold(f64::from_bits(EXP2_COEFFS[12]), |r, &c| r.mul_add(f, f64::from_bits(c)))
}

/// W = ⌊2^(ℓ − m) · 2^WEIGHT_BITS⌋ for a block of log2 mass `l` under head maximum `m` (the
/// largest finite ℓ of the head, so ℓ − m ≤ 0 for finite ℓ).
pub fn block_weight(l: f32, m: f32) -> u64 {
    if l.is_nan() || l == f32::INFINITY {
        return MAX_WEIGHT;
    }
    if l == f32::NEG_INFINITY {
        return 0;
    }
    let x = l as f64 - m as f64;
    if !(x >= -(WEIGHT_BITS as f64 + 1.0)) {
        return 0;
    }
    let n = x.floor();
    let scale = f64::from_bits(((1023 + WEIGHT_BITS + n as i32) as u64) << 52);
    (exp2_unit(x - n) * scale).floor() as u64
}

/// Selector settings of one group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectParams {
    pub coverage: f64,
    pub min_blocks: usize,
    pub max_blocks: usize,
    pub explore: f64,
    /// The group's hashed exploration seed ([`group_seed`]).
    pub seed: u64,
}

/// Block states, as the device writes them.
pub const QUANTISED: u8 = crate::params::PAGE_QUANTISED;
pub const PROMOTED: u8 = crate::params::PAGE_PROMOTED;
pub const EXPLORED: u8 = crate::params::PAGE_EXPLORED;

/// Exploration seed of group `g` (sequence-major, then kv head) in a step seeded `seed`.
pub fn group_seed(seed: u64, g: usize) -> u64 {
    splitmix64(seed ^ splitmix64(g as u64))
}

/// Selection of one group: per block [`QUANTISED`], [`PROMOTED`] or [`EXPLORED`] (tail-tier
/// blocks are [`QUANTISED`]: they need nothing), and K\* after clamping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    pub state: Vec<u8>,
    pub k: usize,
}

/// Runs the selector on one group: `quantised[i]` says block i is in a quantised tier,
/// `lse[i * gqa + h]` is its phase-1 log2 mass for query head h.
pub fn select_blocks(quantised: &[bool], lse: &[f32], gqa: usize, p: &SelectParams) -> Selection {
    let n = quantised.len();
    let mut m = vec![f32::NEG_INFINITY; gqa];
    for (i, l) in lse.iter().enumerate() {
        if l.is_finite() {
            m[i % gqa] = m[i % gqa].max(*l);
        }
    }
    let w = |i: usize, h: usize| block_weight(lse[i * gqa + h], m[h]);
    let (mut total, mut covered) = (vec![0u64; gqa], vec![0u64; gqa]);
    for i in 0..n {
        for h in 0..gqa {
            total[h] += w(i, h);
            if !quantised[i] {
                covered[h] += w(i, h);
            }
        }
    }
    let key = |i: usize| (0..gqa).map(|h| (w(i, h) << 31).checked_div(total[h]).unwrap_or(0)).max().unwrap_or(0);
    let mut order: Vec<(u64, usize)> = (0..n).filter(|&i| quantised[i]).map(|i| (key(i), i)).collect();
    order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let done = |c: &[u64]| c.iter().zip(&total).all(|(&c, &t)| c as f64 >= p.coverage * t as f64);
    let mut k_cov = 0;
    while !done(&covered) && k_cov < order.len() {
        let i = order[k_cov].1;
        (0..gqa).for_each(|h| covered[h] += w(i, h));
        k_cov += 1;
    }
    let nq = order.len();
    let k = k_cov.max(p.min_blocks).min(p.max_blocks).min(nq);
    let mut state = vec![QUANTISED; n];
    order[..k].iter().for_each(|&(_, i)| state[i] = PROMOTED);
    let rest: Vec<usize> = (0..n).filter(|&i| quantised[i] && state[i] == QUANTISED).collect();
    let c = explore_count(p.explore, nq, rest.len()) as u64;
    if c > 0 {
        let (t, s) = (rest.len() as u64, p.seed % rest.len() as u64);
        for (r, &i) in rest.iter().enumerate() {
            let r = r as u64;
            if (r * c + s) / t != ((r + 1) * c + s) / t {
                state[i] = EXPLORED;
            }
        }
    }
    Selection { state, k }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn params(coverage: f64, min_blocks: usize, max_blocks: usize, explore: f64) -> SelectParams {
        SelectParams { coverage, min_blocks, max_blocks, explore, seed: 12345 }
    }

    #[test]
    fn exp2_unit_is_accurate() {
        for i in 0..=4096 {
            let f = i as f64 / 4097.0;
            let rel = (exp2_unit(f) / f.exp2() - 1.0).abs();
            assert!(rel < 1e-12, "2^{f}: {rel}");
        }
        assert_eq!(exp2_unit(0.0), 1.0);
    }

    #[test]
    fn coefficients_are_the_taylor_series_of_2_to_the_f() {
        let mut fact = 1.0f64;
        for (k, &c) in EXP2_COEFFS.iter().enumerate() {
            if k > 0 {
                fact *= k as f64;
            }
            let want = std::f64::consts::LN_2.powi(k as i32) / fact;
            assert!((f64::from_bits(c) / want - 1.0).abs() < 1e-14, "c{k}");
        }
    }

    #[test]
    fn weights() {
        assert_eq!(block_weight(3.0, 3.0), MAX_WEIGHT);
        assert_eq!(block_weight(2.0, 3.0), MAX_WEIGHT / 2);
        assert_eq!(block_weight(-10.0, 0.0), MAX_WEIGHT >> 10);
        assert_eq!(block_weight(f32::NAN, 0.0), MAX_WEIGHT);
        assert_eq!(block_weight(f32::INFINITY, 0.0), MAX_WEIGHT);
        assert_eq!(block_weight(f32::NEG_INFINITY, 0.0), 0);
        assert_eq!(block_weight(-33.5, 0.0), 0);
        assert_eq!(block_weight(-32.5, 0.0), 0);
        assert_eq!(block_weight(-31.0, 0.0), 2);
        let w = block_weight(-0.5, 0.0) as f64 / MAX_WEIGHT as f64;
        assert!((w - (-0.5f64).exp2()).abs() < 1e-9);
    }

    #[test]
    fn coverage_clamp_and_tail_pages() {
        // One head; masses 8:4:2:1:1 (log2 3, 2, 1, 0, 0); page 4 is the exact tail page.
        let q = [true, true, true, true, false];
        let l = [3.0f32, 2.0, 1.0, 0.0, 0.0];
        let sel = |cov, lo, hi| select_blocks(&q, &l, 1, &params(cov, lo, hi, 0.0));
        // Tail page 1/16 + 8/16 + 4/16 = 13/16 ≥ 0.8.
        assert_eq!(sel(0.8, 0, 99).k, 2);
        assert_eq!(sel(0.8, 0, 99).state, vec![PROMOTED, PROMOTED, QUANTISED, QUANTISED, QUANTISED]);
        assert_eq!(sel(0.9, 0, 99).k, 3);
        assert_eq!(sel(1.0, 0, 99).k, 4);
        assert_eq!(sel(0.9, 0, 1).k, 1);
        assert_eq!(sel(0.01, 3, 99).k, 3);
        assert_eq!(sel(0.05, 0, 99).k, 0);
        assert_eq!(sel(0.9, 9, 99).k, 4);
    }

    #[test]
    fn every_head_is_covered() {
        // Head 0 wants page 0, head 1 page 3: both must be promoted.
        let q = [true; 4];
        let l = [10.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 10.0];
        let s = select_blocks(&q, &l, 2, &params(0.99, 0, 99, 0.0));
        assert_eq!(s.state, vec![PROMOTED, QUANTISED, QUANTISED, PROMOTED]);
    }

    #[test]
    fn ties_go_to_the_lower_index_and_non_finite_masses_first() {
        let q = [true; 4];
        let s = select_blocks(&q, &[1.0, 2.0, 1.0, 2.0], 1, &params(0.0, 3, 3, 0.0));
        assert_eq!(s.state, vec![PROMOTED, PROMOTED, QUANTISED, PROMOTED]);
        let s = select_blocks(&q, &[1.0, f32::NAN, 5.0, 2.0], 1, &params(0.0, 1, 1, 0.0));
        assert_eq!(s.state, vec![QUANTISED, PROMOTED, QUANTISED, QUANTISED]);
    }

    #[test]
    fn exploration_is_an_exact_count_of_unpromoted_pages() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for _ in 0..500 {
            let n = rng.gen_range(1..300);
            let q: Vec<bool> = (0..n).map(|_| rng.gen_bool(0.9)).collect();
            let l: Vec<f32> = (0..n).map(|_| rng.gen_range(-5.0f32..5.0)).collect();
            let frac = [0.0, 0.02, 0.3, 1.0][rng.gen_range(0..4)];
            let p = SelectParams { coverage: rng.gen_range(0.5..1.0), min_blocks: 1, max_blocks: rng.gen_range(1..400), explore: frac, seed: rng.gen() };
            let s = select_blocks(&q, &l, 1, &p);
            let nq = q.iter().filter(|&&x| x).count();
            let explored = s.state.iter().filter(|&&x| x == EXPLORED).count();
            assert_eq!(explored, explore_count(frac, nq, nq - s.k));
            assert_eq!(s.state.iter().filter(|&&x| x == PROMOTED).count(), s.k);
            assert!((0..n).all(|i| q[i] || s.state[i] == QUANTISED));
        }
    }

    #[test]
    fn exploration_moves_with_the_seed_and_reaches_every_page() {
        let q = vec![true; 50];
        let l = vec![0.0f32; 50];
        let mut seen = vec![false; 50];
        for seed in 0..1000 {
            let s = select_blocks(&q, &l, 1, &SelectParams { coverage: 0.0, min_blocks: 0, max_blocks: 0, explore: 0.02, seed: group_seed(seed, 0) });
            assert_eq!(s.state.iter().filter(|&&x| x == EXPLORED).count(), 1);
            s.state.iter().enumerate().filter(|(_, &x)| x == EXPLORED).for_each(|(i, _)| seen[i] = true);
        }
        assert!(seen.iter().all(|&x| x), "{seen:?}");
    }
}
