//! Certified decode (seed 004) on the GPU, at block granularity: every output comes with a
//! per-query-head bound on ‖O − O_exact‖₂, or is exact.
//!
//! One step: **phase 1** decodes the quantised pages and records, per block and query head,
//! the log-mass ℓ and the key logit bound Δ (the decode kernel writes both as by-products).
//! The **selector** ([`select`]) promotes, per kv head, the blocks of largest mass until every
//! query head's exact-key coverage reaches τ_cov, plus a small random **exploration** sample of
//! the rest. **Phase 2** decodes again with promoted blocks served from their fp16 originals
//! (tier 2, pinned host memory: [`Originals`]), recording each block's achieved mass ρ. Then,
//! per query head ([`checks`]): every promoted or explored block is a **score check** (its exact
//! log-mass must lie within Δ + ε_guard of its quantised one, or the kv head is escalated as
//! faulty); the **ranking-consistency** and **boundary** checks (seed 004 eqs. 17–18) compare
//! the exact and quantised page rankings; the **certificate** is computed from what phase 2
//! achieved ([`bound`]). The **ladder** escalates: a fault or a failed ranking/boundary check
//! sends the kv head to rung 3 (exact from tier 2); a bound above the target climbs rung 1
//! (double the promoted blocks), rung 2 (promote blocks whose value error ρ·η exceeds v_tol),
//! rung 3; rung 4 recomputes the whole layer when too many kv heads reached rung 3.
//!
//! Two paths run this procedure ([`CertPath`]): the **device path** (default) runs phase 1,
//! the selector, phase 2 and the certificate back to back on the GPU and downloads only the
//! output and the per-head certificates (`device.rs`); the **host path** runs the selector and
//! the certificate on the host between launches (`ladder.rs`). The host functions are the
//! reference: the device selector picks the same blocks bit for bit, the device certificate
//! agrees with the f64 host one to rounding ([`KvCache::certified_crosscheck`]).
//!
//! Everything the procedure ranks, promotes and sums is per 16-token **block** ([`CERT_BLOCK`],
//! seed 004's B; a page of 64 tokens holds 4): phase 1 records ℓ_b and Δ_b per block, the
//! selector promotes blocks, phase 2 records ρ_b per block. Phase 2's page table serves a page
//! whose every block is promoted as a tail-format page at its original (staged like any page);
//! a page promoted in part keeps its quantised entry with a mask of promoted blocks, whose fp16
//! keys and values the decode reads from the original in place.

mod bound;
pub mod checks;
mod device;
mod ladder;
mod originals;
pub mod select;
mod values;

pub use bound::{certificate, total_variation, Certificate};
pub(crate) use device::CertScratch;
pub use device::CrossCheck;
pub use originals::{Originals, PageErrors, PageIn, MAX_BLOCKS_PER_PAGE};

/// Tokens of a certification block: the unit of Δ_b, η_b, the attention masses the selector
/// ranks, promotion and the certificate's sums (seed 004's B); the kernels' number
/// (kvforge-gen params.rs).
pub const CERT_BLOCK: usize = crate::params::CERT_BLOCK;

use kvforge_spec::TAIL_TIER;

use crate::cache::KvCache;
use crate::decode::{from_bits, to_bits};
use crate::error::{Result, RtError};
use crate::pool::PageRef;
use ladder::Group;
use select::{group_seed, SelectParams};

/// Certified decode's state on a cache, one field of [`KvCache`] rather than three: tier 2
/// (the originals) once kept, and the device buffers its steps reuse. Empty until
/// [`KvCache::keep_originals`]; the plain decode never reads it.
#[derive(Default)]
pub(crate) struct CertifiedState {
    /// Tier 2 of certified decode, when kept ([`KvCache::keep_originals`]).
    originals: Option<Originals>,
    /// Device buffers of certified steps on the device path, reused while steps fit.
    scratch: Option<CertScratch>,
    /// [`PageIn::Copy`]: device copies of the originals a launch serves, kept and grown
    /// across steps.
    page_in: Option<cudarc::driver::CudaSlice<u8>>,
}

impl CertifiedState {
    /// Whether tier 2 is kept: appends then record the originals of the pages they encode.
    pub(crate) fn keeps_originals(&self) -> bool {
        self.originals.is_some()
    }
}

/// Where the selector and the certificate run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum CertPath {
    /// On the GPU, fused between the two decodes: no host round trip until the certificates
    /// are down. Needs [`PageIn::Uva`] (the device addresses the originals itself); with
    /// [`PageIn::Copy`] the host path serves the step. Rungs 1–2 continue on the host.
    Gpu,
    /// On the host between launches (the reference, and the comparison point of the bench).
    Host,
}

