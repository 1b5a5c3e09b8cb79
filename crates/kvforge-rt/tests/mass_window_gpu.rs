//! The device importance window against the host fold (f64) of `decode_with_mass`, over
//! decode steps with random masses while pages are appended, re-coded and dropped, the
//! window grows (sequence slots and pages per row) and sequences are removed and reused;
//! both fold paths: inside the split-K combine (plans with splits) and the standalone
//! `mass_window` kernel (a sequence of fewer than 4 pages decoded alone has no splits).
//! Run on the device with `cargo test -- --ignored`.

use std::collections::HashMap;

use kvforge_rt::{CacheConfig, KvCache, RtError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const D: usize = 64;
const GQA: usize = 4;
const HKV: usize = 3;

/// (sequence, kv head, first token) → largest share seen, as `ImportanceTracker` keeps it.
type HostWindow = HashMap<(usize, usize, usize), f64>;

fn rows(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n * HKV * D).map(|_| scale * (rng.gen::<f32>() * 2.0 - 1.0)).collect()
}

fn append(c: &mut KvCache, rng: &mut ChaCha8Rng, seq: usize, n: usize) {
    let (k, v) = (rows(rng, n, 1.5), rows(rng, n, 1.0));
    c.append(seq, &k, &v).unwrap();
}

/// One step: the host reference folds `decode_with_mass`, the device `decode_tracked` folds
/// the same query; both decodes must give the same output.
fn step(c: &mut KvCache, rng: &mut ChaCha8Rng, seqs: &[usize], host: &mut HostWindow) {
    let q: Vec<f32> = (0..seqs.len() * HKV * GQA * D).map(|_| 2.0 * (rng.gen::<f32>() * 2.0 - 1.0)).collect();
    let (want, mass) = c.decode_with_mass(seqs, &q).unwrap();
    for (i, &s) in seqs.iter().enumerate() {
        for (h, shares) in mass[i].iter().enumerate() {
            let firsts: Vec<usize> = c.positioned_pages(s, h).unwrap().iter().map(|p| p.2).collect();
            assert_eq!(firsts.len(), shares.len());
            for (&f, &m) in firsts.iter().zip(shares) {
                let e = host.entry((s, h, f)).or_insert(0.0);
                *e = e.max(m);
            }
        }
    }
    let got = c.decode_tracked(seqs, &q).unwrap();
    // The same kernels (up to the order of shared-memory atomics: one fp16 ulp).
    let worst = got.out.iter().zip(&want.out).map(|(a, b)| (a - b).abs() / b.abs().max(0.25)).fold(0f32, f32::max);
    assert!(worst < 4e-3, "tracked decode changed the output by {worst:e}");
}

/// Takes the device window of `seq` and compares it with the host's, page by page; both
/// start over.
fn compare(c: &mut KvCache, seq: usize, host: &mut HostWindow, when: &str) -> usize {
    let got = c.take_mass_window(seq).unwrap();
    check(c, seq, got, host, when)
}

