//! RDKV (seed 002): rate-distortion bit allocation by a multiple-choice knapsack.
//!
//! * [`token_weights`] (Prop. 3.1, `w_t = Σ_τ a_τt`, Alg. 1 lines 5–6 with the average pool)
//!   and [`channel_weights`] (Prop. 3.2, `w_c = ‖Q[:,c]‖‖K[:,c]‖/√d`);
//! * [`allocate`]: Alg. 2, `min Σ_u w_u ε(b_u) s.t. Σ_u b_u · cost_per_bit ≤ budget`, by
//!   Lagrangian bisection, with the weak-duality gap of Prop. A.3;
//! * [`allocate_head`]: Alg. 1 stages 2–3 for one head — V (tokens) first with half the
//!   budget, then K (channels) over the *kept* tokens only with the other half;
//! * [`RdkvController`]: the same objective on kvforge pages.
//!
//! **Deviation (pages, not tokens/channels).** kvforge pages are tier-homogeneous: one page of
//! 64 tokens has one tier, and a tier fixes the bits of *both* K (all channels) and V. The
//! paper's per-token V widths and per-channel K widths therefore cannot be stored. The page
//! controller aggregates instead: a page's weight is the sum of its tokens' weights
//! `w_p = Σ_{t∈p} w_t` (the TV distance of evicting the whole page, Prop. 3.1 summed), its
//! distortion at tier b is `w_p · (ε_K(b_K) + ε_V(b_V)) / 2`, its cost is the tier's real page
//! bytes (metadata included, not `bits × scalars`), and the knapsack runs over pages. The V-
//! before-K order collapses: evicting a page frees its K and V bytes together, so no K budget
//! is spent on evicted tokens — the reason the paper orders the stages. The channel weights
//! have no page analogue (they would need per-channel tiers inside a page); they are kept for
//! [`allocate_head`]. Like the paper the page controller has no hysteresis (it is meant to run
//! once after prefill); pages still only move down. Its weights are the paper's linear ones
//! by default ([`Proxy::Linear`]); summed per page they tie uniform quantisation at b8/b4
//! bytes on the synthetic end-to-end test (beating it only at b2), while
//! [`Proxy::Concentration`] beats it at all three (see `tests/e2e.rs`).
//!
//! Also unlike Alg. 2, which stops when the average width is within 1% of the target and may
//! land on either side, [`allocate`] never exceeds the budget.

use kvforge_spec::{KeyScheme, Spec, TierId, ValueScheme};

use crate::distortion::{DistortionTable, Proxy};
use crate::knapsack::{self, Choice};
use crate::plan::{assemble, Decision, HeadHulls, Limits, Plan, Problem, ViewDistortion};
use crate::signal::{PageId, PageInfo, PageTableView};
use crate::Controller;

/// Seed 002 Table 14, LLaMA-3.1-8B, K cache per-channel NMSE; ε(16) = 0, ε(0) = 1.
pub const EPS_K_LLAMA31_8B: [(u32, f64); 5] = [(16, 0.0), (8, 2.2e-5), (4, 0.0062), (2, 0.149), (0, 1.0)];
/// Seed 002 Table 14, LLaMA-3.1-8B, V cache per-token NMSE.
pub const EPS_V_LLAMA31_8B: [(u32, f64); 5] = [(16, 0.0), (8, 4.9e-5), (4, 0.0140), (2, 0.313), (0, 1.0)];

/// One solved allocation.
#[derive(Clone, Debug, PartialEq)]
pub struct Allocation {
    /// Bit width of every unit.
    pub bits: Vec<u32>,
    /// Σ w_u ε(b_u).
    pub distortion: f64,
    /// Σ b_u · cost_per_bit.
    pub cost: f64,
    /// Final Lagrange multiplier (distortion per unit cost at the margin).
    pub lambda: f64,
    /// `distortion − max_λ g(λ)`: the allocation is within this of the optimum.
    pub duality_gap: f64,
    pub feasible: bool,
}

