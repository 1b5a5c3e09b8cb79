//! ParisKV recall study on the CPU: Recall@k of the retrieval pipeline (`kvforge-paris`, f64
//! reference) against the exact top-k, on synthetic keys with decode-time drift or on captured
//! keys and queries tiled to length.
//!
//! ```text
//! cargo run --release -p kvforge-lab --example paris_recall -- \
//!     --lengths 131072,1048576 --head-dims 128,64 --out benches/results/paris-recall-cpu-DATE.json
//! # captured SmolLM2 keys/queries (benches/paris/capture_qk.py; benches/paris/on_device.sh smollm2):
//! cargo run --release -p kvforge-lab --example paris_recall -- --qk data/keys/qk-emma.safetensors \
//!     --heads 3 --tile rope --lengths 131072,1048576 --out ...
//! ```
//!
//! **Synthetic keys with drift** (`--source synthetic`), per head dim `D`, all draws from one
//! ChaCha8 stream seeded by `--seed`; `g` is a fresh standard normal draw each time it appears:
//! - channel scales `σ_c = exp(0.4 g)`, and 4 random outlier channels with `σ_c × 6`
//!   (the massive channels of real keys);
//! - prefill distribution A: mean `μ_c = σ_c g`, 128 cluster centres `a_j ~ N(0, I)`;
//!   a key is `μ_c + σ_c (0.9 a_jc + 0.6 g)` with `j` uniform (`--mean` scales `μ`);
//! - decode distribution B (Fig. 1's drift): mean `μ + 0.8 σ ⊙ g`, scales `σ_c · exp(0.25 g)`,
//!   half the centres replaced by fresh ones;
//! - the first 75% of the `n` positions are A keys (prefill), the last 25% B keys (generated);
//! - queries are decode queries: `μ^q_c + σ^B_c (1.2 b_jc + 0.7 g)` with `b_j` a uniform B
//!   centre (so half of them aim at centres that prefill keys share) and `μ^q = 0.5 σ ⊙ g`.
//!
//! **Captured keys** (`--qk`): tensors `k.LNN` `[Hkv, T, D]` and `q.LNN` `[Hq, T, D]` (fp16,
//! post-RoPE). For each layer and KV head the `T` keys are tiled to `n` (`--tile`):
//! - `rope` (default): the text repeated, as if it recurred at positions `rT, rT + 1, …`: copy
//!   `r` of key `t` is the captured key rotated by RoPE at offset `rT` (`k(p + o) = RoPE(o) k(p)`
//!   for post-RoPE keys; rotate-half pairs `(i, i + D/2)`, frequencies `θ^(−2i/D)` with `θ` the
//!   file's metadata `rope_theta`), and every query is rotated by `n − T`, so it sits at the end
//!   of the tiled context. Copies then score differently by their distance, as repeated text
//!   does in a long context (the last few keys of the last copy lie after the query);
//! - `noise`: copy `r ≥ 1` of key `t` is `k_t + 0.05 s ⊙ g` with `s` the per-channel std of that
//!   head's keys (so copies do not tie in the exact top-k): near-duplicates, whose order the
//!   4-bit rerank must resolve from 5% noise (the harder, less realistic case).
//!
//! Queries (`--group kv`, default): one retrieval per kv head and position, as the runtime
//! does: the query of the last `--queries` positions is the sum of the group's query heads
//! (`kvforge_paris::group_query`), and Recall@k is measured against the exact top-k of that
//! summed query (the exact top-k of the group's aggregated scores). `--group head`: the last
//! positions' queries of the group's query heads one by one (round robin), each its own
//! retrieval. `--group kvmax`: one retrieval per kv head and position whose vote and top-C are
//! the summed query's, candidates ranked by the largest of the group's head estimates
//! (`kvforge_paris::Rank::GroupMax`, the runtime's default), Recall@k against the exact top-k by
//! the largest head logit (`exact_top_k_group_max`; the exact rerank column likewise). The JSON's `summary` holds, per length, the mean over the (layer, kv head) runs.
//! Synthetic queries have no GQA group: each is its own retrieval.
//!
//! For every query: the exact top-k (f64), the adaptive schedule's retrieval
//! ([`Schedule::default`]), and a sweep of fixed `(ρ, β)` with the 4-bit rerank and with an
//! exact rerank of the same candidates (coarse quality alone, as the seed's Fig. 10 reports).
//!
//! **What the rerank reads** (docs/paris.md "GPU bytes per key"): the runtime's 4-bit codes with
//! fp16 per-subspace weights (default; 112 B per key at D 128), the same with 8-bit log weights
//! (`--weights log8`, 80 B with the ids as the codes' sign plane), or a `D/2`-byte layout of
//! `kvforge_paris::compact` (`--weights log8` and `--code-bits 3`: 3-bit codes, 8-bit weights per
//! subspace; `--weights log8 --codes whole`: one weight per key, 4-bit codes with 8 coordinates
//! on 3 bits). The vote is the same in every case; each run's JSON gives `layout_bytes_per_key`.

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use half::f16;
use indicatif::{ProgressBar, ProgressStyle};
use kvforge_paris::retrieval::top_k_by;
use kvforge_paris::{exact_top_k, exact_top_k_group_max, group_query, recall, top_candidates, CompactKeys, CompactQuery, CompactSummaries, Layout, ParisConfig, Query, Schedule, Summaries};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde_json::{json, Value};

