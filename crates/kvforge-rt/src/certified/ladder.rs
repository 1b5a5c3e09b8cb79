//! The ladder and the host path of a certified step.
//!
//! A [`Group`] is one (sequence, kv head): its pages, which of them phase 2 serves from tier 2,
//! and its rung. After every phase 2, [`verdict`] decides each group's next move from its
//! heads' certificates — the same rule whether the certificates came from the host
//! ([`head_certificates`]) or the device — and [`climb`] / [`Group::promote_all`] carry it out.
//!
//! The host path ([`KvCache::host_ladder`]) builds every page table on the host; the device path
//! (`device.rs`) hands a step over to it when a group must climb rungs 1–2 (they order pages
//! by achieved mass, which only the host does).

use kvforge_gen::schedule::Entry;
use kvforge_spec::TAIL_TIER;

use super::bound::certificate;
use super::checks::{head_checks, HeadView};
use super::select::{select_blocks, SelectParams, Selection, PROMOTED, QUANTISED};
use super::{CertConfig, HeadCertificate, PageErrors, PageIn, CERT_BLOCK};
use crate::cache::KvCache;
use crate::decode::from_bits;
use crate::error::{drv, Result};
use crate::pool::PageRef;

/// Per (sequence, kv head): the pages in order and the ladder state. Promotion is per
/// 16-token block ([`CERT_BLOCK`]): block u is token rows [16·(u mod B), +16) of page u / B,
/// B = page tokens / 16.
pub(super) struct Group {
    pub pages: Vec<(PageRef, usize)>,
    /// Blocks per page.
    pub bpp: usize,
    /// Per block: [`QUANTISED`] (phase 2 reads it quantised), [`PROMOTED`] or [`EXPLORED`] (it
    /// reads the block's fp16 original). Blocks of tail-tier pages stay [`QUANTISED`].
    pub state: Vec<u8>,
    pub rung: u8,
    /// Score checks failed so far in this step.
    pub detections: usize,
    pub v_max: f64,
    /// Per page (None for tail-tier pages).
    pub errors: Vec<Option<PageErrors>>,
}

impl Group {
    pub fn new(pages: Vec<(PageRef, usize)>, errors: Vec<Option<PageErrors>>, v_max: f64, bpp: usize) -> Group {
        Group { state: vec![QUANTISED; pages.len() * bpp], pages, bpp, rung: 0, detections: 0, v_max, errors }
    }

    pub fn blocks(&self) -> usize {
        self.pages.len() * self.bpp
    }

    /// Whether page `pi` is in a quantised tier.
    pub fn page_quantised(&self, pi: usize) -> bool {
        self.pages[pi].0.tier != TAIL_TIER
    }

    /// Whether block `u` is quantised (its page is).
    pub fn quantised(&self, u: usize) -> bool {
        self.page_quantised(u / self.bpp)
    }

    /// Tokens of block `u`.
    pub fn tokens(&self, u: usize) -> usize {
        self.pages[u / self.bpp].1.saturating_sub((u % self.bpp) * CERT_BLOCK).min(CERT_BLOCK)
    }

    /// η of block `u` (+∞ without a measurement, 0 for exact blocks).
    pub fn eta(&self, u: usize) -> f64 {
        if !self.quantised(u) {
            return 0.0;
        }
        self.errors[u / self.bpp].map_or(f64::INFINITY, |e| e.eta[u % self.bpp])
    }

    /// Whether phase 2 reads block `u` from its fp16 original.
    pub fn served(&self, u: usize) -> bool {
        self.quantised(u) && self.state[u] != QUANTISED
    }

    /// Page `pi`'s served blocks as a mask (bit b: block b of the page).
    pub fn page_mask(&self, pi: usize) -> u32 {
        (0..self.bpp).filter(|b| self.served(pi * self.bpp + b)).fold(0, |m, b| m | 1 << b)
    }

    /// Whether phase 2 reads all of page `pi` from its original (a tail-format page).
    pub fn page_whole(&self, pi: usize) -> bool {
        self.page_quantised(pi) && self.page_mask(pi) == (1 << self.bpp) - 1
    }

    /// Rungs 3 and 4: every quantised block from tier 2.
    pub fn promote_all(&mut self) {
        for u in 0..self.blocks() {
            if self.quantised(u) {
                self.state[u] = PROMOTED;
            }
        }
    }

