//! Synthetic attention with planted structure: the workload the controllers are judged on
//! until real Q/K/V exist.
//!
//! One kv head has a unit direction `u`. Background keys are N(0, I) (or, given a spherical
//! codebook, point near its codewords group by group, like keys a codebook was trained on);
//! queries are `γ(√d·u + z)`, so a key `κ·u + noise` gets a logit about `γκ` above the
//! background. Planted on that direction:
//! * an **attention sink** at position 0 (κ × 1.2), as trained models put one there;
//! * **heavy hitters**: `heavy` tokens spread over six pages (`2 + i·full/6`), the
//!   H2O-style few tokens that take most of a concentrated head's mass;
//! * **needles**: single strong tokens (κ × 1.1) a third and two thirds into the context,
//!   alone on otherwise light pages and carrying values 4× larger than the rest — the
//!   retrieval case where dropping one page loses the answer.
//!
//! `γ` sets how peaked a head is: [`HeadShape::PEAKED`] puts most of its mass on the planted
//! tokens, [`HeadShape::DIFFUSE`] spreads it over the whole context. The generator is
//! deterministic in its RNG and draws in a fixed order (direction, keys, values, plants, then
//! queries on demand), so tests and the frontier driver reproduce each other exactly.

use kvforge_spec::Codebook;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// How one kv head attends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HeadShape {
    /// Query scale γ: larger is more peaked.
    pub gamma: f64,
    /// Planted heavy-hitter tokens.
    pub heavy: usize,
    /// Key scale κ of the planted tokens.
    pub kappa: f64,
    /// Planted needles (at most 2 positions are distinct).
    pub needles: usize,
}

impl HeadShape {
    /// Most of the mass on the sink, 24 heavy hitters and 2 needles.
    pub const PEAKED: HeadShape = HeadShape { gamma: 0.9, heavy: 24, kappa: 7.0, needles: 2 };
    /// Between the two: 12 heavy hitters, one needle.
    pub const MEDIUM: HeadShape = HeadShape { gamma: 0.6, heavy: 12, kappa: 6.0, needles: 1 };
    /// Attention spread over the whole context (4 weak heavy hitters).
    pub const DIFFUSE: HeadShape = HeadShape { gamma: 0.35, heavy: 4, kappa: 5.0, needles: 0 };

    /// `n` heads cycling peaked, diffuse, medium, diffuse (half the heads diffuse, as in
    /// models where many heads attend broadly).
    pub fn mix(n: usize) -> Vec<HeadShape> {
        let cycle = [HeadShape::PEAKED, HeadShape::DIFFUSE, HeadShape::MEDIUM, HeadShape::DIFFUSE];
        (0..n).map(|i| cycle[i % cycle.len()]).collect()
    }
}

/// A random key of `len` channels and norm ≈ √len: isotropic Gaussian, or, with a codebook,
/// near a random codeword in every group (the keys a spherical codebook is trained on).
pub fn draw_key(rng: &mut ChaCha8Rng, len: usize, codebook: Option<&Codebook>) -> Vec<f64> {
    match codebook {
        None => (0..len).map(|_| gauss(rng)).collect(),
        Some(cb) => (0..len / cb.group)
            .flat_map(|_| {
                let word = cb.word(rng.gen_range(0..cb.entries)).to_vec();
                let r = (cb.group as f64).sqrt() * (0.6 + 0.8 * rng.gen_range(0.0..1.0));
                word.iter().map(|&c| r * (f64::from(c) + 0.02 * gauss(rng))).collect::<Vec<_>>()
            })
            .collect(),
    }
}

/// A standard normal draw (Box–Muller; deterministic and dependency-free).
pub fn gauss(rng: &mut ChaCha8Rng) -> f64 {
    let (u1, u2): (f64, f64) = (rng.gen_range(1e-12..1.0), rng.gen_range(0.0..1.0));
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Page holding needle `i` of a head with `full` full pages: a third and two thirds into the
/// context, on odd pages (heavy hitters sit on even ones).
pub fn needle_page(full: usize, i: usize) -> usize {
    full * (1 + i) / 3 + 1
}

/// Pages holding heavy hitters of a head with `full` full pages.
pub fn heavy_pages(full: usize) -> Vec<usize> {
    (0..6).map(|i| 2 + i * full / 6).collect()
}

/// Keys and values of one kv head and the direction its queries point along.
#[derive(Clone, Debug)]
pub struct SynthHead {
    pub d: usize,
    pub shape: HeadShape,
    /// `[tokens][d]`.
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Unit query direction.
    pub u: Vec<f64>,
    /// Positions of the sink, heavy hitters and needles.
    pub sink: usize,
    pub heavy: Vec<usize>,
    pub needles: Vec<usize>,
}

/// Full pages a synthetic head needs: the sink, heavy hitters and needles are planted in
/// distinct pages. Callers check `tokens >= MIN_FULL_PAGES * page_tokens` on user input
/// (`kvforge frontier --contexts`) before they generate.
pub const MIN_FULL_PAGES: usize = 8;

impl SynthHead {
    /// `tokens` tokens; plants are placed by the number of full pages of `page_tokens`.
    ///
    /// # Panics
    /// With fewer than [`MIN_FULL_PAGES`] full pages (a caller's bug: check user input first).
    pub fn generate(rng: &mut ChaCha8Rng, d: usize, tokens: usize, page_tokens: usize, shape: HeadShape, codebook: Option<&Codebook>) -> SynthHead {
        let p = page_tokens;
        let full = tokens / p;
        assert!(full >= MIN_FULL_PAGES, "synthetic heads need at least 8 full pages (got {tokens} tokens of {p}-token pages)");
        let draw = |rng: &mut ChaCha8Rng, len: usize| draw_key(rng, len, codebook);
        let mut u = draw(rng, d);
        let nu = u.iter().map(|x| x * x).sum::<f64>().sqrt();
        u.iter_mut().for_each(|x| *x /= nu);
        let mut k: Vec<f32> = (0..tokens).flat_map(|_| draw(rng, d)).map(|x| x as f32).collect();
        let mut v: Vec<f32> = (0..tokens * d).map(|_| gauss(rng) as f32).collect();
        let mut plant = |rng: &mut ChaCha8Rng, t: usize, kap: f64, vscale: f32| {
            for c in 0..d {
                k[t * d + c] = (kap * u[c] + 0.02 * gauss(rng)) as f32;
                v[t * d + c] *= vscale;
            }
        };
        plant(rng, 0, shape.kappa * 1.2, 1.0);
        let pages = heavy_pages(full);
        let heavy: Vec<usize> = (0..shape.heavy).map(|i| pages[i % pages.len()] * p + (i * 13) % p).collect();
        for &t in &heavy {
            plant(rng, t, shape.kappa, 1.0);
        }
        let needles: Vec<usize> = (0..shape.needles).map(|i| needle_page(full, i) * p + p / 2).collect();
        for &t in &needles {
            plant(rng, t, shape.kappa * 1.1, 4.0);
        }
        SynthHead { d, shape, k, v, u, sink: 0, heavy, needles }
    }

    /// `rows` query rows `[rows][d]` (a decode query of a GQA group is `gqa` rows).
    pub fn queries(&self, rng: &mut ChaCha8Rng, rows: usize) -> Vec<f64> {
        let d = self.d;
        let g = self.shape.gamma;
        (0..rows).flat_map(|_| (0..d).map(|c| g * ((d as f64).sqrt() * self.u[c] + gauss(rng))).collect::<Vec<_>>()).collect()
    }

    /// Tokens of the head.
    pub fn tokens(&self) -> usize {
        self.k.len() / self.d
    }
}
