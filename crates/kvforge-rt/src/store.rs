//! The page store of one layer: the device arena and its per-tier page pool, the sequences'
//! page tables (full pages with their logical positions, the dense tail page with its host
//! mirror), layout epochs, page bytes up- and download, and the memory report. It knows pages
//! and bytes, not codecs: encoding, side tables and launches live in [`KvCache`](crate::KvCache)
//! and its engine.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use kvforge_spec::{PageHeader, SegmentLayout, Spec, TierId, HEADER_BYTES, TAIL_TIER};

use crate::error::{drv, Result, RtError};
use crate::pool::{PagePool, PageRef};
use crate::window::WindowPolicy;

/// The tail page of one (sequence, kv head): its device page and a host mirror of its bytes.
#[derive(Clone, Debug)]
struct Tail {
    page: PageRef,
    bytes: Vec<u8>,
    len: usize,
    /// The device page changed since `bytes` were taken (a device-side append wrote it): the
    /// mirror is downloaded again before a host path reads it ([`PageStore::refresh_tails`]).
    stale: bool,
}

#[derive(Clone, Debug, Default)]
struct HeadPages {
    full: Vec<PageRef>,
    /// Logical position of the first token of every page in `full`: dropped pages leave gaps,
    /// so a page's index no longer says where it sits in the context.
    first: Vec<usize>,
    tail: Option<Tail>,
}

#[derive(Clone, Debug)]
struct Sequence {
    heads: Vec<HeadPages>,
    /// Logical length: every token ever appended, dropped ones included.
    len: usize,
    /// [`PageStore::layout_epoch`]: new whenever the pages change other than by appends.
    epoch: u64,
    /// [`PageStore::table_epoch`]: as `epoch`, except that the window policy's encodes of
    /// pages an append pushed out of the recent window keep it.
    table_epoch: u64,
}

/// Resident bytes of one tier.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TierUsage {
    pub tier: String,
    pub pages: usize,
    pub tokens: usize,
    /// Page bytes in use (header + segment + alignment padding).
    pub resident_bytes: usize,
    /// Spec cost: payload + metadata per token per head.
    pub payload_bytes_per_token: f64,
    /// resident_bytes / tokens.
    pub resident_bytes_per_token: f64,
}

/// Sequences, their page tables and the page bytes on the device.
pub(crate) struct PageStore {
    stream: Arc<CudaStream>,
    pool: PagePool,
    arena: CudaSlice<u8>,
    seqs: Vec<Option<Sequence>>,
    /// Last [`layout_epoch`](Self::layout_epoch) handed out.
    epochs: u64,
    /// Tokens per page.
    page_tokens: usize,
    kv_heads: usize,
    /// The cache's window policy: which full pages appends may re-code after the fact.
    window: WindowPolicy,
}

impl PageStore {
    /// Lays out `pages[t]` pages of every tier `t` at head dim `d` and allocates the arena.
    pub(crate) fn new(stream: Arc<CudaStream>, spec: &Spec, d: usize, kv_heads: usize, pages: &[usize], window: WindowPolicy) -> Result<PageStore> {
        let pool = PagePool::new(spec, d, pages)?;
        let arena_bytes = pool.arena_bytes().max(16) as usize;
        let arena = stream.alloc_zeros::<u8>(arena_bytes).map_err(|e| match drv("page arena")(e) {
            RtError::OutOfMemory { what, .. } => RtError::OutOfMemory { what, bytes: arena_bytes },
            e => e,
        })?;
        Ok(PageStore { stream, pool, arena, seqs: Vec::new(), epochs: 0, page_tokens: spec.page.tokens, kv_heads, window })
    }

    pub(crate) fn pool(&self) -> &PagePool {
        &self.pool
    }

    pub(crate) fn pool_mut(&mut self) -> &mut PagePool {
        &mut self.pool
    }

    /// Device address of the arena, for kernel parameters.
    pub(crate) fn arena_ptr(&self) -> u64 {
        self.arena.device_ptr(&self.stream).0
    }

    /// Adds an empty sequence and returns its id.
    pub(crate) fn add_sequence(&mut self) -> usize {
        let epoch = self.next_epoch();
        let s = Sequence { heads: vec![HeadPages::default(); self.kv_heads], len: 0, epoch, table_epoch: epoch };
        if let Some(i) = self.seqs.iter().position(|s| s.is_none()) {
            self.seqs[i] = Some(s);
            i
        } else {
            self.seqs.push(Some(s));
            self.seqs.len() - 1
        }
    }

