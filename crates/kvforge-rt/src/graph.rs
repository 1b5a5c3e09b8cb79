//! Decode steps a CUDA graph can capture (issue 29): the append and decode launches of one
//! step on a caller's stream, with no host copy, no allocation and no synchronisation, so
//! that a caller (torch's `CUDAGraph`) captures them once and replays them every step.
//!
//! A replayed graph launches the same kernels with the same arguments, so nothing a step
//! changes may live in a kernel argument or a buffer the host rewrites inside the graph:
//!
//! - The append kernel reads its chunk list from a device buffer that
//!   [`KvCache::graph_prepare`] writes before the capture (and again before a replay, where a
//!   page filled or opened in between), and each chunk asks for the row after the ones the
//!   tail page holds ([`GRAPH_POS`]: the kernel reads the page header's length), so the same
//!   list appends token after token into one tail page.
//! - The decode reads the device-resident page table ([`crate::resident`]): a tail page's entry
//!   carries no length, so a token more changes no entry. A page that fills, or a new tail,
//!   changes entries, which `graph_prepare` uploads into the same buffers.
//! - What the graph cannot absorb (a table rebuilt into larger buffers, another split count or
//!   variant, another chunk list size) changes the [`GraphKey`] that `graph_prepare` returns:
//!   the caller captures again when it changes.
//!
//! A step that fills a tail page is not a graph step: the plain path encodes the page into
//! the target tier before the step's decode reads it, which a replayed graph cannot do, so
//! `graph_prepare` answers None and the caller runs that step plainly ([`KvCache::step_external`]),
//! once per page of tokens per sequence. With a window policy ([`crate::WindowPolicy`]) that
//! plain step keeps the filled page dense and encodes the one it pushes out of the window; the
//! resident table re-reads that entry at the next `graph_prepare` without changing its buffers
//! (so the key stays), and graph steps between fills append into the tail as before. The host bookkeeping of a replayed step (tail and
//! sequence lengths) is [`KvCache::graph_commit`], after the replay was queued. Faults the decode kernel flags are reported by the next
//! [`KvCache::synchronize`] (a captured step queues no flag copy).

use std::hash::{Hash, Hasher};

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaSlice, DevicePtr};
use kvforge_spec::{PageHeader, VariantId, TAIL_TIER};

use crate::append_step::{check_distinct, chunk_word};
use crate::cache::KvCache;
use crate::decode::DecodeIo;
use crate::error::{drv, Result, RtError};
use crate::external::{ElemType, ExternalTensor};

/// The chunk position that tells the append kernel to read the row from the page header
/// (`POS_FROM_HEADER` of templates/include/kvforge/append.cuh).
pub const GRAPH_POS: usize = 0xffff;

/// What a captured step's launches depend on beyond the contents of device buffers: equal
/// keys from two [`KvCache::graph_prepare`] calls mean a graph captured after the first
/// replays the second step correctly.
pub type GraphKey = u64;

/// The captured step's chunk list and the sequences it was prepared for.
pub(crate) struct GraphStep {
    /// Unique per cache in the process: a key never matches one from a dropped cache, whose
    /// kernel modules a graph captured from it would still name.
    id: u64,
    rows: Option<CudaSlice<u64>>,
    /// Host copy of what `rows` holds.
    mirror: Vec<u64>,
    /// The sequence list of the last `graph_prepare` (None: not prepared).
    ready: Option<Vec<usize>>,
}

impl Default for GraphStep {
    fn default() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        GraphStep { id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed), rows: None, mirror: Vec::new(), ready: None }
    }
}

/// The chunk list of a graph step: per sequence `i` and kv head `h` its tail page's offset and
/// a one-token chunk at [`GRAPH_POS`] from row `i · hkv + h` of the step's `[n][hkv][d]` k/v.
pub(crate) fn graph_rows(tails: &[u64], hkv: usize) -> Vec<u64> {
    let mut rows = Vec::with_capacity(2 * tails.len());
    for (r, &off) in tails.iter().enumerate() {
        debug_assert!(r / hkv.max(1) * hkv.max(1) + r % hkv.max(1) == r);
        rows.push(off);
        rows.push(chunk_word(GRAPH_POS, 1, r));
    }
    rows
}

