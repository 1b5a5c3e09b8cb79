//! Lloyd–Max levels of the `rotated` scheme: the MSE-optimal scalar quantiser of one
//! coordinate of a uniform random unit vector in R^d, whose density is
//! `f(u) ∝ (1 − u²)^((d−3)/2)` on [−1, 1] (seed 001 Prop. 4.1; a rotated key's direction is
//! such a vector). Its variance is 1/d, and at large d it tends to N(0, 1/d), so the levels
//! tend to the Gaussian Lloyd–Max table scaled by 1/√d (±0.4528, ±1.510 at 2 bits).
//!
//! Computed deterministically in f64 by Lloyd iterations (thresholds at the midpoints, levels
//! at the conditional means) on the positive half, mirrored, so the table is exactly
//! symmetric (`ℓ_i = −ℓ_{E−1−i}`, the middle threshold exactly 0):
//! - the mass `F(u) = ∫₀ᵘ (1 − t²)^((d−3)/2) dt` from a cumulative table on a uniform grid of
//!   [`CELLS`] cells over `[0, L]`, `L = min(1, 40/√d)` (the mass beyond 40 standard
//!   deviations is below e^−800), plus 3-point Gauss–Legendre on the partial cell;
//! - the first moment in closed form, `∫ₐᵇ t (1 − t²)^((d−3)/2) dt = (φ(a) − φ(b)) / (d − 1)`
//!   with `φ(u) = (1 − u²)^((d−1)/2)`;
//! - iterations until no level moves by more than [`TOLERANCE`] standard deviations.
//!
//! [`levels`] caches each `(d, bits)` table for the process (a few milliseconds each).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Grid cells of the cumulative mass table over `[0, L]`.
pub const CELLS: usize = 1 << 14;
/// Convergence tolerance of the Lloyd iterations, in standard deviations (1/√d) of a
/// coordinate.
pub const TOLERANCE: f64 = 1e-13;
/// Code widths whose stored levels lie on an int8 grid ([`LevelTable::grid_log2`]): 8 levels
/// or fewer, so that one PRMT looks up four of them. Rounding moves a level by at most half a
/// grid step (below 2.5% of the smallest level at head dim 64 to 256), which changes the
/// distortion by well under 0.1% (the error is flat at the optimum).
pub const INT8_GRID_BITS: u32 = 3;
/// Iterations after which [`levels`] gives up (never reached for 1 to 8 bits at d ≥ 8).
const MAX_ITERATIONS: usize = 1_000_000;

/// One level table: `E = 2^bits` levels for head dim `d`.
#[derive(Clone, Debug, PartialEq)]
pub struct LevelTable {
    pub d: usize,
    pub bits: u32,
    /// ℓ_0 < … < ℓ_{E−1}, f64.
    pub levels: Vec<f64>,
    /// The levels as stored and used by encode and decode (the side table `levels`). Up to
    /// [`INT8_GRID_BITS`] bits they are the Lloyd–Max levels rounded to integers times
    /// `2^−grid_log2`, the integers within ±127 (see [`LevelTable::grid_log2`]).
    pub levels_f32: Vec<f32>,
    /// `k` where every stored level is an integer in [−127, 127] times `2^−k` (the largest such
    /// `k`, so the outermost level's integer lies in [64, 127]): the decode scores such keys on
    /// integer tensor cores (int8 levels against an int8 query). `None` above
    /// [`INT8_GRID_BITS`] bits, where the levels are the f32 Lloyd–Max values.
    pub grid_log2: Option<u32>,
    /// τ_i = (ℓ_i + ℓ_{i+1}) / 2 in f32 from the f32 levels, `E − 1` of them.
    pub thresholds_f32: Vec<f32>,
    /// Mean squared error per coordinate, E[(u − Q(u))²] (the coordinate's variance is 1/d).
    pub distortion: f64,
    /// Lloyd iterations taken.
    pub iterations: usize,
}

