//! The seeded random-sign Hadamard rotation of the `rotated` scheme ([`super`]):
//! `R = (1/√d) · H · diag(s)`, `H` the d×d Sylvester Hadamard matrix
//! (unnormalised ±1, `H·H = d·I`), `s ∈ {±1}^d` signs drawn from the seed by a fixed integer
//! hash. `R` is orthogonal, so `q·k = (Rq)·(Rk)` and `Σ p_t v_t = Rᵀ Σ p_t (R v_t)`.
//!
//! Not behind the `reference` feature: the runtime rotates every appended key and value row
//! with [`rotate`] (f32, before rounding to the spec dtype), and the f64 reference calls the
//! same function, so host and reference store the same bits.
//!
//! Order of operations (the f32 results depend on it): `rotate` multiplies by the signs, runs
//! the in-place fast Walsh–Hadamard transform (butterfly spans 1, 2, 4, …, d/2; in each block
//! of `2·len`, `(a, b) ← (a + b, a − b)` for the pairs `(i, i + len)`), then multiplies by
//! [`inv_sqrt`]`(d)` (f64: the f64 `1/√d`); `unrotate` runs the transform, multiplies by
//! `1/√d`, then by the signs.

use std::ops::{Add, Mul, Neg, Sub};

/// The default seed of a rotated tier (spec field `seed`).
pub const DEFAULT_SEED: u32 = 0x5EED;

/// Sign `s_c` (±1) of channel `c` under `seed`.
pub fn sign(seed: u32, c: usize) -> i8 {
    let mut h = (c as u32) ^ seed.wrapping_mul(0x9E37_79B9);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^= h >> 16;
    if h & 1 == 1 {
        -1
    } else {
        1
    }
}

/// The `d` signs of `seed`.
pub fn signs(seed: u32, d: usize) -> Vec<i8> {
    (0..d).map(|c| sign(seed, c)).collect()
}

/// Whether `d` is a head dim the rotation serves (a power of two, at least 2).
pub fn rotatable(d: usize) -> bool {
    d >= 2 && d.is_power_of_two()
}

/// `1/√d` as the rotation multiplies by it: the f64 value rounded once to f32 (exact for
/// 64 and 256; `0.088388346f32` at 128). The device side uses the same constant.
pub fn inv_sqrt(d: usize) -> f32 {
    (1.0 / (d as f64).sqrt()) as f32
}

/// The arithmetic the transform needs, for f32 and f64.
pub trait Elem: Copy + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Neg<Output = Self> {
    /// `1/√d` in this precision ([`inv_sqrt`] for f32).
    fn inv_sqrt(d: usize) -> Self;
}

impl Elem for f32 {
    fn inv_sqrt(d: usize) -> f32 {
        inv_sqrt(d)
    }
}

impl Elem for f64 {
    fn inv_sqrt(d: usize) -> f64 {
        1.0 / (d as f64).sqrt()
    }
}

/// In-place unnormalised fast Walsh–Hadamard transform (`x ← H x`).
fn fwht<T: Elem>(x: &mut [T]) {
    let d = x.len();
    let mut len = 1;
    while len < d {
        for block in (0..d).step_by(2 * len) {
            for i in block..block + len {
                let (a, b) = (x[i], x[i + len]);
                x[i] = a + b;
                x[i + len] = a - b;
            }
        }
        len *= 2;
    }
}

fn check(x_len: usize) {
    assert!(rotatable(x_len), "the Hadamard rotation needs a power-of-two head_dim, not {x_len}");
}

fn apply_signs<T: Elem>(seed: u32, x: &mut [T]) {
    for (c, v) in x.iter_mut().enumerate() {
        if sign(seed, c) < 0 {
            *v = -*v;
        }
    }
}

/// `x ← R x` for one row (`x.len()` = d, a power of two).
///
/// # Panics
/// If `x.len()` is not a power of two (the spec validation guarantees it for head dims).
pub fn rotate<T: Elem>(seed: u32, x: &mut [T]) {
    check(x.len());
    apply_signs(seed, x);
    fwht(x);
    let s = T::inv_sqrt(x.len());
    x.iter_mut().for_each(|v| *v = *v * s);
}