/// Seed 002 Alg. 2: bits per unit from `eps` (`(bits, ε(bits))` pairs) minimising
/// `Σ w_u ε(b_u)` with `Σ b_u · cost_per_bit ≤ budget`.
pub fn allocate(weights: &[f64], eps: &[(u32, f64)], cost_per_bit: f64, budget: f64) -> Allocation {
    assert!(!eps.is_empty(), "allocate: the distortion table is empty");
    // Flat (one allocation, not one per unit: 32K units per head after a 32K prefill).
    // Sized up front: collected from `flat_map` (no size hint) it grew by doubling, copying
    // megabytes at 32K units.
    let mut choices: Vec<Choice> = Vec::with_capacity(weights.len() * eps.len());
    choices.extend(weights.iter().flat_map(|&w| eps.iter().map(move |&(b, e)| Choice::new(b as f64 * cost_per_bit, w * e))));
    let start: Vec<usize> = (0..=weights.len()).map(|i| i * eps.len()).collect();
    let s = knapsack::solve_flat(&choices, &start, budget);
    Allocation { bits: s.pick.iter().map(|&i| eps[i].0).collect(), distortion: s.dist, cost: s.cost, lambda: s.lambda, duality_gap: s.gap, feasible: s.feasible }
}

/// Token weights `w_t = Σ_τ a_τt` of an attention matrix `attn` (`[queries][T]`, rows are
/// the observation window's queries, GQA heads stacked), smoothed by a same-length average
/// pool of width `pool` (windows clipped at the ends; `pool ≤ 1` disables it).
pub fn token_weights(attn: &[f64], tokens: usize, pool: usize) -> Vec<f64> {
    assert!(tokens > 0 && attn.len() % tokens == 0, "token_weights: attn must be [queries][{tokens}]");
    let mut w = vec![0.0; tokens];
    for row in attn.chunks_exact(tokens) {
        for (x, a) in w.iter_mut().zip(row) {
            *x += a;
        }
    }
    if pool <= 1 {
        return w;
    }
    let half = pool / 2;
    (0..tokens)
        .map(|t| {
            let (lo, hi) = (t.saturating_sub(half), (t + pool - half).min(tokens));
            w[lo..hi].iter().sum::<f64>() / (hi - lo) as f64
        })
        .collect()
}

/// Channel weights `w_c = ‖Q[:,c]‖₂ ‖K[:,c]‖₂ / √d` of queries `q` (`[nq][d]`) and keys `k`
/// (`[T][d]`).
pub fn channel_weights(q: &[f64], k: &[f64], d: usize) -> Vec<f64> {
    let col = |m: &[f64], c: usize| m.chunks_exact(d).map(|r| r[c] * r[c]).sum::<f64>().sqrt();
    (0..d).map(|c| col(q, c) * col(k, c) / (d as f64).sqrt()).collect()
}

/// Both stages of one head.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadAllocation {
    /// Per-token V widths (stage 2).
    pub v: Allocation,
    /// Per-channel K widths over the kept tokens (stage 3).
    pub k: Allocation,
    /// Tokens with a V width > 0.
    pub kept: Vec<usize>,
}

/// Seed 002 Alg. 1 stages 2–3 for one head with a budget of `budget_bits` bits: V first
/// (each token holds `d` scalars) with half the budget, then K (each channel holds
/// `|kept|` scalars) with the other half.
pub fn allocate_head(token_w: &[f64], channel_w: &[f64], eps_v: &[(u32, f64)], eps_k: &[(u32, f64)], budget_bits: f64, d: usize) -> HeadAllocation {
    let v = allocate(token_w, eps_v, d as f64, budget_bits / 2.0);
    let kept: Vec<usize> = v.bits.iter().enumerate().filter(|(_, &b)| b > 0).map(|(t, _)| t).collect();
    let k = if kept.is_empty() {
        // No token left: every channel is empty, K costs nothing and carries nothing.
        let zero = eps_k.iter().position(|e| e.0 == 0);
        let (b, e) = zero.map_or((0, 0.0), |i| eps_k[i]);
        let distortion = channel_w.iter().map(|w| w * e).sum();
        Allocation { bits: vec![b; channel_w.len()], distortion, cost: 0.0, lambda: 0.0, duality_gap: 0.0, feasible: true }
    } else {
        allocate(channel_w, eps_k, kept.len() as f64, budget_bits / 2.0)
    };
    HeadAllocation { v, k, kept }
}

/// Why a spec cannot be driven by RDKV.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RdkvError {
    #[error("tier `{0}` codes keys spherically; RDKV's tables are for integer bit widths")]
    Spherical(String),
    #[error("no ε for {0} bits in the distortion table")]
    MissingBits(u32),
}

