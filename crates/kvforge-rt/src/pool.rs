//! Page pool of one layer: one device arena cut into per-tier regions of fixed-size pages,
//! each with its own free list. A tier's pages never mix with another tier's, so the arena
//! cannot fragment across tiers; allocation is O(1) and all-or-nothing.
//!
//! This module is pure bookkeeping (no CUDA), so it is tested on any machine.

use kvforge_spec::{Spec, TierId};

use crate::error::{Result, RtError};

/// A page in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageRef {
    pub tier: TierId,
    /// Index within the tier's region.
    pub index: u32,
    /// Byte offset in the arena.
    pub offset: u64,
}

#[derive(Clone, Debug)]
struct Region {
    page_bytes: usize,
    first: u64,
    capacity: usize,
    free: Vec<u32>,
}

/// Per-tier regions and free lists.
#[derive(Clone, Debug)]
pub struct PagePool {
    regions: Vec<Region>,
    names: Vec<String>,
    arena_bytes: u64,
}

impl PagePool {
    /// Lays out `capacity[t]` pages of every tier `t` (tiers without bytes get none).
    pub fn new(spec: &Spec, head_dim: usize, capacity: &[usize]) -> Result<PagePool> {
        if capacity.len() != spec.tiers.len() {
            return Err(RtError::ShapeMismatch {
                what: "page capacity list".into(),
                expected: format!("one entry per tier of spec `{}` ({})", spec.name, spec.tiers.len()),
                got: format!("{} entries", capacity.len()),
            });
        }
        let mut at = 0u64;
        let mut regions = Vec::new();
        for t in &spec.tiers {
            let page_bytes = spec.segment(t.id, head_dim).page_bytes;
            let cap = if page_bytes == 0 { 0 } else { capacity[t.id as usize] };
            let align = spec.page.alignment as u64;
            at = at.div_ceil(align) * align;
            regions.push(Region { page_bytes, first: at, capacity: cap, free: (0..cap as u32).rev().collect() });
            at += (cap * page_bytes) as u64;
        }
        Ok(PagePool { regions, names: spec.tiers.iter().map(|t| t.name.clone()).collect(), arena_bytes: at })
    }

    pub fn arena_bytes(&self) -> u64 {
        self.arena_bytes
    }
    pub fn page_bytes(&self, tier: TierId) -> usize {
        self.regions[tier as usize].page_bytes
    }
    pub fn capacity(&self, tier: TierId) -> usize {
        self.regions[tier as usize].capacity
    }
    pub fn free_pages(&self, tier: TierId) -> usize {
        self.regions[tier as usize].free.len()
    }
    pub fn used_pages(&self, tier: TierId) -> usize {
        self.capacity(tier) - self.free_pages(tier)
    }

    /// Fails without allocating anything unless `need[t]` pages of every tier are free.
    pub fn reserve(&self, need: &[usize]) -> Result<()> {
        for (t, &n) in need.iter().enumerate() {
            if n > self.regions[t].free.len() {
                return Err(self.out_of_pages(t as TierId));
            }
        }
        Ok(())
    }

    /// The error for tier `tier` having too few free pages.
    pub fn out_of_pages(&self, tier: TierId) -> RtError {
        let r = &self.regions[tier as usize];
        RtError::OutOfPages { tier: self.names[tier as usize].clone(), capacity: r.capacity, page_bytes: r.page_bytes }
    }

    pub fn alloc(&mut self, tier: TierId) -> Result<PageRef> {
        let index = self.regions[tier as usize].free.pop().ok_or_else(|| self.out_of_pages(tier))?;
        let r = &self.regions[tier as usize];
        Ok(PageRef { tier, index, offset: r.first + index as u64 * r.page_bytes as u64 })
    }

    pub fn free(&mut self, page: PageRef) {
        let r = &mut self.regions[page.tier as usize];
        debug_assert!(!r.free.contains(&page.index), "double free of {page:?}");
        r.free.push(page.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> Spec {
        Spec::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/certified.toml")).unwrap()
    }

    #[test]
    fn regions_do_not_overlap_and_oom_is_all_or_nothing() {
        let s = spec();
        let mut p = PagePool::new(&s, 128, &[2, 1, 3]).unwrap();
        let a: Vec<PageRef> = (0..3).map(|_| p.alloc(2).unwrap()).collect();
        let t = p.alloc(0).unwrap();
        assert!(matches!(p.alloc(2), Err(RtError::OutOfPages { .. })));
        assert!(p.reserve(&[1, 1, 0]).is_ok());
        assert!(p.reserve(&[2, 0, 0]).is_err());
        let mut spans: Vec<(u64, u64)> = a.iter().chain([&t]).map(|r| (r.offset, r.offset + p.page_bytes(r.tier) as u64)).collect();
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "pages overlap: {w:?}");
        }
        assert!(spans.last().unwrap().1 <= p.arena_bytes());
        p.free(a[1]);
        assert_eq!(p.alloc(2).unwrap(), a[1]);
        assert_eq!(p.used_pages(2), 3);
    }
}