impl LevelTable {
    /// The relative squared error of a unit vector, `d · distortion`.
    pub fn nmse(&self) -> f64 {
        self.d as f64 * self.distortion
    }
}

/// The Lloyd–Max table of `2^bits` levels at head dim `d`, computed once per process.
///
/// # Panics
/// If `bits` is not 1 to 8 or `d` < 4 (the density is not bounded below d = 3); spec
/// validation admits only 2 to 4 bits and head dims 64, 128, 256.
pub fn levels(d: usize, bits: u32) -> &'static LevelTable {
    static CACHE: OnceLock<Mutex<HashMap<(usize, u32), &'static LevelTable>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(t) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&(d, bits)) {
        return t;
    }
    // Computed outside the lock; a racing thread computes the same table and one is kept. The
    // tables are leaked: a process asks for a handful of (d, bits) pairs.
    let table: &'static LevelTable = Box::leak(Box::new(compute(d, bits)));
    cache.lock().unwrap_or_else(|e| e.into_inner()).entry((d, bits)).or_insert(table)
}

/// The density's mass and first moment on `[0, L]` at one head dim (unnormalised).
struct Density {
    /// (d − 3) / 2 and (d − 1) / 2.
    m: f64,
    m1: f64,
    d: f64,
    h: f64,
    /// `cum[i] = F(i·h)`.
    cum: Vec<f64>,
}

const GL3: [(f64, f64); 3] = [(-0.774_596_669_241_483_4, 5.0 / 9.0), (0.0, 8.0 / 9.0), (0.774_596_669_241_483_4, 5.0 / 9.0)];

impl Density {
    fn new(d: usize) -> Density {
        let df = d as f64;
        let l = (40.0 / df.sqrt()).min(1.0);
        let h = l / CELLS as f64;
        let mut den = Density { m: (df - 3.0) / 2.0, m1: (df - 1.0) / 2.0, d: df, h, cum: Vec::with_capacity(CELLS + 1) };
        let mut acc = 0.0;
        den.cum.push(0.0);
        for i in 0..CELLS {
            acc += den.gl3(i as f64 * h, (i + 1) as f64 * h);
            den.cum.push(acc);
        }
        den
    }
    fn upper(&self) -> f64 {
        self.h * CELLS as f64
    }
    fn w(&self, t: f64) -> f64 {
        (self.m * (-t * t).ln_1p()).exp()
    }
    fn phi(&self, t: f64) -> f64 {
        (self.m1 * (-t * t).ln_1p()).exp()
    }
    fn gl3(&self, a: f64, b: f64) -> f64 {
        let (mid, half) = ((a + b) / 2.0, (b - a) / 2.0);
        GL3.iter().map(|&(x, wt)| wt * self.w(mid + half * x)).sum::<f64>() * half
    }
    /// Mass on `[0, u]`, `u` in `[0, L]`.
    fn mass(&self, u: f64) -> f64 {
        let i = ((u / self.h) as usize).min(CELLS - 1);
        self.cum[i] + self.gl3(i as f64 * self.h, u)
    }
    /// First moment on `[a, b]`.
    fn moment(&self, a: f64, b: f64) -> f64 {
        (self.phi(a) - self.phi(b)) / (self.d - 1.0)
    }
}

