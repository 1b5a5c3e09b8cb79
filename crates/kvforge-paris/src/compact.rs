//! Rerank summaries of 1/8 of fp16 K+V (`D/2` bytes per key and kv head: 64 B at head dim
//! 128, 32 B at 64), f64 reference of a study (docs/paris.md, "GPU bytes per key"): the runtime
//! and [`Summaries`] keep the committed 4-bit codes and fp16 weights; nothing here changes them.
//!
//! Both [`Layout`]s keep the committed vote: the centroid id of subspace `b` is the sign
//! pattern of `k̃_b` (`k̃ = R k/‖k‖`), which is the sign plane of the codes below (every level
//! table is symmetric with its middle threshold exactly 0, so code `c ≥ E/2` iff `k̃_j > 0`,
//! `E` the table's levels). The vote therefore reads [`Summaries::ids`] and
//! [`Summaries::hist`] as before, and the ids cost no bytes beyond the codes' sign bits.
//!
//! - [`Layout::Subspace3`]: per subspace as [`crate::summarize_key`], but 3-bit codes on
//!   `levels(m, 3)` (sign + 2-bit magnitude) and 8-bit log weights `w_b = ‖k‖ r_b / α_b` on a
//!   grid of 1/16 octave. Bytes: `D/8` sign plane + `D/4` magnitudes + `B` weights (`D/2` at
//!   `m = 8`).
//! - [`Layout::Whole`] (the TurboQuant way: one normalisation per key): every coordinate of the
//!   rotated unit key `k̃ ∈ R^D` on `levels(D, 4)` (sign + 3-bit magnitude), except `low`
//!   evenly spaced coordinates (`j mod (D/low) = D/low − 1`) on `levels(D, 3)` (sign + 2-bit
//!   magnitude), and one weight per key `w = ‖k‖ / α`, `α = Σ_j ℓ_{c_j} k̃_j` (f64), 8-bit log
//!   on a grid of 1/32 octave. Bytes: `⌈(4D − low) / 8⌉ + 1`, i.e. `D/2` at `low = 8`
//!   ([`Layout::whole_eighth`]) for every `D`; `low = 0` is the 4-bit whole-vector code, one
//!   byte over.
//!
//! **Estimate** (eq. 10 with weight groups): `ŝ_i = ‖q‖ Σ_g w_ig Σ_{j ∈ g} ℓ_{c_ij} q̃_j`, the
//! groups being the `B` subspaces or the whole key. A key scored against its own direction
//! gives `‖q‖ ‖k‖` up to the weight grid (the `α` correction), as the committed layout does.
//!
//! **Weights** ([`LogGrid`]): code 0 is weight 0 (a zero key or `α ≤ 0`); code `c` in 1..=255
//! is `2^((base + c) / steps)`. [`LogGrid::fit`] puts the largest weight of a kv head on the
//! top code, so the grid spans `255 / steps` octaves below it (16 octaves per subspace, about
//! 8 per key); smaller weights clamp to code 1. `base` is one number per kv head.
//!
//! Codes are kept unpacked here (`[n][D]` level indices), weights as grid codes; the bytes
//! counted are those of the packed planes ([`Layout::bytes_per_key`]).
//!
//! **On the device** ([`crate::SummaryLayout::Whole64`], [`Layout::whole_eighth`] only): the
//! ids `[n][B]` (`m = 8`) are the sign plane, and each key has a row of `3D/8` bytes
//! ([`WholeRow`]): the magnitudes as one little-endian bit stream in coordinate order (3 bits,
//! 2 for the 8 low coordinates; coordinate `j` at bit `3j − ⌊j/(D/8)⌋`), `3D − 8` bits, then
//! the weight code in the last byte. A magnitude is the code's distance from the middle of its
//! table: `c − E/2` for a positive code, `E/2 − 1 − c` otherwise. The weight grid is one per
//! (sequence, kv head), fixed by the first append holding a key of positive weight for that kv
//! head (the prefill; [`LogGrid::fit`] over its keys' weights; earlier keys all code weight 0)
//! so that a streaming encoder codes later keys without revisiting earlier ones:
//! later keys past the prefill's largest weight clamp to code 255
//! ([`CompactSummaries::on_grid`] is the reference of that encoder).

