//! What a controller sees: a CUDA-free snapshot of one sequence's page table with an
//! importance signal per page, and the trackers that produce the signal.
//!
//! The runtime fills a [`PageTableView`] (see `runtime::PositionMap::view`); tests fill it by
//! hand. Keeping controllers on this plain struct is what lets every policy be tested on the
//! CPU, byte for byte against the costs the GPU pool will charge.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use kvforge_spec::{TierId, TAIL_TIER};

use crate::budget::TierCosts;

/// A multiply–rotate hasher for the controllers' small integer keys ([`PageKey`], [`PageId`]).
/// The standard SipHash costs ~20 ns per lookup, which at 32K tokens × 8 kv heads (4096
/// pages, every page observed every decode step) was most of the controllers' time; keys
/// come from the runtime, not from an adversary, so DoS resistance is not needed.
#[derive(Clone, Copy, Debug, Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

/// Hash map and set keyed by pages, with [`KeyHasher`].
pub type PageMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;
pub type PageSet<K> = HashSet<K, BuildHasherDefault<KeyHasher>>;

/// A page of one sequence: kv head and index in `KvCache::pages(seq, head)` at the time the
/// view was taken. Indices shift when a page of the same head is dropped, so a [`PageId`] is
/// only meaningful against the view it came from; [`PageKey`] is the stable name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId {
    pub head: usize,
    pub index: usize,
}

/// Stable name of a page across views: kv head and logical position of its first token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageKey {
    pub head: usize,
    pub first_token: usize,
}

/// One page and its importance signal.
#[derive(Clone, Debug, PartialEq)]
pub struct PageInfo {
    pub tier: TierId,
    /// Valid tokens (a full page has `page_tokens`; only the tail page is partial).
    pub tokens: usize,
    /// Logical position of the first token (positions count from 0 and include dropped pages).
    pub first_token: usize,
    /// Logical position of the last token (inclusive).
    pub last_token: usize,
    /// Attention mass of the page: attention probability summed over its tokens and over the
    /// query heads of the kv head's GQA group (and smoothed over recent steps), normalised so
    /// that a sequence's pages sum to 1 ([`PageTableView::normalise`]). Only ratios matter to
    /// the knapsack, but hysteresis margins and drop penalties are relative to the mean.
    pub mass: f64,
    /// Optional per-token masses (same normalisation); RDKV sums these when present.
    pub token_mass: Option<Vec<f64>>,
    /// Pinned by the serving policy (retrieved evidence, markers): never dropped nor
    /// down-tiered below the protection floor.
    pub pinned: bool,
}

impl PageInfo {
    pub fn key(&self, head: usize) -> PageKey {
        PageKey { head, first_token: self.first_token }
    }
    /// The importance the controllers use: the token masses' sum if given, else `mass`.
    pub fn importance(&self) -> f64 {
        match &self.token_mass {
            Some(t) => t.iter().sum(),
            None => self.mass,
        }
    }
    /// Only full pages in a ladder tier can be re-coded (`KvCache::retier` takes full pages;
    /// the tail page is dense and still filling).
    pub fn movable(&self, page_tokens: usize) -> bool {
        self.tier != TAIL_TIER && self.tokens == page_tokens
    }
}

/// One sequence's pages in one layer, per kv head in token order (tail page last), with the
/// spec's tier costs.
#[derive(Clone, Debug, PartialEq)]
pub struct PageTableView {
    pub seq: usize,
    /// Logical length: positions `0..context_tokens` were appended (dropped ones included).
    pub context_tokens: usize,
    /// `heads[h]` lists the live pages of kv head `h` as `KvCache::pages(seq, h)` does.
    pub heads: Vec<Vec<PageInfo>>,
    pub costs: TierCosts,
}

impl PageTableView {
    /// Where each head's pages start in view order (page (h, i) is at `offsets()[h] + i`):
    /// the index of per-page vectors such as the controllers' weights and scores.
    pub fn offsets(&self) -> Vec<usize> {
        self.heads
            .iter()
            .scan(0, |acc, h| {
                let o = *acc;
                *acc += h.len();
                Some(o)
            })
            .collect()
    }

    pub fn page(&self, id: PageId) -> Option<&PageInfo> {
        self.heads.get(id.head).and_then(|h| h.get(id.index))
    }

    /// Every page with its id, head by head, in token order.
    pub fn iter(&self) -> impl Iterator<Item = (PageId, &PageInfo)> {
        self.heads.iter().enumerate().flat_map(|(head, ps)| ps.iter().enumerate().map(move |(index, p)| (PageId { head, index }, p)))
    }

    pub fn num_pages(&self) -> usize {
        self.heads.iter().map(Vec::len).sum()
    }

    /// Bytes the view's pages cost now.
    pub fn cost(&self) -> f64 {
        self.iter().map(|(_, p)| self.costs.cost(p.tier, p.tokens)).sum()
    }

    /// Scales masses (and token masses) so the sequence's pages sum to 1; a view with no mass
    /// at all is left as is.
    pub fn normalise(&mut self) {
        let total: f64 = self.iter().map(|(_, p)| p.importance()).sum();
        if !(total > 0.0 && total.is_finite()) {
            return;
        }
        for p in self.heads.iter_mut().flatten() {
            p.mass /= total;
            if let Some(t) = &mut p.token_mass {
                t.iter_mut().for_each(|x| *x /= total);
            }
        }
    }
}

/// Importance smoothing of seed 000 C.2: `ω_i(t) = EMA_β(max_{s ∈ window} a_s(i))`.
///
/// Call [`observe`](Self::observe) every decode step with the attention mass a page received
/// (summed over its tokens and the GQA group); call [`roll`](Self::roll) once per controller
/// invocation: the window's maximum enters the EMA. The max suppresses nothing that spiked,
/// the EMA damps it over time; pages are keyed by [`PageKey`] so drops do not shuffle them.
#[derive(Clone, Debug)]
pub struct ImportanceTracker {
    /// EMA coefficient β (weight of the past).
    pub beta: f64,
    window: PageMap<PageKey, f64>,
    ema: PageMap<PageKey, f64>,
}

impl ImportanceTracker {
    pub fn new(beta: f64) -> ImportanceTracker {
        assert!((0.0..1.0).contains(&beta), "EMA β must be in [0, 1)");
        ImportanceTracker { beta, window: PageMap::default(), ema: PageMap::default() }
    }

    /// Records one step's attention mass of a page.
    pub fn observe(&mut self, key: PageKey, mass: f64) {
        let m = self.window.entry(key).or_insert(0.0);
        *m = m.max(mass);
    }

    /// Folds the window into the EMA. A page first seen now starts at its window maximum.
    pub fn roll(&mut self) {
        let beta = self.beta;
        for (k, v) in self.ema.iter_mut() {
            let z = self.window.get(k).copied().unwrap_or(0.0);
            *v = beta * *v + (1.0 - beta) * z;
        }
        for (k, z) in self.window.drain() {
            self.ema.entry(k).or_insert(z);
        }
    }

    /// Smoothed importance of a page (0 if never observed).
    pub fn get(&self, key: PageKey) -> f64 {
        self.ema.get(&key).copied().unwrap_or(0.0)
    }

    /// Forgets pages that no longer exist.
    pub fn retain(&mut self, mut keep: impl FnMut(PageKey) -> bool) {
        self.ema.retain(|k, _| keep(*k));
        self.window.retain(|k, _| keep(*k));
    }
}
