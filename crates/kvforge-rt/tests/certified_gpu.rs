//! Certified decode on the GPU (seed 004): bound validity against exact f64 attention over the
//! fp16 originals, exact fallback rungs, fault injection. Run on the device with
//! `--ignored`; `KVFORGE_CERT_JSON=path` writes the run's statistics.

use std::sync::Arc;

use half::f16;
use kvforge_rt::certified::{CertConfig, CertPath, HeadCertificate, PageIn};
use kvforge_rt::{CacheConfig, Device, KvCache, RtError};
use kvforge_spec::{Spec, HEADER_BYTES, TAIL_TIER};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn spec() -> Spec {
    kvforge_rt::testing::shipped_spec("certified.toml")
}

fn h(x: f32) -> f64 {
    f16::from_f32(x).to_f32() as f64
}

/// Attention inputs of one trial: kind of adversarial structure planted.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Random,
    Outliers,
    Needle,
    Peaked,
    Flat,
    NearTies,
}

const KINDS: [Kind; 6] = [Kind::Random, Kind::Outliers, Kind::Needle, Kind::Peaked, Kind::Flat, Kind::NearTies];

struct Trial {
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
}

fn make_kv(rng: &mut ChaCha8Rng, kind: Kind, len: usize, hkv: usize, d: usize) -> Trial {
    let n = len * hkv * d;
    let mut k: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    match kind {
        Kind::Outliers => {
            for c in [3usize, 17] {
                for t in 0..len * hkv {
                    k[t * d + c % d] *= 50.0;
                }
            }
        }
        Kind::Needle => {
            let t = rng.gen_range(0..len);
            for hh in 0..hkv {
                for c in 0..d {
                    k[(t * hkv + hh) * d + c] = 4.0 * if c % 2 == 0 { 1.0 } else { -1.0 };
                }
            }
        }
        Kind::NearTies => {
            // Pages that repeat one block of keys: their masses tie.
            let period = 16 * hkv * d;
            for i in period..n {
                k[i] = k[i % period] + rng.gen_range(-1e-3f32..1e-3);
            }
        }
        _ => {}
    }
    Trial { k, v, len }
}

fn make_q(rng: &mut ChaCha8Rng, kind: Kind, hq: usize, d: usize) -> Vec<f32> {
    let scale = match kind {
        Kind::Peaked => 6.0,
        Kind::Flat => 0.05,
        _ => 1.0,
    };
    let mut q: Vec<f32> = (0..hq * d).map(|_| rng.gen_range(-1.0f32..1.0) * scale).collect();
    if let Kind::Needle = kind {
        for hh in 0..hq {
            for c in 0..d {
                q[hh * d + c] = if c % 2 == 0 { 1.0 } else { -1.0 } * rng.gen_range(0.5f32..1.5);
            }
        }
    }
    q
}

/// Exact attention in f64 over the fp16 originals of one sequence, every q head.
fn exact(t: &Trial, q: &[f32], hkv: usize, gqa: usize, d: usize) -> Vec<f64> {
    let mut out = vec![0f64; hkv * gqa * d];
    let sm = 1.0 / (d as f64).sqrt();
    for kh in 0..hkv {
        let k: Vec<f64> = (0..t.len).flat_map(|i| (0..d).map(move |c| (i, c))).map(|(i, c)| h(t.k[(i * hkv + kh) * d + c])).collect();
        let v: Vec<f64> = (0..t.len).flat_map(|i| (0..d).map(move |c| (i, c))).map(|(i, c)| h(t.v[(i * hkv + kh) * d + c])).collect();
        for g in 0..gqa {
            let row = kh * gqa + g;
            let qv: Vec<f64> = q[row * d..(row + 1) * d].iter().map(|&x| h(x)).collect();
            let (o, _) = kvforge_ref::attention::attention(&qv, &k, &v, sm);
            out[row * d..(row + 1) * d].copy_from_slice(&o);
        }
    }
    out
}

