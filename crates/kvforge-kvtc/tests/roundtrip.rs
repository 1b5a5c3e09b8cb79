//! End to end on a small synthetic cache with low-rank structure: calibrate, save and load the
//! calibration, pack, unpack; errors fall with the ratio; corrupted, truncated and
//! mismatched input gives typed errors naming the chunk, never a panic.

use kvforge_kvtc::{calibrate, pack_into, unpack_from, CalibConfig, Calibration, DpConfig, Entropy, KvDump, KvtcError, PackOptions, Rope};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

const ROPE: Rope = Rope { theta: 10000.0, dim: 16 };

/// Keys built pre-RoPE from a few shared latent factors (so they are low-rank once RoPE is
/// undone), then rotated to their positions; values low-rank too.
fn synthetic(layers: usize, heads: usize, hd: usize, tokens: usize, mix_seed: u64, token_seed: u64) -> KvDump {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(mix_seed);
    let rank = 6;
    let p = layers * heads * hd;
    let mix_k: Vec<f64> = (0..rank * p).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mix_v: Vec<f64> = (0..rank * p).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(token_seed);
    let mut d = KvDump { layers, kv_heads: heads, head_dim: hd, tokens, positions: (0..tokens as i64).collect(), k: vec![0.0; p * tokens], v: vec![0.0; p * tokens] };
    for t in 0..tokens {
        let z: Vec<f64> = (0..rank).map(|r| rng.gen_range(-1.0..1.0) * 4.0 / (1 + r) as f64).collect();
        for l in 0..layers {
            for h in 0..heads {
                let o = (l * heads + h) * hd;
                let mut kr: Vec<f64> = (0..hd).map(|c| 0.5 + (0..rank).map(|r| z[r] * mix_k[r * p + o + c]).sum::<f64>() + rng.gen_range(-0.01..0.01)).collect();
                ROPE.apply(&mut kr, t as i64, 1.0);
                let a = d.at(l, h, t, 0);
                for c in 0..hd {
                    d.k[a + c] = kr[c] as f32;
                    d.v[a + c] = ((0..rank).map(|r| z[r] * mix_v[r * p + o + c]).sum::<f64>() + rng.gen_range(-0.01..0.01)) as f32;
                }
            }
        }
    }
    d
}

