//! Step allocations (`calibrate --step`): entropy-constrained scalar quantisation of the
//! decorrelated coordinates. Every coordinate of a side is quantised with one step `Δ`, centred
//! on zero, and its codes are range-coded against a model of that coordinate
//! ([`crate::model`], the `rans` coder). For the squared error under an entropy budget this is
//! the classic optimum: at a uniform step every coordinate sits at the same slope of its
//! rate–distortion curve (`dD/dR = −Δ²·ln 2 / 6`), so no bit is worth more elsewhere, and a
//! coordinate whose variance is well under the step is dropped. Unlike per-token ranges
//! ([`crate::quant::Fit::Clip`], [`crate::quant::Fit::MinMax`]) the step needs no per-token
//! shift and scale, so the 32 bits a group paid per token go to codes.
//!
//! The models: each coordinate's values divided by its standard deviation follow about one
//! shape per band of components ([`BANDS`] bands by variance rank); a band's shape is the
//! empirical distribution of its standardised calibration values (mixed with 1% of a unit
//! Laplace for the tails no sample reached). Coordinate `j`'s model is that shape quantised at
//! the step `Δ / σ_j`; its width covers the band's largest value. `Δ` is the smallest step
//! whose models' entropies fit the budget.
//!
//! The allocation is ordinary groups (runs of kept coordinates of one width, [`Fit::Step`]),
//! so packing, the container, the CPU unpack and the GPU restore are those of every
//! allocation; only `rans` knows the scales are constants and does not store them.

use rayon::prelude::*;

use crate::alloc::{allocation_error, Allocation, Group};
use crate::model::{fixed_point, group_bits, MAX_MODEL_BITS};
use crate::quant::Fit;

/// Bands of components with a shape of their own.
pub const BANDS: usize = 8;

/// Weight of the unit Laplace mixed into each band's shape.
const TAIL_WEIGHT: f64 = 0.01;

/// Points of the per-band distortion and entropy tables over `log s`.
const GRID: usize = 320;
const S_MIN: f64 = 1e-4;
const S_MAX: f64 = 1e2;
/// Below this step the entropy follows the high-resolution law `H(s) = H(S_EXACT) + log2(S_EXACT / s)`.
const S_EXACT: f64 = 0.02;

/// One band's standardised distribution and its tables.
struct Shape {
    /// Sorted standardised values.
    z: Vec<f64>,
    /// Largest |z| (the width of a coordinate's codes covers it).
    zmax: f64,
    /// Mean squared error of `z` quantised at step `s` (grid over `log s`).
    dist: Vec<f64>,
    /// Entropy in bits of `z` quantised at step `s` (the model's, same grid).
    ent: Vec<f64>,
    /// The encoder's dead zone in steps ([`crate::quant::step_code`]).
    dead_zone: f64,
}

fn laplace_cdf(t: f64) -> f64 {
    let b = std::f64::consts::FRAC_1_SQRT_2;
    if t < 0.0 {
        0.5 * (t / b).exp()
    } else {
        1.0 - 0.5 * (-t / b).exp()
    }
}

fn grid_s(i: usize) -> f64 {
    (S_MIN.ln() + (S_MAX / S_MIN).ln() * i as f64 / (GRID - 1) as f64).exp()
}

/// The signed code of `u` (in steps) with a dead zone: `|u|` rounded with thresholds `dead_zone`
/// further from zero than the midpoints ([`crate::quant::step_code`] without the offset).
fn dz_round(u: f64, dead_zone: f64) -> f64 {
    if dead_zone == 0.0 {
        return u.round();
    }
    (u.abs() + 0.5 - dead_zone).max(0.0).floor().copysign(u)
}

/// The upper end (in steps) of signed code `c`'s interval with a dead zone.
fn upper(c: f64, dead_zone: f64) -> f64 {
    c + 0.5 + if c >= 0.0 { dead_zone } else { -dead_zone }
}

impl Shape {
    fn new(mut z: Vec<f64>, dead_zone: f64) -> Self {
        z.sort_by(f64::total_cmp);
        let zmax = z.iter().fold(1.0f64, |m, &v| m.max(v.abs()));
        let mut s = Shape { z, zmax, dist: Vec::new(), ent: Vec::new(), dead_zone };
        let (dist, ent): (Vec<f64>, Vec<f64>) = (0..GRID)
            .into_par_iter()
            .map(|i| {
                let st = grid_s(i);
                let d = s.z.iter().map(|&v| (v - st * dz_round(v / st, dead_zone)).powi(2)).sum::<f64>() / s.z.len().max(1) as f64;
                (d, s.exact_entropy(st.max(S_EXACT)) + (S_EXACT / st).log2().max(0.0))
            })
            .unzip();
        (s.dist, s.ent) = (dist, ent);
        s
    }

