//! GPU tests of the decode-step append (`KvCache::append_step`, issue 29): a serving loop's
//! one-token-per-sequence appends from device memory leave the same pages as the host append
//! (byte for byte where the spec does not rotate; within fp16 rounding of the rotation, and
//! the same decode within tolerance, where it does), through tails that fill mid-step, new
//! sequences, sequences skipping steps and host appends in between (stale tail mirrors);
//! out-of-pages changes nothing and bad arguments are typed errors. Run on the device with
//! `cargo test -p kvforge-rt --test append_step_gpu -- --ignored`.

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
