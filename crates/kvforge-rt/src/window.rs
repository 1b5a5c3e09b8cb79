//! The recent-window policy (issue 26): which full pages of a sequence stay dense.
//!
//! Low-bit tiers meet their quality targets only when a query reads its most recent tokens
//! and the first few (attention sinks) at full precision (docs/quality.md, "Recent window at
//! fp16"). A cache with a policy keeps such pages in the tail format (tier 0, dense fp16 or
//! bf16, `length` = page size) among the coded ones: a full page is encoded into the target
//! tier only once `recent_pages` newer full pages exist, and the first `sink_pages` pages
//! never are. Decode dispatches on each page's tier and always serves tier 0, so the kernels
//! need nothing new. Page granularity makes the dense window between `recent_pages` and
//! `recent_pages + 1` pages of tokens (the partly filled tail page on top of the full ones).
//!
//! The decision ([`WindowPolicy::to_encode`]) is a pure function of logical page numbers (a
//! page's first token over the page size, which dropped pages do not shift), tested without a
//! device; the cache's append paths ask it which pages to encode, and the `KvCache` half of
//! this module finds and encodes the dense pages that leave the window.

use std::ops::Range;

use kvforge_spec::{HEADER_BYTES, TAIL_TIER};

use crate::cache::KvCache;
use crate::error::Result;
use crate::pool::PageRef;

/// Full pages kept dense: the first `sink_pages` of a sequence, and the `recent_pages` newest.
/// The default (0, 0) encodes every page as it fills.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct WindowPolicy {
    /// Pages from the start of a sequence that are never encoded.
    pub sink_pages: usize,
    /// Newest full pages that stay dense: a full page is encoded once this many newer full
    /// pages exist.
    pub recent_pages: usize,
}

impl WindowPolicy {
    pub fn new(sink_pages: usize, recent_pages: usize) -> WindowPolicy {
        WindowPolicy { sink_pages, recent_pages }
    }

    /// Whether every page is encoded as it fills (no sinks, no window).
    pub fn is_off(&self) -> bool {
        self.sink_pages == 0 && self.recent_pages == 0
    }

    /// Most full pages of one (sequence, kv head) that stay dense at once (each a page of the
    /// tail tier besides the tail page itself).
    pub fn dense_pages(&self) -> usize {
        self.sink_pages + self.recent_pages
    }

    /// Whether full page `page` of a (sequence, kv head) with `full` full pages (logical
    /// numbers) is kept dense.
    pub fn keeps_dense(&self, page: usize, full: usize) -> bool {
        page < self.sink_pages || page + self.recent_pages >= full
    }

    /// The logical pages an append that takes a (sequence, kv head) from `before` to `after`
    /// full pages encodes: those dense before (or new) and not after. Pages below `before` in
    /// it were kept dense by earlier appends and are encoded now; pages from `before` on are
    /// the append's own, encoded as they fill. Empty when nothing crosses the window.
    pub fn to_encode(&self, before: usize, after: usize) -> Range<usize> {
        let lo = self.sink_pages.max(before.saturating_sub(self.recent_pages));
        let hi = after.saturating_sub(self.recent_pages);
        lo..hi.max(lo)
    }

    /// How many of an append's own new full pages (logical `before..after`) it encodes as they
    /// fill; the other new pages stay dense. The rest of [`to_encode`](Self::to_encode), below
    /// `before`, are older dense pages the append pushes out of the window.
    pub fn encodes_new(&self, before: usize, after: usize) -> usize {
        let r = self.to_encode(before, after);
        r.end.saturating_sub(r.start.max(before))
    }
}

/// A dense full page a window-policy append encodes: (sequence, kv head, index among the
/// head's full pages, the page).
pub(crate) type DensePage = (usize, usize, usize, PageRef);

impl KvCache {
    /// The dense full pages of `seq` that an append taking it from `before` to `after` logical
    /// full pages pushes out of the window (pages older than `before`; the append's own new
    /// pages it decides as they fill). Pages a controller already re-coded or dropped are not
    /// listed. Every kv head, head by head.
    pub(crate) fn window_encodes(&self, seq: usize, before: usize, after: usize) -> Result<Vec<DensePage>> {
        let range = self.cfg.window.to_encode(before, after);
        let old = range.start..range.end.min(before);
        let mut out = Vec::new();
        if old.is_empty() {
            return Ok(out);
        }
        for h in 0..self.cfg.num_kv_heads {
            out.extend(self.store.dense_full_pages(seq, h, old.clone())?.into_iter().map(|(i, page)| (seq, h, i, page)));
        }
        Ok(out)
    }