/// Compares a window taken from the device (`got`) with the host's, page by page.
fn check(c: &mut KvCache, seq: usize, got: Vec<Vec<Option<f64>>>, host: &mut HostWindow, when: &str) -> usize {
    let mut checked = 0;
    for (h, win) in got.iter().enumerate() {
        let firsts: Vec<usize> = c.positioned_pages(seq, h).unwrap().iter().map(|p| p.2).collect();
        assert_eq!(firsts.len(), win.len(), "{when}: seq {seq} head {h}");
        for (&f, w) in firsts.iter().zip(win) {
            match (host.remove(&(seq, h, f)), *w) {
                (None, None) => {}
                (Some(want), Some(x)) => {
                    assert!((x - want).abs() <= 1e-4 * want, "{when}: seq {seq} head {h} page at {f}: device {x:e}, host {want:e}");
                    checked += 1;
                }
                (want, x) => panic!("{when}: seq {seq} head {h} page at {f}: device {x:?}, host {want:?}"),
            }
        }
    }
    let left: Vec<_> = host.keys().filter(|k| k.0 == seq).collect();
    assert!(left.is_empty(), "{when}: the host observed pages the cache no longer lists: {left:?}");
    assert!(c.take_mass_window(seq).unwrap().iter().flatten().all(Option::is_none), "{when}: a take must reset the window");
    checked
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_window_equals_the_host_fold() {
    let dev = kvforge_rt::testing::device();
    let s = kvforge_rt::testing::shipped_spec("rdkv.toml");
    let p = s.page.tokens;
    let tier = |n: &str| s.tier(n).unwrap().id;
    let mut c = KvCache::new(dev, s.clone(), CacheConfig::new(&s, D, GQA, HKV, 3, 80 * p)).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut host = HostWindow::new();
    // Sequence 0 is removed at once: the batch's sequence ids are 2 and 1, not 0 and 1.
    let (a, b, x) = (c.add_sequence(), c.add_sequence(), c.add_sequence());
    c.remove_sequence(a).unwrap();
    append(&mut c, &mut rng, b, 3 * p + 60);
    append(&mut c, &mut rng, x, 2 * p + 5);
    // x alone (3 pages per head) decodes without splits: the standalone fold. Batches with b
    // (4 pages) split: the fold inside the combine.
    assert!(c.plan(&[x]).unwrap().combine.is_none(), "a 3-page sequence must decode without a combine here");
    assert!(c.plan(&[b]).unwrap().combine.is_some(), "a 4-page sequence must decode with a split-K combine here");
    let mut checked = 0;
    for t in 0..12 {
        // Steps 0–1 track only b (one slot), step 2 only x (no combine), then both (the
        // window grows its slots).
        let batch: Vec<usize> = match t {
            0 | 1 => vec![b],
            2 => vec![x],
            _ => vec![x, b],
        };
        for &q in &[b, x] {
            append(&mut c, &mut rng, q, 1);
        }
        match t {
            // More than 64 pages per head: the rows grow, open ones are copied.
            4 => append(&mut c, &mut rng, x, 62 * p),
            // Re-coding keeps positions.
            6 => {
                c.retier_pages(x, &[(1, 0, tier("b4")), (1, 2, tier("b4")), (0, 1, tier("b8"))]).unwrap();
            }
            // Drops while b's window is open: later pages keep their maxima.
            8 => {
                c.retier_pages(b, &[(0, 1, tier("b0")), (2, 0, tier("b0")), (2, 2, tier("b0")), (1, 0, tier("b2"))]).unwrap();
                host.retain(|k, _| c.positioned_pages(k.0, k.1).unwrap().iter().any(|pg| pg.2 == k.2));
            }
            9 => checked += compare(&mut c, b, &mut host, "after the drops"),
            _ => {}
        }
        step(&mut c, &mut rng, &batch, &mut host);
    }
    // Both windows in one download (x's slot above b's, asked for in that order).
    let both = c.take_mass_windows(&[x, b]).unwrap();
    for (s, got) in [x, b].into_iter().zip(both) {
        checked += check(&mut c, s, got, &mut host, "at the end (taken together)");
    }
    // x alone ends with 65 pages per head (64 full, one tail).
    assert!(checked >= 65 * HKV, "only {checked} pages compared");
    // A sequence decoded twice in one tracked call is refused before anything runs.
    let q = vec![0.5f32; 2 * HKV * GQA * D];
    assert!(matches!(c.decode_tracked(&[b, b], &q), Err(RtError::Duplicate { .. })));
    // A removed sequence's id comes back with an empty window.
    step(&mut c, &mut rng, &[b], &mut host);
    c.remove_sequence(b).unwrap();
    host.retain(|k, _| k.0 != b);
    // Ids are reused lowest first: a's (never tracked), then b's.
    let (a2, b2) = (c.add_sequence(), c.add_sequence());
    assert_eq!((a2, b2), (a, b));
    for s in [a2, b2] {
        append(&mut c, &mut rng, s, 2 * p);
        assert!(c.take_mass_window(s).unwrap().iter().flatten().all(Option::is_none), "sequence {s} starts with an old window");
    }
    println!("{checked} page maxima equal the host fold");
}