fn norm(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

#[derive(Default, serde::Serialize)]
struct Stats {
    trials: usize,
    violations: usize,
    tightness: Vec<f64>,
    rungs: [usize; 5],
    launches: usize,
    steps: usize,
    promoted_fraction: Vec<f64>,
}

#[test]
#[ignore = "needs a CUDA device"]
fn certified_bound_holds_on_random_and_adversarial_steps() {
    let dev = kvforge_rt::testing::device();
    let s = spec();
    let q8 = s.tier("q8k4v").unwrap().id;
    let mut rng = ChaCha8Rng::seed_from_u64(2026);
    let target: usize = std::env::var("KVFORGE_CERT_TRIALS").ok().and_then(|x| x.parse().ok()).unwrap_or(100_000);
    let mut st = Stats::default();
    let mut per_kind: std::collections::BTreeMap<String, [usize; 5]> = Default::default();
    let (hkv, d) = (8usize, 128usize);
    let mut round = 0usize;
    while st.trials < target {
        let gqa = [1usize, 4, 8][round % 3];
        let kind = KINDS[round % KINDS.len()];
        round += 1;
        let batch = 4;
        let cfg = CacheConfig::new(&s, d, gqa, hkv, batch, 4 * 2100).target(q8);
        let mut c = KvCache::new(dev.clone(), s.clone(), cfg).unwrap();
        c.keep_originals().unwrap();
        let mut trials = Vec::new();
        let mut seqs = Vec::new();
        for _ in 0..batch {
            // Lengths that are not multiples of the page (64) or block (16), down to 1 token.
            let len = match rng.gen_range(0..6) {
                0 => rng.gen_range(1..64),
                _ => rng.gen_range(64..2048),
            };
            let t = make_kv(&mut rng, kind, len, hkv, d);
            let a = c.add_sequence();
            c.append(a, &t.k, &t.v).unwrap();
            seqs.push(a);
            trials.push(t);
        }
        // Targets from loose to tight, so the ladder's rungs 1–3 are exercised too.
        let max_error = [0.05, 0.01, 0.002, 0.0005][round % 4];
        let mut cc = CertConfig { page_in: if round.is_multiple_of(2) { PageIn::Uva } else { PageIn::Copy }, max_error, ..CertConfig::default() };
        for _ in 0..6 {
            let q: Vec<f32> = (0..batch).flat_map(|_| make_q(&mut rng, kind, hkv * gqa, d)).collect();
            let r = c.decode_certified(&seqs, &q, &mut cc).unwrap();
            st.steps += 1;
            st.launches += r.launches;
            let hq = hkv * gqa;
            for (i, t) in trials.iter().enumerate() {
                let ex = exact(t, &q[i * hq * d..(i + 1) * hq * d], hkv, gqa, d);
                for row in 0..hq {
                    let cert = &r.heads[i * hq + row];
                    let o = &r.out[(i * hq + row) * d..(i * hq + row + 1) * d];
                    let diff: Vec<f64> = o.iter().zip(&ex[row * d..(row + 1) * d]).map(|(&a, &b)| a as f64 - b).collect();
                    let err = norm(&diff);
                    st.trials += 1;
                    st.rungs[cert.rung as usize] += 1;
                    per_kind.entry(format!("{kind:?}")).or_default()[cert.rung as usize] += 1;
                    if err > cert.bound {
                        st.violations += 1;
                        eprintln!("VIOLATION {kind:?} len {} gqa {gqa}: err {err:.3e} > bound {:.3e} ({cert:?})", t.len, cert.bound);
                    }
                    if err > 0.0 {
                        st.tightness.push(cert.bound / err);
                    }
                    let blocks = t.len / 64 * 4;
                    if blocks > 0 {
                        st.promoted_fraction.push((cert.promoted + cert.explored) as f64 / blocks as f64);
                    }
                }
            }
        }
    }
    st.tightness.sort_by(f64::total_cmp);
    let q = |p: f64| st.tightness[((st.tightness.len() - 1) as f64 * p) as usize];
    let mean_prom = st.promoted_fraction.iter().sum::<f64>() / st.promoted_fraction.len().max(1) as f64;
    println!(
        "{} head-steps in {} steps ({} launches): {} violations; tightness (bound / actual) min {:.2} p10 {:.2} p50 {:.2} p90 {:.2}; rungs {:?}; mean promoted fraction {:.3}",
        st.trials,
        st.steps,
        st.launches,
        st.violations,
        q(0.0),
        q(0.1),
        q(0.5),
        q(0.9),
        st.rungs,
        mean_prom
    );
    if let Ok(path) = std::env::var("KVFORGE_CERT_JSON") {
        let j = serde_json::json!({
            "device": dev.info.name, "trials": st.trials, "violations": st.violations, "steps": st.steps,
            "phase2_launches": st.launches,
            "tightness": {"min": q(0.0), "p01": q(0.01), "p10": q(0.1), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)},
            "rungs": st.rungs, "rungs_per_generator": per_kind, "mean_promoted_block_fraction": mean_prom,
        });
        std::fs::write(path, serde_json::to_string_pretty(&j).unwrap()).unwrap();
    }
    assert_eq!(st.violations, 0);
}

