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
//!
//! **Coded allocations** ([`DpConfig::coded`]): the budget counts a group's codes at their
//! estimated entropy-coded size instead of their width (the container coder `rans`,
//! [`crate::model`]), measured per candidate on the DP rows ([`crate::model::bits_per_code`]),
//! in units of `1 / CODED_UNITS` bit; each width may also use the min/max range
//! ([`crate::quant::Fit::MinMax`]), whose peaked codes cost well under their width. The DP then
//! trades width, range and coded size directly, as entropy-constrained quantisation does, and
//! each group of the result carries its code distribution (the coder's model).

use rayon::prelude::*;

use crate::model::{bits_per_code, quantised_model, MAX_CODED_BITS};
use crate::quant::{add_group_errors, add_group_stats, group_sq_error_with, Fit, GROUP_OVERHEAD_BITS, MAX_BITS};

/// Cost units per bit of a coded DP (estimated coded sizes are fractional).
pub const CODED_UNITS: usize = 2;

/// Group sizes and bit widths the DP may use.
#[derive(Clone, Debug, PartialEq)]
pub struct DpConfig {
    /// Allowed group sizes, ascending (the paper: 1, 16, 64, 256, 1024).
    pub group_sizes: Vec<usize>,
    /// Allowed non-zero bit widths (≤ 16), ascending.
    pub bit_widths: Vec<u8>,
    /// Budget the estimated entropy-coded size (container coder `rans`) instead of the packed
    /// width, and let widths ≥ 2 use the min/max range too (module docs). Widths above
    /// [`MAX_CODED_BITS`] are not used.
    pub coded: bool,
}

impl Default for DpConfig {
    fn default() -> Self {
        Self { group_sizes: vec![1, 16, 64, 256, 1024], bit_widths: vec![1, 2, 3, 4, 5, 6, 7, 8], coded: false }
    }
}

impl DpConfig {
    /// The (width, range) candidates of a group.
    fn candidates(&self) -> Vec<(u8, Fit)> {
        let mut c = Vec::new();
        for &b in &self.bit_widths {
            if self.coded && b > MAX_CODED_BITS {
                continue;
            }
            c.push((b, Fit::Clip));
            if self.coded && b >= 2 {
                c.push((b, Fit::MinMax));
            }
        }
        c
    }

    /// Cost units per bit of this DP's budgets.
    pub fn units(&self) -> usize {
        if self.coded {
            CODED_UNITS
        } else {
            1
        }
    }
}

/// One group of consecutive PCA coordinates `start..start+len` coded with `bits` bits each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    pub start: u32,
    pub len: u32,
    pub bits: u8,
    /// How the encoder chooses each token's range.
    pub fit: Fit,
}

impl Group {
    /// A group with the least-error range ([`Fit::Clip`]).
    pub fn new(start: u32, len: u32, bits: u8) -> Self {
        Self { start, len, bits, fit: Fit::Clip }
    }

    /// Bits this group costs per token (codes plus fp16 shift and scale).
    pub fn cost_bits(&self) -> u64 {
        self.len as u64 * self.bits as u64 + GROUP_OVERHEAD_BITS as u64
    }
}

/// The groups chosen for one budget (coordinates not in any group are dropped).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Allocation {
    /// The budget in bits per token this allocation was solved for.
    pub budget_bits: u32,
    /// Groups in coordinate order, non-overlapping, all with `bits > 0`.
    pub groups: Vec<Group>,
    /// Expected squared error per token on the calibration rows (decorrelated domain).
    pub expected_error: f64,
    /// A coded allocation's per-group code distributions ([`crate::model`], `2^bits`
    /// fixed-point probabilities pooled over the group, or `len · 2^bits`, one model per
    /// coordinate; group order); empty for a fixed-width one.
    pub models: Vec<Vec<u32>>,
    /// The step `Δ` of its [`Fit::Step`] groups ([`crate::step`]; 0 when it has none).
    pub step: f32,
    /// The encoder's dead zone for its [`Fit::Step`] groups ([`crate::quant::step_code`]; 0:
    /// round to nearest). Only the encoder reads it.
    pub dead_zone: f32,
}

