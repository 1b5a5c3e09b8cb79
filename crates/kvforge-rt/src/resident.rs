//! Device-resident decode plans (issue 29): a serving loop's decode step costs the host
//! O(batch), not O(pages), and never waits for the GPU.
//!
//! [`KvCache::decode_external`] plans every page of every sequence on the host, uploads the
//! page table and allocates its buffers per call, then synchronises to read the error flags:
//! at batch 121 × 32K that is ~500K page entries per layer and step. A serving step, though,
//! changes almost nothing: every sequence gains one token, which lands in its tail page; once
//! per page of tokens a tail fills (its entry becomes the encoded full page) and the next
//! token opens a new tail. [`ResidentTable`] keeps the page table of one sequence list as a
//! host mirror of device buffers and brings both up to date from the cache's page tables in
//! one pass over the (sequence, kv head) pairs:
//!
//! - A tail page's entry carries no length: its tokens field is `PAGE_LIVE_LENGTH`, and the
//!   kernel reads the length from the page header, which the append kernel keeps current.
//!   A token more therefore changes nothing in the table.
//! - Every (sequence, kv head) range is laid out as `[full pages][pads][tail slot]`. A page
//!   that fills takes the first pad and the tail slot takes the new tail page (or a pad while
//!   the sequence has none), so the ranges never move and only the changed entries are
//!   uploaded. A pad points at a page of the tail tier with a zero-length header, the
//!   cache's *null page*, and reads as zero tokens: the kernel checks its header and skips
//!   it. Pads are a few per range (`pad_slots`), so they cost a header read each.
//! - When a range runs out of pads, the sequence list changes, or a sequence's layout epoch
//!   does (a re-code, a drop, a removed and re-added id), the table is rebuilt whole, fresh
//!   pads included: every few hundred steps in a steady batch. A window policy's encode of a
//!   dense page leaving the window ([`crate::WindowPolicy`]) keeps the range: the sync
//!   re-reads the last `recent_pages` full-page entries of each range
//!   ([`PageSource::window_recodes`]), and the store's table epoch it compares stays.
//! - The split count needs no page assignment: the kernel divides each range among the
//!   splits itself, so only the count (from the live page counts, as [`crate::plan`] does)
//!   and the variant (from the tiers present) are recomputed, in O(tiers).
//!
//! What the table must match is [`crate::plan`] over the same pages: the same variant and
//! split count, and per (sequence, kv head) the same pages with the same token counts once
//! pads are dropped and live lengths read from the pages (tests below; with one split the
//! kernel computes exactly what the re-planned launch does, pad iterations aside).

use std::collections::HashMap;
use std::ops::Range;

use cudarc::driver::CudaSlice;
use kvforge_gen::schedule::Entry;
use kvforge_spec::{PageHeader, Spec, TierId, VariantId, TAIL_TIER};

use crate::cache::KvCache;
use crate::decode::{choose_combination, split_count, DecodeIo, DecodePlan, DecodeWorkspace};
use crate::error::{drv, Result, RtError};
use crate::external::ExternalTensor;
use crate::params::PAGE_LIVE_LENGTH;
use crate::pool::PageRef;

/// What a [`ResidentTable`] reads of a cache's page tables.
pub trait PageSource {
    /// [`KvCache::layout_epoch`](crate::KvCache::layout_epoch): changes whenever pages change
    /// other than by appends.
    fn layout_epoch(&self, seq: usize) -> Result<u64>;
    /// Full pages of (seq, head).
    fn full_pages(&self, seq: usize, head: usize) -> Result<usize>;
    /// Full page `index` of (seq, head).
    fn full_page(&self, seq: usize, head: usize, index: usize) -> Result<PageRef>;
    /// The tail page of (seq, head) and its tokens, if it has one.
    fn tail_page(&self, seq: usize, head: usize) -> Result<Option<(PageRef, usize)>>;
    /// How many full pages before the ones a (sequence, kv head) held at the last sync an
    /// append may have re-coded while `layout_epoch` stayed: a window policy encodes dense
    /// pages once newer ones push them out of the recent window ([`crate::window`]), which
    /// [`ResidentTable::sync`] finds by re-reading that many entries instead of rebuilding.
    fn window_recodes(&self) -> usize {
        0
    }
}

impl PageSource for crate::store::PageStore {
    /// The table epoch: a window policy's re-codes keep it ([`PageSource::window_recodes`]).
    fn layout_epoch(&self, seq: usize) -> Result<u64> {
        crate::store::PageStore::table_epoch(self, seq)
    }
    fn full_pages(&self, seq: usize, head: usize) -> Result<usize> {
        Ok(self.page_counts(seq, head)?.0)
    }
    fn full_page(&self, seq: usize, head: usize, index: usize) -> Result<PageRef> {
        crate::store::PageStore::full_page(self, seq, head, index)
    }
    fn tail_page(&self, seq: usize, head: usize) -> Result<Option<(PageRef, usize)>> {
        crate::store::PageStore::tail_page(self, seq, head)
    }
    fn window_recodes(&self) -> usize {
        crate::store::PageStore::window_recodes(self)
    }
}

