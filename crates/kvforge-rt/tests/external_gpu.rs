//! GPU tests of the external-tensor entry points (`kvforge_rt::external`): device-pointer
//! append equals host append byte for byte, decode into caller buffers equals the host decode,
//! prefix attention matches the f64 reference on the dequantised pages and a decode of the
//! truncated sequence, and bad pointers are typed errors. Run on the device with
//! `cargo test -p kvforge-rt --test external_gpu -- --ignored`.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr};
use half::f16;
use kvforge_rt::testing::data_f16 as data;
use kvforge_rt::{CacheConfig, Device, ElemType, ExternalTensor, KvCache, RtError};
use kvforge_spec::Spec;

fn spec(name: &str) -> Spec {
    kvforge_rt::testing::shipped_spec(name)
}

fn upload_f16(dev: &Device, x: &[f32]) -> CudaSlice<u16> {
    let bits: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    dev.stream.clone_htod(&bits).unwrap()
}

fn ptr<T>(dev: &Device, s: &CudaSlice<T>) -> u64 {
    s.device_ptr(&dev.stream).0
}

fn ext<T>(dev: &Device, s: &CudaSlice<T>, elem: ElemType, shape: &[usize]) -> ExternalTensor {
    ExternalTensor::contiguous(ptr(dev, s), elem, shape, dev.ctx.ordinal())
}

const D: usize = 64;
const HKV: usize = 3;
const GQA: usize = 3;
const HQ: usize = HKV * GQA;

/// (spec file, target tier name) pairs every test runs over: dense, integer, spherical.
const CASES: &[(&str, &str)] = &[("baseline.toml", "fp16"), ("rdkv.toml", "b4"), ("rdkv.toml", "b2"), ("spherical.toml", "high")];

fn cache(dev: &Arc<Device>, file: &str, target: &str, tokens: usize) -> KvCache {
    let s = spec(file);
    let t = s.tier(target).unwrap().id;
    let mut cfg = CacheConfig::new(&s, D, GQA, HKV, 2, tokens).target(t);
    cfg.verify_headers = true;
    KvCache::new(dev.clone(), s, cfg).unwrap()
}

