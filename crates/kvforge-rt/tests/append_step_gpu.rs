//! GPU tests of the decode-step append (`KvCache::append_step`, issue 29): a serving loop's
//! one-token-per-sequence appends from device memory leave the same pages as the host append
//! (byte for byte where the spec does not rotate; within fp16 rounding of the rotation, and
//! the same decode within tolerance, where it does), through tails that fill mid-step, new
//! sequences, sequences skipping steps and host appends in between (stale tail mirrors);
//! out-of-pages changes nothing and bad arguments are typed errors. Run on the device with
//! `cargo test -p kvforge-rt --test append_step_gpu -- --ignored`. The prompt-sized device append
//! (`KvCache::append_device`) is checked the same way against per-token host appends.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::f16;
use kvforge_rt::testing::data_f16 as data;
use kvforge_rt::{CacheConfig, Device, KvCache, RtError};
use kvforge_spec::{Spec, HEADER_BYTES, TAIL_TIER};

const D: usize = 64;
const HKV: usize = 3;
const GQA: usize = 3;
const HQ: usize = HKV * GQA;
const SEQS: usize = 4;

/// (spec file, target tier name): dense, integer, spherical, rotated.
const CASES: &[(&str, &str)] = &[("baseline.toml", "fp16"), ("rdkv.toml", "b4"), ("spherical.toml", "high"), ("rotated.toml", "r4")];

fn upload_f16(dev: &Device, x: &[f32]) -> CudaSlice<u16> {
    let bits: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    dev.stream.clone_htod(&bits).unwrap()
}

fn spec(file: &str) -> Spec {
    kvforge_rt::testing::shipped_spec(file)
}

fn cache(dev: &Arc<Device>, file: &str, target: &str, tokens: usize) -> KvCache {
    let s = spec(file);
    let t = s.tier(target).unwrap().id;
    let mut cfg = CacheConfig::new(&s, D, GQA, HKV, SEQS, tokens).target(t);
    cfg.verify_headers = true;
    KvCache::new(dev.clone(), s, cfg).unwrap()
}

/// Tail-page values (k and v rows of the valid tokens) as f32.
fn tail_values(c: &KvCache, page: kvforge_rt::PageRef, len: usize) -> Vec<f32> {
    let bytes = c.download_page(page).unwrap();
    let seg = c.spec().segment(TAIL_TIER, D);
    let mut out = Vec::new();
    for part in ["k", "v"] {
        let off = HEADER_BYTES + seg.offset(part);
        out.extend((0..len * D).map(|i| f16::from_le_bytes([bytes[off + 2 * i], bytes[off + 2 * i + 1]]).to_f32()));
    }
    out
}