    /// Frees every page of a sequence.
    pub(crate) fn remove_sequence(&mut self, seq: usize) -> Result<()> {
        let s = self.seqs.get_mut(seq).and_then(|s| s.take()).ok_or(RtError::NoSequence(seq))?;
        for h in s.heads {
            for p in h.full {
                self.pool.free(p);
            }
            if let Some(t) = h.tail {
                self.pool.free(t.page);
            }
        }
        Ok(())
    }

    /// See [`KvCache::layout_epoch`](crate::KvCache::layout_epoch).
    pub(crate) fn layout_epoch(&self, seq: usize) -> Result<u64> {
        Ok(self.seq(seq)?.epoch)
    }

    fn next_epoch(&mut self) -> u64 {
        self.epochs += 1;
        self.epochs
    }

    /// Gives `seq` a new layout epoch: its pages are about to change other than by appends.
    pub(crate) fn bump_epoch(&mut self, seq: usize) -> Result<()> {
        let epoch = self.next_epoch();
        let s = self.seq_mut(seq)?;
        s.epoch = epoch;
        s.table_epoch = epoch;
        Ok(())
    }

    /// Gives `seq` a new layout epoch for a re-code by its window policy (an append pushed
    /// dense pages out of the recent window): a controller's snapshot no longer names the
    /// pages' tiers, while a [`ResidentTable`](crate::resident::ResidentTable) finds the
    /// re-coded pages among the last few it lists ([`window_recodes`](Self::window_recodes))
    /// and keeps its layout.
    pub(crate) fn window_recoded(&mut self, seq: usize) -> Result<()> {
        let epoch = self.next_epoch();
        self.seq_mut(seq)?.epoch = epoch;
        Ok(())
    }

    /// Like [`layout_epoch`](Self::layout_epoch), except that the window policy's re-codes
    /// keep it (what a resident decode table rebuilds on).
    pub(crate) fn table_epoch(&self, seq: usize) -> Result<u64> {
        Ok(self.seq(seq)?.table_epoch)
    }

    /// How many full pages before a (sequence, kv head)'s last `n` an append may re-code
    /// without a new [`table_epoch`](Self::table_epoch): the window policy's recent pages.
    pub(crate) fn window_recodes(&self) -> usize {
        self.window.recent_pages
    }

    /// `(index, page)` of the full pages of (seq, head) in the tail tier whose logical page
    /// number (first token over the page size) lies in `pages`, in order: the dense pages a
    /// window-policy append encodes. Walks back from the newest page, so it costs the pages
    /// from the range on, not the sequence.
    pub(crate) fn dense_full_pages(&self, seq: usize, head: usize, pages: std::ops::Range<usize>) -> Result<Vec<(usize, PageRef)>> {
        let h = self.head(seq, head)?;
        let p = self.page_tokens;
        let mut out = Vec::new();
        for (i, (&r, &f)) in h.full.iter().zip(&h.first).enumerate().rev() {
            let page = f / p;
            if page < pages.start {
                break;
            }
            if pages.contains(&page) && r.tier == TAIL_TIER {
                out.push((i, r));
            }
        }
        out.reverse();
        Ok(out)
    }

    fn seq(&self, seq: usize) -> Result<&Sequence> {
        self.seqs.get(seq).and_then(|s| s.as_ref()).ok_or(RtError::NoSequence(seq))
    }

    fn seq_mut(&mut self, seq: usize) -> Result<&mut Sequence> {
        self.seqs.get_mut(seq).and_then(|s| s.as_mut()).ok_or(RtError::NoSequence(seq))
    }

    fn head(&self, seq: usize, head: usize) -> Result<&HeadPages> {
        self.seq(seq)?.heads.get(head).ok_or(RtError::NoKvHead { head, heads: self.kv_heads })
    }

    /// Logical length of `seq`: tokens appended so far, including those of dropped pages.
    pub(crate) fn seq_len(&self, seq: usize) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    /// `(page, valid tokens, first token)` of every page of (seq, head), the tail last.
    pub(crate) fn positioned_pages(&self, seq: usize, head: usize) -> Result<Vec<(PageRef, usize, usize)>> {
        let s = self.seq(seq)?;
        let h = self.head(seq, head)?;
        let p = self.page_tokens;
        let mut v: Vec<(PageRef, usize, usize)> = h.full.iter().zip(&h.first).map(|(&r, &f)| (r, p, f)).collect();
        if let Some(t) = &h.tail {
            v.push((t.page, t.len, s.len - t.len));
        }
        Ok(v)
    }

