//! Calibration (kvtc §3.1, App. B.1): sample token positions (attention sinks and each
//! sequence's recent window excluded), take every layer's and head's keys (RoPE undone) or
//! values of a position as one row of `p = layers · kv_heads · head_dim` features, centre, and
//! take the principal directions (eigendecomposition of the `p × p` covariance with faer: exact,
//! and cheaper than a randomised SVD of the `n × p` sample when `n ≫ p`; the `n × n` Gram matrix
//! when there are fewer positions than features). Then the DP of
//! App. B.17 ([`crate::alloc`]) on a subsample projected onto that basis gives one allocation
//! per compression ratio; the basis is kept only as far as the largest allocation uses it.

use faer::Mat;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::alloc::{Allocation, Dp, DpConfig, RowThinning};
use crate::dump::KvDump;
use crate::error::{KvtcError, Result};
use crate::rope::Rope;

/// What [`calibrate`] does.
#[derive(Clone, Debug)]
pub struct CalibConfig {
    /// Leading tokens of a sequence never compressed nor sampled (the paper: 4).
    pub sinks: usize,
    /// Trailing tokens of a sequence never compressed nor sampled (the paper: 128).
    pub window: usize,
    /// Most positions sampled for the PCA (all eligible ones if fewer).
    pub max_samples: usize,
    /// Positions (of the sample) the DP's error tables are computed on.
    pub dp_rows: usize,
    /// Most principal components kept before the DP trims them.
    pub max_rank: usize,
    /// Compression ratios vs fp16 (before entropy coding) to allocate for, e.g. 4, 8, 16, 32, 64.
    pub ratios: Vec<f64>,
    /// RoPE to undo on keys (None: keys are taken as they are).
    pub rope: Option<Rope>,
    pub dp: DpConfig,
    pub seed: u64,
    /// Layers sharing one basis (0: all layers, one PCA over `layers · kv_heads · head_dim`
    /// features). With `n`, each run of `n` layers gets its own PCA: the basis is block
    /// diagonal, which divides the restore's matmul FLOPs by the number of blocks.
    pub layers_per_basis: usize,
    /// Importance of each feature's squared error, per side (`p` values, feature order as
    /// [`features`]; None: all equal). Features are scaled by `sqrt(weight / mean weight)`
    /// before the PCA, so the PCA and the DP minimise the weighted error: for keys the mean
    /// query energy of each (pre-RoPE) channel pair makes it the logits' error, for values the
    /// `o_proj` column energy the attention output's. See [`SideCalib::scale`].
    pub weights: [Option<Vec<f64>>; 2],
    /// Share of the two sides' joint budget (`2 · 16 · p / ratio` bits per token) that keys get;
    /// 0.5 splits it evenly. The ratio vs fp16 of keys and values together is unchanged.
    pub key_share: f64,
    /// Step allocations ([`crate::step`]: one quantisation step per side and ratio, a code
    /// model per coordinate, the budget in expected `rans`-coded bits) instead of the DP.
    pub step: bool,
    /// The encoder's dead zone for step allocations ([`crate::quant::step_code`], in steps;
    /// 0: round to nearest): thresholds moved away from zero trade a little error for fewer
    /// coded bits, and the models and the step are fitted to that quantiser.
    pub dead_zone: f32,
    /// Share of the sampled positions kept out of the PCA (0: none). With `n` positions and
    /// `p` features the PCA's trailing variances are biased low (more so the closer `n / p`
    /// is to 1), so a held-out token puts more energy in them than the calibration planned.
    /// Held-out positions give the allocation its rows and, for step allocations, each
    /// component's variance: what a token the basis did not see costs.
    pub holdout: f64,
}

impl Default for CalibConfig {
    fn default() -> Self {
        Self {
            sinks: 4,
            window: 128,
            max_samples: 16384,
            dp_rows: 256,
            max_rank: usize::MAX,
            ratios: vec![4.0, 8.0, 16.0, 32.0, 64.0],
            rope: None,
            dp: DpConfig::default(),
            seed: 0,
            layers_per_basis: 0,
            weights: [None, None],
            key_share: 0.5,
            step: false,
            dead_zone: 0.0,
            holdout: 0.0,
        }
    }
}