    /// Quantised blocks phase 2 does not read exactly.
    pub fn left(&self) -> usize {
        (0..self.blocks()).filter(|&u| self.quantised(u) && self.state[u] == QUANTISED).count()
    }

    /// The selector's choice from phase 1's log2 block masses `lse` ([block][gqa] of this group).
    pub fn select(&mut self, lse: &[f32], gqa: usize, p: &SelectParams) -> Selection {
        let q: Vec<bool> = (0..self.blocks()).map(|u| self.quantised(u)).collect();
        let s = select_blocks(&q, lse, gqa, p);
        self.state.clone_from(&s.state);
        s
    }
}

/// Per block × gqa results of one launch, on the host.
pub(super) struct PhaseOut {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    /// [block][gqa] log2 masses.
    pub head_lse: Vec<f32>,
    /// [block][gqa] Δ_b; empty for phase-2 launches (their Δ is not read).
    pub delta: Vec<f32>,
    /// [batch * num_kv_heads + 1] into head_lse / delta (blocks).
    pub indptr: Vec<u32>,
}

impl PhaseOut {
    /// Column `hq` of group `gi`'s [block][gqa] array `a`.
    pub fn column(&self, a: &[f32], gi: usize, hq: usize, gqa: usize) -> Vec<f32> {
        (self.indptr[gi] as usize..self.indptr[gi + 1] as usize).map(|i| a[i * gqa + hq]).collect()
    }

    /// Group `gi`'s rows of `a` ([block][gqa]).
    pub fn rows<'a>(&self, a: &'a [f32], gi: usize, gqa: usize) -> &'a [f32] {
        &a[self.indptr[gi] as usize * gqa..self.indptr[gi + 1] as usize * gqa]
    }
}

/// What a group does after a phase 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Action {
    Keep,
    /// Rung 3: recompute the kv head exactly from tier 2.
    Exact,
    /// Rungs 1–2 (or 3 from rung 2): [`climb`].
    Climb,
}

/// The ladder's rule for one group from its heads' certificates of this phase 2 (`left`: its
/// quantised pages phase 2 did not read exactly): a failed score check (a fault) or, with
/// `rank_escalate`, a failed ranking or boundary check while pages are still quantised sends
/// the group to rung 3; a bound that is not certainly within the target (NaN too) climbs.
pub(super) fn verdict(g: &Group, heads: &[HeadCertificate], left: usize, cfg: &CertConfig) -> Action {
    if g.rung >= 3 {
        Action::Keep
    } else if g.detections > 0 || cfg.rank_escalate && left > 0 && heads.iter().any(|h| h.ranking || h.boundary > 0) {
        Action::Exact
    } else if heads.iter().any(|h| !(h.bound <= cfg.max_error)) {
        Action::Climb
    } else {
        Action::Keep
    }
}

/// Rung 4: whether the layer falls back to exact, given the groups' rungs after this round.
pub(super) fn layer_fallback(groups: &[Group], cfg: &CertConfig) -> bool {
    let at3 = groups.iter().filter(|g| g.rung >= 3).count();
    at3 > 0 && (at3 as f64) >= cfg.layer_fallback * groups.len() as f64 && groups.iter().any(|g| g.rung < 3)
}

/// Rung 1: double the promoted blocks (next by achieved mass); rung 2: promote blocks whose
/// value-error share ρ·η exceeds v_tol; rung 3: everything exact. `rho[h][u]` are the achieved
/// block masses. Returns whether anything changed.
pub(super) fn climb(g: &mut Group, rho: &[Vec<f64>], cfg: &CertConfig) -> bool {
    let share = |u: usize| rho.iter().map(|m| m[u]).fold(0.0, f64::max);
    let left: Vec<usize> = (0..g.blocks()).filter(|&u| g.quantised(u) && g.state[u] != PROMOTED).collect();
    if left.is_empty() {
        return false;
    }
    match g.rung {
        0 => {
            let n = g.state.iter().filter(|&&s| s == PROMOTED).count().max(1);
            let mut order = left;
            order.sort_by(|&a, &b| share(b).total_cmp(&share(a)));
            for &u in order.iter().take(n) {
                g.state[u] = PROMOTED;
            }
            g.rung = 1;
        }
        1 => {
            for &u in &left {
                if share(u) * g.eta(u) > cfg.v_tol {
                    g.state[u] = PROMOTED;
                }
            }
            g.rung = 2;
        }
        _ => {
            g.promote_all();
            g.rung = 3;
        }
    }
    true
}

