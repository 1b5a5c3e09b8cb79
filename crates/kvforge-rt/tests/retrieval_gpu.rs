//! GPU tests of ParisKV inside the main cache (`kvforge_rt::retrieval`, issue 27): pages past
//! the local window move from a `KvCache` of any tier to a `ParisIndex`, and one decode step
//! over both is one softmax. With a top-k that covers the retrieval region the step must equal
//! attention over the GPU region as stored (f64 reference of its pages) plus the moved rows in
//! fp16. Run on the device with `cargo test --release -p kvforge-rt --test retrieval_gpu -- --ignored`.

use kvforge_paris::{ParisConfig, Rank, SummaryLayout};
use kvforge_rt::paris::ParisGeometry;
use kvforge_rt::retrieval::{RegionPolicy, RetrievalCache};
use kvforge_rt::testing::{data_f16, device, reference_kv, shipped_spec};
use kvforge_rt::{CacheConfig, RtError};

const D: usize = 128;
const HKV: usize = 2;
const GQA: usize = 4;
const HQ: usize = HKV * GQA;
const P: usize = 64;
const POLICY: RegionPolicy = RegionPolicy { sink_pages: 1, local_pages: 2, update_pages: 1 };

fn geometry(batch: usize, capacity: usize) -> ParisGeometry {
    ParisGeometry {
        batch,
        kv_heads: HKV,
        gqa: GQA,
        per_query_head: false,
        rank: Rank::default(),
        layout: SummaryLayout::Whole64,
        capacity,
        dense_capacity: 1,
        max_candidates: 8192,
        max_k: 1024,
        host_budget_bytes: 1 << 30,
    }
}

/// A retrieval cache over `file`'s `target` tier (`window`: the cache's own dense window of
/// one sink and two recent pages, else every full page coded).
fn retrieval_cache(file: &str, target: &str, window: bool, batch: usize, capacity: usize) -> RetrievalCache {
    let spec = shipped_spec(file);
    let t = spec.tier(target).unwrap().id;
    let mut cfg = CacheConfig::new(&spec, D, GQA, HKV, batch, 4096).target(t);
    if window {
        cfg = cfg.window(1, 2, batch);
    }
    cfg.verify_headers = true;
    RetrievalCache::new(device(), spec, cfg, ParisConfig::default_for(D), geometry(batch, capacity), POLICY).unwrap()
}

/// Appends `n` tokens of sequence `seq` (`[n][HKV][D]`, fp16-exact): a prefill of `prefill`
/// tokens, then one token per call, as decoding does. Returns the keys and values.
fn fill(rc: &mut RetrievalCache, seq: usize, n: usize, prefill: usize) -> (Vec<f32>, Vec<f32>) {
    let (k, v) = (data_f16(n * HKV * D, 7 + seq as u32), data_f16(n * HKV * D, 19 + seq as u32));
    let row = HKV * D;
    rc.append(seq, &k[..prefill * row], &v[..prefill * row]).unwrap();
    for t in prefill..n {
        rc.append(seq, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row]).unwrap();
    }
    (k, v)
}

