//! Per-key summaries (seed 001 §4.1): what the GPU keeps of every retrieval-region key.
//!
//! One key `k ∈ R^D` under a [`ParisConfig`] (`B` subspaces of dim `m`, 16 levels `ℓ` of
//! [`ParisConfig::levels`], f32 as stored):
//! 1. `‖k‖` summed in f64, rounded to f32; `k̂ = k · (1/‖k‖)` in f32; `k̃ = R k̂` with the rotated
//!    tier's f32 Hadamard rotation ([`hadamard::rotate`]).
//! 2. Per subspace `b`: `r_b = ‖k̃_b‖` (f64 sum, f32), `u_b = k̃_b · (1/r_b)` in f32.
//! 3. Direction code of coordinate `j`: `c_j = #{i : u_j > τ_i}` (f32 thresholds; a tie takes
//!    the lower level), 4 bits: `c ≥ 8` is the sign, `|ℓ_c|` the magnitude. `v_b = (ℓ_{c_j})_j`.
//! 4. Centroid id (eq. 5–6): the nearest `ω ∈ {±1/√m}^m` to `u_b` is its sign pattern;
//!    bit `j` of the id is `c_j ≥ 8` (`u_j > 0`), so ids and codes agree by construction.
//! 5. Weight (eq. 7–9): `α_b = ⟨v_b, u_b⟩` (f64), `w_b = ‖k‖ r_b / α_b`, stored fp16
//!    (round to nearest even). The estimate (eq. 10) is invariant to the scale of `v_b`, so
//!    `v_b` is the bare level vector, as the device reads it.
//!
//! A zero key, or a zero subspace, codes `c_j = 8`, id all ones and `w = 0`.
//!
//! **Arrays** of a KV head's `n` keys (structure of arrays, as on the device):
//! `ids [n][B]` u8, `codes [n][D/2]` u8 (channel `c` in byte `c/2`, low nibble for even `c`:
//! the rotated tier's 4-bit packing), `weights [n][B]` fp16 bits; plus the occupancy
//! histogram `hist [B][2^m]` u32 (keys per centroid per subspace) that the vote reads.

use half::f16;
use kvforge_spec::codecs::rotated::hadamard;

use crate::config::ParisConfig;
use crate::error::ParisError;

/// The summaries of one KV head's keys.
#[derive(Clone, Debug, PartialEq)]
pub struct Summaries {
    pub config: ParisConfig,
    /// Keys summarised.
    pub n: usize,
    pub ids: Vec<u8>,
    pub codes: Vec<u8>,
    /// fp16 bit patterns.
    pub weights: Vec<u16>,
    /// `[B][2^m]` keys per centroid.
    pub hist: Vec<u32>,
}

/// One key's summary before packing.
#[derive(Clone, Debug, PartialEq)]
pub struct KeySummary {
    /// `[B]`.
    pub ids: Vec<u8>,
    /// `[D]` 4-bit codes, one per channel.
    pub codes: Vec<u8>,
    /// `[B]` weights as stored (fp16 rounded, as f32).
    pub weights: Vec<f32>,
}

/// Summarises one key `x` (`[D]`, finite).
pub fn summarize_key(cfg: &ParisConfig, x: &[f32]) -> KeySummary {
    let (d, bsub, m) = (cfg.head_dim, cfg.subspaces, cfg.m());
    let table = cfg.levels();
    let norm = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt() as f32;
    let zero = KeySummary { ids: vec![((1u32 << m) - 1) as u8; bsub], codes: vec![8; d], weights: vec![0.0; bsub] };
    let inv = 1.0f32 / norm;
    if norm == 0.0 || !inv.is_finite() {
        return zero;
    }
    let mut kt: Vec<f32> = x.iter().map(|&v| v * inv).collect();
    hadamard::rotate(cfg.seed, &mut kt);
    let mut out = zero;
    for b in 0..bsub {
        let sub = &kt[b * m..(b + 1) * m];
        let r = sub.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt() as f32;
        let rinv = 1.0f32 / r;
        if r == 0.0 || !rinv.is_finite() {
            continue;
        }
        let (mut id, mut alpha) = (0u8, 0f64);
        for (j, &v) in sub.iter().enumerate() {
            let u = v * rinv;
            let c = table.thresholds_f32.iter().filter(|&&t| u > t).count() as u8;
            out.codes[b * m + j] = c;
            id |= u8::from(c >= 8) << j;
            alpha += f64::from(table.levels_f32[c as usize]) * f64::from(u);
        }
        out.ids[b] = id;
        out.weights[b] = if alpha > 0.0 { f16::from_f32((f64::from(norm) * f64::from(r) / alpha) as f32).to_f32() } else { 0.0 };
    }
    out
}

impl Summaries {
    /// Empty summaries under a validated `config`.
    pub fn new(config: ParisConfig) -> Result<Summaries, ParisError> {
        config.validate()?;
        Ok(Summaries { config, n: 0, ids: Vec::new(), codes: Vec::new(), weights: Vec::new(), hist: vec![0; config.subspaces * config.centroids()] })
    }

    /// Summaries of `[n][D]` keys.
    pub fn encode(config: ParisConfig, keys: &[f32]) -> Result<Summaries, ParisError> {
        let mut s = Summaries::new(config)?;
        s.append(keys)?;
        Ok(s)
    }