#[derive(Parser)]
struct Args {
    /// Retrieval-region lengths (keys).
    #[arg(long, value_delimiter = ',', default_value = "131072,1048576")]
    lengths: Vec<usize>,
    /// Head dims of the synthetic study.
    #[arg(long, value_delimiter = ',', default_value = "128,64")]
    head_dims: Vec<usize>,
    /// Queries per (head dim, length) (synthetic) or per head (captured).
    #[arg(long, default_value_t = 32)]
    queries: usize,
    /// Collision tiers T (1: plain collision counting).
    #[arg(long, default_value_t = 6)]
    tiers: u32,
    /// Scale of the keys' shared mean (synthetic; 1 as documented above, larger: keys crowd
    /// fewer sign patterns).
    #[arg(long, default_value_t = 1.0)]
    mean: f64,
    /// Top-k.
    #[arg(long, default_value_t = 100)]
    k: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Captured keys and queries (benches/paris/capture_qk.py) instead of synthetic ones.
    #[arg(long)]
    qk: Option<PathBuf>,
    /// Layers of the captured file (default: all).
    #[arg(long, value_delimiter = ',')]
    layers: Vec<usize>,
    /// KV heads per layer of the captured file (the first ones).
    #[arg(long, default_value_t = 2)]
    heads: usize,
    /// Captured queries: `kv` (one retrieval per kv head for the sum of its query heads),
    /// `kvmax` (per kv head, ranked by the largest head estimate) or `head` (one per query head)
    /// (module docs).
    #[arg(long, default_value = "kv")]
    group: String,
    /// How captured keys are tiled to length: `rope` or `noise` (module docs).
    #[arg(long, default_value = "rope")]
    tile: String,
    /// RoPE base for `--tile rope` when the file's metadata has no `rope_theta`.
    #[arg(long)]
    rope_theta: Option<f64>,
    /// Where to write the JSON.
    #[arg(long)]
    out: Option<PathBuf>,
    /// A label for the JSON (machine, date).
    #[arg(long, default_value = "cpu")]
    label: String,
    /// How the per-subspace weights are stored: `fp16` (the runtime's layout, 112 B per key at
    /// D 128) or `log8` (8 bits, `2^(round(16 log2 w) / 16)`: with the ids read from the codes'
    /// sign plane, the 80 B layout of docs/paris.md "GPU bytes per key"; a study of the f64
    /// reference only, the kernels store fp16).
    #[arg(long, default_value = "fp16", value_parser = ["fp16", "log8"])]
    weights: String,
    /// Normalisation of the rerank codes: `subspace` (the runtime's, per subspace) or `whole`
    /// (one weight per key on the whole rotated unit key, `kvforge_paris::Layout::Whole`: 4-bit
    /// codes but `--whole-low` coordinates on 3 bits, 8-bit log weight; the D/2-byte layout of
    /// docs/paris.md "GPU bytes per key"; needs `--weights log8`).
    #[arg(long, default_value = "subspace", value_parser = ["subspace", "whole"])]
    codes: String,
    /// Bits of the per-subspace direction codes: 4 (the runtime's) or 3 (`Layout::Subspace3`,
    /// the other D/2-byte layout; needs `--weights log8`).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(3..=4))]
    code_bits: u32,
    /// `--codes whole`: coordinates on 3-bit codes (8 makes the layout D/2 bytes at every head
    /// dim; 0 is the 4-bit whole-vector code, one byte more).
    #[arg(long, default_value_t = 8)]
    whole_low: usize,
    /// More `(ρ, β)` pairs for the sweep, `rho:beta` (appended after the fixed ones).
    #[arg(long, value_delimiter = ',')]
    sweep_extra: Vec<String>,
}

