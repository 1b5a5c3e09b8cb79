//! How a batch of page moves runs (`KvCache::retier_many`):
//! checked as a whole, then one transcode launch per (from tier, to tier) pair, whatever
//! sequences the pages belong to: one launch per page made applying a controller plan cost
//! far more than the decode it serves (issue 7).
//!
//! Pure bookkeeping (no CUDA), so it is tested on any machine, and kvforge-control's
//! `SimCache` runs the very same plan on the CPU as kvforge-rt's `KvCache` on the GPU.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashSet};

use kvforge_spec::{Spec, TierId};

/// A batch of moves that cannot run; the cache is unchanged. (Worded as kvforge-rt's errors,
/// which it converts into.)
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MoveError {
    #[error("tier {0} cannot be a page's target here: {1}")]
    BadTier(TierId, String),
    #[error("bad input: {0}")]
    BadInput(String),
}

/// One move: full page `index` of kv head `head` into tier `to` (the drop tier frees it).
/// `(head, index, to)`; `index` counts the head's full pages as they are *before* the batch.
pub type PageMove = (usize, usize, TierId);

/// A move of sequence `seq`'s page: `(seq, move)`. A batch may span sequences
/// (`KvCache::retier_many`): a batch decoding together reaches
/// its RDR boundary at once, and one launch per tier pair for all of them replaces one per
/// sequence and tier pair, each sequence's ending in its own synchronisation.
pub type SeqMove = (usize, PageMove);

/// The order a batch runs in. Entries are positions in the `moves` slice it was planned from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MoveBatch {
    /// Pages to drop, in move order: freed first (no launch), so their slots serve the launches.
    pub drops: Vec<usize>,
    /// One launch each, `(from, to, moves)`, deepest source tier first: a `mid → low` launch
    /// frees the `mid` pages a later `high → mid` launch may need. A launch carries the pages
    /// of every sequence of the batch that move between its two tiers.
    pub launches: Vec<(TierId, TierId, Vec<usize>)>,
}

impl MoveBatch {
    /// The moves of a batch `(sequence, its moves)` as one list, each sequence named once
    /// (what `KvCache::retier_many` and kvforge-control's `SimCache` plan from).
    pub fn seq_moves(batch: &[(usize, &[PageMove])]) -> Result<Vec<SeqMove>, MoveError> {
        for (i, &(s, _)) in batch.iter().enumerate() {
            if batch[..i].iter().any(|b| b.0 == s) {
                return Err(MoveError::BadInput(format!("sequence {s} appears twice in one batch of page moves")));
            }
        }
        Ok(batch.iter().flat_map(|&(s, m)| m.iter().map(move |&m| (s, m))).collect())
    }

    /// Checks every move before anything changes, with `KvCache::retier_many`'s rules:
    /// `tier_of(seq, head, index)` is the tier of that full page (its error when there is
    /// none), `to` must be a spec tier below it, no page may be named twice, and `free[t]` free
    /// pages of tier `t` must cover the launches in the order they run (`out_of_pages(t)`
    /// otherwise; `usize::MAX` means unlimited). Errors are the caller's type `E`.
    pub fn plan<E: From<MoveError>>(
        spec: &Spec,
        moves: &[SeqMove],
        mut tier_of: impl FnMut(usize, usize, usize) -> Result<TierId, E>,
        free: &[usize],
        out_of_pages: impl Fn(TierId) -> E,
    ) -> Result<MoveBatch, E> {
        let mut free = free.to_vec();
        let mut seen = HashSet::with_capacity(moves.len());
        let mut drops = Vec::new();
        let mut groups: BTreeMap<(Reverse<TierId>, TierId), Vec<usize>> = BTreeMap::new();
        for (i, &(seq, (head, index, to))) in moves.iter().enumerate() {
            let from = tier_of(seq, head, index)?;
            let tier = spec.tiers.get(to as usize).ok_or_else(|| MoveError::BadTier(to, "no such tier".into()))?;
            if to <= from {
                return Err(MoveError::BadTier(to, format!("pages move down the ladder only (page is in tier {from})")).into());
            }
            if !seen.insert((seq, head, index)) {
                return Err(MoveError::BadInput(format!("page {index} of kv head {head} of sequence {seq} is moved twice in one batch")).into());
            }
            if tier.is_drop() {
                drops.push(i);
                free[from as usize] = free[from as usize].saturating_add(1);
            } else {
                groups.entry((Reverse(from), to)).or_default().push(i);
            }
        }
        for (&(Reverse(from), to), g) in &groups {
            free[to as usize] = free[to as usize].checked_sub(g.len()).ok_or_else(|| out_of_pages(to))?;
            free[from as usize] = free[from as usize].saturating_add(g.len());
        }
        Ok(MoveBatch { drops, launches: groups.into_iter().map(|((Reverse(from), to), g)| (from, to, g)).collect() })
    }