    /// Full pages of one (sequence, kv head), and the tail page's tokens if it has one.
    pub(crate) fn page_counts(&self, seq: usize, head: usize) -> Result<(usize, Option<usize>)> {
        let h = self.head(seq, head)?;
        Ok((h.full.len(), h.tail.as_ref().map(|t| t.len)))
    }

    /// `f(page, valid tokens)` of every page of (seq, head) in token order, the tail last.
    pub(crate) fn map_pages<T>(&self, seq: usize, head: usize, f: impl Fn(PageRef, usize) -> T) -> Result<Vec<T>> {
        let h = self.head(seq, head)?;
        let p = self.page_tokens;
        let mut v = Vec::with_capacity(h.full.len() + 1);
        v.extend(h.full.iter().map(|&r| f(r, p)));
        if let Some(t) = &h.tail {
            v.push(f(t.page, t.len));
        }
        Ok(v)
    }

    /// Full page `index` of (seq, head).
    pub(crate) fn full_page(&self, seq: usize, head: usize, index: usize) -> Result<PageRef> {
        self.seq(seq)?.heads.get(head).and_then(|h| h.full.get(index)).copied().ok_or(RtError::NoPage { seq, head, index })
    }

    /// Puts `page` in place of full page `index` of (seq, head) and returns the page it held.
    pub(crate) fn replace_full(&mut self, seq: usize, head: usize, index: usize, page: PageRef) -> Result<PageRef> {
        let slot = self.seq_mut(seq)?.heads.get_mut(head).and_then(|h| h.full.get_mut(index)).ok_or(RtError::NoPage { seq, head, index })?;
        Ok(std::mem::replace(slot, page))
    }

    /// Removes the full pages `(head, index)` of `seq` from its tables (indices as they are
    /// before the call; the pages themselves are the caller's to free). The other pages keep
    /// their logical positions.
    pub(crate) fn remove_full(&mut self, seq: usize, dropped: &[(usize, usize)]) -> Result<()> {
        let seq = self.seq_mut(seq)?;
        let mut keep: Vec<Vec<bool>> = seq.heads.iter().map(|h| vec![true; h.full.len()]).collect();
        for &(h, i) in dropped {
            keep[h][i] = false;
        }
        for (h, keep) in seq.heads.iter_mut().zip(keep) {
            let (mut a, mut b) = (keep.iter(), keep.iter());
            h.full.retain(|_| *a.next().unwrap());
            h.first.retain(|_| *b.next().unwrap());
        }
        Ok(())
    }

    /// Frees the tail pages of every head of `seq` (appends supersede them).
    pub(crate) fn free_tails(&mut self, seq: usize) -> Result<()> {
        let s = self.seqs.get_mut(seq).and_then(|s| s.as_mut()).ok_or(RtError::NoSequence(seq))?;
        for h in s.heads.iter_mut() {
            if let Some(t) = h.tail.take() {
                self.pool.free(t.page);
            }
        }
        Ok(())
    }

    /// Appends encoded full pages `(kv head, page)` of `seq` in token order: each head's
    /// pages follow its last one, starting at the sequence's current length.
    pub(crate) fn push_full(&mut self, seq: usize, pages: impl IntoIterator<Item = (usize, PageRef)>) -> Result<()> {
        let (p, hkv) = (self.page_tokens, self.kv_heads);
        let s = self.seq_mut(seq)?;
        let mut next = vec![s.len / p; hkv]; // index of the next full page, in logical pages
        for (h, page) in pages {
            s.heads[h].full.push(page);
            s.heads[h].first.push(next[h] * p);
            next[h] += 1;
        }
        Ok(())
    }

    /// Gives (seq, head) a new tail page holding `bytes` (`len` tokens).
    pub(crate) fn set_tail(&mut self, seq: usize, head: usize, bytes: Vec<u8>, len: usize) -> Result<()> {
        self.seq(seq)?;
        let page = self.pool.alloc(TAIL_TIER)?;
        self.upload(page, &bytes)?;
        self.seq_mut(seq)?.heads[head].tail = Some(Tail { page, bytes, len, stale: false });
        Ok(())
    }

    /// Adds `n` appended tokens to the logical length of `seq`.
    pub(crate) fn grow(&mut self, seq: usize, n: usize) -> Result<()> {
        self.seq_mut(seq)?.len += n;
        Ok(())
    }