impl Args {
    /// The sweep: [`SWEEP`], then `--sweep-extra`.
    fn sweep(&self) -> Result<&'static [(f64, f64)], String> {
        let mut out = SWEEP.to_vec();
        for p in &self.sweep_extra {
            let parsed = p.split_once(':').and_then(|(r, b)| Some((r.parse::<f64>().ok()?, b.parse::<f64>().ok()?)));
            let (rho, beta) = parsed.ok_or_else(|| format!("--sweep-extra {p}: rho:beta"))?;
            kvforge_paris::config::check_ratios(rho, beta).map_err(|e| e.to_string())?;
            out.push((rho, beta));
        }
        Ok(Vec::leak(out))
    }

    /// The compact rerank layout asked for, if any.
    fn layout(&self) -> Result<Option<Layout>, String> {
        let layout = match (self.codes.as_str(), self.code_bits) {
            ("subspace", 4) => None,
            ("subspace", _) => Some(Layout::Subspace3),
            ("whole", 4) => Some(Layout::Whole { low: self.whole_low }),
            (_, bits) => return Err(format!("--codes whole takes 4-bit codes (--whole-low sets the 3-bit ones), not --code-bits {bits}")),
        };
        if layout.is_some() && self.weights != "log8" {
            return Err("--codes whole and --code-bits 3 store 8-bit log weights: add --weights log8".into());
        }
        Ok(layout)
    }
}

/// A weight on the 8-bit log grid `2^(i / 16)` (steps of 1/16 octave), as its fp16 bits (0 stays
/// 0). 8 bits cover 16 octaves, more than the weights of unit-norm subspaces span.
fn log8_weight(bits: u16) -> u16 {
    let w = f16::from_bits(bits).to_f64();
    if w <= 0.0 {
        return bits;
    }
    f16::from_f64((2f64).powf((16.0 * w.log2()).round() / 16.0)).to_bits()
}