fn cfg() -> CalibConfig {
    CalibConfig {
        sinks: 2,
        window: 8,
        max_samples: 400,
        dp_rows: 48,
        ratios: vec![4.0, 16.0, 64.0],
        rope: Some(ROPE),
        dp: DpConfig { group_sizes: vec![1, 4, 16], bit_widths: vec![1, 2, 3, 4, 6, 8], coded: false },
        ..CalibConfig::default()
    }
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn setup() -> (KvDump, Calibration) {
    setup_scoped(0)
}

/// The fixture with a basis per `layers_per_basis` layers (0: one over all layers).
fn setup_scoped(layers_per_basis: usize) -> (KvDump, Calibration) {
    let cal = calibrate(&synthetic(2, 2, 16, 500, 1, 1), &CalibConfig { layers_per_basis, ..cfg() }, |_| {}).unwrap();
    (synthetic(2, 2, 16, 100, 1, 2), cal)
}

/// A per-layer basis is block diagonal: two blocks, each a whole layer, components padded to
/// the block alignment, and no allocation group crossing a block.
#[test]
fn per_layer_basis_is_block_diagonal() {
    let (_, cal) = setup_scoped(1);
    for s in [&cal.k, &cal.v] {
        assert_eq!(s.blocks.len(), 2);
        assert_eq!(s.blocks[0].features, 0..32);
        assert_eq!(s.blocks[1].features, 32..64);
        assert_eq!(s.blocks[1].components.start % kvforge_kvtc::calib::BLOCK_ALIGN, 0);
        assert_eq!(s.basis.len(), s.blocks.iter().map(|b| b.components.len() * 32).sum::<usize>());
        for a in &s.allocations {
            for g in &a.groups {
                assert!(s.block_of(g.start as usize) == s.block_of((g.start + g.len - 1) as usize), "{g:?} crosses a block");
            }
        }
    }
}

#[test]
fn calibrate_pack_unpack_round_trip() {
    round_trip(0);
    round_trip(1);
}

fn round_trip(layers_per_basis: usize) {
    let (cache, cal) = setup_scoped(layers_per_basis);
    let cal2 = reloaded(&cal, &layers_per_basis.to_string());
    let mut prev = 0.0;
    for (i, &ratio) in cal.ratios.iter().enumerate() {
        for entropy in [Entropy::None, Entropy::Deflate, Entropy::Zstd] {
            let mut buf = Vec::new();
            let stats = pack_into(&cache, &cal2, &PackOptions { ratio_index: i, entropy, chunk_tokens: 32 }, &mut buf).unwrap();
            assert_eq!(stats.total_bytes, buf.len());
            let got = stats.ratio_before_entropy();
            assert!(got >= ratio * 0.95, "ratio {ratio}: packed {got:.2}x before entropy");
            let back = unpack_from(&mut buf.as_slice(), &cal2).unwrap();
            assert_eq!(back.positions, cache.positions);
            // sinks and window tokens are fp16-exact
            for t in (0..2).chain(92..100) {
                let a = cache.at(1, 1, t, 0);
                for c in 0..16 {
                    assert_eq!(back.k[a + c], half::f16::from_f32(cache.k[a + c]).to_f32());
                }
            }
            let (ek, ev) = (rel_err(&cache.k, &back.k), rel_err(&cache.v, &back.v));
            if entropy == Entropy::None {
                assert!(ek.max(ev) >= prev * 0.999, "error should grow with the ratio");
                prev = ek.max(ev);
            }
            // 64x of 64 features is 16 bits per token, less than one group's shift and scale:
            // everything is dropped and restores as the mean.
            // A per-layer basis codes the latent factors the layers share once per layer, and
            // pays a shift and scale per group in each: at 16x of 32 features per block that
            // leaves little, so only 4x is bounded tightly there.
            let bound = if ratio <= 4.0 || (ratio <= 16.0 && layers_per_basis == 0) { 0.3 } else { 1.0 };
            eprintln!("ratio {ratio} {entropy:?}: {:.2}x before entropy, {:.2}x after, keys {ek:.4} values {ev:.4}", got, stats.ratio_after_entropy());
            assert!(ek < bound && ev < bound, "ratio {ratio}: rel err keys {ek:.4} values {ev:.4}");
        }
    }
    let mut buf = Vec::new();
    pack_into(&cache, &cal, &PackOptions { ratio_index: 0, entropy: Entropy::Deflate, chunk_tokens: 32 }, &mut buf).unwrap();
    let back = unpack_from(&mut buf.as_slice(), &cal).unwrap();
    assert!(rel_err(&cache.k, &back.k) < 0.02, "4x keys rel err {}", rel_err(&cache.k, &back.k));
}

/// `cal` written to a calibration file and read back (the directory removed), its id checked.
fn reloaded(cal: &Calibration, tag: &str) -> Calibration {
    let dir = std::env::temp_dir().join(format!("kvtc-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cal.safetensors");
    cal.save(&path, &Default::default()).unwrap();
    let back = Calibration::load(&path).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(back.id(), cal.id());
    back
}

#[test]
fn wrong_calibration_is_refused() {
    let (cache, cal) = setup();
    let mut other_cfg = cfg();
    other_cfg.seed = 9;
    let other = calibrate(&synthetic(2, 2, 16, 500, 3, 3), &other_cfg, |_| {}).unwrap();
    let mut buf = Vec::new();
    pack_into(&cache, &cal, &PackOptions { ratio_index: 1, entropy: Entropy::Zstd, chunk_tokens: 32 }, &mut buf).unwrap();
    assert!(matches!(unpack_from(&mut buf.as_slice(), &other), Err(KvtcError::CalibrationMismatch { .. })));
}

#[test]
fn truncation_names_the_chunk() {
    let (cache, cal) = setup();
    let mut buf = Vec::new();
    pack_into(&cache, &cal, &PackOptions { ratio_index: 1, entropy: Entropy::Deflate, chunk_tokens: 32 }, &mut buf).unwrap();
    // chunk k spans starts[k]..starts[k+1] (28-byte header + stored length at offset 20)
    let mut starts = vec![kvforge_kvtc::container::HEADER_LEN];
    while *starts.last().unwrap() < buf.len() {
        let at = *starts.last().unwrap();
        let stored = u32::from_le_bytes(buf[at + 20..at + 24].try_into().unwrap()) as usize;
        starts.push(at + kvforge_kvtc::container::CHUNK_HEADER_LEN + stored);
    }
    assert_eq!(*starts.last().unwrap(), buf.len());
    for cut in (0..buf.len()).step_by(97).chain([buf.len() - 1]) {
        match unpack_from(&mut &buf[..cut], &cal).unwrap_err() {
            KvtcError::BadMagic { .. } => assert!(cut < 8),
            KvtcError::Truncated { chunk, .. } if cut < kvforge_kvtc::container::HEADER_LEN => assert_eq!(chunk, 0),
            KvtcError::Truncated { chunk, .. } => {
                let k = starts.iter().rposition(|&s| s <= cut).unwrap();
                assert_eq!(chunk as usize, k, "cut at byte {cut} falls in chunk {k}");
            }
            e => panic!("cut {cut}: {e}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Any single corrupted byte, or arbitrary garbage appended to a valid prefix, gives an
    /// error (or, for bytes the checksums do not cover, the same cache), never a panic.
    #[test]
    fn corrupted_streams_give_typed_errors(pos in any::<prop::sample::Index>(), xor in 1u8..=255, cut in any::<prop::sample::Index>(), junk in proptest::collection::vec(any::<u8>(), 0..64)) {
        let (cache, cal) = fixture();
        corrupt(cache, cal, Entropy::Deflate, (pos, xor, cut, &junk))?;
    }

    /// The same for a `rans` container of a step calibration.
    #[test]
    fn corrupted_rans_streams_give_typed_errors(pos in any::<prop::sample::Index>(), xor in 1u8..=255, cut in any::<prop::sample::Index>(), junk in proptest::collection::vec(any::<u8>(), 0..64)) {
        let (cache, cal) = step_fixture();
        corrupt(cache, cal, Entropy::Rans, (pos, xor, cut, &junk))?;
    }
}

/// Packs `cache`, flips byte `pos` by `xor` (must fail) and splices `junk` after a prefix of
/// `cut` bytes (must not panic).
fn corrupt(cache: &KvDump, cal: &Calibration, entropy: Entropy, (pos, xor, cut, junk): (prop::sample::Index, u8, prop::sample::Index, &[u8])) -> Result<(), TestCaseError> {
    let mut buf = Vec::new();
    pack_into(cache, cal, &PackOptions { ratio_index: 1, entropy, chunk_tokens: 32 }, &mut buf).unwrap();
    let mut bad = buf.clone();
    let i = pos.index(bad.len());
    bad[i] ^= xor;
    prop_assert!(unpack_from(&mut bad.as_slice(), cal).is_err(), "flipping byte {} went unnoticed", i);
    let mut spliced = buf[..cut.index(buf.len())].to_vec();
    spliced.extend_from_slice(junk);
    let _ = unpack_from(&mut spliced.as_slice(), cal);
    Ok(())
}

fn step_fixture() -> (&'static KvDump, &'static Calibration) {
    use std::sync::OnceLock;
    static F: OnceLock<(KvDump, Calibration)> = OnceLock::new();
    let f = F.get_or_init(|| (synthetic(2, 2, 16, 100, 1, 2), calibrate(&synthetic(2, 2, 16, 500, 1, 1), &CalibConfig { step: true, ..cfg() }, |_| {}).unwrap()));
    (&f.0, &f.1)
}

fn fixture() -> (&'static KvDump, &'static Calibration) {
    use std::sync::OnceLock;
    static F: OnceLock<(KvDump, Calibration)> = OnceLock::new();
    let f = F.get_or_init(setup);
    (&f.0, &f.1)
}

/// The GPU restore's f64 mirror (group table → dequant → coefficients · basis + mean → RoPE,
/// rows per layer) reproduces the CPU unpack, odd and one-token chunks included.
#[test]
fn restore_reference_equals_unpack() {
    use kvforge_kvtc::restore::{dequant_reference, device_layout, group_table, restore_reference};
    use kvforge_kvtc::{decode_container, Side};
    for scope in [0, 1] {
        let (dump, cal) = setup_scoped(scope);
        for (ratio, chunk_tokens) in [(4.0, 7), (16.0, 1), (64.0, 256)] {
            let opts = PackOptions { ratio_index: cal.ratio_index(ratio).unwrap(), entropy: Entropy::Deflate, chunk_tokens };
            let mut bytes = Vec::new();
            pack_into(&dump, &cal, &opts, &mut bytes).unwrap();
            let want = unpack_from(&mut bytes.as_slice(), &cal).unwrap();
            let dc = decode_container(&mut bytes.as_slice(), &cal).unwrap();
            assert!(!dc.chunks.is_empty());
            let (hd, hkv) = (cal.head_dim, cal.kv_heads);
            for c in &dc.chunks {
                let a = &cal.side(c.side).allocations[if c.side == Side::Keys { dc.k_alloc } else { dc.v_alloc }];
                let (n, layout) = (c.tokens.len(), device_layout(cal.side(c.side), a));
                let coeff = dequant_reference(&c.raw, n, &group_table(cal.side(c.side), a, &layout, n), layout.ldc);
                let x = restore_reference(&cal, c.side, &coeff, n, &layout, &dc.positions[c.tokens.clone()], false);
                let w = if c.side == Side::Keys { &want.k } else { &want.v };
                for l in 0..cal.layers {
                    for (i, t) in c.tokens.clone().enumerate() {
                        for h in 0..hkv {
                            for ch in 0..hd {
                                let got = x[(l * n + i) * hkv * hd + h * hd + ch];
                                let exp = w[want.at(l, h, t, ch)] as f64;
                                assert!((got - exp).abs() <= 1e-5 * exp.abs().max(1.0), "scope {scope} ratio {ratio} {:?} l {l} t {t} h {h} ch {ch}: {got} vs {exp}", c.side);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A container rewritten from its decoded chunks (what a restore benchmark saves) is the same
/// bytes, for each entropy coder; the stored form decodes to the same chunks.
#[test]
fn write_container_reproduces_packed_bytes() {
    let (cache, cal) = fixture();
    for entropy in [Entropy::None, Entropy::Deflate, Entropy::Zstd] {
        let mut buf = Vec::new();
        pack_into(cache, cal, &PackOptions { ratio_index: 1, entropy, chunk_tokens: 32 }, &mut buf).unwrap();
        let dc = kvforge_kvtc::decode_container(&mut buf.as_slice(), cal).unwrap();
        let mut again = Vec::new();
        let n = kvforge_kvtc::write_container(&dc, entropy, &mut again).unwrap();
        assert_eq!(n, again.len());
        assert_eq!(again, buf, "{entropy:?}");
        let sc = kvforge_kvtc::read_container(&mut buf.as_slice(), cal).unwrap();
        for (i, c) in dc.chunks.iter().enumerate() {
            assert_eq!(sc.decode_chunk(i).unwrap().raw, c.raw);
        }
    }
}

/// Feature weights of the fixture's shape: a few heavy channels per head, the rest light (as
/// query energy is over key channel pairs), deterministic.
fn skewed_weights(p: usize, seed: u64) -> Vec<f64> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..p).map(|f| if f % 16 < 3 { 50.0 } else { rng.gen_range(0.05..1.0) }).collect()
}

fn weighted_err(a: &[f32], b: &[f32], w: &[f64], d: &KvDump) -> f64 {
    let mut num = 0.0;
    for l in 0..d.layers {
        for h in 0..d.kv_heads {
            for t in 0..d.tokens {
                for c in 0..d.head_dim {
                    let i = d.at(l, h, t, c);
                    num += w[(l * d.kv_heads + h) * d.head_dim + c] * ((a[i] - b[i]) as f64).powi(2);
                }
            }
        }
    }
    num
}

/// A weighted calibration (version 3: per-feature scale, basis `u ⊘ s`) saves and loads with
/// its id, spends the budgets `key_share` gives each side, lowers the *weighted* error against
/// the unweighted calibration at the same ratio, and its GPU mirror (restore reference: the
/// unchanged `coefficients · basis + mean`) equals the CPU unpack.
#[test]
fn weighted_calibration() {
    use kvforge_kvtc::restore::{dequant_reference, device_layout, group_table, restore_reference};
    use kvforge_kvtc::{decode_container, Side};
    let train = synthetic(2, 2, 16, 500, 1, 1);
    let (cache, p) = (synthetic(2, 2, 16, 100, 1, 2), train.features());
    // key weights equal within each RoPE pair (channel c and c + 8 of a head), as query energy
    // is: the weighted error is then the same before and after RoPE
    let wk: Vec<f64> = {
        let w = skewed_weights(p, 3);
        (0..p).map(|f| w[f - f % 16 + f % 8]).collect()
    };
    let wv = skewed_weights(p, 4);
    let plain = calibrate(&train, &CalibConfig { key_share: 0.4, ..cfg() }, |_| {}).unwrap();
    let cal = calibrate(&train, &CalibConfig { weights: [Some(wk.clone()), Some(wv.clone())], key_share: 0.4, ..cfg() }, |_| {}).unwrap();
    assert_eq!(cal.k.scale.len(), p);
    for (i, &r) in cal.ratios.iter().enumerate() {
        let b = kvforge_kvtc::calib::budget_bits(p, r);
        assert_eq!(cal.k.allocations[i].budget_bits as usize, (2.0 * b as f64 * 0.4).floor() as usize);
        assert_eq!(cal.k.allocations[i].budget_bits + cal.v.allocations[i].budget_bits, 2 * b as u32);
        for a in [&cal.k.allocations[i], &cal.v.allocations[i]] {
            assert!(a.cost_bits() <= u64::from(a.budget_bits), "ratio {r}: {} of {} bits", a.cost_bits(), a.budget_bits);
        }
    }
    let cal2 = reloaded(&cal, "weighted");
    assert!(cal2.k.scale == cal.k.scale && cal2.v.scale == cal.v.scale && cal2.k.basis == cal.k.basis && cal2.v.basis == cal.v.basis);
    let restore = |c: &Calibration, ratio: f64| {
        let mut buf = Vec::new();
        pack_into(&cache, c, &PackOptions { ratio_index: c.ratio_index(ratio).unwrap(), entropy: Entropy::Deflate, chunk_tokens: 32 }, &mut buf).unwrap();
        (unpack_from(&mut buf.as_slice(), c).unwrap(), buf)
    };
    for r in [4.0, 16.0] {
        let (a, b) = (restore(&plain, r).0, restore(&cal2, r).0);
        let (pk, qk) = (weighted_err(&cache.k, &a.k, &wk, &cache), weighted_err(&cache.k, &b.k, &wk, &cache));
        let (pv, qv) = (weighted_err(&cache.v, &a.v, &wv, &cache), weighted_err(&cache.v, &b.v, &wv, &cache));
        eprintln!("{r}x weighted error: unweighted calibration keys {pk:.4} values {pv:.4}, weighted keys {qk:.4} values {qv:.4}");
        assert!(qk < pk && qv < pv, "{r}x: weighting should lower the weighted errors: keys {qk} vs {pk}, values {qv} vs {pv}");
    }
    let (back, bytes) = restore(&cal2, 4.0);
    assert!(rel_err(&cache.k, &back.k) < 0.05 && rel_err(&cache.v, &back.v) < 0.05, "4x: keys {} values {}", rel_err(&cache.k, &back.k), rel_err(&cache.v, &back.v));
    let dc = decode_container(&mut bytes.as_slice(), &cal2).unwrap();
    for c in &dc.chunks {
        let s = cal2.side(c.side);
        let al = &s.allocations[if c.side == Side::Keys { dc.k_alloc } else { dc.v_alloc }];
        let (n, layout) = (c.tokens.len(), device_layout(s, al));
        let coeff = dequant_reference(&c.raw, n, &group_table(s, al, &layout, n), layout.ldc);
        let x = restore_reference(&cal2, c.side, &coeff, n, &layout, &dc.positions[c.tokens.clone()], false);
        // the device's fp16 operands (basis `u ⊘ s`, weighted-domain coefficients) stay within
        // the GPU test's tolerance of the CPU unpack
        let x16 = restore_reference(&cal2, c.side, &coeff, n, &layout, &dc.positions[c.tokens.clone()], true);
        let w = if c.side == Side::Keys { &back.k } else { &back.v };
        for l in 0..cal2.layers {
            for (i, t) in c.tokens.clone().enumerate() {
                for h in 0..cal2.kv_heads {
                    for ch in 0..cal2.head_dim {
                        let at = (l * n + i) * cal2.kv_heads * cal2.head_dim + h * cal2.head_dim + ch;
                        let (got, exp) = (x[at], w[back.at(l, h, t, ch)] as f64);
                        assert!((got - exp).abs() <= 1e-5 * exp.abs().max(1.0), "{:?} l {l} t {t} h {h} ch {ch}: {got} vs {exp}", c.side);
                        assert!((x16[at] - exp).abs() <= 5e-3 * exp.abs().max(1.0), "fp16 operands {:?} l {l} t {t} h {h} ch {ch}: {} vs {exp}", c.side, x16[at]);
                    }
                }
            }
        }
    }
}

/// A calibration grid (one PCA per side, one DP per row count, allocations per key share)
/// gives, point for point, what `calibrate` gives for that key share and row count, in the
/// order row counts × key shares; an empty grid or a key share outside (0, 1) is refused.
#[test]
fn calibration_grid_equals_single_calibrations() {
    use kvforge_kvtc::calibrate_grid;
    let train = synthetic(2, 2, 16, 300, 1, 1);
    let (shares, rows) = ([0.3, 0.5], [16, 48]);
    let grid = calibrate_grid(&train, &cfg(), &shares, &rows, |_| {}).unwrap();
    assert_eq!(grid.len(), 4);
    for (i, &r) in rows.iter().enumerate() {
        for (j, &ks) in shares.iter().enumerate() {
            let one = calibrate(&train, &CalibConfig { key_share: ks, dp_rows: r, ..cfg() }, |_| {}).unwrap();
            assert_eq!(grid[i * shares.len() + j], one, "dp rows {r} key share {ks}");
            assert_eq!(grid[i * shares.len() + j].id(), one.id());
        }
    }
    assert_ne!(grid[0].k.allocations, grid[1].k.allocations, "the key share moves the key budget");
    assert!(matches!(calibrate_grid(&train, &cfg(), &[], &rows, |_| {}), Err(KvtcError::BadInput(_))));
    assert!(matches!(calibrate_grid(&train, &cfg(), &[0.3, 1.0], &rows, |_| {}), Err(KvtcError::BadInput(_))));
}

/// A coded calibration (`--coded`): its file round-trips, `rans` packs it to about its ratio
/// after entropy coding and unpacks bit-exactly what the packed codes hold; `rans` with a
/// fixed-width calibration is a typed error.
#[test]
fn coded_calibration_packs_with_rans() {
    coded_round_trip(CalibConfig { dp: DpConfig { coded: true, ..cfg().dp }, ..cfg() }, "coded");
    coded_round_trip(CalibConfig { step: true, ..cfg() }, "step");
    coded_round_trip(CalibConfig { step: true, dead_zone: 0.2, holdout: 0.25, ..cfg() }, "step-dead-zone");
}

fn coded_round_trip(coded: CalibConfig, tag: &str) {
    let cache = synthetic(2, 2, 16, 100, 1, 2);
    let cal = calibrate(&synthetic(2, 2, 16, 500, 1, 1), &coded, |_| {}).unwrap();
    let cal2 = reloaded(&cal, tag);
    for (a, b) in cal.k.allocations.iter().chain(&cal.v.allocations).zip(cal2.k.allocations.iter().chain(&cal2.v.allocations)) {
        assert_eq!((&a.groups, &a.models, a.step, a.dead_zone), (&b.groups, &b.models, b.step, b.dead_zone));
        assert_eq!(b.dead_zone, coded.dead_zone);
    }
    assert!(cal2.k.allocations.iter().chain(&cal2.v.allocations).all(|a| a.codable()) && cal2.k.allocations[0].coded());
    for (i, &ratio) in cal.ratios.iter().enumerate() {
        let mut zs = Vec::new();
        pack_into(&cache, &cal2, &PackOptions { ratio_index: i, entropy: Entropy::None, chunk_tokens: 32 }, &mut zs).unwrap();
        let mut buf = Vec::new();
        let stats = pack_into(&cache, &cal2, &PackOptions { ratio_index: i, entropy: Entropy::Rans, chunk_tokens: 32 }, &mut buf).unwrap();
        let after = stats.ratio_after_entropy();
        // the budget is the calibration rows' estimate: the cache is other tokens of the same source
        assert!(after >= ratio * 0.85, "{tag} ratio {ratio}: {after:.2}x after rans");
        let a = unpack_from(&mut buf.as_slice(), &cal2).unwrap();
        let b = unpack_from(&mut zs.as_slice(), &cal2).unwrap();
        assert_eq!((a.k, a.v), (b.k, b.v), "rans must decode to the packed codes");
    }
    let plain = calibrate(&synthetic(2, 2, 16, 500, 1, 1), &cfg(), |_| {}).unwrap();
    let e = pack_into(&cache, &plain, &PackOptions { ratio_index: 0, entropy: Entropy::Rans, chunk_tokens: 32 }, &mut Vec::new()).unwrap_err();
    assert!(e.to_string().contains("--coded"), "{e}");
}
