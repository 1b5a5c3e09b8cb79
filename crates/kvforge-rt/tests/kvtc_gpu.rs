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

use kvforge_kvtc::restore::{dequant_reference, group_table, padded_components, restore_reference, synthetic_calibration, synthetic_container};
use kvforge_kvtc::{Calibration, DecodedContainer, Rope, Side};
use kvforge_rt::kvtc::KvtcRestorer;
use kvforge_rt::Device;

/// Checks every row of a restore against the f64 mirror of the kernels (fp16 operands): kept
/// rows bit-exact, coded rows within fp32 accumulation plus fp16 output rounding.
fn check_restore(dev: &Device, r: &KvtcRestorer, cal: &Calibration, dc: &DecodedContainer, what: &str) {
    let kv = r.restore(dc).unwrap_or_else(|e| panic!("{what}: {e}"));
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
            let (n, ldc) = (c.tokens.len(), padded_components(a));
            let coeff = dequant_reference(&c.raw, n, &group_table(a, n, ldc), ldc);
            let want = restore_reference(cal, side, &coeff, n, ldc, &dc.positions[c.tokens.clone()], true);
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
/// counts and a short last chunk, allocations with gaps-free and padded component counts.
#[test]
#[ignore = "needs a CUDA device"]
fn restore_matches_reference_on_random_shapes() {
    let dev = Device::open(0).unwrap();
    let shapes = [(2, 2, 16, Some(Rope { theta: 10000.0, dim: 16 })), (3, 2, 64, Some(Rope { theta: 100000.0, dim: 64 })), (2, 4, 128, None), (4, 8, 128, Some(Rope { theta: 500000.0, dim: 96 }))];
    for (si, (layers, heads, hd, rope)) in shapes.into_iter().enumerate() {
        let cal = synthetic_calibration(layers, heads, hd, rope, &[4.0, 16.0, 64.0], 11 + si as u64);
        let r = KvtcRestorer::new(&dev, &cal).unwrap();
        for (ri, (tokens, chunk)) in [(4 + 128 + 1, 1), (4 + 128 + 37, 16), (4 + 128 + 301, 256), (4 + 128 + 7, 3), (100, 256)].into_iter().enumerate() {
            let ratio_index = ri % 3;
            let dc = synthetic_container(&cal, ratio_index, tokens, chunk, 3, 5 + ri as u64);
            check_restore(&dev, &r, &cal, &dc, &format!("shape {layers}x{heads}x{hd} rope {rope:?} tokens {tokens} chunk {chunk} ratio #{ratio_index}"));
        }
    }
}

/// A real calibration and a packed cache: the GPU restore equals the CPU unpack within fp16
/// rounding, and the container's typed errors reach the caller unchanged.
#[test]
#[ignore = "needs a CUDA device"]
fn restore_of_a_packed_cache_matches_cpu_unpack() {
    use kvforge_kvtc::{calibrate, decode_container, pack_into, unpack_from, CalibConfig, DpConfig, Entropy, KvDump, PackOptions};
    use rand::{Rng, SeedableRng};
    let dev = Device::open(0).unwrap();
    let rope = Rope { theta: 10000.0, dim: 16 };
    let synth = |tokens: usize, seed: u64| {
        let (layers, heads, hd) = (2, 2, 16);
        let p = layers * heads * hd;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let mix: Vec<f64> = (0..6 * p).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut d = KvDump { layers, kv_heads: heads, head_dim: hd, tokens, positions: (0..tokens as i64).collect(), k: vec![0.0; p * tokens], v: vec![0.0; p * tokens] };
        for t in 0..tokens {
            let z: Vec<f64> = (0..6).map(|r| rng.gen_range(-1.0..1.0) * 4.0 / (1 + r) as f64).collect();
            for l in 0..layers {
                for h in 0..heads {
                    let o = (l * heads + h) * hd;
                    let mut kr: Vec<f64> = (0..hd).map(|c| 0.5 + (0..6).map(|r| z[r] * mix[r * p + o + c]).sum::<f64>()).collect();
                    rope.apply(&mut kr, t as i64, 1.0);
                    let a = d.at(l, h, t, 0);
                    for c in 0..hd {
                        d.k[a + c] = kr[c] as f32;
                        d.v[a + c] = (0..6).map(|r| z[r] * mix[r * p + o + c] * 0.7).sum::<f64>() as f32;
                    }
                }
            }
        }
        d
    };
    let cfg = CalibConfig { sinks: 2, window: 8, max_samples: 400, dp_rows: 48, ratios: vec![4.0, 16.0], rope: Some(rope), dp: DpConfig { group_sizes: vec![1, 4, 16], bit_widths: vec![1, 2, 3, 4, 6, 8] }, ..CalibConfig::default() };
    let cal = calibrate(&synth(500, 1), &cfg, |_| {}).unwrap();
    let dump = synth(203, 2);
    let r = KvtcRestorer::new(&dev, &cal).unwrap();
    for (ratio, chunk) in [(4.0, 1), (16.0, 64)] {
        let opts = PackOptions { ratio_index: cal.ratio_index(ratio).unwrap(), entropy: Entropy::Deflate, chunk_tokens: chunk };
        let mut bytes = Vec::new();
        pack_into(&dump, &cal, &opts, &mut bytes).unwrap();
        let want = unpack_from(&mut bytes.as_slice(), &cal).unwrap();
        let dc = decode_container(&mut bytes.as_slice(), &cal).unwrap();
        check_restore(&dev, &r, &cal, &dc, &format!("packed ratio {ratio}"));
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
                            assert!((got - exp).abs() <= 2e-3 * exp.abs().max(1.0), "ratio {ratio} {side:?} l {l} t {t} h {h} c {c}: {got} vs {exp}");
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