/// ε_K of a key scheme from the per-bit table; a mixed key averages its segments' ε over the
/// channels (uniform channel weights; [`mixed_key_distortion`] weighs them).
fn key_eps(k: &KeyScheme, name: &str, eps_k: &[(u32, f64)]) -> Result<f64, RdkvError> {
    let Some(widths) = k.codec().bit_widths() else { return Err(RdkvError::Spherical(name.to_string())) };
    widths.into_iter().map(|(bits, share)| Ok(share * lookup(eps_k, bits)?)).sum()
}

/// Seed 002 Alg. 1 stage 4 for a mixed-key tier: the channel order of one head, heaviest
/// channel weight first (ties by channel index), so that the widest segments hold the
/// heaviest channels. For a fixed segment histogram this order minimises `Σ_c w_c ε(b_c)`
/// (rearrangement inequality: ε falls as bits rise), which is the per-channel stage of the
/// paper's knapsack restricted to the spec's histogram.
pub fn channel_order(channel_w: &[f64]) -> Vec<u16> {
    let mut order: Vec<u16> = (0..channel_w.len() as u16).collect();
    order.sort_by(|&a, &b| channel_w[b as usize].total_cmp(&channel_w[a as usize]).then(a.cmp(&b)));
    order
}

/// `Σ_j w[order[j]] · ε(b_j)` of a mixed key whose stored position j has width b_j (dropped
/// positions ε(0)): the K distortion of one head under a channel order.
pub fn mixed_key_distortion(segments: &[kvforge_spec::ChannelSegment], d: usize, channel_w: &[f64], order: &[u16], eps_k: &[(u32, f64)]) -> Result<f64, RdkvError> {
    order.iter().zip(&kvforge_spec::mixed_widths(segments, d)).map(|(&c, &b)| Ok(channel_w[c as usize] * lookup(eps_k, b)?)).sum()
}

/// ε_V of a value scheme from the per-bit table (every value codec is a per-element width).
fn value_eps(v: &ValueScheme, eps_v: &[(u32, f64)]) -> Result<f64, RdkvError> {
    let widths = v.codec().bit_widths().expect("value codecs store every element at a bit width");
    widths.into_iter().map(|(bits, share)| Ok(share * lookup(eps_v, bits)?)).sum()
}

fn lookup(table: &[(u32, f64)], bits: u32) -> Result<f64, RdkvError> {
    table.iter().find(|e| e.0 == bits).map(|e| e.1).ok_or(RdkvError::MissingBits(bits))
}

/// RDKV on kvforge pages (see the module docs for the deviation from the paper).
#[derive(Clone, Debug)]
pub struct RdkvController {
    /// ε per tier id: `(ε_K(b_K) + ε_V(b_V)) / 2`.
    pub table: DistortionTable,
    /// The paper's linear weights by default.
    pub proxy: Proxy,
    /// Split the budget equally over kv heads and solve each head alone, as the paper
    /// allocates per head (heads whose protected pages exceed their share get their minimum
    /// and the rest is re-split). False: one knapsack over all heads.
    pub per_head: bool,
    /// Views of at least this many pages solve their heads on the rayon pool (default
    /// [`runtime::pool_pages`](crate::runtime::pool_pages)); a field so that a host can be
    /// measured both ways.
    pub parallel_pages: usize,
}

impl RdkvController {
    /// With seed 002's LLaMA-3.1-8B tables.
    pub fn new(spec: &Spec) -> Result<RdkvController, RdkvError> {
        RdkvController::with_tables(spec, &EPS_K_LLAMA31_8B, &EPS_V_LLAMA31_8B)
    }

    pub fn with_tables(spec: &Spec, eps_k: &[(u32, f64)], eps_v: &[(u32, f64)]) -> Result<RdkvController, RdkvError> {
        let eps = spec.tiers.iter().map(|t| Ok(0.5 * (key_eps(&t.key, &t.name, eps_k)? + value_eps(&t.value, eps_v)?))).collect::<Result<Vec<f64>, RdkvError>>()?;
        Ok(RdkvController { table: DistortionTable { eps, drop_tier: crate::distortion::drop_tier(spec) }, proxy: Proxy::Linear, per_head: true, parallel_pages: crate::runtime::pool_pages() })
    }
}

