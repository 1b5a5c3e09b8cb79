//! The sliding-window regions of one sequence (seed 001 §4.2.1, Fig. 5): `sinks` first tokens
//! and a `local` window on the GPU for dense attention, an update buffer of new tokens, and
//! the retrieval region between sinks and local, indexed by summaries with its K/V offloaded.
//!
//! Positions `[0, total)` are split, in order, into sinks `[0, s)`, retrieval
//! `[s, retrieval_end)`, local `[retrieval_end, retrieval_end + local_len)` and the buffer
//! after it. A decode token joins the local window while it is not full, else the buffer; when
//! the buffer holds `update` tokens, the oldest `update` local tokens move to the retrieval
//! region (the caller encodes their summaries and offloads their K/V:
//! `kvforge_rt::paris::ParisIndex::append`) and the buffer becomes the newest part of the local
//! window, which again holds `local` tokens.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::ParisError;

/// Region sizes (seed Table 1: local 128–256, update 256–512).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowConfig {
    pub sinks: usize,
    pub local: usize,
    pub update: usize,
}

/// The regions of one sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Regions {
    pub config: WindowConfig,
    total: usize,
    retrieval_end: usize,
    local_len: usize,
    buffer: usize,
}

impl Regions {
    /// The regions after a prefill of `prefill` tokens, and the range the caller indexes into
    /// the retrieval region (empty when the prefill fits sinks + local).
    pub fn after_prefill(config: WindowConfig, prefill: usize) -> Result<(Regions, Range<usize>), ParisError> {
        if config.update == 0 || config.local < config.update {
            return Err(ParisError::Schedule(format!("window: update {} must be 1 to local {}", config.update, config.local)));
        }
        let sinks = config.sinks.min(prefill);
        let retrieval_end = prefill.saturating_sub(config.local).max(sinks);
        let r = Regions { config, total: prefill, retrieval_end, local_len: prefill - retrieval_end, buffer: 0 };
        Ok((r, sinks..retrieval_end))
    }

    /// One new token; `Some(range)` when it triggers an update: the positions that move from
    /// the local window to the retrieval region.
    pub fn push(&mut self) -> Option<Range<usize>> {
        self.total += 1;
        if self.total <= self.config.sinks {
            self.retrieval_end = self.total;
            return None;
        }
        if self.local_len < self.config.local {
            self.local_len += 1;
            return None;
        }
        self.buffer += 1;
        if self.buffer < self.config.update {
            return None;
        }
        let moved = self.retrieval_end..self.retrieval_end + self.config.update;
        self.retrieval_end += self.config.update;
        self.buffer = 0;
        Some(moved)
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn sinks(&self) -> Range<usize> {
        0..self.config.sinks.min(self.total)
    }

    pub fn retrieval(&self) -> Range<usize> {
        self.sinks().end..self.retrieval_end
    }

    /// Local window and update buffer: the dense rows after the sinks.
    pub fn local(&self) -> Range<usize> {
        self.retrieval_end..self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_partition_and_move_in_updates() {
        let cfg = WindowConfig { sinks: 4, local: 16, update: 8 };
        let (mut r, first) = Regions::after_prefill(cfg, 100).unwrap();
        assert_eq!(first, 4..84);
        assert_eq!((r.sinks(), r.retrieval(), r.local()), (0..4, 4..84, 84..100));
        let mut next = 84;
        for t in 0..40 {
            let moved = r.push();
            if (t + 1) % 8 == 0 {
                assert_eq!(moved, Some(next..next + 8), "token {t}");
                next += 8;
                assert_eq!(r.local().len(), 16);
            } else {
                assert_eq!(moved, None);
            }
            assert_eq!(r.sinks().len() + r.retrieval().len() + r.local().len(), r.total());
            assert!(r.local().len() >= 16 && r.local().len() < 24);
        }
        // A short prefill fills the local window before anything is retrieved.
        let (mut r, first) = Regions::after_prefill(cfg, 10).unwrap();
        assert!(first.is_empty());
        assert_eq!((r.sinks(), r.local()), (0..4, 4..10));
        let moved: Vec<_> = (0..30).filter_map(|_| r.push()).collect();
        assert_eq!(moved, vec![4..12, 12..20]);
        assert_eq!(r.local(), 20..40);
        assert!(Regions::after_prefill(WindowConfig { sinks: 4, local: 8, update: 16 }, 10).is_err());
    }
}