/// Decoded (out, lse) of one (external) launch, downloaded.
fn download(dev: &Device, out: &CudaSlice<u16>, lse: &CudaSlice<f32>) -> (Vec<f32>, Vec<f32>) {
    let o: Vec<u16> = dev.stream.clone_dtoh(out).unwrap();
    (o.into_iter().map(|b| f16::from_bits(b).to_f32()).collect(), dev.stream.clone_dtoh(lse).unwrap())
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_append_equals_host_append_and_decode_into_caller_buffers_equals_host_decode() {
    let dev = kvforge_rt::testing::device();
    for &(file, target) in CASES {
        let n = 3 * 64 + 17;
        let (k, v) = (data(n * HKV * D, 1), data(n * HKV * D, 2));
        let mut host = cache(&dev, file, target, 1024);
        let mut devc = cache(&dev, file, target, 1024);
        let (a, b) = (host.add_sequence(), devc.add_sequence());
        host.append(a, &k[..100 * HKV * D], &v[..100 * HKV * D]).unwrap();
        host.append(a, &k[100 * HKV * D..], &v[100 * HKV * D..]).unwrap();
        // Two device appends, the second crossing page boundaries from a partial tail.
        let (kd, vd) = (upload_f16(&dev, &k), upload_f16(&dev, &v));
        for (lo, hi) in [(0, 100), (100, n)] {
            let kt = ExternalTensor { ptr: ptr(&dev, &kd) + (lo * HKV * D * 2) as u64, ..ext(&dev, &kd, ElemType::F16, &[hi - lo, HKV, D]) };
            let vt = ExternalTensor { ptr: ptr(&dev, &vd) + (lo * HKV * D * 2) as u64, ..ext(&dev, &vd, ElemType::F16, &[hi - lo, HKV, D]) };
            devc.append_external(b, &kt, &vt).unwrap();
        }
        assert_eq!(devc.seq_len(b).unwrap(), n);
        for h in 0..HKV {
            let (pa, pb) = (host.pages(a, h).unwrap(), devc.pages(b, h).unwrap());
            assert_eq!(pa.len(), pb.len());
            for ((x, lx), (y, ly)) in pa.iter().zip(&pb) {
                assert_eq!((x.tier, lx), (y.tier, ly));
                assert_eq!(host.download_page(*x).unwrap(), devc.download_page(*y).unwrap(), "{file}/{target}: page bytes differ (head {h})");
            }
        }
        let q = data(HQ * D, 3);
        let want = host.decode(&[a], &q).unwrap();
        let qd = upload_f16(&dev, &q);
        let out = dev.stream.alloc_zeros::<u16>(HQ * D).unwrap();
        let lse = dev.stream.alloc_zeros::<f32>(HQ).unwrap();
        devc.decode_external(&[b], &ext(&dev, &qd, ElemType::F16, &[1, HQ, D]), &ext(&dev, &out, ElemType::F16, &[1, HQ, D]), &ext(&dev, &lse, ElemType::F32, &[1, HQ])).unwrap();
        let (o, l) = download(&dev, &out, &lse);
        assert_eq!(o, want.out, "{file}/{target}: external decode differs from host decode");
        assert_eq!(l, want.lse);
        println!("{file}/{target}: device append == host append, external decode == host decode");
    }
}

/// f64 reference of query `qrow` over the tokens of (seq, head) at logical positions below
/// `len`, on the pages as stored (downloaded and dequantised by kvforge-ref; dropped pages are
/// absent).
fn reference(c: &KvCache, seq: usize, head: usize, len: usize, q: &[f32]) -> (Vec<f64>, f64, f64) {
    let (kk, vv) = kvforge_rt::testing::reference_kv(c, seq, head, Some(len));
    let vmax = vv.iter().fold(0f64, |m, x| m.max(x.abs()));
    let qf: Vec<f64> = q.iter().map(|&x| x as f64).collect();
    let (o, lse) = kvforge_ref::attention(&qf, &kk, &vv, 1.0 / (D as f64).sqrt());
    (o, lse, vmax)
}

/// Runs `attend_prefix_external` for `lengths` with queries `q` and checks every (entry, q head)
/// against [`reference`] within the selftest's bound (two fp16 ulps of the largest value: output
/// rounding and f32 accumulation); returns the outputs and the worst margin.
fn prefixes_match_reference(dev: &Device, c: &mut KvCache, seq: usize, lengths: &[usize], q: &[f32], what: &str) -> (Vec<f32>, f64) {
    let nq = lengths.len();
    let qd = upload_f16(dev, q);
    let out = dev.stream.alloc_zeros::<u16>(nq * HQ * D).unwrap();
    let lse = dev.stream.alloc_zeros::<f32>(nq * HQ).unwrap();
    c.attend_prefix_external(seq, lengths, &ext(dev, &qd, ElemType::F16, &[nq, HQ, D]), &ext(dev, &out, ElemType::F16, &[nq, HQ, D]), &ext(dev, &lse, ElemType::F32, &[nq, HQ])).unwrap();
    let (o, l) = download(dev, &out, &lse);
    let mut worst = f64::NEG_INFINITY;
    for (i, &len) in lengths.iter().enumerate() {
        for hq in 0..HQ {
            let row = i * HQ + hq;
            let (ro, rl, vmax) = reference(c, seq, hq / GQA, len, &q[row * D..(row + 1) * D]);
            let tol = 2.0 * 2f64.powi(-11) * vmax + 1e-6;
            for d in 0..D {
                let e = (o[row * D + d] as f64 - ro[d]).abs();
                worst = worst.max(e - tol);
                assert!(e <= tol, "{what}: length {len} q head {hq} ch {d}: got {} want {} (tol {tol:.2e})", o[row * D + d], ro[d]);
            }
            assert!((l[row] as f64 - rl).abs() < 1e-3 * rl.abs().max(1.0), "{what}: lse of length {len} q head {hq}: {} vs {rl}", l[row]);
        }
    }
    (o, worst)
}

/// A prefix entry's output against a decode of the same tokens (two launches of different
/// shape: equal up to fp16 output rounding).
fn assert_close_to_decode(got: &[f32], want: &[f32], what: &str) {
    for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 2e-3 * w.abs().max(0.5), "{what} at {j}: {g} vs {w}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn prefix_attention_matches_reference_and_truncated_decode() {
    let dev = kvforge_rt::testing::device();
    for &(file, target) in CASES {
        let n = 2 * 64 + 30;
        let (k, v) = (data(n * HKV * D, 4), data(n * HKV * D, 5));
        let mut c = cache(&dev, file, target, 1024);
        let seq = c.add_sequence();
        c.append(seq, &k, &v).unwrap();
        let lengths: Vec<usize> = vec![1, 2, 33, 63, 64, 65, 100, 127, 128, 129, 150, n];
        let nq = lengths.len();
        let q = data(nq * HQ * D, 6);
        let (o, worst) = prefixes_match_reference(&dev, &mut c, seq, &lengths, &q, &format!("{file}/{target}"));
        // Where the cut falls on a page boundary (or at the end), the prefix is exactly what a
        // cache holding only those tokens decodes.
        for (i, &len) in lengths.iter().enumerate().filter(|(_, &l)| l % 64 == 0 || l == n) {
            let mut t = cache(&dev, file, target, 1024);
            let s2 = t.add_sequence();
            if let Some(r) = c.radius_scales(c.config().target_tier).unwrap() {
                t.set_radius_scales(c.config().target_tier, &r).unwrap();
            }
            t.append(s2, &k[..len * HKV * D], &v[..len * HKV * D]).unwrap();
            let want = t.decode(&[s2], &q[i * HQ * D..(i + 1) * HQ * D]).unwrap();
            assert_close_to_decode(&o[i * HQ * D..(i + 1) * HQ * D], &want.out, &format!("{file}/{target}: prefix {len} vs truncated decode"));
        }
        println!("{file}/{target}: attend_prefix over {nq} prefixes within tolerance (worst margin {worst:.2e})");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn dropped_pages_keep_positions_and_prefixes_skip_them() {
    let dev = kvforge_rt::testing::device();
    let s = spec("rdkv.toml");
    let b0 = s.tier("b0").unwrap().id;
    let n = 5 * 64 + 21;
    let (k, v) = (data(n * HKV * D, 7), data(n * HKV * D, 8));
    let mut c = cache(&dev, "rdkv.toml", "b4", 1024);
    let seq = c.add_sequence();
    c.append(seq, &k, &v).unwrap();
    // Heads drop different pages: head 0 page 1, head 1 pages 2 and 3, head 2 none.
    c.retier(seq, 0, 1, b0).unwrap();
    c.retier(seq, 1, 3, b0).unwrap();
    c.retier(seq, 1, 2, b0).unwrap();
    assert_eq!(c.seq_len(seq).unwrap(), n, "a drop must not shorten the logical sequence");
    let firsts = |c: &KvCache, h| c.positioned_pages(seq, h).unwrap().iter().map(|x| (x.1, x.2)).collect::<Vec<_>>();
    assert_eq!(firsts(&c, 0), [(64, 0), (64, 128), (64, 192), (64, 256), (21, 320)]);
    assert_eq!(firsts(&c, 1), [(64, 0), (64, 64), (64, 256), (21, 320)]);
    assert_eq!(firsts(&c, 2).len(), 6);
    // Appending after drops continues the positions.
    let m = 50;
    let (k2, v2) = (data(m * HKV * D, 9), data(m * HKV * D, 10));
    c.append(seq, &k2, &v2).unwrap();
    let total = n + m;
    assert_eq!(c.seq_len(seq).unwrap(), total);
    assert_eq!(firsts(&c, 1), [(64, 0), (64, 64), (64, 256), (64, 320), (7, 384)]);
    // Prefixes by logical position: inside a dropped range, at its edges, after it, the end.
    let lengths: Vec<usize> = vec![1, 64, 65, 100, 128, 129, 150, 192, 200, 256, 257, 300, 321, 384, 385, total];
    let nq = lengths.len();
    let q = data(nq * HQ * D, 11);
    let (o, _) = prefixes_match_reference(&dev, &mut c, seq, &lengths, &q, "after drops");
    // A full decode reads every stored page: equal to the prefix of the whole sequence.
    let want = c.decode(&[seq], &q[(nq - 1) * HQ * D..]).unwrap();
    assert_close_to_decode(&o[(nq - 1) * HQ * D..], &want.out, "decode vs full prefix after drops");
    println!("after drops: {nq} prefixes by logical position match the reference");
}

/// One `retier_pages` batch (drops and three tier pairs over three heads, indices before the
/// batch) takes one launch per tier pair and leaves what page-by-page `retier` calls leave on a
/// twin cache: same tiers, positions and page bytes, the same decode bit for bit, no page
/// leaked; prefixes still match the f64 reference. A bad batch changes nothing.
#[test]
#[ignore = "needs a CUDA device"]
fn batched_retier_equals_page_by_page() {
    let dev = kvforge_rt::testing::device();
    let s = spec("rdkv.toml");
    let t = |name| s.tier(name).unwrap().id;
    let (b8, b4, b2, b0) = (t("b8"), t("b4"), t("b2"), t("b0"));
    let n = 8 * 64 + 21;
    let (k, v) = (data(n * HKV * D, 12), data(n * HKV * D, 13));
    let (mut batched, mut single) = (cache(&dev, "rdkv.toml", "b8", 1024), cache(&dev, "rdkv.toml", "b8", 1024));
    let (a, b) = (batched.add_sequence(), single.add_sequence());
    batched.append(a, &k, &v).unwrap();
    single.append(b, &k, &v).unwrap();
    // Two source tiers: page 7 of every head is in b4 already.
    for h in 0..HKV {
        batched.retier(a, h, 7, b4).unwrap();
        single.retier(b, h, 7, b4).unwrap();
    }
    let moves = [(0, 1, b0), (0, 2, b4), (0, 3, b2), (0, 7, b2), (1, 0, b4), (1, 4, b0), (1, 5, b0), (1, 6, b2), (2, 2, b4), (2, 3, b2), (2, 7, b0)];
    let before: Vec<_> = (0..HKV).map(|h| batched.positioned_pages(a, h).unwrap()).collect();
    for bad in [vec![(0, 2, b4), (0, 8, b2)], vec![(0, 2, b4), (0, 2, b0)], vec![(0, 7, b8)], vec![(0, 2, 9)], vec![(3, 0, b2)]] {
        assert!(batched.retier_pages(a, &bad).is_err(), "{bad:?}");
        assert!((0..HKV).all(|h| batched.positioned_pages(a, h).unwrap() == before[h]), "{bad:?} changed the cache");
    }
    // b8 → b4, b8 → b2 and b4 → b2: three launches; drops take none.
    assert_eq!(batched.retier_pages(a, &moves).unwrap(), 3);
    // Page by page: re-codes first (no index has shifted yet), then drops from the top.
    for &(h, i, to) in moves.iter().filter(|m| m.2 != b0) {
        single.retier(b, h, i, to).unwrap();
    }
    let mut drops: Vec<_> = moves.iter().filter(|m| m.2 == b0).collect();
    drops.sort_by_key(|m| std::cmp::Reverse((m.0, m.1)));
    for &&(h, i, to) in &drops {
        single.retier(b, h, i, to).unwrap();
    }
    let firsts = |c: &KvCache, seq, h| c.positioned_pages(seq, h).unwrap().iter().map(|x| (x.0.tier, x.1, x.2)).collect::<Vec<_>>();
    assert_eq!(firsts(&batched, a, 1), [(b4, 64, 0), (b8, 64, 64), (b8, 64, 128), (b8, 64, 192), (b2, 64, 384), (b4, 64, 448), (0, 21, 512)]);
    for h in 0..HKV {
        assert_eq!(firsts(&batched, a, h), firsts(&single, b, h), "head {h}");
        for (x, y) in batched.pages(a, h).unwrap().into_iter().zip(single.pages(b, h).unwrap()) {
            assert_eq!(batched.download_page(x.0).unwrap(), single.download_page(y.0).unwrap(), "head {h}: page bytes differ");
        }
    }
    for tier in 0..s.tiers.len() as u8 {
        assert_eq!(batched.pool().used_pages(tier), single.pool().used_pages(tier), "tier {tier}: pages in use differ");
    }
    batched.verify_pages(&[a]).unwrap();
    let lengths: Vec<usize> = vec![1, 64, 100, 128, 200, 256, 300, 384, 450, 512, n];
    let nq = lengths.len();
    let q = data(nq * HQ * D, 14);
    let (o, worst) = prefixes_match_reference(&dev, &mut batched, a, &lengths, &q, "after a batch");
    let last = &q[(nq - 1) * HQ * D..];
    let (x, y) = (batched.decode(&[a], last).unwrap(), single.decode(&[b], last).unwrap());
    assert_eq!(x.out, y.out, "decode after a batch differs from decode after page-by-page retier");
    assert_close_to_decode(&o[(nq - 1) * HQ * D..], &x.out, "decode vs full prefix after a batch");
    println!("batch of {} moves in 3 launches == page by page; {nq} prefixes match the reference (worst margin {worst:.2e})", moves.len());
}

/// `retier_many` over two sequences takes one launch per tier pair for both and leaves what a
/// `retier_pages` per sequence leaves on a twin cache: same tiers and page bytes, the same
/// decode bit for bit, the same pages in use. A batch naming a sequence twice, or with one bad
/// move in either sequence, changes neither.
#[test]
#[ignore = "needs a CUDA device"]
fn retier_many_equals_one_batch_per_sequence() {
    let dev = kvforge_rt::testing::device();
    let s = spec("rdkv.toml");
    let t = |name| s.tier(name).unwrap().id;
    let (b4, b2, b0) = (t("b4"), t("b2"), t("b0"));
    let n = 6 * 64 + 9;
    let (mut many, mut each) = (cache(&dev, "rdkv.toml", "b8", 2048), cache(&dev, "rdkv.toml", "b8", 2048));
    let mut seqs = Vec::new();
    for (i, c) in [&mut many, &mut each].into_iter().enumerate() {
        let ids: Vec<usize> = (0..2).map(|_| c.add_sequence()).collect();
        for (j, &q) in ids.iter().enumerate() {
            c.append(q, &data(n * HKV * D, 20 + j as u32), &data(n * HKV * D, 30 + j as u32)).unwrap();
        }
        if i == 0 {
            seqs = ids;
        }
    }
    let (a, b) = (seqs[0], seqs[1]);
    let ma = [(0, 1, b4), (0, 2, b0), (1, 3, b2), (2, 0, b4)];
    let mb = [(0, 1, b4), (1, 1, b4), (1, 4, b0), (2, 5, b2)];
    let before = |c: &KvCache| (0..2).flat_map(|q| (0..HKV).map(move |h| (q, h))).map(|(q, h)| c.positioned_pages(q, h).unwrap()).collect::<Vec<_>>();
    let was = before(&many);
    for bad in [vec![(a, &ma[..]), (a, &mb[..])], vec![(a, &ma[..]), (b, &[(0, 1, b4), (0, 9, b2)][..])], vec![(a, &ma[..]), (7, &mb[..])]] {
        assert!(many.retier_many(&bad).is_err(), "{bad:?}");
        assert!(before(&many) == was, "{bad:?} changed the cache");
    }
    // b8 → b4 and b8 → b2 for both sequences: two launches, each carrying both.
    assert_eq!(many.retier_many(&[(a, &ma), (b, &mb)]).unwrap(), vec![2, 2]);
    assert_eq!(each.retier_pages(a, &ma).unwrap() + each.retier_pages(b, &mb).unwrap(), 4);
    for q in [a, b] {
        for h in 0..HKV {
            let (x, y) = (many.positioned_pages(q, h).unwrap(), each.positioned_pages(q, h).unwrap());
            assert_eq!(x.iter().map(|p| (p.0.tier, p.1, p.2)).collect::<Vec<_>>(), y.iter().map(|p| (p.0.tier, p.1, p.2)).collect::<Vec<_>>(), "sequence {q} head {h}");
            for (x, y) in x.iter().zip(&y) {
                assert_eq!(many.download_page(x.0).unwrap(), each.download_page(y.0).unwrap(), "sequence {q} head {h}: page bytes differ");
            }
        }
    }
    for tier in 0..s.tiers.len() as u8 {
        assert_eq!(many.pool().used_pages(tier), each.pool().used_pages(tier), "tier {tier}: pages in use differ");
    }
    many.verify_pages(&[a, b]).unwrap();
    let q = data(2 * HQ * D, 15);
    assert_eq!(many.decode(&[a, b], &q).unwrap().out, each.decode(&[a, b], &q).unwrap().out, "decode after retier_many differs");
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_pointers_are_typed_errors() {
    let dev = kvforge_rt::testing::device();
    let mut c = cache(&dev, "rdkv.toml", "b4", 512);
    let seq = c.add_sequence();
    c.append(seq, &data(70 * HKV * D, 1), &data(70 * HKV * D, 2)).unwrap();
    let q = dev.stream.alloc_zeros::<u16>(HQ * D).unwrap();
    let out = dev.stream.alloc_zeros::<u16>(HQ * D).unwrap();
    let lse = dev.stream.alloc_zeros::<f32>(HQ).unwrap();
    let (qt, ot, lt) = (ext(&dev, &q, ElemType::F16, &[1, HQ, D]), ext(&dev, &out, ElemType::F16, &[1, HQ, D]), ext(&dev, &lse, ElemType::F32, &[1, HQ]));
    let msg = |r: kvforge_rt::Result<()>| match r {
        Err(RtError::BadInput(m)) => m,
        other => panic!("expected BadInput, got {other:?}"),
    };
    // Host memory claimed to be a CUDA tensor.
    let host = vec![0u16; HQ * D];
    let ht = ExternalTensor { ptr: host.as_ptr() as u64, ..qt.clone() };
    let m = msg(c.decode_external(&[seq], &ht, &ot, &lt));
    assert!(m.contains("not CUDA device memory"), "{m}");
    // A shape larger than the allocation (a plain cuMemAlloc, whose range the driver reports).
    // SAFETY: a fresh allocation of this context, freed below.
    let small = unsafe { cudarc::driver::result::malloc_sync(HQ * D * 2) }.unwrap();
    let big = ExternalTensor::contiguous(small, ElemType::F16, &[4, HQ, D], 0);
    let (out4, lse4) = (dev.stream.alloc_zeros::<u16>(4 * HQ * D).unwrap(), dev.stream.alloc_zeros::<f32>(4 * HQ).unwrap());
    let r = c.attend_prefix_external(seq, &[1, 2, 3, 4], &big, &ext(&dev, &out4, ElemType::F16, &[4, HQ, D]), &ext(&dev, &lse4, ElemType::F32, &[4, HQ]));
    // SAFETY: nothing was launched on it.
    unsafe { cudarc::driver::result::free_sync(small) }.unwrap();
    let m = msg(r);
    assert!(m.contains("allocation"), "{m}");
    // Output aliasing the queries.
    let m = msg(c.decode_external(&[seq], &qt, &ExternalTensor { ptr: qt.ptr, ..ot.clone() }, &lt));
    assert!(m.contains("overlap"), "{m}");
    // Wrong dtype for lse, batch mismatch.
    let m = msg(c.decode_external(&[seq], &qt, &ot, &ExternalTensor { elem: ElemType::F16, ..lt.clone() }));
    assert!(m.contains("`lse` is float16 but must be float32"), "{m}");
    let m = msg(c.decode_external(&[seq, seq], &qt, &ot, &lt));
    assert!(m.contains("expected [batch=2"), "{m}");
    // Prefix lengths out of range.
    let m = msg(c.attend_prefix_external(seq, &[71], &qt, &ot, &lt));
    assert!(m.contains("lengths[0]"), "{m}");
    // Nothing was launched by the failures: a good call still works.
    c.decode_external(&[seq], &qt, &ot, &lt).unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn work_is_ordered_with_a_foreign_stream() {
    let dev = kvforge_rt::testing::device();
    let mut c = cache(&dev, "rdkv.toml", "b8", 512);
    let seq = c.add_sequence();
    c.append(seq, &data(130 * HKV * D, 1), &data(130 * HKV * D, 2)).unwrap();
    let q = data(HQ * D, 9);
    let want = c.decode(&[seq], &q).unwrap();
    // Another library's non-blocking stream writes the queries; the cache waits for it.
    let other = dev.ctx.new_stream().unwrap();
    let bits: Vec<u16> = q.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
    let qd = other.clone_htod(&bits).unwrap();
    let out = other.alloc_zeros::<u16>(HQ * D).unwrap();
    let lse = other.alloc_zeros::<f32>(HQ).unwrap();
    let h = other.cu_stream() as u64;
    // SAFETY: `other` is a live stream of this context.
    unsafe { c.wait_for_stream(h) }.unwrap();
    let p = |s: &CudaSlice<u16>| s.device_ptr(&other).0;
    let qt = ExternalTensor::contiguous(p(&qd), ElemType::F16, &[1, HQ, D], 0);
    let ot = ExternalTensor::contiguous(p(&out), ElemType::F16, &[1, HQ, D], 0);
    let lt = ExternalTensor::contiguous(lse.device_ptr(&other).0, ElemType::F32, &[1, HQ], 0);
    c.decode_external(&[seq], &qt, &ot, &lt).unwrap();
    // SAFETY: as above.
    unsafe { c.signal_stream(h) }.unwrap();
    let o: Vec<u16> = other.clone_dtoh(&out).unwrap();
    let got: Vec<f32> = o.into_iter().map(|b| f16::from_bits(b).to_f32()).collect();
    assert_eq!(got, want.out);
}