/// One diagonal block of a side's basis: its `components` span only its `features` (a run of
/// whole layers). A basis over all layers is one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BasisBlock {
    pub features: std::ops::Range<usize>,
    pub components: std::ops::Range<usize>,
}

/// Components of a block of a multi-block basis come in multiples of this (zero rows of zero
/// variance pad a block's PCA), so every block's coefficients start on a whole k-tile of the
/// device matmul ([`crate::restore::BK`]).
pub const BLOCK_ALIGN: usize = 32;

/// The transform of one side (keys or values).
#[derive(Clone, Debug, PartialEq)]
pub struct SideCalib {
    /// Per-feature mean, `p`.
    pub mean: Vec<f32>,
    /// Principal directions, block after block; within block `b` its components' rows of
    /// `b.features.len()` values (one block over all features: `components × p`), by
    /// decreasing variance within the block.
    pub basis: Vec<f32>,
    /// Variance along each kept direction.
    pub variance: Vec<f32>,
    /// One allocation per ratio, in the order of [`Calibration::ratios`].
    pub allocations: Vec<Allocation>,
    /// The blocks, in order: features tile `0..p`, components tile `0..components()`.
    pub blocks: Vec<BasisBlock>,
    /// Per-feature scale `s` of a weighted calibration (`p` values; empty: none). The PCA ran
    /// on `(x − mean) ⊙ s`; `basis` holds its orthonormal directions divided by `s` (`u ⊘ s`),
    /// so the restore is unchanged, `coefficients · basis + mean`, and projecting is
    /// `(x − mean) ⊙ s² · basisᵀ` ([`SideCalib::project_scale`]).
    pub scale: Vec<f32>,
}

impl SideCalib {
    pub fn components(&self) -> usize {
        self.variance.len()
    }

    /// The block holding component `c`.
    pub fn block_of(&self, c: usize) -> usize {
        self.blocks.iter().position(|b| b.components.contains(&c)).unwrap_or(self.blocks.len().saturating_sub(1))
    }

    /// Where block `b`'s rows start in [`SideCalib::basis`].
    pub fn block_offset(&self, b: usize) -> usize {
        self.blocks[..b].iter().map(|k| k.components.len() * k.features.len()).sum()
    }

    /// Component `c`'s direction: its block's first feature and its values over the block's features.
    pub fn basis_row(&self, c: usize) -> (usize, &[f32]) {
        let b = self.block_of(c);
        let k = &self.blocks[b];
        let w = k.features.len();
        let o = self.block_offset(b) + (c - k.components.start) * w;
        (k.features.start, &self.basis[o..o + w])
    }

    /// What [`crate::codec::project`] multiplies the centred features by before the basis:
    /// `s²` of a weighted calibration, None for an orthonormal basis.
    pub fn project_scale(&self) -> Option<Vec<f64>> {
        (!self.scale.is_empty()).then(|| self.scale.iter().map(|&s| s as f64 * s as f64).collect())
    }

    /// First components of the blocks after the first (no allocation group crosses one).
    pub fn breaks(&self) -> Vec<usize> {
        self.blocks.iter().skip(1).map(|b| b.components.start).collect()
    }
}

/// A calibration: what `kvforge calibrate` writes and `kvforge pack` / `unpack` read.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope: Option<Rope>,
    pub sinks: usize,
    pub window: usize,
    /// Positions the PCA was computed on.
    pub samples: usize,
    pub ratios: Vec<f64>,
    pub k: SideCalib,
    pub v: SideCalib,
}

/// Which side of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Keys,
    Values,
}

impl Side {
    pub fn name(self) -> &'static str {
        match self {
            Side::Keys => "keys",
            Side::Values => "values",
        }
    }
}

impl Calibration {
    pub fn features(&self) -> usize {
        self.layers * self.kv_heads * self.head_dim
    }

