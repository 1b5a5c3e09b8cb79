//! Exact attention: the fp16 tier's decoded page gives exact attention on the fp16-rounded
//! inputs, and softmax attention's invariants hold.

mod common;

use common::{data, data64, dot};
use kvforge_ref::{attention, attention_heads, batched_gqa_attention, combine_partials, decode_page, encode_page, softmax_weights, KvHead};
use proptest::prelude::*;

#[test]
fn fp16_page_attention_equals_exact_attention_on_rounded_inputs() {
    let s = common::spec("baseline");
    for &d in &s.geometry.head_dims {
        for tier in &s.tiers {
            let p = s.page.tokens;
            let len = if tier.id == 0 { p / 2 + 1 } else { p };
            let (k, v) = (data(len * d, -3.0, 3.0, d as u64), data(len * d, -3.0, 3.0, 1));
            let page = encode_page(tier, d, &s.page, &k, &v, &[]).unwrap();
            let dec = decode_page(tier, d, &s.page, &page, &[]).unwrap();
            let round = |x: &[f32]| x.iter().map(|&a| half::f16::from_f32(a).to_f64()).collect::<Vec<_>>();
            let (kr, vr) = (round(&k), round(&v));
            for &gqa in &s.geometry.gqa {
                let q = data64(gqa * d, gqa as u64);
                let sm = 1.0 / (d as f64).sqrt();
                let (o1, l1) = attention_heads(&q, d, &dec.k, &dec.v, sm);
                let (o2, l2) = attention_heads(&q, d, &kr, &vr, sm);
                for (a, b) in o1.iter().zip(&o2).chain(l1.iter().zip(&l2)) {
                    assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()));
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Weights sum to 1, the output is their convex combination of values, and
    /// lse = ln Σ e^{s_t}.
    #[test]
    fn softmax_invariants(d8 in 1usize..5, n in 1usize..50, scale in 0.01f64..30.0, seed in any::<u64>()) {
        let d = 8 * d8;
        let (q, k, v) = (data64(d, seed), data64(n * d, seed ^ 1), data64(n * d, seed ^ 2));
        let w = softmax_weights(&q, &k, scale);
        prop_assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        prop_assert!(w.iter().all(|&x| (0.0..=1.0).contains(&x)));
        let (o, lse) = attention(&q, &k, &v, scale);
        for c in 0..d {
            let expect: f64 = (0..n).map(|t| w[t] * v[t * d + c]).sum();
            prop_assert!((o[c] - expect).abs() < 1e-12);
            let (lo, hi) = (0..n).map(|t| v[t * d + c]).fold((f64::MAX, f64::MIN), |m, x| (m.0.min(x), m.1.max(x)));
            prop_assert!(o[c] >= lo - 1e-12 && o[c] <= hi + 1e-12);
        }
        let direct = (0..n).map(|t| (scale * dot(&q, &k[t * d..(t + 1) * d])).exp()).sum::<f64>().ln();
        prop_assert!((lse - direct).abs() < 1e-12 * (1.0 + direct.abs()));
    }

    /// One token: out = v, lse = its logit.
    #[test]
    fn single_token_returns_its_value(d8 in 1usize..5, scale in 0.01f64..30.0, seed in any::<u64>()) {
        let d = 8 * d8;
        let (q, k, v) = (data64(d, seed), data64(d, seed ^ 1), data64(d, seed ^ 2));
        let (o, lse) = attention(&q, &k, &v, scale);
        prop_assert_eq!(o, v);
        prop_assert!((lse - scale * dot(&q, &k)).abs() < 1e-15 * (1.0 + lse.abs()));
    }

    /// Attention does not depend on token order, and split-K partials merge to the whole.
    #[test]
    fn permutation_and_split_invariance(n in 2usize..40, split in 1usize..39, seed in any::<u64>()) {
        let d = 16;
        let split = split.min(n - 1);
        let (q, k, v) = (data64(d, seed), data64(n * d, seed ^ 1), data64(n * d, seed ^ 2));
        let (o, lse) = attention(&q, &k, &v, 0.25);
        let rev = |x: &[f64]| x.chunks_exact(d).rev().flatten().copied().collect::<Vec<_>>();
        let (or, lr) = attention(&q, &rev(&k), &rev(&v), 0.25);
        let (a, la) = attention(&q, &k[..split * d], &v[..split * d], 0.25);
        let (b, lb) = attention(&q, &k[split * d..], &v[split * d..], 0.25);
        let (empty, le) = attention(&q, &[], &[], 0.25);
        let (oc, lc) = combine_partials(&[(&a, la), (&empty, le), (&b, lb)]);
        for c in 0..d {
            prop_assert!((o[c] - or[c]).abs() < 1e-12 && (o[c] - oc[c]).abs() < 1e-12);
        }
        prop_assert!((lse - lr).abs() < 1e-12 && (lse - lc).abs() < 1e-12);
    }
}

#[test]
fn batched_gqa_matches_per_head() {
    let (d, gqa, n) = (32, 4, 9);
    let caches: Vec<(Vec<f64>, Vec<f64>)> = (0..3).map(|i| (data64((n + i) * d, i as u64), data64((n + i) * d, 10 + i as u64))).collect();
    let heads: Vec<KvHead> = caches.iter().map(|(k, v)| KvHead { k, v }).collect();
    let q = data64(heads.len() * gqa * d, 77);
    let (o, lse) = batched_gqa_attention(&q, d, gqa, &heads, 0.5);
    assert_eq!((o.len(), lse.len()), (q.len(), heads.len() * gqa));
    for (row, qh) in q.chunks_exact(d).enumerate() {
        let h = &heads[row / gqa];
        let (o1, l1) = attention(qh, h.k, h.v, 0.5);
        assert_eq!(&o[row * d..(row + 1) * d], &o1[..]);
        assert_eq!(lse[row], l1);
    }
}

#[test]
fn combining_nothing_is_empty_attention() {
    let (o, l) = combine_partials(&[]);
    assert!(o.is_empty() && l == f64::NEG_INFINITY);
}