/// Each kv head's share of `budget` given the least bytes each head can live on: equal
/// shares, except that heads which cannot live on an equal share get their minimum and the
/// rest is re-split (water-filling), as the paper allocates per head.
fn head_shares(min_cost: &[f64], budget: f64) -> Vec<f64> {
    let n = min_cost.len();
    let mut pinned = vec![false; n];
    loop {
        let free = pinned.iter().filter(|&&p| !p).count();
        let left = budget - (0..n).filter(|&h| pinned[h]).map(|h| min_cost[h]).sum::<f64>();
        let share = if free > 0 { left / free as f64 } else { 0.0 };
        let mut changed = false;
        for h in 0..n {
            if !pinned[h] && min_cost[h] > share {
                pinned[h] = true;
                changed = true;
            }
        }
        if !changed {
            return (0..n).map(|h| if pinned[h] { min_cost[h] } else { share }).collect();
        }
    }
}

impl Controller for RdkvController {
    fn decide(&mut self, view: &PageTableView, limits: &Limits) -> Plan {
        assert_eq!(self.table.eps.len(), view.costs.tiers.len(), "RDKV: the table and the view's spec have different tier counts");
        let budget = limits.budget.bytes(view.context_tokens, view.heads.len());
        let table = &self.table;
        // Weights in view order: page (h, i) is at offset[h] + i (a hash map of 4096 pages,
        // looked up once per tier of every page, was a fifth of the decision at 32K tokens).
        let weights = self.proxy.weights(view);
        let offset = view.offsets();
        let weight = |id: PageId| weights[offset[id.head] + id.index];
        let opts = |id: PageId, p: &PageInfo, out: &mut Vec<(TierId, f64)>| out.extend(limits.protection.allowed_tiers(p, view.context_tokens, &view.costs).map(|t| (t, table.page(weight(id), t))));
        let (sol, decisions) = if self.per_head {
            // Heads are independent knapsacks: one problem per head over its own pages (the
            // other heads' pages enter only as fixed bytes). The table is copied out (not read
            // through references on every call).
            let dist = ViewDistortion { pages: table.pages(), weights: &weights, offset: &offset };
            let pool = view.num_pages() >= self.parallel_pages && rayon::current_num_threads() > 1;
            let (solved, decisions) = if pool { decide_heads_on_pool(view, limits, budget, dist) } else { decide_heads(view, limits, budget, dist) };
            let agg = solved.into_iter().reduce(|a, s| knapsack::Solution { lambda: a.lambda.max(s.lambda), gap: a.gap + s.gap, feasible: a.feasible && s.feasible, ..a });
            (agg.unwrap_or_else(|| knapsack::solve(&[], budget)), decisions)
        } else {
            Problem::build(view, opts).solve(view, budget)
        };
        assemble(view, decisions, budget, &sol, Vec::new(), ViewDistortion { pages: table.pages(), weights: &weights, offset: &offset })
    }
}

impl RdkvController {
    /// Every layer's allocation after one prefill, the layers on the rayon pool (each layer's
    /// heads on its one thread): the same plans as [`decide`](Controller::decide) per layer.
    ///
    /// RDKV runs once, after the prefill of all layers, and the layers' knapsacks are
    /// independent. One layer's decision is a small fraction of that layer's prefill, and the
    /// layers' decisions spread over the pool cost a fraction of that per layer.
    pub fn decide_layers(&self, views: &[PageTableView], limits: &Limits) -> Vec<Plan> {
        use rayon::prelude::*;
        let one = RdkvController { parallel_pages: usize::MAX, ..self.clone() };
        views.par_iter().map(|v| one.clone().decide(v, limits)).collect()
    }
}

/// Every head's solution and all decisions, in page order (heads in turn, each head's in
/// page order), on the calling thread: every head's problem posed in one pass
/// ([`HeadHulls::build_allowed`]), the budget split, then the heads solved in turn.
fn decide_heads(view: &PageTableView, limits: &Limits, budget: f64, dist: ViewDistortion) -> (Vec<knapsack::Solution>, Vec<Decision>) {
    let problems = HeadHulls::build_allowed(view, &limits.protection, dist);
    let shares = head_shares(&problems.min_cost, budget);
    let mut decisions = Vec::new();
    let solved = (0..view.heads.len()).map(|h| problems.solve_head(view, h, shares[h], dist, &mut decisions)).collect();
    problems.recycle();
    (solved, decisions)
}

