//! The summary geometry ([`ParisConfig`]) and the adaptive retrieval schedule ([`Schedule`]).

use kvforge_spec::codecs::rotated::hadamard;
use kvforge_spec::codecs::rotated::levels::{levels, LevelTable};
use serde::{Deserialize, Serialize};

use crate::error::ParisError;

/// Bits of one direction code: 1 sign + 3 magnitude bits (seed 001 §4.2.2).
pub const CODE_BITS: u32 = 4;

/// Geometry of the per-key summaries of one KV head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParisConfig {
    /// Head dim `D` (a power of two, 16 to 256).
    pub head_dim: usize,
    /// Subspace count `B`; the subspace dim is `m = D / B`, 4 to 8.
    pub subspaces: usize,
    /// Seed of the shared random-sign Hadamard rotation (the rotated tier's `seed`).
    pub seed: u32,
    /// Collision bonus tiers `T` (seed 001 §5.4 "multi-tier collision shaping"): a key's
    /// collision score is in `[0, B · T]`. 1 is plain collision counting.
    pub tiers: u32,
}

impl ParisConfig {
    /// The seed's default geometry at head dim `d`: `m = 8` (256 sign-pattern centroids per
    /// subspace, `B = d / 8`), the rotated tier's default seed, 6 tiers.
    pub fn default_for(head_dim: usize) -> ParisConfig {
        ParisConfig { head_dim, subspaces: head_dim / 8, seed: hadamard::DEFAULT_SEED, tiers: 6 }
    }

    /// Checks the geometry.
    pub fn validate(&self) -> Result<(), ParisError> {
        if !(16..=256).contains(&self.head_dim) || !hadamard::rotatable(self.head_dim) {
            return Err(ParisError::HeadDim(self.head_dim));
        }
        if self.subspaces == 0 || self.head_dim % self.subspaces != 0 || !(4..=8).contains(&(self.head_dim / self.subspaces)) {
            return Err(ParisError::Subspaces { head_dim: self.head_dim, subspaces: self.subspaces });
        }
        if !(1..=15).contains(&self.tiers) {
            return Err(ParisError::Tiers(self.tiers));
        }
        Ok(())
    }

    /// Subspace dim `m`.
    pub fn m(&self) -> usize {
        self.head_dim / self.subspaces
    }

    /// Centroids per subspace, `|Ω| = 2^m` (eq. 5).
    pub fn centroids(&self) -> usize {
        1 << self.m()
    }

    /// Largest collision score, `B · T`.
    pub fn max_score(&self) -> usize {
        self.subspaces * self.tiers as usize
    }

    /// The Prop. 4.1 level table of the direction codes: the Lloyd–Max quantiser of one
    /// coordinate of a uniform unit vector in `R^m` (`u_j² ~ Beta(1/2, (m−1)/2)`, eq. 12),
    /// 16 levels, symmetric, so code `c` is sign `c >> 3` and magnitude `c & 7` mirrored
    /// (`c ≥ 8` positive). Shared with the rotated tier (`levels(m, 4)`).
    pub fn levels(&self) -> &'static LevelTable {
        levels(self.m(), CODE_BITS)
    }

    /// Bytes of one key's GPU-resident summary: `B` centroid ids, `D/2` code bytes, `B` fp16
    /// weights.
    pub fn summary_bytes(&self) -> usize {
        self.subspaces + self.head_dim / 2 + 2 * self.subspaces
    }
}

/// Which per-key summaries the device keeps (docs/paris.md, "GPU bytes per key"). The vote
/// reads the same centroid ids in both (for [`SummaryLayout::Whole64`] they are the codes' sign
/// plane); the encoder and the rerank differ.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SummaryLayout {
    /// The seed's per-subspace summaries ([`crate::Summaries`]): `B` id bytes, `D/2` bytes of
    /// 4-bit codes, `B` fp16 weights, `B + D/2 + 2B` bytes per key (112 at head dim 128). What
    /// [`SummaryLayout::for_config`] picks where Whole64 does not apply.
    Subspace4,
    /// The whole-vector code of [`crate::compact::Layout::whole_eighth`] (one normalisation
    /// per key, `levels(D, 4)` with 8 coordinates on `levels(D, 3)`, one 8-bit log weight per
    /// key on a grid per (sequence, kv head)), `D/2` bytes per key: the `B` id bytes (the
    /// codes' sign plane) and a row of `3D/8` bytes (the magnitude bit stream, then the weight
    /// code; [`crate::compact::WholeRow`]). 64 B at head dim 128, 1/8 of fp16 K+V. Needs
    /// `m = 8` and a head dim that is a multiple of 64. The default: on SmolLM2's keys it keeps
    /// Recall@100 at 0.819 / 0.782 (128K / 1M) with its schedule, and its step time matches the
    /// 112 B layout's (docs/paris.md, "Whole64 on the GPU").
    #[default]
    Whole64,
}

