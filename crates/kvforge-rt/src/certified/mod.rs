//! Certified decode (seed 004) on the GPU, at page granularity: every output comes with a
//! per-query-head bound on ‖O − O_exact‖₂, or is exact.
//!
//! One step: **phase 1** decodes the quantised pages and records, per page and query head,
//! the log-mass ℓ and the key logit bound Δ (the decode kernel writes both as by-products).
//! The **selector** promotes, per kv head, the pages of largest mass until every query head's
//! exact-key coverage reaches τ_cov, plus a small random **exploration** sample of the rest.
//! **Phase 2** decodes again with promoted pages served from their fp16 originals (tier 2,
//! pinned host memory: [`Originals`]), recording each page's achieved mass ρ. Every promoted
//! or explored page is a **score check**: its exact log-mass must lie within Δ + ε_guard of its
//! quantised one, or the (sequence, kv head) is escalated as faulty. The **certificate** is
//! computed from what phase 2 achieved ([`bound`]); the **ladder** escalates heads whose bound
//! exceeds the target: rung 1 doubles the promoted pages, rung 2 promotes pages whose value
//! error ρ·η exceeds v_tol, rung 3 recomputes the kv head exactly from tier 2, rung 4 the whole
//! layer when too many heads reached rung 3.
//!
//! Promotion is per page (64 tokens = 4 key blocks of 16) rather than per block: the pages
//! are the kernels' unit of dispatch, so a promoted page is just a tail-format page in the
//! page table and the same generated kernel serves both precisions.

mod bound;
mod originals;

pub use bound::{certificate, Certificate};
pub use originals::{Originals, PageErrors, PageIn};

use cudarc::driver::{CudaSlice, DevicePtr};
use kvforge_spec::TAIL_TIER;
use rand::{Rng, SeedableRng};

use crate::cache::KvCache;
use crate::decode::{from_bits, to_bits};
use crate::error::{drv, Result, RtError};
use crate::pool::PageRef;

/// Thresholds of the selector and the ladder (defaults from seed 004 where it gives them).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CertConfig {
    /// τ_cov: exact-key coverage of every query head's estimated mass.
    pub coverage: f64,
    /// K_min / K_max: promoted pages per (sequence, kv head) before the ladder.
    pub min_pages: usize,
    pub max_pages: usize,
    /// Fraction of the non-promoted quantised pages also promoted at random and score-checked.
    pub explore: f64,
    /// ε_guard of the score check, natural-log units.
    pub guard: f64,
    /// Target: a head whose bound exceeds this (absolute ‖·‖₂) climbs the ladder.
    pub max_error: f64,
    /// Rung 2: promote pages whose value-error share ρ·η exceeds this.
    pub v_tol: f64,
    /// Rung 4: fall back to exact for the whole layer when this fraction of kv heads is at rung 3.
    pub layer_fallback: f64,
    pub page_in: PageIn,
    /// Seed of the exploration sample (advanced every step).
    pub seed: u64,
}

impl Default for CertConfig {
    fn default() -> Self {
        CertConfig { coverage: 0.995, min_pages: 1, max_pages: usize::MAX, explore: 0.02, guard: 1e-3, max_error: 0.05, v_tol: 0.01, layer_fallback: 0.5, page_in: PageIn::Uva, seed: 0x5eed }
    }
}

/// Telemetry and certificate of one query head in one step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct HeadCertificate {
    /// Largest key logit error Δ over the pages left quantised (natural log).
    pub delta: f64,
    /// Achieved attention mass on pages left quantised.
    pub alpha_tail: f64,
    pub v_max: f64,
    pub e_key: f64,
    pub e_val: f64,
    /// fp16 output rounding and fp32 arithmetic.
    pub e_round: f64,
    /// e_key + e_val + e_round: the certified bound on ‖O − O_exact‖₂.
    pub bound: f64,
    /// Pages served from fp16 originals (promoted + explored) of this head's kv head.
    pub promoted: usize,
    pub explored: usize,
    /// 0: none; 1: K* doubled; 2: values promoted; 3: exact kv head; 4: exact layer.
    pub rung: u8,
    /// Score checks that failed for this head's kv head (a fault was detected).
    pub detections: usize,
}

