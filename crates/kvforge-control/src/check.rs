//! The invariant checker: a plan (and the cache after it) must keep every page in a spec tier,
//! move tiers only down, leave protected pages above their floor and never drop them, and
//! respect the budget unless protection alone makes that impossible.
//!
//! The runtime calls [`check_plan`] before touching the cache and compares the cache's tiers
//! with [`simulate`] afterwards, so a controller bug cannot silently corrupt a sequence.

use std::fmt;

use crate::plan::{Limits, Plan};
use crate::protect::Guard;
use crate::signal::{PageId, PageTableView};

/// A broken invariant.
#[derive(Clone, Debug, PartialEq)]
pub enum Violation {
    NoSuchPage(PageId),
    Duplicate(PageId),
    UnknownTier { page: PageId, tier: u8 },
    StaleFrom { page: PageId, plan: u8, view: u8 },
    NotDown { page: PageId, from: u8, to: u8 },
    Immovable(PageId),
    Protected { page: PageId, to: u8, floor: u8 },
    OverBudget { cost: f64, budget: f64 },
    Accounting { what: &'static str, plan: f64, actual: f64 },
    Mismatch { head: usize, expected: Vec<u8>, found: Vec<u8> },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::NoSuchPage(p) => write!(f, "decision for page {p:?}, which the view does not have"),
            Violation::Duplicate(p) => write!(f, "two decisions for page {p:?}"),
            Violation::UnknownTier { page, tier } => write!(f, "page {page:?}: tier {tier} is not in the spec"),
            Violation::StaleFrom { page, plan, view } => write!(f, "page {page:?}: the plan says it is in tier {plan}, the view says {view}"),
            Violation::NotDown { page, from, to } => write!(f, "page {page:?}: {from} → {to} is not down the ladder (originals are not kept)"),
            Violation::Immovable(p) => write!(f, "page {p:?} cannot be re-coded (tail or partial page)"),
            Violation::Protected { page, to, floor } => write!(f, "protected page {page:?} moved to tier {to}, below its floor {floor} or dropped"),
            Violation::OverBudget { cost, budget } => write!(f, "{cost} B exceeds the {budget} B budget while cheaper tiers were allowed"),
            Violation::Accounting { what, plan, actual } => write!(f, "plan reports {what} = {plan}, the view gives {actual}"),
            Violation::Mismatch { head, expected, found } => write!(f, "kv head {head}: expected page tiers {expected:?} after the plan, the cache has {found:?}"),
        }
    }
}

impl std::error::Error for Violation {}

/// The view as it will be after `plan`: tiers changed, dropped pages removed (later indices
/// shift down, as `KvCache::retier` does).
pub fn simulate(view: &PageTableView, plan: &Plan) -> PageTableView {
    let mut out = view.clone();
    for (h, pages) in out.heads.iter_mut().enumerate() {
        let mut i = 0;
        pages.retain_mut(|p| {
            let id = PageId { head: h, index: i };
            i += 1;
            match plan.tier_of(id, view) {
                Some(t) if view.costs.tiers.get(t as usize).is_some_and(|x| x.drop) => false,
                Some(t) => {
                    p.tier = t;
                    true
                }
                None => true,
            }
        });
    }
    out
}

/// Checks a plan against the view it was made for.
pub fn check_plan(view: &PageTableView, plan: &Plan, limits: &Limits) -> Result<(), Violation> {
    checked(view, plan, limits).map(|_| ())
}

/// [`check_plan`], returning the view after the plan ([`simulate`]), which the check needs
/// anyway: `runtime::apply` verifies the cache against it without simulating twice.
pub(crate) fn checked(view: &PageTableView, plan: &Plan, limits: &Limits) -> Result<PageTableView, Violation> {
    let costs = &view.costs;
    let mut seen = std::collections::HashSet::new();
    for d in &plan.decisions {
        let page = view.page(d.page).ok_or(Violation::NoSuchPage(d.page))?;
        if !seen.insert(d.page) {
            return Err(Violation::Duplicate(d.page));
        }
        if !costs.contains(d.to_tier) {
            return Err(Violation::UnknownTier { page: d.page, tier: d.to_tier });
        }
        if d.from_tier != page.tier {
            return Err(Violation::StaleFrom { page: d.page, plan: d.from_tier, view: page.tier });
        }
        if d.to_tier <= page.tier {
            return Err(Violation::NotDown { page: d.page, from: page.tier, to: d.to_tier });
        }
        if limits.protection.guard(page, view.context_tokens, costs) == Guard::Fixed {
            return Err(Violation::Immovable(d.page));
        }
        let allowed = limits.protection.allowed(page, view.context_tokens, costs);
        if !allowed.contains(&d.to_tier) {
            return Err(Violation::Protected { page: d.page, to: d.to_tier, floor: *allowed.last().unwrap() });
        }
    }
    if !plan.decisions.windows(2).all(|w| w[0].page < w[1].page) {
        return Err(Violation::Duplicate(plan.decisions[0].page));
    }
    let after = simulate(view, plan);
    let cost = after.cost();
    let budget = limits.budget.bytes(view.context_tokens, view.heads.len());
    if (cost - plan.cost_after).abs() > 1e-6 * cost.max(1.0) {
        return Err(Violation::Accounting { what: "cost_after", plan: plan.cost_after, actual: cost });
    }
    if (budget - plan.budget_bytes).abs() > 1e-6 * budget.max(1.0) {
        return Err(Violation::Accounting { what: "budget_bytes", plan: plan.budget_bytes, actual: budget });
    }
    if cost > budget {
        // Only acceptable when nothing could have gone cheaper.
        for (id, page) in view.iter() {
            let allowed = limits.protection.allowed(page, view.context_tokens, costs);
            let cheapest = allowed.iter().map(|&t| costs.cost(t, page.tokens)).fold(f64::INFINITY, f64::min);
            let t = plan.tier_of(id, view).unwrap();
            if costs.cost(t, page.tokens) > cheapest {
                return Err(Violation::OverBudget { cost, budget });
            }
        }
    }
    Ok(after)
}