use kvforge_spec::codecs::rotated::hadamard;
use kvforge_spec::codecs::rotated::levels::{levels, LevelTable};
use serde::{Deserialize, Serialize};

use crate::config::ParisConfig;
use crate::error::ParisError;
use crate::retrieval::Query;

/// A rerank layout of `D/2` bytes per key (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Layout {
    /// Per-subspace normalisation, 3-bit codes, 8-bit log weights per subspace.
    Subspace3,
    /// Whole-vector normalisation, 4-bit codes with `low` coordinates on 3 bits, one 8-bit
    /// log weight per key.
    Whole { low: usize },
}

impl Layout {
    /// The whole-vector layout of exactly `D/2` bytes: 8 coordinates on 3-bit codes make room
    /// for the weight's byte.
    pub fn whole_eighth() -> Layout {
        Layout::Whole { low: 8 }
    }

    /// Checks the layout against `cfg` (and `cfg` itself).
    pub fn validate(&self, cfg: &ParisConfig) -> Result<(), ParisError> {
        cfg.validate()?;
        if let Layout::Whole { low } = *self {
            if low > cfg.head_dim || (low > 0 && cfg.head_dim % low != 0) {
                return Err(ParisError::Layout(format!("{low} whole-vector 3-bit coordinates: 0 or a divisor of head_dim {}", cfg.head_dim)));
            }
        }
        Ok(())
    }

    /// Weight groups per key: `B` or 1.
    pub fn groups(&self, cfg: &ParisConfig) -> usize {
        match self {
            Layout::Subspace3 => cfg.subspaces,
            Layout::Whole { .. } => 1,
        }
    }

    /// Log-grid steps per octave of the weights.
    pub fn steps(&self) -> u32 {
        match self {
            Layout::Subspace3 => 16,
            Layout::Whole { .. } => 32,
        }
    }

    /// Whether coordinate `j` is on a 3-bit code (always for [`Layout::Subspace3`]).
    pub fn is_low(&self, cfg: &ParisConfig, j: usize) -> bool {
        match *self {
            Layout::Subspace3 => true,
            Layout::Whole { low } => low > 0 && j % (cfg.head_dim / low) == cfg.head_dim / low - 1,
        }
    }

    /// The level table of coordinate `j`.
    pub fn table(&self, cfg: &ParisConfig, j: usize) -> &'static LevelTable {
        let dim = match self {
            Layout::Subspace3 => cfg.m(),
            Layout::Whole { .. } => cfg.head_dim,
        };
        levels(dim, if self.is_low(cfg, j) { 3 } else { 4 })
    }

    /// GPU bytes per key of the packed planes: sign plane (the ids), magnitudes, 8-bit weights.
    pub fn bytes_per_key(&self, cfg: &ParisConfig) -> usize {
        let d = cfg.head_dim;
        let code_bits: usize = (0..d).map(|j| if self.is_low(cfg, j) { 3 } else { 4 }).sum();
        code_bits.div_ceil(8) + self.groups(cfg)
    }

    /// A short name: `subspace3` or `whole-low{low}`.
    pub fn name(&self) -> String {
        match self {
            Layout::Subspace3 => "subspace3".into(),
            Layout::Whole { low } => format!("whole-low{low}"),
        }
    }
}

/// One key's codes `[D]` (level indices) and unquantised weights `[groups]`.
#[derive(Clone, Debug, PartialEq)]
pub struct CompactKey {
    pub codes: Vec<u8>,
    pub weights: Vec<f64>,
}

