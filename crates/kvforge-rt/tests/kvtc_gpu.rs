//! kvtc restore on the device (kvforge-rt `kvtc`) against the f64 reference of kvforge-kvtc.

/// The module compiles through NVRTC (CPU; skipped, visibly, without NVRTC or the CUDA headers,
/// as tests/spec_compiles.rs).
#[test]
fn kvtc_module_compiles() {
    if !kvforge_rt::nvrtc_present() || kvforge_rt::jit::cuda_include_dir().is_err() {
        assert!(std::env::var("CI").is_err(), "CI needs NVRTC");
        println!("skipped: no NVRTC or CUDA headers");
        return;
    }
    let src = kvforge_gen::render_kvtc().unwrap();
    for arch in ["sm_90", "sm_80"] {
        let c = kvforge_rt::jit::compile_module(kvforge_gen::KVTC_SYMBOL, &src, arch, true).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(!c.cubin.is_empty());
    }
}

use kvforge_kvtc::restore::{dequant_reference, device_layout, group_table, restore_reference, synthetic_calibration, synthetic_container};
use kvforge_kvtc::{CalibConfig, Calibration, DecodedContainer, DpConfig, KvDump, Rope, Side};
use kvforge_rt::kvtc::KvtcRestorer;
use kvforge_rt::Device;

/// A cache of `layers × heads × hd` whose keys (RoPE undone) and values are mixes of `rank`
/// shared latent factors, `tokens` tokens at positions `0..tokens`: low-rank across layers and
/// heads, as kvtc's calibration expects. The mixes depend on the shape only, the tokens on `seed`.
fn low_rank_dump(layers: usize, heads: usize, hd: usize, rank: usize, rope: Rope, tokens: usize, seed: u64) -> KvDump {
    use rand::{Rng, SeedableRng};
    let p = layers * heads * hd;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mix: Vec<f64> = (0..rank * p).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut d = KvDump { layers, kv_heads: heads, head_dim: hd, tokens, positions: (0..tokens as i64).collect(), k: vec![0.0; p * tokens], v: vec![0.0; p * tokens] };
    for t in 0..tokens {
        let z: Vec<f64> = (0..rank).map(|r| rng.gen_range(-1.0..1.0) * 3.0 / (1 + r) as f64).collect();
        for l in 0..layers {
            for h in 0..heads {
                let o = (l * heads + h) * hd;
                let mut kr: Vec<f64> = (0..hd).map(|c| 0.4 + (0..rank).map(|r| z[r] * mix[r * p + o + c]).sum::<f64>()).collect();
                rope.apply(&mut kr, t as i64, 1.0);
                let a = d.at(l, h, t, 0);
                for c in 0..hd {
                    d.k[a + c] = kr[c] as f32;
                    d.v[a + c] = (0..rank).map(|r| z[r] * mix[r * p + o + c] * 0.6).sum::<f64>() as f32;
                }
            }
        }
    }
    d
}

/// A calibration of a [`low_rank_dump`] of `calib_tokens` tokens: small sinks and window, a
/// small DP, basis scope `layers_per_basis` (0: all layers).
fn small_calibration(dump: &KvDump, rope: Rope, sinks: usize, window: usize, ratios: &[f64], dp: DpConfig, layers_per_basis: usize) -> Calibration {
    let cfg = CalibConfig { sinks, window, max_samples: 600, dp_rows: 48, ratios: ratios.to_vec(), rope: Some(rope), dp, layers_per_basis, ..CalibConfig::default() };
    kvforge_kvtc::calibrate(dump, &cfg, |_| {}).unwrap()
}

/// [`small_calibration`] weighted (per-feature scale folded into the basis, keys 40% of the
/// budget): skewed weights, a few heavy channels per head as query energy has.
fn weighted_calibration(dump: &KvDump, rope: Rope, ratios: &[f64], dp: DpConfig, layers_per_basis: usize) -> Calibration {
    let w = |seed: usize| -> Vec<f64> { (0..dump.features()).map(|f| if (f + seed) % 16 < 3 { 40.0 } else { 0.1 + ((f * 7919 + seed) % 97) as f64 / 97.0 }).collect() };
    let cfg = CalibConfig {
        sinks: 2,
        window: 8,
        max_samples: 600,
        dp_rows: 48,
        ratios: ratios.to_vec(),
        rope: Some(rope),
        dp,
        layers_per_basis,
        weights: [Some(w(0)), Some(w(5))],
        key_share: 0.4,
        ..CalibConfig::default()
    };
    kvforge_kvtc::calibrate(dump, &cfg, |_| {}).unwrap()
}

