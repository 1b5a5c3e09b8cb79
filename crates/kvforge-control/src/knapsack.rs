//! Multiple-choice knapsack (MCKP) by Lagrangian bisection, with a weak-duality certificate.
//!
//! Every controller in this crate reduces to the same problem (seed 000 App. C.1, seed 002
//! Eq. 6): each item `i` (a page, a token, a channel) takes exactly one of its choices
//! `(cost, dist)`; minimise `Σ dist` subject to `Σ cost ≤ B`.
//!
//! # Algorithm
//!
//! 1. Per item, the lower convex hull of its choices, walked from the least-distortion choice
//!    (ties: the *most* expensive, i.e. "do not move what need not move") towards the cheapest.
//!    Each hull step is a move with price `ρ = Δdist / Δcost` (distortion per saved byte, the
//!    seed's value-per-byte); along one item's hull the prices increase.
//! 2. For a multiplier λ every item independently takes `argmin dist + λ·cost` (ties: the
//!    cheaper choice), i.e. applies all its moves with `ρ ≤ λ`. The total cost is
//!    non-increasing in λ, so λ is found by bisection (seed 002 Alg. 2) — except that, unlike
//!    Alg. 2, we never return the over-budget side: the bracket keeps `cost(λ_hi) ≤ B`.
//!    Bisection stops once the bracket holds at most 64 moves (step 3 orders them exactly).
//! 3. Inside the final bracket `(λ_lo, λ_hi]` the moves are ordered by `(ρ, item)` and
//!    undone from the most expensive while the budget still holds, stopping at the first move
//!    that does not fit. The result is exactly the greedy downgrade path of seed 000 C.3
//!    ("apply the move with smallest ρ until the budget is met") — a *prefix* of one
//!    budget-independent order of moves. That is what makes the predicted distortion
//!    monotone in the budget (a larger budget stops earlier on the same path), at the price
//!    of not back-filling slack with out-of-order upgrades (the overshoot is at most one move).
//!
//! The Lagrangian dual `g(λ) = Σ_i min_c (dist + λ·cost) − λB` is a lower bound on the
//! optimum for every λ ≥ 0 (seed 002 Prop. A.3); at the marginal price it equals the LP
//! relaxation, so `gap = dist − g(λ*)` certifies the solution: `OPT ≥ dist − gap`. The gap is
//! at most the distortion of the one move the LP would have taken fractionally.

/// One choice of an item.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub cost: f64,
    pub dist: f64,
}

impl Choice {
    pub fn new(cost: f64, dist: f64) -> Choice {
        Choice { cost, dist }
    }
}

/// A solved instance.
#[derive(Clone, Debug, PartialEq)]
pub struct Solution {
    /// Index into each item's choices.
    pub pick: Vec<usize>,
    pub cost: f64,
    pub dist: f64,
    /// Marginal price: ρ of the last move applied (0 when nothing had to move).
    pub lambda: f64,
    /// Best Lagrangian lower bound found (−∞ when infeasible).
    pub dual: f64,
    /// `dist − dual ≥ 0`: the solution is within `gap` of the optimum (∞ when infeasible).
    pub gap: f64,
    /// False when even the cheapest choice of every item exceeds the budget; `pick` is then
    /// that cheapest assignment.
    pub feasible: bool,
    /// Bisection iterations spent.
    pub iterations: usize,
}

/// The lower convex hull of one item, from least distortion to least cost.
#[derive(Clone, Debug)]
struct Hull {
    /// Choice indices along the hull.
    idx: Vec<usize>,
    /// ρ of hull step k (from idx[k] to idx[k+1]); non-decreasing.
    rho: Vec<f64>,
}