/// Pads a range of `full` full pages gets at a rebuild: enough that a steady batch rebuilds
/// once in several pages of tokens per sequence, few enough that the kernel's pad iterations
/// (a header read each) stay a small share of the range.
pub fn pad_slots(full: usize) -> usize {
    (full / 64).clamp(2, 8)
}

/// What [`ResidentTable::sync`] changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sync {
    /// Every entry (and the range pointers) were rewritten: upload the whole table.
    Rebuilt,
    /// Only these entries of `page_offsets` / `page_info` changed (ascending, disjoint); the
    /// range pointers did not.
    Dirty(Vec<Range<usize>>),
}

/// The entries a (sequence, kv head) range lists now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Listed {
    full: usize,
    /// Offset of the tail page in the tail slot, if any.
    tail: Option<u64>,
}

/// The page table of one decode batch, kept up to date incrementally (module docs). Its
/// [`plan`](Self::plan) is what a launch reads: `page_offsets`, `page_info` and `page_indptr`
/// are the host mirror of the device buffers.
#[derive(Clone, Debug)]
pub struct ResidentTable {
    seqs: Vec<usize>,
    hkv: usize,
    page_tokens: usize,
    /// Offset of the null page pads point at.
    null_page: u64,
    plan: DecodePlan,
    /// [entry × hkv + head]
    listed: Vec<Listed>,
    /// [entry]
    epochs: Vec<u64>,
    /// Pages (not pads) per tier.
    tier_pages: Vec<usize>,
    /// Most pages (not pads) of any (sequence, kv head), as of the last sync.
    max_pages: usize,
    /// Rebuilds and incremental syncs so far (diagnostics).
    pub rebuilds: u64,
    pub syncs: u64,
}

fn pad_info() -> u32 {
    TAIL_TIER as u32
}

fn live_info() -> u32 {
    TAIL_TIER as u32 | PAGE_LIVE_LENGTH << 8
}

impl ResidentTable {
    /// An empty table for a cache of `hkv` kv heads, `tiers` tiers and `page_tokens` tokens per
    /// page, whose pads point at the null page at `null_page` (a tail-tier page whose header
    /// says zero tokens). `head_dim` and `gqa` are the cache's; the plan's variant is set by
    /// the first [`shape`](Self::shape).
    pub fn new(spec: &Spec, head_dim: usize, gqa: usize, hkv: usize, null_page: u64) -> ResidentTable {
        let plan = DecodePlan {
            variant: kvforge_gen::decode_variant(spec, &[TAIL_TIER], head_dim, gqa),
            combine: None,
            batch: 0,
            num_kv_heads: hkv,
            gqa,
            head_dim,
            splits: 1,
            page_offsets: Vec::new(),
            page_indptr: vec![0],
            page_info: Vec::new(),
            tiers: Vec::new(),
            bytes_read: 0,
            page_bytes_read: 0,
        };
        ResidentTable {
            seqs: Vec::new(),
            hkv,
            page_tokens: spec.page.tokens,
            null_page,
            plan,
            listed: Vec::new(),
            epochs: Vec::new(),
            tier_pages: vec![0; spec.tiers.len()],
            max_pages: 0,
            rebuilds: 0,
            syncs: 0,
        }
    }

    /// The plan a launch reads (valid after [`sync`](Self::sync) and [`shape`](Self::shape)).
    pub fn plan(&self) -> &DecodePlan {
        &self.plan
    }

    /// Forgets the sequence list, so that the next [`sync`](Self::sync) rebuilds.
    pub fn invalidate(&mut self) {
        self.seqs.clear();
    }

    /// The sequence list the table was last synced to.
    pub fn seqs(&self) -> &[usize] {
        &self.seqs
    }

    fn full_info(&self, p: PageRef) -> u32 {
        p.tier as u32 | (self.page_tokens as u32) << 8
    }

    /// Brings the table up to date with `src` for a decode of `seqs` (a sequence may appear
    /// more than once). O(len(seqs) × kv heads) plus the pages that changed; a rebuild when
    /// the sequence list or a layout epoch changed, or a range ran out of pads. On an error
    /// (a missing sequence, a (sequence, kv head) without tokens) the table forgets its
    /// sequences, so the next call rebuilds.
    pub fn sync(&mut self, src: &dyn PageSource, seqs: &[usize]) -> Result<Sync> {
        let r = self.try_sync(src, seqs);
        if r.is_err() {
            self.seqs.clear();
        }
        r
    }

