//! GPU self-test: every decode variant of a spec against the CPU f64 reference.
//!
//! The reference attends over the *dequantised* pages the GPU actually holds (downloaded and
//! decoded by `kvforge-ref`, mapped back from the spec's basis), so the comparison measures the
//! kernel's arithmetic alone; the quantisation error itself is tested in `kvforge-ref`.
//!
//! Tolerance (stated per dtype): the kernel accumulates in fp32 (relative error ~1e-6 over
//! these lengths) and rounds the output to the query dtype: half an ulp is 2^-11 |o| for fp16
//! and 2^-8 |o| for bf16, and |o| ≤ max |V̂|. The bound is twice the rounding term:
//! `tol = 2 · 2^-11 · max|V̂|` (fp16), `2 · 2^-8 · max|V̂|` (bf16), plus 1e-6 absolute.

use std::sync::Arc;

use kvforge_spec::{DType, Family, Spec, TierId, VariantId, HEADER_BYTES, TAIL_TIER};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use kvforge_rt::Device;
use kvforge_rt::Result;
use kvforge_rt::{CacheConfig, KvCache};

/// Distribution of keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Data {
    Gaussian,
    /// Four channels of keys scaled ×50 (outlier channels).
    Outliers,
    /// Keys near zero: near-uniform attention.
    NearUniform,
    /// One token whose key aligns with the query and holds ~99% of the mass.
    Needle,
}

/// One randomized case.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Case {
    pub lens: Vec<usize>,
    pub num_kv_heads: usize,
    pub data: Data,
    pub seed: u64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct VariantResult {
    pub spec: String,
    pub variant: String,
    pub cases: usize,
    pub max_abs_err: f64,
    pub max_rel_err: f64,
    pub tolerance: f64,
    pub status: &'static str,
    /// Variants the planner actually launched (must be `variant`).
    pub launched: Vec<String>,
}

/// The cases run for every variant. `long` adds 32K and 128K contexts.
pub fn cases(page: usize, long: bool) -> Vec<Case> {
    let mut c = vec![
        Case { lens: vec![1, page - 1, page, page + 1, 1000, 333, 2 * page], num_kv_heads: 2, data: Data::Gaussian, seed: 1 },
        Case { lens: vec![1000], num_kv_heads: 1, data: Data::Outliers, seed: 2 },
        Case { lens: vec![700], num_kv_heads: 2, data: Data::NearUniform, seed: 3 },
        Case { lens: vec![1500, page + 3], num_kv_heads: 2, data: Data::Needle, seed: 4 },
        Case { lens: (0..64).map(|i| 1 + (i * 37) % 300).collect(), num_kv_heads: 1, data: Data::Gaussian, seed: 5 },
    ];
    if long {
        c.push(Case { lens: vec![32 * 1024], num_kv_heads: 1, data: Data::Gaussian, seed: 6 });
        c.push(Case { lens: vec![128 * 1024], num_kv_heads: 1, data: Data::Needle, seed: 7 });
    }
    c
}

fn tolerance(dtype: DType, vmax: f64) -> f64 {
    let ulp = match dtype {
        DType::Fp16 => 2f64.powi(-11),
        DType::Bf16 => 2f64.powi(-8),
    };
    2.0 * ulp * vmax + 1e-6
}