fn gauss(rng: &mut ChaCha8Rng) -> f64 {
    let (u, v): (f64, f64) = (rng.gen::<f64>().max(1e-300), rng.gen());
    (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

fn gvec(rng: &mut ChaCha8Rng, d: usize) -> Vec<f64> {
    (0..d).map(|_| gauss(rng)).collect()
}

/// One distribution of keys: mean, channel scales, cluster centres.
struct Dist {
    mean: Vec<f64>,
    scale: Vec<f64>,
    centres: Vec<Vec<f64>>,
}

impl Dist {
    fn key(&self, rng: &mut ChaCha8Rng) -> impl Iterator<Item = f32> + '_ {
        let j = rng.gen_range(0..self.centres.len());
        let noise = gvec(rng, self.mean.len());
        (0..self.mean.len()).map(move |c| (self.mean[c] + self.scale[c] * (0.9 * self.centres[j][c] + 0.6 * noise[c])) as f32)
    }
}

/// Synthetic keys `[n][d]` and decode queries (module docs).
fn synthetic(d: usize, n: usize, queries: usize, seed: u64, mean_scale: f64) -> (Vec<f32>, Vec<Vec<f64>>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (d as u64) << 32);
    let mut scale: Vec<f64> = (0..d).map(|_| (0.4 * gauss(&mut rng)).exp()).collect();
    for _ in 0..4 {
        let c = rng.gen_range(0..d);
        scale[c] *= 6.0;
    }
    let mean: Vec<f64> = (0..d).map(|c| mean_scale * scale[c] * gauss(&mut rng)).collect();
    let centres: Vec<Vec<f64>> = (0..128).map(|_| gvec(&mut rng, d)).collect();
    let a = Dist { mean, scale, centres };
    let b = Dist {
        mean: (0..d).map(|c| a.mean[c] + 0.8 * a.scale[c] * gauss(&mut rng)).collect(),
        scale: (0..d).map(|c| a.scale[c] * (0.25 * gauss(&mut rng)).exp()).collect(),
        centres: a.centres.iter().enumerate().map(|(j, c)| if j % 2 == 0 { c.clone() } else { gvec(&mut rng, d) }).collect(),
    };
    let prefill = n * 3 / 4;
    // Keys in parallel chunks, each with its own stream derived from the seed.
    let chunk = 1 << 14;
    let keys: Vec<f32> = (0..n.div_ceil(chunk))
        .into_par_iter()
        .flat_map_iter(|ci| {
            let mut r = ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x9e37_79b9).wrapping_add(ci as u64) ^ (d as u64) << 40);
            let (lo, hi) = (ci * chunk, ((ci + 1) * chunk).min(n));
            (lo..hi).flat_map(|i| if i < prefill { a.key(&mut r).collect::<Vec<_>>() } else { b.key(&mut r).collect() }).collect::<Vec<_>>()
        })
        .collect();
    let qmean: Vec<f64> = (0..d).map(|c| 0.5 * a.scale[c] * gauss(&mut rng)).collect();
    let qs = (0..queries)
        .map(|_| {
            let j = rng.gen_range(0..b.centres.len());
            (0..d).map(|c| qmean[c] + b.scale[c] * (1.2 * b.centres[j][c] + 0.7 * gauss(&mut rng))).collect()
        })
        .collect();
    (keys, qs)
}

/// The `(ρ, β)` pairs of the sweep.
const SWEEP: [(f64, f64); 8] = [(0.10, 0.05), (0.20, 0.05), (0.20, 0.10), (0.30, 0.10), (0.10, 0.02), (0.05, 0.02), (0.20, 0.04), (0.20, 0.03)];

#[derive(Default, Clone)]
struct Acc {
    recall: Vec<f64>,
    coarse: Vec<f64>,
    exact_rerank: Vec<f64>,
}

impl Acc {
    fn summary(&self) -> Value {
        let stat = |v: &[f64]| {
            let mut s = v.to_vec();
            s.sort_by(f64::total_cmp);
            json!({"mean": s.iter().sum::<f64>() / s.len().max(1) as f64, "min": s.first(), "p10": s.get(s.len() / 10)})
        };
        json!({"recall": stat(&self.recall), "coarse_recall": stat(&self.coarse), "exact_rerank_recall": stat(&self.exact_rerank), "queries": self.recall.len()})
    }
}