/// Checks that a step of one token fits every tail (`tails[i]`: tokens in sequence i's tail
/// page, None without one) at `page` tokens per page; returns (sequences that need a new tail
/// page, sequences whose tail the step fills: not a graph step).
pub(crate) fn graph_room(tails: &[Option<usize>], page: usize) -> Result<(usize, usize)> {
    let (mut fresh, mut fills) = (0, 0);
    for (i, t) in tails.iter().enumerate() {
        match *t {
            None => {
                fresh += 1;
                fills += usize::from(page == 1);
            }
            Some(n) if n < page => fills += usize::from(n + 1 == page),
            Some(n) => return Err(RtError::BadInput(format!("graph step: entry {i}'s tail page holds {n} of {page} tokens (graph_commit encodes a full tail)"))),
        }
    }
    Ok((fresh, fills))
}

fn key_of(parts: &impl Hash) -> GraphKey {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parts.hash(&mut h);
    h.finish()
}

impl KvCache {
    /// Prepares the next decode step of `seqs` (one token each) for a captured or replayed
    /// graph: gives sequences without a tail page a fresh one, syncs the device-resident page
    /// table and uploads what changed, writes the append chunk list, and loads every kernel
    /// the step launches. Returns the [`GraphKey`] of the step's launches: capture again when
    /// it differs from the one the graph was captured with; or None, changing nothing, when the
    /// step fills a sequence's tail page (run it with [`step_external`](Self::step_external):
    /// the plain path encodes the page before the decode reads it). Host work and copies on
    /// the cache's stream only, nothing waits for the GPU.
    ///
    /// Errors (nothing launched): a missing or repeated sequence, a tail left full, out of
    /// pages for the step (a new tail, the encode of a tail it fills), a target tier whose
    /// encode reads pages on the host (an uncalibrated spherical tier, kept originals), a
    /// cache without a free page for the resident table's null page.
    pub fn graph_prepare(&mut self, seqs: &[usize]) -> Result<Option<GraphKey>> {
        self.engine.poll_flags()?;
        let r = self.try_graph_prepare(seqs);
        if !matches!(r, Ok(Some(_))) {
            self.graph.get_or_insert_with(Default::default).ready = None;
        }
        r
    }

