//! Spherical codebooks: spherical k-means over sample key groups, and uniform random unit
//! vectors as the placeholder sample set until real keys are available.
//!
//! Both are deterministic for a seed (ChaCha8, f64 arithmetic in a fixed order), so a shipped
//! codebook can be regenerated bit for bit from the seed in its metadata.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// The uniform sampler is the spherical codec's (its distortion proxy samples it too).
#[cfg(test)]
use kvforge_spec::codecs::spherical::sampling::gaussian;
use kvforge_spec::codecs::spherical::sampling::random_unit;
pub use kvforge_spec::codecs::spherical::sampling::uniform_unit_samples;

/// Norms below this are treated as zero vectors (they have no direction).
const ZERO_NORM: f64 = 1e-12;

fn norm(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Trains `entries` unit codewords of `group` channels (`[entries][group]`, f32) on `samples`
/// (`[n][group]`, n = `samples.len() / group`) by spherical k-means: samples are normalised
/// (zero samples are skipped: they have no direction), each is assigned to the codeword of
/// largest cosine (lowest index on ties), and each codeword becomes its cluster's renormalised
/// mean. Initial codewords are distinct samples picked by the seeded generator (random unit
/// vectors when there are fewer samples than entries). A cluster left empty (or whose mean is
/// zero) is re-seeded with the sample farthest from its own codeword (lowest cosine, lowest
/// index on ties, each sample used once per iteration), which spends unused codewords where
/// the codebook fits worst. Stops after `iters` iterations or when assignments settle.
///
/// # Panics
/// If `group` or `entries` is 0.
pub fn train_codebook(samples: &[f32], group: usize, entries: usize, seed: u64, iters: usize) -> Vec<f32> {
    assert!(group > 0 && entries > 0, "train_codebook: group ({group}) and entries ({entries}) must be positive");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let points: Vec<Vec<f64>> = samples
        .chunks_exact(group)
        .filter_map(|s| {
            let x: Vec<f64> = s.iter().map(|&v| f64::from(v)).collect();
            let n = norm(&x);
            (n > ZERO_NORM && n.is_finite()).then(|| x.iter().map(|v| v / n).collect())
        })
        .collect();
    let n = points.len();

    let mut order: Vec<usize> = (0..n).collect();
    let picked = entries.min(n);
    for i in 0..picked {
        let j = rng.gen_range(i..n);
        order.swap(i, j);
    }
    let mut words: Vec<Vec<f64>> = order[..picked].iter().map(|&i| points[i].clone()).collect();
    while words.len() < entries {
        words.push(random_unit(&mut rng, group));
    }

    let mut assign = vec![usize::MAX; n];
    let mut cosine = vec![0f64; n];
    for _ in 0..iters {
        let mut changed = false;
        for (p, x) in points.iter().enumerate() {
            let (best, sim) = words.iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (e, w)| {
                let s = dot(x, w);
                if s > b.1 {
                    (e, s)
                } else {
                    b
                }
            });
            changed |= assign[p] != best;
            assign[p] = best;
            cosine[p] = sim;
        }
        let mut sums = vec![vec![0f64; group]; entries];
        for (x, &a) in points.iter().zip(&assign) {
            sums[a].iter_mut().zip(x).for_each(|(s, v)| *s += v);
        }
        let mut taken = vec![false; n];
        let mut reseeded = false;
        for (w, s) in words.iter_mut().zip(&sums) {
            let len = norm(s);
            if len > ZERO_NORM {
                *w = s.iter().map(|v| v / len).collect();
                continue;
            }
            let farthest = (0..n).filter(|&p| !taken[p]).fold(None, |b: Option<usize>, p| match b {
                Some(q) if cosine[q] <= cosine[p] => Some(q),
                _ => Some(p),
            });
            if let Some(p) = farthest {
                taken[p] = true;
                *w = points[p].clone();
                reseeded = true;
            }
        }
        if !changed && !reseeded {
            break;
        }
    }
    words.iter().flatten().map(|&x| x as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_well_separated_directions() {
        // Noisy copies of ±e0, ±e1 in R^2: four codewords land on the four directions.
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut s = Vec::new();
        for i in 0..400 {
            let (x, y) = [(1.0, 0.0), (-1.0, 0.0), (0.0, 1.0), (0.0, -1.0)][i % 4];
            s.push(x + 0.05 * gaussian(&mut rng) as f32);
            s.push(y + 0.05 * gaussian(&mut rng) as f32);
        }
        let cb = train_codebook(&s, 2, 4, 7, 50);
        for target in [[1.0f32, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]] {
            let best = cb.chunks_exact(2).map(|w| w[0] * target[0] + w[1] * target[1]).fold(f32::MIN, f32::max);
            assert!(best > 0.99, "no codeword near {target:?}: {cb:?}");
        }
    }

    #[test]
    fn fewer_samples_than_entries_still_fills_the_codebook() {
        let cb = train_codebook(&[1.0, 0.0, 0.0, 0.0], 2, 8, 3, 10);
        assert_eq!(cb.len(), 16);
        for w in cb.chunks_exact(2) {
            assert!(((w[0] * w[0] + w[1] * w[1]).sqrt() - 1.0).abs() < 1e-6);
        }
    }
}