impl Hull {
    fn new(choices: &[Choice]) -> Hull {
        assert!(!choices.is_empty(), "knapsack: an item has no choices");
        for c in choices {
            assert!(c.cost.is_finite() && c.dist.is_finite() && c.cost >= 0.0, "knapsack: choice {c:?} must have finite cost ≥ 0 and finite distortion");
        }
        // Start: least distortion, ties towards the higher cost (no gratuitous move), then index.
        let start = (0..choices.len())
            .min_by(|&a, &b| {
                let (x, y) = (choices[a], choices[b]);
                x.dist.total_cmp(&y.dist).then(y.cost.total_cmp(&x.cost)).then(a.cmp(&b))
            })
            .unwrap();
        // Candidates strictly cheaper than the start, by cost descending; equal cost: least
        // distortion, then index.
        let mut rest: Vec<usize> = (0..choices.len()).filter(|&i| choices[i].cost < choices[start].cost).collect();
        rest.sort_by(|&a, &b| {
            let (x, y) = (choices[a], choices[b]);
            y.cost.total_cmp(&x.cost).then(x.dist.total_cmp(&y.dist)).then(a.cmp(&b))
        });
        rest.dedup_by(|b, a| choices[*a].cost == choices[*b].cost);
        let slope = |a: usize, b: usize| (choices[b].dist - choices[a].dist) / (choices[a].cost - choices[b].cost);
        let mut idx = vec![start];
        for p in rest {
            // Pop points above the chord (strictly): collinear points stay, they are finer steps.
            while idx.len() >= 2 && slope(idx[idx.len() - 2], idx[idx.len() - 1]) > slope(idx[idx.len() - 1], p) {
                idx.pop();
            }
            idx.push(p);
        }
        let rho = idx.windows(2).map(|w| slope(w[0], w[1]).max(0.0)).collect();
        Hull { idx, rho }
    }

    /// Number of moves applied at multiplier λ (moves with ρ ≤ λ).
    fn steps(&self, lambda: f64) -> usize {
        self.rho.partition_point(|&r| r <= lambda)
    }
}

/// Lagrangian value of one item at λ: `min_c dist + λ cost` over its hull.
fn item_dual(choices: &[Choice], h: &Hull, lambda: f64) -> f64 {
    let c = choices[h.idx[h.steps(lambda)]];
    c.dist + lambda * c.cost
}

/// Solves the MCKP `min Σ dist s.t. Σ cost ≤ budget`, one choice per item. See the module
/// documentation for the algorithm and the meaning of `gap`.
///
/// # Panics
/// If an item has no choice or a choice has a non-finite or negative cost.
pub fn solve(items: &[Vec<Choice>], budget: f64) -> Solution {
    let hulls: Vec<Hull> = items.iter().map(|c| Hull::new(c)).collect();
    let total = |steps: &dyn Fn(&Hull) -> usize| -> (f64, f64) {
        items.iter().zip(&hulls).fold((0.0, 0.0), |(c, d), (ch, h)| {
            let x = ch[h.idx[steps(h)]];
            (c + x.cost, d + x.dist)
        })
    };
    let finish = |steps: Vec<usize>, lambda: f64, feasible: bool, iterations: usize| -> Solution {
        let pick: Vec<usize> = hulls.iter().zip(&steps).map(|(h, &s)| h.idx[s]).collect();
        let (cost, dist) = items.iter().zip(&pick).fold((0.0, 0.0), |(c, d), (ch, &p)| (c + ch[p].cost, d + ch[p].dist));
        let (dual, gap) = if feasible {
            // g is concave; its maximum is at the marginal price λ*. g(0) = Σ min dist.
            let g = |l: f64| items.iter().zip(&hulls).map(|(c, h)| item_dual(c, h, l)).sum::<f64>() - l * budget;
            let dual = g(lambda).max(g(0.0)).min(dist);
            (dual, (dist - dual).max(0.0))
        } else {
            (f64::NEG_INFINITY, f64::INFINITY)
        };
        Solution { pick, cost, dist, lambda, dual, gap, feasible, iterations }
    };

    let (start_cost, _) = total(&|_| 0);
    if start_cost <= budget {
        return finish(vec![0; items.len()], 0.0, true, 0);
    }
    let rho_max = hulls.iter().filter_map(|h| h.rho.last().copied()).fold(0.0f64, f64::max);
    let (min_cost, _) = total(&|h| h.idx.len() - 1);
    if min_cost > budget {
        return finish(hulls.iter().map(|h| h.idx.len() - 1).collect(), rho_max, false, 0);
    }
    // Invariant: cost(x(lo)) > budget ≥ cost(x(hi)); x(−1) is the start (every ρ ≥ 0).
    // Bisection only has to narrow the bracket to a few moves: the moves inside it are
    // ordered exactly below, so stopping at `BRACKET` moves gives the same solution as
    // bisecting to float resolution, in ~log2(moves / BRACKET) passes instead of ~64.
    const BRACKET: usize = 64;
    let at = |lambda: f64| -> (f64, usize) {
        items.iter().zip(&hulls).fold((0.0, 0), |(c, n), (ch, h)| {
            let s = h.steps(lambda);
            (c + ch[h.idx[s]].cost, n + s)
        })
    };
    let (mut lo, mut hi) = (-1.0f64, rho_max);
    let (mut n_lo, mut n_hi) = (0usize, hulls.iter().map(|h| h.rho.len()).sum::<usize>());
    let mut iterations = 0;
    while iterations < 64 && n_hi - n_lo > BRACKET {
        let mid = 0.5 * (lo + hi);
        if mid <= lo || mid >= hi {
            break;
        }
        iterations += 1;
        let (c, n) = at(mid);
        if c <= budget {
            (hi, n_hi) = (mid, n);
        } else {
            (lo, n_lo) = (mid, n);
        }
    }
    // Moves in (lo, hi], in path order (ρ, item, step); undo from the back while it fits.
    let mut steps: Vec<usize> = hulls.iter().map(|h| h.steps(hi)).collect();
    let mut tied: Vec<(f64, usize, usize)> = Vec::new();
    for (i, h) in hulls.iter().enumerate() {
        for s in h.steps(lo)..steps[i] {
            tied.push((h.rho[s], i, s));
        }
    }
    tied.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut cost: f64 = items.iter().zip(&hulls).zip(&steps).map(|((c, h), &s)| c[h.idx[s]].cost).sum();
    // cost(x(lo)) > budget, so undoing stops before `tied` runs out: its last move stays.
    while let Some(&(_, i, s)) = tied.last() {
        let h = &hulls[i];
        let back = items[i][h.idx[s]].cost - items[i][h.idx[s + 1]].cost;
        if cost + back > budget {
            break;
        }
        cost += back;
        steps[i] = s;
        tied.pop();
    }
    let lambda = tied.last().map_or(hi, |t| t.0);
    finish(steps, lambda, true, iterations)
}

