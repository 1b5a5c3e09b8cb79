//! Per-tier distortion ε(tier): the "tier-induced error scale" of seed 000 C.2 and the
//! calibrated table ε(b) of seed 002 §3.1 / App. J.
//!
//! The controllers score page `i` at tier `b` as `D_i(b) = weight_i × ε(b)` (weights:
//! [`Proxy`]). ε is a
//! **proxy**: a normalised mean squared error of the stored keys and values (NMSE, error
//! energy over signal energy), averaged over K and V, with `ε(drop) = 1` (the whole
//! contribution is lost, seed 002: "ε(0) = 1 (eviction)"). It is neither a bound nor a
//! measurement of logit or output error; pass a calibrated table
//! ([`DistortionTable::calibrated`]) measured as seed 000 C.2 prescribes (KL or squared
//! logit error of tiering a bucket of entries, regressed per tier) to replace it.
//!
//! Default per scheme (derivation, so the numbers can be checked):
//! * `int`, b bits, asymmetric min/max quantiser: step Δ = R/(2^b − 1), MSE Δ²/12. For
//!   Gaussian data the per-block range is R ≈ 6σ, so NMSE ≈ 36σ²/(12σ²(2^b − 1)²)
//!   = 3/(2^b − 1)²: 0.333, 0.0133, 4.6e-5 for b = 2, 4, 8 — within 10% of seed 002's
//!   calibrated V-cache table (0.313, 0.0140, 4.9e-5 on LLaMA-3.1-8B).
//! * dense fp16/bf16: relative rounding u = 2^−p (p = 11, 8 significand bits), NMSE u²/3.
//! * spherical (group g, 2^a unit codewords, 8-bit radius): the direction error
//!   E‖u − c(u)‖² = E[2 − 2 cos θ] of the nearest codeword, estimated deterministically on
//!   4096 uniform unit directions against the tier's *own* codebook, plus the radius
//!   quantiser's 3/255². Uniform directions are the worst case for a codebook trained on
//!   real keys, so the proxy is pessimistic for spherical tiers.
//! * mixed per-channel keys: each segment's share of head_dim times its width's NMSE, plus the
//!   dropped share × 1 (uniform channel energy).
//! * drop: 1.
//!
//! The table is made non-decreasing down the ladder (running maximum): a cheaper tier is never
//! assumed to be more accurate, which the monotone (down-only) tiering relies on.

use kvforge_spec::{KeyScheme, Spec, TierId, ValueScheme};

/// ε per tier id (index 0 is the dense tail tier).
#[derive(Clone, Debug, PartialEq)]
pub struct DistortionTable {
    pub eps: Vec<f64>,
    /// Id of the drop tier, if the ladder has one.
    pub drop_tier: Option<TierId>,
}

/// How a page's attention signal weighs its distortion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Proxy {
    /// Seed 000 C.2 and seed 002: `D_i(b) = ω_i ε(b)` with ω_i the page's attention mass.
    Linear,
    /// Like `Linear` for dropping (evicting mass ω loses it coherently: the total-variation
    /// distance of seed 002 Prop. 3.1 is ω), but re-coding is weighted by `Σ_t a_t² / ā`
    /// with `ā = Σ a² / Σ a` over the whole sequence. Quantisation noise of different tokens
    /// is independent, so the output error energy it causes is `Σ_t a_t² ‖δv_t‖²`: a head
    /// that spreads its attention over thousands of tokens averages the noise away, one that
    /// concentrates it on a few tokens does not. The normalisation by ā makes the two
    /// proxies agree when every token has the same mass.
    ///
    /// Pages without per-token masses (the GPU decode kernels report one mass per page) count
    /// as one unit of mass `m_p`: their weight is `m_p² / ā`. Since `Σ_t a_t² ≤ m_p²` this
    /// over-weights pages whose mass is spread over their tokens (by at most the page size), so
    /// it errs towards keeping broad heads precise, but it keeps the property that matters:
    /// quantisation noise on light pages costs quadratically little, so they are coarsened
    /// rather than evicted. Falling back to `Linear` instead evicts the light pages of peaked
    /// heads wholesale (the drop of their pooled background mass is what hurts), and loses to
    /// uniform quantisation at equal bytes on the frontier (`kvforge frontier`).
    #[default]
    Concentration,
}