#[test]
#[ignore = "needs a CUDA device"]
fn append_step_equals_host_append() {
    let dev = kvforge_rt::testing::device();
    for &(file, target) in CASES {
        let rotates = !spec(file).basis().is_identity();
        let mut host = cache(&dev, file, target, 2048);
        let mut devc = cache(&dev, file, target, 2048);
        // Prefill (host appends on both): a tail one short of full, a short tail, nothing yet,
        // two full pages and a tail two short. The first encode calibrates spherical radius
        // scales on both caches from the same pages.
        let prefill = [63usize, 10, 0, 2 * 64 + 62];
        for (i, &n) in prefill.iter().enumerate() {
            let (a, b) = (host.add_sequence(), devc.add_sequence());
            assert_eq!((a, b), (i, i));
            if n > 0 {
                let (k, v) = (data(n * HKV * D, 10 + i as u32), data(n * HKV * D, 20 + i as u32));
                host.append(a, &k, &v).unwrap();
                devc.append(b, &k, &v).unwrap();
            }
        }
        for step in 0..140u32 {
            // Sequence 1 skips odd steps; step 30 also host-appends 5 tokens to sequence 0 (its
            // tail mirror is stale by then).
            let seqs: Vec<usize> = (0..SEQS).filter(|&s| s != 1 || step % 2 == 0).collect();
            let (k, v) = (data(seqs.len() * HKV * D, 1000 + step), data(seqs.len() * HKV * D, 2000 + step));
            for (i, &s) in seqs.iter().enumerate() {
                let r = i * HKV * D..(i + 1) * HKV * D;
                host.append(s, &k[r.clone()], &v[r]).unwrap();
            }
            devc.append_step(&seqs, &upload_f16(&dev, &k), &upload_f16(&dev, &v)).unwrap();
            if step == 30 {
                let (k, v) = (data(5 * HKV * D, 7), data(5 * HKV * D, 8));
                host.append(0, &k, &v).unwrap();
                devc.append(0, &k, &v).unwrap();
            }
        }
        devc.verify_pages(&(0..SEQS).collect::<Vec<_>>()).unwrap();
        for s in 0..SEQS {
            assert_eq!(host.seq_len(s).unwrap(), devc.seq_len(s).unwrap(), "{file}/{target}: sequence {s} length");
            for h in 0..HKV {
                let (pa, pb) = (host.pages(s, h).unwrap(), devc.pages(s, h).unwrap());
                assert_eq!(pa.len(), pb.len(), "{file}/{target}: sequence {s} head {h} pages");
                for (i, ((x, lx), (y, ly))) in pa.iter().zip(&pb).enumerate() {
                    assert_eq!((x.tier, lx), (y.tier, ly), "{file}/{target}: sequence {s} head {h} page {i}");
                    if !rotates {
                        assert_eq!(host.download_page(*x).unwrap(), devc.download_page(*y).unwrap(), "{file}/{target}: sequence {s} head {h} page {i} bytes differ");
                    } else if x.tier == TAIL_TIER {
                        // The rotation computed on the device rounds like the host's up to an
                        // fp16 step.
                        let (a, b) = (tail_values(&host, *x, *lx), tail_values(&devc, *y, *ly));
                        let worst = a.iter().zip(&b).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                        assert!(worst <= 2e-3, "{file}/{target}: sequence {s} head {h} tail differs by {worst}");
                    }
                }
            }
        }
        let seqs: Vec<usize> = (0..SEQS).collect();
        let q = data(SEQS * HQ * D, 3);
        let (want, got) = (host.decode(&seqs, &q).unwrap(), devc.decode(&seqs, &q).unwrap());
        let worst = want.out.iter().zip(&got.out).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        if rotates {
            assert!(worst <= 2e-2, "{file}/{target}: decode after append_step differs by {worst}");
        } else {
            assert_eq!(want.out, got.out, "{file}/{target}: decode after append_step differs");
        }
        println!("{file}/{target}: append_step == host append (decode max diff {worst:.2e})");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn append_step_out_of_pages_changes_nothing_and_bad_arguments_are_typed() {
    let dev = kvforge_rt::testing::device();
    let s = spec("baseline.toml");
    let t = s.tier("fp16").unwrap().id;
    // Tail pages for two sequences only: a third new sequence cannot get one.
    let mut cfg = CacheConfig::new(&s, D, GQA, HKV, SEQS, 1024).target(t);
    cfg.pages[TAIL_TIER as usize] = 2 * HKV;
    let mut c = KvCache::new(dev.clone(), s, cfg).unwrap();
    let ids: Vec<usize> = (0..3).map(|_| c.add_sequence()).collect();
    let row = |n: usize, seed: u32| upload_f16(&dev, &data(n * HKV * D, seed));
    c.append_step(&ids[..2], &row(2, 1), &row(2, 2)).unwrap();
    let err = c.append_step(&ids, &row(3, 3), &row(3, 4)).unwrap_err();
    assert!(matches!(err, RtError::OutOfPages { .. }), "{err:?}");
    for &i in &ids[..2] {
        assert_eq!(c.seq_len(i).unwrap(), 1);
        assert_eq!(c.page_counts(i, 0).unwrap(), (0, Some(1)));
    }
    assert_eq!(c.seq_len(ids[2]).unwrap(), 0);
    assert_eq!(c.page_counts(ids[2], 0).unwrap(), (0, None));
    // A sequence listed twice, a wrong shape, an unknown sequence.
    assert!(matches!(c.append_step(&[0, 0], &row(2, 5), &row(2, 6)), Err(RtError::BadInput(_))));
    assert!(matches!(c.append_step(&[0], &row(2, 5), &row(2, 6)), Err(RtError::ShapeMismatch { .. })));
    assert!(matches!(c.append_step(&[9], &row(1, 5), &row(1, 6)), Err(RtError::NoSequence(9))));
    assert_eq!(c.seq_len(0).unwrap(), 1);
    c.verify_pages(&ids).unwrap();
}

/// Bulk-append cases: dense, integer 8 and 4 bits, rotated 3 and 4 bits, spherical (radius
/// scales calibrated on both caches by the same first page), TriZone-free.
const BULK_CASES: &[(&str, &str)] = &[("baseline.toml", "fp16"), ("rdkv.toml", "b8"), ("rdkv.toml", "b4"), ("rotated.toml", "r3"), ("rotated.toml", "r4"), ("spherical.toml", "high")];

/// Checks that two caches hold the same pages for `seqs` (bytes where the spec does not rotate,
/// tail values within an fp16 step where it does) and decode alike.
fn same_pages_and_decode(what: &str, want: &mut KvCache, got: &mut KvCache, seqs: &[usize]) -> f32 {
    let rotates = !want.spec().basis().is_identity();
    got.verify_pages(seqs).unwrap();
    for &s in seqs {
        assert_eq!(want.seq_len(s).unwrap(), got.seq_len(s).unwrap(), "{what}: sequence {s} length");
        for h in 0..HKV {
            let (pa, pb) = (want.pages(s, h).unwrap(), got.pages(s, h).unwrap());
            assert_eq!(pa.len(), pb.len(), "{what}: sequence {s} head {h} pages");
            for (i, ((x, lx), (y, ly))) in pa.iter().zip(&pb).enumerate() {
                assert_eq!((x.tier, lx), (y.tier, ly), "{what}: sequence {s} head {h} page {i}");
                if !rotates {
                    assert_eq!(want.download_page(*x).unwrap(), got.download_page(*y).unwrap(), "{what}: sequence {s} head {h} page {i} bytes differ");
                } else if x.tier == TAIL_TIER {
                    let (a, b) = (tail_values(want, *x, *lx), tail_values(got, *y, *ly));
                    let worst = a.iter().zip(&b).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(worst <= 2e-3, "{what}: sequence {s} head {h} tail differs by {worst}");
                }
            }
        }
    }
    let live: Vec<usize> = seqs.iter().copied().filter(|&s| want.seq_len(s).unwrap() > 0).collect();
    let q = data(live.len() * HQ * D, 3);
    let (a, b) = (want.decode(&live, &q).unwrap(), got.decode(&live, &q).unwrap());
    let worst = a.out.iter().zip(&b.out).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    if rotates {
        assert!(worst <= 2e-2, "{what}: decode after the bulk append differs by {worst}");
    } else {
        assert_eq!(a.out, b.out, "{what}: decode after the bulk append differs");
    }
    worst
}

#[test]
#[ignore = "needs a CUDA device"]
fn append_device_equals_per_token_append() {
    let dev = kvforge_rt::testing::device();
    // Per sequence: tokens appended by the host first (an existing tail, or full pages and a
    // tail), then the bulk append's length: empty, one token, odd lengths, exact pages, a tail
    // continued, a tail filled exactly, a long prompt.
    let plan: &[(usize, usize)] = &[(0, 0), (0, 1), (0, 63), (0, 64), (0, 65), (0, 2 * 64 + 61), (10, 54), (10, 200), (70, 1), (63, 1), (0, 2048 + 37)];
    for &(file, target) in BULK_CASES {
        let what = format!("{file}/{target}");
        let mk = || {
            let s = spec(file);
            let t = s.tier(target).unwrap().id;
            let mut cfg = CacheConfig::new(&s, D, GQA, HKV, plan.len() + 1, 8 * 1024).target(t);
            cfg.verify_headers = true;
            KvCache::new(dev.clone(), s, cfg).unwrap()
        };
        let (mut per_token, mut bulk) = (mk(), mk());
        // Sequence 0 on both: one host-appended page calibrates spherical radius scales alike.
        let (k0, v0) = (data(64 * HKV * D, 1), data(64 * HKV * D, 2));
        for c in [&mut per_token, &mut bulk] {
            let s0 = c.add_sequence();
            c.append(s0, &k0, &v0).unwrap();
        }
        for (i, &(pre, n)) in plan.iter().enumerate() {
            let (a, b) = (per_token.add_sequence(), bulk.add_sequence());
            assert_eq!(a, b);
            if pre > 0 {
                let (k, v) = (data(pre * HKV * D, 30 + i as u32), data(pre * HKV * D, 40 + i as u32));
                per_token.append(a, &k, &v).unwrap();
                bulk.append(b, &k, &v).unwrap();
            }
            let (k, v) = (data(n * HKV * D, 50 + i as u32), data(n * HKV * D, 60 + i as u32));
            let row = HKV * D;
            for t in 0..n {
                per_token.append(a, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row]).unwrap();
            }
            if n == 0 {
                // An empty tensor is a no-op (a zero-length slice cannot be uploaded: host path).
                assert_eq!(bulk.seq_len(b).unwrap(), pre);
                continue;
            }
            bulk.append_device(b, &upload_f16(&dev, &k), &upload_f16(&dev, &v)).unwrap();
        }
        let seqs: Vec<usize> = (0..=plan.len()).collect();
        let worst = same_pages_and_decode(&what, &mut per_token, &mut bulk, &seqs);
        // A decode step after the bulk append continues the stale tail on the device, and a
        // host append after it reads the refreshed mirror.
        let step: Vec<usize> = (1..=plan.len()).collect();
        let (k, v) = (data(step.len() * HKV * D, 70), data(step.len() * HKV * D, 71));
        for (j, &s) in step.iter().enumerate() {
            let r = j * HKV * D..(j + 1) * HKV * D;
            per_token.append(s, &k[r.clone()], &v[r]).unwrap();
        }
        bulk.append_step(&step, &upload_f16(&dev, &k), &upload_f16(&dev, &v)).unwrap();
        let (k, v) = (data(3 * HKV * D, 72), data(3 * HKV * D, 73));
        per_token.append(3, &k, &v).unwrap();
        bulk.append(3, &k, &v).unwrap();
        same_pages_and_decode(&what, &mut per_token, &mut bulk, &seqs);
        println!("{what}: bulk append == per-token append (decode max diff {worst:.2e})");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn append_device_batches_through_few_tail_pages_and_out_of_pages_changes_nothing() {
    let dev = kvforge_rt::testing::device();
    for &(file, target) in &[("rdkv.toml", "b4"), ("rotated.toml", "r3")] {
        let what = format!("{file}/{target}");
        let s = spec(file);
        let t = s.tier(target).unwrap().id;
        let mk = |tails: usize, full: usize| {
            let mut cfg = CacheConfig::new(&s, D, GQA, HKV, 2, 4096).target(t);
            cfg.pages[TAIL_TIER as usize] = tails * HKV;
            cfg.pages[t as usize] = full * HKV;
            cfg.verify_headers = true;
            KvCache::new(dev.clone(), s.clone(), cfg).unwrap()
        };
        // Two tail pages per head: a 10-page prompt goes in five batches or more.
        let (mut small, mut roomy) = (mk(2, 64), mk(64, 64));
        let n = 10 * 64 + 17;
        let (k, v) = (data(n * HKV * D, 5), data(n * HKV * D, 6));
        let (a, b) = (roomy.add_sequence(), small.add_sequence());
        roomy.append(a, &k, &v).unwrap();
        small.append_device(b, &upload_f16(&dev, &k), &upload_f16(&dev, &v)).unwrap();
        same_pages_and_decode(&what, &mut roomy, &mut small, &[a]);
        // Too few target pages: nothing changes.
        let mut tight = mk(4, 3);
        let s0 = tight.add_sequence();
        let err = tight.append_device(s0, &upload_f16(&dev, &k), &upload_f16(&dev, &v)).unwrap_err();
        assert!(matches!(err, RtError::OutOfPages { .. }), "{what}: {err:?}");
        assert_eq!((tight.seq_len(s0).unwrap(), tight.page_counts(s0, 0).unwrap()), (0, (0, None)));
        // A wrong shape is typed.
        let odd = upload_f16(&dev, &data(5 * HKV * D + 1, 7));
        assert!(matches!(tight.append_device(s0, &odd, &odd), Err(RtError::ShapeMismatch { .. })), "{what}");
        println!("{what}: bulk append through two tail pages per head == host append");
    }
}