    /// Copies host bytes to the start of a page.
    pub(crate) fn upload(&mut self, page: PageRef, bytes: &[u8]) -> Result<()> {
        let off = page.offset as usize;
        let mut view = self.arena.slice_mut(off..off + bytes.len());
        self.stream.memcpy_htod(bytes, &mut view).map_err(drv("page upload"))
    }

    /// See [`KvCache::tile_sequence`](crate::KvCache::tile_sequence); `target` is the tier
    /// full pages are encoded into.
    pub(crate) fn tile_sequence(&mut self, s0: usize, batch: usize, len: usize, target: TierId, tiers: usize) -> Result<Vec<usize>> {
        let (hkv, p) = (self.kv_heads, self.page_tokens);
        if batch == 0 || len == 0 {
            return Err(RtError::BadInput("tiling needs batch > 0 and len > 0".into()));
        }
        if !self.window.is_off() {
            // Tiling copies pages of the target tier only; a template whose sinks and window
            // are dense pages would need them copied (and counted) apart.
            return Err(RtError::BadInput(format!("tiling a cache with a window policy ({} sink pages, {} recent pages) is not supported", self.window.sink_pages, self.window.recent_pages)));
        }
        let full = len / p;
        let tmpl_full = (1..=full.min(16)).rev().find(|t| full.is_multiple_of(*t)).unwrap_or(0);
        let tmpl_len = tmpl_full * p + len % p;
        let s = self.seq(s0)?;
        if s.len != tmpl_len || s.heads.iter().any(|h| h.full.len() != tmpl_full) {
            return Err(RtError::BadInput(format!("tiling {len} tokens needs a template of {tmpl_len} tokens ({tmpl_full} full pages per kv head), sequence {s0} holds {}", s.len)));
        }
        if self.seqs.iter().enumerate().any(|(i, s)| i != s0 && s.is_some()) || self.pool.used_pages(target) != tmpl_full * hkv {
            return Err(RtError::BadInput("tiling needs a fresh cache holding only the template sequence".into()));
        }
        // Pages of the template are region indices [0, tmpl_full * hkv) of the target tier.
        let tmpl_pages = tmpl_full * hkv;
        let want = full * hkv * batch;
        let mut need = vec![0usize; tiers];
        need[target as usize] = want.saturating_sub(tmpl_pages);
        need[TAIL_TIER as usize] = if !len.is_multiple_of(p) { hkv * (batch - 1) } else { 0 };
        self.pool.reserve(&need)?;
        let mut pages = Vec::with_capacity(want);
        for h in 0..hkv {
            pages.extend(self.seqs[s0].as_ref().unwrap().heads[h].full.iter().copied());
        }
        while pages.len() < want {
            pages.push(self.pool.alloc(target)?);
        }
        if tmpl_pages > 0 {
            let pb = self.pool.page_bytes(target) as u64;
            let base = pages.iter().map(|p| p.offset).min().unwrap();
            debug_assert!(pages.iter().all(|p| (p.offset - base) / pb < want as u64));
            let (arena, _g) = self.arena.device_ptr(&self.stream);
            let mut copied = tmpl_pages;
            while copied < want {
                let n = copied.min(want - copied);
                // SAFETY: source [0, n) and destination [copied, copied + n) pages lie inside
                // the target region of the arena and do not overlap (n <= copied).
                unsafe { cudarc::driver::result::memcpy_dtod_async(arena + base + copied as u64 * pb, arena + base, n * pb as usize, self.stream.cu_stream()) }.map_err(drv("bench page replication"))?;
                copied += n;
            }
        }
        // Page i of the replicated region holds template page (i mod tmpl_pages): template
        // pages are ordered head-major, so give every (sequence, head) pages of its own head.
        let mut by_head: Vec<Vec<PageRef>> = vec![Vec::new(); hkv];
        let mut region: Vec<PageRef> = pages.clone();
        region.sort_by_key(|p| p.offset);
        for (i, pg) in region.iter().enumerate() {
            by_head[(i % tmpl_pages.max(1)) / tmpl_full.max(1)].push(*pg);
        }
        self.refresh_tails(s0)?;
        let tail = self.seqs[s0].as_ref().unwrap().heads.iter().map(|h| h.tail.clone()).collect::<Vec<_>>();
        let mut ids = vec![s0];
        let s0_full: Vec<Vec<PageRef>> = (0..hkv).map(|h| by_head[h][..full].to_vec()).collect();
        {
            let epoch = self.next_epoch();
            let s = self.seqs[s0].as_mut().unwrap();
            for h in 0..hkv {
                s.heads[h].full = s0_full[h].clone();
                s.heads[h].first = (0..full).map(|i| i * p).collect();
            }
            s.len = len;
            s.epoch = epoch;
            s.table_epoch = epoch;
        }
        for b in 1..batch {
            let sid = self.add_sequence();
            let mut heads = Vec::with_capacity(hkv);
            for h in 0..hkv {
                let full_pages = by_head[h][b * full..(b + 1) * full].to_vec();
                let t = match &tail[h] {
                    Some(t) => {
                        let page = self.pool.alloc(TAIL_TIER)?;
                        self.upload(page, &t.bytes)?;
                        Some(Tail { page, bytes: t.bytes.clone(), len: t.len, stale: false })
                    }
                    None => None,
                };
                heads.push(HeadPages { full: full_pages, first: (0..full).map(|i| i * p).collect(), tail: t });
            }
            let epoch = self.next_epoch();
            self.seqs[sid] = Some(Sequence { heads, len, epoch, table_epoch: epoch });
            ids.push(sid);
        }
        Ok(ids)
    }