/// One query's numbers: adaptive, then the sweep; each `(recall, coarse, exact rerank)`.
/// One retrieval's recalls per plan (adaptive, then the sweep): `heads` is one query `[D]`, or
/// with `max` a GQA group's queries `[G][D]` (vote by their sum, rerank and exact ranking by
/// the largest head's).
fn one_query(cfg: &ParisConfig, s: &Summaries, compact: Option<&CompactSummaries>, keys: &[f32], heads: &[f64], how: How) -> Vec<(f64, f64, f64)> {
    let How { max, k, sweep, .. } = how;
    let d = cfg.head_dim;
    let q = group_query(heads, d);
    let want = if max { exact_top_k_group_max(keys, heads, d, k) } else { exact_top_k(keys, &q, k) };
    let qp = Query::new(cfg, &q).expect("a finite query");
    let per: Vec<Query> = if max { heads.chunks_exact(d).map(|h| Query::new(cfg, h).expect("a finite query")).collect() } else { Vec::new() };
    let dot = |i: u32, q: &[f64]| keys[i as usize * d..(i as usize + 1) * d].iter().zip(q).map(|(&a, b)| f64::from(a) * b).sum::<f64>();
    let exact = |i: u32| if max { heads.chunks_exact(d).map(|h| dot(i, h)).fold(f64::NEG_INFINITY, f64::max) } else { dot(i, &q) };
    // The rerank: the runtime's summaries, or a compact layout's (the vote is the same).
    let scorers: Vec<_> = if max { per.iter().map(|h| scorer(s, compact, h)).collect() } else { vec![scorer(s, compact, &qp)] };
    let estimate = |i: u32| scorers.iter().map(|e| e(i as usize)).fold(f64::NEG_INFINITY, f64::max);
    let plan = Schedule::default().plan(s.n, k);
    let runs = std::iter::once((plan.rho, plan.candidates)).chain(sweep.iter().map(|&(rho, beta)| (rho, ((beta * s.n as f64).ceil() as usize).max(k))));
    let mut out = Vec::new();
    let mut last_rho = f64::NAN;
    let mut scores = Vec::new();
    for (rho, c) in runs {
        if rho != last_rho {
            scores = qp.vote(s, rho);
            last_rho = rho;
        }
        let cands = top_candidates(&scores, c);
        let est = top_k_by(cands.iter().map(|&i| (estimate(i), i)).collect(), k);
        let ex = top_k_by(cands.iter().map(|&i| (exact(i), i)).collect(), k);
        let got: Vec<u32> = est.iter().map(|x| x.1).collect();
        let gotx: Vec<u32> = ex.iter().map(|x| x.1).collect();
        out.push((recall(&got, &want), recall(&cands, &want), recall(&gotx, &want)));
    }
    out
}

/// The rerank estimate of query `q` by key index: the runtime's summaries `s`, or `compact`'s.
fn scorer<'a>(s: &'a Summaries, compact: Option<&'a CompactSummaries>, q: &'a Query) -> Box<dyn Fn(usize) -> f64 + 'a> {
    match compact {
        Some(c) => {
            let cq = CompactQuery::new(q, c.layout).expect("a valid layout");
            Box::new(move |i| cq.estimate(c, i))
        }
        None => Box::new(move |i| q.estimate(s, i)),
    }
}

/// Runs the queries of one (keys, config) and returns its JSON (`max`: each query is a GQA
/// group's heads, ranked by the largest head, as `one_query`).
/// How a study ranks and what it stores: `max` ranks by the largest head estimate (`kvmax`),
/// Recall@`k`, `log8` weights on the 8-bit log grid, `layout` a compact rerank layout instead of
/// the runtime's codes, `sweep` the `(ρ, β)` pairs swept.
#[derive(Clone, Copy)]
struct How {
    max: bool,
    k: usize,
    log8: bool,
    layout: Option<Layout>,
    sweep: &'static [(f64, f64)],
}

impl How {
    /// GPU bytes per key of the layout studied, with the ids read from the codes' sign plane
    /// where the weights are 8-bit (the runtime's fp16 layout stores them apart).
    fn bytes(&self, cfg: &ParisConfig) -> usize {
        match (self.layout, self.log8) {
            (Some(l), _) => l.bytes_per_key(cfg),
            (None, true) => cfg.head_dim / 2 + cfg.subspaces,
            (None, false) => cfg.summary_bytes(),
        }
    }
}

