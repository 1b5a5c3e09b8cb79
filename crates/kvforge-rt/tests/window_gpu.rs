//! GPU tests of the window policy (`CacheConfig::window`, issue 26): every append path keeps
//! the sink pages and the recent window dense and encodes the pages in between, and decode
//! over a page list that mixes dense and coded pages (host plan and device-resident plan)
//! matches the f64 reference on the pages as stored. Run on the device with
//! `cargo test --release -p kvforge-rt --test window_gpu -- --ignored`.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr};
use half::f16;
use kvforge_rt::testing::data_f16 as data;
use kvforge_rt::{CacheConfig, Device, ElemType, ExternalTensor, KvCache, WindowPolicy};
use kvforge_spec::TAIL_TIER;

const D: usize = 64;
const HKV: usize = 3;
const GQA: usize = 3;
const HQ: usize = HKV * GQA;
const SINK: usize = 1;
const RECENT: usize = 2;

/// (spec file, target tier): integer, rotated (Hadamard basis), spherical (its radius scales
/// are calibrated from the first page encoded, which the window defers to a later append:
/// the host encode path of dense pages) and dense targets.
const CASES: &[(&str, &str)] = &[("rdkv.toml", "b4"), ("rdkv.toml", "b2"), ("rotated.toml", "r3"), ("rotated.toml", "r2"), ("spherical.toml", "high"), ("baseline.toml", "fp16")];

fn upload_f16(dev: &Device, x: &[f32]) -> CudaSlice<u16> {
    let bits: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    dev.stream.clone_htod(&bits).unwrap()
}

fn ext<T>(dev: &Device, s: &CudaSlice<T>, elem: ElemType, shape: &[usize]) -> ExternalTensor {
    ExternalTensor::contiguous(s.device_ptr(&dev.stream).0, elem, shape, dev.ctx.ordinal())
}

fn cache(dev: &Arc<Device>, file: &str, target: &str, sequences: usize, tokens: usize) -> KvCache {
    let s = kvforge_rt::testing::shipped_spec(file);
    let t = s.tier(target).unwrap().id;
    let mut cfg = CacheConfig::new(&s, D, GQA, HKV, sequences, tokens).target(t).window(SINK, RECENT, sequences);
    cfg.verify_headers = true;
    KvCache::new(dev.clone(), s, cfg).unwrap()
}

/// Every head's full pages are dense exactly where the policy says (sinks and the window), in
/// the target tier elsewhere; returns the dense full pages per head.
fn assert_policy(c: &KvCache, seq: usize, what: &str) -> usize {
    let (p, target) = (c.spec().page.tokens, c.config().target_tier);
    let len = c.seq_len(seq).unwrap();
    let full = len / p;
    let w = WindowPolicy::new(SINK, RECENT);
    let mut dense = 0;
    for h in 0..HKV {
        let pages = c.positioned_pages(seq, h).unwrap();
        assert_eq!(pages.len(), full + usize::from(!len.is_multiple_of(p)), "{what}: head {h} pages");
        for (pg, n, first) in pages {
            if n < p {
                assert_eq!((pg.tier, first), (TAIL_TIER, full * p), "{what}: head {h} tail");
                continue;
            }
            let want = if w.keeps_dense(first / p, full) { TAIL_TIER } else { target };
            assert_eq!(pg.tier, want, "{what}: head {h} page {} of {full} full", first / p);
            dense += usize::from(h == 0 && pg.tier == TAIL_TIER);
        }
    }
    dense
}

/// f64 reference of (seq, kv head) for a natural-basis query row: the pages as stored,
/// dequantised by kvforge-ref, attended in the stored basis, the output mapped back.
fn reference(c: &KvCache, seq: usize, head: usize, q: &[f32]) -> (Vec<f64>, f64, f64) {
    let s = c.spec();
    let (kk, vv) = kvforge_rt::testing::reference_kv(c, seq, head, None);
    let vmax = vv.iter().fold(0f64, |m, x| m.max(x.abs()));
    let basis = s.basis();
    let mut qf: Vec<f64> = q.iter().map(|&x| x as f64).collect();
    basis.to_stored_f64(D, &mut qf);
    let (mut o, lse) = kvforge_ref::attention(&qf, &kk, &vv, 1.0 / (D as f64).sqrt());
    basis.to_natural(D, &mut o);
    (o, lse, vmax)
}