/// Checks every row of a restore against the f64 mirror of the kernels (fp16 operands): kept
/// rows bit-exact, coded rows within fp32 accumulation plus fp16 output rounding.
/// The pipelined restore (segments of a few chunks, so several) gives the same rows, bit for bit.
fn check_restore(dev: &Device, r: &KvtcRestorer, cal: &Calibration, dc: &DecodedContainer, what: &str) {
    let kv = r.restore(dc).unwrap_or_else(|e| panic!("{what}: {e}"));
    {
        let mut bytes = Vec::new();
        kvforge_kvtc::write_container(dc, kvforge_kvtc::Entropy::Zstd, &mut bytes).unwrap();
        let sc = kvforge_kvtc::read_container(&mut bytes.as_slice(), cal).unwrap();
        let seg = (3 * dc.header.chunk_tokens as usize).max(1);
        let (pk, times) = r.restore_pipelined(&sc, seg).unwrap_or_else(|e| panic!("{what} pipelined: {e}"));
        for side in [Side::Keys, Side::Values] {
            for l in 0..cal.layers {
                assert_eq!(
                    pk.download_layer(&dev.stream, side, l).unwrap(),
                    kv.download_layer(&dev.stream, side, l).unwrap(),
                    "{what}: pipelined restore differs ({side:?} layer {l}, {} segments)",
                    times.segments
                );
            }
        }
    }
    let (n_tok, width, hd, hkv) = (dc.tokens(), cal.kv_heads * cal.head_dim, cal.head_dim, cal.kv_heads);
    for side in [Side::Keys, Side::Values] {
        let s = side as usize;
        let layers: Vec<Vec<u16>> = (0..cal.layers).map(|l| kv.download_layer(&dev.stream, side, l).unwrap()).collect();
        let nk = dc.kept.len();
        for l in 0..cal.layers {
            for h in 0..hkv {
                for (i, &t) in dc.kept.iter().enumerate() {
                    let src = s * cal.features() * nk + ((l * hkv + h) * nk + i) * hd;
                    assert_eq!(&layers[l][t * width + h * hd..][..hd], &dc.kept_fp16[src..src + hd], "{what}: kept row {t} layer {l} head {h}");
                }
            }
        }
        for c in dc.chunks.iter().filter(|c| c.side == side) {
            let a = &cal.side(side).allocations[if side == Side::Keys { dc.k_alloc } else { dc.v_alloc }];
            let (n, layout) = (c.tokens.len(), device_layout(cal.side(side), a));
            let coeff = dequant_reference(&c.raw, n, &group_table(cal.side(side), a, &layout, n), layout.ldc);
            let want = restore_reference(cal, side, &coeff, n, &layout, &dc.positions[c.tokens.clone()], true);
            let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
            for l in 0..cal.layers {
                for (i, t) in c.tokens.clone().enumerate() {
                    for f in 0..width {
                        let got = half::f16::from_bits(layers[l][t * width + f]).to_f64();
                        let exp = want[(l * n + i) * width + f];
                        assert!((got - exp).abs() <= 1e-3 * exp.abs() + 2e-4 * scale, "{what}: {side:?} layer {l} token {t} feature {f}: {got} vs {exp} (scale {scale})");
                    }
                }
            }
        }
    }
    assert_eq!(n_tok, kv.tokens);
}

/// Random shapes: head dims 16/64/128, with and without RoPE, one-token chunks, odd token
/// counts and a short last chunk, allocations with gaps-free and padded component counts; a
/// basis over all layers and one per layer (block diagonal), and per two layers.
#[test]
#[ignore = "needs a CUDA device"]
fn restore_matches_reference_on_random_shapes() {
    let dev = Device::open(0).unwrap();
    let shapes = [(2, 2, 16, Some(Rope { theta: 10000.0, dim: 16 })), (3, 2, 64, Some(Rope { theta: 100000.0, dim: 64 })), (2, 4, 128, None), (4, 8, 128, Some(Rope { theta: 500000.0, dim: 96 }))];
    // KVTC_TEST_SMALL (compute-sanitizer runs): the two small shapes only
    let take = if std::env::var("KVTC_TEST_SMALL").is_ok() { 2 } else { shapes.len() };
    for ((si, (layers, heads, hd, rope)), lpb) in shapes.into_iter().take(take).enumerate().flat_map(|s| [(s, 0), (s, 1), (s, 2)]) {
        let cal = synthetic_calibration(layers, heads, hd, rope, &[4.0, 16.0, 64.0], lpb, 11 + si as u64);
        let r = KvtcRestorer::new(&dev, &cal).unwrap();
        for (ri, (tokens, chunk)) in [(4 + 128 + 1, 1), (4 + 128 + 37, 16), (4 + 128 + 301, 256), (4 + 128 + 7, 3), (100, 256)].into_iter().enumerate() {
            let ratio_index = ri % 3;
            let dc = synthetic_container(&cal, ratio_index, tokens, chunk, 3, 5 + ri as u64);
            check_restore(&dev, &r, &cal, &dc, &format!("shape {layers}x{heads}x{hd} layers/basis {lpb} rope {rope:?} tokens {tokens} chunk {chunk} ratio #{ratio_index}"));
        }
    }
}