/// A certified decode step.
#[derive(Clone, Debug)]
pub struct CertifiedOutput {
    /// [batch][q heads][head_dim]
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
    /// [batch][q heads]
    pub heads: Vec<HeadCertificate>,
    /// Phase-2 launches (1 + escalations).
    pub launches: usize,
    /// Bytes of fp16 originals read over the bus or copied, summed over launches.
    pub paged_in_bytes: usize,
}

/// Per (sequence, kv head): the encoded pages in order, and the ladder state.
struct Group {
    pages: Vec<(PageRef, usize)>,
    /// Indices into `pages` served from tier 2.
    promoted: Vec<bool>,
    explored: Vec<bool>,
    rung: u8,
    detections: usize,
    v_max: f64,
    errors: Vec<Option<PageErrors>>,
}

/// Per page × gqa results of one launch.
struct PhaseOut {
    out: Vec<f32>,
    lse: Vec<f32>,
    head_lse: Vec<f32>,
    delta: Vec<f32>,
    /// [batch * num_kv_heads + 1] into head_lse / delta (pages).
    indptr: Vec<u32>,
}

impl KvCache {
    /// Keeps the fp16 original of every page encoded from now on in pinned host memory
    /// (tier 2 of certified decode). Call before appending; fails with a typed error if the
    /// pinned slab cannot be allocated.
    pub fn keep_originals(&mut self) -> Result<()> {
        if self.pool.used_pages(self.cfg.target_tier) > 0 {
            return Err(RtError::BadInput("keep_originals must be called before any page is encoded".into()));
        }
        let seg = self.spec.segment(TAIL_TIER, self.cfg.head_dim);
        let bytes = kvforge_spec::HEADER_BYTES + seg.bytes;
        self.originals = Some(Originals::new(self.dev.stream.context(), self.pool.capacity(self.cfg.target_tier), bytes)?);
        Ok(())
    }

    pub fn originals(&self) -> Option<&Originals> {
        self.originals.as_ref()
    }

    /// Fault injection and eviction: forget a page's original.
    pub fn forget_original(&mut self, page: &PageRef) {
        if let Some(o) = &mut self.originals {
            o.forget(page);
        }
    }

    /// Records the originals of freshly encoded pages with their value error η (measured
    /// against the encoded page, decoded by the reference) and largest value norm.
    pub(crate) fn record_originals(&mut self, full: &[(usize, Vec<u8>)], encoded: &[PageRef]) -> Result<()> {
        let d = self.cfg.head_dim;
        let tier = self.spec.tiers[self.cfg.target_tier as usize].clone();
        let tail = self.spec.tiers[TAIL_TIER as usize].clone();
        let opts = self.spec.page.clone();
        let rs_all = self.radius_scales(self.cfg.target_tier)?.unwrap_or_default();
        let per_head = rs_all.len() / self.cfg.num_kv_heads;
        for ((h, orig), page) in full.iter().zip(encoded) {
            let enc = self.download_page(*page)?;
            let rs = &rs_all[h * per_head..(h + 1) * per_head];
            let exact = kvforge_ref::page::decode_page(&tail, d, &opts, orig, &[]).map_err(|e| RtError::BadInput(format!("tier-2 original: {e}")))?;
            let quant = kvforge_ref::page::decode_page(&tier, d, &opts, &enc, rs).map_err(|e| RtError::BadInput(format!("encoded page: {e}")))?;
            let (mut eta, mut v_max) = (0f64, 0f64);
            for t in 0..exact.v.len() / d {
                let r = t * d..(t + 1) * d;
                let e: f64 = exact.v[r.clone()].iter().zip(&quant.v[r.clone()]).map(|(a, b)| (a - b) * (a - b)).sum();
                let n: f64 = exact.v[r].iter().map(|a| a * a).sum();
                eta = eta.max(e.sqrt());
                v_max = v_max.max(n.sqrt());
            }
            let pb = self.originals.as_ref().map_or(0, |o| o.page_bytes());
            self.originals.as_mut().unwrap().record(*page, &orig[..pb.min(orig.len())], PageErrors { eta, v_max })?;
        }
        Ok(())
    }