/// [`decide_heads`] with the heads on the rayon pool, in one hand-off: the budget split needs
/// only each head's least bytes ([`HeadHulls::least_costs`], a cheap walk), so each pool
/// thread poses and solves its head. Posing was 40% of the decision and, with only the solves
/// on the pool, its serial part; a second hand-off cost more than it saved. Same numbers as `decide_heads`: each head's hulls, least and fixed bytes are built
/// as it builds them.
fn decide_heads_on_pool(view: &PageTableView, limits: &Limits, budget: f64, dist: ViewDistortion) -> (Vec<knapsack::Solution>, Vec<Decision>) {
    use rayon::prelude::*;
    let min_cost = HeadHulls::least_costs(view, &limits.protection);
    let shares = head_shares(&min_cost, budget);
    let per_head: Vec<(knapsack::Solution, Vec<Decision>)> = (0..view.heads.len())
        .into_par_iter()
        .map(|h| {
            let problem = HeadHulls::build_head(view, h, &limits.protection, dist);
            debug_assert_eq!(problem.min_cost[0].to_bits(), min_cost[h].to_bits(), "head {h}: least bytes differ");
            let mut d = Vec::new();
            let s = problem.solve_head(view, h, shares[h], dist, &mut d);
            problem.recycle();
            (s, d)
        })
        .collect();
    let mut decisions = Vec::with_capacity(per_head.iter().map(|x| x.1.len()).sum());
    let solved = per_head
        .into_iter()
        .map(|(s, d)| {
            decisions.extend(d);
            s
        })
        .collect();
    (solved, decisions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{Budget, CostModel, TierCosts};
    use crate::protect::Protection;

    /// RDKV's per-head decision as it was posed before [`HeadHulls`]: each head's least
    /// bytes from its own walk over the allowed tiers, then one [`Problem`] per head, solved
    /// and sorted on its own. The fast path must give the very same plan.
    fn decide_head_by_head(c: &RdkvController, view: &PageTableView, limits: &Limits) -> Plan {
        let budget = limits.budget.bytes(view.context_tokens, view.heads.len());
        let weights = c.proxy.weights(view);
        let offset = view.offsets();
        let min: Vec<f64> = (0..view.heads.len())
            .map(|h| view.heads[h].iter().map(|p| limits.protection.allowed_tiers(p, view.context_tokens, &view.costs).map(|t| view.costs.cost(t, p.tokens)).fold(f64::INFINITY, f64::min)).sum())
            .collect();
        let shares = head_shares(&min, budget);
        let mut all = Vec::new();
        let mut agg: Option<knapsack::Solution> = None;
        for h in 0..view.heads.len() {
            let (s, d) = Problem::build_head_allowed(view, h, &limits.protection, |i, t| c.table.page(weights[offset[h] + i], t)).solve(view, shares[h]);
            all.extend(d);
            agg = Some(match agg {
                None => s,
                Some(a) => knapsack::Solution { lambda: a.lambda.max(s.lambda), gap: a.gap + s.gap, feasible: a.feasible && s.feasible, ..a },
            });
        }
        all.sort_by_key(|d| d.page);
        let sol = agg.unwrap_or_else(|| knapsack::solve(&[], budget));
        assemble(view, all, budget, &sol, Vec::new(), |id: PageId, t: TierId| c.table.page(weights[offset[id.head] + id.index], t))
    }

    /// A view of `heads` kv heads whose pages sit in random ladder tiers with random masses
    /// (exact ties and zeros included), some pinned, each head ending in a partial tail page.
    fn view(spec: &Spec, heads: usize, pages: &[(u8, u8, bool)], tail: usize) -> PageTableView {
        let costs = TierCosts::from_spec(spec, 128, CostModel::Resident);
        let p = costs.page_tokens;
        let mass = |m: u8| match m % 4 {
            0 => 0.0,
            1 => 0.5,
            _ => f64::from(m) * 1e-3,
        };
        let per_head = pages.len().div_ceil(heads).max(1);
        let hs: Vec<Vec<PageInfo>> = pages
            .chunks(per_head)
            .map(|ps| {
                let mut v: Vec<PageInfo> =
                    ps.iter().enumerate().map(|(i, &(t, m, pin))| PageInfo { tier: 1 + t % 5, tokens: p, first_token: i * p, last_token: i * p + p - 1, mass: mass(m), token_mass: None, pinned: pin }).collect();
                let n = v.len();
                v.push(PageInfo { tier: kvforge_spec::TAIL_TIER, tokens: tail, first_token: n * p, last_token: n * p + tail - 1, mass: 0.01, token_mass: None, pinned: false });
                v
            })
            .collect();
        let context_tokens = per_head * p + tail;
        PageTableView { seq: 0, context_tokens, heads: hs, costs }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, ..Default::default() })]

        /// All heads posed in one pass ([`HeadHulls`]), and each head posed and solved on the
        /// pool, give the plan the head-by-head problems gave, field for field: budgets from
        /// "nothing moves" to "infeasible", protection on and off, both proxies.
        #[test]
        fn head_hulls_decide_as_head_by_head(
            pages in proptest::collection::vec((0u8..5, 0u8..40, proptest::prelude::any::<bool>()), 1..200),
            heads in 1usize..6,
            tail in 1usize..64,
            frac in 0.0f64..1.1,
            protect in proptest::prelude::any::<bool>(),
            concentration in proptest::prelude::any::<bool>(),
        ) {
            let spec = Spec::load(concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/rdkv.toml").as_ref()).expect("rdkv spec");
            let v = view(&spec, heads, &pages, tail);
            let fp16 = v.costs.cost(1, v.costs.page_tokens) / v.costs.page_tokens as f64;
            let protection = if protect { Protection { sink_tokens: 4, recent_tokens: 128, floor: 2 } } else { Protection::none() };
            let limits = Limits { budget: Budget::PerToken(frac * fp16), protection };
            let mut c = RdkvController::new(&spec).unwrap();
            if concentration {
                c.proxy = Proxy::Concentration;
            }
            let want = decide_head_by_head(&c, &v, &limits);
            let bits = |p: &Plan| [p.budget_bytes, p.cost_before, p.cost_after, p.distortion_before, p.distortion_after, p.lambda, p.duality_gap].map(f64::to_bits);
            // On the calling thread, and with the heads posed and solved on the pool.
            for parallel_pages in [usize::MAX, 0] {
                c.parallel_pages = parallel_pages;
                let got = c.decide(&v, &limits);
                proptest::prop_assert_eq!(&got.decisions, &want.decisions);
                proptest::prop_assert_eq!(bits(&got), bits(&want));
                proptest::prop_assert_eq!(got.feasible, want.feasible);
            }
            // The pool's budget split reads least bytes from a walk, not from the posed hulls.
            let none = vec![crate::distortion::Weights::default(); v.num_pages()];
            let offset = v.offsets();
            let posed = HeadHulls::build_allowed(&v, &limits.protection, ViewDistortion { pages: c.table.pages(), weights: &none, offset: &offset });
            let bits_of = |x: &[f64]| x.iter().map(|c| c.to_bits()).collect::<Vec<_>>();
            proptest::prop_assert_eq!(bits_of(&HeadHulls::least_costs(&v, &limits.protection)), bits_of(&posed.min_cost));
            posed.recycle();
        }
    }

    /// Layers on the pool ([`RdkvController::decide_layers`]) decide as each layer alone.
    #[test]
    fn layers_decide_as_each_alone() {
        let spec = Spec::load(concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/rdkv.toml").as_ref()).expect("rdkv spec");
        let views: Vec<PageTableView> = (0..5u8).map(|l| view(&spec, 3, &(0..90u8).map(|i| (i % 5, i.wrapping_mul(7 + l) % 40, i % 11 == 0)).collect::<Vec<_>>(), 17)).collect();
        let fp16 = views[0].costs.cost(1, views[0].costs.page_tokens) / views[0].costs.page_tokens as f64;
        let limits = Limits { budget: Budget::PerToken(0.3 * fp16), protection: Protection::none() };
        let c = RdkvController::new(&spec).unwrap();
        let plans = c.decide_layers(&views, &limits);
        assert_eq!(plans.len(), views.len());
        for (v, p) in views.iter().zip(&plans) {
            assert_eq!(*p, c.clone().decide(v, &limits));
            assert!(!p.decisions.is_empty(), "a 30% budget moves pages");
            assert!(p.feasible);
        }
    }
}
