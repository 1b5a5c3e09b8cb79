//! Bit allocation by dynamic programming (kvtc App. B.17): over the PCA coordinates in order of
//! explained variance, choose a partition into groups of consecutive coordinates, each of an
//! allowed size ({1, 16, 64, 256, 1024} by default) with a bit width (0 = dropped, free), that
//! minimises the squared error in the decorrelated domain (equal to the error after the
//! orthonormal inverse projection, kvtc eq. 5) under a budget of bits per token counting the
//! codes and each group's 16-bit shift and scale.
//!
//! `best[i][b]` is the least error change of the first `i` coordinates with at most `b` bits
//! (coordinates past `i` dropped). `best[0][·] = 0` and
//! `best[i][b] = min(best[i-1][b], min_{size, bits} E(i, size, bits) + best[i-size][b - cost])`
//! where `E` is the error of quantising coordinates `i-size..i` minus their energy (what
//! dropping them costs). Optimality follows by induction on `i` (B.17's proof sketch); the
//! test below checks it against exhaustive search. One table serves every budget up to the
//! largest, so one run gives the allocations of all compression ratios.

use rayon::prelude::*;

use crate::quant::{add_group_errors, group_sq_error, GROUP_OVERHEAD_BITS, MAX_BITS};

/// Group sizes and bit widths the DP may use.
#[derive(Clone, Debug, PartialEq)]
pub struct DpConfig {
    /// Allowed group sizes, ascending (the paper: 1, 16, 64, 256, 1024).
    pub group_sizes: Vec<usize>,
    /// Allowed non-zero bit widths (≤ 16), ascending.
    pub bit_widths: Vec<u8>,
}

impl Default for DpConfig {
    fn default() -> Self {
        Self { group_sizes: vec![1, 16, 64, 256, 1024], bit_widths: vec![1, 2, 3, 4, 5, 6, 7, 8] }
    }
}

/// One group of consecutive PCA coordinates `start..start+len` coded with `bits` bits each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    pub start: u32,
    pub len: u32,
    pub bits: u8,
}

impl Group {
    /// Bits this group costs per token (codes plus fp16 shift and scale).
    pub fn cost_bits(&self) -> u64 {
        self.len as u64 * self.bits as u64 + GROUP_OVERHEAD_BITS as u64
    }
}

/// The groups chosen for one budget (coordinates not in any group are dropped).
#[derive(Clone, Debug, PartialEq)]
pub struct Allocation {
    /// The budget in bits per token this allocation was solved for.
    pub budget_bits: u32,
    /// Groups in coordinate order, non-overlapping, all with `bits > 0`.
    pub groups: Vec<Group>,
    /// Expected squared error per token on the calibration rows (decorrelated domain).
    pub expected_error: f64,
}

impl Allocation {
    /// Bits per token actually used (≤ `budget_bits`).
    pub fn cost_bits(&self) -> u64 {
        self.groups.iter().map(Group::cost_bits).sum()
    }

    /// Coordinates the restore needs (one past the last coded one).
    pub fn used_components(&self) -> usize {
        self.groups.last().map_or(0, |g| (g.start + g.len) as usize)
    }

    /// Checks the groups are in order, non-overlapping, within `components`, and fit the budget.
    pub fn validate(&self, components: usize, cfg_max_bits: u8) -> Result<(), String> {
        let mut next = 0u64;
        for g in &self.groups {
            if g.len == 0 || g.bits == 0 || g.bits > cfg_max_bits.min(MAX_BITS) {
                return Err(format!("group at {} has len {} bits {}", g.start, g.len, g.bits));
            }
            if (g.start as u64) < next {
                return Err(format!("group at {} overlaps the previous one", g.start));
            }
            next = g.start as u64 + g.len as u64;
        }
        if next as usize > components {
            return Err(format!("groups reach component {next}, the basis has {components}"));
        }
        if self.cost_bits() > self.budget_bits as u64 {
            return Err(format!("groups cost {} bits, over the budget of {}", self.cost_bits(), self.budget_bits));
        }
        Ok(())
    }
}

/// The solved tables for budgets `0..=max_budget`.
pub struct Dp {
    comps: usize,
    max_budget: usize,
    cfg: DpConfig,
    /// Energy per token of all coordinates (the error with nothing coded).
    energy: f64,
    /// `best[comps][b]`.
    last: Vec<f64>,
    /// Choice at `(i, b)`: 0 = drop coordinate i-1, else 1 + size_index·nbits + bits_index.
    choice: Vec<u8>,
}