/// Host decode and the device-resident decode of `seqs` against [`reference`] (two fp16 ulps
/// of the largest value, four in a rotated basis: the output is rotated back in f32).
fn assert_decode(dev: &Device, c: &mut KvCache, seqs: &[usize], step: u32, what: &str) {
    let q = data(seqs.len() * HQ * D, 100 + step);
    let host = c.decode(seqs, &q).unwrap();
    let qd = upload_f16(dev, &q);
    let out = dev.stream.alloc_zeros::<u16>(seqs.len() * HQ * D).unwrap();
    let lse = dev.stream.alloc_zeros::<f32>(seqs.len() * HQ).unwrap();
    c.decode_step_external(seqs, &ext(dev, &qd, ElemType::F16, &[seqs.len(), HQ, D]), &ext(dev, &out, ElemType::F16, &[seqs.len(), HQ, D]), &ext(dev, &lse, ElemType::F32, &[seqs.len(), HQ])).unwrap();
    c.synchronize().unwrap();
    let resident: Vec<f32> = dev.stream.clone_dtoh(&out).unwrap().into_iter().map(|b| f16::from_bits(b).to_f32()).collect();
    let ulps = if c.spec().basis().is_identity() { 2.0 } else { 4.0 };
    for (i, &s) in seqs.iter().enumerate() {
        for hq in 0..HQ {
            let row = i * HQ + hq;
            let (ro, rl, vmax) = reference(c, s, hq / GQA, &q[row * D..(row + 1) * D]);
            let tol = ulps * 2f64.powi(-11) * vmax + 1e-5;
            for d in 0..D {
                let (h, r) = (host.out[row * D + d] as f64, resident[row * D + d] as f64);
                assert!((h - ro[d]).abs() <= tol, "{what}: seq {s} q head {hq} ch {d}: host {h} want {} (tol {tol:.2e})", ro[d]);
                assert!((r - ro[d]).abs() <= tol, "{what}: seq {s} q head {hq} ch {d}: resident {r} want {} (tol {tol:.2e})", ro[d]);
            }
            assert!((host.lse[row] as f64 - rl).abs() < 1e-3 * rl.abs().max(1.0), "{what}: lse seq {s} q head {hq}: {} vs {rl}", host.lse[row]);
        }
    }
}

/// One sequence through every append path (host bulk, host single tokens, device bulk, device
/// decode steps), a second shorter than sinks + window, and a one-token third: after each
/// phase the pages follow the policy, the memory report counts dense pages as the tail tier,
/// and both decode plans match the reference over the mixed page lists.
#[test]
#[ignore = "needs a CUDA device"]
fn every_append_path_keeps_sinks_and_window_dense_and_decode_matches_reference() {
    let dev = kvforge_rt::testing::device();
    for &(file, target) in CASES {
        let mut c = cache(&dev, file, target, 3, 4096);
        let p = c.spec().page.tokens;
        let (a, b, one) = (c.add_sequence(), c.add_sequence(), c.add_sequence());
        let mut fed = 0usize;
        let mut step = 0u32;
        let feed_host = |c: &mut KvCache, seq: usize, n: usize, fed: &mut usize| {
            let (k, v) = (data(n * HKV * D, 1 + *fed as u32), data(n * HKV * D, 7 + *fed as u32));
            c.append(seq, &k, &v).unwrap();
            *fed += n;
        };
        // b: shorter than sinks + window (2 full pages and a tail): never encoded.
        feed_host(&mut c, b, 2 * p + 9, &mut fed);
        feed_host(&mut c, one, 1, &mut fed);
        // a: a prompt of 5 pages and a bit (pages 1 and 2 coded at once, 0, 3, 4 dense).
        feed_host(&mut c, a, 5 * p + 3, &mut fed);
        assert_eq!(assert_policy(&c, a, "host prompt"), 3);
        assert_eq!(assert_policy(&c, b, "short"), 2);
        assert_decode(&dev, &mut c, &[a, b, one], step, &format!("{file}/{target} host prompt"));
        // Host single-token appends across a page boundary (page 3 leaves the window).
        for _ in 0..p {
            feed_host(&mut c, a, 1, &mut fed);
        }
        assert_policy(&c, a, "host tokens");
        step += 1;
        assert_decode(&dev, &mut c, &[a, b], step, &format!("{file}/{target} host tokens"));
        // Device bulk append of 3.5 pages from a partial tail.
        let n = 3 * p + p / 2;
        let (k, v) = (upload_f16(&dev, &data(n * HKV * D, 31)), upload_f16(&dev, &data(n * HKV * D, 32)));
        c.append_external_device(a, &ext(&dev, &k, ElemType::F16, &[n, HKV, D]), &ext(&dev, &v, ElemType::F16, &[n, HKV, D])).unwrap();
        assert_policy(&c, a, "device bulk");
        step += 1;
        assert_decode(&dev, &mut c, &[a, one, b], step, &format!("{file}/{target} device bulk"));
        // Device decode steps of a and b over more than a page, the resident plan synced
        // after every step (a fill re-codes a dense page in place).
        for i in 0..(p + 5) {
            let (k, v) = (upload_f16(&dev, &data(2 * HKV * D, 50 + i as u32)), upload_f16(&dev, &data(2 * HKV * D, 60 + i as u32)));
            c.append_step(&[a, b], &k, &v).unwrap();
            if i % 16 == 0 || i == p / 2 {
                step += 1;
                assert_decode(&dev, &mut c, &[a, b], step, &format!("{file}/{target} step {i}"));
            }
        }
        let dense = assert_policy(&c, a, "device steps");
        assert_eq!(dense, SINK + RECENT);
        // b now holds 3 full pages: still all dense (page 0 a sink, pages 1 and 2 the window).
        assert_eq!(assert_policy(&c, b, "short after steps"), 3);
        step += 1;
        assert_decode(&dev, &mut c, &[a, b, one], step, &format!("{file}/{target} final"));
        c.verify_pages(&[a, b, one]).unwrap();
        // The memory report counts dense full pages as the tail tier.
        let tail_tokens: usize = [a, b, one].iter().map(|&s| c.seq_len(s).unwrap()).sum::<usize>();
        let report = c.memory_report();
        let t0 = &report[TAIL_TIER as usize];
        let coded: usize = report.iter().skip(1).map(|u| u.tokens).sum();
        assert_eq!(t0.tokens + coded, tail_tokens * HKV, "{file}/{target}: {report:?}");
        let dense_b = 3 * p + (c.seq_len(b).unwrap() % p);
        let dense_a = (SINK + RECENT) * p + c.seq_len(a).unwrap() % p;
        assert_eq!(t0.tokens, (dense_a + dense_b + 1) * HKV, "{file}/{target}: {report:?}");
        println!("{file}/{target}: sinks and window dense on every append path, decode matches the reference ({step} checks)");
    }
}