/// Exhaustive optimum of a small instance (tests and audits): `(pick, dist)` of the
/// least-distortion feasible assignment, or `None` when none is feasible.
pub fn brute_force(items: &[Vec<Choice>], budget: f64) -> Option<(Vec<usize>, f64)> {
    fn rec(items: &[Vec<Choice>], budget: f64, i: usize, cost: f64, dist: f64, pick: &mut Vec<usize>, best: &mut Option<(Vec<usize>, f64)>) {
        if cost > budget {
            return;
        }
        if i == items.len() {
            if best.as_ref().is_none_or(|b| dist < b.1) {
                *best = Some((pick.clone(), dist));
            }
            return;
        }
        for (j, c) in items[i].iter().enumerate() {
            pick.push(j);
            rec(items, budget, i + 1, cost + c.cost, dist + c.dist, pick, best);
            pick.pop();
        }
    }
    let mut best = None;
    rec(items, budget, 0, 0.0, 0.0, &mut Vec::new(), &mut best);
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ch(v: &[(f64, f64)]) -> Vec<Choice> {
        v.iter().map(|&(c, d)| Choice::new(c, d)).collect()
    }

    #[test]
    fn hull_skips_dominated_and_concave_points() {
        // (cost, dist): 10/0, 8/5 (above the chord 10/0 → 4/3), 6/1... sorted: 10,8,6,4.
        let c = ch(&[(10.0, 0.0), (8.0, 5.0), (6.0, 1.0), (4.0, 3.0), (4.0, 9.0)]);
        let h = Hull::new(&c);
        assert_eq!(h.idx, vec![0, 2, 3]);
        assert!(h.rho.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn zero_distortion_items_do_not_move_without_pressure() {
        let items = vec![ch(&[(10.0, 0.0), (0.0, 0.0)]), ch(&[(10.0, 0.0), (5.0, 1.0)])];
        let s = solve(&items, 20.0);
        assert_eq!(s.pick, vec![0, 0]);
        let s = solve(&items, 15.0);
        assert_eq!(s.pick, vec![1, 0], "the free move comes first");
    }

    #[test]
    fn infeasible_returns_cheapest() {
        let items = vec![ch(&[(10.0, 0.0), (5.0, 1.0)]), ch(&[(10.0, 0.0), (6.0, 1.0)])];
        let s = solve(&items, 10.0);
        assert!(!s.feasible);
        assert_eq!(s.pick, vec![1, 1]);
        assert_eq!(s.gap, f64::INFINITY);
    }
}
