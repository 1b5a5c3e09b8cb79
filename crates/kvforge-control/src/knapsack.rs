//! Multiple-choice knapsack (MCKP) along the greedy path (a weighted selection), with a weak-duality certificate.
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
//! 2. All hull moves of all items, ordered by `(ρ, item, step)`, form the greedy downgrade path
//!    of seed 000 C.3 ("apply the move with smallest ρ until the budget is met"); within an
//!    item prices do not decrease, so any prefix of the path takes each item's first moves.
//!    The solution is the *shortest prefix* that meets the budget, found in O(moves): a radix
//!    pass over price buckets finds the bucket where it ends, then a weighted quickselect on
//!    that bucket's moves only (only the last ≤ 32 are sorted). It is a
//!    prefix of one budget-independent order of moves, which is what makes the predicted
//!    distortion monotone in the budget (a larger budget stops earlier on the same path), at
//!    the price of not back-filling slack with out-of-order upgrades (the overshoot is at most
//!    one move). Equivalently (seed 002 Alg. 2) every item takes `argmin dist + λ·cost` at
//!    the marginal price λ of the last move, ties resolved along the path.
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
    /// Selection rounds spent (each halves the moves that may end the prefix).
    pub iterations: usize,
}

/// The lower convex hulls of all items, stored flat (one allocation per solve, not three
/// per item: at 4096 pages the per-item vectors were a third of RDR's decision time).
///
/// Item `i`'s hull is `idx[at[i]..at[i + 1]]` (choice indices, least distortion first) and
/// its steps' prices are `rho[at[i] - i..at[i + 1] - i - 1]` (one fewer than points). The
/// flat step index `j` of step `s` of item `i` is `at[i] - i + s`, so `(ρ, j)` orders the
/// steps as `(ρ, item, step)` does.
struct Hulls {
    idx: Vec<u32>,
    rho: Vec<f64>,
    /// Bytes saved by each step (indexed like `rho`).
    save: Vec<f64>,
    at: Vec<usize>,
    /// Σ over items, in item order, of the cost at the start of the hull and at its end (the
    /// cheapest choice), and the largest step price: the solver's first checks, summed here
    /// instead of in two more passes over the items (same additions in the same order).
    start_cost: f64,
    end_cost: f64,
    rho_max: f64,
}

impl Hulls {
    fn new(choices: &[Choice], start: &[usize]) -> Hulls {
        let n = start.len().saturating_sub(1);
        let mut h = Hulls::empty(n, choices.len());
        let mut rest: Vec<usize> = Vec::new();
        for i in 0..n {
            h.push_item(&choices[start[i]..start[i + 1]], &mut rest);
        }
        h
    }

    /// No items yet, with room for `items` items of `choices` choices in all: the storage of
    /// this thread's previous solve if any (see `SPARE_HULLS`).
    fn empty(items: usize, choices: usize) -> Hulls {
        let spare = SPARE_HULLS.with(|s| s.take());
        let mut h = match spare {
            Some(mut h) => {
                h.idx.clear();
                h.rho.clear();
                h.save.clear();
                h.at.clear();
                h.reset_totals();
                h
            }
            None => Hulls { idx: Vec::new(), rho: Vec::new(), save: Vec::new(), at: Vec::new(), start_cost: 0.0, end_cost: 0.0, rho_max: 0.0 },
        };
        h.idx.reserve(choices);
        h.rho.reserve(choices);
        h.save.reserve(choices);
        h.at.reserve(items + 1);
        h.at.push(0);
        h
    }

    /// Starts the sums of [`Hulls::start_cost`], [`Hulls::end_cost`] and the largest price over.
    fn reset_totals(&mut self) {
        (self.start_cost, self.end_cost, self.rho_max) = (0.0, 0.0, 0.0);
    }

