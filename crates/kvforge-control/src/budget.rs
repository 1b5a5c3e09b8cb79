//! Byte budgets and the rate model `cost(tier)`.
//!
//! Seed 000 C.1 defines the budget on *effective resident bytes* (payload + headers +
//! alignment), measured once per tier and constant while decoding. A kvforge page of tier `t`
//! occupies one slot of `spec.segment(t, d).page_bytes` in the pool whatever its token count,
//! so [`CostModel::Resident`] (the default) charges exactly what `KvCache::memory_report`
//! reports as `resident_bytes`. [`CostModel::Payload`] charges the spec's payload + metadata
//! bytes per token (`Tier::bytes_per_token`) times the page's tokens, for comparisons with
//! papers that count bits only.

use kvforge_spec::{Spec, TierId};

/// What a page costs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CostModel {
    /// Whole page slots: header + segment + alignment padding (what the pool holds).
    #[default]
    Resident,
    /// Payload + scale/metadata bytes per token × tokens (page header and padding excluded).
    Payload,
}

/// One tier as the controllers see it.
#[derive(Clone, Debug, PartialEq)]
pub struct TierCost {
    pub id: TierId,
    pub name: String,
    pub drop: bool,
    /// Bytes of one page slot of this tier (0 for drop).
    pub page_bytes: f64,
    /// Payload + metadata bytes per token per head (0 for drop).
    pub bytes_per_token: f64,
}

/// The cost of every tier of a spec at one head dim, indexed by tier id.
#[derive(Clone, Debug, PartialEq)]
pub struct TierCosts {
    pub model: CostModel,
    pub page_tokens: usize,
    pub tiers: Vec<TierCost>,
}

impl TierCosts {
    pub fn from_spec(spec: &Spec, head_dim: usize, model: CostModel) -> TierCosts {
        let p = spec.page.tokens;
        let tiers = spec
            .tiers
            .iter()
            .map(|t| TierCost {
                id: t.id,
                name: t.name.clone(),
                drop: t.is_drop(),
                page_bytes: if t.is_drop() { 0.0 } else { spec.segment(t.id, head_dim).page_bytes as f64 },
                bytes_per_token: t.bytes_per_token(head_dim, p),
            })
            .collect();
        TierCosts { model, page_tokens: p, tiers }
    }

    /// Bytes a page of `tokens` tokens costs in `tier` (0 for the drop tier).
    pub fn cost(&self, tier: TierId, tokens: usize) -> f64 {
        let t = &self.tiers[tier as usize];
        match self.model {
            CostModel::Resident => t.page_bytes,
            CostModel::Payload => t.bytes_per_token * tokens as f64,
        }
    }

    /// Id of the drop tier, if the ladder has one (it is always last).
    pub fn drop_tier(&self) -> Option<TierId> {
        self.tiers.iter().find(|t| t.drop).map(|t| t.id)
    }

    /// Ladder tier ids (tail excluded), most to least precise.
    pub fn ladder(&self) -> impl Iterator<Item = TierId> + '_ {
        self.tiers.iter().skip(1).map(|t| t.id)
    }

    /// The last tier that still keeps keys and values.
    pub fn lowest_live(&self) -> TierId {
        self.tiers.iter().rev().find(|t| !t.drop).map_or(0, |t| t.id)
    }

    pub fn contains(&self, tier: TierId) -> bool {
        (tier as usize) < self.tiers.len()
    }
}

/// A byte budget for one sequence in one layer (all its kv heads).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    /// Bytes per token per kv head of the sequence's *context*: every position ever appended,
    /// dropped ones included, so dropping a page does not shrink the budget that made it
    /// necessary.
    PerToken(f64),
    /// Total bytes of the sequence in this layer, summed over kv heads.
    Total(f64),
}

impl Budget {
    /// The budget in bytes for a sequence of `context_tokens` positions and `heads` kv heads.
    pub fn bytes(&self, context_tokens: usize, heads: usize) -> f64 {
        match *self {
            Budget::PerToken(b) => b * (context_tokens * heads) as f64,
            Budget::Total(b) => b,
        }
    }
}