    /// Entropy in bits at step `s`, summed over every code the shape reaches.
    fn exact_entropy(&self, s: f64) -> f64 {
        let h = (1.0 + (self.zmax + 8.0) / s).ceil() as i64;
        let mut prev = self.cdf(upper(-(h as f64) - 1.0, self.dead_zone) * s);
        let mut e = 0.0;
        for c in -h..=h {
            let f = self.cdf(upper(c as f64, self.dead_zone) * s);
            let p = f - prev;
            if p > 0.0 {
                e -= p * p.log2();
            }
            prev = f;
        }
        e
    }

    /// The shape's distribution function: the empirical one of `z` (linear between order
    /// statistics) mixed with [`TAIL_WEIGHT`] of a unit Laplace.
    fn cdf(&self, t: f64) -> f64 {
        let n = self.z.len();
        let emp = if n == 0 {
            laplace_cdf(t)
        } else {
            let i = self.z.partition_point(|&v| v < t);
            if i == 0 {
                0.0
            } else if i == n {
                1.0
            } else {
                let (a, b) = (self.z[i - 1], self.z[i]);
                let f = if b > a { (t - a) / (b - a) } else { 0.5 };
                (i as f64 - 0.5 + f) / n as f64
            }
        };
        (1.0 - TAIL_WEIGHT) * emp + TAIL_WEIGHT * laplace_cdf(t)
    }

    fn table(&self, t: &[f64], s: f64) -> f64 {
        let x = ((s.clamp(S_MIN, S_MAX) / S_MIN).ln() / (S_MAX / S_MIN).ln() * (GRID - 1) as f64).min((GRID - 1) as f64 - 1e-9);
        let i = x.floor() as usize;
        t[i] + (t[i + 1] - t[i]) * (x - i as f64)
    }

    /// Mean squared error at step `s` (in standard deviations).
    fn distortion(&self, s: f64) -> f64 {
        if s >= S_MAX {
            return 1.0;
        }
        self.table(&self.dist, s)
    }

    /// Entropy in bits at step `s`.
    fn entropy(&self, s: f64) -> f64 {
        if s >= S_MAX {
            return 0.0;
        }
        self.table(&self.ent, s)
    }

    /// Code width for step `s`: codes `−2^(b−1) … 2^(b−1) − 1` cover `±zmax`.
    fn bits(&self, s: f64) -> u8 {
        let need = (self.zmax / s).ceil() + 1.0;
        let mut b = 2u8;
        while b < MAX_MODEL_BITS && ((1u64 << (b - 1)) as f64) < need {
            b += 1;
        }
        b
    }

    /// The model of a coordinate quantised at step `s` with `bits`-bit codes.
    fn model(&self, s: f64, bits: u8) -> Vec<u32> {
        let k = 1usize << bits;
        let h = (k / 2) as f64;
        let mut p = Vec::with_capacity(k);
        let mut prev = 0.0;
        for c in 0..k {
            let f = if c + 1 == k { 1.0 } else { self.cdf(upper(c as f64 - h, self.dead_zone) * s) };
            p.push(f - prev);
            prev = f;
        }
        fixed_point(&p)
    }

    /// Whether coding a coordinate at step `s` is worth its bits at the slope of the step.
    fn keep(&self, s: f64) -> bool {
        let h = self.entropy(s);
        h > 1e-3 && (1.0 - self.distortion(s)) / (s * s) >= std::f64::consts::LN_2 / 6.0 * h
    }
}

/// The shapes of `BANDS` bands of the `comps` coordinates (`data`, `rows × comps`, standard
/// deviations `sigma`) for a quantiser with `dead_zone`.
fn shapes(data: &[f64], rows: usize, comps: usize, sigma: &[f64], dead_zone: f64) -> Vec<Shape> {
    (0..BANDS)
        .into_par_iter()
        .map(|b| {
            let (lo, hi) = (b * comps / BANDS, (b + 1) * comps / BANDS);
            let z: Vec<f64> = (0..rows).flat_map(|r| (lo..hi).filter(|&j| sigma[j] > 0.0).map(move |j| data[r * comps + j] / sigma[j])).collect();
            Shape::new(z, dead_zone)
        })
        .collect()
}

fn band(j: usize, comps: usize) -> usize {
    (j * BANDS / comps.max(1)).min(BANDS - 1)
}