/// Codes of `x` (`[D]`, finite) under `layout` (module docs). A zero key codes the middle
/// level `E/2` everywhere (sign bit set, as [`crate::summarize_key`]) with weight 0.
pub fn compact_key(cfg: &ParisConfig, layout: Layout, x: &[f32]) -> CompactKey {
    let d = cfg.head_dim;
    let tables: Vec<&LevelTable> = (0..d).map(|j| layout.table(cfg, j)).collect();
    let groups = layout.groups(cfg);
    let mut out = CompactKey { codes: tables.iter().map(|t| (t.levels_f32.len() / 2) as u8).collect(), weights: vec![0.0; groups] };
    let norm = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt() as f32;
    let inv = 1.0f32 / norm;
    if norm == 0.0 || !inv.is_finite() {
        return out;
    }
    let mut kt: Vec<f32> = x.iter().map(|&v| v * inv).collect();
    hadamard::rotate(cfg.seed, &mut kt);
    let width = d / groups;
    for g in 0..groups {
        let sub = &kt[g * width..(g + 1) * width];
        // Per subspace: r_b and u_b = k̃_b / r_b; whole: k̃ is already a unit vector.
        let r = if groups == 1 { 1.0f32 } else { sub.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt() as f32 };
        let rinv = 1.0f32 / r;
        if r == 0.0 || !rinv.is_finite() {
            continue;
        }
        let mut alpha = 0f64;
        for (jj, &v) in sub.iter().enumerate() {
            let (j, u) = (g * width + jj, if groups == 1 { v } else { v * rinv });
            let t = tables[j];
            let c = t.thresholds_f32.iter().filter(|&&th| u > th).count();
            out.codes[j] = c as u8;
            alpha += f64::from(t.levels_f32[c]) * f64::from(u);
        }
        out.weights[g] = if alpha > 0.0 { f64::from(norm) * f64::from(r) / alpha } else { 0.0 };
    }
    out
}

/// The 8-bit log grid of the weights (module docs, "Weights").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogGrid {
    /// Steps per octave.
    pub steps: u32,
    /// Code `c ≥ 1` is `2^((base + c) / steps)`.
    pub base: i32,
}

impl LogGrid {
    /// The grid whose top code (255) is the largest positive finite weight of `weights` (base
    /// −128 when there is none).
    pub fn fit(steps: u32, weights: impl IntoIterator<Item = f64>) -> LogGrid {
        let top = weights.into_iter().filter(|w| *w > 0.0 && w.is_finite()).map(|w| (f64::from(steps) * w.log2()).round() as i32).max();
        LogGrid { steps, base: top.map_or(-128, |t| t - 255) }
    }

    /// The code of `w`: 0 for `w ≤ 0` (or not finite), else the nearest grid point clamped to
    /// 1..=255.
    pub fn code(&self, w: f64) -> u8 {
        if !(w > 0.0 && w.is_finite()) {
            return 0;
        }
        ((f64::from(self.steps) * w.log2()).round() as i64 - i64::from(self.base)).clamp(1, 255) as u8
    }

    /// The weight of code `c`.
    pub fn value(&self, c: u8) -> f64 {
        if c == 0 {
            0.0
        } else {
            (2f64).powf(f64::from(self.base + i32::from(c)) / f64::from(self.steps))
        }
    }
}

/// Unquantised compact codes of a run of keys (chunks of one kv head can be encoded apart and
/// [`CompactKeys::extend`]ed, then quantised on one grid by [`CompactSummaries::from_keys`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CompactKeys {
    pub config: ParisConfig,
    pub layout: Layout,
    pub n: usize,
    /// `[n][D]` level indices.
    pub codes: Vec<u8>,
    /// `[n][groups]` weights before the log grid (f64).
    pub weights: Vec<f64>,
}

impl CompactKeys {
    /// Codes of `[n][D]` finite keys.
    pub fn encode(config: ParisConfig, layout: Layout, keys: &[f32]) -> Result<CompactKeys, ParisError> {
        layout.validate(&config)?;
        let d = config.head_dim;
        if keys.len() % d != 0 {
            return Err(ParisError::Length { what: "keys", got: keys.len(), want: keys.len().next_multiple_of(d) });
        }
        if let Some(row) = keys.chunks_exact(d).position(|r| r.iter().any(|v| !v.is_finite())) {
            return Err(ParisError::NonFinite { what: "key", row });
        }
        let mut out = CompactKeys { config, layout, n: 0, codes: Vec::with_capacity(keys.len()), weights: Vec::with_capacity(keys.len() / d * layout.groups(&config)) };
        for row in keys.chunks_exact(d) {
            let k = compact_key(&config, layout, row);
            out.codes.extend_from_slice(&k.codes);
            out.weights.extend_from_slice(&k.weights);
            out.n += 1;
        }
        Ok(out)
    }