/// Which of the calibration rows the DP measures a group of each size on. A group's expected
/// error is a mean over rows × its coordinates, so a large group needs fewer rows for the same
/// number of samples, and measuring a group of 1024 on every row at every start costs 64× a
/// group of 16: groups larger than `above` are measured on every `stride`-th row, about
/// `rows · above / size` of them but at least `min_rows` (all rows when fewer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowThinning {
    pub above: usize,
    pub min_rows: usize,
}

impl RowThinning {
    /// Every row for every group size.
    pub const NONE: Self = Self { above: usize::MAX, min_rows: usize::MAX };
    /// What calibration uses: every group gets at least `16 · rows` samples (all rows for
    /// groups ≤ 16) and at least 16 rows.
    pub const CALIBRATION: Self = Self { above: 16, min_rows: 16 };

    /// Step between the rows a group of `size` is measured on.
    pub fn stride(&self, rows: usize, size: usize) -> usize {
        if size <= self.above || rows <= self.min_rows {
            return 1;
        }
        let want = (rows * self.above).div_ceil(size).max(self.min_rows).min(rows);
        (rows / want).max(1)
    }
}

impl Dp {
    /// Solves the DP on `rows` calibration rows of `comps` decorrelated coordinates
    /// (`data[row * comps + j]`), for every budget up to `max_budget` bits per token. No group
    /// crosses a coordinate of `breaks` (the first coordinates of a block-diagonal basis's
    /// blocks: a group's codes share one shift and scale and the restore reads each block's
    /// coefficients apart).
    pub fn solve(data: &[f64], rows: usize, comps: usize, cfg: &DpConfig, max_budget: usize, breaks: &[usize]) -> Self {
        Self::solve_thinned(data, rows, comps, cfg, max_budget, breaks, RowThinning::NONE)
    }

    /// [`Dp::solve`] with each group size measured on the rows `thin` gives it (the error
    /// tables are then means over those rows; [`allocation_error_thinned`] is the same measure).
    pub fn solve_thinned(data: &[f64], rows: usize, comps: usize, cfg: &DpConfig, max_budget: usize, breaks: &[usize], thin: RowThinning) -> Self {
        assert_eq!(data.len(), rows * comps);
        assert!(cfg.group_sizes.len() * cfg.bit_widths.len() < 255);
        let (ns, nq) = (cfg.group_sizes.len(), cfg.bit_widths.len());
        let norm = 1.0 / rows.max(1) as f64;
        // col_prefix[j]: energy of coordinates 0..j summed over all rows
        let mut col_prefix = vec![0.0; comps + 1];
        for j in 0..comps {
            col_prefix[j + 1] = col_prefix[j] + (0..rows).map(|r| data[r * comps + j] * data[r * comps + j]).sum::<f64>();
        }
        // err[(i-1)*ns*nq + s*nq + q]: error change per token of coding coordinates i-size..i.
        let err: Vec<f64> = (1..=comps)
            .into_par_iter()
            .flat_map_iter(|i| {
                let mut out = vec![f64::INFINITY; ns * nq];
                for (si, &size) in cfg.group_sizes.iter().enumerate() {
                    if size > i || breaks.iter().any(|&b| i - size < b && b < i) {
                        continue;
                    }
                    let acc = &mut out[si * nq..(si + 1) * nq];
                    acc.fill(0.0);
                    let stride = thin.stride(rows, size);
                    for r in (0..rows).step_by(stride) {
                        add_group_errors(&data[r * comps + i - size..r * comps + i], &cfg.bit_widths, acc);
                    }
                    // the quantisation error from the measured rows, the energy it replaces from
                    // all rows (a noisy energy would let the DP pick groups by their sample)
                    let used = rows.div_ceil(stride).max(1) as f64;
                    let all_energy = (col_prefix[i] - col_prefix[i - size]) * norm;
                    acc.iter_mut().for_each(|e| *e = *e / used - all_energy);
                }
                out
            })
            .collect();
        let energy = data.iter().map(|x| x * x).sum::<f64>() * norm;
        let ring = cfg.group_sizes.iter().copied().max().unwrap_or(1) + 1;
        let width = max_budget + 1;
        let mut rows_ring: Vec<Vec<f64>> = vec![Vec::new(); ring];
        rows_ring[0] = vec![0.0; width];
        let mut choice = vec![0u8; (comps + 1) * width];
        for i in 1..=comps {
            let mut cur = vec![0.0; width];
            {
                let prev = &rows_ring[(i - 1) % ring];
                let e = &err[(i - 1) * ns * nq..i * ns * nq];
                let ch = &mut choice[i * width..(i + 1) * width];
                let rr = &rows_ring;
                cur.par_chunks_mut(1024).zip(ch.par_chunks_mut(1024)).enumerate().for_each(|(ci, (cv, cc))| {
                    for (k, (v, c)) in cv.iter_mut().zip(cc.iter_mut()).enumerate() {
                        let b = ci * 1024 + k;
                        let mut best = prev[b];
                        let mut pick = 0u8;
                        for (si, &size) in cfg.group_sizes.iter().enumerate() {
                            if size > i {
                                continue;
                            }
                            let from = &rr[(i - size) % ring];
                            for (qi, &bits) in cfg.bit_widths.iter().enumerate() {
                                let cost = size * bits as usize + GROUP_OVERHEAD_BITS as usize;
                                if cost > b {
                                    continue;
                                }
                                let cand = e[si * nq + qi] + from[b - cost]; // infinite across a break
                                if cand < best {
                                    best = cand;
                                    pick = 1 + (si * nq + qi) as u8;
                                }
                            }
                        }
                        *v = best;
                        *c = pick;
                    }
                });
            }
            rows_ring[i % ring] = cur;
        }
        let last = rows_ring[comps % ring].clone();
        Self { comps, max_budget, cfg: cfg.clone(), energy, last, choice }
    }