/// The two weights of one page (see [`Proxy`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Weights {
    /// Weight of dropping (the page's attention mass).
    pub drop: f64,
    /// Weight of re-coding into a live tier.
    pub recode: f64,
}

impl Proxy {
    /// Whether the weights read per-token masses ([`PageInfo::token_mass`]); when not, a view
    /// need not carry them (at 32K tokens × 8 heads the vectors were half of RDKV's view).
    ///
    /// [`PageInfo::token_mass`]: crate::signal::PageInfo::token_mass
    pub fn uses_token_mass(self) -> bool {
        self == Proxy::Concentration
    }

    /// Weights of every page of a view, in view order.
    pub fn weights(self, view: &crate::signal::PageTableView) -> Vec<Weights> {
        let linear = |p: &crate::signal::PageInfo| {
            let w = p.importance().max(0.0);
            Weights { drop: w, recode: w }
        };
        if self == Proxy::Linear {
            return view.iter().map(|(_, p)| linear(p)).collect();
        }
        // Σ a² over a page's units: its tokens when known, else the page as one unit.
        let sq = |p: &crate::signal::PageInfo| match &p.token_mass {
            Some(t) => t.iter().map(|x| x.max(0.0) * x.max(0.0)).sum::<f64>(),
            None => p.mass.max(0.0) * p.mass.max(0.0),
        };
        let (s1, s2) = view.iter().fold((0.0, 0.0), |(a, b), (_, p)| (a + p.importance().max(0.0), b + sq(p)));
        let abar = if s1 > 0.0 { s2 / s1 } else { 0.0 };
        view.iter().map(|(_, p)| if abar > 0.0 { Weights { drop: p.importance().max(0.0), recode: sq(p) / abar } } else { linear(p) }).collect()
    }
}

/// Why a calibrated table was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TableError {
    #[error("the table has {found} entries, spec `{spec}` has {expected} tiers (tail included)")]
    Length { spec: String, found: usize, expected: usize },
    #[error("ε of tier `{tier}` is {value}; it must be finite and ≥ 0")]
    Value { tier: String, value: f64 },
    #[error("ε must not decrease down the ladder: tier `{tier}` has {value} < {prev} of the tier before it")]
    NotMonotone { tier: String, value: f64, prev: f64 },
}

/// Normalised squared error `Σ (x − x̂)² / Σ x²` of a decoded array against its original.
pub fn nmse(original: &[f32], decoded: &[f64]) -> f64 {
    let (mut e, mut s) = (0.0, 0.0);
    for (&x, &y) in original.iter().zip(decoded) {
        let x = f64::from(x);
        e += (x - y) * (x - y);
        s += x * x;
    }
    if s > 0.0 {
        e / s
    } else {
        0.0
    }
}

// The per-scheme proxies live with their codecs (`Codec::nmse` of kvforge-spec's codecs).
pub use kvforge_spec::codecs::dense::dense_nmse;
pub use kvforge_spec::codecs::int::int_nmse;
pub use kvforge_spec::codecs::spherical::spherical_direction_nmse;

pub fn key_nmse(k: &KeyScheme) -> f64 {
    k.codec().nmse()
}

pub fn value_nmse(v: &ValueScheme) -> f64 {
    v.codec().nmse()
}

impl DistortionTable {
    /// The documented proxy: `ε = (ε_K + ε_V) / 2` per tier, made non-decreasing.
    pub fn from_spec(spec: &Spec) -> DistortionTable {
        let raw: Vec<f64> = spec.tiers.iter().map(|t| 0.5 * (key_nmse(&t.key) + value_nmse(&t.value))).collect();
        DistortionTable { eps: monotone(raw), drop_tier: drop_tier(spec) }
    }