fn study(source: &str, cfg: ParisConfig, keys: &[f32], queries: &[Vec<f64>], how: How, bar: &ProgressBar) -> Value {
    let How { k, log8, layout, sweep, .. } = how;
    let n = keys.len() / cfg.head_dim;
    let t0 = Instant::now();
    // Encode in parallel chunks, then concatenate (the histogram adds up).
    let chunk = 1 << 15;
    let parts: Vec<Summaries> = keys.par_chunks(chunk * cfg.head_dim).map(|c| Summaries::encode(cfg, c).expect("finite keys")).collect();
    let mut s = Summaries::new(cfg).expect("a valid config");
    for p in parts {
        s.ids.extend(p.ids);
        s.codes.extend(p.codes);
        s.weights.extend(p.weights);
        s.hist.iter_mut().zip(&p.hist).for_each(|(a, b)| *a += b);
        s.n += p.n;
    }
    if log8 && layout.is_none() {
        s.weights.iter_mut().for_each(|w| *w = log8_weight(*w));
    }
    // A compact layout's codes, chunks encoded in parallel, weights on one grid per kv head.
    let compact = layout.map(|l| {
        let mut parts = keys.par_chunks(chunk * cfg.head_dim).map(|c| CompactKeys::encode(cfg, l, c).expect("finite keys")).collect::<Vec<_>>().into_iter();
        let mut all = parts.next().expect("keys");
        parts.for_each(|p| all.extend(p).expect("one layout"));
        CompactSummaries::from_keys(all)
    });
    let encode_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let per: Vec<Vec<(f64, f64, f64)>> = queries
        .par_iter()
        .map(|q| {
            let r = one_query(&cfg, &s, compact.as_ref(), keys, q, how);
            bar.inc(1);
            r
        })
        .collect();
    let mut accs = vec![Acc::default(); 1 + sweep.len()];
    for r in &per {
        for (a, &(rc, co, ex)) in accs.iter_mut().zip(r) {
            a.recall.push(rc);
            a.coarse.push(co);
            a.exact_rerank.push(ex);
        }
    }
    let plan = Schedule::default().plan(n, k);
    let sweep: Vec<Value> = sweep.iter().zip(&accs[1..]).map(|(&(rho, beta), a)| json!({"rho": rho, "beta": beta, "candidates": ((beta * n as f64).ceil() as usize).max(k), "result": a.summary()})).collect();
    let v = json!({
        "source": source, "head_dim": cfg.head_dim, "n": n, "k": k, "config": cfg,
        "summary_bytes_per_key": cfg.summary_bytes(), "fp16_kv_bytes_per_key": 4 * cfg.head_dim,
        "layout": layout.map(|l| l.name()), "layout_bytes_per_key": how.bytes(&cfg),
        "weight_grid": compact.as_ref().map(|c| c.grid),
        "encode_s": encode_s, "query_s": t1.elapsed().as_secs_f64(),
        "adaptive": {"plan": plan, "result": accs[0].summary()},
        "sweep": sweep,
    });
    let line = format!(
        "{source} D {} n {n} ({} B): adaptive (rho {}, beta {}) recall@{k} {:.3} (coarse {:.3}, exact rerank {:.3}); ratio 0.10: {:.3}",
        cfg.head_dim,
        how.bytes(&cfg),
        plan.rho,
        plan.beta,
        mean(&accs[0].recall),
        mean(&accs[0].coarse),
        mean(&accs[0].exact_rerank),
        mean(&accs[3].recall)
    );
    bar.suspend(|| eprintln!("{line}"));
    v
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn f16_rows(t: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    t.data().chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
}

/// Rotates a post-RoPE row `x` (`[D]`) by RoPE at position offset `offset` (rotate-half
/// pairs `(i, i + D/2)`, angle `offset · θ^(−2i/D)`, f64).
fn rope_shift(x: &[f32], offset: f64, theta: f64) -> Vec<f64> {
    let h = x.len() / 2;
    let mut out = vec![0f64; x.len()];
    for i in 0..h {
        let a = offset * theta.powf(-2.0 * i as f64 / x.len() as f64);
        let (sn, cs) = a.sin_cos();
        let (x0, x1) = (f64::from(x[i]), f64::from(x[i + h]));
        out[i] = x0 * cs - x1 * sn;
        out[i + h] = x1 * cs + x0 * sn;
    }
    out
}

/// Per length, the mean over runs of the adaptive recall, its coarse recall and the recall at
/// ratio 0.10 (sweep entry 2: ρ 0.20, β 0.10).
fn summarize_runs(runs: &[Value]) -> Value {
    let mut lengths: Vec<u64> = runs.iter().filter_map(|r| r["n"].as_u64()).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let rows: Vec<Value> = lengths
        .iter()
        .map(|&n| {
            let of: Vec<&Value> = runs.iter().filter(|r| r["n"].as_u64() == Some(n)).collect();
            let m = |f: &dyn Fn(&Value) -> Option<f64>| of.iter().filter_map(|r| f(r)).sum::<f64>() / of.len().max(1) as f64;
            let worst = of.iter().filter_map(|r| r["adaptive"]["result"]["recall"]["mean"].as_f64()).fold(f64::INFINITY, f64::min);
            json!({
                "n": n, "runs": of.len(),
                "adaptive_recall_mean": m(&|r| r["adaptive"]["result"]["recall"]["mean"].as_f64()),
                "adaptive_coarse_recall_mean": m(&|r| r["adaptive"]["result"]["coarse_recall"]["mean"].as_f64()),
                "adaptive_recall_worst_run": worst,
                "ratio_0.10_recall_mean": m(&|r| r["sweep"][2]["result"]["recall"]["mean"].as_f64()),
            })
        })
        .collect();
    json!(rows)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let layout = args.layout()?;
    let sweep = args.sweep()?;
    let style = ProgressStyle::with_template("{bar:40} {pos}/{len} queries {elapsed} {msg}")?;
    let mut runs = Vec::new();
    match &args.qk {
        None => {
            let bar = ProgressBar::new((args.head_dims.len() * args.lengths.len() * args.queries) as u64).with_style(style);
            for &d in &args.head_dims {
                for &n in &args.lengths {
                    bar.set_message(format!("synthetic D {d} n {n}"));
                    let (keys, qs) = synthetic(d, n, args.queries, args.seed, args.mean);
                    let mut v =
                        study("synthetic-drift", ParisConfig { tiers: args.tiers, ..ParisConfig::default_for(d) }, &keys, &qs, How { max: false, k: args.k, log8: args.weights == "log8", layout, sweep }, &bar);
                    v["mean_scale"] = json!(args.mean);
                    runs.push(v);
                }
            }
            bar.finish();
        }
        Some(path) => {
            let bytes = std::fs::read(path)?;
            let st = safetensors::SafeTensors::deserialize(&bytes)?;
            let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)?;
            let theta = match (args.tile.as_str(), args.rope_theta) {
                ("noise", _) => None,
                ("rope", Some(t)) => Some(t),
                ("rope", None) => {
                    Some(meta.metadata().as_ref().and_then(|m| m.get("rope_theta")).and_then(|t| t.parse::<f64>().ok()).ok_or("--tile rope needs rope_theta in the file's metadata or --rope-theta")?)
                }
                (other, _) => return Err(format!("--tile {other}: rope or noise").into()),
            };
            let mut layers: Vec<usize> = st.names().iter().filter_map(|n| n.strip_prefix("k.L").and_then(|l| l.parse().ok())).collect();
            layers.sort_unstable();
            if !args.layers.is_empty() {
                layers.retain(|l| args.layers.contains(l));
            }
            let bar = ProgressBar::new((layers.len() * args.heads * args.lengths.len() * args.queries) as u64).with_style(style);
            for &l in &layers {
                let (kt, qt) = (st.tensor(&format!("k.L{l:02}"))?, st.tensor(&format!("q.L{l:02}"))?);
                let (hkv, t, d) = (kt.shape()[0], kt.shape()[1], kt.shape()[2]);
                let hq = qt.shape()[0];
                let (kall, qall) = (f16_rows(&kt), f16_rows(&qt));
                for h in 0..args.heads.min(hkv) {
                    let base = &kall[h * t * d..(h + 1) * t * d];
                    let std: Vec<f64> = (0..d)
                        .map(|c| {
                            let m = (0..t).map(|i| f64::from(base[i * d + c])).sum::<f64>() / t as f64;
                            ((0..t).map(|i| (f64::from(base[i * d + c]) - m).powi(2)).sum::<f64>() / t as f64).sqrt()
                        })
                        .collect();
                    let g = hq / hkv;
                    let (per_head, max) = match args.group.as_str() {
                        "head" => (true, false),
                        "kv" => (false, false),
                        "kvmax" => (false, true),
                        other => return Err(format!("--group {other}: kv, kvmax or head").into()),
                    };
                    let head_row = |qh: usize, pos: usize| &qall[(qh * t + pos) * d..(qh * t + pos + 1) * d];
                    // Query j: query head h g + j % g at position t - 1 - j / g, or the sum of the
                    // group's heads at position t - 1 - j (kvmax: the group's heads, `[g][D]`).
                    let qrow = |j: usize| -> Vec<f32> {
                        if per_head {
                            head_row(h * g + j % g, t - 1 - j / g).to_vec()
                        } else if max {
                            (0..g).flat_map(|i| head_row(h * g + i, t - 1 - j).iter().copied()).collect()
                        } else {
                            let heads: Vec<f64> = (0..g).flat_map(|i| head_row(h * g + i, t - 1 - j).iter().map(|&v| f64::from(v))).collect();
                            group_query(&heads, d).into_iter().map(|v| v as f32).collect()
                        }
                    };
                    for &n in &args.lengths {
                        bar.set_message(format!("layer {l} head {h} n {n}"));
                        let qs: Vec<Vec<f64>> = (0..args.queries)
                            .map(|j| match theta {
                                // Per head (a kvmax query holds the group's heads).
                                Some(th) => qrow(j).chunks_exact(d).flat_map(|r| rope_shift(r, n.saturating_sub(t) as f64, th)).collect(),
                                None => qrow(j).iter().map(|&v| f64::from(v)).collect(),
                            })
                            .collect();
                        let mut rng = ChaCha8Rng::seed_from_u64(args.seed ^ ((l * 1000 + h) as u64));
                        let keys: Vec<f32> = match theta {
                            Some(th) => (0..n)
                                .into_par_iter()
                                .flat_map_iter(|i| {
                                    let (r, row) = (i / t, &base[(i % t) * d..(i % t + 1) * d]);
                                    if r == 0 {
                                        row.to_vec()
                                    } else {
                                        rope_shift(row, (r * t) as f64, th).into_iter().map(|v| v as f32).collect()
                                    }
                                })
                                .collect(),
                            None => {
                                let mut keys = Vec::with_capacity(n * d);
                                for i in 0..n {
                                    let (r, row) = (i / t, &base[(i % t) * d..(i % t + 1) * d]);
                                    keys.extend(row.iter().enumerate().map(|(c, &v)| if r == 0 { v } else { (f64::from(v) + 0.05 * std[c] * gauss(&mut rng)) as f32 }));
                                }
                                keys
                            }
                        };
                        let mut v =
                            study("captured-tiled", ParisConfig { tiers: args.tiers, ..ParisConfig::default_for(d) }, &keys, &qs, How { max, k: args.k, log8: args.weights == "log8", layout, sweep }, &bar);
                        v["layer"] = json!(l);
                        v["kv_head"] = json!(h);
                        v["captured_tokens"] = json!(t);
                        v["tile"] = json!(args.tile);
                        v["group"] = json!(match (per_head, max) {
                            (true, _) => "query head",
                            (false, true) => "kv head (summed group query's vote, ranked by the largest head estimate)",
                            (false, false) => "kv head (summed group query)",
                        });
                        v["rope_theta"] = json!(theta);
                        runs.push(v);
                    }
                }
            }
            bar.finish();
        }
    }
    let out = json!({
        "what": "ParisKV Recall@k of the kvforge-paris f64 reference vs the exact top-k (crates/kvforge-lab/examples/paris_recall.rs states the data)",
        "label": args.label,
        "weights": args.weights,
        "codes": args.codes,
        "code_bits": args.code_bits,
        "layout": layout.map(|l| l.name()),
        "schedule": Schedule::default(),
        "quoted_seed_001": {
            "note": "quoted from seed 001 §5.4 (Fig. 9), not measured here: Recall@100 at candidate ratio 0.10 by KV length, Qwen/Llama keys",
            "ratio_0.10": {"5K": 0.6104, "10K": 0.6774, "30K": 0.8036, "100K": 0.8376},
        },
        "summary": if args.qk.is_some() { summarize_runs(&runs) } else { Value::Null },
        "runs": runs,
    });
    kvforge_lab::emit_json(args.out.as_deref(), &out)?;
    Ok(())
}