    /// Least expected squared error per token within `budget` bits.
    pub fn best_error(&self, budget: usize) -> f64 {
        self.energy + self.last[budget.min(self.max_budget)]
    }

    /// The optimal allocation for `budget` bits per token (≤ the solved maximum).
    pub fn allocation(&self, budget: usize) -> Allocation {
        let budget = budget.min(self.max_budget);
        let width = self.max_budget + 1;
        let nq = self.cfg.bit_widths.len();
        let (mut i, mut b) = (self.comps, budget);
        let mut groups = Vec::new();
        while i > 0 {
            let c = self.choice[i * width + b];
            if c == 0 {
                i -= 1;
                continue;
            }
            let k = (c - 1) as usize;
            let (size, bits) = (self.cfg.group_sizes[k / nq], self.cfg.bit_widths[k % nq]);
            groups.push(Group { start: (i - size) as u32, len: size as u32, bits });
            i -= size;
            b -= size * bits as usize + GROUP_OVERHEAD_BITS as usize;
        }
        groups.reverse();
        Allocation { budget_bits: budget as u32, groups, expected_error: self.best_error(budget) }
    }
}

/// Squared error per token of `alloc` on the rows (what [`Dp::solve`] minimises).
pub fn allocation_error(data: &[f64], rows: usize, comps: usize, alloc: &Allocation) -> f64 {
    allocation_error_thinned(data, rows, comps, alloc, RowThinning::NONE)
}