    /// Appends `other` (same config and layout).
    pub fn extend(&mut self, other: CompactKeys) -> Result<(), ParisError> {
        if other.config != self.config || other.layout != self.layout {
            return Err(ParisError::Layout(format!("joining {:?} codes to {:?} codes (or another config)", other.layout, self.layout)));
        }
        self.codes.extend(other.codes);
        self.weights.extend(other.weights);
        self.n += other.n;
        Ok(())
    }
}

/// The compact rerank summaries of one kv head (module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct CompactSummaries {
    pub config: ParisConfig,
    pub layout: Layout,
    pub n: usize,
    /// `[n][D]` level indices (packed on a device as a sign plane and magnitude planes).
    pub codes: Vec<u8>,
    /// `[n][groups]` weight codes on `grid`.
    pub weights: Vec<u8>,
    pub grid: LogGrid,
}

impl CompactSummaries {
    /// Quantises `keys`' weights on the grid fitted to them.
    pub fn from_keys(keys: CompactKeys) -> CompactSummaries {
        let grid = LogGrid::fit(keys.layout.steps(), keys.weights.iter().copied());
        CompactSummaries::on_grid(keys, grid)
    }

    /// The device rows of every key (`[n][3D/8]`, [`WholeRow`]); [`Layout::whole_eighth`] only.
    pub fn whole_rows(&self) -> Result<Vec<u8>, ParisError> {
        let row = WholeRow::new(&self.config, self.layout)?;
        let d = self.config.head_dim;
        let mut out = Vec::with_capacity(self.n * row.bytes());
        for i in 0..self.n {
            out.extend(row.pack(&self.codes[i * d..(i + 1) * d], self.weights[i]));
        }
        Ok(out)
    }

    /// The summaries a device holds as `ids [n][B]` and `rows [n][3D/8]` ([`WholeRow`]) on
    /// `grid`, unpacked to level indices.
    pub fn from_whole_rows(config: ParisConfig, ids: &[u8], rows: &[u8], grid: LogGrid) -> Result<CompactSummaries, ParisError> {
        let layout = Layout::whole_eighth();
        let row = WholeRow::new(&config, layout)?;
        let (b, rb) = (config.subspaces, row.bytes());
        let n = rows.len() / rb;
        if rows.len() != n * rb || ids.len() != n * b {
            return Err(ParisError::Length { what: "whole64 ids and rows", got: ids.len() + rows.len(), want: n * (b + rb) });
        }
        let mut out = CompactSummaries { config, layout, n, codes: Vec::with_capacity(n * config.head_dim), weights: Vec::with_capacity(n), grid };
        for i in 0..n {
            let (codes, w) = row.unpack(&ids[i * b..(i + 1) * b], &rows[i * rb..(i + 1) * rb]);
            out.codes.extend(codes);
            out.weights.push(w);
        }
        Ok(out)
    }

    /// Quantises `keys`' weights on a given `grid` (the device's streaming encoder: the grid of
    /// the prefill, module docs).
    pub fn on_grid(keys: CompactKeys, grid: LogGrid) -> CompactSummaries {
        let weights = keys.weights.iter().map(|&w| grid.code(w)).collect();
        CompactSummaries { config: keys.config, layout: keys.layout, n: keys.n, codes: keys.codes, weights, grid }
    }

    /// Summaries of `[n][D]` finite keys.
    pub fn encode(config: ParisConfig, layout: Layout, keys: &[f32]) -> Result<CompactSummaries, ParisError> {
        Ok(CompactSummaries::from_keys(CompactKeys::encode(config, layout, keys)?))
    }

    /// Weight of key `i`, group `g`, as stored.
    pub fn weight(&self, i: usize, g: usize) -> f64 {
        self.grid.value(self.weights[i * self.layout.groups(&self.config) + g])
    }