    fn try_sync(&mut self, src: &dyn PageSource, seqs: &[usize]) -> Result<Sync> {
        if seqs.is_empty() {
            return Err(RtError::BadInput("decode of an empty batch".into()));
        }
        if self.seqs != seqs {
            return self.rebuild(src, seqs);
        }
        for (e, &s) in seqs.iter().enumerate() {
            if src.layout_epoch(s)? != self.epochs[e] {
                return self.rebuild(src, seqs);
            }
        }
        let hkv = self.hkv;
        let recodes = src.window_recodes();
        let mut dirty: Vec<Range<usize>> = Vec::new();
        let mut max_pages = 0;
        for (e, &s) in seqs.iter().enumerate() {
            for h in 0..hkv {
                let k = e * hkv + h;
                let was = self.listed[k];
                let full = src.full_pages(s, h)?;
                let tail = src.tail_page(s, h)?.map(|t| t.0);
                let (start, end) = (self.plan.page_indptr[k] as usize, self.plan.page_indptr[k + 1] as usize);
                if full < was.full || full > end - start - 1 {
                    return self.rebuild(src, seqs);
                }
                if full == 0 && tail.is_none() {
                    return Err(RtError::EmptySequence(e));
                }
                max_pages = max_pages.max(full + usize::from(tail.is_some()));
                let (mut lo, mut hi) = (usize::MAX, 0);
                // Pages a window policy re-coded since the last sync (dense ones pushed out of
                // the recent window): the entry changes, the range does not.
                for j in was.full.saturating_sub(recodes)..was.full {
                    let p = src.full_page(s, h, j)?;
                    let info = self.full_info(p);
                    if self.plan.page_offsets[start + j] != p.offset || self.plan.page_info[start + j] != info {
                        self.tier_pages[(self.plan.page_info[start + j] & 0xff) as usize] -= 1;
                        self.plan.page_offsets[start + j] = p.offset;
                        self.plan.page_info[start + j] = info;
                        self.tier_pages[p.tier as usize] += 1;
                        lo = lo.min(start + j);
                        hi = start + j + 1;
                    }
                }
                for j in was.full..full {
                    let p = src.full_page(s, h, j)?;
                    self.plan.page_offsets[start + j] = p.offset;
                    self.plan.page_info[start + j] = self.full_info(p);
                    self.tier_pages[p.tier as usize] += 1;
                    lo = lo.min(start + j);
                    hi = start + j + 1;
                }
                let tail_off = tail.map(|p| p.offset);
                if tail_off != was.tail {
                    let slot = end - 1;
                    match tail {
                        Some(p) => {
                            self.plan.page_offsets[slot] = p.offset;
                            self.plan.page_info[slot] = live_info();
                        }
                        None => {
                            self.plan.page_offsets[slot] = self.null_page;
                            self.plan.page_info[slot] = pad_info();
                        }
                    }
                    let t = &mut self.tier_pages[TAIL_TIER as usize];
                    *t = *t + usize::from(tail.is_some()) - usize::from(was.tail.is_some());
                    lo = lo.min(slot);
                    hi = slot + 1;
                }
                if lo < hi {
                    dirty.push(lo..hi);
                }
                self.listed[k] = Listed { full, tail: tail_off };
            }
        }
        self.max_pages = max_pages;
        self.syncs += 1;
        Ok(Sync::Dirty(dirty))
    }

    fn rebuild(&mut self, src: &dyn PageSource, seqs: &[usize]) -> Result<Sync> {
        let hkv = self.hkv;
        self.seqs.clear();
        self.listed.clear();
        self.epochs.clear();
        self.tier_pages.iter_mut().for_each(|t| *t = 0);
        let p = &mut self.plan;
        p.page_offsets.clear();
        p.page_info.clear();
        p.page_indptr.clear();
        p.page_indptr.push(0);
        let mut max_pages = 0;
        for (e, &s) in seqs.iter().enumerate() {
            self.epochs.push(src.layout_epoch(s)?);
            for h in 0..hkv {
                let full = src.full_pages(s, h)?;
                let tail = src.tail_page(s, h)?.map(|t| t.0);
                if full == 0 && tail.is_none() {
                    return Err(RtError::EmptySequence(e));
                }
                max_pages = max_pages.max(full + usize::from(tail.is_some()));
                for j in 0..full {
                    let pg = src.full_page(s, h, j)?;
                    self.plan.page_offsets.push(pg.offset);
                    self.plan.page_info.push(pg.tier as u32 | (self.page_tokens as u32) << 8);
                    self.tier_pages[pg.tier as usize] += 1;
                }
                for _ in 0..pad_slots(full) {
                    self.plan.page_offsets.push(self.null_page);
                    self.plan.page_info.push(pad_info());
                }
                match tail {
                    Some(pg) => {
                        self.plan.page_offsets.push(pg.offset);
                        self.plan.page_info.push(live_info());
                        self.tier_pages[TAIL_TIER as usize] += 1;
                    }
                    None => {
                        self.plan.page_offsets.push(self.null_page);
                        self.plan.page_info.push(pad_info());
                    }
                }
                self.plan.page_indptr.push(self.plan.page_offsets.len() as u32);
                self.listed.push(Listed { full, tail: tail.map(|t| t.offset) });
            }
        }
        self.seqs = seqs.to_vec();
        self.plan.batch = seqs.len();
        self.max_pages = max_pages;
        self.rebuilds += 1;
        Ok(Sync::Rebuilt)
    }