    /// Per sequence of `seqs`, the launches that carry its pages.
    pub fn launches_of(&self, moves: &[SeqMove], seqs: &[usize]) -> Vec<usize> {
        seqs.iter().map(|&s| self.launches.iter().filter(|(_, _, g)| g.iter().any(|&m| moves[m].0 == s)).count()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Errors of the tests' cache: the batch's own, or out of pages.
    #[derive(Debug)]
    enum E {
        Move(MoveError),
        OutOfPages,
    }
    use E::OutOfPages;

    impl From<MoveError> for E {
        fn from(e: MoveError) -> E {
            E::Move(e)
        }
    }

    type Result<T> = std::result::Result<T, E>;

    fn spec() -> Spec {
        // b16 b8 b4 b2 b0(drop) after the tail tier.
        Spec::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/rdkv.toml")).unwrap()
    }

    /// One sequence's moves (sequence 0), page `i` of every head in tier `tiers[i]`.
    fn plan(moves: &[PageMove], tiers: &[TierId], free: &[usize]) -> Result<MoveBatch> {
        let moves: Vec<SeqMove> = moves.iter().map(|&m| (0, m)).collect();
        plan_seqs(&moves, tiers, free)
    }

    fn plan_seqs(moves: &[SeqMove], tiers: &[TierId], free: &[usize]) -> Result<MoveBatch> {
        let tier_of = |_s: usize, _h: usize, i: usize| tiers.get(i).copied().ok_or_else(|| E::Move(MoveError::BadInput(format!("no full page {i}"))));
        MoveBatch::plan(&spec(), moves, tier_of, free, |_| OutOfPages)
    }

    #[test]
    fn groups_by_tier_pair_deepest_source_first() {
        let tiers = [1, 1, 2, 1, 2, 3];
        let moves = [(0, 0, 3), (0, 1, 5), (0, 2, 3), (0, 3, 3), (0, 4, 4), (0, 5, 4), (1, 0, 3)];
        let b = plan(&moves, &tiers, &[usize::MAX; 6]).unwrap();
        assert_eq!(b.drops, vec![1]);
        assert_eq!(b.launches, vec![(3, 4, vec![5]), (2, 3, vec![2]), (2, 4, vec![4]), (1, 3, vec![0, 3, 6])]);
        assert_eq!(plan(&[], &tiers, &[0; 6]).unwrap(), MoveBatch::default());
    }

    #[test]
    fn bad_moves_and_capacity_are_errors() {
        let tiers = [1, 2];
        let inf = [usize::MAX; 6];
        assert!(matches!(plan(&[(0, 2, 3)], &tiers, &inf), Err(E::Move(MoveError::BadInput(_)))));
        assert!(matches!(plan(&[(0, 0, 9)], &tiers, &inf), Err(E::Move(MoveError::BadTier(9, _)))));
        assert!(matches!(plan(&[(0, 1, 2)], &tiers, &inf), Err(E::Move(MoveError::BadTier(2, _)))));
        assert!(matches!(plan(&[(0, 0, 3), (0, 0, 5)], &tiers, &inf), Err(E::Move(MoveError::BadInput(_)))));
        // Tier 2 is full: page 1 leaves it (launch 2 → 3 runs first), then page 0 may enter.
        assert!(plan(&[(0, 0, 2), (0, 1, 3)], &tiers, &[0, 0, 0, 1, 0, 0]).is_ok());
        assert!(matches!(plan(&[(0, 0, 2)], &tiers, &[0, 0, 0, 1, 0, 0]), Err(OutOfPages)));
        // A drop frees its slot before any launch.
        assert!(plan(&[(0, 1, 5), (0, 0, 2)], &tiers, &[0; 6]).is_ok());
    }

    #[test]
    fn sequences_share_launches() {
        let tiers = [1, 2, 1];
        // Sequences 4 and 7: one 1 → 3 launch carries both, 2 → 3 only sequence 7's page.
        let moves = [(4, (0, 0, 3)), (7, (0, 0, 3)), (7, (1, 1, 3)), (4, (0, 2, 5)), (7, (0, 2, 3))];
        let b = plan_seqs(&moves, &tiers, &[usize::MAX; 6]).unwrap();
        assert_eq!(b.drops, vec![3]);
        assert_eq!(b.launches, vec![(2, 3, vec![2]), (1, 3, vec![0, 1, 4])]);
        assert_eq!(b.launches_of(&moves, &[4, 7, 9]), vec![1, 2, 0]);
        // The same page of two sequences is two pages; of one sequence, one named twice.
        assert!(plan_seqs(&[(4, (0, 0, 3)), (7, (0, 0, 3))], &tiers, &[usize::MAX; 6]).is_ok());
        assert!(matches!(plan_seqs(&[(4, (0, 0, 3)), (4, (0, 0, 5))], &tiers, &[usize::MAX; 6]), Err(E::Move(MoveError::BadInput(_)))));
        // Capacity counts the whole batch: two pages into tier 3 need two free slots.
        assert!(matches!(plan_seqs(&moves[..2], &tiers, &[0, 0, 0, 1, 0, 0]), Err(OutOfPages)));
    }

    #[test]
    fn seq_moves_flatten_in_order_and_name_each_sequence_once() {
        let (a, b): (&[PageMove], &[PageMove]) = (&[(0, 1, 3), (1, 0, 2)], &[(0, 4, 5)]);
        assert_eq!(MoveBatch::seq_moves(&[(7, a), (2, b)]).unwrap(), vec![(7, (0, 1, 3)), (7, (1, 0, 2)), (2, (0, 4, 5))]);
        assert!(matches!(MoveBatch::seq_moves(&[(7, a), (2, b), (7, b)]), Err(MoveError::BadInput(_))));
    }
}