    fn try_graph_prepare(&mut self, seqs: &[usize]) -> Result<Option<GraphKey>> {
        let (hkv, d, p) = (self.cfg.num_kv_heads, self.cfg.head_dim, self.spec.page.tokens);
        if seqs.is_empty() {
            return Err(RtError::BadInput("graph step of an empty batch".into()));
        }
        for &s in seqs {
            self.seq_len(s)?;
        }
        check_distinct(seqs)?;
        let target = self.cfg.target_tier;
        if self.encode_needs_host(target) {
            return Err(RtError::BadInput(format!("graph step: encoding into tier {} reads pages on the host (an uncalibrated spherical tier or kept originals)", self.spec.tiers[target as usize].name)));
        }
        if p > GRAPH_POS - 1 {
            return Err(RtError::BadInput(format!("graph step: pages of {p} tokens (at most {})", GRAPH_POS - 1)));
        }
        let tails: Vec<Option<usize>> = seqs.iter().map(|&s| self.uniform_tail(s)).collect::<Result<_>>()?;
        let (fresh, fills) = graph_room(&tails, p)?;
        if fills > 0 {
            return Ok(None);
        }
        let mut need = vec![0usize; self.spec.tiers.len()];
        need[TAIL_TIER as usize] = fresh * hkv;
        self.store.pool().reserve(&need)?;
        // Loaded before the capture (a module load inside one would break it).
        self.engine.kernel(&self.spec, &VariantId::append(&self.spec, d))?;
        if self.resident.is_none() {
            self.resident = Some(self.make_resident()?.ok_or_else(|| self.store.pool().out_of_pages(TAIL_TIER))?);
        }
        // New tails: a zero-length header, which the kernel reads as row 0 (it zeroes the page).
        let seg = self.spec.segment(TAIL_TIER, d);
        let empty = PageHeader { tier: TAIL_TIER, flags: 0, length: 0 }.to_bytes();
        for (&s, t) in seqs.iter().zip(&tails) {
            if t.is_none() {
                for h in 0..hkv {
                    let page = self.store.new_device_tail(s, h, seg.page_bytes)?;
                    self.store.upload(page, &empty)?;
                }
            }
        }
        let mut r = self.resident.take().expect("made above");
        let synced = self.resident_sync(&mut r, seqs);
        let plan_key = synced.and_then(|_| {
            let plan = r.table.plan();
            // Loaded now: a module load inside a capture would break it.
            self.engine.kernel(&self.spec, &plan.variant)?;
            let combine = match &plan.combine {
                Some(cv) => Some(self.engine.kernel(&self.spec, cv)?),
                None => None,
            };
            let st = self.engine.dev().stream.clone();
            let ws = &r.ws;
            let ptrs = [ws.page_offsets.device_ptr(&st).0, ws.page_info.device_ptr(&st).0, ws.page_indptr.device_ptr(&st).0, ws.partial_out.device_ptr(&st).0, ws.partial_lse.device_ptr(&st).0];
            Ok((plan.variant.to_string(), plan.combine.as_ref().map(|c| c.to_string()), plan.splits, plan.batch, ptrs, combine.is_some()))
        });
        if plan_key.is_err() {
            r.table.invalidate();
        }
        self.resident = Some(r);
        let plan_key = plan_key?;
        let mut offsets = Vec::with_capacity(seqs.len() * hkv);
        for &s in seqs {
            for h in 0..hkv {
                offsets.push(self.store.tail_page(s, h)?.ok_or(RtError::NoPage { seq: s, head: h, index: usize::MAX })?.0.offset);
            }
        }
        let rows = graph_rows(&offsets, hkv);
        let (arena, side) = (self.store.arena_ptr(), self.tier_pointers().side);
        let st = self.engine.dev().stream.clone();
        let g = self.graph.get_or_insert_with(Default::default);
        if g.rows.as_ref().is_none_or(|b| b.len() < rows.len()) {
            g.rows = Some(st.alloc_zeros::<u64>(rows.len().next_power_of_two()).map_err(drv("graph chunk list"))?);
            g.mirror.clear();
        }
        let buf = g.rows.as_mut().expect("allocated above");
        if g.mirror != rows {
            st.memcpy_htod(&rows, &mut buf.slice_mut(0..rows.len())).map_err(drv("graph chunk list"))?;
            g.mirror = rows;
        }
        let rows_ptr = buf.device_ptr(&st).0;
        g.ready = Some(seqs.to_vec());
        Ok(Some(key_of(&(g.id, plan_key, rows_ptr, g.mirror.len(), arena, side))))
    }

