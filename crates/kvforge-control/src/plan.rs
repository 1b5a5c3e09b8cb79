//! Decisions, plans, and the reduction of a page table view to a knapsack instance.

use kvforge_spec::TierId;

use crate::budget::{Budget, TierCosts};
use crate::distortion::{PageDistortion, Weights};
use crate::knapsack::{self, Choice, GroupHulls, Solution};
use crate::protect::Protection;
use crate::signal::{PageId, PageInfo, PageTableView};

/// Re-code one page into a lower tier (`to_tier` may be the drop tier).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub page: PageId,
    pub from_tier: TierId,
    pub to_tier: TierId,
}

/// What a controller is given besides the view.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    pub budget: Budget,
    pub protection: Protection,
}

/// A controller's answer for one sequence: the decisions and the numbers behind them.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// At most one per page, sorted by (head, index); tiers only move down.
    pub decisions: Vec<Decision>,
    pub budget_bytes: f64,
    pub cost_before: f64,
    pub cost_after: f64,
    /// Predicted distortion Σ_i D_i(tier_i) over all pages (drop penalties excluded).
    pub distortion_before: f64,
    pub distortion_after: f64,
    /// Marginal price (distortion per byte) of the last move, the knapsack's λ.
    pub lambda: f64,
    /// Weak-duality gap of the knapsack objective (penalties included); ∞ when infeasible.
    pub duality_gap: f64,
    /// `cost_after ≤ budget_bytes`. When false, every page is at the cheapest tier its
    /// protection allows: protected pages alone exceed the budget.
    pub feasible: bool,
    /// Pages moved while still in their hysteresis cooldown because the budget forced it.
    pub forced: Vec<PageId>,
}

impl Plan {
    /// The tier a page ends in under this plan.
    pub fn tier_of(&self, id: PageId, view: &PageTableView) -> Option<TierId> {
        match self.decisions.binary_search_by(|d| d.page.cmp(&id)) {
            Ok(i) => Some(self.decisions[i].to_tier),
            Err(_) => view.page(id).map(|p| p.tier),
        }
    }
}

/// Movable pages of a view as knapsack items, stored flat (see [`knapsack::solve_flat`]):
/// page `ids[i]` may take `tiers[start[i]..start[i + 1]]` at `choices[..]` of the same range.
pub(crate) struct Problem {
    pub ids: Vec<PageId>,
    pub tiers: Vec<TierId>,
    pub choices: Vec<Choice>,
    pub start: Vec<usize>,
    /// Cost of the pages that cannot move.
    pub fixed: f64,
}

impl Problem {
    /// `options(id, page, out)` pushes the tiers a page may take (current first) with the
    /// objective distortion of each into the empty `out`; a page with one option is fixed.
    pub fn build(view: &PageTableView, mut options: impl FnMut(PageId, &PageInfo, &mut Vec<(TierId, f64)>)) -> Problem {
        let mut p = Problem::with_capacity(view.num_pages(), view.costs.tiers.len());
        let mut opts = Vec::new();
        for (id, page) in view.iter() {
            opts.clear();
            options(id, page, &mut opts);
            p.push(view, id, page, &opts);
        }
        p
    }

    /// [`build`](Self::build) over kv head `head`'s pages only: a problem whose budget is the
    /// head's share (the other heads' pages enter neither `fixed` nor the items, so a head
    /// costs O(its pages), not O(all pages): at 8 heads the walks over the whole view were a
    /// quarter of RDKV's decision).
    #[cfg(test)]
    pub fn build_head(view: &PageTableView, head: usize, mut options: impl FnMut(PageId, &PageInfo, &mut Vec<(TierId, f64)>)) -> Problem {
        let pages = view.heads.get(head).map_or(&[][..], Vec::as_slice);
        let mut p = Problem::with_capacity(pages.len(), view.costs.tiers.len());
        let mut opts = Vec::new();
        for (index, page) in pages.iter().enumerate() {
            opts.clear();
            options(PageId { head, index }, page, &mut opts);
            p.push(view, PageId { head, index }, page, &opts);
        }
        p
    }