/// A real calibration and a packed cache: the GPU restore equals the CPU unpack within fp16
/// rounding, and the container's typed errors reach the caller unchanged.
#[test]
#[ignore = "needs a CUDA device"]
fn restore_of_a_packed_cache_matches_cpu_unpack() {
    use kvforge_kvtc::{decode_container, pack_into, unpack_from, Entropy, PackOptions};
    let dev = Device::open(0).unwrap();
    let rope = Rope { theta: 10000.0, dim: 16 };
    let dp = DpConfig { group_sizes: vec![1, 4, 16], bit_widths: vec![1, 2, 3, 4, 6, 8], coded: false };
    for (lpb, weighted) in [(0, false), (1, false), (0, true), (1, true)] {
        let train = low_rank_dump(2, 2, 16, 6, rope, 500, 1);
        let cal = if weighted { weighted_calibration(&train, rope, &[4.0, 16.0], dp.clone(), lpb) } else { small_calibration(&train, rope, 2, 8, &[4.0, 16.0], dp.clone(), lpb) };
        let dump = low_rank_dump(2, 2, 16, 6, rope, 203, 2);
        let r = KvtcRestorer::new(&dev, &cal).unwrap();
        for (ratio, chunk) in [(4.0, 1), (16.0, 64)] {
            let opts = PackOptions { ratio_index: cal.ratio_index(ratio).unwrap(), entropy: Entropy::Deflate, chunk_tokens: chunk };
            let mut bytes = Vec::new();
            pack_into(&dump, &cal, &opts, &mut bytes).unwrap();
            let want = unpack_from(&mut bytes.as_slice(), &cal).unwrap();
            let dc = decode_container(&mut bytes.as_slice(), &cal).unwrap();
            check_restore(&dev, &r, &cal, &dc, &format!("packed ratio {ratio} layers/basis {lpb} weighted {weighted}"));
            let kv = r.restore(&dc).unwrap();
            let width = cal.kv_heads * cal.head_dim;
            for (side, w) in [(Side::Keys, &want.k), (Side::Values, &want.v)] {
                for l in 0..cal.layers {
                    let rows = kv.download_layer(&dev.stream, side, l).unwrap();
                    for t in 0..dump.tokens {
                        for h in 0..cal.kv_heads {
                            for c in 0..cal.head_dim {
                                let got = half::f16::from_bits(rows[t * width + h * cal.head_dim + c]).to_f32();
                                let exp = w[want.at(l, h, t, c)];
                                assert!((got - exp).abs() <= 5e-3 * exp.abs().max(1.0), "ratio {ratio} layers/basis {lpb} {side:?} l {l} t {t} h {h} c {c}: {got} vs {exp}");
                            }
                        }
                    }
                }
            }
            // a corrupted chunk is refused before anything reaches the device
            let mut bad = bytes.clone();
            let at = bad.len() - 40;
            bad[at] ^= 0x5a;
            assert!(decode_container(&mut bad.as_slice(), &cal).is_err());
        }
    }
}