fn needle_cache(dev: &Arc<Device>, s: &Spec, len: usize, seed: u64) -> (KvCache, usize, Trial, Vec<f32>) {
    let (hkv, gqa, d) = (2usize, 4usize, 128usize);
    let q8 = s.tier("q8k4v").unwrap().id;
    let cfg = CacheConfig::new(s, d, gqa, hkv, 1, len + 64).target(q8);
    let mut c = KvCache::new(dev.clone(), s.clone(), cfg).unwrap();
    c.keep_originals().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let t = make_kv(&mut rng, Kind::Needle, len, hkv, d);
    let a = c.add_sequence();
    c.append(a, &t.k, &t.v).unwrap();
    let q = make_q(&mut rng, Kind::Needle, hkv * gqa, d);
    (c, a, t, q)
}

/// Asserts every head of `r` is exact (rung ≥ 3, no key or value error term) and equal to
/// exact fp16 attention up to the output rounding.
fn assert_exact(r: &kvforge_rt::certified::CertifiedOutput, ex: &[f64], d: usize) {
    for (row, cert) in r.heads.iter().enumerate() {
        assert!(cert.rung >= 3, "{cert:?}");
        assert_eq!(cert.e_key, 0.0);
        assert_eq!(cert.e_val, 0.0);
        for (x, y) in r.out[row * d..(row + 1) * d].iter().zip(&ex[row * d..(row + 1) * d]) {
            assert!((*x as f64 - y).abs() <= y.abs() / 2048.0 + 1e-6, "{x} vs {y}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn exact_rungs_equal_fp16_attention() {
    let dev = kvforge_rt::testing::device();
    let s = spec();
    // Rung 3: an unreachable target sends every kv head down the ladder to exact recompute.
    let (mut c, a, t, q) = needle_cache(&dev, &s, 1000, 1);
    let ex = exact(&t, &q, 2, 4, 128);
    let r = c.decode_certified(&[a], &q, &mut CertConfig { max_error: 0.0, layer_fallback: 1.1, ..CertConfig::default() }).unwrap();
    assert!(r.heads.iter().all(|h| h.rung == 3));
    assert_exact(&r, &ex, 128);
    // Rung 4: a fault detected in kv head 0 alone sends the whole layer to exact.
    let (mut c, a, t, q) = needle_cache(&dev, &s, 1000, 2);
    let ex = exact(&t, &q, 2, 4, 128);
    let needle = (0..t.len).max_by(|&i, &j| t.k[i * 2 * 128].total_cmp(&t.k[j * 2 * 128])).unwrap();
    let (page, _) = c.pages(a, 0).unwrap()[needle / 64];
    let q8 = s.tier("q8k4v").unwrap().id;
    let at = HEADER_BYTES + s.segment(q8, 128).offset("k_codes") + (needle % 64) * 128 + 5;
    let b = c.download_page(page).unwrap();
    c.write_page_bytes(page, at, &[b[at] ^ 0x80]).unwrap();
    let r = c.decode_certified(&[a], &q, &mut CertConfig { max_error: 1e9, layer_fallback: 0.0, ..CertConfig::default() }).unwrap();
    assert!(r.heads[..4].iter().any(|h| h.detections > 0), "{:?}", r.heads);
    assert!(r.heads.iter().all(|h| h.rung == 4), "{:?}", r.heads);
    assert_exact(&r, &ex, 128);
}

#[test]
#[ignore = "needs a CUDA device"]
fn injected_faults_are_detected() {
    let dev = kvforge_rt::testing::device();
    let s = spec();
    let q8 = s.tier("q8k4v").unwrap().id;
    let seg = s.segment(q8, 128);
    let (ks, kz, kc) = (HEADER_BYTES + seg.offset("k_scale"), HEADER_BYTES + seg.offset("k_zero"), HEADER_BYTES + seg.offset("k_codes"));
    let mut injected = 0;
    let mut detected = 0;
    for (fault, seed) in [("scale", 11u64), ("zero", 12), ("bit", 13), ("scale", 14), ("zero", 15), ("bit", 16)] {
        let (mut c, a, t, q) = needle_cache(&dev, &s, 1500, seed);
        // Fault in the page holding the needle (the page every head attends to): the
        // selector promotes it, so the score check sees it.
        let needle = (0..t.len).max_by(|&i, &j| t.k[i * 2 * 128].total_cmp(&t.k[j * 2 * 128])).unwrap();
        let pages = c.pages(a, 0).unwrap();
        let Some(&(page, _)) = pages.get(needle / 64).filter(|(p, _)| p.tier != TAIL_TIER) else { continue };
        let block = (needle % 64) / 16;
        match fault {
            "scale" => {
                let mut b = c.download_page(page).unwrap();
                for ch in 0..128 {
                    let at = ks + (block * 128 + ch) * 4;
                    let x = f32::from_le_bytes(b[at..at + 4].try_into().unwrap()) * 8.0;
                    b[at..at + 4].copy_from_slice(&x.to_le_bytes());
                }
                c.write_page_bytes(page, ks, &b[ks..kz]).unwrap();
            }
            "zero" => {
                // A stale zero: the previous block's zeros (or the next one's).
                let b = c.download_page(page).unwrap();
                let other = if block == 0 { 1 } else { block - 1 };
                let stale = b[kz + other * 128 * 4..kz + (other + 1) * 128 * 4].to_vec();
                c.write_page_bytes(page, kz + block * 128 * 4, &stale).unwrap();
            }
            _ => {
                let b = c.download_page(page).unwrap();
                let at = kc + (needle % 64) * 128 + 5;
                c.write_page_bytes(page, at, &[b[at] ^ 0x80]).unwrap();
            }
        }
        injected += 1;
        let r = c.decode_certified(&[a], &q, &mut CertConfig::default()).unwrap();
        let hit = r.heads[..4].iter().any(|h| h.detections > 0);
        println!("fault {fault} (seed {seed}) in page {} block {block}: detected {hit}; rungs {:?}", needle / 64, r.heads.iter().map(|h| h.rung).collect::<Vec<_>>());
        if hit {
            detected += 1;
            // Detected heads were recomputed exactly from tier 2.
            assert!(r.heads[..4].iter().all(|h| h.rung >= 3));
        }
    }
    // A missing tier-2 page is a typed error, not an output.
    let (mut c, a, _, q) = needle_cache(&dev, &s, 500, 21);
    let (page, _) = c.pages(a, 1).unwrap()[2];
    c.forget_original(&page);
    injected += 1;
    match c.decode_certified(&[a], &q, &mut CertConfig::default()) {
        Err(RtError::MissingOriginal { .. }) => detected += 1,
        other => panic!("missing original gave {:?}", other.map(|r| r.heads.len())),
    }
    println!("faults injected {injected}, detected {detected}");
    if let Ok(path) = std::env::var("KVFORGE_CERT_FAULTS_JSON") {
        std::fs::write(path, serde_json::json!({"faults_injected": injected, "faults_detected": detected}).to_string()).unwrap();
    }
    assert_eq!(injected, detected);
}

#[test]
#[ignore = "needs a CUDA device"]
fn certified_needs_originals_and_a_sane_query() {
    let dev = kvforge_rt::testing::device();
    let s = spec();
    let q8 = s.tier("q8k4v").unwrap().id;
    let mut c = KvCache::new(dev.clone(), s.clone(), CacheConfig::new(&s, 128, 4, 2, 1, 256).target(q8)).unwrap();
    let a = c.add_sequence();
    c.append(a, &vec![0.1; 100 * 256], &vec![0.1; 100 * 256]).unwrap();
    assert!(matches!(c.decode_certified(&[a], &vec![0.0; 8 * 128], &mut CertConfig::default()), Err(RtError::WrongState { .. })));
    assert!(matches!(c.keep_originals(), Err(RtError::WrongState { .. })));
    // A spec built without the certified entry (rdkv: `kernels.certified` unset) is refused
    // with a typed error that names the key, on both paths, before any launch.
    let r = kvforge_rt::testing::shipped_spec("rdkv.toml");
    let b8 = r.tier("b8").unwrap().id;
    let mut c = KvCache::new(dev.clone(), r.clone(), CacheConfig::new(&r, 128, 4, 2, 1, 256).target(b8)).unwrap();
    c.keep_originals().unwrap();
    let a = c.add_sequence();
    c.append(a, &vec![0.1; 100 * 256], &vec![0.1; 100 * 256]).unwrap();
    for path in [CertPath::Gpu, CertPath::Host] {
        let mut cfg = CertConfig { path, ..CertConfig::default() };
        match c.decode_certified(&[a], &vec![0.0; 8 * 128], &mut cfg) {
            Err(RtError::NotInSpec { fix, .. }) => assert!(fix.contains("certified = true"), "{fix}"),
            other => panic!("rdkv certified decode on {path:?}: {:?}", other.map(|_| ())),
        }
    }
}

/// Step time of certified decode against plain quantised and plain fp16 decode through the
/// same host API (upload, plan, launch, download), batch 1, 32 q / 8 kv heads, d 128. Prints a
/// table; `KVFORGE_CERT_TIME_JSON=path` writes it. Tests never assert on time.
#[test]
#[ignore = "needs a CUDA device"]
fn certified_step_time() {
    let dev = kvforge_rt::testing::device();
    let s = spec();
    let q8 = s.tier("q8k4v").unwrap().id;
    let fp16 = s.tier("fp16").unwrap().id;
    let (hkv, gqa, d) = (8usize, 4usize, 128usize);
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut rows = Vec::new();
    for ctx in [8192usize, 32768, 131072] {
        for kind in [Kind::Needle, Kind::Random] {
            let mut rng = ChaCha8Rng::seed_from_u64(ctx as u64);
            let t = make_kv(&mut rng, kind, ctx, hkv, d);
            let q = make_q(&mut rng, if let Kind::Needle = kind { Kind::Needle } else { Kind::Peaked }, hkv * gqa, d);
            let time = |tier, certified: Option<PageIn>| -> (f64, Option<kvforge_rt::certified::CertifiedOutput>) {
                let mut c = KvCache::new(dev.clone(), s.clone(), CacheConfig::new(&s, d, gqa, hkv, 1, ctx + 64).target(tier)).unwrap();
                if certified.is_some() {
                    c.keep_originals().unwrap();
                }
                let a = c.add_sequence();
                c.append(a, &t.k, &t.v).unwrap();
                let mut cc = CertConfig { page_in: certified.unwrap_or(PageIn::Uva), ..CertConfig::default() };
                let mut ts = Vec::new();
                let mut last = None;
                for i in 0..12 {
                    let t0 = std::time::Instant::now();
                    if certified.is_some() {
                        last = Some(c.decode_certified(&[a], &q, &mut cc).unwrap());
                    } else {
                        c.decode(&[a], &q).unwrap();
                    }
                    if i >= 2 {
                        ts.push(t0.elapsed().as_secs_f64() * 1e6);
                    }
                }
                (median(ts), last)
            };
            let (t_fp16, _) = time(fp16, None);
            let (t_q, _) = time(q8, None);
            let (t_copy, _) = time(q8, Some(PageIn::Copy));
            let (t_c, r) = time(q8, Some(PageIn::Uva));
            let r = r.unwrap();
            let promoted: usize = r.heads.iter().step_by(gqa).map(|h| h.promoted + h.explored).sum();
            let bound = r.heads.iter().map(|h| h.bound).fold(0.0, f64::max);
            println!(
                "ctx {ctx:6} {kind:?}: fp16 {t_fp16:8.0} us, q8k4v {t_q:8.0} us, certified UVA {t_c:8.0} us ({:.2}x q8k4v), copy {t_copy:8.0} us, {} launches, {:.1}% blocks promoted, paged in {:.1} MB, max bound {bound:.2e}",
                t_c / t_q,
                r.launches,
                100.0 * promoted as f64 / (hkv * (ctx / 16)) as f64,
                r.paged_in_bytes as f64 / 1e6
            );
            rows.push(serde_json::json!({"context": ctx, "attention": format!("{kind:?}"), "fp16_us": t_fp16, "q8k4v_us": t_q, "certified_us": t_c, "certified_uva_us": t_c, "certified_copy_us": t_copy,
                "launches": r.launches, "promoted_fraction": promoted as f64 / (hkv * (ctx / 16)) as f64, "paged_in_bytes": r.paged_in_bytes, "max_bound": bound}));
        }
    }
    if let Ok(path) = std::env::var("KVFORGE_CERT_TIME_JSON") {
        std::fs::write(path, serde_json::to_string_pretty(&serde_json::json!({"device": dev.info.name, "batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "timing": "host API wall time per step (upload, plan, launches, download), median of 10", "rows": rows})).unwrap()).unwrap();
    }
}

/// A cache of `lens` sequences of `kind` keys (8 kv heads, d 128) keeping its originals, and
/// one query per sequence.
fn cache_of(dev: &Arc<Device>, s: &Spec, rng: &mut ChaCha8Rng, kind: Kind, gqa: usize, lens: &[usize]) -> (KvCache, Vec<usize>, Vec<Trial>, Vec<f32>) {
    let (hkv, d) = (8usize, 128usize);
    let q8 = s.tier("q8k4v").unwrap().id;
    let total: usize = lens.iter().map(|l| l + 64).sum();
    let mut c = KvCache::new(dev.clone(), s.clone(), CacheConfig::new(s, d, gqa, hkv, lens.len(), total).target(q8)).unwrap();
    c.keep_originals().unwrap();
    let (mut seqs, mut trials) = (Vec::new(), Vec::new());
    for &len in lens {
        let t = make_kv(rng, kind, len, hkv, d);
        let a = c.add_sequence();
        c.append(a, &t.k, &t.v).unwrap();
        seqs.push(a);
        trials.push(t);
    }
    let q: Vec<f32> = (0..lens.len()).flat_map(|_| make_q(rng, kind, hkv * gqa, d)).collect();
    (c, seqs, trials, q)
}

/// Device and host certificate of one head: Δ, the counts and the checks exactly equal; the
/// f64 sums (α̂, E_key, E_val, E_round, bound) within 1e-9 relative + 1e-12·V_max absolute
/// (the device sums pages in another order and fuses multiply-adds; E_key's 1/L − 1 cancels
/// for tiny α̂Δ, hence the absolute part). Returns the largest relative difference.
fn assert_same_certificate(dev: &HeadCertificate, host: &HeadCertificate, what: &str) -> f64 {
    assert_eq!((dev.delta, dev.v_max), (host.delta, host.v_max), "{what}: {dev:?} vs {host:?}");
    assert_eq!((dev.promoted, dev.explored, dev.detections, dev.ranking, dev.boundary), (host.promoted, host.explored, host.detections, host.ranking, host.boundary), "{what}: {dev:?} vs {host:?}");
    let mut worst = 0f64;
    for (name, a, b) in [("alpha", dev.alpha_tail, host.alpha_tail), ("e_key", dev.e_key, host.e_key), ("e_val", dev.e_val, host.e_val), ("e_round", dev.e_round, host.e_round), ("bound", dev.bound, host.bound)]
    {
        if a == b {
            continue;
        }
        let diff = (a - b).abs();
        assert!(diff <= 1e-9 * b.abs() + 1e-12 * host.v_max, "{what}: {name} device {a:e} host {b:e} ({dev:?} vs {host:?})");
        worst = worst.max(diff / b.abs().max(f64::MIN_POSITIVE));
    }
    worst
}

/// The device selector picks exactly the host reference's pages and the device certificate
/// equals the f64 host reference (tolerance in `assert_same_certificate`), on needle, flat,
/// random, near-tie and outlier caches, lengths not multiple of the page (64) or block (16),
/// exact multiples and one-token caches, gqa 1/4/8, several seeds, exploration fractions and
/// clamps.
#[test]
#[ignore = "needs a CUDA device"]
fn device_selector_and_certificate_match_the_host_reference() {
    let dev = kvforge_rt::testing::device();
    let s = spec();
    let mut rng = ChaCha8Rng::seed_from_u64(404);
    let (mut groups, mut pages, mut heads, mut worst, mut explored, mut ranking, mut boundary) = (0usize, 0usize, 0usize, 0f64, 0usize, 0usize, 0usize);
    for (round, kind) in [Kind::Needle, Kind::Flat, Kind::Random, Kind::NearTies, Kind::Outliers, Kind::Peaked].into_iter().enumerate() {
        for gqa in [1usize, 4, 8] {
            let lens = [1, 1000, 1024, rng.gen_range(2..64), rng.gen_range(64..3000), 8192 + 37];
            let (mut c, seqs, _, q) = cache_of(&dev, &s, &mut rng, kind, gqa, &lens);
            for (i, cfg) in [
                CertConfig::default(),
                CertConfig { explore: 0.3, seed: 77, ..CertConfig::default() },
                CertConfig { coverage: 0.9, min_blocks: 3, max_blocks: 5, rank_depth: 3, seed: 78 + round as u64, ..CertConfig::default() },
                CertConfig { coverage: 1.0, explore: 0.0, ..CertConfig::default() },
            ]
            .into_iter()
            .enumerate()
            {
                let x = c.certified_crosscheck(&seqs, &q, &cfg).unwrap();
                for (gi, (d, h)) in x.device_state.iter().zip(&x.host_state).enumerate() {
                    assert_eq!(d, h, "{kind:?} gqa {gqa} config {i}: group {gi} (sequence {}, {} pages)", gi / 8, d.len());
                    pages += d.len();
                    explored += d.iter().filter(|&&s| s == 2).count();
                }
                groups += x.device_state.len();
                for (row, (d, h)) in x.device.iter().zip(&x.host).enumerate() {
                    worst = worst.max(assert_same_certificate(d, h, &format!("{kind:?} gqa {gqa} config {i} row {row}")));
                    heads += 1;
                    ranking += usize::from(d.ranking);
                    boundary += usize::from(d.boundary > 0);
                }
            }
        }
    }
    println!("{groups} groups, {pages} pages: device selection = host selection ({explored} explored); {heads} head certificates, largest relative difference {worst:.2e}; ranking triggers {ranking}, boundary triggers {boundary}");
}

/// Device path and host path give the same step: same output bits (same phase-2 page tables
/// through the same kernel), same rungs, page counts and checks, certificates within the
/// tolerance above; targets from loose to unreachable exercise rungs 1–4 (rungs 1–2 continue
/// on the host from the device's state, rungs 3–4 stay on the device).
#[test]
#[ignore = "needs a CUDA device"]
fn device_path_equals_host_path() {
    let dev = kvforge_rt::testing::device();
    let s = spec();
    let mut rng = ChaCha8Rng::seed_from_u64(405);
    let mut rungs = [0usize; 5];
    let mut host_ladder = 0usize;
    for (round, kind) in KINDS.into_iter().enumerate() {
        for max_error in [0.05, 0.002, 0.0002, 0.0] {
            let gqa = [1usize, 4, 8][round % 3];
            let lens = [1, rng.gen_range(2..64), rng.gen_range(64..2500), 2048];
            let (mut c, seqs, _, q) = cache_of(&dev, &s, &mut rng, kind, gqa, &lens);
            let layer_fallback = if max_error == 0.0 { 1.1 } else { 0.5 };
            let mut g = CertConfig { max_error, layer_fallback, seed: round as u64, ..CertConfig::default() };
            let mut h = CertConfig { path: CertPath::Host, ..g.clone() };
            // Copied page-in (DMA copies into the page-in buffer) serves the same bytes
            // from device memory: the same step as reading them over UVA.
            let mut hc = CertConfig { page_in: PageIn::Copy, ..h.clone() };
            for step in 0..2 {
                let a = c.decode_certified(&seqs, &q, &mut g).unwrap();
                let b = c.decode_certified(&seqs, &q, &mut h).unwrap();
                let bc = c.decode_certified(&seqs, &q, &mut hc).unwrap();
                let what = format!("{kind:?} gqa {gqa} max_error {max_error} step {step}");
                assert!(!b.host_ladder || b.kernel_us.is_none());
                assert_eq!((&b.out, &b.lse, b.launches, b.paged_in_bytes), (&bc.out, &bc.lse, bc.launches, bc.paged_in_bytes), "{what}: copied page-in differs from UVA");
                assert_eq!(b.heads, bc.heads, "{what}: copied page-in certificates");
                assert_eq!(a.out, b.out, "{what}: outputs differ");
                assert_eq!(a.lse, b.lse, "{what}");
                assert_eq!((a.launches, a.paged_in_bytes), (b.launches, b.paged_in_bytes), "{what}");
                for (row, (x, y)) in a.heads.iter().zip(&b.heads).enumerate() {
                    assert_eq!(x.rung, y.rung, "{what} row {row}: {x:?} vs {y:?}");
                    assert_same_certificate(x, y, &format!("{what} row {row}"));
                    rungs[x.rung as usize] += 1;
                }
                host_ladder += usize::from(a.host_ladder);
            }
        }
    }
    println!("device path = host path; rungs {rungs:?}; {host_ladder} device-path steps continued on the host");
    // Rungs 1–2 run on the host continuation of a device step (`host_ladder`); on these caches
    // the heads they do not settle go on to rung 3, so they need not be any head's final rung
    // (H100: final rungs [5376, 0, 0, 256, 1024], 36 steps continued on the host).
    assert!(host_ladder > 0 && rungs[3] > 0 && rungs[4] > 0, "{rungs:?}, {host_ladder} host continuations");
}

/// A small step through every certify kernel path (selection, exploration, forced rungs 3–4):
/// the case compute-sanitizer runs (`--kernel-name regex:cert`).
#[test]
#[ignore = "needs a CUDA device"]
fn certify_kernels_small_batch() {
    let dev = kvforge_rt::testing::device();
    let s = spec();
    let mut rng = ChaCha8Rng::seed_from_u64(406);
    let (mut c, seqs, trials, q) = cache_of(&dev, &s, &mut rng, Kind::Needle, 4, &[1, 100, 700, 1024]);
    let cfg = CertConfig { explore: 0.5, rank_depth: 2, ..CertConfig::default() };
    let x = c.certified_crosscheck(&seqs, &q, &cfg).unwrap();
    assert_eq!(x.device_state, x.host_state);
    for (d, h) in x.device.iter().zip(&x.host) {
        assert_same_certificate(d, h, "small");
    }
    // Progress lines: under a sanitizer they show how far the process got.
    eprintln!("certify_kernels_small_batch: crosscheck round done");
    // A flipped key bit in the needle's page (promoted: every head attends to it) is a
    // detection: rung 3 on the device, and with a zero layer threshold rung 4 for all.
    let t = &trials[3];
    let needle = (0..t.len).max_by(|&i, &j| t.k[i * 8 * 128].total_cmp(&t.k[j * 8 * 128])).unwrap();
    let (page, _) = c.pages(seqs[3], 0).unwrap()[needle / 64];
    let q8 = s.tier("q8k4v").unwrap().id;
    let at = HEADER_BYTES + s.segment(q8, 128).offset("k_codes") + (needle % 64) * 128 + 5;
    let b = c.download_page(page).unwrap();
    c.write_page_bytes(page, at, &[b[at] ^ 0x80]).unwrap();
    let r = c.decode_certified(&seqs, &q, &mut CertConfig { max_error: 1e9, layer_fallback: 0.0, ..CertConfig::default() }).unwrap();
    assert!(r.heads.iter().any(|h| h.detections > 0) && !r.host_ladder);
    assert!(r.heads.iter().all(|h| h.rung == 4), "{:?}", r.heads.iter().map(|h| h.rung).collect::<Vec<_>>());
    eprintln!("certify_kernels_small_batch: forced rung 3-4 step done");
}