    /// All items as one problem.
    fn span(&self) -> HullSpan<'_> {
        HullSpan { idx: &self.idx, rho: &self.rho, save: &self.save, at: &self.at, start_cost: self.start_cost, end_cost: self.end_cost, rho_max: self.rho_max }
    }

    /// Appends the hull of one item.
    fn push_item(&mut self, choices: &[Choice], rest: &mut Vec<usize>) {
        assert!(!choices.is_empty(), "knapsack: an item has no choices");
        // One pass for the checks and the shape. Controllers list a page's tiers down the
        // ladder: strictly cheaper, no less distorted. Then the start is the first choice and
        // the candidates are the rest in order, which is what the general path below
        // computes, without its sort.
        let valid = |c: &Choice| finite(c.cost) & finite(c.dist) & (c.cost >= 0.0);
        let (mut ok, mut ladder) = (valid(&choices[0]), true);
        for w in choices.windows(2) {
            ok &= valid(&w[1]);
            ladder &= w[1].cost < w[0].cost && w[1].dist >= choices[0].dist;
        }
        if !ok {
            let c = choices.iter().find(|c| !valid(c)).expect("an invalid choice");
            panic!("knapsack: choice {c:?} must have finite cost ≥ 0 and finite distortion");
        }
        if ladder && choices.len() <= LADDER_MAX {
            let (mut cost, mut dist) = ([0.0f64; LADDER_MAX], [0.0f64; LADDER_MAX]);
            for (k, c) in choices.iter().enumerate() {
                (cost[k], dist[k]) = (c.cost, c.dist);
            }
            self.push_ladder(&cost[..choices.len()], &dist[..choices.len()]);
            return;
        }
        // Start: least distortion, ties towards the higher cost (no gratuitous move), then index.
        let start = if ladder {
            0
        } else {
            (0..choices.len())
                .min_by(|&a, &b| {
                    let (x, y) = (choices[a], choices[b]);
                    x.dist.total_cmp(&y.dist).then(y.cost.total_cmp(&x.cost)).then(a.cmp(&b))
                })
                .unwrap()
        };
        // Candidates strictly cheaper than the start, by cost descending; equal cost: least
        // distortion, then index.
        rest.clear();
        if ladder {
            rest.extend(1..choices.len());
        } else {
            rest.extend((0..choices.len()).filter(|&i| choices[i].cost < choices[start].cost));
            rest.sort_by(|&a, &b| {
                let (x, y) = (choices[a], choices[b]);
                y.cost.total_cmp(&x.cost).then(x.dist.total_cmp(&y.dist)).then(a.cmp(&b))
            });
            rest.dedup_by(|b, a| choices[*a].cost == choices[*b].cost);
        }
        let slope = |a: usize, b: usize| (choices[b].dist - choices[a].dist) / (choices[a].cost - choices[b].cost);
        // The stack ([`hull_stack`]) lives in the item's room at the end of `idx` and `rho` (at
        // most every candidate stays), trimmed afterwards: no push or pop per point.
        let (first, first_step) = (self.idx.len(), self.rho.len());
        self.idx.resize(first + rest.len() + 1, 0);
        self.rho.resize(first_step + rest.len(), 0.0);
        let (idx, rho) = (&mut self.idx[first..], &mut self.rho[first_step..]);
        idx[0] = start as u32;
        let top = hull_stack(idx, rho, rest.iter().copied(), slope, slope);
        self.rho_max = self.rho_max.max(close_steps(choices, &idx[..=top], &mut rho[..top], &mut self.save));
        self.start_cost += choices[start].cost;
        self.end_cost += choices[idx[top] as usize].cost;
        self.idx.truncate(first + top + 1);
        self.rho.truncate(first_step + top);
        self.at.push(self.idx.len());
    }

    /// [`push_ladder`](Self::push_ladder) of a ladder of `N` points whose slopes do not fall
    /// (nothing would pop from [`hull_stack`]: every point is on the hull), for `N` known when
    /// compiling; the same checks, slopes and sums. Returns false, with nothing pushed, when
    /// the choices are not such a ladder.
    #[inline(always)]
    fn push_convex<const N: usize>(&mut self, cost: &[f64; N], dist: &[f64; N]) -> bool {
        /// The hull's choice indices when every point is on it.
        const ALL: [u32; LADDER_MAX] = [0, 1, 2, 3, 4, 5, 6, 7];
        if N < 2 || N > LADDER_MAX {
            return false;
        }
        let valid = |c: f64, d: f64| finite(c) & finite(d) & (c >= 0.0);
        let (mut slope, mut save) = ([0.0f64; N], [0.0f64; N]);
        let mut ok = valid(cost[0], dist[0]);
        for k in 1..N {
            save[k - 1] = cost[k - 1] - cost[k];
            slope[k - 1] = (dist[k] - dist[k - 1]) / save[k - 1];
            ok &= valid(cost[k], dist[k]) & (cost[k] < cost[k - 1]) & (dist[k] >= dist[0]);
        }
        // Not `<=`: a slope pops its predecessor exactly when `hull_stack`'s `>` says so.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        for k in 1..N - 1 {
            ok &= !(slope[k - 1] > slope[k]);
        }
        if !ok {
            return false;
        }
        let mut most = 0.0f64;
        for r in &mut slope[..N - 1] {
            *r = r.max(0.0);
            most = most.max(*r);
        }
        self.idx.extend_from_slice(&ALL[..N]);
        self.rho.extend_from_slice(&slope[..N - 1]);
        self.save.extend_from_slice(&save[..N - 1]);
        self.rho_max = self.rho_max.max(most);
        self.start_cost += cost[0];
        self.end_cost += cost[N - 1];
        self.at.push(self.idx.len());
        true
    }

    /// [`push_item`](Self::push_item) for a short ladder (start 0, candidates 1.. in order),
    /// its points given as costs and distortions. Each candidate's first slope is to the point
    /// just below it on the ladder (the stack's top is always the last point pushed), so those
    /// slopes are taken up front, side by side. When they do not fall, nothing would pop and
    /// every point is on the hull: RDKV's pages are all such (ε is convex in the bytes), and
    /// they skip the stack and go into the vectors straight (writing small arrays and
    /// copying them whole stalled on store forwarding: a third of RDKV's decision).
    fn push_ladder(&mut self, cost: &[f64], dist: &[f64]) {
        let n = cost.len();
        debug_assert!(n == dist.len() && (1..=LADDER_MAX).contains(&n));
        let mut next = [0.0f64; LADDER_MAX];
        for k in 0..n - 1 {
            next[k] = (dist[k + 1] - dist[k]) / (cost[k] - cost[k + 1]);
        }
        let next = &next[..n - 1];
        if next.windows(2).any(|w| w[0] > w[1]) {
            return self.push_ladder_stack(cost, dist, next);
        }
        // What the stack leaves when nothing pops (see `hull_stack`), prices clamped at 0.
        self.idx.extend(0..n as u32);
        let mut most = 0.0f64;
        self.rho.extend(next.iter().map(|&r| {
            let r = r.max(0.0);
            most = most.max(r);
            r
        }));
        self.save.extend(cost.windows(2).map(|w| w[0] - w[1]));
        self.rho_max = self.rho_max.max(most);
        self.start_cost += cost[0];
        self.end_cost += cost[n - 1];
        self.at.push(self.idx.len());
    }

    /// [`push_ladder`](Self::push_ladder) of a ladder whose first slopes `next` fall somewhere:
    /// the stack, in register-sized arrays, trimmed into the vectors.
    fn push_ladder_stack(&mut self, cost: &[f64], dist: &[f64], next: &[f64]) {
        let n = cost.len();
        let slope = |a: usize, b: usize| (dist[b] - dist[a]) / (cost[a] - cost[b]);
        let (mut idx, mut rho) = ([0u32; LADDER_MAX], [0.0f64; LADDER_MAX]);
        let top = hull_stack(&mut idx, &mut rho, 1..n, |_, p| next[p - 1], slope);
        let idx = &idx[..=top];
        let mut most = 0.0f64;
        for r in &mut rho[..top] {
            *r = r.max(0.0);
            most = most.max(*r);
        }
        self.rho_max = self.rho_max.max(most);
        self.idx.extend_from_slice(idx);
        self.rho.extend_from_slice(&rho[..top]);
        self.save.extend(idx.windows(2).map(|w| cost[w[0] as usize] - cost[w[1] as usize]));
        self.start_cost += cost[0];
        self.end_cost += cost[idx[top] as usize];
        self.at.push(self.idx.len());
    }

    /// Keeps the storage for this thread's next solve.
    fn recycle(self) {
        SPARE_HULLS.with(|s| s.set(Some(self)));
    }

    fn len(&self) -> usize {
        self.at.len() - 1
    }

    /// Bytes each of item `i`'s hull steps saves; positive.
    #[cfg(test)]
    fn save(&self, i: usize) -> &[f64] {
        &self.save[self.at[i] - i..self.at[i + 1] - i - 1]
    }

    /// Choice indices along item `i`'s hull.
    #[cfg(test)]
    fn idx(&self, i: usize) -> &[u32] {
        &self.idx[self.at[i]..self.at[i + 1]]
    }

    /// Prices of item `i`'s hull steps; non-decreasing.
    #[cfg(test)]
    fn rho(&self, i: usize) -> &[f64] {
        &self.rho[self.at[i] - i..self.at[i + 1] - i - 1]
    }

    /// Choice index of item `i` after `s` moves.
    #[cfg(test)]
    fn pick(&self, i: usize, s: usize) -> usize {
        self.idx(i)[s] as usize
    }
}