    /// Encodes dense full pages (from [`window_encodes`](Self::window_encodes)) into the target
    /// tier in place: one transcode launch straight from their device pages, not waited for
    /// (its fault flags are watched, as a decode step's encode of its filled tails). An
    /// uncalibrated spherical target takes its radius scales from the pages first (downloaded
    /// for it); the launch is the same, so no staging page is needed. (Certified decode, whose
    /// originals would be recorded here, refuses a cache with a window.)
    /// The pages keep their positions; their sequences get a new layout epoch (the tiers
    /// changed), not a new table epoch (a resident decode table re-reads the few entries). The
    /// caller reserved the target pages.
    pub(crate) fn encode_dense_pages(&mut self, pages: &[DensePage]) -> Result<()> {
        if pages.is_empty() {
            return Ok(());
        }
        let target = self.cfg.target_tier;
        if self.encode_needs_host(target) {
            let seg = self.spec.segment(TAIL_TIER, self.cfg.head_dim);
            let mut bytes: Vec<(usize, Vec<u8>)> = Vec::with_capacity(pages.len());
            for &(_, h, _, page) in pages {
                let mut b = self.store.download_page(page)?;
                b.truncate(seg.page_bytes);
                bytes.push((h, b));
            }
            self.ensure_radius_scales(target, &bytes, HEADER_BYTES + seg.offset("k"))?;
        }
        let src: Vec<PageRef> = pages.iter().map(|p| p.3).collect();
        let heads: Vec<u32> = pages.iter().map(|p| p.1 as u32).collect();
        let dst: Vec<PageRef> = (0..src.len()).map(|_| self.store.pool_mut().alloc(target)).collect::<Result<_>>()?;
        if let Err(e) = self.transcode_watched(&src, &dst, &heads, TAIL_TIER, target) {
            dst.into_iter().for_each(|p| self.store.pool_mut().free(p));
            return Err(e);
        }
        let mut seqs: Vec<usize> = Vec::new();
        for (&(s, h, i, old), new) in pages.iter().zip(dst) {
            let was = self.store.replace_full(s, h, i, new)?;
            debug_assert_eq!(was, old);
            self.store.pool_mut().free(old);
            if !seqs.contains(&s) {
                seqs.push(s);
            }
        }
        for s in seqs {
            self.store.window_recoded(s)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pages dense after appending tokens one at a time, by brute force over `keeps_dense`.
    fn dense_after(w: WindowPolicy, full: usize) -> Vec<usize> {
        (0..full).filter(|&i| w.keeps_dense(i, full)).collect()
    }

    #[test]
    fn off_encodes_every_page_as_it_fills() {
        let w = WindowPolicy::default();
        assert!(w.is_off());
        assert_eq!(w.to_encode(0, 0), 0..0);
        assert_eq!(w.to_encode(0, 1), 0..1);
        assert_eq!(w.to_encode(3, 7), 3..7);
        assert_eq!(dense_after(w, 5), Vec::<usize>::new());
    }

    #[test]
    fn encodes_new_counts_the_append_s_own_pages_only() {
        let w = WindowPolicy::new(1, 2);
        for before in 0..12 {
            for after in before..before + 9 {
                let own = (before..after).filter(|k| w.to_encode(before, after).contains(k)).count();
                assert_eq!(w.encodes_new(before, after), own, "{before}..{after}");
            }
        }
        assert_eq!(WindowPolicy::default().encodes_new(3, 7), 4);
    }

    #[test]
    fn sinks_and_window_stay_dense() {
        let w = WindowPolicy::new(1, 2);
        assert_eq!(w.dense_pages(), 3);
        // Fewer full pages than sinks + window: nothing is ever encoded.
        for (before, after) in [(0, 0), (0, 1), (0, 3), (1, 2), (2, 3)] {
            assert!(w.to_encode(before, after).is_empty(), "{before} -> {after}");
        }
        // The fourth full page pushes page 1 out of the window; page 0 is a sink.
        assert_eq!(w.to_encode(3, 4), 1..2);
        assert_eq!(w.to_encode(4, 5), 2..3);
        assert_eq!(dense_after(w, 5), vec![0, 3, 4]);
        // A prompt of 32 pages at once: pages 1..30 encoded, 0, 30 and 31 dense.
        assert_eq!(w.to_encode(0, 32), 1..30);
        // Continuing a prompt: the window's old pages are encoded along with new ones.
        assert_eq!(w.to_encode(3, 10), 1..8);
    }

    #[test]
    fn a_window_without_sinks_and_sinks_without_a_window() {
        let win = WindowPolicy::new(0, 2);
        assert_eq!(win.to_encode(0, 2), 0..0);
        assert_eq!(win.to_encode(2, 3), 0..1);
        assert_eq!(win.to_encode(0, 5), 0..3);
        let sinks = WindowPolicy::new(2, 0);
        assert_eq!(sinks.to_encode(0, 1), 2..2);
        assert_eq!(sinks.to_encode(0, 5), 2..5);
        assert_eq!(sinks.to_encode(5, 6), 5..6);
        assert_eq!(dense_after(sinks, 6), vec![0, 1]);
    }

    /// Token-level appends as the cache makes them: an append of `n` tokens to a sequence of
    /// `len` takes it from `len / P` to `(len + n) / P` full pages.
    fn encoded_after_appends(w: WindowPolicy, p: usize, appends: &[usize]) -> (usize, Vec<bool>) {
        let mut len = 0;
        let mut encoded = Vec::new();
        for &n in appends {
            let (before, after) = (len / p, (len + n) / p);
            encoded.resize(after, false);
            for i in w.to_encode(before, after) {
                assert!(!encoded[i], "page {i} encoded twice");
                encoded[i] = true;
            }
            len += n;
        }
        (len, encoded)
    }

    #[test]
    fn odd_lengths_empty_and_one_token_sequences() {
        let (w, p) = (WindowPolicy::new(1, 2), 64);
        // Empty appends and a one-token sequence: no full page, nothing encoded.
        assert_eq!(encoded_after_appends(w, p, &[]), (0, vec![]));
        assert_eq!(encoded_after_appends(w, p, &[0, 0]), (0, vec![]));
        assert_eq!(encoded_after_appends(w, p, &[1]), (1, vec![]));
        // Shorter than sinks + window (3 pages + a partial tail): never encoded.
        for n in [63, 64, 65, 127, 128, 129, 191, 192, 193, 255] {
            let (_, e) = encoded_after_appends(w, p, &[n]);
            assert!(e.iter().all(|&x| !x), "{n} tokens: {e:?}");
            let (_, e) = encoded_after_appends(w, p, &vec![1; n]);
            assert!(e.iter().all(|&x| !x), "{n} single tokens: {e:?}");
        }
        // The fourth full page (token 256) pushes page 1 out; page 0 stays a sink.
        assert_eq!(encoded_after_appends(w, p, &[256]).1, vec![false, true, false, false]);
        assert_eq!(encoded_after_appends(w, p, &vec![1; 256]).1, vec![false, true, false, false]);
        // Odd splits agree with one append of the same tokens.
        for splits in [vec![1, 62, 3, 200, 77, 1], vec![65; 9], vec![600], vec![63, 1, 63, 1, 472]] {
            let (len, e) = encoded_after_appends(w, p, &splits);
            let full = len / p;
            let want: Vec<bool> = (0..full).map(|i| !w.keeps_dense(i, full)).collect();
            assert_eq!(e, want, "{splits:?}");
            assert_eq!(e.iter().filter(|&&x| !x).count(), w.dense_pages().min(full));
        }
    }

    #[test]
    fn appends_in_any_split_encode_each_page_once_and_leave_the_policy_s_pages_dense() {
        for (sink, recent) in [(0, 0), (1, 2), (0, 1), (2, 0), (1, 0), (3, 5)] {
            let w = WindowPolicy::new(sink, recent);
            for step in [1usize, 2, 3, 7, 40] {
                let mut encoded = [false; 40];
                let mut full = 0;
                while full < 40 {
                    let after = (full + step).min(40);
                    for i in w.to_encode(full, after) {
                        assert!(!encoded[i], "page {i} encoded twice ({sink}, {recent}) step {step}");
                        encoded[i] = true;
                    }
                    full = after;
                    let dense: Vec<usize> = (0..full).filter(|&i| !encoded[i]).collect();
                    assert_eq!(dense, dense_after(w, full), "({sink}, {recent}) step {step} at {full}");
                }
            }
        }
    }
}