/// Thresholds of the selector and the ladder (defaults from seed 004 where it gives them).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CertConfig {
    /// τ_cov: exact-key coverage of every query head's estimated mass.
    pub coverage: f64,
    /// K_min / K_max: promoted blocks per (sequence, kv head) before the ladder (unbounded by
    /// default: seed 004's uncapped top-K; its operating point caps at 128).
    pub min_blocks: usize,
    pub max_blocks: usize,
    /// Fraction of the quantised blocks also served exactly at random (at most the unpromoted
    /// ones; at least one while any is left) and score-checked.
    pub explore: f64,
    /// ε_guard of the score check, natural-log units.
    pub guard: f64,
    /// Target: a head whose bound exceeds this (absolute ‖·‖₂) climbs the ladder.
    pub max_error: f64,
    /// Rung 2: promote blocks whose value-error share ρ·η exceeds this.
    pub v_tol: f64,
    /// Rung 4: fall back to exact for the whole layer when this fraction of kv heads is at rung 3
    /// (above 1: never).
    pub layer_fallback: f64,
    pub page_in: PageIn,
    /// r of the ranking-consistency and boundary checks (seed 004: 1); 0 skips both.
    pub rank_depth: usize,
    /// A failed ranking or boundary check sends the kv head to rung 3 (seed 004); `false`
    /// only reports it in [`HeadCertificate`] (the bound does not depend on the ranking).
    pub rank_escalate: bool,
    pub path: CertPath,
    /// Device path: time phase 1, selector, phase 2 and certificate with CUDA events
    /// ([`CertifiedOutput::kernel_us`]).
    pub profile: bool,
    /// Seed of the exploration sample (advanced every step).
    pub seed: u64,
}

impl Default for CertConfig {
    fn default() -> Self {
        CertConfig {
            coverage: 0.995,
            min_blocks: 1,
            max_blocks: usize::MAX,
            explore: 0.02,
            guard: 1e-3,
            max_error: 0.05,
            v_tol: 0.01,
            layer_fallback: 0.5,
            page_in: PageIn::Uva,
            rank_depth: 1,
            rank_escalate: true,
            path: CertPath::Gpu,
            profile: false,
            seed: 0x5eed,
        }
    }
}

impl CertConfig {
    /// Rejects settings the selector or the ladder cannot honour.
    pub fn validate(&self) -> Result<()> {
        let unit = |x: f64| (0.0..=1.0).contains(&x);
        let bad = |m: &str| Err(RtError::BadInput(format!("certified decode: {m}")));
        if !unit(self.coverage) || !unit(self.explore) {
            return bad("coverage and explore must be in [0, 1]");
        }
        if !(self.layer_fallback >= 0.0) {
            return bad("layer_fallback must be >= 0 (above 1: never)");
        }
        if self.min_blocks > self.max_blocks {
            return bad("min_blocks must not exceed max_blocks");
        }
        if !(self.guard >= 0.0 && self.v_tol >= 0.0) || self.max_error.is_nan() {
            return bad("guard and v_tol must be >= 0 and max_error a number");
        }
        Ok(())
    }

    /// The path a step takes: the device path needs UVA page-in.
    pub fn effective_path(&self) -> CertPath {
        match (self.path, self.page_in) {
            (CertPath::Gpu, PageIn::Uva) => CertPath::Gpu,
            _ => CertPath::Host,
        }
    }
}

/// Telemetry and certificate of one query head in one step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct HeadCertificate {
    /// Largest key logit error Δ over the blocks left quantised (natural log).
    pub delta: f64,
    /// Achieved attention mass on blocks left quantised.
    pub alpha_tail: f64,
    pub v_max: f64,
    pub e_key: f64,
    pub e_val: f64,
    /// fp16 output rounding and fp32 arithmetic.
    pub e_round: f64,
    /// e_key + e_val + e_round: the certified bound on ‖O − O_exact‖₂.
    pub bound: f64,
    /// Blocks of this head's kv head served from fp16 originals by the selector or the ladder
    /// (explored ones excluded).
    pub promoted: usize,
    /// Blocks served from fp16 originals as the exploration sample.
    pub explored: usize,
    /// 0: none; 1: K* doubled; 2: values promoted; 3: exact kv head; 4: exact layer.
    pub rung: u8,
    /// Score checks that failed for this head's kv head (a fault was detected).
    pub detections: usize,
    /// Top-r exact and quantised page rankings disagreed (eq. 17) in the last phase 2.
    pub ranking: bool,
    /// Quantised tail blocks whose upper-bounded exact mass could enter the top r (eq. 18).
    pub boundary: usize,
}

/// Device time of the stages of a device-path step's first round (CUDA events), µs.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct KernelTimes {
    pub phase1_us: f64,
    pub select_us: f64,
    pub phase2_us: f64,
    /// The certificate kernel: E_key, E_val, E_round and the score, ranking and boundary checks.
    pub bound_us: f64,
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
    /// Whether the host built page tables and certificates (host path, or rungs 1–2).
    pub host_ladder: bool,
    /// Device path with [`CertConfig::profile`]: stage times of the first round.
    pub kernel_us: Option<KernelTimes>,
}