    /// [`build_head`](Self::build_head) for a controller whose options are the tiers
    /// `protection` allows ([`Protection::allowed_tiers`], current first), tier `t` of page
    /// `index` at distortion `dist(index, t)`: the same problem, written in place in one loop
    /// (building each page's options in a vector and copying them cost RDKV more than its
    /// knapsack at 32K tokens). RDKV poses all heads at once ([`HeadHulls`]); this is the
    /// one-head form the tests hold it to.
    #[cfg(test)]
    pub fn build_head_allowed(view: &PageTableView, head: usize, protection: &Protection, dist: impl Fn(usize, TierId) -> f64) -> Problem {
        let pages = view.heads.get(head).map_or(&[][..], Vec::as_slice);
        let costs = &view.costs;
        let mut p = Problem::with_capacity(pages.len(), costs.tiers.len());
        for (index, page) in pages.iter().enumerate() {
            let (lowest, no_drop) = protection.allowed_span(page, view.context_tokens, costs);
            let begin = p.choices.len();
            for t in page.tier..=lowest {
                if !(no_drop && costs.tiers[t as usize].drop) {
                    p.tiers.push(t);
                    p.choices.push(Choice::new(costs.cost(t, page.tokens), dist(index, t)));
                }
            }
            if p.choices.len() - begin <= 1 {
                // One option or none: fixed, as `push` keeps it.
                p.tiers.truncate(begin);
                p.choices.truncate(begin);
                p.fixed += costs.cost(page.tier, page.tokens);
            } else {
                p.ids.push(PageId { head, index });
                p.start.push(p.choices.len());
            }
        }
        p
    }

    /// Room for `n` pages of up to `tiers` options each (no reallocation while building: a
    /// page may take every tier of a ladder, five in RDKV's spec).
    fn with_capacity(n: usize, tiers: usize) -> Problem {
        let mut p = Problem { ids: Vec::with_capacity(n), tiers: Vec::with_capacity(tiers * n), choices: Vec::with_capacity(tiers * n), start: Vec::with_capacity(n + 1), fixed: 0.0 };
        p.start.push(0);
        p
    }

    /// Adds a page with its options; with one option or none it is fixed at its cost.
    fn push(&mut self, view: &PageTableView, id: PageId, page: &PageInfo, opts: &[(TierId, f64)]) {
        if opts.len() <= 1 {
            self.fixed += view.costs.cost(page.tier, page.tokens);
            return;
        }
        self.ids.push(id);
        for &(t, d) in opts {
            self.tiers.push(t);
            self.choices.push(Choice::new(view.costs.cost(t, page.tokens), d));
        }
        self.start.push(self.choices.len());
    }

    /// Solves for `budget` bytes (fixed pages included) and lists the tier changes.
    pub fn solve(&self, view: &PageTableView, budget: f64) -> (Solution, Vec<Decision>) {
        let s = knapsack::solve_flat(&self.choices, &self.start, budget - self.fixed);
        let mut d: Vec<Decision> = Vec::new();
        for (i, (&id, &pick)) in self.ids.iter().zip(&s.pick).enumerate() {
            let from = view.page(id).unwrap().tier;
            let to = self.tiers[self.start[i] + pick];
            if to != from {
                d.push(Decision { page: id, from_tier: from, to_tier: to });
            }
        }
        d.sort_by_key(|x| x.page);
        (s, d)
    }
}

/// The distortion of every page of a view at every tier: page `index` of kv head `head` at
/// tier `t` costs `pages.page(weights[offset[head] + index], t)` ([`PageDistortion::page`]).
/// Posing reads a page's weights once for all its tiers, from its head's slice, with the
/// table in registers (a closure `(head, index, tier) → f64`, called per tier and not
/// inlined, looked the weights up again for every tier).
#[derive(Clone, Copy)]
pub(crate) struct ViewDistortion<'a> {
    pub pages: PageDistortion<'a>,
    /// Every page's weights in view order (heads in turn).
    pub weights: &'a [Weights],
    /// Where each head's pages start in `weights`.
    pub offset: &'a [usize],
}