impl Allocation {
    /// Bits per token actually used (≤ `budget_bits`).
    pub fn cost_bits(&self) -> u64 {
        self.groups.iter().map(Group::cost_bits).sum()
    }

    /// Whether the groups carry models (the budget counts estimated coded bits).
    pub fn coded(&self) -> bool {
        !self.models.is_empty()
    }

    /// Whether the `rans` coder can code chunks of this allocation: every group has a model
    /// (an allocation with no groups trivially).
    pub fn codable(&self) -> bool {
        self.models.len() == self.groups.len()
    }

    /// Expected entropy-coded bits per token of a coded allocation (codes at their models'
    /// entropy, plus each group's fp16 shift and scale).
    pub fn expected_coded_bits(&self) -> f64 {
        self.groups.iter().zip(&self.models).map(|(g, m)| if crate::model::stores_scales(g) { GROUP_OVERHEAD_BITS as f64 } else { 0.0 } + crate::model::group_bits(g, m)).sum()
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
        if self.coded() {
            if self.models.len() != self.groups.len() {
                return Err(format!("{} models for {} groups", self.models.len(), self.groups.len()));
            }
            for (g, m) in self.groups.iter().zip(&self.models) {
                crate::model::check_model(m, g).map_err(|e| format!("group at {}: {e}", g.start))?;
                if g.fit == Fit::Step && !(self.step > 0.0 && self.step.is_finite()) {
                    return Err(format!("a step group at {} with step {}", g.start, self.step));
                }
            }
            // the DP budgets the estimate on its rows; the models are measured on all rows
            let e = self.expected_coded_bits();
            if e > 1.1 * self.budget_bits as f64 + 64.0 {
                return Err(format!("groups are expected to cost {e:.0} coded bits, over the budget of {}", self.budget_bits));
            }
            return Ok(());
        }
        if self.groups.iter().any(|g| g.fit != Fit::Clip) {
            return Err("a min/max range in an allocation without models".into());
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
    /// Largest budget in cost units ([`DpConfig::units`] per bit).
    max_units: usize,
    cfg: DpConfig,
    cands: Vec<(u8, Fit)>,
    /// Energy per token of all coordinates (the error with nothing coded).
    energy: f64,
    /// `best[comps][b]`.
    last: Vec<f64>,
    /// Choice at `(i, b)`: 0 = drop coordinate i-1, else 1 + size_index·cands + candidate.
    choice: Vec<u8>,
    /// Cost in units of the candidate group ending at `i` (`(i-1)·sizes·cands + ...`).
    cost: Vec<u32>,
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
        let cands = cfg.candidates();
        let (ns, nc) = (cfg.group_sizes.len(), cands.len());
        assert!(ns * nc < 255);
        let units = cfg.units();
        let norm = 1.0 / rows.max(1) as f64;
        // col_prefix[j]: energy of coordinates 0..j summed over all rows
        let mut col_prefix = vec![0.0; comps + 1];
        for j in 0..comps {
            col_prefix[j + 1] = col_prefix[j] + (0..rows).map(|r| data[r * comps + j] * data[r * comps + j]).sum::<f64>();
        }
        let widths: Vec<u8> = cands.iter().map(|c| c.0).collect();
        // per candidate group ending at i: (error change per token, cost in units)
        let table: Vec<(f64, u32)> = (1..=comps)
            .into_par_iter()
            .flat_map_iter(|i| {
                let mut out = vec![(f64::INFINITY, u32::MAX); ns * nc];
                for (si, &size) in cfg.group_sizes.iter().enumerate() {
                    if size > i || breaks.iter().any(|&b| i - size < b && b < i) {
                        continue;
                    }
                    let mut acc = vec![0.0; nc];
                    let mut hists: Vec<Vec<u32>> = if cfg.coded { cands.iter().map(|c| vec![0; 1 << c.0]).collect() } else { Vec::new() };
                    let stride = thin.stride(rows, size);
                    for r in (0..rows).step_by(stride) {
                        let xs = &data[r * comps + i - size..r * comps + i];
                        if cfg.coded {
                            add_group_stats(xs, &cands, 0.0, 0.0, &mut acc, &mut hists);
                        // no step among the DP's candidates
                        } else {
                            add_group_errors(xs, &widths, &mut acc);
                        }
                    }
                    // the quantisation error from the measured rows, the energy it replaces from
                    // all rows (a noisy energy would let the DP pick groups by their sample)
                    let used = rows.div_ceil(stride).max(1) as f64;
                    let all_energy = (col_prefix[i] - col_prefix[i - size]) * norm;
                    for (ci, &(bits, _)) in cands.iter().enumerate() {
                        let cost =
                            if cfg.coded { (units as f64 * (GROUP_OVERHEAD_BITS as f64 + size as f64 * bits_per_code(&hists[ci]))).ceil() as u32 } else { (size * bits as usize) as u32 + GROUP_OVERHEAD_BITS };
                        out[si * nc + ci] = (acc[ci] / used - all_energy, cost);
                    }
                }
                out
            })
            .collect();
        let energy = data.iter().map(|x| x * x).sum::<f64>() * norm;
        let ring = cfg.group_sizes.iter().copied().max().unwrap_or(1) + 1;
        let max_units = max_budget * units;
        let width = max_units + 1;
        let mut rows_ring: Vec<Vec<f64>> = vec![Vec::new(); ring];
        rows_ring[0] = vec![0.0; width];
        let mut choice = vec![0u8; (comps + 1) * width];
        for i in 1..=comps {
            let mut cur = vec![0.0; width];
            {
                let prev = &rows_ring[(i - 1) % ring];
                let e = &table[(i - 1) * ns * nc..i * ns * nc];
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
                            for (q, &(err, cost)) in e[si * nc..(si + 1) * nc].iter().enumerate() {
                                if cost as usize > b {
                                    continue;
                                }
                                let cand = err + from[b - cost as usize]; // infinite across a break
                                if cand < best {
                                    best = cand;
                                    pick = 1 + (si * nc + q) as u8;
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
        let cost = table.iter().map(|t| t.1).collect();
        Self { comps, max_units, cfg: cfg.clone(), cands, energy, last, choice, cost }
    }

    /// Least expected squared error per token within `budget` bits.
    pub fn best_error(&self, budget: usize) -> f64 {
        self.energy + self.last[(budget * self.cfg.units()).min(self.max_units)]
    }

    /// The optimal allocation for `budget` bits per token (≤ the solved maximum). A coded DP's
    /// allocation has no models yet: [`Allocation::with_models`] measures them.
    pub fn allocation(&self, budget: usize) -> Allocation {
        let units = self.cfg.units();
        let budget = budget.min(self.max_units / units);
        let width = self.max_units + 1;
        let (ns, nc) = (self.cfg.group_sizes.len(), self.cands.len());
        let (mut i, mut b) = (self.comps, budget * units);
        let mut groups = Vec::new();
        while i > 0 {
            let c = self.choice[i * width + b];
            if c == 0 {
                i -= 1;
                continue;
            }
            let k = (c - 1) as usize;
            let (size, (bits, fit)) = (self.cfg.group_sizes[k / nc], self.cands[k % nc]);
            groups.push(Group { start: (i - size) as u32, len: size as u32, bits, fit });
            b -= self.cost[(i - 1) * ns * nc + k] as usize;
            i -= size;
        }
        groups.reverse();
        Allocation { budget_bits: budget as u32, groups, expected_error: self.best_error(budget), models: Vec::new(), step: 0.0, dead_zone: 0.0 }
    }
}

impl Allocation {
    /// The allocation with each group's code distribution measured on all `rows` of `data`
    /// (`rows × comps`, as the DP's), as the coder's models: what a coded allocation carries.
    pub fn with_models(mut self, data: &[f64], rows: usize, comps: usize) -> Self {
        self.models = self
            .groups
            .par_iter()
            .map(|g| {
                let (s, e) = (g.start as usize, (g.start + g.len) as usize);
                let mut h = vec![vec![0u32; 1 << g.bits]];
                let mut err = [0.0];
                for r in 0..rows {
                    add_group_stats(&data[r * comps + s..r * comps + e], &[(g.bits, g.fit)], self.step, self.dead_zone, &mut err, &mut h);
                }
                quantised_model(&h[0])
            })
            .collect();
        self
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
        let q: f64 = (0..rows).step_by(stride).map(|r| group_sq_error_with(&data[r * comps..(r + 1) * comps][s.clone()], g.bits, g.fit, alloc.step, alloc.dead_zone)).sum();
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
                let a = Allocation { budget_bits: u32::MAX, groups: groups.clone(), expected_error: 0.0, models: Vec::new(), step: 0.0, dead_zone: 0.0 };
                *best = best.min(allocation_error_thinned(d, rows, comps, &a, c.thin));
                return;
            }
            go(i + 1, left, groups, c, best);
            for &size in &cfg.group_sizes {
                for &bits in &cfg.bit_widths {
                    let cost = size * bits as usize + GROUP_OVERHEAD_BITS as usize;
                    if i + size <= comps && cost <= left {
                        groups.push(Group::new(i as u32, size as u32, bits));
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
        let cfg = DpConfig { group_sizes: vec![1, 2, 4], bit_widths: vec![1, 2, 4], coded: false };
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

    /// On Gaussian coordinates of decaying variance (a PCA spectrum), the coded DP reaches less
    /// error than the fixed-width one at the same budget, since its budget buys coded bits:
    /// entropy-constrained quantisation beats fixed-rate codes plus a byte coder.
    #[test]
    fn coded_budget_buys_less_error() {
        let (rows, comps) = (256, 384);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let d: Vec<f64> = (0..rows * comps)
            .map(|k| {
                let g: f64 = (0..12).map(|_| rng.gen_range(-0.5..0.5)).sum();
                g * 10.0 / (1.0 + (k % comps) as f64).powf(0.4)
            })
            .collect();
        let fixed = DpConfig { group_sizes: vec![1, 16, 64, 256], ..DpConfig::default() };
        let coded = DpConfig { coded: true, ..fixed.clone() };
        let budget = 2 * comps;
        let (f, c) = (Dp::solve(&d, rows, comps, &fixed, budget, &[]), Dp::solve(&d, rows, comps, &coded, budget, &[]));
        for b in [comps / 2, comps, 2 * comps] {
            let (ef, ec) = (f.best_error(b), c.best_error(b));
            let a = c.allocation(b).with_models(&d, rows, comps);
            a.validate(comps, 16).unwrap();
            assert!(a.groups.iter().all(|g| g.bits <= MAX_CODED_BITS));
            assert!(ec <= 1.001 * ef, "budget {b}: coded {ec} vs fixed {ef}");
            if b == 2 * comps {
                assert!(ec < 0.95 * ef, "budget {b}: coded {ec} vs fixed {ef}");
            }
            // the models' expected size stays near the budget the DP spent
            assert!(a.expected_coded_bits() <= 1.05 * b as f64, "{} > {b}", a.expected_coded_bits());
            let e = allocation_error(&d, rows, comps, &a);
            assert!((e - ec).abs() <= 1e-9 * ec.max(1.0), "backtracked coded allocation {e} vs table {ec}");
        }
    }

    #[test]
    fn budget_is_exact_and_error_falls_with_budget() {
        let (rows, comps) = (16, 40);
        let d = data(rows, comps, 7);
        let cfg = DpConfig { group_sizes: vec![1, 16], bit_widths: vec![1, 2, 3, 4, 8], coded: false };
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