fn gen_kv(rng: &mut ChaCha8Rng, n: usize, hkv: usize, d: usize, data: Data) -> (Vec<f32>, Vec<f32>) {
    let mut k: Vec<f32> = (0..n * hkv * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let v: Vec<f32> = (0..n * hkv * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    match data {
        Data::Gaussian | Data::Needle => {}
        Data::Outliers => {
            for (i, x) in k.iter_mut().enumerate() {
                if [3, 17, 42, 60].contains(&(i % d)) {
                    *x *= 50.0;
                }
            }
        }
        Data::NearUniform => k.iter_mut().for_each(|x| *x *= 0.01),
    }
    (k, v)
}

/// A spherical tier reached only by re-tiering needs radius scales: take the largest scale of
/// the tier the pages come from (twice, for headroom) or a small default.
fn ensure_radius_scales(cache: &mut KvCache, spec: &Spec, to: TierId, from: TierId, hkv: usize, d: usize) -> Result<()> {
    let kvforge_spec::KeyScheme::Spherical { group, .. } = spec.tiers[to as usize].key else { return Ok(()) };
    if cache.radius_scales(to)?.is_some() {
        return Ok(());
    }
    let base = cache.radius_scales(from)?.map_or(0.05, |r| r.iter().cloned().fold(0f32, f32::max));
    cache.set_radius_scales(to, &vec![2.0 * base; hkv * d / group])
}

/// Gives every mixed-key tier a seeded random channel order per kv head (so the self-test
/// checks the gather/scatter through the order, not just the identity). Per tier id: the
/// order set, if any.
fn set_channel_orders(cache: &mut KvCache, spec: &Spec, hkv: usize, d: usize, seed: u64) -> Result<Vec<Option<Vec<u16>>>> {
    use rand::seq::SliceRandom;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x0de5);
    let mut out = vec![None; spec.tiers.len()];
    for t in &spec.tiers {
        if matches!(t.key, kvforge_spec::KeyScheme::Mixed { .. }) {
            let mut order = Vec::with_capacity(hkv * d);
            for _ in 0..hkv {
                let mut o = kvforge_ref::mixed::identity_order(d);
                o.shuffle(&mut rng);
                order.extend(o);
            }
            cache.set_channel_order(t.id, &order)?;
            out[t.id as usize] = Some(order);
        }
    }
    Ok(out)
}

/// Runs every case for one decode variant; `mixed` re-tiers pages so the batch holds every
/// tier of the variant's combination.
pub fn run_variant(dev: &Arc<Device>, spec: &Spec, v: &VariantId, long: bool) -> Result<VariantResult> {
    let Family::Decode { tiers, gqa, .. } = &v.family else { unreachable!("decode variants only") };
    let (d, p) = (v.head_dim, spec.page.tokens);
    let ladder: Vec<TierId> = tiers.iter().copied().filter(|&t| t != TAIL_TIER).collect();
    let target = ladder.first().copied().unwrap_or(1);
    let mut worst = (0f64, 0f64, 0f64);
    let mut worst_margin = f64::INFINITY;
    let mut launched = Vec::new();
    let all = cases(p, long);
    for case in &all {
        let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ (d as u64) << 8 ^ (*gqa as u64) << 16);
        let hkv = case.num_kv_heads;
        let total: usize = case.lens.iter().sum();
        let mut cfg = CacheConfig::new(spec, d, *gqa, hkv, case.lens.len(), total).target(target);
        cfg.verify_headers = true;
        let mut cache = KvCache::new(dev.clone(), spec.clone(), cfg)?;
        let orders = set_channel_orders(&mut cache, spec, hkv, d, case.seed)?;
        let mut seqs = Vec::new();
        let mut qs = Vec::new();
        for &len in &case.lens {
            let s = cache.add_sequence();
            let (mut k, v) = gen_kv(&mut rng, len, hkv, d, case.data);
            let q: Vec<f32> = (0..hkv * gqa * d).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            if case.data == Data::Needle {
                // Token len/3 of every head gets key = 8·q of its first query head: logit
                // ≈ 8‖q‖²/√d, far above the rest.
                let t = len / 3;
                for h in 0..hkv {
                    for c in 0..d {
                        k[(t * hkv + h) * d + c] = 8.0 * q[(h * gqa) * d + c];
                    }
                }
            }
            // Prefill all but the last few tokens, then append them one by one (decode steps).
            let steps = len.min(3);
            let pre = len - steps;
            let row = hkv * d;
            cache.append(s, &k[..pre * row], &v[..pre * row])?;
            for i in pre..len {
                cache.append(s, &k[i * row..(i + 1) * row], &v[i * row..(i + 1) * row])?;
            }
            seqs.push(s);
            qs.extend(q);
        }
        // Mixed tiers: move pages round-robin down to the other tiers of the combination, one
        // batch per sequence (the path controllers take: one transcode launch per tier pair).
        if ladder.len() > 1 {
            for &s in &seqs {
                let mut moves = Vec::new();
                for h in 0..hkv {
                    let full = cache.pages(s, h)?.iter().filter(|(pg, _)| pg.tier != TAIL_TIER).count();
                    moves.extend((0..full).map(|i| (h, i, ladder[i % ladder.len()])).filter(|m| m.2 != target));
                }
                for &to in &ladder[1..] {
                    if moves.iter().any(|m| m.2 == to) {
                        ensure_radius_scales(&mut cache, spec, to, target, hkv, d)?;
                    }
                }
                cache.retier_pages(s, &moves)?;
            }
        }
        let mut plan = cache.plan(&seqs)?;
        // The planner picks a format's default schedule; where it serves `v`'s format, run `v`
        // itself (a test may ask for the format under another schedule).
        if v.schedule().is_some_and(|s| plan.variant.with_schedule(s) == *v) {
            plan.variant = v.clone();
        }
        if !launched.contains(&plan.variant.name()) {
            launched.push(plan.variant.name());
        }
        let got = cache.decode_planned(&plan, &qs)?;
        // Reference on the downloaded pages.
        let dtype = spec.geometry.dtype;
        let basis = spec.basis();
        let mut vmax = 0f64;
        let mut max_abs = 0f64;
        let mut max_ref = 0f64;
        for (bi, &s) in seqs.iter().enumerate() {
            for h in 0..hkv {
                let mut kk = Vec::new();
                let mut vv = Vec::new();
                for (pg, len) in cache.pages(s, h)? {
                    let bytes = cache.download_page(pg)?;
                    let tier = &spec.tiers[pg.tier as usize];
                    let rs = if matches!(tier.key, kvforge_spec::KeyScheme::Spherical { .. }) {
                        cache.radius_scales(pg.tier)?.map(|r| {
                            let ng = r.len() / hkv;
                            r[h * ng..(h + 1) * ng].to_vec()
                        })
                    } else {
                        None
                    };
                    let (k, mut v) = kvforge_ref::decode_segment(tier, d, p, &bytes[HEADER_BYTES..], rs.as_deref().unwrap_or(&[]));
                    // Mixed keys decode in stored channel order.
                    let mut k = match &orders[pg.tier as usize] {
                        Some(o) => kvforge_ref::mixed::to_natural(&k, d, &o[h * d..(h + 1) * d]),
                        None => k,
                    };
                    // A rotated spec's pages hold R k and R v; the kernel rotates q and the
                    // output instead, which is the same attention (q·Rᵀk̂ = Rq·k̂).
                    basis.to_natural(d, &mut k);
                    basis.to_natural(d, &mut v);
                    kk.extend_from_slice(&k[..len * d]);
                    vv.extend_from_slice(&v[..len * d]);
                }
                vmax = vv.iter().fold(vmax, |m, x| m.max(x.abs()));
                for g in 0..*gqa {
                    let row = (bi * hkv + h) * gqa + g;
                    let q: Vec<f64> = qs[row * d..(row + 1) * d].iter().map(|&x| kvforge_rt::from_bits(dtype, kvforge_rt::to_bits(dtype, x)) as f64).collect();
                    let (o, _lse) = kvforge_ref::attention(&q, &kk, &vv, 1.0 / (d as f64).sqrt());
                    for c in 0..d {
                        let e = (got.out[row * d + c] as f64 - o[c]).abs();
                        if !e.is_finite() {
                            max_abs = f64::INFINITY;
                        }
                        max_abs = max_abs.max(e);
                        max_ref = max_ref.max(o[c].abs());
                    }
                }
            }
        }
        let tol = tolerance(spec.geometry.dtype, vmax);
        let rel = max_abs / max_ref.max(1e-30);
        if max_abs > worst.0 {
            worst.0 = max_abs;
        }
        worst.1 = worst.1.max(rel);
        if tol - max_abs < worst_margin {
            worst_margin = tol - max_abs;
            worst.2 = tol;
        }
    }
    let pass = worst_margin >= 0.0 && launched == vec![v.name()];
    Ok(VariantResult { spec: spec.name.clone(), variant: v.name(), cases: all.len(), max_abs_err: worst.0, max_rel_err: worst.1, tolerance: worst.2, status: if pass { "pass" } else { "fail" }, launched })
}