    pub fn side(&self, s: Side) -> &SideCalib {
        match s {
            Side::Keys => &self.k,
            Side::Values => &self.v,
        }
    }

    /// Index of the allocation for `ratio` (the nearest calibrated one within 1%).
    pub fn ratio_index(&self, ratio: f64) -> Option<usize> {
        self.ratios.iter().position(|&r| (r - ratio).abs() <= 0.01 * ratio)
    }

    /// The calibration's identity: blake3 over a canonical encoding of everything that
    /// changes what a container decodes to (shapes, RoPE, windows, ratios, means, bases,
    /// allocations). Containers record it; unpacking with another calibration is refused.
    pub fn id(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(b"kvforge-kvtc-calibration/1");
        for x in [self.layers, self.kv_heads, self.head_dim, self.sinks, self.window] {
            h.update(&(x as u64).to_le_bytes());
        }
        match self.rope {
            Some(r) => {
                h.update(&[1]);
                h.update(&r.theta.to_le_bytes());
                h.update(&(r.dim as u64).to_le_bytes());
            }
            None => {
                h.update(&[0]);
            }
        }
        for r in &self.ratios {
            h.update(&r.to_le_bytes());
        }
        for s in [&self.k, &self.v] {
            if s.blocks.len() > 1 {
                h.update(b"blocks");
                for b in &s.blocks {
                    for x in [b.features.start, b.features.end, b.components.start, b.components.end] {
                        h.update(&(x as u64).to_le_bytes());
                    }
                }
            }
            if !s.scale.is_empty() {
                h.update(b"scale");
                for x in &s.scale {
                    h.update(&x.to_le_bytes());
                }
            }
            h.update(&(s.components() as u64).to_le_bytes());
            hash_f32s(&mut h, &s.mean);
            hash_f32s(&mut h, &s.basis);
            for a in &s.allocations {
                h.update(&a.budget_bits.to_le_bytes());
                h.update(&(a.groups.len() as u64).to_le_bytes());
                for g in &a.groups {
                    h.update(&g.start.to_le_bytes());
                    h.update(&g.len.to_le_bytes());
                    h.update(&[g.bits]);
                }
                // coded allocations only, so the ids of fixed-width calibrations stay as they were
                if a.coded() {
                    h.update(b"coded");
                    h.update(&a.step.to_le_bytes());
                    // only when set, so the ids of step calibrations without one stay as they were
                    if a.dead_zone != 0.0 {
                        h.update(b"dead zone");
                        h.update(&a.dead_zone.to_le_bytes());
                    }
                    for (g, m) in a.groups.iter().zip(&a.models) {
                        h.update(&[g.fit.id()]);
                        m.iter().for_each(|p| {
                            h.update(&p.to_le_bytes());
                        });
                    }
                }
            }
        }
        *h.finalize().as_bytes()
    }