/// The typed error for certified decode of a spec built without its entry points
/// (`kernels.certified`), before any launch or at one.
pub(crate) fn uncertified_spec(spec: &kvforge_spec::Spec) -> RtError {
    RtError::NotInSpec { spec: spec.name.clone(), what: "certified decode".into(), fix: format!("set `certified = true` under [kernels] in {} and regenerate", spec.path) }
}

impl KvCache {
    /// Keeps the fp16 original of every page encoded from now on in pinned host memory
    /// (tier 2 of certified decode). Call before appending; fails with a typed error if the
    /// pinned slab cannot be allocated.
    pub fn keep_originals(&mut self) -> Result<()> {
        if !self.cfg.window.is_off() {
            // The certificate bounds the values of dense pages by the tail page's alone: a
            // window's dense full pages would be left out of it.
            return Err(RtError::WrongState { what: "keep_originals on a cache with a window policy".into(), fix: "certify a cache without one (CacheConfig::window(0, 0, _))".into() });
        }
        if self.store.pool().used_pages(self.cfg.target_tier) > 0 {
            return Err(RtError::WrongState { what: "keep_originals".into(), fix: "call it before any page is encoded".into() });
        }
        let tokens = self.spec.page.tokens;
        if !tokens.is_multiple_of(CERT_BLOCK) || tokens / CERT_BLOCK > MAX_BLOCKS_PER_PAGE {
            return Err(RtError::BadInput(format!("certified decode promotes {CERT_BLOCK}-token blocks, at most {MAX_BLOCKS_PER_PAGE} per page: spec `{}` has {tokens}-token pages", self.spec.name)));
        }
        let seg = self.spec.segment(TAIL_TIER, self.cfg.head_dim);
        let bytes = kvforge_spec::HEADER_BYTES + seg.bytes;
        self.cert.originals = Some(Originals::new(self.engine.dev().stream.context(), self.store.pool().capacity(self.cfg.target_tier), bytes)?);
        Ok(())
    }

    pub fn originals(&self) -> Option<&Originals> {
        self.cert.originals.as_ref()
    }

    /// Fault injection and eviction: forget a page's original.
    pub fn forget_original(&mut self, page: &PageRef) {
        if let Some(o) = &mut self.cert.originals {
            o.forget(page);
        }
    }

    /// Blocks per page of this cache's spec (`keep_originals` checks they divide the page).
    pub(crate) fn cert_blocks_per_page(&self) -> usize {
        self.spec.page.tokens / CERT_BLOCK
    }

    /// Bytes of a served block's fp16 (bf16) keys and values, as `paged_in_bytes` counts them.
    pub(crate) fn cert_block_bytes(&self) -> usize {
        CERT_BLOCK * 2 * self.cfg.head_dim * 2
    }

    /// Records the originals of freshly encoded pages with their value error η (measured
    /// against the encoded page, decoded by the reference) and largest value norm.
    pub(crate) fn record_originals(&mut self, full: &[(usize, Vec<u8>)], encoded: &[PageRef]) -> Result<()> {
        let d = self.cfg.head_dim;
        let target = self.cfg.target_tier;
        for ((_, orig), page) in full.iter().zip(encoded) {
            let enc = self.download_page(*page)?;
            let exact = values::page_values(&self.spec, TAIL_TIER, d, orig).map_err(|e| RtError::BadInput(format!("tier-2 original: {e}")))?;
            let quant = values::page_values(&self.spec, target, d, &enc).map_err(|e| RtError::BadInput(format!("encoded page: {e}")))?;
            let mut errors = PageErrors::uniform(0.0, 0.0);
            for t in 0..exact.len() / d {
                let r = t * d..(t + 1) * d;
                let e: f64 = exact[r.clone()].iter().zip(&quant[r.clone()]).map(|(a, b)| (a - b) * (a - b)).sum();
                let n: f64 = exact[r].iter().map(|a| a * a).sum();
                let b = &mut errors.eta[t / CERT_BLOCK];
                *b = b.max(e.sqrt());
                errors.v_max = errors.v_max.max(n.sqrt());
            }
            let pb = self.cert.originals.as_ref().map_or(0, |o| o.page_bytes());
            self.cert.originals.as_mut().unwrap().record(*page, &orig[..pb.min(orig.len())], errors)?;
        }
        Ok(())
    }

