//! Decisions, plans, and the reduction of a page table view to a knapsack instance.

use kvforge_spec::TierId;

use crate::budget::Budget;
use crate::knapsack::{self, Choice, Solution};
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

/// Assembles a plan: costs and predicted distortions before and after.
pub(crate) fn assemble(view: &PageTableView, decisions: Vec<Decision>, budget_bytes: f64, s: &Solution, forced: Vec<PageId>, dist: impl Fn(PageId, TierId) -> f64) -> Plan {
    let mut plan = Plan {
        decisions,
        budget_bytes,
        cost_before: view.cost(),
        cost_after: 0.0,
        distortion_before: 0.0,
        distortion_after: 0.0,
        lambda: s.lambda,
        duality_gap: s.gap,
        feasible: false,
        forced,
    };
    // Decisions are sorted by page, as `view.iter()` walks: merge instead of a binary search
    // per page (same tiers as `Plan::tier_of`).
    let mut next = plan.decisions.iter().peekable();
    for (id, p) in view.iter() {
        let t = match next.next_if(|d| d.page == id) {
            Some(d) => d.to_tier,
            None => p.tier,
        };
        plan.cost_after += view.costs.cost(t, p.tokens);
        plan.distortion_before += dist(id, p.tier);
        plan.distortion_after += dist(id, t);
    }
    debug_assert!(next.next().is_none(), "assemble: decisions must name pages of the view, sorted by page");
    plan.feasible = plan.cost_after <= budget_bytes;
    plan
}
