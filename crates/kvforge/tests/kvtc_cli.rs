//! `kvforge calibrate` / `pack` / `unpack` (kvtc) end to end on a small synthetic dump: the
//! round trip works, and truncated, corrupted or mismatched input exits 2 with a message
//! naming the chunk, leaving no output file behind.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kvforge_kvtc::{KvDump, Rope};

fn kvforge(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvforge")).args(args).env("CUDA_VISIBLE_DEVICES", "").output().expect("kvforge runs")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Keys with low-rank structure before RoPE (theta 10000 over 16 channels), values low-rank.
fn dump(tokens: usize, seed: u64) -> KvDump {
    let (layers, heads, hd) = (2, 2, 16);
    let p = layers * heads * hd;
    let rope = Rope { theta: 10000.0, dim: hd };
    let h = |a: u64, b: u64| (((a.wrapping_mul(6364136223846793005).wrapping_add(b.wrapping_mul(1442695040888963407)) >> 33) % 2001) as f64 - 1000.0) / 1000.0;
    let mut d = KvDump { layers, kv_heads: heads, head_dim: hd, tokens, positions: (0..tokens as i64).collect(), k: vec![0.0; p * tokens], v: vec![0.0; p * tokens] };
    for t in 0..tokens {
        let z: Vec<f64> = (0..4u64).map(|r| h(seed * 1_000_003 + t as u64, r) * 3.0 / (1 + r) as f64).collect();
        for l in 0..layers {
            for hh in 0..heads {
                let o = (l * heads + hh) * hd;
                let mut k: Vec<f64> = (0..hd).map(|c| (0..4).map(|r| z[r] * h(r as u64, (o + c) as u64)).sum::<f64>() + 0.3).collect();
                rope.apply(&mut k, t as i64, 1.0);
                let a = d.at(l, hh, t, 0);
                for c in 0..hd {
                    d.k[a + c] = k[c] as f32;
                    d.v[a + c] = (0..4).map(|r| z[r] * h(r as u64 + 7, (o + c) as u64)).sum::<f64>() as f32;
                }
            }
        }
    }
    d
}

fn workdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvtc-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Calibration samples `dump(600, seed)` with RoPE theta in the metadata.
fn samples(dir: &Path, seed: u64) -> PathBuf {
    let samples = dir.join(format!("samples{seed}.safetensors"));
    let mut meta = std::collections::HashMap::new();
    meta.insert("rope_theta".to_string(), "10000.0".to_string());
    dump(600, seed).save(&samples, meta).unwrap();
    samples
}

fn calibration(dir: &Path, seed: u64) -> PathBuf {
    calibration_with(dir, seed, &["--dp-rows", "32", "--seed", &seed.to_string()])
}

/// `kvforge calibrate` at ratios 4 and 8 with `extra` arguments.
fn calibration_with(dir: &Path, seed: u64, extra: &[&str]) -> PathBuf {
    let samples = samples(dir, seed);
    let cal = dir.join(format!("cal{seed}.safetensors"));
    let o = kvforge(&[&["calibrate", "--samples", s(&samples), "--out", s(&cal), "--ratios", "4,8", "--sinks", "2", "--window", "16"], extra].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    cal
}

/// Packs `original` (saved at `cache`) at 4× with `extra` pack arguments, unpacks it, and
/// returns the keys' relative error.
fn keys_round_trip(dir: &Path, cal: &Path, cache: &Path, original: &KvDump, extra: &[&str]) -> f64 {
    let packed = dir.join("c.kvtc");
    let o = kvforge(&[&["pack", s(cache), "--calibration", s(cal), "--ratio", "4", "--out", s(&packed)], extra].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = dir.join("r.safetensors");
    let o = kvforge(&["unpack", s(&packed), "--calibration", s(cal), "--out", s(&out)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let back = KvDump::load(&out).unwrap();
    let num: f64 = original.k.iter().zip(&back.k).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = original.k.iter().map(|a| (*a as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn calibrate_pack_unpack() {
    let dir = workdir("ok");
    let cal = calibration(&dir, 1);
    let cache = dir.join("cache.safetensors");
    let original = dump(200, 99);
    original.save(&cache, Default::default()).unwrap();
    let json = dir.join("c.json");
    let e = keys_round_trip(&dir, &cal, &cache, &original, &["--json", s(&json)]);
    assert!(e < 0.05, "keys rel err {e}");
    assert!(std::fs::read_to_string(&json).unwrap().contains("\"ratio_before_entropy\""));
    let packed = dir.join("c.kvtc");

    // a ratio the calibration lacks
    let o = kvforge(&["pack", s(&cache), "--calibration", s(&cal), "--ratio", "5", "--out", s(&packed)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--ratio 5"));

    // corrupted and truncated containers: exit 2, the chunk named, no output left
    let bytes = std::fs::read(&packed).unwrap();
    let mut bad = bytes.clone();
    let n = bad.len();
    bad[n - 40] ^= 0x55;
    let badp = dir.join("bad.kvtc");
    std::fs::write(&badp, &bad).unwrap();
    let out2 = dir.join("r2.safetensors");
    let o = kvforge(&["unpack", s(&badp), "--calibration", s(&cal), "--out", s(&out2)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("chunk"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!out2.exists());
    std::fs::write(&badp, &bytes[..n / 2]).unwrap();
    let o = kvforge(&["unpack", s(&badp), "--calibration", s(&cal), "--out", s(&out2)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("stream ends inside chunk"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!out2.exists());

    // another calibration
    let other = calibration(&dir, 2);
    let o = kvforge(&["unpack", s(&packed), "--calibration", s(&other), "--out", s(&out2)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("packed with calibration"), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn calibrate_without_rope_says_how() {
    let dir = workdir("rope");
    let samples = dir.join("s.safetensors");
    dump(300, 1).save(&samples, Default::default()).unwrap();
    let o = kvforge(&["calibrate", "--samples", s(&samples), "--out", s(&dir.join("c.safetensors"))]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--rope-theta"));
    std::fs::remove_dir_all(&dir).ok();
}

/// Several --key-share and --dp-rows values write one calibration per point, named
/// `<stem>-ks<share>-dp<rows>.<ext>`, each usable for packing; a share outside (0, 1) exits 2.
#[test]
fn calibrate_grid_writes_one_file_per_point() {
    let dir = workdir("grid");
    let samples = samples(&dir, 1);
    let cal = dir.join("cal.safetensors");
    let o = kvforge(&["calibrate", "--samples", s(&samples), "--out", s(&cal), "--ratios", "4,8", "--sinks", "2", "--window", "16", "--dp-rows", "16,32", "--key-share", "0.3,0.5"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!cal.exists());
    let cache = dir.join("cache.safetensors");
    dump(100, 9).save(&cache, Default::default()).unwrap();
    for name in ["cal-ks0.3-dp16", "cal-ks0.5-dp16", "cal-ks0.3-dp32", "cal-ks0.5-dp32"] {
        let c = dir.join(format!("{name}.safetensors"));
        assert!(c.exists(), "{name}: {}", String::from_utf8_lossy(&o.stdout));
        let o = kvforge(&["pack", s(&cache), "--calibration", s(&c), "--ratio", "8", "--out", s(&dir.join("c.kvtc"))]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let o = kvforge(&["calibrate", "--samples", s(&samples), "--out", s(&cal), "--key-share", "0.3,1.2"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--key-share"));
    std::fs::remove_dir_all(&dir).ok();
}

/// `calibrate --step` and `pack --entropy rans` round-trip; `rans` with a fixed-width
/// calibration exits 2 naming `--coded`.
#[test]
fn step_calibration_packs_with_rans() {
    let dir = workdir("step");
    let cal = calibration_with(&dir, 5, &["--dp-rows", "64", "--step"]);
    let cache = dir.join("cache.safetensors");
    let original = dump(200, 98);
    original.save(&cache, Default::default()).unwrap();
    let e = keys_round_trip(&dir, &cal, &cache, &original, &["--entropy", "rans"]);
    assert!(e < 0.1, "keys rel err {e}");
    let fixed = calibration(&dir, 3);
    let o = kvforge(&["pack", s(&cache), "--calibration", s(&fixed), "--ratio", "4", "--entropy", "rans", "--out", s(&dir.join("x.kvtc"))]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--coded"), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!dir.join("x.kvtc").exists());
    std::fs::remove_dir_all(&dir).ok();
}