fn compute(d: usize, bits: u32) -> LevelTable {
    assert!((1..=8).contains(&bits), "Lloyd–Max levels of 1 to 8 bits, not {bits}");
    assert!(d >= 4, "Lloyd–Max levels of a unit vector's coordinate need head_dim ≥ 4, not {d}");
    let den = Density::new(d);
    let sigma = 1.0 / (d as f64).sqrt();
    let half = (1usize << bits) / 2;
    let upper = den.upper();
    let total = den.mass(upper);
    // Positive levels p_0 < … < p_{K−1}, starting evenly spread over 3σ.
    let mut p: Vec<f64> = (0..half).map(|i| sigma * 3.0 * (i as f64 + 0.5) / half as f64).collect();
    let bounds = |p: &[f64]| -> Vec<f64> {
        let mut b = Vec::with_capacity(half + 1);
        b.push(0.0);
        b.extend(p.windows(2).map(|w| (w[0] + w[1]) / 2.0));
        b.push(upper);
        b
    };
    let mut iterations = 0;
    loop {
        let b = bounds(&p);
        let next: Vec<f64> = (0..half).map(|i| den.moment(b[i], b[i + 1]) / (den.mass(b[i + 1]) - den.mass(b[i]))).collect();
        let moved = p.iter().zip(&next).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        p = next;
        iterations += 1;
        if moved <= TOLERANCE * sigma {
            break;
        }
        assert!(iterations < MAX_ITERATIONS, "Lloyd–Max levels at d {d}, {bits} bits did not converge");
    }
    // Distortion per coordinate: E[u²] − Σ P_i ℓ_i² at the centroids (E[u²] = 1/d).
    let b = bounds(&p);
    let explained: f64 = (0..half).map(|i| p[i] * p[i] * (den.mass(b[i + 1]) - den.mass(b[i]))).sum::<f64>() / total;
    let distortion = 1.0 / d as f64 - explained;
    let levels: Vec<f64> = p.iter().rev().map(|x| -x).chain(p.iter().copied()).collect();
    let grid_log2 = (bits <= INT8_GRID_BITS).then(|| int8_grid(p[half - 1]));
    let levels_f32: Vec<f32> = match grid_log2 {
        Some(k) => levels.iter().map(|&x| ((x * f64::from(1u32 << k)).round() / f64::from(1u32 << k)) as f32).collect(),
        None => levels.iter().map(|&x| x as f32).collect(),
    };
    let thresholds_f32 = levels_f32.windows(2).map(|w| (w[0] + w[1]) * 0.5).collect();
    LevelTable { d, bits, levels, levels_f32, grid_log2, thresholds_f32, distortion, iterations }
}

