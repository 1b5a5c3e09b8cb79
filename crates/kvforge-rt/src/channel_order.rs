//! Channel orders of mixed-key tiers (seed 002 TriZone, K side).
//!
//! A mixed-key tier stores each kv head's channels in a *channel order* (stored position j
//! holds natural channel `order[j]`) so that its segments — fp16, int8, int4, int2, dropped —
//! hold the channels the controller ranks heaviest first. Decode gathers the query and encode
//! gathers each stored position's channel through the order, a mixed source page is read
//! back through its inverse; both lie on the device as
//! `[num_kv_heads][2][head_dim]` u16. An order is fixed before the tier's first page is
//! coded: pages coded in one order cannot be read in another, so changing it later is an
//! error rather than a silent re-interpretation. Until set, a tier uses the identity.

use kvforge_spec::TierId;

use crate::cache::KvCache;
use crate::error::{Result, RtError};

/// The mixed-key codec's side table (`kvforge_spec::codecs::mixed`).
const CHANNEL_ORDER: &str = "channel_order";

impl KvCache {
    /// Sets the channel order of mixed-key tier `tier`: `order` is `[num_kv_heads][head_dim]`,
    /// each head's row a permutation of `0..head_dim` (stored position → natural channel).
    pub fn set_channel_order(&mut self, tier: TierId, order: &[u16]) -> Result<()> {
        let t = self.spec.tiers.get(tier as usize).ok_or_else(|| RtError::BadTier(tier, "no such tier".into()))?;
        if !self.side.declares(tier, CHANNEL_ORDER) {
            return Err(RtError::BadTier(tier, format!("`{}` does not store mixed-bit keys; channel orders belong to mixed-key tiers", t.name)));
        }
        let used = self.store.pool().used_pages(tier);
        if used > 0 {
            return Err(RtError::WrongState {
                what: format!("channel order of tier `{}`", t.name),
                fix: format!("the tier already holds {used} pages coded in its current channel order; set the order before the first page is coded"),
            });
        }
        let (d, hkv) = (self.cfg.head_dim, self.cfg.num_kv_heads);
        if order.len() != hkv * d {
            return Err(RtError::ShapeMismatch { what: "channel order".into(), expected: format!("{hkv} kv heads × {d} channels = {} entries", hkv * d), got: format!("{} entries", order.len()) });
        }
        let mut table = Vec::with_capacity(2 * hkv * d);
        for (h, row) in order.chunks(d).enumerate() {
            kvforge_spec::codecs::mixed::check_order(row, d).map_err(|e| RtError::BadInput(format!("channel order of kv head {h}: {e}")))?;
            let mut inverse = vec![0u16; d];
            for (j, &c) in row.iter().enumerate() {
                inverse[c as usize] = j as u16;
            }
            table.extend_from_slice(row);
            table.extend_from_slice(&inverse);
        }
        self.side.set_u16(&self.engine.dev().stream, tier, CHANNEL_ORDER, &table)
    }

    /// The channel order `[num_kv_heads][head_dim]` of tier `tier`, once set.
    pub fn channel_order(&self, tier: TierId) -> Result<Option<Vec<u16>>> {
        let Some(all) = self.side.get_u16(&self.engine.dev().stream, tier, CHANNEL_ORDER)? else { return Ok(None) };
        let d = self.cfg.head_dim;
        Ok(Some(all.chunks(2 * d).flat_map(|h| h[..d].iter().copied()).collect()))
    }
}