    /// The tail page of (seq, head): its bytes (host mirror) and token count. Call
    /// [`refresh_tails`](Self::refresh_tails) first: a stale mirror is an error here.
    pub(crate) fn tail_bytes(&self, seq: usize, head: usize) -> Result<Option<(&[u8], usize)>> {
        let s = self.seq(seq)?;
        let h = s.heads.get(head).ok_or(RtError::NoKvHead { head, heads: s.heads.len() })?;
        match &h.tail {
            Some(t) if t.stale => Err(RtError::BadInput(format!("sequence {seq} head {head}: the tail page's host mirror is stale (refresh_tails first)"))),
            t => Ok(t.as_ref().map(|t| (t.bytes.as_slice(), t.len))),
        }
    }

    /// Like [`tail_bytes`](Self::tail_bytes) from `&self`: a stale mirror's page is downloaded
    /// into the returned copy (the mirror stays stale).
    pub(crate) fn tail_bytes_current(&self, seq: usize, head: usize) -> Result<Option<(std::borrow::Cow<'_, [u8]>, usize)>> {
        let s = self.seq(seq)?;
        let h = s.heads.get(head).ok_or(RtError::NoKvHead { head, heads: s.heads.len() })?;
        let Some(t) = &h.tail else { return Ok(None) };
        if !t.stale {
            return Ok(Some((std::borrow::Cow::Borrowed(t.bytes.as_slice()), t.len)));
        }
        let off = t.page.offset as usize;
        let bytes = self.stream.clone_dtoh(&self.arena.slice(off..off + t.bytes.len())).map_err(drv("tail page download"))?;
        Ok(Some((std::borrow::Cow::Owned(bytes), t.len)))
    }

    /// Downloads the tail pages of `seq` whose host mirror is stale (device-side appends wrote
    /// them): once per page between a device append and the next host path that reads it.
    pub(crate) fn refresh_tails(&mut self, seq: usize) -> Result<()> {
        let stream = self.stream.clone();
        let s = self.seqs.get_mut(seq).and_then(|s| s.as_mut()).ok_or(RtError::NoSequence(seq))?;
        for t in s.heads.iter_mut().filter_map(|h| h.tail.as_mut()).filter(|t| t.stale) {
            let off = t.page.offset as usize;
            let n = t.bytes.len();
            t.bytes = stream.clone_dtoh(&self.arena.slice(off..off + n)).map_err(drv("tail page download"))?;
            t.stale = false;
        }
        Ok(())
    }

    /// `(page, tokens)` of the tail page of (seq, head), if it has one.
    pub(crate) fn tail_page(&self, seq: usize, head: usize) -> Result<Option<(PageRef, usize)>> {
        Ok(self.head(seq, head)?.tail.as_ref().map(|t| (t.page, t.len)))
    }

    /// Gives (seq, head) an empty tail page whose bytes a device append writes (its mirror,
    /// `page_bytes` long, starts stale). The caller reserved the page.
    pub(crate) fn new_device_tail(&mut self, seq: usize, head: usize, page_bytes: usize) -> Result<PageRef> {
        self.head(seq, head)?;
        let page = self.pool.alloc(TAIL_TIER)?;
        self.seq_mut(seq)?.heads[head].tail = Some(Tail { page, bytes: vec![0u8; page_bytes], len: 0, stale: true });
        Ok(page)
    }