    /// One certified decode step for `seqs` (one query token each, `q` as in [`KvCache::decode`]).
    pub fn decode_certified(&mut self, seqs: &[usize], q: &[f32], cfg: &mut CertConfig) -> Result<CertifiedOutput> {
        if self.originals.is_none() {
            return Err(RtError::BadInput("certified decode needs tier 2: call keep_originals() before appending".into()));
        }
        let (hkv, gqa, d) = (self.cfg.num_kv_heads, self.cfg.gqa, self.cfg.head_dim);
        let rows = seqs.len() * hkv * gqa;
        if seqs.is_empty() || q.len() != rows * d {
            return Err(RtError::BadInput(format!("query has {} values, expected {} sequences × {} q heads × {d}", q.len(), seqs.len(), hkv * gqa)));
        }
        let mut groups = Vec::with_capacity(seqs.len() * hkv);
        for &s in seqs {
            for h in 0..hkv {
                let pages = self.pages(s, h)?;
                if pages.is_empty() {
                    return Err(RtError::EmptySequence(s));
                }
                let orig = self.originals.as_ref().unwrap();
                let mut errors = Vec::with_capacity(pages.len());
                let mut v_max = 0f64;
                for (p, _) in &pages {
                    if p.tier == TAIL_TIER {
                        errors.push(None);
                    } else {
                        // A missing original is a typed error before any output exists.
                        let e = orig.errors(p)?;
                        v_max = v_max.max(e.v_max);
                        errors.push(Some(e));
                    }
                }
                v_max = v_max.max(self.tail_v_max(s, h)?);
                let n = pages.len();
                groups.push(Group { pages, promoted: vec![false; n], explored: vec![false; n], rung: 0, detections: 0, v_max, errors });
            }
        }
        let dtype = self.spec.geometry.dtype;
        let qh: Vec<u16> = q.iter().map(|&x| to_bits(dtype, x)).collect();

        // Phase 1: quantised pages, masses and Δ.
        let p1 = self.certified_launch(&groups, &qh, cfg.page_in, &mut 0)?;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cfg.seed);
        cfg.seed = cfg.seed.wrapping_add(1);
        for (gi, g) in groups.iter_mut().enumerate() {
            select(g, &p1, gi, gqa, cfg, &mut rng);
        }
        let mut paged = 0usize;
        let mut launches = 0usize;
        let mut certs;
        let mut p2;
        loop {
            p2 = self.certified_launch(&groups, &qh, cfg.page_in, &mut paged)?;
            launches += 1;
            certs = Vec::with_capacity(rows);
            let mut escalate = false;
            for (gi, g) in groups.iter_mut().enumerate() {
                // Score check of every page served exactly: exact and quantised log-masses of
                // the same tokens differ by at most Δ (+ guard) unless the page is corrupt.
                let base = p1.indptr[gi] as usize;
                for (pi, _) in g.pages.iter().enumerate() {
                    if !(g.promoted[pi] || g.explored[pi]) || g.pages[pi].0.tier == TAIL_TIER {
                        continue;
                    }
                    for hq in 0..gqa {
                        let at = (base + pi) * gqa + hq;
                        let l1 = p1.head_lse[at] as f64 * std::f64::consts::LN_2;
                        let l2 = p2.head_lse[at] as f64 * std::f64::consts::LN_2;
                        let delta = p1.delta[at] as f64;
                        if !((l1 - l2).abs() <= delta + cfg.guard) {
                            g.detections += 1;
                        }
                    }
                }
                // Achieved page masses ρ of every query head: the certificate and the ladder read them.
                let rho: Vec<Vec<f64>> = (0..gqa).map(|hq| masses(&p2, gi, hq, gqa)).collect();
                let mut worst = 0f64;
                let mut head_certs = Vec::with_capacity(gqa);
                for hq in 0..gqa {
                    let c = head_certificate(g, &p1, &p2, &rho[hq], gi, hq, gqa, d);
                    worst = worst.max(c.bound);
                    head_certs.push(c);
                }
                if g.detections > 0 && g.rung < 3 {
                    promote_all(g);
                    g.rung = 3;
                    escalate = true;
                } else if worst > cfg.max_error && g.rung < 3 {
                    escalate |= climb(g, &rho, cfg);
                }
                certs.extend(head_certs);
            }
            let at3 = groups.iter().filter(|g| g.rung >= 3).count();
            if at3 > 0 && (at3 as f64) >= cfg.layer_fallback * groups.len() as f64 && groups.iter().any(|g| g.rung < 3) {
                for g in groups.iter_mut() {
                    promote_all(g);
                    g.rung = 4;
                }
                escalate = true;
            }
            if !escalate {
                break;
            }
        }
        let mut heads = Vec::with_capacity(rows);
        for (gi, g) in groups.iter().enumerate() {
            for hq in 0..gqa {
                let mut c = certs[gi * gqa + hq].clone();
                c.rung = g.rung;
                c.detections = g.detections;
                heads.push(c);
            }
        }
        let out = p2.out.clone();
        Ok(CertifiedOutput { out, lse: p2.lse.clone(), heads, launches, paged_in_bytes: paged })
    }

    /// Largest ‖V_t‖₂ of the tail page of (seq, head) (its tokens are exact; they still enter
    /// the key term's Σ|p̂ − p|·‖v‖).
    fn tail_v_max(&self, seq: usize, head: usize) -> Result<f64> {
        let Some((bytes, len)) = self.tail_bytes(seq, head)? else { return Ok(0.0) };
        let d = self.cfg.head_dim;
        let voff = kvforge_spec::HEADER_BYTES + self.spec.segment(TAIL_TIER, d).offset("v");
        let dtype = self.spec.geometry.dtype;
        let norm = |t: usize| (0..d).map(|c| from_bits(dtype, u16::from_le_bytes([bytes[voff + (t * d + c) * 2], bytes[voff + (t * d + c) * 2 + 1]])) as f64).map(|x| x * x).sum::<f64>().sqrt();
        Ok((0..len).map(norm).fold(0.0, f64::max))
    }

    /// Launches decode over the groups' pages, promoted ones served from tier 2, recording
    /// per-page per-head log-masses and Δ.
    fn certified_launch(&mut self, groups: &[Group], qh: &[u16], page_in: PageIn, paged: &mut usize) -> Result<PhaseOut> {
        let hkv = self.cfg.num_kv_heads;
        let arena = {
            let st = &self.dev.stream;
            self.arena.device_ptr(st).0
        };
        let orig = self.originals.as_ref().unwrap();
        let pb = orig.page_bytes();
        // Promoted pages: their tier-2 address (UVA) or a slot of the scratch buffer (copy).
        let mut sources: Vec<u64> = Vec::new();
        for g in groups {
            for (pi, (p, _)) in g.pages.iter().enumerate() {
                if (g.promoted[pi] || g.explored[pi]) && p.tier != TAIL_TIER {
                    sources.push(orig.address(p)?);
                }
            }
        }
        *paged += sources.len() * pb;
        let scratch: Option<CudaSlice<u8>> = match page_in {
            PageIn::Copy if !sources.is_empty() => {
                let st = &self.dev.stream;
                let mut buf = st.alloc_zeros::<u8>(sources.len() * pb).map_err(drv("tier-2 scratch"))?;
                // One copy per run of consecutive slots.
                let mut i = 0;
                while i < sources.len() {
                    let mut j = i + 1;
                    while j < sources.len() && sources[j] == sources[j - 1] + pb as u64 {
                        j += 1;
                    }
                    // SAFETY: slots i..j are consecutive filled pinned slots of `pb` bytes.
                    let host = unsafe { std::slice::from_raw_parts(sources[i] as *const u8, (j - i) * pb) };
                    let mut dst = buf.slice_mut(i * pb..j * pb);
                    st.memcpy_htod(host, &mut dst).map_err(drv("tier-2 page-in"))?;
                    i = j;
                }
                Some(buf)
            }
            _ => None,
        };
        let scratch_ptr = scratch.as_ref().map(|b| b.device_ptr(&self.dev.stream).0);
        let mut k = 0usize;
        let mut lists: Vec<Vec<Vec<(PageRef, usize)>>> = Vec::new();
        for (gi, g) in groups.iter().enumerate() {
            if gi % hkv == 0 {
                lists.push(Vec::with_capacity(hkv));
            }
            let list = g
                .pages
                .iter()
                .enumerate()
                .map(|(pi, &(p, len))| {
                    if (g.promoted[pi] || g.explored[pi]) && p.tier != TAIL_TIER {
                        let addr = match scratch_ptr {
                            Some(s) => s + (k * pb) as u64,
                            None => sources[k],
                        };
                        k += 1;
                        // A tail-format page outside the arena: the kernel adds the offset to
                        // the arena base, so the (wrapping) difference addresses it.
                        (PageRef { tier: TAIL_TIER, index: u32::MAX, offset: addr.wrapping_sub(arena) }, len)
                    } else {
                        (p, len)
                    }
                })
                .collect();
            lists.last_mut().unwrap().push(list);
        }
        let plan = self.plan_pages(&lists)?;
        let mut ws = self.workspace(&plan)?;
        let npages = plan.page_offsets.len().max(1);
        let st = self.dev.stream.clone();
        ws.page_head_lse = Some(st.alloc_zeros::<f32>(npages * plan.gqa).map_err(drv("page masses"))?);
        ws.page_delta = Some(st.alloc_zeros::<f32>(npages * plan.gqa).map_err(drv("page bounds"))?);
        st.memcpy_htod(qh, &mut ws.q).map_err(drv("query upload"))?;
        self.launch(&plan, &mut ws)?;
        self.check(&plan)?;
        let dtype = self.spec.geometry.dtype;
        let out = st.clone_dtoh(&ws.out).map_err(drv("output download"))?;
        let lse = st.clone_dtoh(&ws.lse).map_err(drv("lse download"))?;
        let head_lse = st.clone_dtoh(ws.page_head_lse.as_ref().unwrap()).map_err(drv("page masses"))?;
        let delta = st.clone_dtoh(ws.page_delta.as_ref().unwrap()).map_err(drv("page bounds"))?;
        drop(scratch);
        Ok(PhaseOut { out: out.into_iter().map(|b| from_bits(dtype, b)).collect(), lse, head_lse, delta, indptr: plan.page_indptr })
    }
}