    /// A caller-measured table (one ε per tier id, tail first), validated: finite, ≥ 0 and
    /// non-decreasing down the ladder.
    pub fn calibrated(spec: &Spec, eps: Vec<f64>) -> Result<DistortionTable, TableError> {
        if eps.len() != spec.tiers.len() {
            return Err(TableError::Length { spec: spec.name.clone(), found: eps.len(), expected: spec.tiers.len() });
        }
        for (t, &e) in spec.tiers.iter().zip(&eps) {
            if !(e.is_finite() && e >= 0.0) {
                return Err(TableError::Value { tier: t.name.clone(), value: e });
            }
        }
        for w in 2..eps.len() {
            if eps[w] < eps[w - 1] {
                return Err(TableError::NotMonotone { tier: spec.tiers[w].name.clone(), value: eps[w], prev: eps[w - 1] });
            }
        }
        Ok(DistortionTable { eps, drop_tier: drop_tier(spec) })
    }

    /// A table from measured NMSE of keys and values per tier (seed 000 C.2's calibration:
    /// code sample pages in every tier, compare with the originals; see [`nmse`]). The tail
    /// tier's entries are used as given, the drop tier gets 1; the ladder is made
    /// non-decreasing like the default.
    pub fn from_nmse(spec: &Spec, k: &[f64], v: &[f64]) -> Result<DistortionTable, TableError> {
        let n = spec.tiers.len();
        if k.len() != n || v.len() != n {
            return Err(TableError::Length { spec: spec.name.clone(), found: k.len().min(v.len()), expected: n });
        }
        let raw: Vec<f64> = spec.tiers.iter().map(|t| if t.is_drop() { 1.0 } else { 0.5 * (k[t.id as usize] + v[t.id as usize]) }).collect();
        for (t, &e) in spec.tiers.iter().zip(&raw) {
            if !(e.is_finite() && e >= 0.0) {
                return Err(TableError::Value { tier: t.name.clone(), value: e });
            }
        }
        Ok(DistortionTable { eps: monotone(raw), drop_tier: drop_tier(spec) })
    }

    pub fn get(&self, tier: TierId) -> f64 {
        self.eps[tier as usize]
    }

    /// `D_i(b)` of a page with weights `w`: `recode · ε(b)` for live tiers and
    /// `max(drop · ε(drop), recode · ε(last live tier))` for the drop tier, so a page's
    /// distortion never decreases down the ladder (dropping loses at least what the cheapest
    /// live tier loses).
    pub fn page(&self, w: Weights, tier: TierId) -> f64 {
        self.pages().page(w, tier)
    }

    /// [`page`](Self::page) with the table's fields copied out, for loops over every page.
    pub fn pages(&self) -> PageDistortion<'_> {
        let last_live = self.eps.len().saturating_sub(2);
        PageDistortion { eps: &self.eps, drop_tier: self.drop_tier, last_live_eps: self.eps.get(last_live).copied().unwrap_or(f64::NAN) }
    }
}

/// [`DistortionTable::page`] by value: a loop that also writes vectors (the hulls) would read
/// the table's fields again through the reference on every call, as far as the compiler knows
/// the writes may change them; copied into the loop they stay in registers.
#[derive(Clone, Copy, Debug)]
pub struct PageDistortion<'a> {
    eps: &'a [f64],
    drop_tier: Option<TierId>,
    /// ε of the last live tier (what dropping loses at least).
    last_live_eps: f64,
}

impl PageDistortion<'_> {
    /// `D_i(b)` of a page with weights `w` (see [`DistortionTable::page`]).
    #[inline]
    pub fn page(self, w: Weights, tier: TierId) -> f64 {
        if Some(tier) != self.drop_tier {
            return w.recode * self.eps[tier as usize];
        }
        (w.drop * self.eps[tier as usize]).max(w.recode * self.last_live_eps)
    }
}

pub(crate) fn drop_tier(spec: &Spec) -> Option<TierId> {
    spec.tiers.iter().find(|t| t.is_drop()).map(|t| t.id)
}

/// Running maximum over the ladder (the tail, tier 0, is left alone).
fn monotone(mut eps: Vec<f64>) -> Vec<f64> {
    for i in 2..eps.len() {
        eps[i] = eps[i].max(eps[i - 1]);
    }
    eps
}