/// `y ← Rᵀ y` for one row, the inverse of [`rotate`].
///
/// # Panics
/// If `y.len()` is not a power of two.
pub fn unrotate<T: Elem>(seed: u32, y: &mut [T]) {
    check(y.len());
    fwht(y);
    let s = T::inv_sqrt(y.len());
    y.iter_mut().for_each(|v| *v = *v * s);
    apply_signs(seed, y);
}

/// [`rotate`] on every row of `[n][d]` `rows`.
pub fn rotate_rows<T: Elem>(seed: u32, d: usize, rows: &mut [T]) {
    rows.chunks_exact_mut(d).for_each(|r| rotate(seed, r));
}

/// [`unrotate`] on every row of `[n][d]` `rows`.
pub fn unrotate_rows<T: Elem>(seed: u32, d: usize, rows: &mut [T]) {
    rows.chunks_exact_mut(d).for_each(|r| unrotate(seed, r));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(d: usize, salt: u64) -> Vec<f64> {
        let mut s = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..d)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect()
    }

    fn dot(a: &[f64], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// The columns of R (rotations of the unit vectors) are orthonormal.
    #[test]
    fn rotation_is_orthogonal() {
        for d in [64, 128, 256] {
            let cols: Vec<Vec<f64>> = (0..d)
                .map(|i| {
                    let mut e = vec![0f64; d];
                    e[i] = 1.0;
                    rotate(DEFAULT_SEED, &mut e);
                    e
                })
                .collect();
            for i in 0..d {
                for j in 0..d {
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((dot(&cols[i], &cols[j]) - want).abs() < 1e-12, "d {d}: <R e_{i}, R e_{j}>");
                }
            }
        }
    }

    #[test]
    fn unrotate_inverts_rotate_and_keeps_inner_products() {
        for d in [64, 128, 256] {
            for seed in [0, 1, DEFAULT_SEED, u32::MAX] {
                let (x, q) = (row(d, d as u64 + u64::from(seed)), row(d, 7 + u64::from(seed)));
                let (mut y, mut rq) = (x.clone(), q.clone());
                rotate(seed, &mut y);
                rotate(seed, &mut rq);
                assert!((dot(&y, &rq) - dot(&x, &q)).abs() < 1e-12, "d {d} seed {seed}: q·k = Rq·Rk");
                assert!((dot(&y, &y) - dot(&x, &x)).abs() < 1e-12);
                unrotate(seed, &mut y);
                assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1e-14), "d {d} seed {seed}");
                // f32 agrees with f64 to rounding.
                let mut y32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
                rotate(seed, &mut y32);
                let mut y64 = x.clone();
                rotate(seed, &mut y64);
                assert!(y32.iter().zip(&y64).all(|(&a, b)| (f64::from(a) - b).abs() < 1e-5));
            }
        }
    }

    /// R = (1/√d) H diag(s) entry by entry: R[i][j] = s_j (−1)^popcount(i & j) / √d.
    #[test]
    fn rotation_is_sylvester_hadamard_times_signs() {
        let d = 64;
        let s = signs(DEFAULT_SEED, d);
        assert!(s.iter().any(|&v| v < 0) && s.iter().any(|&v| v > 0));
        for j in 0..d {
            let mut e = vec![0f64; d];
            e[j] = 1.0;
            rotate(DEFAULT_SEED, &mut e);
            for (i, &r) in e.iter().enumerate() {
                let h = if (i & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 };
                assert!((r - h * f64::from(s[j]) / 8.0).abs() < 1e-15);
            }
        }
    }

    #[test]
    fn signs_follow_the_contract_hash() {
        // Seeds differ in their signs; a seed's signs are stable (they are in the format).
        assert_ne!(signs(0, 64), signs(1, 64));
        let first: String = signs(DEFAULT_SEED, 16).iter().map(|&s| if s < 0 { '-' } else { '+' }).collect();
        let again: String = (0..16).map(|c| if sign(DEFAULT_SEED, c) < 0 { '-' } else { '+' }).collect();
        assert_eq!(first, again);
        assert_eq!(inv_sqrt(64), 0.125);
        assert_eq!(inv_sqrt(256), 0.0625);
    }
}