    pub fn id_hex(&self) -> String {
        self.id().iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Feeds `xs` to `h` as their little-endian bytes: the same stream as one `update` per value,
/// hashed in parallel (a basis holds tens of millions of values and a container read checks the
/// calibration's id).
fn hash_f32s(h: &mut blake3::Hasher, xs: &[f32]) {
    if cfg!(target_endian = "little") {
        h.update_rayon(bytemuck::cast_slice(xs));
        return;
    }
    let mut buf = [0u8; 4 * 4096];
    for block in xs.chunks(4096) {
        for (o, x) in buf.chunks_exact_mut(4).zip(block) {
            o.copy_from_slice(&x.to_le_bytes());
        }
        h.update(&buf[..4 * block.len()]);
    }
}

/// Token indices of `positions` that may be sampled: not among the first `sinks` or the last
/// `window` tokens of their sequence (a sequence ends where positions stop increasing).
pub fn eligible(positions: &[i64], sinks: usize, window: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut start = 0;
    for end in 1..=positions.len() {
        if end == positions.len() || positions[end] <= positions[end - 1] {
            let n = end - start;
            if n > sinks + window {
                out.extend(start + sinks..end - window);
            }
            start = end;
        }
    }
    out
}

/// One token's features of one side, RoPE undone for keys when `rope` is given:
/// `x[(layer · kv_heads + head) · head_dim + channel]`.
pub fn features(dump: &KvDump, side: Side, t: usize, rope: Option<Rope>, out: &mut [f64]) {
    let (hd, src) = (dump.head_dim, if side == Side::Keys { &dump.k } else { &dump.v });
    for l in 0..dump.layers {
        for h in 0..dump.kv_heads {
            let o = (l * dump.kv_heads + h) * hd;
            let row = &mut out[o..o + hd];
            let a = dump.at(l, h, t, 0);
            for (x, &s) in row.iter_mut().zip(&src[a..a + hd]) {
                *x = s as f64;
            }
            if let (Side::Keys, Some(r)) = (side, rope) {
                r.apply(row, dump.positions[t], -1.0);
            }
        }
    }
}

/// Budget in bits per token of one side at `ratio` vs fp16.
pub fn budget_bits(features: usize, ratio: f64) -> usize {
    (16.0 * features as f64 / ratio).floor() as usize
}

/// Budget of `side` at `ratio` when keys get `key_share` of both sides' `2 · budget_bits`
/// (rounded down; values get the rest, so the two add up to it exactly).
pub fn side_budget_bits(features: usize, ratio: f64, side: Side, key_share: f64) -> usize {
    let total = 2 * budget_bits(features, ratio);
    let keys = ((total as f64 * key_share).floor() as usize).min(total);
    if side == Side::Keys {
        keys
    } else {
        total - keys
    }
}

/// The scale `sqrt(w / mean w)` of feature weights `w` (a weight below 1e-6 of the mean is
/// taken as 1e-6 of it, so no feature is scaled to nothing).
pub fn weight_scale(w: &[f64]) -> Vec<f64> {
    let mean = w.iter().sum::<f64>() / w.len().max(1) as f64;
    w.iter().map(|&x| (x.max(1e-6 * mean) / mean).sqrt()).collect()
}

/// Calibrates keys and values on `dump`; `progress` is told each step's name.
pub fn calibrate(dump: &KvDump, cfg: &CalibConfig, progress: impl FnMut(&str)) -> Result<Calibration> {
    let mut all = calibrate_grid(dump, cfg, &[cfg.key_share], &[cfg.dp_rows], progress)?;
    Ok(all.remove(0))
}

/// [`calibrate`] for every `dp_rows` × `key_shares` (in that order, key shares varying
/// fastest; `cfg.key_share` and `cfg.dp_rows` are ignored) at the cost of one PCA per side:
/// only the DP depends on the rows it measures (one solve per side and row count, the first
/// rows of one shuffle, so each count's rows are those [`calibrate`] would take) and only the
/// budgets on the key share (one table serves all budgets). Each calibration equals what
/// [`calibrate`] gives for that point.
pub fn calibrate_grid(dump: &KvDump, cfg: &CalibConfig, key_shares: &[f64], dp_rows: &[usize], mut progress: impl FnMut(&str)) -> Result<Vec<Calibration>> {
    if key_shares.is_empty() || dp_rows.is_empty() {
        return Err(KvtcError::BadInput("a calibration grid needs at least one key share and one DP row count".into()));
    }
    dump.validate()?;
    if let Some(i) = dump.k.iter().chain(&dump.v).position(|x| !x.is_finite()) {
        return Err(KvtcError::BadInput(format!("the K/V dump holds a non-finite value (element {i})")));
    }
    if let Some(r) = cfg.rope {
        if r.dim % 2 != 0 || r.dim > dump.head_dim || r.dim == 0 || !(r.theta > 1.0) {
            return Err(KvtcError::BadInput(format!("rope_dim {} must be even, ≤ head_dim {} and rope_theta {} > 1", r.dim, dump.head_dim, r.theta)));
        }
    }
    if cfg.layers_per_basis > dump.layers {
        return Err(KvtcError::BadInput(format!("layers_per_basis {} > the dump's {} layers", cfg.layers_per_basis, dump.layers)));
    }
    for (w, side) in cfg.weights.iter().zip(["keys", "values"]) {
        if let Some(w) = w {
            if w.len() != dump.features() || w.iter().any(|x| !(x.is_finite() && *x >= 0.0)) || !w.iter().any(|&x| x > 0.0) {
                return Err(KvtcError::BadInput(format!("{side} weights: need {} finite, non-negative values, not all zero (got {})", dump.features(), w.len())));
            }
        }
    }
    if let Some(ks) = key_shares.iter().find(|&&ks| !(ks > 0.0 && ks < 1.0)) {
        return Err(KvtcError::BadInput(format!("key_share {ks} must lie strictly between 0 and 1")));
    }
    if cfg.ratios.is_empty() || cfg.ratios.iter().any(|&r| !(r >= 1.0)) {
        return Err(KvtcError::BadInput(format!("ratios {:?}: need at least one, each ≥ 1", cfg.ratios)));
    }
    let mut idx = eligible(&dump.positions, cfg.sinks, cfg.window);
    if idx.len() < 2 {
        return Err(KvtcError::BadInput(format!("{} tokens leave {} to sample after excluding {} sinks and a window of {} per sequence", dump.tokens, idx.len(), cfg.sinks, cfg.window)));
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cfg.seed);
    if idx.len() > cfg.max_samples {
        idx.shuffle(&mut rng);
        idx.truncate(cfg.max_samples);
        idx.sort_unstable();
    }
    // positions the PCA does not see (`holdout`); the rows are drawn from them
    let held: Vec<usize> = if cfg.holdout > 0.0 {
        let mut sh = idx.clone();
        sh.shuffle(&mut rng);
        let h = ((cfg.holdout * idx.len() as f64).round() as usize).clamp(1, idx.len() - 1);
        let (mut held, mut rest) = (sh[..h].to_vec(), sh[h..].to_vec());
        held.sort_unstable();
        rest.sort_unstable();
        idx = rest;
        held
    } else {
        Vec::new()
    };
    let mut perm: Vec<usize> = (0..if held.is_empty() { idx.len() } else { held.len() }).collect();
    perm.shuffle(&mut rng);
    let dp_sets: Vec<Vec<usize>> = dp_rows
        .iter()
        .map(|&r| {
            let mut d = perm[..r.clamp(1, perm.len())].to_vec();
            d.sort_unstable();
            d
        })
        .collect();
    let mut ratios = cfg.ratios.clone();
    ratios.sort_by(|a, b| a.partial_cmp(b).unwrap());
    ratios.dedup();
    let k = calibrate_side(dump, Side::Keys, cfg, &idx, &held, &dp_sets, key_shares, &ratios, &mut progress)?;
    let v = calibrate_side(dump, Side::Values, cfg, &idx, &held, &dp_sets, key_shares, &ratios, &mut progress)?;
    Ok(k.into_iter()
        .zip(v)
        .map(|(k, v)| Calibration {
            layers: dump.layers,
            kv_heads: dump.kv_heads,
            head_dim: dump.head_dim,
            rope: cfg.rope,
            sinks: cfg.sinks,
            window: cfg.window,
            samples: idx.len(),
            ratios: ratios.clone(),
            k,
            v,
        })
        .collect())
}

/// Principal directions of the centred rows of `x` (`n × p`) as the columns of a `p × rank`
/// matrix, with their variances, by decreasing variance. With `n ≥ p` from the `p × p`
/// covariance; with fewer rows than features from the `n × n` Gram matrix (`v = Xᵀu / √(nλ)`),
/// which has the same non-zero spectrum at a fraction of the cost. Directions of (numerically)
/// zero variance are left out.
pub fn principal_directions(x: &Mat<f64>, max_rank: usize, mut progress: impl FnMut(&str)) -> Result<(Mat<f64>, Vec<f64>)> {
    let (n, p) = (x.nrows(), x.ncols());
    let gram = n < p;
    let m = if gram {
        progress(&format!("Gram matrix {n} × {n} (fewer positions than features)"));
        x * x.transpose() * faer::Scale(1.0 / n as f64)
    } else {
        progress(&format!("covariance {p} × {p}"));
        x.transpose() * x * faer::Scale(1.0 / n as f64)
    };
    progress("eigendecomposition");
    let evd = m.self_adjoint_eigen(faer::Side::Lower).map_err(|e| KvtcError::Linalg(format!("{e:?}")))?;
    let (u, s) = (evd.U(), evd.S().column_vector());
    let k = m.nrows();
    // faer sorts eigenvalues ascending: component c is column k-1-c.
    let top = s[k - 1].max(0.0);
    let rank = (0..k.min(max_rank)).take_while(|&c| s[k - 1 - c] > 1e-12 * top && s[k - 1 - c] > 0.0).count();
    let mut basis = Mat::<f64>::zeros(p, rank);
    let mut variance = Vec::with_capacity(rank);
    for c in 0..rank {
        let col = k - 1 - c;
        variance.push(s[col]);
        if gram {
            let v = x.transpose() * u.col(col);
            let norm = (n as f64 * s[col]).sqrt();
            for f in 0..p {
                basis[(f, c)] = v[f] / norm;
            }
        } else {
            for f in 0..p {
                basis[(f, c)] = u[(f, col)];
            }
        }
    }
    Ok((basis, variance))
}

/// Feature ranges of the basis blocks: runs of `layers_per_basis` layers (0: one block).
pub fn block_features(layers: usize, layer_width: usize, layers_per_basis: usize) -> Vec<std::ops::Range<usize>> {
    let per = if layers_per_basis == 0 { layers.max(1) } else { layers_per_basis };
    (0..layers.max(1)).step_by(per).map(|l| l * layer_width..(l + per).min(layers.max(1)) * layer_width).collect()
}

/// The features of positions `idx` of one side, a row each.
fn gather(dump: &KvDump, side: Side, idx: &[usize], rope: Option<Rope>) -> Mat<f64> {
    let p = dump.features();
    let mut x = Mat::<f64>::zeros(idx.len(), p);
    let mut row = vec![0.0; p];
    for (i, &t) in idx.iter().enumerate() {
        features(dump, side, t, rope, &mut row);
        for (j, &v) in row.iter().enumerate() {
            x[(i, j)] = v;
        }
    }
    x
}

/// One side's calibrations of the grid: for each row set of `dp_sets` (indices into `held`,
/// or into `idx` when nothing is held out), for each key share.
#[allow(clippy::too_many_arguments)]
fn calibrate_side(
    dump: &KvDump,
    side: Side,
    cfg: &CalibConfig,
    idx: &[usize],
    held: &[usize],
    dp_sets: &[Vec<usize>],
    key_shares: &[f64],
    ratios: &[f64],
    progress: &mut impl FnMut(&str),
) -> Result<Vec<SideCalib>> {
    let p = dump.features();
    let n = idx.len();
    progress(&format!("{}: gathering {n} positions × {p} features ({} held out)", side.name(), held.len()));
    let mut x = gather(dump, side, idx, cfg.rope);
    let mean: Vec<f64> = (0..p).map(|j| (0..n).map(|i| x[(i, j)]).sum::<f64>() / n as f64).collect();
    let scale = cfg.weights[usize::from(side == Side::Values)].as_deref().map(weight_scale);
    // the held-out positions, centred and scaled as the PCA's
    let mut xh = gather(dump, side, held, cfg.rope);
    for j in 0..p {
        let s = scale.as_ref().map_or(1.0, |s| s[j]);
        for i in 0..n {
            x[(i, j)] = (x[(i, j)] - mean[j]) * s;
        }
        for i in 0..held.len() {
            xh[(i, j)] = (xh[(i, j)] - mean[j]) * s;
        }
    }
    let rows_of = if held.is_empty() { &x } else { &xh };
    let fblocks = block_features(dump.layers, dump.kv_heads * dump.head_dim, cfg.layers_per_basis);
    let multi = fblocks.len() > 1;
    // per block: its basis (features × components, padded with zero columns in a multi-block
    // basis) and variances
    let mut parts: Vec<(Mat<f64>, Vec<f64>)> = Vec::with_capacity(fblocks.len());
    for (bi, fr) in fblocks.iter().enumerate() {
        let sub = x.subcols(fr.start, fr.len()).to_owned();
        let tag = if multi { format!("{} block {bi} (features {}..{})", side.name(), fr.start, fr.end) } else { side.name().to_string() };
        let (basis, mut variance) = principal_directions(&sub, cfg.max_rank, |m| progress(&format!("{tag}: {m}")))?;
        let comps = if multi { variance.len().div_ceil(BLOCK_ALIGN) * BLOCK_ALIGN } else { variance.len() };
        let mut b = Mat::<f64>::zeros(fr.len(), comps);
        for c in 0..variance.len() {
            for f in 0..fr.len() {
                b[(f, c)] = basis[(f, c)];
            }
        }
        variance.resize(comps, 0.0);
        parts.push((b, variance));
    }
    let rank: usize = parts.iter().map(|p| p.1.len()).sum();
    let mut blocks = Vec::with_capacity(parts.len());
    let mut c0 = 0;
    for (fr, part) in fblocks.iter().zip(&parts) {
        blocks.push(BasisBlock { features: fr.clone(), components: c0..c0 + part.1.len() });
        c0 += part.1.len();
    }
    let breaks: Vec<usize> = blocks.iter().skip(1).map(|b| b.components.start).collect();
    let budget = |r: f64, ks: f64| side_budget_bits(p, r, side, ks);
    let max_budget = key_shares.iter().map(|&ks| budget(ratios[0], ks)).max().unwrap_or(0);
    // With several blocks the DP weighs each block's error by the inverse of the block's
    // variance (its coordinates scaled by `sqrt(mean block variance / block variance)`): every
    // run of layers then gets about the same *relative* error. Unweighted, the squared error is
    // smallest when low-variance layers are dropped whole, which their attention does not survive.
    let block_var: Vec<f64> = parts.iter().map(|p| p.1.iter().sum::<f64>()).collect();
    let mean_var = block_var.iter().sum::<f64>() / block_var.len() as f64;
    let mut out = Vec::with_capacity(dp_sets.len() * key_shares.len());
    for dp_idx in dp_sets {
        let what = if cfg.step { "step allocation" } else { "DP bit allocation" };
        progress(&format!("{}: {what} on {} rows, {} blocks, budgets up to {max_budget} bits", side.name(), dp_idx.len(), blocks.len()));
        let mut xs = Mat::<f64>::zeros(dp_idx.len(), p);
        for (r, &i) in dp_idx.iter().enumerate() {
            for f in 0..p {
                xs[(r, f)] = rows_of[(i, f)];
            }
        }
        let mut data = vec![0.0; dp_idx.len() * rank];
        for ((b, part), &bv) in blocks.iter().zip(&parts).zip(&block_var) {
            let fr = &b.features;
            let proj = xs.subcols(fr.start, fr.len()) * &part.0;
            let w = if multi && bv > 0.0 { (mean_var / bv).sqrt() } else { 1.0 };
            for r in 0..dp_idx.len() {
                for j in 0..part.1.len() {
                    data[r * rank + b.components.start + j] = w * proj[(r, j)];
                }
            }
        }
        if cfg.step {
            // the PCA's variances (over every sampled position), or the held-out positions'
            // mean square along each direction; scaled as the rows are
            let sigma: Vec<f64> = blocks
                .iter()
                .zip(&parts)
                .zip(&block_var)
                .flat_map(|((b, part), &bv)| {
                    let w = if multi && bv > 0.0 { (mean_var / bv).sqrt() } else { 1.0 };
                    let var = if held.is_empty() {
                        part.1.clone()
                    } else {
                        let proj = xh.subcols(b.features.start, b.features.len()) * &part.0;
                        (0..part.1.len()).map(|j| (0..held.len()).map(|r| proj[(r, j)] * proj[(r, j)]).sum::<f64>() / held.len() as f64).collect()
                    };
                    var.into_iter().map(move |v| w * v.max(0.0).sqrt())
                })
                .collect();
            for &ks in key_shares {
                let allocations: Vec<Allocation> = ratios.iter().map(|&r| crate::step::allocation(&data, dp_idx.len(), rank, &sigma, budget(r, ks), &breaks, cfg.dead_zone)).collect();
                out.push(trimmed_side(&mean, scale.as_deref(), &blocks, &parts, allocations));
            }
            continue;
        }
        let dp = Dp::solve_thinned(&data, dp_idx.len(), rank, &cfg.dp, max_budget, &breaks, RowThinning::CALIBRATION);
        for &ks in key_shares {
            let allocations: Vec<Allocation> = ratios
                .iter()
                .map(|&r| {
                    let a = dp.allocation(budget(r, ks));
                    if cfg.dp.coded {
                        a.with_models(&data, dp_idx.len(), rank)
                    } else {
                        a
                    }
                })
                .collect();
            out.push(trimmed_side(&mean, scale.as_deref(), &blocks, &parts, allocations));
        }
    }
    Ok(out)
}

/// A side's calibration with the basis kept only as far as the largest allocation uses it.
fn trimmed_side(mean: &[f64], scale: Option<&[f64]>, blocks: &[BasisBlock], parts: &[(Mat<f64>, Vec<f64>)], allocations: Vec<Allocation>) -> SideCalib {
    let used = allocations.iter().map(Allocation::used_components).max().unwrap_or(0);
    let mut blocks = blocks.to_vec();
    let mut basis_rows = Vec::new();
    let mut variance = Vec::with_capacity(used);
    for (b, part) in blocks.iter_mut().zip(parts) {
        let keep = b.components.end.min(used).saturating_sub(b.components.start);
        b.components = b.components.start.min(used)..b.components.start.min(used) + keep;
        for c in 0..keep {
            let f0 = b.features.start;
            basis_rows.extend((0..b.features.len()).map(|f| (part.0[(f, c)] / scale.map_or(1.0, |s| s[f0 + f])) as f32));
            variance.push(part.1[c] as f32);
        }
    }
    let scale = scale.map_or(Vec::new(), |s| s.iter().map(|&x| x as f32).collect());
    SideCalib { mean: mean.iter().map(|&m| m as f32).collect(), basis: basis_rows, variance, allocations, blocks, scale }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    /// Both paths (covariance for tall samples, Gram matrix for wide ones) give orthonormal
    /// eigenvectors of the covariance, by decreasing variance.
    #[test]
    fn principal_directions_are_covariance_eigenvectors() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for (n, p) in [(40, 12), (9, 30)] {
            let mut x = Mat::<f64>::from_fn(n, p, |_, j| rng.gen_range(-1.0..1.0) * (1.0 + j as f64 * 0.3));
            for j in 0..p {
                let m = (0..n).map(|i| x[(i, j)]).sum::<f64>() / n as f64;
                (0..n).for_each(|i| x[(i, j)] -= m);
            }
            let (b, var) = principal_directions(&x, usize::MAX, |_| {}).unwrap();
            assert_eq!(var.len(), n.min(p) - usize::from(n <= p), "rank of {n} centred rows in {p} dims");
            assert!(var.windows(2).all(|w| w[0] >= w[1]));
            let cov = x.transpose() * &x * faer::Scale(1.0 / n as f64);
            let btb = b.transpose() * &b;
            let cb = &cov * &b;
            for c in 0..var.len() {
                for d in 0..var.len() {
                    assert!((btb[(c, d)] - f64::from(u8::from(c == d))).abs() < 1e-9);
                }
                for f in 0..p {
                    assert!((cb[(f, c)] - var[c] * b[(f, c)]).abs() < 1e-9 * var[0], "n {n} p {p} component {c}");
                }
            }
        }
    }
}
