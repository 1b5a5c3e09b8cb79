//! Shared helpers of the integration tests: shipped specs, ad-hoc tiers, seeded data.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use kvforge_spec::{Codebook, KeyScheme, ScaleDType, Spec, Tier, ValueScheme};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub const SPECS: [&str; 6] = ["baseline", "certified", "rdkv", "rotated", "spherical", "trizone"];

pub fn spec(name: &str) -> Spec {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../specs").join(format!("{name}.toml"));
    Spec::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

/// Uniform values in [lo, hi), seeded.
pub fn data(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(lo..hi)).collect()
}

pub fn data64(n: usize, seed: u64) -> Vec<f64> {
    data(n, -1.0, 1.0, seed).into_iter().map(f64::from).collect()
}

pub fn int_tier(kbits: u32, block: usize, kscale: ScaleDType, vbits: u32, group: usize, vscale: ScaleDType) -> Tier {
    Tier { id: 1, name: format!("k{kbits}b{block}_v{vbits}g{group}"), key: KeyScheme::Int { bits: kbits, block, scale: kscale }, value: ValueScheme::Int { bits: vbits, group, scale: vscale } }
}

/// A spherical tier with a codebook of `2^angle_bits` uniform random unit words.
pub fn spherical_tier(group: usize, angle_bits: u32, seed: u64) -> Tier {
    let entries = 1usize << angle_bits;
    let data = kvforge_ref::uniform_unit_samples(entries, group, seed);
    let codebook = Codebook::new("test".into(), entries, group, data, HashMap::new());
    Tier { id: 1, name: format!("sph{group}b{angle_bits}"), key: KeyScheme::Spherical { group, angle_bits, codebook }, value: ValueScheme::Dense(kvforge_spec::DType::Fp16) }
}

pub fn scale_dtype(fp16: bool) -> ScaleDType {
    if fp16 {
        ScaleDType::Fp16
    } else {
        ScaleDType::Fp32
    }
}

pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