impl SummaryLayout {
    /// Parses `subspace4` / `112` or `whole64` / `whole` / `64` (the CLI and Python spelling).
    pub fn parse(s: &str) -> Option<SummaryLayout> {
        match s {
            "subspace4" | "subspace" | "112" => Some(SummaryLayout::Subspace4),
            "whole64" | "whole" | "64" => Some(SummaryLayout::Whole64),
            _ => None,
        }
    }

    /// The layout for `cfg` when the caller names none: [`SummaryLayout::Whole64`] where it
    /// applies (`m = 8`, head dim a multiple of 64), else [`SummaryLayout::Subspace4`].
    pub fn for_config(cfg: &ParisConfig) -> SummaryLayout {
        if SummaryLayout::Whole64.validate(cfg).is_ok() {
            SummaryLayout::Whole64
        } else {
            SummaryLayout::Subspace4
        }
    }

    /// `subspace4` or `whole64`.
    pub fn name(self) -> &'static str {
        match self {
            SummaryLayout::Subspace4 => "subspace4",
            SummaryLayout::Whole64 => "whole64",
        }
    }

    /// Checks the layout against `cfg` (and `cfg` itself).
    pub fn validate(self, cfg: &ParisConfig) -> Result<(), ParisError> {
        cfg.validate()?;
        if self == SummaryLayout::Whole64 && (cfg.m() != 8 || cfg.head_dim % 64 != 0) {
            return Err(ParisError::Layout(format!(
                "whole64 summaries need subspaces of m = 8 (the ids are the sign plane's bytes) and a head dim that is a multiple of 64; got head_dim {}, m {}",
                cfg.head_dim,
                cfg.m()
            )));
        }
        Ok(())
    }

    /// The rerank codes of [`crate::compact`] this layout stores (`None`: the seed's).
    pub fn compact(self) -> Option<crate::compact::Layout> {
        match self {
            SummaryLayout::Subspace4 => None,
            SummaryLayout::Whole64 => Some(crate::compact::Layout::whole_eighth()),
        }
    }

    /// GPU-resident bytes of one key's summary and kv head.
    pub fn bytes_per_key(self, cfg: &ParisConfig) -> usize {
        match self {
            SummaryLayout::Subspace4 => cfg.summary_bytes(),
            SummaryLayout::Whole64 => cfg.head_dim / 2,
        }
    }

    /// The default schedule of the layout: [`Schedule::default`] for the seed's summaries,
    /// [`Schedule::whole64`] for the whole-vector code.
    pub fn schedule(self) -> Schedule {
        match self {
            SummaryLayout::Subspace4 => Schedule::default(),
            SummaryLayout::Whole64 => Schedule::whole64(),
        }
    }
}

/// One point of the adaptive schedule: from `min_len` retrieval-region keys on, vote with
/// `rho` and keep `beta` of the keys as candidates.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SchedulePoint {
    pub min_len: usize,
    pub rho: f64,
    pub beta: f64,
}

/// Adaptive `(ρ, β)` by length (seed 001 §4.2.2: the required candidate ratio falls as the
/// context grows, §5.4), and the length below which decode attends densely.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// Below this many retrieval-region keys, attend to all of them (seed Table 1 "Full-thres.").
    pub dense_below: usize,
    /// Points by increasing `min_len`; the first must have `min_len` 0.
    pub points: Vec<SchedulePoint>,
    /// Candidates are at least `min_candidates_per_k · k`.
    pub min_candidates_per_k: usize,
}

