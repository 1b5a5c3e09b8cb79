//! Uniform random unit vectors (normalised Gaussians, ChaCha8): the placeholder sample set
//! codebooks are trained on and the directions the spherical distortion proxy averages over.
//! Deterministic for a seed, f64 arithmetic in a fixed order.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Norms below this are treated as zero vectors (they have no direction).
const ZERO_NORM: f64 = 1e-12;

fn norm(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

/// A standard normal sample.
pub fn gaussian(rng: &mut ChaCha8Rng) -> f64 {
    // Box–Muller; 1 - U is in (0, 1], so the log is finite.
    let u1: f64 = 1.0 - rng.gen::<f64>();
    let u2: f64 = rng.gen::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A unit vector of `group` channels, uniform on the sphere.
pub fn random_unit(rng: &mut ChaCha8Rng, group: usize) -> Vec<f64> {
    loop {
        let x: Vec<f64> = (0..group).map(|_| gaussian(rng)).collect();
        let n = norm(&x);
        if n > ZERO_NORM {
            return x.iter().map(|v| v / n).collect();
        }
    }
}

/// `n` unit vectors of `group` channels drawn uniformly from the sphere (normalised
/// Gaussians), row-major `[n][group]`.
pub fn uniform_unit_samples(n: usize, group: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).flat_map(|_| random_unit(&mut rng, group)).map(|x| x as f32).collect()
}