    /// Sets the plan's variant, split count and byte counts from the tiers present and the
    /// page counts, as [`crate::plan`] chooses them; `page_bytes(t)` is a tier's page size and
    /// `slots(variant)` the CTAs of that variant the GPU holds at once. O(tiers).
    pub fn shape(&mut self, spec: &Spec, page_bytes: &dyn Fn(TierId) -> usize, slots: &mut dyn FnMut(&kvforge_spec::VariantId) -> Result<usize>) -> Result<()> {
        let p = &mut self.plan;
        let present: Vec<TierId> = (0..self.tier_pages.len()).filter(|&t| self.tier_pages[t] > 0).map(|t| t as TierId).collect();
        if present != p.tiers {
            let (d, gqa) = (p.head_dim, p.gqa);
            let combo = choose_combination(spec, &present).ok_or_else(|| RtError::NoVariant {
                spec: spec.name.clone(),
                tiers: present.iter().map(|&t| spec.tiers[t as usize].name.clone()).collect(),
                head_dim: d,
                gqa,
            })?;
            p.variant = kvforge_gen::decode_variant(spec, &combo, d, gqa);
            p.tiers = present;
        }
        let (hkv, batch) = (self.hkv, p.batch);
        p.splits = if spec.kernels.split_k { split_count(batch * hkv, self.max_pages, slots(&p.variant)?) } else { 1 };
        p.combine = (p.splits > 1).then(|| kvforge_spec::VariantId::combine(spec, p.head_dim));
        let d = p.head_dim;
        let read = |t: TierId| kvforge_spec::HEADER_BYTES + spec.segment(t, d).bytes;
        p.page_bytes_read = (0..self.tier_pages.len()).map(|t| self.tier_pages[t] * read(t as TierId)).sum();
        p.bytes_read = (0..self.tier_pages.len()).map(|t| self.tier_pages[t] * page_bytes(t as TierId)).sum::<usize>() + batch * hkv * p.gqa * p.head_dim * 2;
        Ok(())
    }

