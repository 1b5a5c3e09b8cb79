//! Per-(kv head, group) codebooks of spherical tiers.
//!
//! A spherical tier's `codebook` side table is `[num_kv_heads][groups][entries][group]` unit
//! codewords. The spec fills it with its one codebook copied to every head and group; a
//! caller with codebooks trained on the model's own keys (`kvforge codebook train
//! --per-head`, one per layer, kv head and group) sets each layer's cache's table with
//! [`KvCache::set_codebook`] before the tier's first page is coded: pages coded with one
//! codebook cannot be read with another. A tier that codes pages with a uniform placeholder
//! codebook (trained on random unit vectors, which do not fit real keys) is reported once
//! per process with a `warn!`.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use kvforge_spec::codecs::spherical::codebook::first_non_unit;
use kvforge_spec::codecs::spherical::HeadCodebooks;
use kvforge_spec::{KeyScheme, TierId};

use crate::cache::KvCache;
use crate::error::{Result, RtError};

/// The spherical codec's codebook side table (`kvforge_spec::codecs::spherical`).
const CODEBOOK: &str = "codebook";

impl KvCache {
    /// Sets the codebooks of spherical tier `tier`: `data` is `[num_kv_heads][head_dim /
    /// group][2^angle_bits][group]` f32, every codeword a unit vector (e.g. one layer of a
    /// [`kvforge_spec::codecs::spherical::HeadCodebooks`] file, [`HeadCodebooks::layer`]).
    /// Call before the tier's first page is coded.
    ///
    /// [`HeadCodebooks::layer`]: kvforge_spec::codecs::spherical::HeadCodebooks::layer
    pub fn set_codebook(&mut self, tier: TierId, data: &[f32]) -> Result<()> {
        let t = self.spec.tiers.get(tier as usize).ok_or_else(|| RtError::BadTier(tier, "no such tier".into()))?;
        let KeyScheme::Spherical { group, angle_bits, .. } = t.key else {
            return Err(RtError::BadTier(tier, format!("`{}` does not store spherical keys; codebooks belong to spherical tiers", t.name)));
        };
        let used = self.store.pool().used_pages(tier);
        if used > 0 {
            return Err(RtError::WrongState {
                what: format!("codebook of tier `{}`", t.name),
                fix: format!("the tier already holds {used} pages coded with its current codebook; set the codebook before the first page is coded"),
            });
        }
        let (d, hkv, entries) = (self.cfg.head_dim, self.cfg.num_kv_heads, 1usize << angle_bits);
        let want = hkv * d * entries;
        if data.len() != want {
            return Err(RtError::ShapeMismatch {
                what: format!("codebook of tier `{}`", t.name),
                expected: format!("{hkv} kv heads × {} groups × {entries} codewords × {group} channels = {want} values", d / group),
                got: format!("{} values", data.len()),
            });
        }
        if let Some((row, norm)) = first_non_unit(data, group) {
            let (head, rest) = (row / (d / group * entries), row % (d / group * entries));
            return Err(RtError::BadInput(format!("codebook of tier `{}`: kv head {head}, group {}, codeword {} has norm {norm}; codewords must be unit vectors", t.name, rest / entries, rest % entries)));
        }
        self.side.set_f32(&self.engine.dev().stream, tier, CODEBOOK, data)
    }

    /// Sets spherical tier `tier`'s codebooks to layer `layer` of a per-(layer, kv head, group)
    /// codebook file, after checking that its group, codeword count, head_dim and kv heads are
    /// the tier's and the cache's, and that it was trained on unrotated keys (a file trained
    /// in a rotated basis fits only a spec that stores keys rotated).
    pub fn set_head_codebooks(&mut self, tier: TierId, codebooks: &HeadCodebooks, layer: usize) -> Result<()> {
        let t = self.spec.tiers.get(tier as usize).ok_or_else(|| RtError::BadTier(tier, "no such tier".into()))?;
        let KeyScheme::Spherical { group, angle_bits, .. } = t.key else {
            return Err(RtError::BadTier(tier, format!("`{}` does not store spherical keys; codebooks belong to spherical tiers", t.name)));
        };
        let (d, hkv) = (self.cfg.head_dim, self.cfg.num_kv_heads);
        let found = (codebooks.group, codebooks.entries, codebooks.head_dim, codebooks.kv_heads);
        if found != (group, 1 << angle_bits, d, hkv) {
            return Err(RtError::ShapeMismatch {
                what: format!("codebooks for tier `{}`", t.name),
                expected: format!("group {group}, {} codewords, head_dim {d}, {hkv} kv heads", 1 << angle_bits),
                got: format!("group {}, {} codewords, head_dim {}, {} kv heads", found.0, found.1, found.2, found.3),
            });
        }
        if codebooks.basis() != "identity" {
            return Err(RtError::BadInput(format!("codebooks trained in basis `{}` (keys rotated before grouping); tier `{}` stores keys unrotated", codebooks.basis(), t.name)));
        }
        let data = codebooks.layer(layer).ok_or_else(|| RtError::BadInput(format!("layer {layer}: the codebook file has {} layers", codebooks.layers)))?;
        self.set_codebook(tier, data)
    }