impl<'a> ViewDistortion<'a> {
    /// The weights of head `head`'s pages, in page order.
    pub fn head(&self, head: usize) -> &'a [Weights] {
        &self.weights[self.offset[head]..]
    }

    #[inline(always)]
    pub fn page(&self, id: PageId, tier: TierId) -> f64 {
        self.pages.page(self.head(id.head)[id.index], tier)
    }
}

/// Every kv head's [`Problem`] of a view as hulls, built in one pass without storing the
/// problems (one set of vectors for all heads, not one per head; and no choices or tier
/// lists: at 32K tokens × 8 kv heads, writing every page's options out and reading them back
/// for the hulls cost as much as the hulls). A page's options are recomputed from its tier
/// and distortion when the solution is summed, giving the same numbers.
///
/// Head `h`'s pages that cannot move cost `fixed[h]`, and the cheapest tier every page of it
/// may take costs `min_cost[h]` in all (what a budget split must leave a head).
pub(crate) struct HeadHulls {
    hulls: GroupHulls,
    /// Index within its head of every movable page, heads in turn (the hulls' items).
    pages: Vec<u32>,
    /// Bytes of a full page in each tier (a page that can move is full).
    full_cost: Vec<f64>,
    /// Head of group 0 (0, or the head a [`build_head`](Self::build_head) posed): group `h - first_head` is head `h`, and so are `fixed` and `min_cost`.
    first_head: usize,
    pub fixed: Vec<f64>,
    pub min_cost: Vec<f64>,
}

impl HeadHulls {
    /// [`Problem::build_head_allowed`] for every head in one pass, straight into hulls: page
    /// `index` of head `head` at tier `t` has distortion `dist.page(head, index, t)`. Each head's
    /// items, choices and fixed cost are those `build_head_allowed` poses, and `min_cost[h]`
    /// sums, page by page in order, the least cost over the tiers `protection` allows.
    pub fn build_allowed(view: &PageTableView, protection: &Protection, dist: ViewDistortion) -> HeadHulls {
        let mut out = HeadHulls::empty(view, 0, view.num_pages());
        let allowed = Allowed::new(view, protection);
        for head in 0..view.heads.len() {
            out.push_head(view, head, &allowed, dist);
        }
        out
    }

    /// [`build_allowed`](Self::build_allowed) of head `head` alone (its `fixed` and
    /// `min_cost` are entry 0): what a pool thread builds, so that the heads' hulls are built
    /// side by side and not only solved side by side.
    pub fn build_head(view: &PageTableView, head: usize, protection: &Protection, dist: ViewDistortion) -> HeadHulls {
        let mut out = HeadHulls::empty(view, head, view.heads[head].len());
        out.push_head(view, head, &Allowed::new(view, protection), dist);
        out
    }

    /// Every head's `min_cost` as [`build_allowed`](Self::build_allowed) sums it, without
    /// posing anything: what the budget split needs before the heads are posed on the pool.
    pub fn least_costs(view: &PageTableView, protection: &Protection) -> Vec<f64> {
        let allowed = Allowed::new(view, protection);
        view.heads.iter().map(|pages| pages.iter().fold(-0.0f64, |sum, page| sum + allowed.least_cost(page))).collect()
    }

    fn empty(view: &PageTableView, first_head: usize, pages: usize) -> HeadHulls {
        let costs = &view.costs;
        HeadHulls {
            hulls: GroupHulls::with_capacity(pages, pages * costs.tiers.len()),
            pages: Vec::with_capacity(pages),
            full_cost: (0..costs.tiers.len()).map(|t| costs.cost(t as TierId, costs.page_tokens)).collect(),
            first_head,
            fixed: Vec::new(),
            min_cost: Vec::new(),
        }
    }