/// The certificates of group `gi`'s heads from phase 1 (`p1`) and phase 2 (`p2`), computed
/// on the host in f64 (the reference of the device's `cert_bound`). Rung and detections are
/// left for the caller.
pub(super) fn head_certificates(g: &Group, p1: &PhaseOut, p2: &PhaseOut, gi: usize, gqa: usize, d: usize, cfg: &CertConfig) -> Vec<(HeadCertificate, usize)> {
    let quantised: Vec<bool> = (0..g.blocks()).map(|u| g.quantised(u)).collect();
    let tokens: Vec<usize> = (0..g.blocks()).map(|u| g.tokens(u)).collect();
    let eta: Vec<f64> = (0..g.blocks()).map(|u| g.eta(u)).collect();
    (0..gqa)
        .map(|hq| {
            let (l1, d1, l2) = (p1.column(&p1.head_lse, gi, hq, gqa), p1.column(&p1.delta, gi, hq, gqa), p2.column(&p2.head_lse, gi, hq, gqa));
            let v = HeadView { quantised: &quantised, state: &g.state, tokens: &tokens, eta: &eta, l1: &l1, d1: &d1, l2: &l2 };
            let c = head_checks(&v, cfg.guard, cfg.rank_depth);
            let row = gi * gqa + hq;
            let out_norm = p2.out[row * d..(row + 1) * d].iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt();
            let b = certificate(c.delta, c.alpha, g.v_max, c.e_val, out_norm, c.tokens);
            let cert = HeadCertificate {
                delta: c.delta,
                alpha_tail: c.alpha,
                v_max: g.v_max,
                e_key: b.e_key,
                e_val: b.e_val,
                e_round: b.e_round,
                bound: b.bound,
                promoted: c.promoted,
                explored: c.explored,
                rung: g.rung,
                detections: 0,
                ranking: c.ranking,
                boundary: c.boundary,
            };
            (cert, c.detections)
        })
        .collect()
}

/// Achieved block masses ρ of every query head of group `gi` in phase 2.
pub(super) fn achieved(p2: &PhaseOut, gi: usize, gqa: usize) -> Vec<Vec<f64>> {
    (0..gqa).map(|hq| super::checks::masses(&p2.column(&p2.head_lse, gi, hq, gqa))).collect()
}