impl Default for Schedule {
    /// Chosen from the CPU recall study on keys captured from SmolLM2 (`kvforge-lab` example
    /// `paris_recall --qk`, `benches/results/paris-recall-smollm2-*.json`): real keys need
    /// `ρ ≥ 0.2` and `β ≈ 0.10` at 128K to keep Recall@100 above 0.80 (the synthetic keys,
    /// `paris-recall-cpu-*.json`, pass with far less); from 512K keys `β` 0.05 bounds the
    /// rerank's and top-k's share of the step while recall at 1M stays above its 0.75 target
    /// (`ρ` 0.20, `β` 0.05 in the same study's sweep at 1M: 0.82 on RoPE tiling, 0.88 on noise).
    fn default() -> Schedule {
        Schedule {
            dense_below: 2048,
            points: vec![SchedulePoint { min_len: 0, rho: 0.25, beta: 0.10 }, SchedulePoint { min_len: 64 << 10, rho: 0.20, beta: 0.10 }, SchedulePoint { min_len: 512 << 10, rho: 0.20, beta: 0.05 }],
            min_candidates_per_k: 8,
        }
    }
}

impl Schedule {
    /// The default schedule of [`SummaryLayout::Whole64`]: [`Schedule::default`] with `ρ` 0.30
    /// from 64K keys (β unchanged). The CPU study (docs/paris.md, "The 1/8 layouts on
    /// SmolLM2") measured the 64 B whole-vector code at Recall@100 0.793 / 0.741 on SmolLM2
    /// keys at 128K / 1M with `ρ` 0.20, below the 0.80 / 0.75 targets, and 0.819 / 0.782 with
    /// `ρ` 0.30; `ρ` costs nothing on the device (the vote reads every key's ids whatever `ρ`).
    pub fn whole64() -> Schedule {
        let mut s = Schedule::default();
        for p in &mut s.points {
            if p.min_len >= 64 << 10 {
                p.rho = 0.30;
            }
        }
        s
    }
}

/// `(ρ, β, candidates)` for one retrieval: what [`Schedule::plan`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RetrievalPlan {
    pub rho: f64,
    pub beta: f64,
    /// Candidates kept by the vote, `min(n, max(⌈β n⌉, min_candidates_per_k · k))`.
    pub candidates: usize,
    /// Keys retrieved.
    pub k: usize,
    /// Whether `n` is below the dense threshold (then nothing is retrieved).
    pub dense: bool,
}

impl Schedule {
    /// Checks the points.
    pub fn validate(&self) -> Result<(), ParisError> {
        let Some(first) = self.points.first() else {
            return Err(ParisError::Schedule("no points".into()));
        };
        if first.min_len != 0 {
            return Err(ParisError::Schedule(format!("the first point starts at {} keys, not 0", first.min_len)));
        }
        if self.points.windows(2).any(|w| w[1].min_len <= w[0].min_len) {
            return Err(ParisError::Schedule("min_len must increase".into()));
        }
        for p in &self.points {
            check_ratios(p.rho, p.beta)?;
        }
        Ok(())
    }

    /// The plan for `n` retrieval-region keys and top-`k`.
    pub fn plan(&self, n: usize, k: usize) -> RetrievalPlan {
        let p = self.points.iter().rev().find(|p| p.min_len <= n).copied().unwrap_or(SchedulePoint { min_len: 0, rho: 1.0, beta: 1.0 });
        let candidates = ((p.beta * n as f64).ceil() as usize).max(self.min_candidates_per_k * k).min(n);
        RetrievalPlan { rho: p.rho, beta: p.beta, candidates, k: k.min(n), dense: n < self.dense_below }
    }
}