/// Estimated coded bits per token of the kept coordinates at step `delta`.
fn estimate(shapes: &[Shape], sigma: &[f64], delta: f64) -> f64 {
    let comps = sigma.len();
    sigma
        .iter()
        .enumerate()
        .filter(|(_, &s)| s > 0.0)
        .map(|(j, &s)| {
            let sh = &shapes[band(j, comps)];
            let st = delta / s;
            if sh.keep(st) {
                sh.entropy(st)
            } else {
                0.0
            }
        })
        .sum()
}

/// The allocation at step `delta` (rounded to fp16): kept coordinates in runs of one width,
/// no run crossing `breaks`.
fn at_step(shapes: &[Shape], sigma: &[f64], delta: f32, breaks: &[usize], budget_bits: usize, dead_zone: f32) -> Allocation {
    let comps = sigma.len();
    let d = half::f16::from_f32(delta).to_f64();
    let coord: Vec<Option<(u8, Vec<u32>)>> = (0..comps)
        .into_par_iter()
        .map(|j| {
            let sh = &shapes[band(j, comps)];
            if !(sigma[j] > 0.0) || !sh.keep(d / sigma[j]) {
                return None;
            }
            let st = d / sigma[j];
            let mut b = sh.bits(st);
            // lo = −2^(b−1)·Δ must be an fp16 value
            while b > 2 && (2f64.powi(b as i32 - 1) * d) > 65504.0 {
                b -= 1;
            }
            Some((b, sh.model(st, b)))
        })
        .collect();
    let mut groups: Vec<Group> = Vec::new();
    let mut models: Vec<Vec<u32>> = Vec::new();
    for (j, c) in coord.into_iter().enumerate() {
        let Some((b, m)) = c else { continue };
        match groups.last_mut() {
            Some(g) if g.bits == b && (g.start + g.len) as usize == j && !breaks.contains(&j) => {
                g.len += 1;
                models.last_mut().expect("a model per group").extend(m);
            }
            _ => {
                groups.push(Group { start: j as u32, len: 1, bits: b, fit: Fit::Step });
                models.push(m);
            }
        }
    }
    Allocation { budget_bits: budget_bits as u32, groups, expected_error: f64::NAN, models, step: half::f16::from_f64(d).to_f32(), dead_zone }
}