    /// Poses head `head`'s problem as the next group of hulls. A page that can move is full,
    /// so its options cost the full pages' bytes of its tiers, and the page's ladder goes to
    /// the hulls as two short arrays (no vector of options per page).
    fn push_head(&mut self, view: &PageTableView, head: usize, allowed: &Allowed, dist: ViewDistortion) {
        let costs = &view.costs;
        let (table, weights) = (dist.pages, dist.head(head));
        // The fixed cost starts at 0 as `build_head_allowed`'s does; the least costs are
        // summed as `Iterator::sum` sums them (from −0.0).
        let (mut fixed, mut min_cost) = (0.0f64, -0.0f64);
        for (index, page) in view.heads[head].iter().enumerate() {
            let (first, count) = allowed.span(page);
            if count <= 1 {
                // Its own tier or nothing (a protected page in the drop tier): fixed.
                min_cost += if count == 1 { f64::INFINITY.min(costs.cost(first, page.tokens)) } else { f64::INFINITY };
                fixed += costs.cost(page.tier, page.tokens);
                continue;
            }
            let cost = &self.full_cost[first as usize..first as usize + count];
            let dist = |k: usize| table.page(weights[index], first + k as TierId);
            min_cost += match count {
                2 => push_ladder::<2>(&mut self.hulls, cost, dist),
                3 => push_ladder::<3>(&mut self.hulls, cost, dist),
                4 => push_ladder::<4>(&mut self.hulls, cost, dist),
                5 => push_ladder::<5>(&mut self.hulls, cost, dist),
                6 => push_ladder::<6>(&mut self.hulls, cost, dist),
                _ => {
                    self.hulls.push_points(cost, &(0..count).map(dist).collect::<Vec<f64>>());
                    least(cost)
                }
            };
            self.pages.push(index as u32);
        }
        self.hulls.close_group();
        self.fixed.push(fixed);
        self.min_cost.push(min_cost);
    }

    /// Solves head `h` for `budget` bytes (its fixed pages included) and appends its tier
    /// changes to `decisions`, in page order (what [`Problem::solve`] lists for the head);
    /// `dist` is the one the hulls were built with.
    pub fn solve_head(&self, view: &PageTableView, h: usize, budget: f64, dist: ViewDistortion, decisions: &mut Vec<Decision>) -> Solution {
        let pages = &view.heads[h][..];
        let (table, weights) = (dist.pages, dist.head(h));
        let g = h - self.first_head;
        let items = &self.pages[self.hulls.items(g)];
        let choices = PageChoices { items, pages, full_cost: &self.full_cost, table, weights };
        let s = self.hulls.solve_group(g, budget - self.fixed[g], choices);
        for (&index, &pick) in items.iter().zip(&s.pick) {
            if pick != 0 {
                let from = pages[index as usize].tier;
                decisions.push(Decision { page: PageId { head: h, index: index as usize }, from_tier: from, to_tier: from + pick as TierId });
            }
        }
        s
    }

    /// Keeps the hulls' storage for this thread's next decision.
    pub fn recycle(self) {
        self.hulls.recycle();
    }
}

/// A page's ladder of `N` tiers (costs `cost`, distortions `dist(k)`) into the hulls as arrays
/// of a length known when compiling ([`GroupHulls::push_array`]): `push_head` dispatches on
/// the tier count, up to 6 tiers (RDKV's ladder has 5). Returns the least of the costs.
#[inline(always)]
fn push_ladder<const N: usize>(hulls: &mut GroupHulls, cost: &[f64], dist: impl Fn(usize) -> f64) -> f64 {
    let cost: &[f64; N] = cost.try_into().expect("a ladder of N tiers");
    hulls.push_array(cost, &std::array::from_fn(dist));
    least(cost)
}

/// The least of a page's option costs (as `min` folds them from ∞, in order).
#[inline(always)]
fn least(cost: &[f64]) -> f64 {
    cost.iter().fold(f64::INFINITY, |m, &c| m.min(c))
}

/// The options of one head's movable pages as [`HeadHulls::solve_head`] reads them back:
/// option `k` of item `i` (page `items[i]`) is `k` tiers below the page's own (see
/// [`Allowed::span`]), at a full page's bytes and the page's distortion.
struct PageChoices<'a> {
    items: &'a [u32],
    pages: &'a [PageInfo],
    full_cost: &'a [f64],
    table: PageDistortion<'a>,
    weights: &'a [Weights],
}

impl knapsack::ItemChoices for PageChoices<'_> {
    #[inline(always)]
    fn choice(&self, item: usize, k: usize) -> Choice {
        let index = self.items[item] as usize;
        let t = self.pages[index].tier + k as TierId;
        Choice::new(self.full_cost[t as usize], self.table.page(self.weights[index], t))
    }
}

