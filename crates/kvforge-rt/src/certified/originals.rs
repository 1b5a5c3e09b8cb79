//! Tier 2 of certified decode (seed 004 §3.4, P4): the fp16 originals of every encoded page in
//! pinned host memory, written when the page is encoded and kept for the life of the cache.
//!
//! A promoted page is served from here, either read by the decode kernel straight over UVA or
//! copied into a device scratch page first ([`PageIn`]). The store also keeps, per encoded
//! page, the two numbers the certificate needs and only the encoder can know cheaply:
//! η_b = max_t ‖V_t − V̂_t‖₂ of every 16-token block (its value error) and max_t ‖V_t‖₂.

use std::collections::HashMap;

use cudarc::driver::{sys, PinnedHostSlice};

use crate::error::{drv, Result, RtError};
use crate::pool::PageRef;

/// How promoted pages reach the decode kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum PageIn {
    /// The kernel reads the pinned original in place (zero-copy over PCIe / C2C).
    Uva,
    /// Host-to-device copies into a scratch buffer, then the kernel reads device memory.
    Copy,
}

/// Most 16-token blocks a page of a certified cache holds (the promoted-block mask of a page
/// table entry has 8 bits).
pub const MAX_BLOCKS_PER_PAGE: usize = 8;

/// What the encoder measured of one page.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PageErrors {
    /// Per 16-token block b: η_b = max over its tokens of ‖V_t − V̂_t‖₂ (entries past the
    /// page's blocks unused).
    pub eta: [f64; MAX_BLOCKS_PER_PAGE],
    /// max over the page's tokens of ‖V_t‖₂.
    pub v_max: f64,
}

impl PageErrors {
    /// Every block with the same η (tests, and pages measured as a whole).
    pub fn uniform(eta: f64, v_max: f64) -> PageErrors {
        PageErrors { eta: [eta; MAX_BLOCKS_PER_PAGE], v_max }
    }
}

/// Pinned slab of fp16 original pages (tail-page format: header + K + V), one slot per page of
/// the cache's target tier (slot = the page's index in its region).
pub struct Originals {
    slab: PinnedHostSlice<u8>,
    /// Host (and, under UVA, device) address of the slab.
    base: u64,
    page_bytes: usize,
    /// Keyed by the encoded page: slot written, and its measured errors.
    pages: HashMap<PageRef, PageErrors>,
    capacity: usize,
}

impl Originals {
    /// Allocates `capacity` slots of `page_bytes`. Running out of pinned memory is a typed
    /// error here, before any certified output can depend on it.
    pub fn new(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, capacity: usize, page_bytes: usize) -> Result<Originals> {
        let bytes = capacity.max(1) * page_bytes;
        // SAFETY: the slab is plain bytes, written before any read (slots are only read once
        // `record` filled them).
        let slab =
            unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(|e| RtError::OutOfPinnedMemory { bytes, reason: e.to_string() })?;
        let base = slab.as_ptr().map_err(drv("tier-2 slab"))? as u64;
        Ok(Originals { slab, base, page_bytes, pages: HashMap::new(), capacity })
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// Stores the original of encoded page `page` and its measured errors.
    pub fn record(&mut self, page: PageRef, original: &[u8], errors: PageErrors) -> Result<()> {
        let slot = page.index as usize;
        if slot >= self.capacity || original.len() > self.page_bytes {
            return Err(RtError::CapacityExceeded {
                what: "tier-2 originals".into(),
                requested: format!("slot {slot} ({} B page)", original.len()),
                capacity: format!("{} slots of {} B", self.capacity, self.page_bytes),
            });
        }
        let base = self.slab.as_mut_ptr().map_err(drv("tier-2 slab"))?;
        // SAFETY: slot < capacity, so [slot * page_bytes, + original.len()) lies in the slab.
        // No copy still reads it: the ladder's page-in copies from the slab are ordered before
        // the step's output download, which synchronises the stream, and slots are written
        // between steps. (`as_mut_ptr` waits for nothing: cudarc records the slab's event only
        // when the context tracks several streams.)
        unsafe { std::ptr::copy_nonoverlapping(original.as_ptr(), base.add(slot * self.page_bytes), original.len()) };
        self.pages.insert(page, errors);
        Ok(())
    }

    /// Forgets a page (freed or re-tiered: its slot may be reused; fault injection: a lost page).
    pub fn forget(&mut self, page: &PageRef) {
        self.pages.remove(page);
    }

    /// Errors of an encoded page, or the typed "missing original" error.
    pub fn errors(&self, page: &PageRef) -> Result<PageErrors> {
        self.pages.get(page).copied().ok_or(RtError::MissingOriginal { page: page.index as usize, offset: page.offset })
    }

    /// Host address of page's original (also its device address under UVA).
    pub fn address(&self, page: &PageRef) -> Result<u64> {
        self.errors(page)?;
        Ok(self.base + (page.index as usize * self.page_bytes) as u64)
    }
}