/// The largest `k` with `round(top · 2^k) ≤ 127`, `top` the outermost level (then that
/// integer is at least 64).
fn int8_grid(top: f64) -> u32 {
    let mut k = 0;
    while (top * f64::from(1u32 << (k + 1))).round() <= 127.0 {
        k += 1;
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gaussian N(0, 1) Lloyd–Max positive levels and distortions (Max 1960).
    const GAUSSIAN: [(u32, &[f64], f64); 3] = [(2, &[0.4528, 1.510], 0.1175), (3, &[0.2451, 0.7560, 1.344, 2.152], 0.03454), (4, &[0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733], 0.009497)];

    #[test]
    fn symmetric_and_increasing() {
        for d in [64, 128, 256] {
            for bits in 1..=4 {
                let t = levels(d, bits);
                let e = 1usize << bits;
                assert_eq!(t.levels.len(), e);
                assert_eq!(t.thresholds_f32.len(), e - 1);
                assert!(t.levels.windows(2).all(|w| w[0] < w[1]), "d {d} bits {bits}: {:?}", t.levels);
                assert!(t.levels_f32.windows(2).all(|w| w[0] < w[1]));
                for i in 0..e {
                    assert_eq!(t.levels[i], -t.levels[e - 1 - i]);
                    assert_eq!(t.levels_f32[i], -t.levels_f32[e - 1 - i]);
                }
                assert_eq!(t.thresholds_f32[e / 2 - 1], 0.0);
                assert!(t.levels[e - 1] < 1.0 && t.levels[0] > -1.0);
            }
        }
    }

    #[test]
    fn distortion_decreases_with_bits() {
        for d in [64, 128, 256] {
            let n: Vec<f64> = (1..=5).map(|b| levels(d, b).nmse()).collect();
            assert!(n.windows(2).all(|w| w[1] < w[0] && w[1] > 0.0), "d {d}: {n:?}");
            // Each bit divides the error by about 4 (3.4 to 3.7 from 2 to 4 bits).
            assert!(n[2] / n[3] > 3.0 && n[3] / n[4] > 3.0, "d {d}: {n:?}");
        }
    }

    /// At large d the coordinate is N(0, 1/d): the levels are Max's Gaussian table / √d.
    #[test]
    fn large_d_gives_the_gaussian_table() {
        let d = 1 << 16;
        for (bits, pos, dist) in GAUSSIAN {
            let t = levels(d, bits);
            let scaled: Vec<f64> = t.levels[t.levels.len() / 2..].iter().map(|x| x * (d as f64).sqrt()).collect();
            for (got, want) in scaled.iter().zip(pos) {
                assert!((got - want).abs() < 1.5e-3, "{bits} bits: {scaled:?} vs {pos:?}");
            }
            assert!((t.nmse() - dist).abs() < 2e-3 * dist, "{bits} bits: distortion {} vs {dist}", t.nmse());
        }
    }

    /// At d = 256 the table is within 1% of the Gaussian one (the density is slightly lighter
    /// tailed: its levels sit slightly inside).
    #[test]
    fn head_dim_256_is_close_to_gaussian() {
        let d = 256;
        for (bits, pos, dist) in GAUSSIAN {
            let t = levels(d, bits);
            let scaled: Vec<f64> = t.levels[t.levels.len() / 2..].iter().map(|x| x * 16.0).collect();
            for (got, want) in scaled.iter().zip(pos) {
                assert!((got / want - 1.0).abs() < 0.01, "{bits} bits at d 256: {scaled:?} vs {pos:?}");
            }
            assert!((t.nmse() / dist - 1.0).abs() < 0.02, "{bits} bits: {} vs {dist}", t.nmse());
        }
    }

    /// The distortion formula agrees with a direct sum over the density at d = 64.
    #[test]
    fn distortion_matches_direct_integration() {
        let (d, bits) = (64, 3);
        let t = levels(d, bits);
        let n = 400_000;
        let (mut num, mut den) = (0.0, 0.0);
        for i in 0..n {
            let u = -1.0 + (i as f64 + 0.5) * 2.0 / n as f64;
            let w = (1.0 - u * u).powf((d as f64 - 3.0) / 2.0);
            let q = t.levels.iter().copied().min_by(|a, b| (a - u).abs().total_cmp(&(b - u).abs())).unwrap();
            num += w * (u - q) * (u - q);
            den += w;
        }
        assert!((num / den / t.distortion - 1.0).abs() < 1e-6, "{} vs {}", num / den, t.distortion);
    }

    /// Up to 3 bits the stored levels are distinct integers within ±127 times 2^−k, the
    /// outermost at least 64, each within half a grid step of its Lloyd–Max level.
    #[test]
    fn narrow_levels_lie_on_an_int8_grid() {
        for d in [64, 128, 256] {
            for bits in 1..=4 {
                let t = levels(d, bits);
                let Some(k) = t.grid_log2 else {
                    assert!(bits > INT8_GRID_BITS);
                    continue;
                };
                let ints: Vec<f64> = t.levels_f32.iter().map(|&l| f64::from(l) * f64::from(1u32 << k)).collect();
                assert!(ints.iter().all(|x| x.fract() == 0.0 && x.abs() <= 127.0), "d {d} bits {bits}: {ints:?}");
                assert!(ints[ints.len() - 1] >= 64.0, "d {d} bits {bits}: {ints:?}");
                assert!(ints.windows(2).all(|w| w[0] < w[1]));
                for (l, x) in t.levels.iter().zip(&ints) {
                    assert!((l * f64::from(1u32 << k) - x).abs() <= 0.5);
                }
            }
        }
    }

    #[test]
    fn cached_tables_are_shared() {
        assert!(std::ptr::eq(levels(128, 3), levels(128, 3)));
    }
}
