//! End to end on the CPU: synthetic attention with planted heavy hitters and needles, pages
//! coded byte-exactly by kvforge-ref, tiers chosen by the controllers, attention output error
//! against exact f64 attention on the original keys and values.
//!
//! A page re-tiered from the first ladder tier is coded as the GPU does it: the first-tier
//! page is decoded and the result re-encoded in the new tier (transcode), so spherical errors
//! compound like they will on the device.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use common::*;
use kvforge_control::*;
use kvforge_ref::{attention, decode_page, encode_page, radius_scales};
use kvforge_spec::{Codebook, KeyScheme, Spec, TierId, TAIL_TIER};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const GQA: usize = 4;
/// Tokens in full pages per head (48 pages of 64 tokens, 24 of 128).
const FULL_TOKENS: usize = 3072;
const TAIL: usize = 20;
const OBS: usize = 16;
const TEST: usize = 8;

struct Head {
    k: Vec<f32>,
    v: Vec<f32>,
    /// Observation queries (importance) and held-out test queries, `[n][GQA][D]`.
    q_obs: Vec<f64>,
    q_test: Vec<f64>,
}

/// Decoded keys and values of one page.
type Kv = (Vec<f64>, Vec<f64>);
type Worlds = HashMap<(String, u64), Arc<OnceLock<Arc<World>>>>;

struct World {
    spec: Spec,
    /// Page tokens and full pages per head.
    p: usize,
    full: usize,
    heads: Vec<Head>,
    /// decoded[h][page][tier] = (K̂, V̂) of full page `page` of head `h` re-coded into `tier`.
    decoded: Vec<Vec<Vec<Option<Kv>>>>,
    /// Tail page (dense) per head.
    tail: Vec<Kv>,
    /// Exact attention outputs of the test queries, per head.
    exact: Vec<Vec<Vec<f64>>>,
}

/// Worlds are built once per test binary (coding every page in every tier is slow in debug).
fn world(name: &str, seed: u64) -> Arc<World> {
    static CACHE: OnceLock<Mutex<Worlds>> = OnceLock::new();
    let cell = CACHE.get_or_init(Default::default).lock().unwrap().entry((name.to_string(), seed)).or_default().clone();
    cell.get_or_init(|| Arc::new(build_world(name, seed))).clone()
}

/// Page of needle `i`: a third and two thirds into the context, on odd pages (heavy hitters
/// sit on even ones).
fn needle_page(full: usize, i: usize) -> usize {
    full * (1 + i) / 3 + 1
}

