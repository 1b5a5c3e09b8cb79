//! # kvforge-paging: the page table's vocabulary, without a GPU
//!
//! What the runtime (`kvforge-rt`, on the GPU) and the tier controllers (`kvforge-control`,
//! CPU-only) share about a paged cache: a page move ([`PageMove`]), how a batch of moves
//! runs ([`MoveBatch`]), and the interface a controller drives a cache through
//! ([`PagedCache`]). No CUDA here, so the controllers build and test on any machine.

use std::cmp::Reverse;

use kvforge_spec::{Spec, TierId, TAIL_TIER};

mod moves;

pub use moves::{MoveBatch, MoveError, PageMove, SeqMove};

/// What a controller needs from a paged cache: its page table, and re-coding pages down the
/// ladder (kvforge-control's `apply` drives it; kvforge-rt's `KvCache` and kvforge-control's
/// `SimCache` implement it).
pub trait PagedCache {
    type Error: std::error::Error + Send + Sync + 'static;
    fn spec(&self) -> &Spec;
    fn head_dim(&self) -> usize;
    fn num_kv_heads(&self) -> usize;
    /// `(tier, valid tokens)` of every page of (seq, head), in token order, tail page last.
    fn page_tiers(&self, seq: usize, head: usize) -> Result<Vec<(TierId, usize)>, Self::Error>;
    /// Re-codes full page `index` of (seq, head) into a lower tier; the drop tier frees it and
    /// removes it from the list.
    fn retier(&mut self, seq: usize, head: usize, index: usize, to: TierId) -> Result<(), Self::Error>;

    /// Full pages of (seq, head) and the tail page's tokens (None: no tail page). The default
    /// reads [`page_tiers`](Self::page_tiers).
    fn page_counts(&self, seq: usize, head: usize) -> Result<(usize, Option<usize>), Self::Error> {
        let pages = self.page_tiers(seq, head)?;
        let tail = pages.iter().find(|x| x.0 == TAIL_TIER).map(|x| x.1);
        Ok((pages.iter().filter(|x| x.0 != TAIL_TIER).count(), tail))
    }

    /// A number that changes whenever the pages of `seq` change other than by appends
    /// (`KvCache::layout_epoch`); None where the cache keeps none. A plan made from a
    /// snapshot of the same epoch applies without walking the page table for staleness.
    fn layout_epoch(&self, _seq: usize) -> Option<u64> {
        None
    }

    /// Applies moves `(kv head, index, to)` of one sequence, on distinct pages; `index` counts
    /// the head's pages *before* the call (the call removes dropped pages itself). Returns the
    /// kernel launches it took.
    ///
    /// The default calls [`retier`](Self::retier) once per move (one launch per re-code) in
    /// an order that frees pages before allocating: drops per head from the highest index down
    /// (the indices still to visit stay valid), then re-codes deepest source tier first (a
    /// `mid → low` frees a `mid` slot for a `high → mid`), indices shifted past the drops. A
    /// move naming no full page goes to `retier` first, as given, so the cache's own error
    /// comes before anything changes (shifted, it could land on another page).
    fn retier_pages(&mut self, seq: usize, moves: &[PageMove]) -> Result<usize, Self::Error> {
        let mut tiers = std::collections::BTreeMap::new();
        for &(h, _, _) in moves {
            if let std::collections::btree_map::Entry::Vacant(e) = tiers.entry(h) {
                e.insert(self.page_tiers(seq, h)?);
            }
        }
        let is_drop = |t: TierId| self.spec().tiers.get(t as usize).is_some_and(|x| x.is_drop());
        let (mut bad, mut drops, mut recodes) = (Vec::new(), Vec::new(), Vec::new());
        for &(h, i, to) in moves {
            match tiers[&h].get(i).map(|x: &(TierId, usize)| x.0).filter(|&t| t != TAIL_TIER) {
                None => bad.push((h, i, to)),
                Some(_) if is_drop(to) => drops.push((h, i, to)),
                Some(from) => recodes.push((Reverse(from), h, i, to)),
            }
        }
        drops.sort_by_key(|&(h, i, _)| (h, Reverse(i)));
        recodes.sort_unstable();
        for (h, i, to) in bad.into_iter().chain(drops.iter().copied()) {
            self.retier(seq, h, i, to)?;
        }
        for &(_, h, i, to) in &recodes {
            let shift = drops.iter().filter(|d| d.0 == h && d.1 < i).count();
            self.retier(seq, h, i - shift, to)?;
        }
        Ok(recodes.len())
    }

    /// [`retier_pages`](Self::retier_pages) of several sequences (each once), in one batch
    /// where the cache can (`KvCache`: one transcode launch per tier pair for all of them, one
    /// synchronisation). Returns, per sequence, the launches that carried its pages. The
    /// default applies the sequences one after another, stopping at the first error.
    fn retier_many(&mut self, batch: &[(usize, &[PageMove])]) -> Result<Vec<usize>, Self::Error> {
        batch.iter().map(|&(seq, moves)| self.retier_pages(seq, moves)).collect()
    }
}