/// The lower-hull stack of one item: from the start `idx[0]`, each candidate (cost descending)
/// pops the points above its chord (strictly: collinear points stay, they are finer steps) and
/// goes on top. `rho[k]` is the slope from point k to k + 1 as computed when k + 1 was pushed
/// (the same division of the same numbers the chord test would redo), so a candidate costs one
/// division plus one per point it pops. `first(top, p)` is a candidate's slope to the stack's
/// top before any pop (a short ladder passes slopes it took up front; it must equal
/// `slope(top, p)`). Returns the top's position.
fn hull_stack(idx: &mut [u32], rho: &mut [f64], candidates: impl Iterator<Item = usize>, first: impl Fn(usize, usize) -> f64, slope: impl Fn(usize, usize) -> f64) -> usize {
    let mut top = 0;
    for p in candidates {
        let mut s = first(idx[top] as usize, p);
        while top > 0 && rho[top - 1] > s {
            top -= 1;
            s = slope(idx[top] as usize, p);
        }
        rho[top] = s;
        top += 1;
        idx[top] = p as u32;
    }
    top
}

/// Clamps a hull's step prices at 0 and pushes each step's bytes saved; returns the largest price.
fn close_steps(choices: &[Choice], idx: &[u32], rho: &mut [f64], save: &mut Vec<f64>) -> f64 {
    let mut most = 0.0f64;
    for r in rho.iter_mut() {
        *r = r.max(0.0);
        most = most.max(*r);
    }
    save.extend(idx.windows(2).map(|w| choices[w[0] as usize].cost - choices[w[1] as usize].cost));
    most
}

/// Solves the MCKP `min Σ dist s.t. Σ cost ≤ budget`, one choice per item. See the module
/// documentation for the algorithm and the meaning of `gap`.
///
/// # Panics
/// If an item has no choice or a choice has a non-finite or negative cost.
pub fn solve(items: &[Vec<Choice>], budget: f64) -> Solution {
    let mut start = Vec::with_capacity(items.len() + 1);
    start.push(0);
    for it in items {
        start.push(start.last().unwrap() + it.len());
    }
    let choices: Vec<Choice> = items.iter().flatten().copied().collect();
    solve_flat(&choices, &start, budget)
}

/// [`solve`] on items stored flat: item `i`'s choices are `choices[start[i]..start[i + 1]]`
/// (`start` has one entry more than there are items).
pub fn solve_flat(choices: &[Choice], start: &[usize], budget: f64) -> Solution {
    let hulls = Hulls::new(choices, start);
    let solution = solve_span(&hulls.span(), budget, |i, k| choices[start[i] + k]);
    hulls.recycle();
    solution
}

/// The hulls of consecutive items (one problem) inside a [`Hulls`], with their sums.
/// `at` holds the items' positions in the whole `Hulls` (its first entry is where `idx`
/// starts), so item `i`'s hull is `idx[at[i] - at[0]..at[i + 1] - at[0]]` and its steps are
/// `rho[at[i] - at[0] - i..]` (as in [`Hulls`], shifted by the span's start).
struct HullSpan<'a> {
    idx: &'a [u32],
    rho: &'a [f64],
    save: &'a [f64],
    at: &'a [usize],
    start_cost: f64,
    end_cost: f64,
    rho_max: f64,
}

impl HullSpan<'_> {
    fn len(&self) -> usize {
        self.at.len() - 1
    }
}

/// Choice `k` of item `i` of a problem, as its hulls were built from: the solution's sums
/// read the choices again rather than the hulls storing them. Any `Fn(i, k) -> Choice` is
/// one; a caller that computes choices (RDKV) implements it on a struct whose method is
/// inlined into the sums, which a closure was not (its call spilled the running sums
/// around every item).
pub(crate) trait ItemChoices {
    fn choice(&self, item: usize, k: usize) -> Choice;
}

impl<F: Fn(usize, usize) -> Choice> ItemChoices for F {
    #[inline(always)]
    fn choice(&self, item: usize, k: usize) -> Choice {
        self(item, k)
    }
}