    /// Appends `[n][D]` keys (the sliding-window update's step (iii)). Nothing is appended
    /// when a row is not finite.
    pub fn append(&mut self, keys: &[f32]) -> Result<(), ParisError> {
        let (d, bsub) = (self.config.head_dim, self.config.subspaces);
        if keys.len() % d != 0 {
            return Err(ParisError::Length { what: "keys", got: keys.len(), want: keys.len().next_multiple_of(d) });
        }
        if let Some(row) = keys.chunks_exact(d).position(|r| r.iter().any(|v| !v.is_finite())) {
            return Err(ParisError::NonFinite { what: "key", row });
        }
        let add = keys.len() / d;
        self.ids.reserve(add * bsub);
        self.codes.reserve(add * d / 2);
        self.weights.reserve(add * bsub);
        let cents = self.config.centroids();
        for row in keys.chunks_exact(d) {
            let s = summarize_key(&self.config, row);
            for b in 0..bsub {
                self.hist[b * cents + s.ids[b] as usize] += 1;
            }
            self.ids.extend_from_slice(&s.ids);
            self.codes.extend(s.codes.chunks_exact(2).map(|p| p[0] | (p[1] << 4)));
            self.weights.extend(s.weights.iter().map(|&w| f16::from_f32(w).to_bits()));
        }
        self.n += add;
        Ok(())
    }

    /// Code of key `i`, channel `c`.
    pub fn code(&self, i: usize, c: usize) -> u8 {
        (self.codes[i * self.config.head_dim / 2 + c / 2] >> (4 * (c % 2))) & 15
    }

    /// Weight `w_ib` as stored.
    pub fn weight(&self, i: usize, b: usize) -> f64 {
        f16::from_bits(self.weights[i * self.config.subspaces + b]).to_f64()
    }

    /// Centroid id of key `i` in subspace `b`.
    pub fn id(&self, i: usize, b: usize) -> u8 {
        self.ids[i * self.config.subspaces + b]
    }

    /// GPU-resident bytes (summaries and histogram).
    pub fn bytes(&self) -> usize {
        self.ids.len() + self.codes.len() + 2 * self.weights.len() + 4 * self.hist.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(d: usize, salt: u64) -> Vec<f32> {
        crate::test_uniform(d, salt).map(|v| v as f32).collect()
    }

    #[test]
    fn ids_are_the_nearest_sign_pattern_centroid() {
        let cfg = ParisConfig::default_for(128);
        let m = cfg.m();
        for salt in 0..20 {
            let x = key(128, salt);
            let s = summarize_key(&cfg, &x);
            let mut kt: Vec<f64> = {
                let n = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
                x.iter().map(|&v| f64::from(v) / n).collect()
            };
            hadamard::rotate(cfg.seed, &mut kt);
            for b in 0..cfg.subspaces {
                // Brute-force argmax over Ω (eq. 6).
                let best = (0..1u32 << m)
                    .max_by(|&a, &c| {
                        let dot = |w: u32| (0..m).map(|j| if w >> j & 1 == 1 { kt[b * m + j] } else { -kt[b * m + j] }).sum::<f64>();
                        dot(a).total_cmp(&dot(c))
                    })
                    .unwrap();
                assert_eq!(u32::from(s.ids[b]), best, "salt {salt} subspace {b}");
            }
        }
    }

    /// Eq. 10 with exact directions would be exact; with 4-bit codes and the α correction
    /// it is within a few percent of ‖k‖‖q‖ on random vectors.
    #[test]
    fn weights_make_the_estimate_close() {
        for d in [64, 128] {
            let cfg = ParisConfig::default_for(d);
            let keys: Vec<f32> = (0..200).flat_map(|i| key(d, i).into_iter().map(|v| v * 3.0)).collect();
            let s = Summaries::encode(cfg, &keys).unwrap();
            let q: Vec<f64> = key(d, 999).iter().map(|&v| f64::from(v)).collect();
            let qp = crate::retrieval::Query::new(&cfg, &q).unwrap();
            let mut worst = 0f64;
            for i in 0..200 {
                let exact: f64 = keys[i * d..(i + 1) * d].iter().zip(&q).map(|(&k, q)| f64::from(k) * q).sum();
                let kn = keys[i * d..(i + 1) * d].iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
                let qn = q.iter().map(|v| v * v).sum::<f64>().sqrt();
                worst = worst.max((qp.estimate(&s, i) - exact).abs() / (kn * qn));
            }
            assert!(worst < 0.06, "d {d}: worst relative error {worst}");
        }
    }

    #[test]
    fn append_checks_and_counts() {
        let cfg = ParisConfig::default_for(64);
        let mut s = Summaries::new(cfg).unwrap();
        assert_eq!(s.append(&[0.0; 65]), Err(ParisError::Length { what: "keys", got: 65, want: 128 }));
        let mut bad = vec![1.0f32; 128];
        bad[70] = f32::NAN;
        assert_eq!(s.append(&bad), Err(ParisError::NonFinite { what: "key", row: 1 }));
        assert_eq!(s.n, 0);
        s.append(&key(64, 1)).unwrap();
        s.append(&[0.0; 64]).unwrap();
        assert_eq!(s.n, 2);
        assert_eq!(s.hist.iter().sum::<u32>() as usize, 2 * cfg.subspaces);
        assert!((0..cfg.subspaces).all(|b| s.weight(1, b) == 0.0 && s.id(1, b) == 255));
        assert!((0..64).all(|c| s.code(1, c) == 8));
        // Ids agree with the code signs.
        for b in 0..cfg.subspaces {
            let from_codes = (0..8).fold(0u8, |id, j| id | (u8::from(s.code(0, b * 8 + j) >= 8) << j));
            assert_eq!(s.id(0, b), from_codes);
        }
    }
}
