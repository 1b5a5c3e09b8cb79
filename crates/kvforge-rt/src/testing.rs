//! Helpers shared by the GPU tests of this workspace (and usable by downstream tests): where
//! the repository is, and the device (a test without one fails).

use std::path::PathBuf;
use std::sync::Arc;

use crate::device::Device;

/// The repository root holding `specs/`: `KVFORGE_ROOT`, else the nearest ancestor of the
/// working directory with a `specs/` folder, else this crate's workspace.
pub fn repo_root() -> PathBuf {
    if let Ok(r) = std::env::var("KVFORGE_ROOT") {
        return r.into();
    }
    let mut d = std::env::current_dir().unwrap_or_default();
    loop {
        if d.join("specs").is_dir() {
            return d;
        }
        if !d.pop() {
            return PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        }
    }
}

/// A shipped spec by file name (`"certified.toml"`); panics with the spec error (tests only).
pub fn shipped_spec(file: &str) -> kvforge_spec::Spec {
    kvforge_spec::Spec::load(&repo_root().join("specs").join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// Device 0 for a GPU test; panics with "needs a CUDA device: <why>" where there is none, so
/// a GPU test forced to run (`-- --ignored`) on a machine without a GPU fails instead of
/// passing. GPU tests are `#[ignore = "needs a CUDA device"]`, so a plain CPU run lists them
/// as ignored.
pub fn device() -> Arc<Device> {
    match Device::open(0) {
        Ok(d) => Arc::new(d),
        Err(e) => panic!("needs a CUDA device: {e}"),
    }
}

/// `n` test values in `[-1, 1)`, a multiplicative hash of the index and `seed` (cheap,
/// deterministic, no RNG dependency).
pub fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed * 97)) % 2000) as f32 / 1000.0 - 1.0).collect()
}

/// [`data`] rounded to fp16, so host and device paths see the same numbers.
pub fn data_f16(n: usize, seed: u32) -> Vec<f32> {
    data(n, seed).into_iter().map(|v| half::f16::from_f32(v).to_f32()).collect()
}

/// A xorshift64 stream (shifts 13, 7, 17) seeded with `salt · 0x9e3779b97f4a7c15 | 1`: the
/// same numbers in every test and in the fixture writers that mirror it.
#[derive(Clone, Debug)]
pub struct Xorshift(u64);

impl Xorshift {
    pub fn new(salt: u64) -> Xorshift {
        Xorshift(salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    /// Uniform in `[0, 1)`, 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller, one of the pair).
    pub fn gauss(&mut self) -> f64 {
        let (u, v) = (self.uniform().max(1e-12), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// The f64 reference's keys and values (`[len][D]` each, row-major) of the first `len` tokens
/// of `(seq, head)` (every token with `None`), decoded page by page from the cache's own bytes
/// with `kvforge_ref::decode_segment` (spherical pages with their tier's radius scales): what
/// a decode over that cache must attend. Panics on a cache error (tests only).
pub fn reference_kv(c: &crate::cache::KvCache, seq: usize, head: usize, len: Option<usize>) -> (Vec<f64>, Vec<f64>) {
    let s = c.spec();
    let (d, hkv, p) = (c.config().head_dim, c.config().num_kv_heads, s.page.tokens);
    let len = len.unwrap_or(usize::MAX);
    let (mut kk, mut vv) = (Vec::new(), Vec::new());
    for (pg, n, first) in c.positioned_pages(seq, head).unwrap() {
        let n = n.min(len.saturating_sub(first));
        if n == 0 {
            continue;
        }
        let bytes = c.download_page(pg).unwrap();
        let tier = &s.tiers[pg.tier as usize];
        let rs = if matches!(tier.key, kvforge_spec::KeyScheme::Spherical { .. }) {
            c.radius_scales(pg.tier).unwrap().map(|r| {
                let ng = r.len() / hkv;
                r[head * ng..(head + 1) * ng].to_vec()
            })
        } else {
            None
        };
        let (k, v) = kvforge_ref::decode_segment(tier, d, p, &bytes[kvforge_spec::HEADER_BYTES..], rs.as_deref().unwrap_or(&[]));
        kk.extend_from_slice(&k[..n * d]);
        vv.extend_from_slice(&v[..n * d]);
    }
    (kk, vv)
}