/// Solves the items of `hulls` for `budget`; `choice(i, k)` is choice `k` of item `i` (the
/// choices the hulls were built from: the solution's sums read them again rather than the
/// hulls storing them).
fn solve_span(hulls: &HullSpan, budget: f64, choices: impl ItemChoices) -> Solution {
    let choice = |i: usize, k: usize| choices.choice(i, k);
    let n = hulls.len();
    let at0 = hulls.at[0];
    let finish = |steps: Vec<usize>, lambda: f64, feasible: bool, iterations: usize| -> Solution {
        // One pass: the picks with their cost and distortion and, when feasible, the
        // Lagrangian at λ* and at 0 (g is concave; its maximum is at the marginal price λ*;
        // g(0) = Σ min dist). Each sum adds the same terms in the same order as a pass of
        // its own would (`Sum` of f64 starts at −0.0), so the numbers do not depend on the fusion.
        let mut pick = Vec::with_capacity(n);
        let (mut cost, mut dist) = (0.0, 0.0);
        let (mut g_lambda, mut g_zero) = (-0.0f64, -0.0f64);
        // Item i's hull and prices are sliced once from `at`.
        for (i, (&s, at)) in steps.iter().zip(hulls.at.windows(2)).enumerate() {
            let idx = &hulls.idx[at[0] - at0..at[1] - at0];
            let p = idx[s] as usize;
            pick.push(p);
            let picked = choice(i, p);
            cost += picked.cost;
            dist += picked.dist;
            if feasible {
                // Prices do not decrease along a hull, so the moves priced at most λ are its
                // first ones: counting them is `Hulls::steps` without the binary search. The
                // choice is asked for again only when it is another one (most items sit at
                // the same hull point for λ* as in the solution).
                // Both counts in one scalar pass over the item's few prices (two counting
                // passes were each vectorised, with their set-up and remainder, over ≤ 4 prices).
                let rho = &hulls.rho[at[0] - at0 - i..at[1] - at0 - i - 1];
                let (mut below_lambda, mut below_zero) = (0, 0);
                for &r in rho {
                    below_lambda += usize::from(r <= lambda);
                    below_zero += usize::from(r <= 0.0);
                }
                let at_lambda = idx[below_lambda] as usize;
                let c = if at_lambda == p { picked } else { choice(i, at_lambda) };
                g_lambda += c.dist + lambda * c.cost;
                let at_zero = idx[below_zero] as usize;
                let c = if at_zero == p {
                    picked
                } else if at_zero == at_lambda {
                    c
                } else {
                    choice(i, at_zero)
                };
                g_zero += c.dist + 0.0 * c.cost;
            }
        }
        let (dual, gap) = if feasible {
            let dual = (g_lambda - lambda * budget).max(g_zero - 0.0 * budget).min(dist);
            (dual, (dist - dual).max(0.0))
        } else {
            (f64::NEG_INFINITY, f64::INFINITY)
        };
        Solution { pick, cost, dist, lambda, dual, gap, feasible, iterations }
    };

    let start_cost = hulls.start_cost;
    if start_cost <= budget {
        finish(vec![0; n], 0.0, true, 0)
    } else if hulls.end_cost > budget {
        finish(hulls.at.windows(2).map(|w| w[1] - w[0] - 1).collect(), hulls.rho_max, false, 0)
    } else {
        // The greedy path takes moves in (ρ, item, step) order, and the solution is its
        // shortest prefix that saves `need` bytes (see [`prefix`]).
        let (steps, lambda, iterations) = prefix(hulls, start_cost - budget);
        finish(steps, lambda, true, iterations)
    }
}

/// Independent problems (groups of consecutive items, e.g. one per kv head) whose hulls are
/// built item by item from choices the caller computes on the fly, and solved group by group.
/// A controller that can recompute an item's choices need not store them: at 32K tokens × 8
/// kv heads, writing every page's choices to flat vectors and reading them back for the hulls
/// cost RDKV as much as the hulls themselves.
pub(crate) struct GroupHulls {
    hulls: Hulls,
    /// Hull candidates of the general (non-ladder) path.
    rest: Vec<usize>,
    /// Per closed group: items end (exclusive), then its start cost, end cost and largest price.
    groups: Vec<(usize, f64, f64, f64)>,
}

impl GroupHulls {
    /// Room for `items` items of `choices` choices in all.
    pub fn with_capacity(items: usize, choices: usize) -> GroupHulls {
        GroupHulls { hulls: Hulls::empty(items, choices), rest: Vec::new(), groups: Vec::new() }
    }

    /// Appends an item (to the open group) with its choices.
    ///
    /// # Panics
    /// As [`solve`] does, on an item without choices or a non-finite or negative choice.
    #[cfg(test)]
    pub fn push_item(&mut self, choices: &[Choice]) {
        self.hulls.push_item(choices, &mut self.rest);
    }

    /// [`push_points`](Self::push_points) of a ladder of a length known when compiling (RDKV
    /// dispatches on a page's tier count): every loop unrolls, the page's points, slopes and
    /// savings stay in registers and go into the vectors as constant-size copies. Written for
    /// a run-time length, the points went through small arrays on the stack that were read
    /// back as vectors and stalled on store forwarding (most of RDKV's posing).
    #[inline(always)]
    pub fn push_array<const N: usize>(&mut self, cost: &[f64; N], dist: &[f64; N]) {
        if !self.hulls.push_convex::<N>(cost, dist) {
            self.push_points(cost, dist);
        }
    }

    /// [`push_item`](Self::push_item) of the choices `(cost[k], dist[k])`, without writing
    /// them out first: a caller that computes a page's ladder (RDKV, every page of a 32K
    /// context) hands its two arrays straight to the hull. Choices that are not a short
    /// ladder take `push_item`'s general path (and its panics), as there.
    pub fn push_points(&mut self, cost: &[f64], dist: &[f64]) {
        assert_eq!(cost.len(), dist.len(), "knapsack: one distortion per cost");
        let n = cost.len();
        let valid = |c: f64, d: f64| finite(c) & finite(d) & (c >= 0.0);
        let mut ladder = n > 0 && n <= LADDER_MAX && valid(cost[0], dist[0]);
        for k in 1..n {
            ladder &= valid(cost[k], dist[k]) & (cost[k] < cost[k - 1]) & (dist[k] >= dist[0]);
        }
        if ladder {
            self.hulls.push_ladder(cost, dist);
        } else {
            let choices: Vec<Choice> = cost.iter().zip(dist).map(|(&c, &d)| Choice::new(c, d)).collect();
            self.hulls.push_item(&choices, &mut self.rest);
        }
    }

    /// Closes the open group: the items pushed since the last close form one problem.
    pub fn close_group(&mut self) {
        let h = &mut self.hulls;
        self.groups.push((h.len(), h.start_cost, h.end_cost, h.rho_max));
        h.reset_totals();
    }

    /// Items of group `g` (their indices among all items pushed).
    pub fn items(&self, g: usize) -> std::ops::Range<usize> {
        let first = if g == 0 { 0 } else { self.groups[g - 1].0 };
        first..self.groups[g].0
    }