/// Per-head page masses (natural probabilities) of group `gi` from a launch.
fn masses(p: &PhaseOut, gi: usize, hq: usize, gqa: usize) -> Vec<f64> {
    let r = p.indptr[gi] as usize..p.indptr[gi + 1] as usize;
    let ls: Vec<f64> = r.map(|i| p.head_lse[i * gqa + hq] as f64).collect();
    let mx = ls.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let tot: f64 = ls.iter().map(|l| (l - mx).exp2()).sum();
    ls.iter().map(|l| (l - mx).exp2() / tot).collect()
}

/// Selector: promote pages of largest estimated mass until every query head's exact share
/// (fp16 tail pages + promoted) reaches τ_cov, clamped to [K_min, K_max]; then explore.
fn select(g: &mut Group, p1: &PhaseOut, gi: usize, gqa: usize, cfg: &CertConfig, rng: &mut impl Rng) {
    let quant: Vec<usize> = (0..g.pages.len()).filter(|&i| g.pages[i].0.tier != TAIL_TIER).collect();
    if quant.is_empty() {
        return;
    }
    let per_head: Vec<Vec<f64>> = (0..gqa).map(|h| masses(p1, gi, h, gqa)).collect();
    // Pages by their largest share over the group's query heads.
    let mut order = quant.clone();
    let key = |i: usize| per_head.iter().map(|m| m[i]).fold(0.0, f64::max);
    order.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
    let mut covered: Vec<f64> = per_head.iter().map(|m| (0..g.pages.len()).filter(|&i| g.pages[i].0.tier == TAIL_TIER).map(|i| m[i]).sum()).collect();
    let mut taken = 0;
    for &i in &order {
        let need = covered.iter().any(|&c| c < cfg.coverage);
        if (!need && taken >= cfg.min_pages) || taken >= cfg.max_pages {
            break;
        }
        g.promoted[i] = true;
        taken += 1;
        for (h, m) in per_head.iter().enumerate() {
            covered[h] += m[i];
        }
    }
    let rest: Vec<usize> = quant.into_iter().filter(|&i| !g.promoted[i]).collect();
    if !rest.is_empty() && cfg.explore > 0.0 {
        let n = ((rest.len() as f64 * cfg.explore).ceil() as usize).min(rest.len());
        for _ in 0..n {
            let i = rest[rng.gen_range(0..rest.len())];
            g.explored[i] = true;
        }
    }
}

