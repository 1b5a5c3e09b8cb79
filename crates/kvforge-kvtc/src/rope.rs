//! Rotary position embedding as Llama-family models in transformers apply it (`rotate_half`:
//! channel `i` pairs with `i + rope_dim/2`, inverse frequency `theta^(-2i/rope_dim)`), so that
//! kvtc can undo it on keys before the transform and re-apply it after restore. Keys differ
//! across positions mostly by this rotation; removing it exposes their low-rank structure.

/// RoPE parameters, named as in transformers' config (`rope_theta`) and GGUF metadata
/// (`llama.rope.freq_base`, `llama.rope.dimension_count`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Base of the inverse frequencies (`rope_theta`; SmolLM2: 100000).
    pub theta: f64,
    /// Leading channels rotated (`rope_dim`, even, ≤ head_dim; the rest pass through).
    pub dim: usize,
}

impl Rope {
    /// Rotates `x` (one head's row of `head_dim` channels) to position `pos`; `sign` -1 undoes it.
    pub fn apply(&self, x: &mut [f64], pos: i64, sign: f64) {
        let half = self.dim / 2;
        for i in 0..half {
            let inv = self.theta.powf(-2.0 * i as f64 / self.dim as f64);
            let (s, c) = (sign * pos as f64 * inv).sin_cos();
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undo_inverts_apply() {
        let r = Rope { theta: 100000.0, dim: 64 };
        let x0: Vec<f64> = (0..64).map(|i| (i as f64 * 0.37).sin()).collect();
        let mut x = x0.clone();
        r.apply(&mut x, 1234, 1.0);
        assert!(x.iter().zip(&x0).any(|(a, b)| (a - b).abs() > 1e-3));
        r.apply(&mut x, 1234, -1.0);
        for (a, b) in x.iter().zip(&x0) {
            assert!((a - b).abs() < 1e-12);
        }
    }

    #[test]
    fn position_zero_is_identity_and_dot_products_are_relative() {
        let r = Rope { theta: 10000.0, dim: 8 };
        let q0: Vec<f64> = (0..8).map(|i| i as f64 - 3.0).collect();
        let k0: Vec<f64> = (0..8).map(|i| (i * i) as f64 * 0.1).collect();
        let mut z = q0.clone();
        r.apply(&mut z, 0, 1.0);
        assert_eq!(z, q0);
        let dot = |m: i64, n: i64| {
            let (mut q, mut k) = (q0.clone(), k0.clone());
            r.apply(&mut q, m, 1.0);
            r.apply(&mut k, n, 1.0);
            q.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>()
        };
        assert!((dot(10, 3) - dot(107, 100)).abs() < 1e-9);
    }
}