    /// Launches the step [`graph_prepare`](Self::graph_prepare) prepared for `seqs` on
    /// `stream` (a CUDA graph may be capturing it): the append of `k`, `v` (`[n][num_kv_heads]
    /// [head_dim]`) and the decode of `q` (`[n][num_q_heads][head_dim]`) into `out`, `lse`, as
    /// [`append_step_external`](Self::append_step_external) and
    /// [`decode_step_external`](Self::decode_step_external) compute them. No host copy, no
    /// allocation, no synchronisation, no bookkeeping: each run of the launches (the capture
    /// does not run them; every replay does) is followed by one
    /// [`graph_commit`](Self::graph_commit) and, before the next, one `graph_prepare`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this cache's context; the tensors must stay alive and
    /// at their addresses for every replay of a graph that captured the launches.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn graph_launch(&mut self, stream: u64, seqs: &[usize], k: &ExternalTensor, v: &ExternalTensor, q: &ExternalTensor, out: &ExternalTensor, lse: &ExternalTensor) -> Result<()> {
        let (hkv, d) = (self.cfg.num_kv_heads, self.cfg.head_dim);
        let ready = self.graph.as_ref().and_then(|g| g.ready.as_deref());
        if ready != Some(seqs) {
            return Err(RtError::BadInput("graph_launch: call graph_prepare with the same sequences first".into()));
        }
        k.check_rank("k", 3, "[n_seqs, num_kv_heads, head_dim]")?;
        v.check_rank("v", 3, "[n_seqs, num_kv_heads, head_dim]")?;
        let elem = ElemType::of(self.spec.geometry.dtype);
        let dims = vec![("n_seqs", seqs.len()), ("num_kv_heads", hkv), ("head_dim", d)];
        self.check_all(&[("k", k, elem.clone(), dims.clone()), ("v", v, elem, dims)])?;
        self.check_decode_io(seqs.len(), q, out, lse)?;
        let append = self.engine.kernel(&self.spec, &VariantId::append(&self.spec, d))?;
        let g = self.graph.as_ref().expect("checked above");
        let st = self.engine.dev().stream.clone();
        let rows_ptr = g.rows.as_ref().expect("prepared").device_ptr(&st).0;
        let n_rows = g.mirror.len() / 2;
        // SAFETY: the caller guarantees `stream` is a live stream of this context.
        let caller = unsafe { self.engine.dev().ctx.wrap_borrowed_stream(stream as CUstream) };
        self.engine.set_launch_stream(Some(caller));
        let r = self.resident.take().expect("prepared");
        // SAFETY: the chunk list names each sequence's tail page, which graph_prepare made
        // sure has room for the token; k / v hold n · hkv rows (checked above).
        let res = unsafe { self.launch_append_at(&append, rows_ptr, n_rows, k.ptr, v.ptr) }.and_then(|_| self.launch_io(r.table.plan(), &r.ws, DecodeIo { q: q.ptr, out: out.ptr, lse: lse.ptr }));
        self.resident = Some(r);
        self.engine.set_launch_stream(None);
        res
    }

    /// The host side of one run of a graph step of `seqs` (after it was queued): every
    /// sequence one token longer (a tail left full, which `graph_prepare` never plans, would
    /// be encoded into the target tier here).
    pub fn graph_commit(&mut self, seqs: &[usize]) -> Result<()> {
        let (hkv, p) = (self.cfg.num_kv_heads, self.spec.page.tokens);
        for &s in seqs {
            self.seq_len(s)?;
        }
        if let Some(g) = self.graph.as_mut() {
            g.ready = None;
        }
        let mut full = Vec::new();
        for &s in seqs {
            let mut len = 0;
            for h in 0..hkv {
                len = self.store.tail_grew_on_device(s, h, 1)?;
            }
            if len == p {
                full.push(s);
            }
        }
        if !full.is_empty() {
            self.encode_filled_tails(&full)?;
        }
        for &s in seqs {
            self.store.grow(s, 1)?;
        }
        Ok(())
    }

    /// One decode step without a graph: [`append_step_external`](Self::append_step_external)
    /// of `k`, `v`, then [`decode_step_external`](Self::decode_step_external) of `q` into
    /// `out`, `lse` (one call for a caller's per-layer step: one argument check of the
    /// sequence list, one stream join around both).
    #[allow(clippy::too_many_arguments)]
    pub fn step_external(&mut self, seqs: &[usize], k: &ExternalTensor, v: &ExternalTensor, q: &ExternalTensor, out: &ExternalTensor, lse: &ExternalTensor) -> Result<()> {
        // Decode arguments first: a bad output must not leave the token appended.
        self.check_decode_io(seqs.len(), q, out, lse)?;
        if let Some(g) = self.graph.as_mut() {
            g.ready = None;
        }
        self.append_step_external(seqs, k, v)?;
        self.decode_step_external(seqs, q, out, lse)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graph_rows_read_the_position_from_the_header() {
        let rows = graph_rows(&[4096, 8192, 12288], 3);
        assert_eq!(rows.len(), 6);
        for (r, w) in rows.chunks(2).enumerate() {
            assert_eq!(w[0], 4096 * (r as u64 + 1));
            assert_eq!((w[1] & 0xffff, (w[1] >> 16) & 0xffff, w[1] >> 32), (GRAPH_POS as u64, 1, r as u64));
        }
    }

    #[test]
    fn room_counts_new_tails_and_fills_and_refuses_a_full_tail() {
        assert_eq!(graph_room(&[None, Some(0), Some(62), Some(63)], 64).unwrap(), (1, 1));
        assert_eq!(graph_room(&[None], 1).unwrap(), (1, 1));
        assert!(matches!(graph_room(&[Some(3), Some(64)], 64), Err(RtError::BadInput(m)) if m.contains("entry 1")));
    }

    #[test]
    fn keys_differ_where_the_launches_do() {
        let a = key_of(&("v", Some("c"), 4usize, 1usize, [1u64, 2, 3, 4, 5], true));
        assert_eq!(a, key_of(&("v", Some("c"), 4usize, 1usize, [1u64, 2, 3, 4, 5], true)));
        assert_ne!(a, key_of(&("v", Some("c"), 5usize, 1usize, [1u64, 2, 3, 4, 5], true)));
        assert_ne!(a, key_of(&("v", Some("c"), 4usize, 1usize, [1u64, 2, 3, 4, 6], true)));
    }
}