fn promote_all(g: &mut Group) {
    for (i, (p, _)) in g.pages.iter().enumerate() {
        if p.tier != TAIL_TIER {
            g.promoted[i] = true;
        }
    }
}

/// Rung 1: double the promoted pages (next by achieved mass); rung 2: promote pages whose
/// value-error share ρ·η exceeds v_tol; rung 3: everything exact. Returns whether anything changed.
fn climb(g: &mut Group, per_head: &[Vec<f64>], cfg: &CertConfig) -> bool {
    let rho = |i: usize| per_head.iter().map(|m| m[i]).fold(0.0, f64::max);
    let left: Vec<usize> = (0..g.pages.len()).filter(|&i| g.pages[i].0.tier != TAIL_TIER && !g.promoted[i]).collect();
    if left.is_empty() {
        return false;
    }
    match g.rung {
        0 => {
            let n = g.promoted.iter().filter(|&&p| p).count().max(1);
            let mut order = left;
            order.sort_by(|&a, &b| rho(b).total_cmp(&rho(a)));
            for &i in order.iter().take(n) {
                g.promoted[i] = true;
            }
            g.rung = 1;
        }
        1 => {
            for &i in &left {
                if rho(i) * g.errors[i].map_or(0.0, |e| e.eta) > cfg.v_tol {
                    g.promoted[i] = true;
                }
            }
            g.rung = 2;
        }
        _ => {
            promote_all(g);
            g.rung = 3;
        }
    }
    true
}