    /// The centroid id of key `i` in subspace `b` read from the codes' sign plane (what
    /// [`Summaries::ids`] holds for the same key).
    pub fn id(&self, i: usize, b: usize) -> u8 {
        let m = self.config.m();
        (0..m).fold(0u8, |id, j| {
            let c = b * m + j;
            let half = self.layout.table(&self.config, c).levels_f32.len() / 2;
            id | u8::from(usize::from(self.codes[i * self.config.head_dim + c]) >= half) << j
        })
    }
}

/// The device row of the whole-vector code of `D/2` bytes (module docs, "On the device"): the
/// magnitude bit stream and the weight code; the signs are the ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WholeRow {
    config: ParisConfig,
    layout: Layout,
}

impl WholeRow {
    /// The row of `layout` under `config`: [`Layout::whole_eighth`] with `m = 8` and a head
    /// dim that is a multiple of 64 ([`crate::SummaryLayout::Whole64`]'s checks).
    pub fn new(config: &ParisConfig, layout: Layout) -> Result<WholeRow, ParisError> {
        crate::SummaryLayout::Whole64.validate(config)?;
        if layout != Layout::whole_eighth() {
            return Err(ParisError::Layout(format!("the device row packs {:?} only, not {layout:?}", Layout::whole_eighth())));
        }
        Ok(WholeRow { config: *config, layout })
    }

    /// Bytes of a row, `3D/8`.
    pub fn bytes(&self) -> usize {
        3 * self.config.head_dim / 8
    }

    /// Bit offset of coordinate `j`'s magnitude: `3j − ⌊j/(D/8)⌋` (one bit less per low
    /// coordinate before `j`).
    pub fn offset(&self, j: usize) -> usize {
        3 * j - j / (self.config.head_dim / 8)
    }

    /// Magnitude bits of coordinate `j`: 3, or 2 on a low coordinate.
    pub fn width(&self, j: usize) -> usize {
        if self.layout.is_low(&self.config, j) {
            2
        } else {
            3
        }
    }

    /// The row of one key's codes `[D]` (level indices) and weight code.
    pub fn pack(&self, codes: &[u8], weight: u8) -> Vec<u8> {
        let mut row = vec![0u8; self.bytes()];
        for (j, &c) in codes.iter().enumerate() {
            let half = 1u32 << self.width(j);
            let c = u32::from(c);
            let mag = (if c >= half { c - half } else { half - 1 - c }) & (half - 1);
            let off = self.offset(j);
            let bits = u32::from(row[off / 8]) | u32::from(*row.get(off / 8 + 1).unwrap_or(&0)) << 8 | (mag << (off % 8));
            row[off / 8] = bits as u8;
            if off / 8 + 1 < row.len() {
                row[off / 8 + 1] = (bits >> 8) as u8;
            }
        }
        *row.last_mut().expect("a row of at least 24 bytes") = weight;
        row
    }

    /// One key's codes `[D]` and weight code from its ids `[B]` and row.
    pub fn unpack(&self, ids: &[u8], row: &[u8]) -> (Vec<u8>, u8) {
        let codes = (0..self.config.head_dim)
            .map(|j| {
                let (off, w) = (self.offset(j), self.width(j));
                let bits = u32::from(row[off / 8]) | u32::from(*row.get(off / 8 + 1).unwrap_or(&0)) << 8;
                let mag = (bits >> (off % 8)) & ((1 << w) - 1);
                let half = 1u32 << w;
                let positive = ids[j / 8] >> (j % 8) & 1 == 1;
                (if positive { half + mag } else { half - 1 - mag }) as u8
            })
            .collect();
        (codes, row[row.len() - 1])
    }
}

/// A query prepared for compact summaries: `‖q‖` and the per-coordinate lookup table
/// `ℓ_c q̃_j` of each coordinate's level table.
#[derive(Clone, Debug)]
pub struct CompactQuery {
    pub layout: Layout,
    norm: f64,
    /// `[D][16]` (3-bit coordinates use the first 8).
    lut: Vec<f64>,
}