/// Checks `0 < β ≤ ρ ≤ 1`.
pub fn check_ratios(rho: f64, beta: f64) -> Result<(), ParisError> {
    for (name, value) in [("rho", rho), ("beta", beta)] {
        if !(value > 0.0 && value <= 1.0) {
            return Err(ParisError::Ratio { name, value });
        }
    }
    if rho < beta {
        return Err(ParisError::RhoBelowBeta { rho, beta });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_checked() {
        assert!(ParisConfig::default_for(128).validate().is_ok());
        assert!(ParisConfig::default_for(64).validate().is_ok());
        assert_eq!(ParisConfig::default_for(128).summary_bytes(), 16 + 64 + 32);
        assert_eq!(ParisConfig { head_dim: 96, ..ParisConfig::default_for(128) }.validate(), Err(ParisError::HeadDim(96)));
        let c = ParisConfig { subspaces: 8, ..ParisConfig::default_for(128) };
        assert_eq!(c.validate(), Err(ParisError::Subspaces { head_dim: 128, subspaces: 8 }));
        assert_eq!(ParisConfig { tiers: 0, ..ParisConfig::default_for(128) }.validate(), Err(ParisError::Tiers(0)));
        assert!(ParisConfig { subspaces: 32, ..ParisConfig::default_for(128) }.validate().is_ok());
    }

    #[test]
    fn schedule_plans_by_length() {
        let s = Schedule::default();
        s.validate().unwrap();
        assert!(s.plan(1000, 100).dense);
        let p = s.plan(128 << 10, 100);
        assert_eq!((p.rho, p.beta, p.dense), (0.20, 0.10, false));
        assert_eq!(p.candidates, (0.10f64 * (128 << 10) as f64).ceil() as usize);
        let p = s.plan(1 << 20, 100);
        assert_eq!((p.rho, p.beta, p.candidates), (0.20, 0.05, (0.05f64 * (1 << 20) as f64).ceil() as usize));
        assert_eq!(s.plan(5000, 100).candidates, 800);
        let bad = Schedule { points: vec![SchedulePoint { min_len: 0, rho: 0.05, beta: 0.1 }], ..Schedule::default() };
        assert_eq!(bad.validate(), Err(ParisError::RhoBelowBeta { rho: 0.05, beta: 0.1 }));
        assert!(matches!(Schedule { points: vec![], ..Schedule::default() }.validate(), Err(ParisError::Schedule(_))));
    }

    #[test]
    fn layouts_have_their_bytes_and_schedules() {
        for d in [64, 128, 256] {
            let cfg = ParisConfig::default_for(d);
            assert_eq!(SummaryLayout::Whole64.bytes_per_key(&cfg), d / 2);
            assert_eq!(SummaryLayout::Whole64.bytes_per_key(&cfg), SummaryLayout::Whole64.compact().unwrap().bytes_per_key(&cfg));
            assert_eq!(SummaryLayout::Subspace4.bytes_per_key(&cfg), cfg.summary_bytes());
            SummaryLayout::Whole64.validate(&cfg).unwrap();
        }
        assert_eq!(SummaryLayout::Whole64.bytes_per_key(&ParisConfig::default_for(128)), 64);
        assert_eq!(SummaryLayout::default(), SummaryLayout::Whole64);
        assert_eq!(SummaryLayout::for_config(&ParisConfig::default_for(128)), SummaryLayout::Whole64);
        assert_eq!(SummaryLayout::for_config(&ParisConfig::default_for(96)), SummaryLayout::Subspace4);
        assert_eq!(SummaryLayout::for_config(&ParisConfig { subspaces: 32, ..ParisConfig::default_for(128) }), SummaryLayout::Subspace4);
        assert!(matches!(SummaryLayout::Whole64.validate(&ParisConfig::default_for(32)), Err(ParisError::Layout(_))));
        assert!(matches!(SummaryLayout::Whole64.validate(&ParisConfig { subspaces: 32, ..ParisConfig::default_for(128) }), Err(ParisError::Layout(_))));
        SummaryLayout::Subspace4.validate(&ParisConfig { subspaces: 32, ..ParisConfig::default_for(128) }).unwrap();
        for l in [SummaryLayout::Subspace4, SummaryLayout::Whole64] {
            assert_eq!(SummaryLayout::parse(l.name()), Some(l));
        }
        assert_eq!(SummaryLayout::parse("whole3"), None);
        // ρ 0.30 from 64K for the whole-vector code; the seed's schedule unchanged.
        let (w, s) = (SummaryLayout::Whole64.schedule(), SummaryLayout::Subspace4.schedule());
        w.validate().unwrap();
        assert_eq!(s, Schedule::default());
        for (n, rho, beta) in [(5000, 0.25, 0.10), (64 << 10, 0.30, 0.10), (128 << 10, 0.30, 0.10), (1 << 20, 0.30, 0.05)] {
            let p = w.plan(n, 100);
            assert_eq!((p.rho, p.beta), (rho, beta), "{n} keys");
            assert_eq!(p.candidates, s.plan(n, 100).candidates);
        }
        assert_eq!(s.plan(1 << 20, 100).rho, 0.20);
    }
}