/// A spherical target calibrates its radius scales from the first pages it encodes; with a
/// window those are dense pages a decode step pushes out of it, downloaded and encoded by the
/// host path's steps.
#[test]
#[ignore = "needs a CUDA device"]
fn spherical_scales_calibrate_from_the_first_dense_page_encoded() {
    let dev = kvforge_rt::testing::device();
    let mut c = cache(&dev, "spherical.toml", "high", 1, 2048);
    let high = c.config().target_tier;
    let p = c.spec().page.tokens;
    let a = c.add_sequence();
    c.append(a, &data(3 * p * HKV * D, 3), &data(3 * p * HKV * D, 4)).unwrap();
    assert!(c.radius_scales(high).unwrap().is_none(), "nothing encoded yet");
    for i in 0..(p + 1) {
        let (k, v) = (upload_f16(&dev, &data(HKV * D, 80 + i as u32)), upload_f16(&dev, &data(HKV * D, 90 + i as u32)));
        c.append_step(&[a], &k, &v).unwrap();
    }
    assert!(c.radius_scales(high).unwrap().is_some(), "page 1 left the window and was encoded");
    assert_eq!(assert_policy(&c, a, "spherical steps"), SINK + RECENT);
    assert_decode(&dev, &mut c, &[a], 0, "spherical/high after the first window encode");
}