#[allow(clippy::too_many_arguments)]
fn head_certificate(g: &Group, p1: &PhaseOut, p2: &PhaseOut, rho: &[f64], gi: usize, hq: usize, gqa: usize, d: usize) -> HeadCertificate {
    let base = p1.indptr[gi] as usize;
    let (mut alpha, mut delta, mut e_val) = (0f64, 0f64, 0f64);
    let mut tokens = 0usize;
    for (pi, &(p, len)) in g.pages.iter().enumerate() {
        tokens += len;
        let exact = p.tier == TAIL_TIER || g.promoted[pi] || g.explored[pi];
        if exact {
            continue;
        }
        alpha += rho[pi];
        delta = delta.max(p1.delta[(base + pi) * gqa + hq] as f64);
        e_val += rho[pi] * g.errors[pi].map_or(f64::INFINITY, |e| e.eta);
    }
    let row = gi * gqa + hq;
    let o = &p2.out[row * d..(row + 1) * d];
    let out_norm = o.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt();
    let c = certificate(delta, alpha, g.v_max, e_val, out_norm, tokens);
    HeadCertificate {
        delta,
        alpha_tail: alpha,
        v_max: g.v_max,
        e_key: c.e_key,
        e_val: c.e_val,
        e_round: c.e_round,
        bound: c.bound,
        promoted: g.promoted.iter().filter(|&&x| x).count(),
        explored: g.explored.iter().zip(&g.promoted).filter(|(&e, &p)| e && !p).count(),
        rung: g.rung,
        detections: g.detections,
    }
}