fn gauss(rng: &mut ChaCha8Rng) -> f64 {
    // Box–Muller; deterministic and dependency-free.
    let (u1, u2): (f64, f64) = (rng.gen_range(1e-12..1.0), rng.gen_range(0.0..1.0));
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// One kv head: background keys N(0, I); queries γ(√d·u + z); heavy hitters and needles are
/// keys κ·u + noise (logit ≈ γκ above the background); needles also carry distinctive values.
///
/// With `codebook`, every 16-channel group of every key (and of u) points near one of its
/// codewords, like keys that the codebook was trained on; without, keys are isotropic.
fn head(rng: &mut ChaCha8Rng, p: usize, gamma: f64, heavy: usize, kappa: f64, needles: usize, codebook: Option<&Codebook>) -> Head {
    let full = FULL_TOKENS / p;
    let n = FULL_TOKENS + TAIL;
    let d = D;
    // A random vector of norm ≈ √(len): isotropic, or codeword directions per group.
    let draw = |rng: &mut ChaCha8Rng, len: usize| -> Vec<f64> {
        match codebook {
            None => (0..len).map(|_| gauss(rng)).collect(),
            Some(cb) => (0..len / cb.group)
                .flat_map(|_| {
                    let word = cb.word(rng.gen_range(0..cb.entries));
                    let r = (cb.group as f64).sqrt() * (0.6 + 0.8 * rng.gen_range(0.0..1.0));
                    word.iter().map(|&c| r * (f64::from(c) + 0.02 * gauss(rng))).collect::<Vec<_>>()
                })
                .collect(),
        }
    };
    let mut u: Vec<f64> = draw(rng, d);
    let nu = u.iter().map(|x| x * x).sum::<f64>().sqrt();
    u.iter_mut().for_each(|x| *x /= nu);
    let mut k: Vec<f32> = (0..n).flat_map(|_| draw(rng, d)).map(|x| x as f32).collect();
    let mut v: Vec<f32> = (0..n * d).map(|_| gauss(rng) as f32).collect();
    let mut plant = |t: usize, kap: f64, vscale: f32, k: &mut Vec<f32>, v: &mut Vec<f32>| {
        for c in 0..d {
            k[t * d + c] = (kap * u[c] + 0.02 * gauss(rng)) as f32;
            v[t * d + c] *= vscale;
        }
    };
    // Attention sink at position 0.
    plant(0, kappa * 1.2, 1.0, &mut k, &mut v);
    // Heavy hitters in a few pages (not the protected recent window).
    let pages: Vec<usize> = (0..6).map(|i| 2 + i * full / 6).collect();
    for i in 0..heavy {
        let t = pages[i % pages.len()] * p + (i * 13) % p;
        plant(t, kappa, 1.0, &mut k, &mut v);
    }
    // Needles: single strong tokens in otherwise light pages, with large values.
    for i in 0..needles {
        let t = needle_page(full, i) * p + p / 2;
        plant(t, kappa * 1.1, 4.0, &mut k, &mut v);
    }
    let mut qs = |count: usize| -> Vec<f64> { (0..count * GQA).flat_map(|_| (0..d).map(|c| gamma * ((d as f64).sqrt() * u[c] + gauss(rng))).collect::<Vec<_>>()).collect() };
    let q_obs = qs(OBS);
    let q_test = qs(TEST);
    Head { k, v, q_obs, q_test }
}

fn build_world(name: &str, seed: u64) -> World {
    let spec = spec(name);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Head 0: peaked (many heavy hitters, needles); head 1: diffuse.
    let cb = match &spec.tiers[1].key {
        KeyScheme::Spherical { codebook, .. } => Some(codebook.clone()),
        _ => None,
    };
    let p = spec.page.tokens;
    let full = FULL_TOKENS / p;
    let heads = vec![head(&mut rng, p, 0.9, 24, 7.0, 2, cb.as_ref()), head(&mut rng, p, 0.35, 4, 5.0, 0, cb.as_ref())];
    let mut decoded = Vec::new();
    let mut tail = Vec::new();
    for h in &heads {
        // Radius scales per spherical tier from the original keys (the runtime needs them set
        // before re-coding into a spherical tier).
        let rs: Vec<Vec<f32>> = spec.tiers.iter().map(|t| match &t.key {
            KeyScheme::Spherical { group, .. } => radius_scales(&h.k, D, *group),
            _ => Vec::new(),
        }).collect();
        let mut per_page = Vec::new();
        for i in 0..full {
            let r = i * p * D..(i + 1) * p * D;
            let first = &spec.tiers[1];
            let bytes = encode_page(first, D, &spec.page, &h.k[r.clone()], &h.v[r], &rs[1]).unwrap();
            let top = decode_page(first, D, &spec.page, &bytes, &rs[1]).unwrap();
            let (k32, v32): (Vec<f32>, Vec<f32>) = (top.k.iter().map(|&x| x as f32).collect(), top.v.iter().map(|&x| x as f32).collect());
            let mut tiers = vec![None; spec.tiers.len()];
            for t in spec.tiers.iter().skip(1) {
                if t.is_drop() {
                    continue;
                }
                let page = if t.id == 1 {
                    top.clone()
                } else {
                    let b = encode_page(t, D, &spec.page, &k32, &v32, &rs[t.id as usize]).unwrap();
                    decode_page(t, D, &spec.page, &b, &rs[t.id as usize]).unwrap()
                };
                tiers[t.id as usize] = Some((page.k, page.v));
            }
            per_page.push(tiers);
        }
        decoded.push(per_page);
        let r = full * p * D..(full * p + TAIL) * D;
        let tb = encode_page(&spec.tiers[TAIL_TIER as usize], D, &spec.page, &h.k[r.clone()], &h.v[r], &[]).unwrap();
        let tp = decode_page(&spec.tiers[TAIL_TIER as usize], D, &spec.page, &tb, &[]).unwrap();
        tail.push((tp.k, tp.v));
    }
    let sm = 1.0 / (D as f64).sqrt();
    let exact = heads
        .iter()
        .map(|h| {
            let (k, v) = (to64(&h.k), to64(&h.v));
            h.q_test.chunks_exact(D).map(|q| attention(q, &k, &v, sm).0).collect()
        })
        .collect();
    World { spec, p, full, heads, decoded, tail, exact }
}

fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

/// The controllers' input: page masses from the observation queries' exact attention.
fn view_of(w: &World, token_masses: bool) -> PageTableView {
    let sm = 1.0 / (D as f64).sqrt();
    let masses: Vec<Vec<f64>> = w
        .heads
        .iter()
        .map(|h| {
            let (k, n) = (to64(&h.k), h.k.len() / D);
            let mut tok = vec![0.0; n];
            for q in h.q_obs.chunks_exact(D) {
                for (t, a) in kvforge_ref::softmax_weights(q, &k, sm).into_iter().enumerate() {
                    tok[t] += a;
                }
            }
            tok
        })
        .collect();
    let mut v = view(&w.spec, w.heads.len(), w.full, 1, TAIL, |_, _| 0.0);
    for (h, pages) in v.heads.iter_mut().enumerate() {
        for p in pages.iter_mut() {
            let t = masses[h][p.first_token..=p.last_token].to_vec();
            p.mass = t.iter().sum();
            p.token_mass = if token_masses { Some(t) } else { None };
        }
    }
    v.normalise();
    v
}

/// Relative L2 error of the test queries' attention outputs with pages in `tiers[h][page]`
/// (`None`: dropped).
fn error(w: &World, tiers: &[Vec<Option<TierId>>]) -> f64 {
    let sm = 1.0 / (D as f64).sqrt();
    let (mut num, mut den) = (0.0, 0.0);
    for (h, head) in w.heads.iter().enumerate() {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (i, t) in tiers[h].iter().enumerate() {
            if let Some(t) = t {
                let (pk, pv) = w.decoded[h][i][*t as usize].as_ref().unwrap();
                k.extend_from_slice(pk);
                v.extend_from_slice(pv);
            }
        }
        k.extend_from_slice(&w.tail[h].0);
        v.extend_from_slice(&w.tail[h].1);
        for (q, o) in head.q_test.chunks_exact(D).zip(&w.exact[h]) {
            let (oh, _) = attention(q, &k, &v, sm);
            num += o.iter().zip(&oh).map(|(a, b)| (a - b) * (a - b)).sum::<f64>();
            den += o.iter().map(|a| a * a).sum::<f64>();
        }
    }
    (num / den).sqrt()
}

fn tiers_of(view: &PageTableView, plan: &Plan) -> Vec<Vec<Option<TierId>>> {
    let drop = view.costs.drop_tier();
    let full = view.heads[0].len() - 1;
    (0..view.heads.len())
        .map(|h| (0..full).map(|i| plan.tier_of(PageId { head: h, index: i }, view).filter(|&t| Some(t) != drop)).collect())
        .collect()
}

/// Uniform quantisation as KIVI-style baselines do it: every page the controllers must
/// protect (sink, recent window) stays in the first tier, every other full page is in `t`.
/// Returns the tiers and their bytes, the budget the controller gets.
fn uniform(view: &PageTableView, t: TierId, protection: &Protection) -> (Vec<Vec<Option<TierId>>>, f64) {
    let full = view.heads[0].len() - 1;
    let mut bytes = 0.0;
    let tiers = view
        .heads
        .iter()
        .map(|pages| {
            bytes += view.costs.cost(TAIL_TIER, TAIL);
            pages[..full]
                .iter()
                .map(|p| {
                    let tier = if protection.protects(p, view.context_tokens) { 1 } else { t };
                    bytes += view.costs.cost(tier, p.tokens);
                    Some(tier)
                })
                .collect()
        })
        .collect();
    (tiers, bytes)
}

fn run(name: &str, ctrl: &mut dyn FnMut() -> Box<dyn Controller>, label: &str, fracs: &[f64]) {
    run_with(name, ctrl, label, fracs, true)
}

/// (a) error falls as the budget rises; (b) versus uniform quantisation at equal bytes,
/// asserted when `must_beat_uniform`.
fn run_with(name: &str, ctrl: &mut dyn FnMut() -> Box<dyn Controller>, label: &str, fracs: &[f64], must_beat_uniform: bool) {
    let w = world(name, 42);
    let v = view_of(&w, true);
    let protection = Protection::default();
    let full_bytes = v.cost();
    println!("\n[{name}] {label}: relative output error vs exact attention ({} kv heads, {} tokens each)", v.heads.len(), v.context_tokens);
    println!("  all pages in `{}`: error {:.4e} at {:.0} B", w.spec.tiers[1].name, error(&w, &vec![vec![Some(1); w.full]; 2]), full_bytes);
    // (a) error falls as the budget rises.
    let mut errs = Vec::new();
    for &f in fracs {
        let l = Limits { budget: Budget::Total(full_bytes * f), protection };
        let plan = ctrl().decide(&v, &l);
        check_plan(&v, &plan, &l).unwrap();
        assert!(plan.feasible, "{label} at {f}");
        let e = error(&w, &tiers_of(&v, &plan));
        let drop = v.costs.drop_tier();
        let hist: Vec<String> = w.spec.tiers.iter().skip(1).map(|t| format!("{}:{}", t.name, simulate(&v, &plan).iter().filter(|(_, p)| p.tier == t.id).count() + if Some(t.id) == drop { plan.decisions.iter().filter(|d| Some(d.to_tier) == drop).count() } else { 0 })).collect();
        println!("  budget {:>4.0}%: error {e:.4e}  predicted D {:.4e}  pages [{}]", f * 100.0, plan.distortion_after, hist.join(" "));
        errs.push(e);
    }
    for (i, p) in errs.windows(2).enumerate() {
        assert!(p[1] <= p[0] * 1.02 + 1e-12, "{label}: error rises from {:.4e} to {:.4e} between budgets {} and {}", p[0], p[1], fracs[i], fracs[i + 1]);
    }
    assert!(errs.last() < errs.first(), "{label}: more budget must help overall");
    // (b) beats uniform quantisation at equal bytes.
    for t in w.spec.tiers.iter().skip(2).filter(|t| !t.is_drop()) {
        let (tiers, bytes) = uniform(&v, t.id, &protection);
        let ue = error(&w, &tiers);
        let l = Limits { budget: Budget::Total(bytes), protection };
        let plan = ctrl().decide(&v, &l);
        check_plan(&v, &plan, &l).unwrap();
        assert!(plan.feasible && plan.cost_after <= bytes);
        let e = error(&w, &tiers_of(&v, &plan));
        println!("  equal bytes as uniform `{}` (protected pages in `{}`, {:.0} B): uniform {ue:.4e}, {label} {e:.4e} ({:.1}x lower)", t.name, w.spec.tiers[1].name, bytes, ue / e);
        if must_beat_uniform {
            assert!(e < ue, "{label} ({e:.4e}) does not beat uniform `{}` ({ue:.4e}) at {bytes} B", t.name);
        }
    }
}

const FRACS: [f64; 6] = [0.12, 0.2, 0.3, 0.45, 0.65, 0.9];

#[test]
fn rdr_on_rdkv_ladder() {
    run("rdkv", &mut || Box::new(rdr("rdkv")), "RDR", &FRACS);
}

#[test]
fn rdr_on_spherical_ladder() {
    run("spherical", &mut || Box::new(rdr("spherical")), "RDR", &[0.35, 0.5, 0.65, 0.8, 0.95]);
}

#[test]
fn rdkv_pages_on_rdkv_ladder() {
    // The paper's linear page weights tie uniform quantisation here (see `run_rdkv_linear`);
    // with the concentration proxy RDKV's knapsack beats it.
    let s = spec("rdkv");
    run(
        "rdkv",
        &mut || {
            let mut c = RdkvController::new(&s).unwrap();
            c.proxy = distortion::Proxy::Concentration;
            Box::new(c)
        },
        "RDKV (concentration)",
        &FRACS,
    );
}

#[test]
fn rdkv_pages_linear_weights() {
    let s = spec("rdkv");
    run_with("rdkv", &mut || Box::new(RdkvController::new(&s).unwrap()), "RDKV (paper, linear)", &FRACS, false);
}

#[test]
fn rdr_on_spherical_ladder_calibrated() {
    // Seed 000 C.2's protocol in miniature: measure each tier's NMSE on the data and give the
    // controller that table instead of the proxy (which assumes uniform key directions).
    let w = world("spherical", 7);
    let n = w.spec.tiers.len();
    let (mut kn, mut vn) = (vec![0.0; n], vec![0.0; n]);
    for t in 1..n {
        if w.spec.tiers[t].is_drop() {
            continue;
        }
        let r = 5 * w.p * D..6 * w.p * D;
        for (h, head) in w.heads.iter().enumerate() {
            let (k, v) = w.decoded[h][5][t].as_ref().unwrap();
            kn[t] += distortion::nmse(&head.k[r.clone()], k) / 2.0;
            vn[t] += distortion::nmse(&head.v[r.clone()], v) / 2.0;
        }
    }
    let table = DistortionTable::from_nmse(&w.spec, &kn, &vn).unwrap();
    println!("calibrated spherical ε: {:?} (proxy: {:?})", table.eps, DistortionTable::from_spec(&w.spec).eps);
    run("spherical", &mut || Box::new(RdrController::with_table(table.clone())), "RDR calibrated", &[0.35, 0.5, 0.65, 0.8, 0.95]);
}

#[test]
fn needles_and_sinks_survive_tight_budgets() {
    let w = world("rdkv", 42);
    let v = view_of(&w, true);
    let protection = Protection::default();
    // At the bytes of uniform b4 and b2 (the tightest uniform point).
    for t in [3, 4] {
        let l = Limits { budget: Budget::Total(uniform(&v, t, &protection).1), protection };
        let plan = rdr("rdkv").decide(&v, &l);
        let drop = v.costs.drop_tier().unwrap();
        for i in 0..2 {
            let page = needle_page(w.full, i);
            let tier = plan.tier_of(PageId { head: 0, index: page }, &v).unwrap();
            assert!(tier != drop, "at uniform tier {t} bytes: needle page {page} dropped");
        }
        // The sink page is protected.
        for h in 0..2 {
            assert_eq!(plan.tier_of(PageId { head: h, index: 0 }, &v), Some(1));
        }
    }
}