    /// The codebooks `[num_kv_heads][groups][entries][group]` of spherical tier `tier`.
    pub fn codebook(&self, tier: TierId) -> Result<Option<Vec<f32>>> {
        self.side.get_f32(&self.engine.dev().stream, tier, CODEBOOK)
    }

    /// Spherical tiers whose codebook is still the spec's uniform placeholder (no
    /// [`KvCache::set_codebook`] since the cache was made).
    pub fn placeholder_codebook_tiers(&self) -> Vec<TierId> {
        self.spec.tiers.iter().filter(|t| matches!(&t.key, KeyScheme::Spherical { codebook, .. } if codebook.is_placeholder()) && self.side.is_from_spec(t.id, CODEBOOK)).map(|t| t.id).collect()
    }

    /// Warns (once per process and codebook file) when pages are about to be coded into
    /// `tier` with a uniform placeholder codebook.
    pub(crate) fn warn_placeholder_codebook(&self, tier: TierId) {
        let Some(t) = self.spec.tiers.get(tier as usize) else { return };
        let KeyScheme::Spherical { codebook, .. } = &t.key else { return };
        if !codebook.is_placeholder() || !self.side.is_from_spec(tier, CODEBOOK) {
            return;
        }
        static WARNED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
        let first = WARNED.get_or_init(Default::default).lock().map(|mut w| w.insert(codebook.hash.clone())).unwrap_or(false);
        if first {
            tracing::warn!(
                "spherical tier `{}` of spec `{}` codes keys with the placeholder codebook {} (trained on uniform random unit vectors, not on keys): expect a large quality loss; train per-head codebooks on the model's keys (`kvforge codebook train --per-head`) and set them with set_codebook",
                t.name,
                self.spec.name,
                codebook.path
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::cache::{CacheConfig, KvCache};
    use crate::error::RtError;

    #[test]
    #[ignore = "needs a CUDA device"]
    fn set_codebook_checks_shape_unit_rows_and_state() {
        let dev = crate::testing::device();
        let spec = crate::testing::shipped_spec("spherical.toml");
        let high = spec.tier("high").unwrap().id;
        let (d, hkv) = (64, 3);
        let mut cache = KvCache::new(dev, spec.clone(), CacheConfig::new(&spec, d, 3, hkv, 1, 512).target(high)).unwrap();
        assert!(cache.placeholder_codebook_tiers().contains(&high));
        let (group, entries) = (16, 64);
        // Codeword e of every (head, group) is the unit vector on channel e % group.
        let cb: Vec<f32> = (0..hkv * (d / group) * entries * group).map(|i| if (i / group) % entries % group == i % group { 1.0 } else { 0.0 }).collect();
        assert!(matches!(cache.set_codebook(high, &cb[1..]), Err(RtError::ShapeMismatch { .. })));
        let mut bad = cb.clone();
        bad[0] = 2.0;
        assert!(matches!(cache.set_codebook(high, &bad), Err(RtError::BadInput(_))));
        assert!(matches!(cache.set_codebook(spec.tier("drop").unwrap().id, &cb), Err(RtError::BadTier(..))));
        cache.set_codebook(high, &cb).unwrap();
        assert_eq!(cache.codebook(high).unwrap().unwrap(), cb);
        assert!(!cache.placeholder_codebook_tiers().contains(&high));
        let seq = cache.add_sequence();
        let k: Vec<f32> = (0..64 * hkv * d).map(|i| ((i % 7) as f32 - 3.0) * 0.25).collect();
        cache.append(seq, &k, &k).unwrap();
        assert!(matches!(cache.set_codebook(high, &cb), Err(RtError::WrongState { .. })));
    }
}