impl CompactQuery {
    /// From a prepared [`Query`] (its norm and rotation).
    pub fn new(q: &Query, layout: Layout) -> Result<CompactQuery, ParisError> {
        let cfg = &q.config;
        layout.validate(cfg)?;
        let mut lut = vec![0f64; cfg.head_dim * 16];
        for (j, &qj) in q.rotated.iter().enumerate() {
            for (c, &l) in layout.table(cfg, j).levels_f32.iter().enumerate() {
                lut[j * 16 + c] = f64::from(l) * qj;
            }
        }
        Ok(CompactQuery { layout, norm: q.norm, lut })
    }

    /// The estimate of `⟨k_i, q⟩` (module docs, "Estimate").
    pub fn estimate(&self, s: &CompactSummaries, i: usize) -> f64 {
        let d = s.config.head_dim;
        let groups = s.layout.groups(&s.config);
        let width = d / groups;
        let row = &s.codes[i * d..(i + 1) * d];
        let mut acc = 0.0;
        for g in 0..groups {
            let dot: f64 = (g * width..(g + 1) * width).map(|j| self.lut[j * 16 + row[j] as usize]).sum();
            acc += s.weight(i, g) * dot;
        }
        self.norm * acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summary::Summaries;

    fn key(d: usize, salt: u64) -> Vec<f32> {
        // An outlier channel and a mean, as real keys have.
        crate::test_uniform(d, salt).enumerate().map(|(c, v)| (if c == 3 { 6.0 * v + 2.0 } else { v + 0.3 }) as f32).collect()
    }

    const LAYOUTS: [Layout; 3] = [Layout::Subspace3, Layout::Whole { low: 8 }, Layout::Whole { low: 0 }];

    #[test]
    fn bytes_are_an_eighth_of_fp16() {
        for d in [64, 128] {
            let cfg = ParisConfig::default_for(d);
            assert_eq!(Layout::Subspace3.bytes_per_key(&cfg), 4 * d / 8, "d {d}");
            assert_eq!(Layout::whole_eighth().bytes_per_key(&cfg), 4 * d / 8, "d {d}");
            assert_eq!(Layout::Whole { low: 0 }.bytes_per_key(&cfg), d / 2 + 1, "d {d}");
            assert_eq!((0..d).filter(|&j| Layout::whole_eighth().is_low(&cfg, j)).count(), 8);
        }
        let cfg = ParisConfig::default_for(128);
        assert!(Layout::Whole { low: 12 }.validate(&cfg).is_err());
        assert!(Layout::Whole { low: 256 }.validate(&cfg).is_err());
        assert!(Layout::Whole { low: 16 }.validate(&cfg).is_ok());
        assert_eq!(Layout::Whole { low: 16 }.bytes_per_key(&cfg), 63);
    }

    #[test]
    fn sign_plane_is_the_ids() {
        for d in [64, 128] {
            let cfg = ParisConfig::default_for(d);
            let mut keys: Vec<f32> = (0..50).flat_map(|i| key(d, i)).collect();
            keys.extend(std::iter::repeat_n(0.0, d));
            let s = Summaries::encode(cfg, &keys).unwrap();
            for layout in LAYOUTS {
                let c = CompactSummaries::encode(cfg, layout, &keys).unwrap();
                assert_eq!(c.n, 51);
                for i in 0..c.n {
                    for b in 0..cfg.subspaces {
                        assert_eq!(c.id(i, b), s.id(i, b), "{layout:?} d {d} key {i} subspace {b}");
                    }
                }
                assert!((0..c.layout.groups(&cfg)).all(|g| c.weight(50, g) == 0.0));
            }
        }
    }

    #[test]
    fn codes_use_their_tables() {
        let cfg = ParisConfig::default_for(128);
        let k = compact_key(&cfg, Layout::whole_eighth(), &key(128, 7));
        for (j, &c) in k.codes.iter().enumerate() {
            let e = if Layout::whole_eighth().is_low(&cfg, j) { 8 } else { 16 };
            assert!(usize::from(c) < e, "coordinate {j} code {c}");
        }
        assert!(k.codes.iter().enumerate().any(|(j, &c)| !Layout::whole_eighth().is_low(&cfg, j) && c >= 8));
        let k = compact_key(&cfg, Layout::Subspace3, &key(128, 7));
        assert!(k.codes.iter().all(|&c| c < 8));
    }

    /// A key scored with its own direction gives `‖q‖ ‖k‖` up to the weight grid.
    #[test]
    fn self_estimate_is_exact_up_to_the_grid() {
        for d in [64, 128] {
            let cfg = ParisConfig::default_for(d);
            let keys: Vec<f32> = (0..40).flat_map(|i| key(d, i).into_iter().map(move |v| v * (1.0 + i as f32 / 8.0))).collect();
            for layout in LAYOUTS {
                let s = CompactSummaries::encode(cfg, layout, &keys).unwrap();
                let tol = (2f64).powf(0.5 / f64::from(layout.steps())) - 1.0 + 1e-6;
                for i in 0..40 {
                    let q: Vec<f64> = keys[i * d..(i + 1) * d].iter().map(|&v| f64::from(v)).collect();
                    let n2 = q.iter().map(|v| v * v).sum::<f64>();
                    let e = CompactQuery::new(&Query::new(&cfg, &q).unwrap(), layout).unwrap().estimate(&s, i);
                    assert!((e / n2 - 1.0).abs() <= tol, "{layout:?} d {d} key {i}: {e} vs {n2}");
                }
            }
        }
    }

    /// On another query the estimate is within a few percent of `‖k‖‖q‖` (here at most 4.8%
    /// with 3-bit codes, 4.1% whole-vector; the committed 4-bit layout's bound is 6%).
    #[test]
    fn estimates_are_close() {
        for d in [64, 128] {
            let cfg = ParisConfig::default_for(d);
            let keys: Vec<f32> = (0..200).flat_map(|i| key(d, i)).collect();
            let q: Vec<f64> = key(d, 999).iter().map(|&v| f64::from(v) - 0.3).collect();
            let qp = Query::new(&cfg, &q).unwrap();
            for (layout, bound) in [(Layout::Subspace3, 0.07), (Layout::whole_eighth(), 0.05), (Layout::Whole { low: 0 }, 0.05)] {
                let s = CompactSummaries::encode(cfg, layout, &keys).unwrap();
                let cq = CompactQuery::new(&qp, layout).unwrap();
                let mut worst = 0f64;
                for i in 0..200 {
                    let k = &keys[i * d..(i + 1) * d];
                    let exact: f64 = k.iter().zip(&q).map(|(&k, q)| f64::from(k) * q).sum();
                    let kn = k.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
                    worst = worst.max((cq.estimate(&s, i) - exact).abs() / (kn * qp.norm));
                }
                assert!(worst < bound, "{layout:?} d {d}: worst relative error {worst}");
            }
        }
    }

    /// The device rows: the signs are the ids, the magnitudes a bit stream of `3D − 8` bits,
    /// the weight code last; packing and unpacking are inverse.
    #[test]
    fn whole_rows_round_trip() {
        for d in [64, 128, 256] {
            let cfg = ParisConfig::default_for(d);
            let row = WholeRow::new(&cfg, Layout::whole_eighth()).unwrap();
            assert_eq!(row.bytes() + cfg.subspaces, d / 2);
            assert_eq!(row.offset(d - 1) + row.width(d - 1), 3 * d - 8);
            assert_eq!((0..d).map(|j| row.width(j)).sum::<usize>(), 3 * d - 8);
            let mut keys: Vec<f32> = (0..60).flat_map(|i| key(d, i).into_iter().map(move |v| v * (1.0 + i as f32))).collect();
            keys.extend(std::iter::repeat_n(0.0, d));
            let c = CompactSummaries::encode(cfg, Layout::whole_eighth(), &keys).unwrap();
            let s = Summaries::encode(cfg, &keys).unwrap();
            let rows = c.whole_rows().unwrap();
            assert_eq!(rows.len(), 61 * row.bytes());
            let back = CompactSummaries::from_whole_rows(cfg, &s.ids, &rows, c.grid).unwrap();
            assert_eq!(back, c, "d {d}");
            // The weight is the last byte; the largest weight has the top code.
            assert_eq!((0..60).map(|i| rows[(i + 1) * row.bytes() - 1]).max(), Some(255));
            assert_eq!(rows[61 * row.bytes() - 1], 0, "a zero key's weight");
        }
        // Coordinate 15 (low at d 128) holds 2 bits at bit 45; coordinate 16 starts at 47.
        let cfg = ParisConfig::default_for(128);
        let row = WholeRow::new(&cfg, Layout::whole_eighth()).unwrap();
        assert_eq!((row.offset(15), row.width(15), row.offset(16)), (45, 2, 47));
        let mut codes: Vec<u8> = (0..128).map(|j| if Layout::whole_eighth().is_low(&cfg, j) { 4 } else { 8 }).collect();
        codes[15] = 7; // 3-bit table: positive, magnitude 3
        codes[16] = 0; // 4-bit table: negative, magnitude 7
        let r = row.pack(&codes, 9);
        assert_eq!(r[5] >> 5, 0b011 | 0b100, "bits 45..46 = 3, bit 47 = 1");
        assert_eq!(r[6] & 3, 3);
        assert_eq!(r[47], 9);
        assert!(WholeRow::new(&cfg, Layout::Whole { low: 0 }).is_err());
        assert!(WholeRow::new(&ParisConfig::default_for(32), Layout::whole_eighth()).is_err());
        assert!(CompactSummaries::from_whole_rows(cfg, &[0; 16], &[0; 47], LogGrid { steps: 32, base: 0 }).is_err());
    }

    /// The streaming encoder's reference: the prefill fixes the grid, later keys clamp.
    #[test]
    fn on_grid_is_the_prefill_grid() {
        let cfg = ParisConfig::default_for(128);
        let keys: Vec<f32> = (0..30).flat_map(|i| key(128, i).into_iter().map(move |v| v * (1.0 + i as f32))).collect();
        let pre = CompactKeys::encode(cfg, Layout::whole_eighth(), &keys[..128 * 10]).unwrap();
        let grid = LogGrid::fit(32, pre.weights.iter().copied());
        let all = CompactSummaries::on_grid(CompactKeys::encode(cfg, Layout::whole_eighth(), &keys).unwrap(), grid);
        assert_eq!(all.grid, grid);
        assert!(all.weights[15..].iter().all(|&c| c == 255), "larger keys than the prefill's clamp");
        assert_eq!(&all.weights[..10], &CompactSummaries::from_keys(pre).weights[..]);
    }

    #[test]
    fn log_grid_round_trips() {
        let g = LogGrid::fit(32, [0.0, 3.0, 100.0, -1.0, f64::NAN]);
        assert_eq!(g.code(100.0), 255);
        assert_eq!((g.code(0.0), g.code(-2.0), g.code(f64::INFINITY)), (0, 0, 0));
        assert_eq!(g.value(0), 0.0);
        for w in [3.0, 7.5, 99.0, 1.0, 100.0 / 200.0] {
            let v = g.value(g.code(w));
            assert!((v / w).log2().abs() <= 0.5 / 32.0 + 1e-12, "{w} -> {v}");
        }
        // More than 255 steps below the top clamps to code 1.
        assert_eq!(g.code(100.0 / 1024.0), 1);
        assert_eq!(LogGrid::fit(16, [0.0]).base, -128);
        // Chunks quantised on one grid equal one encode.
        let cfg = ParisConfig::default_for(64);
        let keys: Vec<f32> = (0..30).flat_map(|i| key(64, i)).collect();
        let mut a = CompactKeys::encode(cfg, Layout::whole_eighth(), &keys[..64 * 11]).unwrap();
        a.extend(CompactKeys::encode(cfg, Layout::whole_eighth(), &keys[64 * 11..]).unwrap()).unwrap();
        assert_eq!(CompactSummaries::from_keys(a), CompactSummaries::encode(cfg, Layout::whole_eighth(), &keys).unwrap());
        assert!(CompactKeys::encode(cfg, Layout::Subspace3, &keys[..65]).is_err());
    }
}