/// f64 attention of query head `j` of `seq` over the cache's pages as stored (natural basis)
/// and the rows the index holds (`moved` tokens after the sink page, from `k`, `v`).
fn reference(rc: &RetrievalCache, seq: usize, j: usize, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f64> {
    let h = j / GQA;
    let c = rc.cache();
    let (mut kk, mut vv) = reference_kv(c, seq, h, None);
    let basis = c.spec().basis();
    basis.to_natural(D, &mut kk);
    basis.to_natural(D, &mut vv);
    let moved = rc.retrieval_len(seq).unwrap();
    for t in P * POLICY.sink_pages..P * POLICY.sink_pages + moved {
        let at = (t * HKV + h) * D;
        kk.extend(k[at..at + D].iter().map(|&x| x as f64));
        vv.extend(v[at..at + D].iter().map(|&x| x as f64));
    }
    let qj = &q[(seq * HQ + j) * D..(seq * HQ + j + 1) * D];
    let scores: Vec<f64> = kk.chunks_exact(D).map(|kr| kr.iter().zip(qj).map(|(a, &b)| a * b as f64).sum::<f64>() / (D as f64).sqrt()).collect();
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let sum: f64 = w.iter().sum();
    (0..D).map(|c| w.iter().zip(vv.chunks_exact(D)).map(|(wi, vr)| wi * vr[c]).sum::<f64>() / sum).collect()
}

/// The largest |device − reference| over every query head of every sequence.
fn max_error(rc: &mut RetrievalCache, batch: usize, kv: &[(Vec<f32>, Vec<f32>)]) -> f64 {
    let q: Vec<f32> = data_f16(batch * HQ * D, 31).iter().map(|x| 2.0 * x).collect();
    let out = rc.decode(&q, 1024).unwrap();
    let mut err = 0f64;
    for (s, (k, v)) in kv.iter().enumerate() {
        for j in 0..HQ {
            let want = reference(rc, s, j, &q, k, v);
            let got = &out.out[(s * HQ + j) * D..(s * HQ + j + 1) * D];
            for (a, b) in got.iter().zip(&want) {
                err = err.max((*a as f64 - b).abs());
            }
        }
    }
    err
}

#[test]
#[ignore = "needs a CUDA device"]
fn pages_past_the_window_move_to_the_index_and_decode_is_one_softmax() {
    // (spec, target tier, the cache's own dense window): integer, rotated (the Hadamard
    // basis: the cache rotates, the index keeps natural rows) and coded pages in the window.
    for (file, target, window) in [("rdkv.toml", "b8", false), ("rdkv.toml", "b4", true), ("rotated.toml", "r3", true)] {
        let mut rc = retrieval_cache(file, target, window, 2, 4096);
        // 1000 tokens: 15 full pages, 12 past sink + window (768 rows); 700: 10 full, 7 moved.
        let kv = vec![fill(&mut rc, 0, 1000, 600), fill(&mut rc, 1, 700, 300)];
        assert_eq!((rc.retrieval_len(0).unwrap(), rc.retrieval_len(1).unwrap()), (768, 448), "{file} {target}");
        for s in 0..2 {
            for h in 0..HKV {
                // Sink, two window pages, the tail.
                assert_eq!(rc.cache().page_count(s, h).unwrap(), 4, "{file} {target} seq {s} head {h}");
            }
        }
        let err = max_error(&mut rc, 2, &kv);
        eprintln!("{file} {target} window {window}: max |error| {err:.3e}");
        assert!(err < 2e-3, "{file} {target}: max |error| {err:.3e}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn short_sequences_attend_the_gpu_region_alone() {
    // 100 and 250 tokens: fewer than sink + window + update pages, nothing moves and the index
    // is not launched.
    let mut rc = retrieval_cache("rdkv.toml", "b8", false, 2, 4096);
    let kv = vec![fill(&mut rc, 0, 100, 100), fill(&mut rc, 1, 250, 1)];
    assert_eq!((rc.retrieval_len(0).unwrap(), rc.retrieval_len(1).unwrap()), (0, 0));
    let err = max_error(&mut rc, 2, &kv);
    assert!(err < 2e-3, "max |error| {err:.3e}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_move_past_the_host_budget_keeps_the_pages_on_the_gpu() {
    // The index holds 200 keys per sequence; the prefill's move (768 rows) is refused.
    let mut rc = retrieval_cache("rdkv.toml", "b8", false, 1, 200);
    let (k, v) = (data_f16(1000 * HKV * D, 7), data_f16(1000 * HKV * D, 19));
    let e = rc.append(0, &k, &v).unwrap_err();
    assert!(matches!(e, RtError::HostBudget { .. }), "{e}");
    assert_eq!(rc.retrieval_len(0).unwrap(), 0);
    assert_eq!(rc.len(0).unwrap(), 1000);
    for h in 0..HKV {
        assert_eq!(rc.cache().page_count(0, h).unwrap(), 16, "head {h}: every page stays");
    }
    // Decode still attends every token, from the GPU.
    let err = max_error(&mut rc, 1, &[(k, v)]);
    assert!(err < 2e-3, "max |error| {err:.3e}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_batch_mixes_empty_and_filled_retrieval_regions() {
    // Sequence 0 stays within sink + window (nothing moves), sequence 1 moves 12 pages: the
    // merge takes sequence 0's GPU region alone, whatever the retrieval wrote for it.
    let mut rc = retrieval_cache("rotated.toml", "r3", true, 2, 4096);
    let kv = vec![fill(&mut rc, 0, 200, 50), fill(&mut rc, 1, 1000, 1000)];
    assert_eq!((rc.retrieval_len(0).unwrap(), rc.retrieval_len(1).unwrap()), (0, 768));
    // Twice: the second step reuses the resident plan and the buffers.
    for _ in 0..2 {
        let err = max_error(&mut rc, 2, &kv);
        eprintln!("mixed batch: max |error| {err:.3e}");
        assert!(err < 2e-3, "max |error| {err:.3e}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_long_prefill_goes_through_a_small_cache_in_pieces() {
    // A cache sized for the window and one append piece (`RetrievalCache::gpu_tokens`) takes a
    // 40000-token prefill in one call: pieces of `APPEND_PIECE` tokens, each moved on.
    let spec = shipped_spec("rotated.toml");
    let t = spec.tier("r3").unwrap().id;
    let cfg = CacheConfig::new(&spec, D, GQA, HKV, 1, RetrievalCache::gpu_tokens(POLICY, P)).target(t);
    let mut rc = RetrievalCache::new(device(), spec, cfg, ParisConfig::default_for(D), geometry(1, 40_000), POLICY).unwrap();
    let n = 40_000;
    let (k, v) = (data_f16(n * HKV * D, 7), data_f16(n * HKV * D, 19));
    rc.append(0, &k, &v).unwrap();
    // 625 full pages: all but the sink page and the two local pages moved.
    assert_eq!(rc.retrieval_len(0).unwrap(), (625 - 3) * P);
    for h in 0..HKV {
        assert_eq!(rc.cache().page_count(0, h).unwrap(), 3, "head {h}: sink and two local pages (40000 = 625 × 64)");
    }
    let q = data_f16(HQ * D, 31);
    let out = rc.decode(&q, 256).unwrap();
    assert!(out.out.iter().chain(&out.lse).all(|x| x.is_finite()));
}