/// What [`Dp::solve_thinned`] minimises: the energy per token of the dropped coordinates (over
/// all rows) plus each group's quantisation error per token over the rows it is measured on.
pub fn allocation_error_thinned(data: &[f64], rows: usize, comps: usize, alloc: &Allocation, thin: RowThinning) -> f64 {
    let mut coded = vec![false; comps];
    let mut e = 0.0;
    for g in &alloc.groups {
        let s = g.start as usize..(g.start + g.len) as usize;
        s.clone().for_each(|j| coded[j] = true);
        let stride = thin.stride(rows, g.len as usize);
        let q: f64 = (0..rows).step_by(stride).map(|r| group_sq_error(&data[r * comps..(r + 1) * comps][s.clone()], g.bits)).sum();
        e += q / rows.div_ceil(stride).max(1) as f64;
    }
    let dropped: f64 = (0..rows).map(|r| data[r * comps..(r + 1) * comps].iter().zip(&coded).filter(|(_, &c)| !c).map(|(x, _)| x * x).sum::<f64>()).sum();
    e + dropped / rows.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn data(rows: usize, comps: usize, seed: u64) -> Vec<f64> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..rows * comps).map(|k| rng.gen_range(-1.0..1.0) * 8.0 / (1.0 + (k % comps) as f64)).collect()
    }

    /// Least error over every partition of the coordinates into dropped ones and groups of
    /// allowed sizes and widths, within `budget` bits.
    fn brute(data: &[f64], rows: usize, comps: usize, cfg: &DpConfig, budget: usize, thin: RowThinning) -> f64 {
        struct Ctx<'a> {
            d: &'a [f64],
            rows: usize,
            comps: usize,
            cfg: &'a DpConfig,
            thin: RowThinning,
        }
        fn go(i: usize, left: usize, groups: &mut Vec<Group>, c: &Ctx, best: &mut f64) {
            let (d, rows, comps, cfg) = (c.d, c.rows, c.comps, c.cfg);
            if i == comps {
                let a = Allocation { budget_bits: u32::MAX, groups: groups.clone(), expected_error: 0.0 };
                *best = best.min(allocation_error_thinned(d, rows, comps, &a, c.thin));
                return;
            }
            go(i + 1, left, groups, c, best);
            for &size in &cfg.group_sizes {
                for &bits in &cfg.bit_widths {
                    let cost = size * bits as usize + GROUP_OVERHEAD_BITS as usize;
                    if i + size <= comps && cost <= left {
                        groups.push(Group { start: i as u32, len: size as u32, bits });
                        go(i + size, left - cost, groups, c, best);
                        groups.pop();
                    }
                }
            }
        }
        let mut best = f64::INFINITY;
        go(0, budget, &mut Vec::new(), &Ctx { d: data, rows, comps, cfg, thin }, &mut best);
        best
    }

    #[test]
    fn dp_is_optimal_against_exhaustive_search() {
        let cfg = DpConfig { group_sizes: vec![1, 2, 4], bit_widths: vec![1, 2, 4] };
        // every row, then groups of 2 on every 2nd of 8 rows and of 4 on every 4th
        let thinned = RowThinning { above: 1, min_rows: 2 };
        assert_eq!((thinned.stride(8, 1), thinned.stride(8, 2), thinned.stride(8, 4)), (1, 2, 4));
        for (seed, rows, thin) in [(0, 5, RowThinning::NONE), (1, 5, RowThinning::NONE), (2, 5, RowThinning::NONE), (3, 8, thinned), (4, 8, thinned)] {
            let comps = 6;
            let d = data(rows, comps, seed);
            let max_b = 6 * 4 + 3 * 32;
            let dp = Dp::solve_thinned(&d, rows, comps, &cfg, max_b, &[], thin);
            for budget in (0..=max_b).step_by(3) {
                let want = brute(&d, rows, comps, &cfg, budget, thin);
                let got = dp.best_error(budget);
                assert!((want - got).abs() <= 1e-9 * want.max(1.0), "seed {seed} budget {budget}: dp {got} brute {want}");
                assert!(got >= -1e-9, "an expected error below zero: {got}");
                let a = dp.allocation(budget);
                a.validate(comps, 16).unwrap();
                assert!(a.cost_bits() <= budget as u64);
                let e = allocation_error_thinned(&d, rows, comps, &a, thin);
                assert!((e - got).abs() <= 1e-9 * got.max(1.0), "backtracked allocation error {e} vs table {got}");
            }
        }
        // calibration's thinning: groups ≤ 16 on every row, 1024 on 16 of 256 rows, never fewer than 16
        let c = RowThinning::CALIBRATION;
        assert_eq!((c.stride(256, 16), c.stride(256, 64), c.stride(256, 1024), c.stride(64, 1024), c.stride(12, 1024)), (1, 4, 16, 4, 1));
    }

    #[test]
    fn budget_is_exact_and_error_falls_with_budget() {
        let (rows, comps) = (16, 40);
        let d = data(rows, comps, 7);
        let cfg = DpConfig { group_sizes: vec![1, 16], bit_widths: vec![1, 2, 3, 4, 8] };
        let dp = Dp::solve(&d, rows, comps, &cfg, 400, &[]);
        let mut prev = f64::INFINITY;
        for budget in [0, 33, 48, 100, 200, 400] {
            let a = dp.allocation(budget);
            a.validate(comps, 16).unwrap();
            assert!(a.cost_bits() <= budget as u64, "{} > {budget}", a.cost_bits());
            assert!(a.expected_error <= prev);
            prev = a.expected_error;
        }
        assert!(dp.allocation(0).groups.is_empty());
        // with the big budget the high-variance leading coordinates get the most bits
        let a = dp.allocation(400);
        assert_eq!(a.groups[0].start, 0);
    }
}
