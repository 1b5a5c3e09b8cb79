//! RDR's importance signal when the decode window lives on the device.
//!
//! [`ImportanceTracker`](crate::ImportanceTracker) is fed every decode step on the host. At
//! long contexts that bookkeeping (downloading every page's mass and folding them into hash
//! maps each step) was most of the controller's cost (issue 7). With `KvCache::decode_tracked` the window's maximum is kept by the GPU, and the
//! host works only when the controller runs: kvforge-control-rt's `roll_cache` takes the
//! window (one download) and folds it into the EMA.
//!
//! The result is the tracker's, number for number: [`PagedImportance::roll`] is
//! [`ImportanceTracker::observe`](crate::ImportanceTracker::observe) of every observed page
//! followed by [`ImportanceTracker::roll`](crate::ImportanceTracker::roll), in the same f64
//! operations. It is dense rather than hashed: a page's key is its kv head and logical page
//! (`first_token / page_tokens`; pages are aligned and logical positions are never reused),
//! so a roll over 4096 pages is a few array passes instead of ~8000 hash-map operations, and
//! dropped pages need no `retain` (their slot is never read again).

use crate::signal::PageKey;

/// Why a window could not be rolled in.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ImportanceError {
    #[error("EMA β = {0} must be in [0, 1)")]
    Beta(f64),
    #[error("pages must hold at least one token")]
    PageTokens,
    #[error("the window has {window} kv heads, the page table {pages}")]
    Heads { window: usize, pages: usize },
    #[error("kv head {head}: the window has {window} pages, the page table {pages}")]
    Shape { head: usize, window: usize, pages: usize },
    #[error("kv head {head}: a page starts at token {first_token}, not at a multiple of {page_tokens}")]
    Unaligned { head: usize, first_token: usize, page_tokens: usize },
    #[error("kv head {head}: the page at token {first_token} has share {share}; shares are finite and ≥ 0")]
    Share { head: usize, first_token: usize, share: f64 },
}

/// `ω_i = EMA_β(max over the window of a_s(i))` of one sequence's pages, rolled in once per
/// controller invocation from a window kept elsewhere (the GPU).
#[derive(Clone, Debug, PartialEq)]
pub struct PagedImportance {
    /// EMA coefficient β (weight of the past).
    pub beta: f64,
    page_tokens: usize,
    /// Per kv head, per logical page: the EMA, NaN until a window holding the page rolled in.
    ema: Vec<Vec<f64>>,
    /// Scratch of [`roll`](Self::roll): this window's maximum per logical page (NaN: unseen).
    seen: Vec<f64>,
}

impl PagedImportance {
    pub fn new(beta: f64, page_tokens: usize) -> Result<PagedImportance, ImportanceError> {
        if !(0.0..1.0).contains(&beta) {
            return Err(ImportanceError::Beta(beta));
        }
        if page_tokens == 0 {
            return Err(ImportanceError::PageTokens);
        }
        Ok(PagedImportance { beta, page_tokens, ema: Vec::new(), seen: Vec::new() })
    }

    /// Folds one window into the EMA. `first_tokens[h][i]` is the first token of page `i` of
    /// kv head `h` and `window[h][i]` its largest share over the window's decode steps
    /// (`None`: not observed). Pages in the EMA but not observed decay (their window value
    /// counts as 0); a page observed for the first time starts at its window value.
    pub fn roll(&mut self, first_tokens: &[Vec<usize>], window: &[Vec<Option<f64>>]) -> Result<(), ImportanceError> {
        if first_tokens.len() != window.len() {
            return Err(ImportanceError::Heads { window: window.len(), pages: first_tokens.len() });
        }
        for (head, (firsts, win)) in first_tokens.iter().zip(window).enumerate() {
            if firsts.len() != win.len() {
                return Err(ImportanceError::Shape { head, window: win.len(), pages: firsts.len() });
            }
            for (&first_token, w) in firsts.iter().zip(win) {
                if first_token % self.page_tokens != 0 {
                    return Err(ImportanceError::Unaligned { head, first_token, page_tokens: self.page_tokens });
                }
                if let Some(share) = *w {
                    if !(share.is_finite() && share >= 0.0) {
                        return Err(ImportanceError::Share { head, first_token, share });
                    }
                }
            }
        }
        if self.ema.len() < first_tokens.len() {
            self.ema.resize(first_tokens.len(), Vec::new());
        }
        let beta = self.beta;
        // Heads the window does not list observed nothing: their pages decay.
        for (h, ema) in self.ema.iter_mut().enumerate() {
            let (firsts, win) = match (first_tokens.get(h), window.get(h)) {
                (Some(f), Some(w)) => (f.as_slice(), w.as_slice()),
                _ => (&[][..], &[][..]),
            };
            let slots = firsts.last().map_or(0, |f| f / self.page_tokens + 1);
            if ema.len() < slots {
                ema.resize(slots, f64::NAN);
            }
            self.seen.clear();
            self.seen.resize(ema.len(), f64::NAN);
            for (&f, w) in firsts.iter().zip(win) {
                if let Some(share) = *w {
                    let s = &mut self.seen[f / self.page_tokens];
                    // `observe` keeps the window's maximum, starting from 0.
                    *s = if s.is_nan() { share.max(0.0) } else { s.max(share) };
                }
            }
            for (v, &z) in ema.iter_mut().zip(&self.seen) {
                *v = match (v.is_nan(), z.is_nan()) {
                    (false, false) => beta * *v + (1.0 - beta) * z,
                    (false, true) => beta * *v + (1.0 - beta) * 0.0,
                    (true, false) => z,
                    (true, true) => f64::NAN,
                };
            }
        }
        Ok(())
    }

    /// Smoothed importance of a page (0 if never observed).
    pub fn get(&self, key: PageKey) -> f64 {
        if key.first_token % self.page_tokens != 0 {
            return 0.0;
        }
        self.ema.get(key.head).and_then(|e| e.get(key.first_token / self.page_tokens)).copied().filter(|x| !x.is_nan()).unwrap_or(0.0)
    }
}