impl KvCache {
    /// The host path from phase 2 on: certificates, verdicts and relaunches until no group
    /// escalates. `pending` is a phase 2 already run (the device path's), else one is launched.
    /// Returns the last phase 2 and the certificates (rungs and detections filled in).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn host_ladder(
        &mut self,
        groups: &mut [Group],
        p1: &PhaseOut,
        qh: &[u16],
        cfg: &CertConfig,
        mut pending: Option<PhaseOut>,
        launches: &mut usize,
        paged: &mut usize,
    ) -> Result<(PhaseOut, Vec<HeadCertificate>)> {
        let (gqa, d) = (self.cfg.gqa, self.cfg.head_dim);
        loop {
            let p2 = match pending.take() {
                Some(p) => p,
                None => {
                    *launches += 1;
                    self.certified_launch(groups, qh, cfg.page_in, paged, false)?
                }
            };
            let mut certs = Vec::with_capacity(groups.len() * gqa);
            let mut escalate = false;
            for (gi, g) in groups.iter_mut().enumerate() {
                let heads = head_certificates(g, p1, &p2, gi, gqa, d, cfg);
                g.detections += heads.iter().map(|h| h.1).sum::<usize>();
                let heads: Vec<HeadCertificate> = heads.into_iter().map(|h| h.0).collect();
                match verdict(g, &heads, g.left(), cfg) {
                    Action::Keep => {}
                    Action::Exact => {
                        g.promote_all();
                        g.rung = 3;
                        escalate = true;
                    }
                    Action::Climb => escalate |= climb(g, &achieved(&p2, gi, gqa), cfg),
                }
                certs.extend(heads);
            }
            if layer_fallback(groups, cfg) {
                for g in groups.iter_mut() {
                    g.promote_all();
                    g.rung = 4;
                }
                escalate = true;
            }
            if !escalate {
                return Ok((p2, finish(groups, certs, gqa)));
            }
        }
    }

    /// [`PageIn::Copy`]: copies the served originals (`sources`, pinned tier-2 addresses of
    /// `pb` bytes each) into the cache's page-in buffer, slot k = k-th source, and returns the
    /// buffer's device address. One asynchronous DMA copy per run of consecutive slots, on the
    /// runtime's stream, so the decode launched next reads them; the buffer is kept and grown,
    /// not allocated and zeroed per launch. (`cuMemcpyBatchAsync`, one call for all runs, is
    /// refused on the legacy default stream the runtime uses: CUDA_ERROR_INVALID_VALUE on the
    /// H100.)
    fn page_in_copy(&mut self, sources: &[u64], pb: usize) -> Result<u64> {
        use cudarc::driver::{sys, DevicePtrMut};
        let need = sources.len() * pb;
        let st = self.engine.dev().stream.clone();
        if self.cert.page_in.as_ref().is_none_or(|b| b.len() < need) {
            // SAFETY: every byte a launch reads is written by the copies below first.
            self.cert.page_in = Some(unsafe { st.alloc::<u8>(need) }.map_err(drv("tier-2 page-in buffer"))?);
        }
        let buf = self.cert.page_in.as_mut().expect("allocated above");
        let (base, _guard) = buf.device_ptr_mut(&st);
        let mut i = 0;
        while i < sources.len() {
            let mut j = i + 1;
            while j < sources.len() && sources[j] == sources[j - 1] + pb as u64 {
                j += 1;
            }
            // SAFETY: slots i..j lie in the page-in buffer (need bytes); sources i..j are
            // consecutive filled pinned tier-2 slots of `pb` bytes, alive for the cache's life.
            let r = unsafe { sys::cuMemcpyHtoDAsync_v2(base + (i * pb) as u64, sources[i] as *const std::ffi::c_void, (j - i) * pb, st.cu_stream()) };
            r.result().map_err(drv("tier-2 page-in"))?;
            i = j;
        }
        Ok(base)
    }

    /// Launches decode over the groups' pages, the blocks phase 2 serves exactly read from
    /// tier 2, recording per-block per-head log-masses; `with_delta` marks phase 1 (records Δ_b
    /// too), else phase 2 (the device path's phase-2 plan).
    pub(super) fn certified_launch(&mut self, groups: &[Group], qh: &[u16], page_in: PageIn, paged: &mut usize, with_delta: bool) -> Result<PhaseOut> {
        let hkv = self.cfg.num_kv_heads;
        let arena = self.store.arena_ptr();
        let orig = self.cert.originals.as_ref().expect("checked by decode_certified");
        let pb = orig.page_bytes();
        let block_bytes = self.cert_block_bytes();
        // Pages with a served block: their tier-2 address (UVA) or a slot of the scratch buffer
        // (copy, the whole page).
        let mut sources: Vec<u64> = Vec::new();
        for g in groups {
            for (pi, (p, _)) in g.pages.iter().enumerate() {
                let mask = g.page_mask(pi);
                if mask != 0 {
                    sources.push(orig.address(p)?);
                    // The served blocks' bytes (what the device path counts; a copied page-in
                    // moves the whole page).
                    *paged += mask.count_ones() as usize * block_bytes;
                }
            }
        }
        let scratch_ptr = match page_in {
            PageIn::Copy if !sources.is_empty() => Some(self.page_in_copy(&sources, pb)?),
            _ => None,
        };
        // Phase 1's plan over the quantised pages, and for phase 2 the same page ranges, splits
        // and (tail-serving) variant as the device path: a page served whole becomes a
        // tail-format page outside the arena (the kernel adds the offset to the arena base, so
        // the wrapping difference addresses it); a page served in part keeps its entry, with
        // the mask of served blocks in its info and its original in `promoted_offsets`.
        let lists: Vec<Vec<Vec<(PageRef, usize)>>> = groups.chunks(hkv).map(|seq| seq.iter().map(|g| g.pages.clone()).collect()).collect();
        let mut plan = self.plan_entry(&lists, Entry::Certified)?;
        let mut promoted = Vec::new();
        if !with_delta {
            plan = super::device::phase2_plan(&self.spec, &plan)?;
            promoted = vec![0u64; plan.page_offsets.len().max(1)];
            let mut at = 0usize;
            let mut k = 0usize;
            for g in groups {
                for pi in 0..g.pages.len() {
                    let mask = g.page_mask(pi);
                    if mask != 0 {
                        let addr = scratch_ptr.map_or(sources[k], |s| s + (k * pb) as u64).wrapping_sub(arena);
                        if g.page_whole(pi) {
                            plan.page_offsets[at] = addr;
                            plan.page_info[at] = (plan.page_info[at] & !0xff) | TAIL_TIER as u32;
                        } else {
                            plan.page_info[at] |= mask << 16;
                            promoted[at] = addr;
                        }
                        k += 1;
                    }
                    at += 1;
                }
            }
        }
        let mut ws = self.workspace(&plan)?;
        let bpp = self.cert_blocks_per_page();
        let nblocks = plan.page_offsets.len().max(1) * bpp;
        let st = self.engine.dev().stream.clone();
        ws.block_head_lse = Some(st.alloc_zeros::<f32>(nblocks * plan.gqa).map_err(drv("block masses"))?);
        ws.page_warp_lse = self.warp_lse_scratch(&plan)?;
        if with_delta {
            ws.block_delta = Some(st.alloc_zeros::<f32>(nblocks * plan.gqa).map_err(drv("block bounds"))?);
        } else {
            ws.promoted_offsets = Some(st.clone_htod(&promoted).map_err(drv("promoted blocks"))?);
        }
        st.memcpy_htod(qh, &mut ws.q).map_err(drv("query upload"))?;
        self.launch(&plan, &mut ws)?;
        self.check(&plan)?;
        let dtype = self.spec.geometry.dtype;
        let out = st.clone_dtoh(&ws.out).map_err(drv("output download"))?;
        let lse = st.clone_dtoh(&ws.lse).map_err(drv("lse download"))?;
        let head_lse = st.clone_dtoh(ws.block_head_lse.as_ref().expect("allocated above")).map_err(drv("block masses"))?;
        let delta = match &ws.block_delta {
            Some(b) => st.clone_dtoh(b).map_err(drv("block bounds"))?,
            None => Vec::new(),
        };
        Ok(PhaseOut { out: out.into_iter().map(|b| from_bits(dtype, b)).collect(), lse, head_lse, delta, indptr: block_indptr(&plan.page_indptr, bpp) })
    }
}

