//! Page moves. How a batch of them runs ([`MoveBatch`]) is pure bookkeeping that lives in
//! kvforge-paging, shared with the controllers' CPU twin of this cache; here its errors become
//! the runtime's, and [`KvCache`] implements the interface the controllers drive a cache
//! through ([`PagedCache`]).

use kvforge_paging::PagedCache;
use kvforge_spec::{Spec, TierId};

pub use kvforge_paging::{MoveBatch, MoveError, PageMove, SeqMove};

use crate::cache::KvCache;
use crate::error::RtError;

impl From<MoveError> for RtError {
    fn from(e: MoveError) -> RtError {
        match e {
            MoveError::BadTier(t, why) => RtError::BadTier(t, why),
            MoveError::BadInput(why) => RtError::BadInput(why),
        }
    }
}

impl PagedCache for KvCache {
    type Error = RtError;
    fn spec(&self) -> &Spec {
        KvCache::spec(self)
    }
    fn head_dim(&self) -> usize {
        self.config().head_dim
    }
    fn num_kv_heads(&self) -> usize {
        self.config().num_kv_heads
    }
    fn page_tiers(&self, seq: usize, head: usize) -> Result<Vec<(TierId, usize)>, Self::Error> {
        KvCache::page_tiers(self, seq, head)
    }
    fn page_counts(&self, seq: usize, head: usize) -> Result<(usize, Option<usize>), Self::Error> {
        KvCache::page_counts(self, seq, head)
    }
    fn retier(&mut self, seq: usize, head: usize, index: usize, to: TierId) -> Result<(), Self::Error> {
        KvCache::retier(self, seq, head, index, to)
    }
    fn retier_pages(&mut self, seq: usize, moves: &[PageMove]) -> Result<usize, Self::Error> {
        KvCache::retier_pages(self, seq, moves)
    }
    fn retier_many(&mut self, batch: &[(usize, &[PageMove])]) -> Result<Vec<usize>, Self::Error> {
        KvCache::retier_many(self, batch)
    }
    fn layout_epoch(&self, seq: usize) -> Option<u64> {
        KvCache::layout_epoch(self, seq).ok()
    }
}