/// The tiers `protection` allows every page of a view ([`Protection::allowed_tiers`]), as a
/// span `first..first + count` of consecutive tiers: the page's own tier down to its lowest
/// allowed one, a protected page stopping above the drop tier (the spec puts it last). What
/// the span depends on besides the page (the lowest live tier: a scan of the tiers in
/// [`Protection::guard`]) is read once per view, not once per page.
pub(crate) struct Allowed<'a> {
    costs: &'a TierCosts,
    protection: Protection,
    context_tokens: usize,
    /// The floor of protected pages, clamped to the lowest live tier.
    floor: TierId,
    last: TierId,
}

impl<'a> Allowed<'a> {
    pub fn new(view: &'a PageTableView, protection: &Protection) -> Allowed<'a> {
        let costs = &view.costs;
        Allowed { costs, protection: *protection, context_tokens: view.context_tokens, floor: protection.floor.min(costs.lowest_live()), last: costs.tiers.len() as TierId - 1 }
    }

    /// `(first, count)`: the page may take tiers `first..first + count`, current first (the
    /// tiers of [`Protection::allowed_tiers`]; a fixed page has its own tier alone).
    ///
    /// # Panics
    /// If a protected page's span holds a drop tier other than its last.
    #[inline]
    pub fn span(&self, page: &PageInfo) -> (TierId, usize) {
        let costs = self.costs;
        if !page.movable(costs.page_tokens) || !costs.contains(page.tier) {
            return (page.tier, 1);
        }
        if !self.protection.protects(page, self.context_tokens) {
            return (page.tier, usize::from(self.last - page.tier) + 1);
        }
        let lowest = self.floor.max(page.tier);
        let drop = |t: TierId| costs.tiers[t as usize].drop;
        assert!(!(page.tier..lowest).any(drop), "the drop tier must be the last of the ladder");
        (page.tier, usize::from(lowest - page.tier) + usize::from(!drop(lowest)))
    }

    /// The least cost over the tiers the page may take (∞ when none).
    pub fn least_cost(&self, page: &PageInfo) -> f64 {
        let (first, count) = self.span(page);
        (first..first + count as TierId).fold(f64::INFINITY, |m, t| m.min(self.costs.cost(t, page.tokens)))
    }
}

/// The predicted distortion of page `id` at tier `tier`, as [`assemble`] sums it for every
/// page: any `Fn(PageId, TierId) -> f64`, or a [`ViewDistortion`], whose method inlines into
/// the sums (RDKV's closure was a call per page and tier, spilling the sums around it).
pub(crate) trait PageDist {
    fn dist(&self, id: PageId, tier: TierId) -> f64;
}

impl<F: Fn(PageId, TierId) -> f64> PageDist for F {
    #[inline(always)]
    fn dist(&self, id: PageId, tier: TierId) -> f64 {
        self(id, tier)
    }
}

impl PageDist for ViewDistortion<'_> {
    #[inline(always)]
    fn dist(&self, id: PageId, tier: TierId) -> f64 {
        self.page(id, tier)
    }
}