/// Block ranges of the groups from their page ranges (`bpp` blocks per page).
pub(super) fn block_indptr(page_indptr: &[u32], bpp: usize) -> Vec<u32> {
    page_indptr.iter().map(|&i| i * bpp as u32).collect()
}

/// Fills every certificate's rung and detections from its group.
pub(super) fn finish(groups: &[Group], mut certs: Vec<HeadCertificate>, gqa: usize) -> Vec<HeadCertificate> {
    for (gi, g) in groups.iter().enumerate() {
        for c in &mut certs[gi * gqa..(gi + 1) * gqa] {
            c.rung = g.rung;
            c.detections = g.detections;
        }
    }
    certs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certified::select::EXPLORED;

    fn group(tiers: &[u8]) -> Group {
        let pages = tiers.iter().enumerate().map(|(i, &t)| (PageRef { tier: t, index: i as u32, offset: 0 }, 64)).collect();
        let errors = tiers.iter().map(|&t| (t != TAIL_TIER).then_some(PageErrors::uniform(0.1, 1.0))).collect();
        // One block per page: the ladder's rules do not depend on the block size.
        Group::new(pages, errors, 1.0, 1)
    }

    fn cert(bound: f64, ranking: bool, boundary: usize) -> HeadCertificate {
        HeadCertificate { delta: 0.0, alpha_tail: 0.0, v_max: 1.0, e_key: 0.0, e_val: 0.0, e_round: 0.0, bound, promoted: 0, explored: 0, rung: 0, detections: 0, ranking, boundary }
    }

    #[test]
    fn verdicts() {
        let cfg = CertConfig::default();
        let mut g = group(&[1, 1, TAIL_TIER]);
        assert_eq!(verdict(&g, &[cert(0.01, false, 0)], g.left(), &cfg), Action::Keep);
        assert_eq!(verdict(&g, &[cert(0.01, false, 0), cert(0.06, false, 0)], g.left(), &cfg), Action::Climb);
        assert_eq!(verdict(&g, &[cert(f64::NAN, false, 0)], g.left(), &cfg), Action::Climb);
        assert_eq!(verdict(&g, &[cert(0.01, true, 0)], g.left(), &cfg), Action::Exact);
        assert_eq!(verdict(&g, &[cert(0.01, false, 2)], g.left(), &cfg), Action::Exact);
        assert_eq!(verdict(&g, &[cert(0.01, true, 0)], g.left(), &CertConfig { rank_escalate: false, ..CertConfig::default() }), Action::Keep);
        g.detections = 1;
        assert_eq!(verdict(&g, &[cert(0.01, false, 0)], g.left(), &cfg), Action::Exact);
        // Every quantised page already exact: a ranking disagreement changes nothing.
        g.detections = 0;
        g.promote_all();
        assert_eq!(verdict(&g, &[cert(0.01, true, 0)], g.left(), &cfg), Action::Keep);
        g.rung = 3;
        assert_eq!(verdict(&g, &[cert(1.0, true, 0)], g.left(), &cfg), Action::Keep);
    }

    #[test]
    fn climbing_promotes_by_achieved_mass_then_value_error_then_all() {
        let cfg = CertConfig { v_tol: 0.05, ..CertConfig::default() };
        let mut g = group(&[1, 1, 1, 1, TAIL_TIER]);
        g.state[0] = PROMOTED;
        g.state[3] = EXPLORED;
        let rho = vec![vec![0.4, 0.1, 0.3, 0.15, 0.05]];
        assert!(climb(&mut g, &rho, &cfg));
        assert_eq!((g.rung, &g.state[..]), (1, &[PROMOTED, QUANTISED, PROMOTED, EXPLORED, QUANTISED][..]));
        // ρ·η with page 3's η 0.5: page 1 0.01, page 3 0.075 > v_tol.
        g.errors[3] = Some(PageErrors::uniform(0.5, 1.0));
        assert!(climb(&mut g, &rho, &cfg));
        assert_eq!((g.rung, &g.state[..]), (2, &[PROMOTED, QUANTISED, PROMOTED, PROMOTED, QUANTISED][..]));
        assert!(climb(&mut g, &rho, &cfg));
        assert_eq!(g.rung, 3);
        assert_eq!(g.left(), 0);
        assert!(!climb(&mut g, &rho, &cfg));
    }

    #[test]
    fn blocks_map_to_pages_masks_and_tokens() {
        let pages = vec![(PageRef { tier: 1, index: 0, offset: 0 }, 64), (PageRef { tier: 1, index: 1, offset: 0 }, 64), (PageRef { tier: TAIL_TIER, index: 2, offset: 0 }, 21)];
        let mut e = PageErrors::uniform(0.0, 1.0);
        e.eta[..4].copy_from_slice(&[0.1, 0.2, 0.3, 0.4]);
        let mut g = Group::new(pages, vec![Some(e), Some(e), None], 1.0, 4);
        assert_eq!(g.blocks(), 12);
        assert_eq!((0..12).map(|u| g.tokens(u)).collect::<Vec<_>>(), vec![16, 16, 16, 16, 16, 16, 16, 16, 16, 5, 0, 0]);
        assert_eq!((g.eta(5), g.eta(8), g.quantised(7), g.quantised(8)), (0.2, 0.0, true, false));
        g.state[1] = PROMOTED;
        g.state[3] = EXPLORED;
        (4..8).for_each(|u| g.state[u] = PROMOTED);
        assert_eq!((g.page_mask(0), g.page_whole(0), g.page_mask(1), g.page_whole(1), g.page_mask(2)), (0b1010, false, 0b1111, true, 0));
        assert_eq!(g.left(), 2);
        g.promote_all();
        assert_eq!((g.left(), g.page_whole(0), g.state[8..].to_vec()), (0, true, vec![QUANTISED; 4]));
    }

    #[test]
    fn layer_falls_back_when_enough_heads_are_exact() {
        let cfg = CertConfig { layer_fallback: 0.5, ..CertConfig::default() };
        let mut gs = vec![group(&[1]), group(&[1]), group(&[1])];
        assert!(!layer_fallback(&gs, &cfg));
        gs[0].rung = 3;
        assert!(!layer_fallback(&gs, &cfg));
        gs[1].rung = 3;
        assert!(layer_fallback(&gs, &cfg));
        gs[2].rung = 3;
        assert!(!layer_fallback(&gs, &cfg));
    }
}