/// The cache round trip: a sequence appended to every layer's cache (fp16 tier) → saved as a
/// kvtc container → restored on the device into a new sequence → decode over it matches decode
/// over the original within the codec's error; failures (corrupt input, a layer out of pages)
/// leave no sequence behind.
#[test]
#[ignore = "needs a CUDA device"]
fn save_load_decode_round_trip() {
    use kvforge_kvtc::{unpack_from, Entropy, PackOptions};
    use kvforge_rt::kvtc::{load_container, save_sequence};
    use kvforge_rt::{CacheConfig, KvCache};
    use rand::{Rng, SeedableRng};
    let dev = kvforge_rt::testing::device();
    let (layers, hkv, d, gqa) = (2usize, 2usize, 64usize, 3usize);
    let rope = Rope { theta: 10000.0, dim: d };
    let dp = DpConfig { group_sizes: vec![1, 16, 64], bit_widths: vec![2, 3, 4, 6, 8], coded: false };
    let cal = small_calibration(&low_rank_dump(layers, hkv, d, 8, rope, 800, 1), rope, 4, 16, &[4.0, 8.0], dp, 0);
    let x = low_rank_dump(layers, hkv, d, 8, rope, 301, 2);
    let spec = kvforge_rt::testing::shipped_spec("baseline.toml");
    let tier = spec.tier("fp16").unwrap().id;
    let mut caches: Vec<KvCache> = (0..layers).map(|_| KvCache::new(dev.clone(), spec.clone(), CacheConfig::new(&spec, d, gqa, hkv, 4, 2048).target(tier)).unwrap()).collect();
    // rows [n][hkv][d] of layer l
    let rows = |src: &[f32], l: usize| -> Vec<f32> { (0..x.tokens).flat_map(|t| (0..hkv).flat_map(move |h| (0..d).map(move |c| (t, h, c)))).map(|(t, h, c)| src[x.at(l, h, t, c)]).collect() };
    for (l, c) in caches.iter_mut().enumerate() {
        let s = c.add_sequence();
        c.append(s, &rows(&x.k, l), &rows(&x.v, l)).unwrap();
    }
    let opts = PackOptions { ratio_index: 0, entropy: Entropy::Deflate, chunk_tokens: 64 };
    let mut bytes = Vec::new();
    let stats = save_sequence(&caches.iter().collect::<Vec<_>>(), 0, &cal, &opts, &mut bytes).unwrap();
    assert_eq!(stats.tokens, x.tokens);
    let restored = unpack_from(&mut bytes.as_slice(), &cal).unwrap();
    let rel = |a: &[f32], b: &[f32]| (a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>() / a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>()).sqrt();
    let codec_err = rel(&x.k, &restored.k).max(rel(&x.v, &restored.v));
    println!("codec relative error (keys, values): {} {} ratio {:.2}", rel(&x.k, &restored.k), rel(&x.v, &restored.v), stats.ratio_total());
    let restorer = KvtcRestorer::new(&dev, &cal).unwrap();
    let ids = {
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        load_container(&mut refs, &mut bytes.as_slice(), &cal, &restorer, tier).unwrap()
    };
    assert_eq!(ids, vec![1, 1]);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    for c in caches.iter_mut() {
        assert_eq!(c.seq_len(1).unwrap(), x.tokens);
        let q: Vec<f32> = (0..hkv * gqa * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let (a, b) = (c.decode(&[0], &q).unwrap(), c.decode(&[1], &q).unwrap());
        let diff = rel(&a.out, &b.out);
        println!("decode relative difference original vs restored: {diff}");
        // key errors move the softmax weights too: a few times the rows' relative error
        assert!(diff <= 4.0 * codec_err + 5e-3, "decode differs by {diff}, codec error {codec_err}");
    }
    // corrupt input: typed error naming a chunk, no sequence added
    let mut bad = bytes.clone();
    let at = bad.len() / 2;
    bad[at] ^= 0x40;
    {
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let e = load_container(&mut refs, &mut bad.as_slice(), &cal, &restorer, tier).unwrap_err();
        assert!(e.to_string().contains("chunk"), "{e}");
    }
    assert!(caches.iter().all(|c| c.seq_len(2).is_err()));
    // a layer out of pages: the layer appended before it is rolled back
    let mut small_cfg = CacheConfig::new(&spec, d, gqa, hkv, 1, 64).target(tier);
    small_cfg.pages = vec![2; spec.tiers.len()];
    let mut small = KvCache::new(dev.clone(), spec.clone(), small_cfg).unwrap();
    let mut big = KvCache::new(dev.clone(), spec.clone(), CacheConfig::new(&spec, d, gqa, hkv, 4, 2048).target(tier)).unwrap();
    {
        let mut refs: Vec<&mut KvCache> = vec![&mut big, &mut small];
        assert!(load_container(&mut refs, &mut bytes.as_slice(), &cal, &restorer, tier).is_err());
    }
    assert!(big.seq_len(0).is_err() && small.seq_len(0).is_err());
}