/// Assembles a plan: costs and predicted distortions before and after.
pub(crate) fn assemble(view: &PageTableView, decisions: Vec<Decision>, budget_bytes: f64, s: &Solution, forced: Vec<PageId>, dist: impl PageDist) -> Plan {
    let mut plan = Plan { decisions, budget_bytes, cost_before: view.cost(), cost_after: 0.0, distortion_before: 0.0, distortion_after: 0.0, lambda: s.lambda, duality_gap: s.gap, feasible: false, forced };
    // Decisions are sorted by page, as `view.iter()` walks: merge instead of a binary search
    // per page (same tiers as `Plan::tier_of`).
    let mut next = plan.decisions.iter().peekable();
    for (id, p) in view.iter() {
        let t = match next.next_if(|d| d.page == id) {
            Some(d) => d.to_tier,
            None => p.tier,
        };
        plan.cost_after += view.costs.cost(t, p.tokens);
        plan.distortion_before += dist.dist(id, p.tier);
        plan.distortion_after += dist.dist(id, t);
    }
    debug_assert!(next.next().is_none(), "assemble: decisions must name pages of the view, sorted by page");
    plan.feasible = plan.cost_after <= budget_bytes;
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{CostModel, TierCosts};

    proptest::proptest! {
        /// [`Allowed::span`] (what RDKV poses from) lists the tiers
        /// [`Protection::allowed_tiers`] lists, and [`Allowed::least_cost`] is their least
        /// cost, bit for bit: free, protected (floors above, at and below the page's tier,
        /// past the drop tier), pinned, tail, partial and dropped pages, both cost models.
        #[test]
        fn allowed_span_lists_the_allowed_tiers(
            pages in proptest::collection::vec((0u8..6, 1usize..=64, proptest::prelude::any::<bool>(), 0usize..40), 1..60),
            floor in 0u8..7,
            sink in 0usize..100,
            recent in 0usize..300,
            payload in proptest::prelude::any::<bool>(),
        ) {
            let spec = kvforge_spec::Spec::load(concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/rdkv.toml").as_ref()).expect("rdkv spec");
            let costs = TierCosts::from_spec(&spec, 128, if payload { CostModel::Payload } else { CostModel::Resident });
            let p = costs.page_tokens;
            let infos: Vec<PageInfo> = pages.iter().map(|&(tier, tokens, pinned, at)| PageInfo { tier, tokens, first_token: at * p, last_token: at * p + tokens - 1, mass: 0.0, token_mass: None, pinned }).collect();
            let view = PageTableView { seq: 0, context_tokens: 40 * p, heads: vec![infos], costs };
            let protection = Protection { sink_tokens: sink, recent_tokens: recent, floor };
            let allowed = Allowed::new(&view, &protection);
            for page in &view.heads[0] {
                let want: Vec<TierId> = protection.allowed_tiers(page, view.context_tokens, &view.costs).collect();
                let (first, count) = allowed.span(page);
                proptest::prop_assert_eq!((first..first + count as TierId).collect::<Vec<_>>(), want.clone(), "{:?}", page);
                let least = want.iter().fold(f64::INFINITY, |m, &t| m.min(view.costs.cost(t, page.tokens)));
                proptest::prop_assert_eq!(allowed.least_cost(page).to_bits(), least.to_bits());
            }
        }
    }

    /// The in-place builder poses the problem the generic one does with the same options:
    /// free, protected (sinks, recent, pinned; floors above and below the page's tier) and
    /// fixed pages (tail, partial), on both cost models.
    #[test]
    fn build_head_allowed_equals_build_head() {
        let spec = kvforge_spec::Spec::load(concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/rdkv.toml").as_ref()).expect("rdkv spec");
        for model in [CostModel::Resident, CostModel::Payload] {
            let costs = TierCosts::from_spec(&spec, 128, model);
            let p = costs.page_tokens;
            let page = |i: usize, tier: TierId, tokens: usize| PageInfo { tier, tokens, first_token: i * p, last_token: i * p + tokens - 1, mass: 1.0 / (i + 1) as f64, token_mass: None, pinned: i % 7 == 3 };
            let mut pages: Vec<PageInfo> = (0..40).map(|i| page(i, 1 + (i % 5) as TierId, p)).collect();
            pages.push(page(40, kvforge_spec::TAIL_TIER, p / 2));
            let view = PageTableView { seq: 0, context_tokens: 40 * p + p / 2, heads: vec![Vec::new(), pages], costs };
            for floor in [1, 2, 3, 4, 5] {
                let protection = Protection { sink_tokens: 4, recent_tokens: 3 * p, floor };
                let dist = |i: usize, t: TierId| (i * 10 + t as usize) as f64 * 0.1;
                let want = Problem::build_head(&view, 1, |id, pg, out| out.extend(protection.allowed_tiers(pg, view.context_tokens, &view.costs).map(|t| (t, dist(id.index, t)))));
                let got = Problem::build_head_allowed(&view, 1, &protection, dist);
                assert_eq!((&got.ids, &got.tiers, &got.choices, &got.start, got.fixed), (&want.ids, &want.tiers, &want.choices, &want.start, want.fixed), "floor {floor}, {model:?}");
                assert!(got.ids.len() > 10 && got.fixed > 0.0);
            }
        }
    }
}