    /// Per entry and kv head, the (page offset, page_info) the kernel computes over: pads
    /// dropped and live lengths read through `tail_len(offset)`, i.e. what [`crate::plan`]
    /// lists for the same pages.
    pub fn logical(&self, tail_len: &dyn Fn(u64) -> usize) -> Vec<Vec<Vec<(u64, u32)>>> {
        let p = &self.plan;
        (0..p.batch)
            .map(|e| {
                (0..self.hkv)
                    .map(|h| {
                        let k = e * self.hkv + h;
                        (p.page_indptr[k] as usize..p.page_indptr[k + 1] as usize)
                            .filter(|&i| !(p.page_offsets[i] == self.null_page && p.page_info[i] == pad_info()))
                            .map(|i| {
                                let info = p.page_info[i];
                                let live = info == live_info();
                                (p.page_offsets[i], if live { TAIL_TIER as u32 | (tail_len(p.page_offsets[i]) as u32) << 8 } else { info })
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect()
    }
}

/// Merges ascending dirty entry ranges whose gaps are at most `gap` entries into the spans one
/// upload each covers: a span re-sends the unchanged entries inside it (the mirror equals the
/// device there), trading bytes for driver calls.
pub fn upload_spans(dirty: &[Range<usize>], gap: usize) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in dirty {
        match out.last_mut() {
            Some(last) if r.start <= last.end + gap => last.end = last.end.max(r.end),
            _ => out.push(r.clone()),
        }
    }
    out
}

/// A cache's resident decode state: the table, its device buffers (grown, never shrunk) and
/// the null page its pads point at.
pub(crate) struct Resident {
    pub(crate) table: ResidentTable,
    pub(crate) ws: DecodeWorkspace,
    /// CTAs per variant the GPU holds at once (an occupancy query per variant, once).
    slots: HashMap<VariantId, usize>,
}

/// Entries a dirty upload may re-send to save a driver call (see [`upload_spans`]): about what
/// one more call costs in copy time.
const UPLOAD_GAP: usize = 4096;

/// Grows `buf` to hold `n` elements (contents are not kept: the caller uploads).
fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(st: &std::sync::Arc<cudarc::driver::CudaStream>, buf: &mut CudaSlice<T>, n: usize, what: &str) -> Result<()> {
    if buf.len() < n {
        *buf = st.alloc_zeros::<T>(n.next_power_of_two()).map_err(drv(what.to_string()))?;
    }
    Ok(())
}

impl KvCache {
    /// One decode step of `seqs` on external tensors, as [`KvCache::decode_external`] computes
    /// it, through the cache's device-resident plan: called again for the same sequences (a
    /// token appended to each in between, by [`KvCache::append_step_external`] or any other
    /// append), the host only checks what changed, O(len(seqs) × kv heads), uploads the few
    /// page-table entries that did, and launches; the workspace is reused and nothing waits
    /// for the GPU. Another sequence list, a re-coded or dropped page, or a range out of pads
    /// rebuilds the table (module docs).
    ///
    /// Errors: bad arguments, a missing or empty sequence and the like are reported by this
    /// call, before anything is launched, as [`KvCache::decode_external`] reports them. A
    /// fault the kernel flags (a page with a bad header, in a tier the variant lacks, longer
    /// than a page) is reported asynchronously, as the same [`RtError::KernelFault`] naming
    /// the variant: by the first later call of this method that finds the flag copy queued
    /// after the faulty launch landed (the next step's, unless the host runs more than a step
    /// ahead of the GPU), or by [`KvCache::synchronize`], which waits for it. Outputs of a
    /// faulty launch skip the bad pages; call `synchronize` before trusting a step whose
    /// output matters more than throughput.
    ///
    /// The resident plan takes one page of the tail tier (the null page); where none is free
    /// this falls back to [`KvCache::decode_external`], which synchronises.
    pub fn decode_step_external(&mut self, seqs: &[usize], q: &ExternalTensor, out: &ExternalTensor, lse: &ExternalTensor) -> Result<()> {
        self.engine.poll_flags()?;
        if self.resident.is_none() {
            match self.make_resident()? {
                Some(r) => self.resident = Some(r),
                None => return self.decode_external(seqs, q, out, lse),
            }
        }
        let mut r = self.resident.take().expect("made above");
        let res = self.resident_step(&mut r, seqs, q, out, lse);
        if res.is_err() {
            // The mirror may hold changes the device does not: rebuild next time.
            r.table.invalidate();
        }
        self.resident = Some(r);
        res
    }

    /// Waits for the cache's stream and reports any fault the kernels flagged since the last
    /// check ([`KvCache::decode_step_external`] reports them asynchronously).
    pub fn synchronize(&mut self) -> Result<()> {
        self.engine.synchronize()
    }

    /// (rebuilds, incremental syncs) of the resident plan so far; None before its first step.
    pub fn resident_stats(&self) -> Option<(u64, u64)> {
        self.resident.as_ref().map(|r| (r.table.rebuilds, r.table.syncs))
    }

    /// The resident plan's table as of the last step (tests, diagnostics).
    pub fn resident_table(&self) -> Option<&ResidentTable> {
        self.resident.as_ref().map(|r| &r.table)
    }

    pub(crate) fn make_resident(&mut self) -> Result<Option<Resident>> {
        if self.store.pool().free_pages(TAIL_TIER) == 0 {
            return Ok(None);
        }
        let null = self.store.pool_mut().alloc(TAIL_TIER)?;
        let header = PageHeader { tier: TAIL_TIER, flags: 0, length: 0 }.to_bytes();
        if let Err(e) = self.store.upload(null, &header) {
            self.store.pool_mut().free(null);
            return Err(e);
        }
        let ws = DecodeWorkspace::zeroed(&self.engine.dev().stream, 1, 1, 1, 1, 1)?;
        let table = ResidentTable::new(&self.spec, self.cfg.head_dim, self.cfg.gqa, self.cfg.num_kv_heads, null.offset);
        Ok(Some(Resident { table, ws, slots: HashMap::new() }))
    }

    fn resident_step(&mut self, r: &mut Resident, seqs: &[usize], q: &ExternalTensor, out: &ExternalTensor, lse: &ExternalTensor) -> Result<()> {
        // Arguments first: nothing changes on a bad tensor.
        self.check_decode_io(seqs.len(), q, out, lse)?;
        self.resident_sync(r, seqs)?;
        let io = DecodeIo { q: q.ptr, out: out.ptr, lse: lse.ptr };
        self.launch_io(r.table.plan(), &r.ws, io)?;
        self.engine.watch_flags(&r.table.plan().variant)
    }

    /// Brings `r` up to date for a decode of `seqs`: the table synced and shaped, the changed
    /// entries uploaded and the buffers grown to the plan. After it a launch of the plan on
    /// `r.ws` needs no host copy and no allocation.
    pub(crate) fn resident_sync(&mut self, r: &mut Resident, seqs: &[usize]) -> Result<()> {
        let sync = r.table.sync(&self.store, seqs)?;
        if self.cfg.verify_headers {
            self.verify_pages(seqs)?;
        }
        let page_bytes: Vec<usize> = (0..self.spec.tiers.len()).map(|t| self.store.pool().page_bytes(t as TierId)).collect();
        let cache = &mut r.slots;
        let this = &*self;
        r.table.shape(&self.spec, &|t| page_bytes[t as usize], &mut |v| {
            if let Some(&n) = cache.get(v) {
                return Ok(n);
            }
            let n = this.slots(v, Entry::Decode)?;
            cache.insert(v.clone(), n);
            Ok(n)
        })?;
        let st = self.engine.dev().stream.clone();
        let plan = r.table.plan();
        let ws = &mut r.ws;
        match sync {
            Sync::Rebuilt => {
                let n = plan.page_offsets.len();
                grow(&st, &mut ws.page_offsets, n, "resident page table")?;
                grow(&st, &mut ws.page_info, n, "resident page table")?;
                grow(&st, &mut ws.page_indptr, plan.page_indptr.len(), "resident page table")?;
                st.memcpy_htod(&plan.page_offsets, &mut ws.page_offsets.slice_mut(0..n)).map_err(drv("resident page table"))?;
                st.memcpy_htod(&plan.page_info, &mut ws.page_info.slice_mut(0..n)).map_err(drv("resident page table"))?;
                st.memcpy_htod(&plan.page_indptr, &mut ws.page_indptr.slice_mut(0..plan.page_indptr.len())).map_err(drv("resident page table"))?;
            }
            Sync::Dirty(ranges) => {
                // Pageable sources are staged before the call returns, so the mirror may
                // change again at once (the launches that read the device copy are queued).
                for span in upload_spans(&ranges, UPLOAD_GAP) {
                    st.memcpy_htod(&plan.page_offsets[span.clone()], &mut ws.page_offsets.slice_mut(span.clone())).map_err(drv("resident page table"))?;
                    st.memcpy_htod(&plan.page_info[span.clone()], &mut ws.page_info.slice_mut(span)).map_err(drv("resident page table"))?;
                }
            }
        }
        let rows = plan.batch * plan.num_kv_heads * plan.gqa;
        if plan.splits > 1 {
            grow(&st, &mut ws.partial_out, plan.splits * rows * plan.head_dim, "split partials")?;
        }
        grow(&st, &mut ws.partial_lse, plan.splits * rows, "split lse")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// A cache's page tables without a device: sequences of per-head full pages and tails,
    /// changed the ways a serving loop and a controller change them.
    #[derive(Clone, Debug, Default)]
    struct Fake {
        seqs: HashMap<usize, (u64, Vec<(Vec<PageRef>, Option<(PageRef, usize)>)>)>,
        next_offset: u64,
        epochs: u64,
        free_tails: Vec<u64>,
        /// The window policy's re-codes ([`Fake::append_windowed`]).
        window: crate::window::WindowPolicy,
    }

    const P: usize = 64;
    const HKV: usize = 3;

    impl PageSource for Fake {
        fn layout_epoch(&self, seq: usize) -> Result<u64> {
            self.seqs.get(&seq).map(|s| s.0).ok_or(RtError::NoSequence(seq))
        }
        fn full_pages(&self, seq: usize, head: usize) -> Result<usize> {
            Ok(self.seqs.get(&seq).ok_or(RtError::NoSequence(seq))?.1[head].0.len())
        }
        fn full_page(&self, seq: usize, head: usize, index: usize) -> Result<PageRef> {
            self.seqs.get(&seq).ok_or(RtError::NoSequence(seq))?.1[head].0.get(index).copied().ok_or(RtError::NoPage { seq, head, index })
        }
        fn tail_page(&self, seq: usize, head: usize) -> Result<Option<(PageRef, usize)>> {
            Ok(self.seqs.get(&seq).ok_or(RtError::NoSequence(seq))?.1[head].1)
        }
        fn window_recodes(&self) -> usize {
            self.window.recent_pages
        }
    }

    impl Fake {
        fn page(&mut self, tier: TierId) -> PageRef {
            // Tail pages are reused LIFO, as the pool does: a new tail often sits where the
            // last one was.
            if tier == TAIL_TIER {
                if let Some(o) = self.free_tails.pop() {
                    return PageRef { tier, index: 0, offset: o };
                }
            }
            self.next_offset += 4096;
            PageRef { tier, index: 0, offset: self.next_offset }
        }
        fn add(&mut self, id: usize, tokens: usize, tier: TierId) {
            self.epochs += 1;
            self.seqs.insert(id, (self.epochs, vec![(Vec::new(), None); HKV]));
            self.append(id, tokens, tier);
        }
        /// `n` tokens on every head: tails grow, fill into `tier`, new tails open.
        fn append(&mut self, id: usize, n: usize, tier: TierId) {
            for _ in 0..n {
                for h in 0..HKV {
                    let tail = self.seqs[&id].1[h].1;
                    let tail = match tail {
                        Some(t) => t,
                        None => (self.page(TAIL_TIER), 0),
                    };
                    let (pg, len) = (tail.0, tail.1 + 1);
                    if len == P {
                        let full = self.page(tier);
                        self.free_tails.push(pg.offset);
                        let head = &mut self.seqs.get_mut(&id).unwrap().1[h];
                        head.0.push(full);
                        head.1 = None;
                    } else {
                        self.seqs.get_mut(&id).unwrap().1[h].1 = Some((pg, len));
                    }
                }
            }
        }
        /// A controller's re-code of one full page (a new epoch).
        fn recode(&mut self, id: usize, head: usize, index: usize, tier: TierId) {
            let pg = self.page(tier);
            self.epochs += 1;
            let s = self.seqs.get_mut(&id).unwrap();
            if let Some(p) = s.1[head].0.get_mut(index) {
                *p = pg;
                s.0 = self.epochs;
            }
        }
        /// `n` tokens under the window policy, as the cache appends them: a filled tail stays a
        /// dense full page, and the dense pages it pushes out of the window are re-coded into
        /// `tier` in place, with no new epoch.
        fn append_windowed(&mut self, id: usize, n: usize, tier: TierId) {
            for _ in 0..n {
                let before = self.seqs[&id].1[0].0.len();
                for h in 0..HKV {
                    let tail = match self.seqs[&id].1[h].1 {
                        Some(t) => t,
                        None => (self.page(TAIL_TIER), 0),
                    };
                    let head = &mut self.seqs.get_mut(&id).unwrap().1[h];
                    if tail.1 + 1 == P {
                        head.0.push(tail.0);
                        head.1 = None;
                    } else {
                        head.1 = Some((tail.0, tail.1 + 1));
                    }
                }
                let after = self.seqs[&id].1[0].0.len();
                for i in self.window.to_encode(before, after) {
                    for h in 0..HKV {
                        let pg = self.page(tier);
                        let old = std::mem::replace(&mut self.seqs.get_mut(&id).unwrap().1[h].0[i], pg);
                        assert_eq!(old.tier, TAIL_TIER, "a page is re-coded once");
                    }
                }
            }
        }
        fn tail_len(&self, offset: u64) -> usize {
            self.seqs.values().flat_map(|s| s.1.iter()).filter_map(|h| h.1).find(|t| t.0.offset == offset).map(|t| t.1).expect("a live tail")
        }
    }

    fn spec() -> Spec {
        Spec::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/rdkv.toml")).unwrap()
    }

    /// The full re-plan of the same pages.
    fn replan(spec: &Spec, src: &Fake, seqs: &[usize]) -> DecodePlan {
        let pages: Vec<Vec<Vec<(PageRef, usize)>>> = seqs
            .iter()
            .map(|&s| {
                (0..HKV)
                    .map(|h| {
                        let head = &src.seqs[&s].1[h];
                        head.0.iter().map(|&p| (p, P)).chain(head.1).collect()
                    })
                    .collect()
            })
            .collect();
        crate::plan(spec, 128, 4, &pages, &|t| 1000 + t as usize, &|_| 264).unwrap()
    }

    /// The device copy: what the uploads of every sync put there.
    fn apply(dev: &mut (Vec<u64>, Vec<u32>, Vec<u32>), t: &ResidentTable, sync: &Sync) {
        let p = t.plan();
        match sync {
            Sync::Rebuilt => *dev = (p.page_offsets.clone(), p.page_info.clone(), p.page_indptr.clone()),
            Sync::Dirty(ranges) => {
                assert_eq!(dev.0.len(), p.page_offsets.len(), "an incremental sync never changes the table's size");
                for r in upload_spans(ranges, 7) {
                    dev.0[r.clone()].copy_from_slice(&p.page_offsets[r.clone()]);
                    dev.1[r.clone()].copy_from_slice(&p.page_info[r]);
                }
            }
        }
    }

    fn check(spec: &Spec, t: &mut ResidentTable, src: &Fake, seqs: &[usize], dev: &mut (Vec<u64>, Vec<u32>, Vec<u32>)) -> Sync {
        let sync = t.sync(src, seqs).unwrap();
        t.shape(spec, &|t| 1000 + t as usize, &mut |_| Ok(264)).unwrap();
        apply(dev, t, &sync);
        let p = t.plan();
        assert_eq!((&dev.0, &dev.1, &dev.2), (&p.page_offsets, &p.page_info, &p.page_indptr), "device copy drifted from the mirror");
        let want = replan(spec, src, seqs);
        let logical = t.logical(&|o| src.tail_len(o));
        for (e, heads) in logical.iter().enumerate() {
            for (h, got) in heads.iter().enumerate() {
                let k = e * HKV + h;
                let r = want.page_indptr[k] as usize..want.page_indptr[k + 1] as usize;
                let exp: Vec<(u64, u32)> = want.page_offsets[r.clone()].iter().copied().zip(want.page_info[r].iter().copied()).collect();
                assert_eq!(got, &exp, "entry {e} head {h}");
            }
        }
        assert_eq!((&p.variant, &p.combine, p.splits, &p.tiers, p.batch), (&want.variant, &want.combine, want.splits, &want.tiers, want.batch));
        assert_eq!((p.bytes_read, p.page_bytes_read), (want.bytes_read, want.page_bytes_read));
        sync
    }

    /// xorshift: deterministic without a crate.
    fn rng(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn steady_steps_touch_only_the_pages_that_changed() {
        let s = spec();
        let b4 = s.tier("b4").unwrap().id;
        let mut src = Fake::default();
        for (i, len) in [70usize, 127, 128, 300].into_iter().enumerate() {
            src.add(i, len, b4);
        }
        let seqs = [0, 1, 2, 3];
        let null = 1 << 40;
        let mut t = ResidentTable::new(&s, 128, 4, HKV, null);
        let mut dev = Default::default();
        assert_eq!(check(&s, &mut t, &src, &seqs, &mut dev), Sync::Rebuilt);
        // A token that stays in the tail changes nothing (sequence 0: 6 → 7 tail tokens).
        src.append(0, 1, b4);
        for &q in &seqs[1..] {
            src.append(q, 0, b4);
        }
        assert_eq!(check(&s, &mut t, &src, &seqs, &mut dev), Sync::Dirty(vec![]));
        // Sequence 1 fills its tail (127 → 128): one entry per head, the tail slot becomes a
        // pad and the first pad the full page.
        src.append(1, 1, b4);
        let Sync::Dirty(d) = check(&s, &mut t, &src, &seqs, &mut dev) else { panic!("rebuilt") };
        assert_eq!(d.len(), HKV);
        // Its next token opens a new tail: only the tail slots.
        src.append(1, 1, b4);
        let Sync::Dirty(d) = check(&s, &mut t, &src, &seqs, &mut dev) else { panic!("rebuilt") };
        assert_eq!(d.iter().map(|r| r.len()).collect::<Vec<_>>(), vec![1; HKV]);
        assert_eq!(t.rebuilds, 1);
    }

    #[test]
    fn window_recodes_update_their_entries_without_a_rebuild() {
        let s = spec();
        let b4 = s.tier("b4").unwrap().id;
        let mut src = Fake { window: crate::window::WindowPolicy::new(1, 2), ..Default::default() };
        src.add(0, 0, b4);
        src.add(1, 0, b4);
        src.append_windowed(0, 3 * P + 5, b4);
        src.append_windowed(1, 7 * P - 1, b4);
        let seqs = [0, 1];
        let mut t = ResidentTable::new(&s, 128, 4, HKV, 1 << 40);
        let mut dev = Default::default();
        assert_eq!(check(&s, &mut t, &src, &seqs, &mut dev), Sync::Rebuilt);
        // Token by token over two pages (as many as a range has pads): every fill re-codes the
        // page two before it (from the fourth on), which the table finds among its last
        // entries without a rebuild.
        let mut state = 7u64;
        for _ in 0..2 * P {
            src.append_windowed(0, 1, b4);
            src.append_windowed(1, (rng(&mut state) % 2) as usize, b4);
            check(&s, &mut t, &src, &seqs, &mut dev);
        }
        assert_eq!(t.rebuilds, 1, "window re-codes must not rebuild the table");
        let tiers = |src: &Fake| -> Vec<TierId> { src.seqs[&0].1[0].0.iter().map(|p| p.tier).collect() };
        assert_eq!(tiers(&src), vec![TAIL_TIER, b4, b4, TAIL_TIER, TAIL_TIER]);
        // A bulk append that pushes several dense pages out at once (and outgrows the pads).
        src.append_windowed(0, 3 * P, b4);
        check(&s, &mut t, &src, &seqs, &mut dev);
        assert_eq!(tiers(&src), vec![TAIL_TIER, b4, b4, b4, b4, b4, TAIL_TIER, TAIL_TIER]);
    }

    #[test]
    fn random_appends_recodes_and_batch_changes_match_a_full_replan() {
        let s = spec();
        let (b8, b4, b2) = (s.tier("b8").unwrap().id, s.tier("b4").unwrap().id, s.tier("b2").unwrap().id);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut src = Fake::default();
        let mut next_id = 0;
        let mut seqs: Vec<usize> = Vec::new();
        for _ in 0..5 {
            let len = 1 + (rng(&mut state) % 700) as usize;
            src.add(next_id, len, b4);
            seqs.push(next_id);
            next_id += 1;
        }
        let mut t = ResidentTable::new(&s, 128, 4, HKV, 1 << 40);
        let mut dev = Default::default();
        let (mut rebuilt, mut dirty) = (0, 0);
        for step in 0..3000 {
            match rng(&mut state) % 100 {
                // One token for every sequence: the steady state.
                0..=84 => seqs.iter().for_each(|&q| src.append(q, 1, b4)),
                // A prefill-sized append to one sequence (several pages at once).
                85..=89 => {
                    let q = seqs[(rng(&mut state) % seqs.len() as u64) as usize];
                    src.append(q, (rng(&mut state) % 200) as usize, b4);
                }
                // A controller re-codes a page.
                90..=92 => {
                    let q = seqs[(rng(&mut state) % seqs.len() as u64) as usize];
                    let h = (rng(&mut state) % HKV as u64) as usize;
                    src.recode(q, h, 0, if step % 2 == 0 { b8 } else { b2 });
                }
                // A request joins.
                93..=95 => {
                    src.add(next_id, 1 + (rng(&mut state) % 400) as usize, b4);
                    seqs.push(next_id);
                    next_id += 1;
                }
                // A request leaves (and its id may come back as a new sequence).
                96..=98 if seqs.len() > 1 => {
                    let i = (rng(&mut state) % seqs.len() as u64) as usize;
                    let q = seqs.remove(i);
                    if rng(&mut state).is_multiple_of(2) {
                        src.add(q, 1 + (rng(&mut state) % 90) as usize, b4);
                        seqs.push(q);
                    } else {
                        src.seqs.remove(&q);
                    }
                }
                // The same sequence twice in a batch.
                _ => {
                    let mut twice = seqs.clone();
                    twice.push(seqs[0]);
                    check(&s, &mut t, &src, &twice, &mut dev);
                }
            }
            match check(&s, &mut t, &src, &seqs, &mut dev) {
                Sync::Rebuilt => rebuilt += 1,
                Sync::Dirty(_) => dirty += 1,
            }
        }
        assert!(dirty > 2 * rebuilt, "{rebuilt} rebuilds, {dirty} incremental syncs");
    }

    #[test]
    fn a_missing_or_empty_sequence_is_an_error_and_the_next_sync_rebuilds() {
        let s = spec();
        let b4 = s.tier("b4").unwrap().id;
        let mut src = Fake::default();
        src.add(0, 100, b4);
        src.add(1, 0, b4);
        let mut t = ResidentTable::new(&s, 128, 4, HKV, 1 << 40);
        assert!(matches!(t.sync(&src, &[0, 1]), Err(RtError::EmptySequence(1))));
        assert!(matches!(t.sync(&src, &[0, 7]), Err(RtError::NoSequence(7))));
        assert!(matches!(t.sync(&src, &[]), Err(RtError::BadInput(_))));
        assert_eq!(t.sync(&src, &[0]).unwrap(), Sync::Rebuilt);
        assert_eq!(t.sync(&src, &[0]).unwrap(), Sync::Dirty(vec![]));
    }

    #[test]
    fn spans_merge_close_ranges() {
        assert_eq!(upload_spans(&[0..1, 3..4, 20..22, 23..24], 2), vec![0..4, 20..24]);
        assert_eq!(upload_spans(&[], 2), Vec::<Range<usize>>::new());
        assert_eq!(upload_spans(&[5..6, 8..9], 0), vec![5..6, 8..9]);
    }
}