/// CUDA-graph steps (prepared and launched on the cache's stream, as a replay runs them) between
/// plain fill steps: `graph_prepare` answers None exactly at the fills, the plain step keeps the
/// filled page dense and encodes the one leaving the window, and every step's output matches
/// the reference.
#[test]
#[ignore = "needs a CUDA device"]
fn graph_steps_between_plain_fill_steps_keep_the_window() {
    let dev = kvforge_rt::testing::device();
    for &(file, target) in &[("rotated.toml", "r3"), ("rdkv.toml", "b4")] {
        let mut c = cache(&dev, file, target, 1, 2048);
        let p = c.spec().page.tokens;
        let a = c.add_sequence();
        c.append(a, &data((3 * p + 10) * HKV * D, 5), &data((3 * p + 10) * HKV * D, 6)).unwrap();
        let out = dev.stream.alloc_zeros::<u16>(HQ * D).unwrap();
        let lse = dev.stream.alloc_zeros::<f32>(HQ).unwrap();
        let (ot, lt) = (ext(&dev, &out, ElemType::F16, &[1, HQ, D]), ext(&dev, &lse, ElemType::F32, &[1, HQ]));
        let stream = dev.stream.cu_stream() as u64;
        let (mut graph_steps, mut plain_steps) = (0, 0);
        let ulps = if c.spec().basis().is_identity() { 2.0 } else { 4.0 };
        for i in 0..(2 * p + 3) as u32 {
            let (k, v, q) = (upload_f16(&dev, &data(HKV * D, 200 + i)), upload_f16(&dev, &data(HKV * D, 400 + i)), data(HQ * D, 600 + i));
            let qd = upload_f16(&dev, &q);
            let (kt, vt, qt) = (ext(&dev, &k, ElemType::F16, &[1, HKV, D]), ext(&dev, &v, ElemType::F16, &[1, HKV, D]), ext(&dev, &qd, ElemType::F16, &[1, HQ, D]));
            let tail = c.page_counts(a, 0).unwrap().1.unwrap_or(0);
            match c.graph_prepare(&[a]).unwrap() {
                Some(_) => {
                    assert_ne!(tail + 1, p, "{file}/{target}: a step that fills its tail is not a graph step");
                    // SAFETY: the cache's own stream; the tensors live until the synchronize below.
                    unsafe { c.graph_launch(stream, &[a], &kt, &vt, &qt, &ot, &lt) }.unwrap();
                    c.graph_commit(&[a]).unwrap();
                    graph_steps += 1;
                }
                None => {
                    assert_eq!(tail + 1, p, "{file}/{target}: graph_prepare refused a step that fills nothing");
                    c.step_external(&[a], &kt, &vt, &qt, &ot, &lt).unwrap();
                    plain_steps += 1;
                }
            }
            c.synchronize().unwrap();
            if i % 8 == 0 || tail + 2 >= p || tail < 2 {
                let got: Vec<f32> = dev.stream.clone_dtoh(&out).unwrap().into_iter().map(|b| f16::from_bits(b).to_f32()).collect();
                for hq in 0..HQ {
                    let (ro, _, vmax) = reference(&c, a, hq / GQA, &q[hq * D..(hq + 1) * D]);
                    let tol = ulps * 2f64.powi(-11) * vmax + 1e-5;
                    for d in 0..D {
                        assert!((got[hq * D + d] as f64 - ro[d]).abs() <= tol, "{file}/{target} step {i}: q head {hq} ch {d}: {} want {} (tol {tol:.2e})", got[hq * D + d], ro[d]);
                    }
                }
            }
        }
        assert_eq!((plain_steps, graph_steps), (2, 2 * p + 1), "{file}/{target}");
        assert_eq!(assert_policy(&c, a, "graph steps"), SINK + RECENT);
        c.verify_pages(&[a]).unwrap();
        println!("{file}/{target}: {graph_steps} graph steps and {plain_steps} plain fill steps keep the window; outputs match the reference");
    }
}

/// A pool whose tail tier cannot hold the window is an all-or-nothing out-of-pages error,
/// not a half-applied append; certified decode and tiling refuse a window.
#[test]
#[ignore = "needs a CUDA device"]
fn a_tail_tier_too_small_for_the_window_refuses_the_append() {
    let dev = kvforge_rt::testing::device();
    let s = kvforge_rt::testing::shipped_spec("rdkv.toml");
    let b4 = s.tier("b4").unwrap().id;
    let p = s.page.tokens;
    let mut cfg = CacheConfig::new(&s, D, GQA, HKV, 1, 16 * p).target(b4).window(SINK, RECENT, 1);
    cfg.pages[TAIL_TIER as usize] = 2 * HKV;
    let mut c = KvCache::new(dev, s, cfg).unwrap();
    let a = c.add_sequence();
    let n = 4 * p;
    let err = c.append(a, &data(n * HKV * D, 1), &data(n * HKV * D, 2)).unwrap_err();
    assert!(matches!(err, kvforge_rt::RtError::OutOfPages { .. }), "{err:?}");
    assert_eq!(c.seq_len(a).unwrap(), 0);
    assert_eq!(c.pool().used_pages(TAIL_TIER), 0);
    // Certified decode (its value bound reads the tail page only) and benchmark tiling refuse
    // a window with typed errors.
    assert!(matches!(c.keep_originals(), Err(kvforge_rt::RtError::WrongState { .. })));
    assert!(matches!(c.tile_sequence(a, 2, 64), Err(kvforge_rt::RtError::BadInput(m)) if m.contains("window policy")));
}
