//! GPU tests: run on the device with `cargo test -- --ignored`. On a machine without a GPU
//! they are ignored; forced with `--ignored` they fail ("needs a CUDA device: ...").

use kvforge_rt::testing::data;
use kvforge_rt::{CacheConfig, KvCache, RtError};
use kvforge_spec::{mixed_widths, KeyScheme, Spec, VariantId, HEADER_BYTES, TAIL_TIER};

fn spec(name: &str) -> Spec {
    kvforge_rt::testing::shipped_spec(name)
}

#[test]
#[ignore = "needs a CUDA device"]
fn one_variant_per_spec_matches_reference() {
    let dev = kvforge_rt::testing::device();
    for (file, variant) in [
        ("baseline.toml", "decode_kfp16_vfp16_d128_g4_p64"),
        ("spherical.toml", "decode_ksph16x8b6_vfp16__ksph16x8b4_vfp16__ksph32x4b3_vfp16_d128_g4_p64"),
        ("certified.toml", "decode_kfp16_vfp16__kint8c16f32_vint4g16f16_d128_g8_p64"),
        ("rdkv.toml", "decode_kint2c64f16_vint2g32f16_d64_g1_p64"),
        ("trizone.toml", "decode_kmix16x1_8x2_4x3_2x1c64f16_vfp16__kmix16x1_8x2_4x3_2x1c64f16_vint8g32f16__kmix16x1_8x2_4x3_2x1c64f16_vint4g32f16__kmix16x1_8x2_4x3_2x1c64f16_vint2g32f16_d128_g8_p64"),
    ] {
        let s = spec(file);
        // The format's default schedule (the name's `_w…` suffix).
        let v = kvforge_gen::variants(&s).into_iter().find(|v| v.name().starts_with(&format!("{variant}_w"))).unwrap_or_else(|| panic!("{variant} not in {file}"));
        let r = kvforge_lab::selftest::run_variant(&dev, &s, &v, false).unwrap();
        println!("{} {} max_abs {:.3e} tol {:.3e} {}", r.spec, r.variant, r.max_abs_err, r.tolerance, r.status);
        assert_eq!(r.status, "pass", "{r:?}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn resident_bytes_equal_spec_cost_plus_headers() {
    let dev = kvforge_rt::testing::device();
    for file in ["spherical.toml", "certified.toml", "rdkv.toml", "baseline.toml"] {
        let s = spec(file);
        let (d, p) = (128, s.page.tokens);
        let cfg = CacheConfig::new(&s, d, 4, 2, 1, 10 * p);
        let mut c = KvCache::new(dev.clone(), s.clone(), cfg).unwrap();
        let q = c.add_sequence();
        let n = 5 * p + 7;
        c.append(q, &data(n * 2 * d, 1), &data(n * 2 * d, 2)).unwrap();
        for u in c.memory_report() {
            let t = s.tier(&u.tier).unwrap();
            let seg = s.segment(t.id, d);
            if u.pages == 0 {
                continue;
            }
            let overhead = (seg.page_bytes - seg.payload_bytes) as f64 / p as f64;
            if t.id == TAIL_TIER {
                assert_eq!(u.tokens, 2 * 7);
                assert_eq!(u.resident_bytes, 2 * seg.page_bytes);
            } else {
                assert_eq!(u.tokens, 2 * 5 * p, "{file} {}", u.tier);
                assert!((u.resident_bytes_per_token - (u.payload_bytes_per_token + overhead)).abs() < 1e-9, "{file} {u:?}");
                assert!(overhead * p as f64 >= HEADER_BYTES as f64);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_inputs_are_typed_errors_not_launches() {
    let dev = kvforge_rt::testing::device();
    let s = spec("certified.toml");
    let cfg = CacheConfig::new(&s, 128, 4, 2, 2, 256);
    let mut c = KvCache::new(dev.clone(), s.clone(), cfg).unwrap();
    let a = c.add_sequence();
    assert!(matches!(c.decode(&[a], &vec![0.0; 8 * 128]), Err(RtError::EmptySequence(0))));
    assert!(matches!(c.decode(&[], &[]), Err(RtError::BadInput(_))));
    assert!(matches!(c.decode(&[7], &[]), Err(RtError::NoSequence(7))));
    c.append(a, &data(10 * 2 * 128, 1), &data(10 * 2 * 128, 2)).unwrap();
    assert!(matches!(c.decode(&[a], &[0.0; 3]), Err(RtError::ShapeMismatch { .. })));
    assert!(matches!(c.append(a, &[1.0; 5], &[1.0; 5]), Err(RtError::ShapeMismatch { .. })));
    assert!(matches!(c.append(a, &[f32::NAN; 256], &[0.0; 256]), Err(RtError::NonFinite { .. })));
    // Query dtype must match the spec (certified decodes fp16 queries).
    assert!(matches!(c.decode_typed(&[a], &vec![half::bf16::ZERO; 8 * 128]), Err(RtError::BadInput(_))));
    let exact = c.decode_typed(&[a], &vec![half::f16::from_f32(0.25); 8 * 128]).unwrap();
    let conv = c.decode(&[a], &vec![0.25; 8 * 128]).unwrap();
    let diff: Vec<usize> = (0..exact.out.len()).filter(|&i| exact.out[i] != conv.out[i]).collect();
    assert!(diff.is_empty(), "decode_typed and decode differ at {} of {} outputs: {:?}", diff.len(), exact.out.len(), &diff[..diff.len().min(16)]);
    assert!(KvCache::new(dev.clone(), s.clone(), CacheConfig::new(&s, 96, 4, 2, 1, 64)).is_err());
    assert!(KvCache::new(dev, s.clone(), CacheConfig::new(&s, 128, 5, 2, 1, 64)).is_err());
}

/// The same query on the same cache gives bit-identical outputs: no reads of uninitialised
/// workspace, no order-dependent reductions (split-K, GQA heads, tail page in place).
#[test]
#[ignore = "needs a CUDA device"]
fn decode_is_deterministic() {
    let dev = kvforge_rt::testing::device();
    for file in ["baseline.toml", "certified.toml", "spherical.toml"] {
        let s = spec(file);
        for len in [1usize, 10, 64, 65, 300, 4000] {
            let cfg = CacheConfig::new(&s, 128, 4, 2, 2, 4096);
            let mut c = KvCache::new(dev.clone(), s.clone(), cfg).unwrap();
            let a = c.add_sequence();
            c.append(a, &data(len * 2 * 128, 1), &data(len * 2 * 128, 2)).unwrap();
            let q = data(8 * 128, 3);
            let first = c.decode(&[a], &q).unwrap();
            for rep in 0..4 {
                let again = c.decode(&[a], &q).unwrap();
                let diff = first.out.iter().zip(&again.out).filter(|(x, y)| x != y).count();
                assert_eq!(diff, 0, "{file} len {len} repeat {rep}: {diff} of {} outputs differ", first.out.len());
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn out_of_pages_leaves_the_cache_unchanged() {
    let dev = kvforge_rt::testing::device();
    let s = spec("certified.toml");
    let mut cfg = CacheConfig::new(&s, 128, 4, 1, 1, 128);
    cfg.pages = vec![4, 2, 2];
    let mut c = KvCache::new(dev, s, cfg).unwrap();
    let a = c.add_sequence();
    c.append(a, &data(100 * 128, 1), &data(100 * 128, 2)).unwrap();
    let before = c.memory_report();
    let err = c.append(a, &data(200 * 128, 3), &data(200 * 128, 4)).unwrap_err();
    assert!(matches!(err, RtError::OutOfPages { .. }), "{err}");
    assert_eq!(c.seq_len(a).unwrap(), 100);
    assert_eq!(c.memory_report(), before);
    let q = data(4 * 128, 5);
    c.decode(&[a], &q).unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn corrupt_header_is_named() {
    let dev = kvforge_rt::testing::device();
    let s = spec("baseline.toml");
    let mut cfg = CacheConfig::new(&s, 64, 1, 1, 1, 256);
    cfg.verify_headers = true;
    let mut c = KvCache::new(dev, s, cfg).unwrap();
    let a = c.add_sequence();
    c.append(a, &data(150 * 64, 1), &data(150 * 64, 2)).unwrap();
    let (page, _) = c.pages(a, 0).unwrap()[1];
    c.write_page_bytes(page, 8, &[0xff]).unwrap();
    match c.decode(&[a], &data(64, 3)) {
        Err(RtError::CorruptPage { page: 1, .. }) => {}
        other => panic!("expected CorruptPage for page 1, got {other:?}"),
    }
    // Without host verification the kernel's own header check reports it.
    c.write_page_bytes(page, 0, &[0, 0, 0, 0]).unwrap();
    let mut cfg2 = c.config().clone();
    cfg2.verify_headers = false;
    c.set_verify_headers(false);
    assert!(matches!(c.decode(&[a], &data(64, 3)), Err(RtError::KernelFault { .. })));
    let _ = cfg2;
}

#[test]
#[ignore = "needs a CUDA device"]
fn encode_kernels_stay_within_quantisation_bounds() {
    let dev = kvforge_rt::testing::device();
    for (file, tier) in [("certified.toml", "q8k4v"), ("rdkv.toml", "b4"), ("rdkv.toml", "b2"), ("spherical.toml", "high")] {
        let s = spec(file);
        let t = s.tier(tier).unwrap().clone();
        let d = 128;
        let p = s.page.tokens;
        let cfg = CacheConfig::new(&s, d, 1, 1, 1, 2 * p).target(t.id);
        let mut c = KvCache::new(dev.clone(), s.clone(), cfg).unwrap();
        let a = c.add_sequence();
        let (k, v) = (data(p * d, 11), data(p * d, 12));
        c.append(a, &k, &v).unwrap();
        let (page, _) = c.pages(a, 0).unwrap()[0];
        assert_eq!(page.tier, t.id);
        let bytes = c.download_page(page).unwrap();
        let rs = c.radius_scales(t.id).unwrap().unwrap_or_default();
        let (kh, vh) = kvforge_ref::decode_segment(&t, d, p, &bytes[HEADER_BYTES..], &rs);
        // Re-encode on the CPU from the same fp16 inputs and compare reconstructions: the GPU's
        // fp32 arithmetic may differ by one code at rounding boundaries, never more.
        let kr: Vec<f32> = k.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
        let vr: Vec<f32> = v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
        let seg = kvforge_ref::encode_segment(&t, d, p, &kr, &vr, &rs);
        let (kc, vc) = kvforge_ref::decode_segment(&t, d, p, &seg, &rs);
        let worst = |a: &[f64], b: &[f64], x: &[f32]| a.iter().zip(b).zip(x).fold((0f64, 0f64), |m, ((g, c), x)| (m.0.max((g - *x as f64).abs()), m.1.max((c - *x as f64).abs())));
        let (kg, kc_err) = worst(&kh, &kc, &kr);
        let (vg, vc_err) = worst(&vh, &vc, &vr);
        println!("{file} {tier}: key error gpu {kg:.4} cpu {kc_err:.4}; value error gpu {vg:.4} cpu {vc_err:.4}");
        assert!(kg <= kc_err * 1.5 + 1e-3, "{file} {tier} key error {kg} vs reference {kc_err}");
        assert!(vg <= vc_err * 1.5 + 1e-3, "{file} {tier} value error {vg} vs reference {vc_err}");
        let _ = VariantId::transcode(&s, TAIL_TIER, t.id, d);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn page_masses_match_the_reference_and_find_the_needle() {
    let dev = kvforge_rt::testing::device();
    let s = spec("baseline.toml");
    let (d, p, n) = (64, s.page.tokens, 1000);
    let mut c = KvCache::new(dev, s.clone(), CacheConfig::new(&s, d, 1, 1, 1, n)).unwrap();
    let a = c.add_sequence();
    let q = data(d, 9);
    let mut k: Vec<f32> = data(n * d, 1).iter().map(|x| x * 0.1).collect();
    let needle = 700;
    for i in 0..d {
        k[needle * d + i] = 4.0 * q[i];
    }
    c.append(a, &k, &data(n * d, 2)).unwrap();
    let (_, mass) = c.decode_with_mass(&[a], &q).unwrap();
    let m = &mass[0][0];
    assert_eq!(m.len(), n.div_ceil(p));
    assert!((m.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    // Reference: softmax over fp16-rounded keys, summed per page.
    let kr: Vec<f64> = k.iter().map(|&x| half::f16::from_f32(x).to_f64()).collect();
    let qr: Vec<f64> = q.iter().map(|&x| half::f16::from_f32(x).to_f64()).collect();
    let w = kvforge_ref::softmax_weights(&qr, &kr, 1.0 / (d as f64).sqrt());
    for (pi, share) in m.iter().enumerate() {
        let want: f64 = w[pi * p..((pi + 1) * p).min(n)].iter().sum();
        assert!((share - want).abs() < 1e-3, "page {pi}: {share} vs {want}");
    }
    assert!(m[needle / p] > 0.9, "needle page holds {}", m[needle / p]);
}

/// Integer pages decode in the per-warp layout (every warp its own online softmax over its
/// tokens of a page); their page masses meet across warps after the page loop. Checked
/// against the f64 reference on the pages the GPU holds (b8/b4/b2 pages, a partial tail), at
/// gqa 4 with a needle aligned with head 0's query; the output too.
#[test]
#[ignore = "needs a CUDA device"]
fn page_masses_of_integer_pages_match_the_reference() {
    let dev = kvforge_rt::testing::device();
    let s = spec("rdkv.toml");
    let (d, gqa, n) = (128, 4, 1000);
    let p = s.page.tokens;
    let mut c = KvCache::new(dev, s.clone(), CacheConfig::new(&s, d, gqa, 1, 1, n)).unwrap();
    let a = c.add_sequence();
    let q = data(gqa * d, 9);
    let mut k: Vec<f32> = data(n * d, 1).iter().map(|x| x * 0.3).collect();
    let needle = 700;
    for i in 0..d {
        k[needle * d + i] = 3.0 * q[i];
    }
    c.append(a, &k, &data(n * d, 2)).unwrap();
    let tier = |name: &str| s.tier(name).unwrap().id;
    let ladder = [tier("b8"), tier("b4"), tier("b2")];
    let moves: Vec<_> = (0..n / p).map(|i| (0, i, ladder[i % 3])).collect();
    c.retier_pages(a, &moves).unwrap();
    let (out, mass) = c.decode_with_mass(&[a], &q).unwrap();
    let (mut kk, mut vv, mut lens) = (Vec::new(), Vec::new(), Vec::new());
    for (pg, len) in c.pages(a, 0).unwrap() {
        let bytes = c.download_page(pg).unwrap();
        let (kp, vp) = kvforge_ref::decode_segment(&s.tiers[pg.tier as usize], d, p, &bytes[HEADER_BYTES..], &[]);
        kk.extend_from_slice(&kp[..len * d]);
        vv.extend_from_slice(&vp[..len * d]);
        lens.push(len);
    }
    assert!(c.pages(a, 0).unwrap().iter().any(|(pg, _)| pg.tier == tier("b2")), "the ladder reached b2");
    let sm = 1.0 / (d as f64).sqrt();
    let qr: Vec<f64> = q.iter().map(|&x| half::f16::from_f32(x).to_f64()).collect();
    let vmax = vv.iter().fold(0f64, |m: f64, x| m.max(x.abs()));
    // Page shares of Σ_heads Σ_tokens e^logit, and each head's output.
    let mut logits = Vec::new();
    for h in 0..gqa {
        let qh = &qr[h * d..(h + 1) * d];
        logits.push((0..n).map(|t| sm * (0..d).map(|i| qh[i] * kk[t * d + i]).sum::<f64>()).collect::<Vec<f64>>());
        let (o, _) = kvforge_ref::attention(qh, &kk, &vv, sm);
        for i in 0..d {
            let e = (out.out[h * d + i] as f64 - o[i]).abs();
            assert!(e <= 2.0 * 2f64.powi(-11) * vmax + 1e-6, "head {h} channel {i}: {} vs {}", out.out[h * d + i], o[i]);
        }
    }
    let mx = logits.iter().flatten().cloned().fold(f64::NEG_INFINITY, f64::max);
    let total: f64 = logits.iter().flatten().map(|l| (l - mx).exp()).sum();
    let m = &mass[0][0];
    assert_eq!(m.len(), lens.len());
    let mut start = 0;
    for (pi, &len) in lens.iter().enumerate() {
        let want: f64 = logits.iter().map(|l| l[start..start + len].iter().map(|x| (x - mx).exp()).sum::<f64>()).sum::<f64>() / total;
        assert!((m[pi] - want).abs() < 1e-3, "page {pi}: {} vs {want}", m[pi]);
        start += len;
    }
    assert!(m[needle / p] > 0.9, "needle page holds {}", m[needle / p]);
}

/// TriZone (seed 002): mixed-key pages coded through a channel order hold, at each natural
/// channel, the reference's reconstruction of that channel at its segment's width (within one
/// code at fp32 rounding boundaries), across encode (tail → zb) and transcodes down the zone
/// tiers; the order is validated and frozen once pages exist.
#[test]
#[ignore = "needs a CUDA device"]
fn mixed_keys_follow_their_channel_order() {
    let dev = kvforge_rt::testing::device();
    let s = spec("trizone.toml");
    let (d, p, hkv) = (128, s.page.tokens, 2);
    let id = |n: &str| s.tier(n).unwrap().id;
    let cfg = CacheConfig::new(&s, d, 4, hkv, 1, 6 * p).target(id("zb"));
    let mut c = KvCache::new(dev.clone(), s.clone(), cfg).unwrap();
    // Orders: reversed for head 0, a stride-5 walk for head 1 (both permutations of 0..128).
    let order: Vec<u16> = (0..d as u16).rev().chain((0..d).map(|j| ((j * 5) % d) as u16)).collect();
    assert!(matches!(c.set_channel_order(TAIL_TIER, &order), Err(RtError::BadTier(..))));
    assert!(matches!(c.set_channel_order(id("za4"), &order[..d]), Err(RtError::ShapeMismatch { .. })));
    let mut bad = order.clone();
    bad[3] = bad[4];
    assert!(matches!(c.set_channel_order(id("za4"), &bad), Err(RtError::BadInput(m)) if m.contains("kv head 0")));
    for t in ["zb", "za8", "za4", "za2"] {
        c.set_channel_order(id(t), &order).unwrap();
    }
    assert_eq!(c.channel_order(id("za2")).unwrap().unwrap(), order);
    let a = c.add_sequence();
    let n = 4 * p + 7;
    let (k, v) = (data(n * hkv * d, 21), data(n * hkv * d, 22));
    c.append(a, &k, &v).unwrap();
    assert!(matches!(c.set_channel_order(id("zb"), &order), Err(RtError::WrongState { fix, .. }) if fix.contains("already holds")));
    // Page i of each head: 0 stays in zb (encoded from the tail), 1..3 go down to za8, za4, za2.
    for h in 0..hkv {
        for (i, t) in ["za8", "za4", "za2"].iter().enumerate() {
            c.retier(a, h, i + 1, id(t)).unwrap();
        }
    }
    let f16 = |x: f32| half::f16::from_f32(x).to_f32();
    for h in 0..hkv {
        let o = &order[h * d..(h + 1) * d];
        for (i, (page, _)) in c.pages(a, h).unwrap().into_iter().enumerate().take(4) {
            let t = s.tiers[page.tier as usize].clone();
            let bytes = c.download_page(page).unwrap();
            let (kg, vg) = kvforge_ref::decode_segment(&t, d, p, &bytes[HEADER_BYTES..], &[]);
            let kg = kvforge_ref::mixed::to_natural(&kg, d, o);
            // The page's original rows of head h (fp16-rounded as the tail stored them).
            let rows = |x: &[f32]| -> Vec<f32> { (i * p..(i + 1) * p).flat_map(|tok| x[(tok * hkv + h) * d..(tok * hkv + h + 1) * d].iter().map(|&e| f16(e))).collect() };
            let (kr, vr) = (rows(&k), rows(&v));
            // Keys against the direct reference coding of the page's original rows (values are
            // checked through attention by the self-test below).
            let seg = kvforge_ref::encode_segment(&t, d, p, &kvforge_ref::mixed::to_stored(&kr, d, o), &vr, &[]);
            let (kc, _) = kvforge_ref::decode_segment(&t, d, p, &seg, &[]);
            let kc = kvforge_ref::mixed::to_natural(&kc, d, o);
            let KeyScheme::Mixed { segments, .. } = &t.key else { panic!("{} is not a mixed tier", t.name) };
            let mut width = vec![0u32; d];
            for (&c, &bits) in o.iter().zip(&mixed_widths(segments, d)) {
                width[c as usize] = bits;
            }
            for ch in 0..d {
                let (mut gmax, mut rmax) = (0f64, 0f64);
                for tok in 0..p {
                    let (g, r, x) = (kg[tok * d + ch], kc[tok * d + ch], f64::from(kr[tok * d + ch]));
                    match width[ch] {
                        0 => assert_eq!(g, 0.0, "dropped channel {ch}"),
                        16 => assert_eq!(g, x, "fp16 channel {ch} of page {i}"),
                        _ => (gmax, rmax) = (gmax.max((g - x).abs()), rmax.max((r - x).abs())),
                    }
                }
                // Direct coding (zb) matches the reference up to one code at fp32 rounding
                // boundaries; zb → za* re-quantise zb's reconstruction at the same widths,
                // within the direct coding's worst error plus zb's (each at most half a step).
                assert!(gmax <= 2.0 * rmax + 1e-3, "page {i} ({}) head {h} channel {ch} ({} bits): gpu error {gmax} vs reference {rmax}", t.name, width[ch]);
            }
            assert!(vg.iter().all(|x| x.is_finite()));
        }
    }
    // And attention over the mixed pages matches the f64 reference on what the GPU holds.
    let r = kvforge_lab::selftest::run_variant(
        &dev,
        &s,
        &kvforge_gen::variants(&s)
            .into_iter()
            .find(|v| {
                v.name()
                    .starts_with("decode_kmix16x1_8x2_4x3_2x1c64f16_vfp16__kmix16x1_8x2_4x3_2x1c64f16_vint8g32f16__kmix16x1_8x2_4x3_2x1c64f16_vint4g32f16__kmix16x1_8x2_4x3_2x1c64f16_vint2g32f16_d128_g4_p64_w")
            })
            .unwrap(),
        false,
    )
    .unwrap();
    assert_eq!(r.status, "pass", "{r:?}");
}

/// What applying a controller plan costs on one layer like SmolLM2's at 8K (3 kv heads × 128
/// pages of d 64 in b8): three quarters of the pages re-coded to b4 or b2 or dropped, page by
/// page (`retier`, one launch each) and in one `retier_pages` batch (two launches), kernels
/// loaded. Prints the median of 5 of each (`--nocapture`); both leave the same tiers.
#[test]
#[ignore = "needs a CUDA device"]
fn retier_pages_cost() {
    let dev = kvforge_rt::testing::device();
    let s = spec("rdkv.toml");
    let t = |name| s.tier(name).unwrap().id;
    let (b8, b4, b2, b0) = (t("b8"), t("b4"), t("b2"), t("b0"));
    let (d, gqa, hkv, n) = (64, 3, 3, 8192);
    let (k, v) = (data(n * hkv * d, 1), data(n * hkv * d, 2));
    // Each cache loads its kernels on first use: warm both transcodes on pages outside `moves`.
    let make = || {
        let mut c = KvCache::new(dev.clone(), s.clone(), CacheConfig::new(&s, d, gqa, hkv, 1, n).target(b8)).unwrap();
        let a = c.add_sequence();
        c.append(a, &k, &v).unwrap();
        c.retier(a, 0, 0, b4).unwrap();
        c.retier(a, 0, 4, b2).unwrap();
        (c, a)
    };
    let moves: Vec<(usize, usize, u8)> = (0..hkv).flat_map(|h| (0..n / 64).map(move |i| (h, i, [b8, b4, b2, b0][i % 4]))).filter(|m| m.2 != b8).collect();
    let page_by_page = |c: &mut KvCache, a| {
        for &(h, i, to) in moves.iter().filter(|m| m.2 != b0) {
            c.retier(a, h, i, to).unwrap();
        }
        for &(h, i, to) in moves.iter().rev().filter(|m| m.2 == b0) {
            c.retier(a, h, i, to).unwrap();
        }
    };
    let (mut warm, a) = make();
    assert_eq!(warm.retier_pages(a, &moves).unwrap(), 2);
    let median = |mut x: Vec<f64>| {
        x.sort_by(f64::total_cmp);
        x[x.len() / 2]
    };
    let (mut tb, mut ts) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let ((mut x, a), (mut y, b)) = (make(), make());
        dev.stream.synchronize().unwrap();
        let t0 = std::time::Instant::now();
        x.retier_pages(a, &moves).unwrap();
        dev.stream.synchronize().unwrap();
        tb.push(t0.elapsed().as_secs_f64() * 1e3);
        let t0 = std::time::Instant::now();
        page_by_page(&mut y, b);
        dev.stream.synchronize().unwrap();
        ts.push(t0.elapsed().as_secs_f64() * 1e3);
        assert!((0..hkv).all(|h| x.pages(a, h).unwrap().iter().map(|p| (p.0.tier, p.1)).eq(y.pages(b, h).unwrap().iter().map(|p| (p.0.tier, p.1)))));
    }
    println!("{} moves ({} pages): one batch {:.3} ms, page by page {:.3} ms (medians of 5)", moves.len(), hkv * n / 64, median(tb), median(ts));
}

/// A batch checks its launches once, after the last (kvforge-rt `transcode`), with the outcome
/// of checking each: the launches before a faulting one land, it and the ones after keep their
/// pages' tiers, no page leaks, and the flags are clear for the next batch.
#[test]
#[ignore = "needs a CUDA device"]
fn retier_pages_fault_lands_the_launches_before_it() {
    let dev = kvforge_rt::testing::device();
    let s = spec("rdkv.toml");
    let t = |name| s.tier(name).unwrap().id;
    let (b8, b4, b2) = (t("b8"), t("b4"), t("b2"));
    let (d, gqa, n) = (64, 3, 8 * 64);
    let mut c = KvCache::new(dev, s.clone(), CacheConfig::new(&s, d, gqa, 1, 1, n + 64).target(b8)).unwrap();
    let a = c.add_sequence();
    c.append(a, &data(n * d, 1), &data(n * d, 2)).unwrap();
    let tiers = |c: &KvCache| c.pages(a, 0).unwrap().iter().take(8).map(|p| p.0.tier).collect::<Vec<_>>();
    let free = |c: &KvCache| [b8, b4, b2].map(|t| c.pool().free_pages(t));
    let before = free(&c);
    // Launches run deepest source first, then by destination: b8 → b4 (pages 0, 1), then
    // b8 → b2 (page 5, whose header is broken).
    let (bad, _) = c.pages(a, 0).unwrap()[5];
    c.write_page_bytes(bad, 0, &[0, 0, 0, 0]).unwrap();
    match c.retier_pages(a, &[(0, 5, b2), (0, 0, b4), (0, 1, b4)]) {
        Err(RtError::KernelFault { variant, .. }) => assert!(variant.contains("kint2"), "the b2 launch faulted, not {variant}"),
        other => panic!("expected a kernel fault, got {other:?}"),
    }
    assert_eq!(tiers(&c), vec![b4, b4, b8, b8, b8, b8, b8, b8]);
    assert_eq!(free(&c), [before[0] + 2, before[1] - 2, before[2]], "pages leaked or lost");
    // The flags were cleared: a clean batch of two launches lands whole.
    assert_eq!(c.retier_pages(a, &[(0, 2, b4), (0, 3, b2)]).unwrap(), 2);
    assert_eq!(tiers(&c), vec![b4, b4, b4, b2, b8, b8, b8, b8]);
}

/// Transcode launches split each page over several CTAs (kvforge-gen `transcode_split`: key
/// slices of whole channels or whole tokens, value slices of whole tokens; 4 CTAs per page at
/// head_dim 64, 8 at 128). Every transcode pair rdkv and spherical generate, on a launch of 6
/// pages of two kv heads whose sources are reference-coded pages: each destination is the
/// reference's coding of its source's reconstruction (header exact; each array's bytes equal
/// but for ≤ 2% at fp32 rounding boundaries, where a misplaced or missing slice is ≥ 1/8),
/// and no worse than it against the source (as `encode_kernels_stay_within_quantisation_bounds`).
/// A page whose source header is broken raises the fault, its destination keeps every byte,
/// and the launch's other pages are still coded; fixed, the same launch lands whole.
#[test]
#[ignore = "needs a CUDA device"]
fn split_transcodes_match_the_reference() {
    use kvforge_spec::{Family, PageHeader, Tier};
    let dev = kvforge_rt::testing::device();
    for file in ["rdkv.toml", "spherical.toml", "rotated.toml"] {
        let s = spec(file);
        let p = s.page.tokens;
        for d in [64, 128] {
            let (hkv, n, bad) = (2usize, 6usize, 3usize);
            let mut c = KvCache::new(dev.clone(), s.clone(), CacheConfig::new(&s, d, 1, hkv, 1, 2 * n * p)).unwrap();
            // Radius scales of every spherical tier, fixed so that kernels and reference share
            // them (keys in [-1, 1): group radii up to sqrt(32) < 0.025 · 255).
            let mut radius: Vec<Vec<f32>> = vec![Vec::new(); s.tiers.len()];
            for t in &s.tiers {
                if let KeyScheme::Spherical { group, .. } = t.key {
                    radius[t.id as usize] = (0..hkv * d / group).map(|i| 0.025 + 0.0005 * i as f32).collect();
                    c.set_radius_scales(t.id, &radius[t.id as usize]).unwrap();
                }
            }
            let rs = |t: &Tier, h: u32| -> Vec<f32> {
                match t.key {
                    KeyScheme::Spherical { group, .. } => radius[t.id as usize][h as usize * d / group..(h as usize + 1) * d / group].to_vec(),
                    _ => Vec::new(),
                }
            };
            let heads: Vec<u32> = (0..n).map(|i| (i % hkv) as u32).collect();
            let mut pairs = 0;
            for v in kvforge_gen::variants(&s) {
                let Family::Transcode { src, dst, .. } = v.family else { continue };
                if v.head_dim != d {
                    continue;
                }
                pairs += 1;
                let (ts, tt) = (s.tiers[src as usize].clone(), s.tiers[dst as usize].clone());
                let page_bytes = c.pool().page_bytes(dst);
                let layout = kvforge_spec::SegmentLayout::new(&tt, d, p, s.page.alignment);
                // Sources: reference-coded pages of distinct data.
                let mut srcs = Vec::new();
                let mut src_bytes = Vec::new();
                for (i, &h) in heads.iter().enumerate() {
                    let (k, vv) = (data(p * d, 100 + i as u32), data(p * d, 200 + i as u32));
                    let bytes = kvforge_ref::encode_page(&ts, d, &s.page, &k, &vv, &rs(&ts, h)).unwrap();
                    let pg = c.alloc_page(src).unwrap();
                    c.write_page_bytes(pg, 0, &bytes).unwrap();
                    srcs.push(pg);
                    src_bytes.push(bytes);
                }
                let dsts: Vec<_> = (0..n).map(|_| c.alloc_page(dst).unwrap()).collect();
                let zeros = vec![0u8; page_bytes];
                let sentinel = vec![0xa5u8; page_bytes];
                for (i, &pg) in dsts.iter().enumerate() {
                    c.write_page_bytes(pg, 0, if i == bad { &sentinel } else { &zeros }).unwrap();
                }
                // What the reference codes page i into, and how far that is from the source.
                let check = |c: &KvCache, i: usize| {
                    let h = heads[i];
                    let (ks, vs) = kvforge_ref::decode_segment(&ts, d, p, &src_bytes[i][HEADER_BYTES..], &rs(&ts, h));
                    let (k32, v32): (Vec<f32>, Vec<f32>) = (ks.iter().map(|&x| x as f32).collect(), vs.iter().map(|&x| x as f32).collect());
                    let want = kvforge_ref::encode_segment(&tt, d, p, &k32, &v32, &rs(&tt, h));
                    let got = c.download_page(dsts[i]).unwrap();
                    assert_eq!(got[..HEADER_BYTES], PageHeader { tier: dst, flags: 0, length: p as u32 }.to_bytes()[..], "{v} page {i}: header");
                    let seg = &got[HEADER_BYTES..HEADER_BYTES + want.len()];
                    for a in &layout.arrays {
                        let r = a.offset..a.offset + a.bytes;
                        let differ = seg[r.clone()].iter().zip(&want[r]).filter(|(x, y)| x != y).count();
                        assert!(differ * 50 <= a.bytes.max(100), "{v} page {i} (kv head {h}): {differ} of {} bytes of {} differ from the reference", a.bytes, a.name);
                    }
                    let (kg, vg) = kvforge_ref::decode_segment(&tt, d, p, seg, &rs(&tt, h));
                    let (kc, vc) = kvforge_ref::decode_segment(&tt, d, p, &want, &rs(&tt, h));
                    let worst = |a: &[f64], x: &[f64]| a.iter().zip(x).fold(0f64, |m, (g, x)| m.max((g - x).abs()));
                    let (ek, eks) = (worst(&kg, &ks), worst(&kc, &ks));
                    let (ev, evs) = (worst(&vg, &vs), worst(&vc, &vs));
                    assert!(ek <= eks * 1.5 + 1e-3, "{v} page {i}: key error {ek} vs reference {eks}");
                    assert!(ev <= evs * 1.5 + 1e-3, "{v} page {i}: value error {ev} vs reference {evs}");
                };
                // Page `bad`'s source header is broken: the launch faults, that destination
                // keeps its bytes, the others are coded.
                c.write_page_bytes(srcs[bad], 0, &[0, 0, 0, 0]).unwrap();
                match c.transcode_pages(src, dst, &srcs, &dsts, &heads) {
                    Err(RtError::KernelFault { what, .. }) => assert!(what.contains("expected tier"), "{v}: {what}"),
                    other => panic!("{v}: expected a kernel fault for page {bad}, got {other:?}"),
                }
                assert!(c.download_page(dsts[bad]).unwrap() == sentinel, "{v}: the destination of the bad source was written");
                for i in (0..n).filter(|&i| i != bad) {
                    check(&c, i);
                }
                // Fixed, the same launch lands whole.
                c.write_page_bytes(srcs[bad], 0, &src_bytes[bad][..4]).unwrap();
                c.write_page_bytes(dsts[bad], 0, &zeros).unwrap();
                c.transcode_pages(src, dst, &srcs, &dsts, &heads).unwrap();
                for i in 0..n {
                    check(&c, i);
                }
                for pg in srcs.into_iter().chain(dsts) {
                    c.free_page(pg);
                }
            }
            println!("{file} d {d}: {pairs} transcode pairs match the reference");
            assert!(pairs >= 3, "{file} generates transcodes at head_dim {d}");
        }
    }
}
