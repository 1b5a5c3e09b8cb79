//! Hard protection (seed 000 C.1 "eligible set"): attention sinks, the recent window and
//! pinned spans are never dropped and never re-coded below a floor tier.
//!
//! Protection is enforced by restricting each page's feasible tiers before the solver runs,
//! not by a penalty, so no budget can buy it off. Pages are tier-homogeneous, so a page is
//! protected as soon as one of its tokens is: protection has page granularity.

use kvforge_spec::TierId;

use crate::budget::TierCosts;
use crate::signal::PageInfo;

/// Which positions are protected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Protection {
    /// Positions `0..sink_tokens` (attention sinks) are protected.
    pub sink_tokens: usize,
    /// The last `recent_tokens` positions of the context are protected.
    pub recent_tokens: usize,
    /// Protected pages may be re-coded down to this tier but not below, and never dropped.
    /// The default, the first ladder tier, leaves them untouched (pages are born there or
    /// below). A floor at or past the drop tier is clamped to the last live tier.
    pub floor: TierId,
}

impl Default for Protection {
    fn default() -> Self {
        Protection { sink_tokens: 4, recent_tokens: 128, floor: 1 }
    }
}

/// What the controller may do with one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guard {
    /// Any tier from the current one down, drop included.
    Free,
    /// Tiers from the current one down to `floor`, no drop.
    Protected { floor: TierId },
    /// Nothing: the tail page (dense, partial) or a page in no ladder tier.
    Fixed,
}

impl Protection {
    /// Nothing protected (tests, offline allocation).
    pub fn none() -> Protection {
        Protection { sink_tokens: 0, recent_tokens: 0, floor: 1 }
    }

    /// Whether the page holds a sink, a recent or a pinned token.
    pub fn protects(&self, page: &PageInfo, context_tokens: usize) -> bool {
        let sink = page.first_token < self.sink_tokens;
        let recent = self.recent_tokens > 0 && page.last_token + self.recent_tokens >= context_tokens;
        sink || recent || page.pinned
    }

    pub fn guard(&self, page: &PageInfo, context_tokens: usize, costs: &TierCosts) -> Guard {
        if !page.movable(costs.page_tokens) || !costs.contains(page.tier) {
            return Guard::Fixed;
        }
        if self.protects(page, context_tokens) {
            Guard::Protected { floor: self.floor.min(costs.lowest_live()) }
        } else {
            Guard::Free
        }
    }

    /// Tiers the page may take, current tier first, then down the ladder.
    pub fn allowed(&self, page: &PageInfo, context_tokens: usize, costs: &TierCosts) -> Vec<TierId> {
        self.allowed_tiers(page, context_tokens, costs).collect()
    }

    /// [`allowed`](Self::allowed) without the allocation (controllers ask for every page).
    pub fn allowed_tiers<'a>(&self, page: &PageInfo, context_tokens: usize, costs: &'a TierCosts) -> impl Iterator<Item = TierId> + 'a {
        let (lowest, no_drop) = self.allowed_span(page, context_tokens, costs);
        (page.tier..=lowest).filter(move |&t| !(no_drop && costs.tiers[t as usize].drop))
    }

    /// The tiers [`allowed_tiers`](Self::allowed_tiers) lists as a span: `page.tier..=lowest`,
    /// drop tiers left out when the flag is set (for loops that build a page's options in
    /// place).
    pub fn allowed_span(&self, page: &PageInfo, context_tokens: usize, costs: &TierCosts) -> (TierId, bool) {
        let last = costs.tiers.len() as TierId - 1;
        match self.guard(page, context_tokens, costs) {
            Guard::Fixed => (page.tier, false),
            Guard::Free => (last, false),
            Guard::Protected { floor } => (floor.max(page.tier), true),
        }
    }
}