    /// Solves group `g` for `budget`, as [`solve_flat`] solves its items alone; `choice(i, k)`
    /// is choice `k` of the group's item `i` (counted from the group's first), as pushed.
    pub fn solve_group(&self, g: usize, budget: f64, choice: impl ItemChoices) -> Solution {
        let r = self.items(g);
        let h = &self.hulls;
        let at = &h.at[r.start..=r.end];
        let steps = at[0] - r.start..at[at.len() - 1] - r.end;
        let (_, start_cost, end_cost, rho_max) = self.groups[g];
        let span = HullSpan { idx: &h.idx[at[0]..at[at.len() - 1]], rho: &h.rho[steps.clone()], save: &h.save[steps], at, start_cost, end_cost, rho_max };
        solve_span(&span, budget, choice)
    }

    /// Keeps the storage for this thread's next solve.
    pub fn recycle(self) {
        self.hulls.recycle();
    }
}

std::thread_local! {
    /// The hull vectors of the last solve on this thread, reused by the next: RDKV's paper
    /// allocation solves 32K units per head, and fresh megabytes each time cost a page fault
    /// per 4 KiB touched (half the median time of a solve, against the warm minimum). A
    /// thread keeps at most the storage of its largest solve.
    static SPARE_HULLS: std::cell::Cell<Option<Hulls>> = const { std::cell::Cell::new(None) };
}

/// `x.is_finite()` as `x − x == 0` (∞ − ∞ and NaN − NaN are NaN): the same answer without
/// leaving the float registers. `is_finite`'s integer test moved every point of every page
/// across to the integer unit and back, a tenth of RDKV's decision at 32K tokens.
#[inline(always)]
#[allow(clippy::eq_op)]
fn finite(x: f64) -> bool {
    x - x == 0.0
}

/// Ladders of at most this many choices take [`Hulls::push_ladder`] (a kvforge ladder has 5
/// tiers below the tail).
pub(crate) const LADDER_MAX: usize = 8;

/// One hull step on the greedy path: `(ρ, item, step, bytes saved)`.
type Move = (f64, u32, u32, f64);

/// The path order of moves: `(ρ, item, step)`.
fn path_order(a: &Move, b: &Move) -> std::cmp::Ordering {
    a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2))
}

/// `ρ` as an integer in the order of `f64::total_cmp` (the path's order of prices), so that
/// the high bits of the difference to the smallest key bucket prices monotonically.
fn price_key(rho: f64) -> u64 {
    let b = rho.to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | 1 << 63
    }
}

/// Price buckets of [`prefix`]'s first pass: 2¹¹ (16 KiB of sums, L1-resident).
const BUCKET_BITS: u32 = 11;

/// The shortest prefix of the greedy path (all hull moves in `(ρ, item, step)` order) whose
/// moves save at least `need > 0` bytes: the moves each item takes, the price of the last
/// move, and the selection rounds spent.
///
/// One radix pass first: moves are bucketed by the high bits of their price key (monotone in
/// ρ), the bytes saved are summed per bucket, and the bucket where the running sum reaches
/// `need` holds the end of the prefix; every move of an earlier bucket precedes all of that
/// bucket's moves on the path, so it is in the prefix. Only that bucket's moves (a few, with
/// prices spread over orders of magnitude as page importances are) are gathered and handed to
/// the quickselect of [`select_end`], starting from the bytes the earlier buckets saved; the
/// rest is never materialised. (A quickselect over all moves, partitioning 32-byte tuples
/// around medians, was ~40% of a 512-page solve.) The prefix is the one [`select_end`] finds
/// on all moves whenever the sums of bytes saved are exact (integer byte costs), because
/// both find the same shortest prefix of the same order.
fn prefix(hulls: &HullSpan, need: f64) -> (Vec<usize>, f64, usize) {
    let n = hulls.len();
    if hulls.rho.is_empty() {
        return (vec![0; n], 0.0, 0);
    }
    // Each move's price key once, then its bucket once (the passes below read them rather
    // than redo the conversion per pass).
    let keys: Vec<u64> = hulls.rho.iter().map(|&r| price_key(r)).collect();
    let (lo_key, hi_key) = keys.iter().fold((u64::MAX, 0), |(lo, hi), &k| (lo.min(k), hi.max(k)));
    let shift = (u64::BITS - (hi_key - lo_key).leading_zeros()).saturating_sub(BUCKET_BITS);
    let last = ((hi_key - lo_key) >> shift) as usize;
    let buckets: Vec<u16> = keys.iter().map(|&k| ((k - lo_key) >> shift) as u16).collect();
    let mut saved = vec![0.0f64; last + 1];
    for (&b, &s) in buckets.iter().zip(hulls.save) {
        saved[b as usize] += s;
    }
    // The bucket where the prefix ends (the last one if rounding keeps the sum short of
    // `need`: then the whole path is the prefix, as in `select_end`), and what the buckets
    // before it save.
    let (acc, end_bucket) = end_of_prefix(&saved[..last], need);
    let end_bucket = end_bucket.unwrap_or(last);
    let end_bucket = end_bucket as u16;
    let mut steps = vec![0usize; n];
    let mut moves: Vec<Move> = Vec::new();
    // Item i's moves are the flat moves `at[i] - i..at[i + 1] - i - 1`, walked in turn.
    let mut j = 0;
    for (i, (taken, w)) in steps.iter_mut().zip(hulls.at.windows(2)).enumerate() {
        let len = w[1] - w[0] - 1;
        for (s, &b) in buckets[j..j + len].iter().enumerate() {
            if b < end_bucket {
                *taken = s + 1;
            } else if b == end_bucket {
                moves.push((hulls.rho[j + s], i as u32, s as u32, hulls.save[j + s]));
            }
        }
        j += len;
    }
    let (end, rounds) = select_end(&mut moves, acc, need);
    for m in &moves[..end] {
        let (i, s) = (m.1 as usize, m.2 as usize + 1);
        steps[i] = steps[i].max(s);
    }
    let lambda = moves[..end].last().map_or(0.0, |m| m.0);
    (steps, lambda, 1 + rounds)
}