/// The step allocation for `budget_bits` coded bits per token of the coordinates `data`
/// (`rows × comps`, the DP's rows) with standard deviations `sigma` (from the PCA, which saw
/// more positions than the rows): the smallest fp16 step whose models' expected size fits.
/// The encoder rounds with `dead_zone` ([`crate::quant::step_code`]; 0: to nearest); the
/// models, the step and the drop rule are those of that quantiser.
pub fn allocation(data: &[f64], rows: usize, comps: usize, sigma: &[f64], budget_bits: usize, breaks: &[usize], dead_zone: f32) -> Allocation {
    assert_eq!((data.len(), sigma.len()), (rows * comps, comps));
    let shapes = shapes(data, rows, comps, sigma, dead_zone as f64);
    let smax = sigma.iter().fold(0.0f64, |m, &s| m.max(s));
    if budget_bits == 0 || smax <= 0.0 {
        return Allocation { budget_bits: budget_bits as u32, groups: Vec::new(), expected_error: allocation_error(data, rows, comps, &Allocation::default()), models: Vec::new(), step: 0.0, dead_zone };
    }
    // bisection on log Δ over the tables' estimate, then up in fp16 steps until the models fit
    let (mut lo, mut hi) = ((smax * 1e-4).ln(), (smax * S_MAX).ln());
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if estimate(&shapes, sigma, mid.exp()) > budget_bits as f64 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let mut delta = hi.exp() as f32;
    let mut a = at_step(&shapes, sigma, delta, breaks, budget_bits, dead_zone);
    for _ in 0..64 {
        let cost: f64 = a.groups.iter().zip(&a.models).map(|(g, m)| group_bits(g, m)).sum();
        if cost <= budget_bits as f64 || a.groups.is_empty() {
            break;
        }
        delta *= 1.0 + 0.5 * (cost / budget_bits as f64 - 1.0).max(0.002) as f32;
        a = at_step(&shapes, sigma, delta, breaks, budget_bits, dead_zone);
    }
    a.expected_error = allocation_error(data, rows, comps, &a);
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::{Dp, DpConfig};
    use rand::{Rng, SeedableRng};

    /// On Gaussian coordinates of decaying variance, the step allocation fits its budget in
    /// expected coded bits, its rANS size is about that, and it reaches less error than the
    /// coded DP at the same budget.
    #[test]
    fn step_fits_the_budget_and_beats_the_coded_dp() {
        let (rows, comps) = (512, 256);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let sd: Vec<f64> = (0..comps).map(|j| 10.0 / (1.0 + j as f64).powf(0.6)).collect();
        let gauss = |rng: &mut rand_chacha::ChaCha8Rng| (0..12).map(|_| rng.gen_range(-0.5..0.5)).sum::<f64>();
        let d: Vec<f64> = (0..rows * comps).map(|k| gauss(&mut rng) * sd[k % comps]).collect();
        let coded = DpConfig { coded: true, group_sizes: vec![1, 16, 64], ..DpConfig::default() };
        let dp = Dp::solve(&d, rows, comps, &coded, 2 * comps, &[]);
        for budget in [comps / 2, comps, 2 * comps] {
            let a = allocation(&d, rows, comps, &sd, budget, &[64], 0.0);
            a.validate(comps, 16).unwrap();
            assert!(a.groups.iter().all(|g| g.fit == Fit::Step && !(g.start < 64 && g.start + g.len > 64)));
            let e = a.expected_coded_bits();
            assert!(e <= budget as f64 && e >= 0.9 * budget as f64, "budget {budget}: expected {e}");
            // measured: rANS on fresh tokens of the same source
            let n = 200;
            let fresh: Vec<f64> = (0..n * comps).map(|k| gauss(&mut rng) * sd[k % comps]).collect();
            let raw = crate::pack::encode(&fresh, n, comps, &a);
            let coded_bytes = crate::model::encode(&raw, n, &a).unwrap().len();
            let per_token = 8.0 * coded_bytes as f64 / n as f64;
            assert!(per_token <= 1.06 * budget as f64, "budget {budget}: {per_token} bits per token coded");
            let mut back = vec![0u8; raw.len()];
            crate::model::decode_into(&crate::model::encode(&raw, n, &a).unwrap(), n, &a, &mut back).unwrap();
            assert_eq!(back, raw);
            let dp_err = dp.best_error(budget);
            assert!(a.expected_error < 0.9 * dp_err, "budget {budget}: step {} vs coded DP {dp_err}", a.expected_error);
        }
    }

    /// On Laplacian coordinates a dead zone keeps the budget (expected and rANS-measured on
    /// fresh tokens), round-trips through `rans`, and reaches less error than rounding to
    /// nearest at the same coded size.
    #[test]
    fn dead_zone_fits_the_budget_and_lowers_the_error() {
        let (rows, comps) = (1024, 128);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let sd: Vec<f64> = (0..comps).map(|j| 10.0 / (1.0 + j as f64).powf(0.7)).collect();
        // unit-variance Laplace
        let laplace = |rng: &mut rand_chacha::ChaCha8Rng| {
            let u: f64 = rng.gen_range(-0.5..0.5);
            -u.signum() * (1.0 - 2.0 * u.abs()).max(1e-300).ln() * std::f64::consts::FRAC_1_SQRT_2
        };
        let d: Vec<f64> = (0..rows * comps).map(|k| laplace(&mut rng) * sd[k % comps]).collect();
        let n = 400;
        let fresh: Vec<f64> = (0..n * comps).map(|k| laplace(&mut rng) * sd[k % comps]).collect();
        for budget in [comps / 2, comps, 2 * comps] {
            let plain = allocation(&d, rows, comps, &sd, budget, &[], 0.0);
            let dz = allocation(&d, rows, comps, &sd, budget, &[], 0.2);
            dz.validate(comps, 16).unwrap();
            assert_eq!(dz.dead_zone, 0.2);
            let e = dz.expected_coded_bits();
            assert!(e <= budget as f64 && e >= 0.9 * budget as f64, "budget {budget}: expected {e}");
            let raw = crate::pack::encode(&fresh, n, comps, &dz);
            let coded = crate::model::encode(&raw, n, &dz).unwrap();
            let per_token = 8.0 * coded.len() as f64 / n as f64;
            assert!(per_token <= 1.06 * budget as f64, "budget {budget}: {per_token} bits per token coded");
            let mut back = vec![0u8; raw.len()];
            crate::model::decode_into(&coded, n, &dz, &mut back).unwrap();
            assert_eq!(back, raw);
            // the error of fresh tokens, both at the same budget
            let err = |a: &Allocation| allocation_error(&fresh, n, comps, a);
            assert!(err(&dz) < 0.97 * err(&plain), "budget {budget}: dead zone {} vs nearest {}", err(&dz), err(&plain));
        }
    }
}