    /// Counts `n` tokens written on the device into the tail page of (seq, head): its mirror
    /// becomes stale. Returns the tail's new length.
    pub(crate) fn tail_grew_on_device(&mut self, seq: usize, head: usize, n: usize) -> Result<usize> {
        let kv_heads = self.kv_heads;
        let t = self.seq_mut(seq)?.heads.get_mut(head).and_then(|h| h.tail.as_mut()).ok_or(RtError::NoKvHead { head, heads: kv_heads })?;
        t.len += n;
        t.stale = true;
        Ok(t.len)
    }

    /// Takes the tail page of (seq, head) out of its table (a filled tail about to be encoded;
    /// the page is the caller's to free).
    pub(crate) fn take_tail(&mut self, seq: usize, head: usize) -> Result<Option<PageRef>> {
        let kv_heads = self.kv_heads;
        let h = self.seq_mut(seq)?.heads.get_mut(head).ok_or(RtError::NoKvHead { head, heads: kv_heads })?;
        Ok(h.tail.take().map(|t| t.page))
    }

    /// Overwrites bytes of a page (low level: tools and corruption tests).
    pub(crate) fn write_page_bytes(&mut self, page: PageRef, at: usize, bytes: &[u8]) -> Result<()> {
        if at + bytes.len() > self.pool.page_bytes(page.tier) {
            return Err(RtError::CapacityExceeded { what: "page write".into(), requested: format!("{} bytes at {at}", bytes.len()), capacity: format!("a {} B page", self.pool.page_bytes(page.tier)) });
        }
        let off = page.offset as usize + at;
        let mut view = self.arena.slice_mut(off..off + bytes.len());
        self.stream.memcpy_htod(bytes, &mut view).map_err(drv("page write"))
    }

    /// Downloads one page's bytes (header + segment + padding).
    pub(crate) fn download_page(&self, page: PageRef) -> Result<Vec<u8>> {
        let off = page.offset as usize;
        let n = self.pool.page_bytes(page.tier);
        self.stream.clone_dtoh(&self.arena.slice(off..off + n)).map_err(drv("page download"))
    }

    /// Checks every mapped page's header against the bookkeeping; names the first bad page.
    pub(crate) fn verify_pages(&self, seqs: &[usize]) -> Result<()> {
        for &s in seqs {
            for h in 0..self.kv_heads {
                for (i, (page, len)) in self.map_pages(s, h, |r, n| (r, n))?.into_iter().enumerate() {
                    let off = page.offset as usize;
                    let raw = self.stream.clone_dtoh(&self.arena.slice(off..off + HEADER_BYTES)).map_err(drv("header download"))?;
                    let hd = PageHeader::from_bytes(&raw).map_err(|reason| RtError::CorruptPage { page: i, offset: page.offset, reason: format!("sequence {s} head {h}: {reason}") })?;
                    if hd.tier != page.tier || hd.length as usize != len {
                        return Err(RtError::CorruptPage {
                            page: i,
                            offset: page.offset,
                            reason: format!("sequence {s} head {h}: header says tier {} length {}, expected tier {} length {len}", hd.tier, hd.length, page.tier),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Resident bytes per tier over all sequences, at head dim `d`.
    pub(crate) fn memory_report(&self, spec: &Spec, d: usize) -> Vec<TierUsage> {
        let p = self.page_tokens;
        spec.tiers
            .iter()
            .map(|t| {
                let mut pages = 0;
                let mut tokens = 0;
                for s in self.seqs.iter().flatten() {
                    for h in &s.heads {
                        let n = h.full.iter().filter(|r| r.tier == t.id).count();
                        pages += n;
                        tokens += n * p;
                        if let Some(tl) = h.tail.as_ref().filter(|tl| tl.page.tier == t.id) {
                            pages += 1;
                            tokens += tl.len;
                        }
                    }
                }
                let seg: SegmentLayout = spec.segment(t.id, d);
                let resident = pages * seg.page_bytes;
                TierUsage {
                    tier: t.name.clone(),
                    pages,
                    tokens,
                    resident_bytes: resident,
                    payload_bytes_per_token: t.bytes_per_token(d, p),
                    resident_bytes_per_token: if tokens > 0 { resident as f64 / tokens as f64 } else { 0.0 },
                }
            })
            .collect()
    }
}