    /// One certified decode step for `seqs` (one query token each, `q` as in [`KvCache::decode`]).
    pub fn decode_certified(&mut self, seqs: &[usize], q: &[f32], cfg: &mut CertConfig) -> Result<CertifiedOutput> {
        cfg.validate()?;
        if !self.spec.kernels.certified {
            return Err(uncertified_spec(&self.spec));
        }
        let (mut groups, qh) = self.cert_groups(seqs, q)?;
        let step_seed = cfg.seed;
        cfg.seed = cfg.seed.wrapping_add(1);
        let cfg = &CertConfig { seed: step_seed, ..cfg.clone() };
        match cfg.effective_path() {
            CertPath::Gpu => self.device_step(&mut groups, &qh, cfg),
            CertPath::Host => self.host_step(&mut groups, &qh, cfg),
        }
    }

    /// The step's groups (sequence-major, then kv head) with their tier-2 annotations, and the
    /// queries in the spec dtype. A missing original is a typed error before any launch.
    fn cert_groups(&self, seqs: &[usize], q: &[f32]) -> Result<(Vec<Group>, Vec<u16>)> {
        let Some(orig) = self.cert.originals.as_ref() else {
            return Err(RtError::WrongState { what: "certified decode needs tier 2".into(), fix: "call keep_originals() before appending".into() });
        };
        let (hkv, gqa, d) = (self.cfg.num_kv_heads, self.cfg.gqa, self.cfg.head_dim);
        let rows = seqs.len() * hkv * gqa;
        if seqs.is_empty() || q.len() != rows * d {
            return Err(RtError::ShapeMismatch { what: "query".into(), expected: format!("{} sequences (at least 1) × {} q heads × {d} values", seqs.len(), hkv * gqa), got: format!("{} values", q.len()) });
        }
        let mut groups = Vec::with_capacity(seqs.len() * hkv);
        for &s in seqs {
            for h in 0..hkv {
                let pages = self.pages(s, h)?;
                if pages.is_empty() {
                    return Err(RtError::EmptySequence(s));
                }
                let mut errors = Vec::with_capacity(pages.len());
                let mut v_max = 0f64;
                for (p, _) in &pages {
                    if p.tier == TAIL_TIER {
                        errors.push(None);
                    } else {
                        let e = orig.errors(p)?;
                        v_max = v_max.max(e.v_max);
                        errors.push(Some(e));
                    }
                }
                v_max = v_max.max(self.tail_v_max(s, h)?);
                groups.push(Group::new(pages, errors, v_max, self.cert_blocks_per_page()));
            }
        }
        let dtype = self.spec.geometry.dtype;
        Ok((groups, q.iter().map(|&x| to_bits(dtype, x)).collect()))
    }

    /// A certified step on the host path: every page table built and every certificate
    /// computed on the host between launches.
    fn host_step(&mut self, groups: &mut [Group], qh: &[u16], cfg: &CertConfig) -> Result<CertifiedOutput> {
        let gqa = self.cfg.gqa;
        let p1 = self.certified_launch(groups, qh, cfg.page_in, &mut 0, true)?;
        for (gi, g) in groups.iter_mut().enumerate() {
            let sp = SelectParams { coverage: cfg.coverage, min_blocks: cfg.min_blocks, max_blocks: cfg.max_blocks, explore: cfg.explore, seed: group_seed(cfg.seed, gi) };
            g.select(p1.rows(&p1.head_lse, gi, gqa), gqa, &sp);
        }
        let (mut launches, mut paged) = (0, 0);
        let (p2, heads) = self.host_ladder(groups, &p1, qh, cfg, None, &mut launches, &mut paged)?;
        Ok(CertifiedOutput { out: p2.out, lse: p2.lse, heads, launches, paged_in_bytes: paged, host_ladder: true, kernel_us: None })
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation_and_path() {
        let ok = CertConfig::default();
        assert!(ok.validate().is_ok());
        // A layer threshold above 1 disables rung 4 (the GPU tests use 1.1).
        assert!(CertConfig { layer_fallback: 1.1, ..CertConfig::default() }.validate().is_ok());
        for bad in [
            CertConfig { coverage: 1.5, ..CertConfig::default() },
            CertConfig { explore: -0.1, ..CertConfig::default() },
            CertConfig { layer_fallback: f64::NAN, ..CertConfig::default() },
            CertConfig { min_blocks: 3, max_blocks: 2, ..CertConfig::default() },
            CertConfig { guard: -1.0, ..CertConfig::default() },
            CertConfig { max_error: f64::NAN, ..CertConfig::default() },
        ] {
            assert!(matches!(bad.validate(), Err(RtError::BadInput(_))), "{bad:?}");
        }
        assert_eq!(ok.effective_path(), CertPath::Gpu);
        assert_eq!(CertConfig { page_in: PageIn::Copy, ..CertConfig::default() }.effective_path(), CertPath::Host);
        assert_eq!(CertConfig { path: CertPath::Host, ..CertConfig::default() }.effective_path(), CertPath::Host);
    }
}