/// The first bucket `k` where the running sum of `saved` reaches `need > 0` (None when the
/// sum stays short), with the sum of the buckets before it (of all when short). The sum only moves at
/// buckets that hold moves, so the empty ones are skipped 64 at a time (adding 0 to a sum of
/// savings changes nothing, and a sum short of `need` stays short): the running sum is a
/// chain of dependent additions, and walking it over every one of 2¹¹ mostly empty buckets
/// was half of [`prefix`].
fn end_of_prefix(saved: &[f64], need: f64) -> (f64, Option<usize>) {
    let mut acc = 0.0f64;
    for (w, chunk) in saved.chunks(64).enumerate() {
        let mut held = chunk.iter().enumerate().fold(0u64, |m, (k, &s)| m | u64::from(s != 0.0) << k);
        while held != 0 {
            let k = w * 64 + held.trailing_zeros() as usize;
            if acc + saved[k] >= need {
                return (acc, Some(k));
            }
            acc += saved[k];
            held &= held - 1;
        }
    }
    (acc, None)
}

/// The weighted quickselect: reorders `moves` so that `moves[..end]` are the first `end` in
/// path order, where `end` is the shortest count with `acc` plus their savings `≥ need` (all
/// of them if none is), and returns `end` with the selection rounds spent. Expected
/// O(moves): partition around the median key, keep the half holding the point where the
/// savings reach `need`, sort only the last few. (Bisecting λ cost one O(items) pass per
/// halving of the bracket, most of RDR's decision at 4096 pages.) Within an item prices do
/// not decrease and ties go by step, so each item's moves in the prefix are its first ones.
fn select_end(moves: &mut [Move], mut acc: f64, need: f64) -> (usize, usize) {
    // moves[..lo] are in the prefix (their keys precede every key of moves[lo..hi]) and save
    // `acc`; the prefix ends inside moves[lo..hi].
    let (mut lo, mut hi) = (0usize, moves.len());
    let mut iterations = 0;
    // A controller invoked every few decode steps is short by a few pages, so the prefix is
    // a few moves: first select the SHORT smallest keys (one partial pass, where halving
    // from the median partitions ~2× the moves and sums half of them each round). If they
    // save enough, the prefix ends among them; else they all belong to it and the halving
    // goes on above them. Either way the invariant below holds, so the prefix is the same.
    const SHORT: usize = 64;
    if hi > 4 * SHORT {
        iterations += 1;
        moves.select_nth_unstable_by(SHORT, path_order);
        let saved: f64 = moves[..SHORT].iter().map(|m| m.3).sum();
        if acc + saved >= need {
            hi = SHORT;
        } else {
            acc += saved;
            lo = SHORT;
        }
    }
    let end = loop {
        if hi - lo <= 32 {
            moves[lo..hi].sort_unstable_by(path_order);
            let mut end = hi;
            for (k, m) in moves[lo..hi].iter().enumerate() {
                acc += m.3;
                if acc >= need {
                    end = lo + k + 1;
                    break;
                }
            }
            break end;
        }
        iterations += 1;
        let mid = lo + (hi - lo) / 2;
        moves[lo..hi].select_nth_unstable_by(mid - lo, path_order);
        let left: f64 = moves[lo..mid].iter().map(|m| m.3).sum();
        if acc + left >= need {
            hi = mid;
        } else {
            acc += left;
            lo = mid;
        }
    };
    (end, iterations)
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
        let two = [c.clone(), ch(&[(3.0, 1.0), (5.0, 0.0)])].concat();
        let h = Hulls::new(&two, &[0, 5, 7]);
        assert_eq!(h.idx(0), [0, 2, 3]);
        assert!(h.rho(0).windows(2).all(|w| w[0] <= w[1]));
        assert_eq!((h.idx(1), h.rho(1)), (&[1u32, 0][..], &[0.5][..]));
    }

    #[test]
    fn zero_distortion_items_do_not_move_without_pressure() {
        let items = vec![ch(&[(10.0, 0.0), (0.0, 0.0)]), ch(&[(10.0, 0.0), (5.0, 1.0)])];
        let s = solve(&items, 20.0);
        assert_eq!(s.pick, vec![0, 0]);
        let s = solve(&items, 15.0);
        assert_eq!(s.pick, vec![1, 0], "the free move comes first");
    }

    /// The selection (the SHORT first pass, then halving) against the path taken literally:
    /// every hull move sorted by (ρ, item, step), the shortest prefix saving enough. Budgets
    /// from "short by one page" (prefix inside the first SHORT moves) to "most pages move"
    /// (prefix far past it), on instances with thousands of moves.
    #[test]
    fn selection_equals_the_sorted_path() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for trial in 0..40 {
            let n = 300 + 40 * trial;
            // Ladders like RDR's: page costs fixed per tier (integers), distortion weight × ε.
            let costs = [1000.0, 600.0, 350.0, 200.0, 0.0];
            let eps = [0.0, 0.01, 0.05, 0.3, 1.0];
            let items: Vec<Vec<Choice>> = (0..n)
                .map(|_| {
                    let w = (rng.gen::<f64>() * 12.0 - 12.0).exp();
                    let from = rng.gen_range(0..3);
                    (from..5).map(|t| Choice::new(costs[t], w * eps[t] + if t == 4 { 1e-4 } else { 0.0 })).collect()
                })
                .collect();
            let top: f64 = items.iter().map(|c| c[0].cost).sum();
            let bottom: f64 = items.iter().map(|c| c.last().unwrap().cost).sum();
            for need in [1.0, 500.0, 5e3, 0.3 * (top - bottom), 0.9 * (top - bottom)] {
                let budget = top - need;
                let got = solve(&items, budget);
                let mut start = vec![0];
                for it in &items {
                    start.push(start.last().unwrap() + it.len());
                }
                let flat: Vec<Choice> = items.iter().flatten().copied().collect();
                let h = Hulls::new(&flat, &start);
                let mut moves: Vec<(f64, usize, usize, f64)> = Vec::new();
                for i in 0..n {
                    for (k, &r) in h.rho(i).iter().enumerate() {
                        let it = &items[i];
                        moves.push((r, i, k, it[h.pick(i, k)].cost - it[h.pick(i, k + 1)].cost));
                    }
                }
                moves.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
                let (mut acc, mut steps, mut lambda) = (0.0, vec![0usize; n], 0.0);
                for m in &moves {
                    if acc >= need {
                        break;
                    }
                    acc += m.3;
                    steps[m.1] = m.2 + 1;
                    lambda = m.0;
                }
                let want: Vec<usize> = (0..n).map(|i| h.pick(i, steps[i])).collect();
                assert!(got.feasible);
                assert_eq!(got.pick, want, "trial {trial}, need {need}");
                assert_eq!(got.lambda, lambda, "trial {trial}, need {need}");
            }
        }
    }

    /// Item hulls as the chord test computes them, every slope recomputed (the hull before
    /// the slopes were kept on the stack): `(choice indices, prices)`.
    fn hull_by_chords(choices: &[Choice]) -> (Vec<u32>, Vec<f64>) {
        let start = (0..choices.len())
            .min_by(|&a, &b| {
                let (x, y) = (choices[a], choices[b]);
                x.dist.total_cmp(&y.dist).then(y.cost.total_cmp(&x.cost)).then(a.cmp(&b))
            })
            .unwrap();
        let mut rest: Vec<usize> = (0..choices.len()).filter(|&i| choices[i].cost < choices[start].cost).collect();
        rest.sort_by(|&a, &b| {
            let (x, y) = (choices[a], choices[b]);
            y.cost.total_cmp(&x.cost).then(x.dist.total_cmp(&y.dist)).then(a.cmp(&b))
        });
        rest.dedup_by(|b, a| choices[*a].cost == choices[*b].cost);
        let slope = |a: usize, b: usize| (choices[b].dist - choices[a].dist) / (choices[a].cost - choices[b].cost);
        let mut idx = vec![start];
        for p in rest {
            while idx.len() >= 2 && slope(idx[idx.len() - 2], idx[idx.len() - 1]) > slope(idx[idx.len() - 1], p) {
                idx.pop();
            }
            idx.push(p);
        }
        let rho = idx.windows(2).map(|w| slope(w[0], w[1]).max(0.0)).collect();
        (idx.into_iter().map(|i| i as u32).collect(), rho)
    }

    /// The path's prefix by the quickselect alone over every move (the selection before the
    /// radix pass): the reference [`prefix`] must reproduce.
    fn prefix_by_quickselect(h: &Hulls, need: f64) -> (Vec<usize>, f64) {
        let mut moves: Vec<Move> = Vec::new();
        for i in 0..h.len() {
            for (s, (&r, &b)) in h.rho(i).iter().zip(h.save(i)).enumerate() {
                moves.push((r, i as u32, s as u32, b));
            }
        }
        let (end, _) = select_end(&mut moves, 0.0, need);
        let mut steps = vec![0usize; h.len()];
        for m in &moves[..end] {
            steps[m.1 as usize] = steps[m.1 as usize].max(m.2 as usize + 1);
        }
        (steps, moves[..end].last().map_or(0.0, |m| m.0))
    }

    fn flat(items: &[Vec<Choice>]) -> (Vec<Choice>, Vec<usize>) {
        let mut start = vec![0];
        for it in items {
            start.push(start.last().unwrap() + it.len());
        }
        (items.iter().flatten().copied().collect(), start)
    }

    /// Items as controllers pose them and worse: page ladders truncated from above (pages
    /// already down-tiered) and below (protected pages, no drop), weights with exact ties
    /// (equal prices across items) and zeros (free moves), plus arbitrary choice lists (not
    /// ladders: the general hull), all with integer byte costs.
    fn mixed_items() -> impl proptest::strategy::Strategy<Value = Vec<Vec<Choice>>> {
        use proptest::prelude::*;
        const COSTS: [f64; 5] = [1000.0, 600.0, 350.0, 200.0, 0.0];
        const EPS: [f64; 5] = [0.0, 2.2e-5, 0.0062, 0.149, 1.0];
        let weight = prop_oneof![Just(0.0), Just(1.0), Just(0.25), (-30.0f64..2.0).prop_map(f64::exp)];
        let ladder = (weight, 0usize..4, 2usize..=5).prop_map(|(w, from, to)| {
            let to = to.max(from + 2);
            (from..to).map(|t| Choice::new(COSTS[t], w * EPS[t])).collect::<Vec<_>>()
        });
        let general = prop::collection::vec((0u32..30, prop_oneof![Just(0.0), 0.0f64..5.0]).prop_map(|(c, d)| Choice::new(c as f64, d)), 1..=6);
        prop::collection::vec(prop_oneof![4 => ladder, 1 => general], 1..700)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 300, ..Default::default() })]

        /// The radix pass then quickselect inside one bucket equals the quickselect over all
        /// moves: same moves per item, same marginal price, for budgets from "short by one
        /// byte" to "everything moves".
        #[test]
        fn radix_prefix_equals_quickselect(items in mixed_items(), fracs in proptest::collection::vec(0.0f64..=1.0, 1..6)) {
            let (choices, start) = flat(&items);
            let h = Hulls::new(&choices, &start);
            let total: f64 = h.save.iter().sum();
            for f in fracs {
                let need = (f * total).round().max(1.0);
                let (steps, lambda, _) = prefix(&h.span(), need);
                let want = prefix_by_quickselect(&h, need);
                proptest::prop_assert_eq!(&steps, &want.0, "need {}", need);
                proptest::prop_assert_eq!(lambda.to_bits(), want.1.to_bits(), "need {}", need);
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, ..Default::default() })]

        /// Groups built in one [`GroupHulls`] and solved one by one, with their choices
        /// recomputed through the closure, give each group the solution [`solve_flat`] gives
        /// its items alone, bit for bit (picks, sums, λ, dual, gap, feasibility).
        #[test]
        fn groups_solve_as_alone(items in mixed_items(), cuts in proptest::collection::vec(0.0f64..1.0, 0..4), fracs in proptest::collection::vec(0.0f64..=1.2, 4)) {
            let mut bounds: Vec<usize> = cuts.iter().map(|c| (c * items.len() as f64) as usize).collect();
            bounds.extend([0, items.len()]);
            bounds.sort_unstable();
            let groups: Vec<&[Vec<Choice>]> = bounds.windows(2).map(|w| &items[w[0]..w[1]]).collect();
            let mut g = GroupHulls::with_capacity(items.len(), 0);
            for group in &groups {
                for it in group.iter() {
                    g.push_item(it);
                }
                g.close_group();
            }
            for (k, group) in groups.iter().enumerate() {
                let (choices, start) = flat(group);
                let top: f64 = group.iter().map(|c| c[0].cost).sum();
                let budget = (fracs[k % fracs.len()] * top).round();
                let want = solve_flat(&choices, &start, budget);
                let got = g.solve_group(k, budget, |i: usize, c: usize| group[i][c]);
                let bits = |s: &Solution| [s.cost, s.dist, s.lambda, s.dual, s.gap].map(f64::to_bits);
                proptest::prop_assert_eq!(&got.pick, &want.pick);
                proptest::prop_assert_eq!(bits(&got), bits(&want));
                proptest::prop_assert_eq!(got.feasible, want.feasible);
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, ..Default::default() })]

        /// Items handed over as cost and distortion arrays ([`GroupHulls::push_points`], and
        /// [`GroupHulls::push_array`] for the lengths RDKV dispatches on: the ladder paths it
        /// poses through, or the general path for the others) get the hulls, prices, savings
        /// and sums [`GroupHulls::push_item`] gives them, bit for bit.
        #[test]
        fn push_points_poses_as_push_item(items in mixed_items(), long in long_item()) {
            fn array<const N: usize>(g: &mut GroupHulls, cost: &[f64], dist: &[f64]) {
                g.push_array::<N>(cost.try_into().unwrap(), dist.try_into().unwrap());
            }
            let mut items = items;
            items.push(long);
            let mut by_item = GroupHulls::with_capacity(items.len(), 0);
            let (mut by_points, mut by_array) = (GroupHulls::with_capacity(items.len(), 0), GroupHulls::with_capacity(items.len(), 0));
            for it in &items {
                by_item.push_item(it);
                let (cost, dist): (Vec<f64>, Vec<f64>) = it.iter().map(|c| (c.cost, c.dist)).unzip();
                by_points.push_points(&cost, &dist);
                match it.len() {
                    2 => array::<2>(&mut by_array, &cost, &dist),
                    3 => array::<3>(&mut by_array, &cost, &dist),
                    4 => array::<4>(&mut by_array, &cost, &dist),
                    5 => array::<5>(&mut by_array, &cost, &dist),
                    6 => array::<6>(&mut by_array, &cost, &dist),
                    _ => by_array.push_points(&cost, &dist),
                }
            }
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let sums = |g: &GroupHulls| g.groups.iter().map(|x| [x.1, x.2, x.3].map(f64::to_bits)).collect::<Vec<_>>();
            by_item.close_group();
            for mut g in [by_points, by_array] {
                g.close_group();
                let (a, b) = (&by_item.hulls, &g.hulls);
                proptest::prop_assert_eq!(&a.idx, &b.idx);
                proptest::prop_assert_eq!(&a.at, &b.at);
                proptest::prop_assert_eq!(bits(&a.rho), bits(&b.rho));
                proptest::prop_assert_eq!(bits(&a.save), bits(&b.save));
                proptest::prop_assert_eq!(sums(&by_item), sums(&g));
            }
        }
    }

    proptest::proptest! {
        /// The float-register finiteness test answers as `f64::is_finite` on any bits
        /// (infinities, NaNs of every payload, subnormals, zeros of both signs included).
        #[test]
        fn finite_is_is_finite(bits in proptest::prelude::any::<u64>(), special in 0usize..8) {
            let specials = [f64::INFINITY, f64::NEG_INFINITY, f64::NAN, -0.0, 0.0, f64::MAX, f64::MIN_POSITIVE / 2.0, f64::from_bits(bits)];
            for x in [f64::from_bits(bits), specials[special]] {
                proptest::prop_assert_eq!(finite(x), x.is_finite(), "{:?}", x);
            }
        }
    }

    /// One item of up to 40 arbitrary choices on a coarse grid (many equal costs, ties and
    /// collinear points).
    fn long_item() -> impl proptest::strategy::Strategy<Value = Vec<Choice>> {
        use proptest::prelude::*;
        prop::collection::vec((0u32..40, 0u32..8).prop_map(|(c, d)| Choice::new(c as f64, d as f64 * 0.5)), 1..40)
    }

    proptest::proptest! {
        /// The stacked slopes give the hull and prices of the chord test, bit for bit, on
        /// ladders, general lists (ties, equal costs, collinear points) and long items.
        #[test]
        fn hull_equals_the_chord_test(items in mixed_items(), long in long_item()) {
            let mut items = items;
            items.push(long);
            let (choices, start) = flat(&items);
            let h = Hulls::new(&choices, &start);
            for (i, it) in items.iter().enumerate() {
                let (idx, rho) = hull_by_chords(it);
                proptest::prop_assert_eq!(h.idx(i), &idx[..]);
                proptest::prop_assert_eq!(h.rho(i).iter().map(|r| r.to_bits()).collect::<Vec<_>>(), rho.iter().map(|r| r.to_bits()).collect::<Vec<_>>());
            }
        }
    }

    /// Thousands of moves at a handful of prices (equal weights): the end bucket holds far
    /// more than the quickselect's short pass, and ties are broken by (item, step).
    #[test]
    fn radix_prefix_with_one_crowded_bucket() {
        let items: Vec<Vec<Choice>> = (0..2000).map(|i| ch(&[(1000.0, 0.0), (600.0, 0.5), (350.0, 1.0 + (i % 2) as f64 * 1e-12), (0.0, 9.0)])).collect();
        let (choices, start) = flat(&items);
        let h = Hulls::new(&choices, &start);
        for need in [1.0, 399.0, 400.0, 401.0, 1e5, 7e5, 1.2e6, 2e6] {
            let (steps, lambda, _) = prefix(&h.span(), need);
            assert_eq!((steps, lambda), prefix_by_quickselect(&h, need), "need {need}");
        }
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
