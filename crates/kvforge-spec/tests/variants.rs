//! Variant naming: one id names every kernel (file, symbol, Rust ident, cache key). The tiers'
//! byte costs of every shipped spec are snapshotted, so a change in costs is reviewed; the
//! variant lists with their default schedules are pinned by kvforge-gen's tests (the schedules
//! are the generator's). Here decode formats take one fixed schedule, [`S`].

use std::collections::HashSet;
use std::fmt::Write;
use std::path::Path;

use kvforge_spec::{Family, Schedule, Spec, TierId, VariantId, TAIL_TIER};

const SHIPPED: [&str; 4] = ["baseline", "certified", "rdkv", "spherical"];

fn specs_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs")
}

fn spec(name: &str) -> Spec {
    Spec::load(&specs_dir().join(format!("{name}.toml"))).unwrap()
}

/// The schedule every decode format takes in these tests.
const S: Schedule = Schedule { warps: 4, ctas_per_sm: 1, stages: 2, tc_values: true };

fn variants(s: &Spec) -> Vec<VariantId> {
    s.variants_with(&|_: &Spec, _: &[TierId], _: usize, _: usize| S)
}

fn names(s: &Spec) -> Vec<String> {
    variants(s).iter().map(VariantId::name).collect()
}

#[test]
fn spherical_names() {
    let s = spec("spherical");
    let n = names(&s);
    for want in [
        "decode_ksph16x8b6_vfp16_d128_g4_p64_w4c1s2t",
        "decode_ksph16x8b4_vfp16_d128_g1_p64_w4c1s2t",
        "decode_ksph32x4b3_vfp16_d128_g8_p64_w4c1s2t",
        "decode_ksph16x4b6_vfp16_d64_g4_p64_w4c1s2t",
        "decode_ksph16x16b6_vfp16_d256_g4_p64_w4c1s2t",
        "decode_ksph16x8b6_vfp16__ksph16x8b4_vfp16__ksph32x4b3_vfp16_d128_g8_p64_w4c1s2t",
        "transcode_tail_to_ksph16x8b6_vfp16_d128_p64",
        "transcode_ksph16x8b6_vfp16_to_ksph32x4b3_vfp16_d128_p64",
        "combine_d128",
        "append_d128_p64",
    ] {
        assert!(n.iter().any(|x| x == want), "spherical lacks `{want}`; has:\n{}", n.join("\n"));
    }
    // Nothing serves or transcodes into the drop tier.
    assert!(!n.iter().any(|x| x.contains("drop")), "{n:?}");
    // 3 head dims x (4 combinations x 4 gqa + 6 transcodes among tail/high/mid/low + combine
    // + append), and one importance-window kernel for all of them.
    assert_eq!(n.len(), 3 * (4 * 4 + 6 + 1 + 1) + 1);
    assert!(n.contains(&"mass_window".to_string()));
}

#[test]
fn derived_names() {
    let s = spec("spherical");
    let v = variants(&s).into_iter().find(|v| v.name() == "decode_ksph16x8b6_vfp16_d128_g4_p64_w4c1s2t").unwrap();
    assert_eq!(v.symbol(), "kvf_spherical_decode_ksph16x8b6_vfp16_d128_g4_p64_w4c1s2t");
    assert_eq!(v.file(), "spherical/decode_ksph16x8b6_vfp16_d128_g4_p64_w4c1s2t.cu");
    assert_eq!(v.rust_ident(), "DecodeKsph16x8b6Vfp16D128G4P64W4c1s2t");
    assert_eq!(v.to_string(), "spherical/decode_ksph16x8b6_vfp16_d128_g4_p64_w4c1s2t");
    assert_eq!((v.kind(), v.gqa(), v.head_dim, v.page_tokens, v.dtype), ("decode", Some(4), 128, 64, "fp16"));
    match &v.family {
        Family::Decode { tiers, codes, gqa, schedule } => {
            assert_eq!(tiers, &vec![TAIL_TIER, 1]);
            assert_eq!(codes.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(), ["ksph16x8b6_vfp16"]);
            assert_eq!(*gqa, 4);
            assert_eq!(*schedule, S);
        }
        f => panic!("{f:?}"),
    }
}

#[test]
fn the_schedule_is_part_of_the_id() {
    let s = spec("rdkv");
    let v = variants(&s).into_iter().find(|v| v.name() == "decode_kint4c64f16_vint4g32f16_d128_g4_p64_w4c1s2t").unwrap();
    let other = Schedule { warps: 8, ctas_per_sm: 2, stages: 3, tc_values: false };
    let w = v.with_schedule(other);
    assert_eq!(w.name(), "decode_kint4c64f16_vint4g32f16_d128_g4_p64_w8c2s3f");
    assert_eq!(w.symbol(), "kvf_rdkv_decode_kint4c64f16_vint4g32f16_d128_g4_p64_w8c2s3f");
    assert_eq!((v.schedule(), w.schedule()), (Some(S), Some(other)));
    assert_ne!(v, w);
    assert_ne!(v.cache_key("src", "sm_90", "nvrtc"), w.cache_key("src", "sm_90", "nvrtc"));
    // Same format: only the schedule differs.
    assert_eq!(w.with_schedule(S), v);
    // Other families have none, and keep their ids.
    let c = VariantId::combine(&s, 128);
    assert_eq!((c.schedule(), c.with_schedule(other)), (None, c.clone()));
}

#[test]
fn certified_and_rdkv_names() {
    let n = names(&spec("certified"));
    assert!(n.contains(&"decode_kint8c16f32_vint4g16f16_d128_g4_p64_w4c1s2t".to_string()), "{n:?}");
    assert!(n.contains(&"decode_kfp16_vfp16__kint8c16f32_vint4g16f16_d128_g8_p64_w4c1s2t".to_string()), "{n:?}");
    assert!(n.contains(&"transcode_kfp16_vfp16_to_kint8c16f32_vint4g16f16_d256_p64".to_string()), "{n:?}");
    let n = names(&spec("rdkv"));
    assert!(n.contains(&"decode_kint2c64f16_vint2g32f16_d64_g1_p64_w4c1s2t".to_string()), "{n:?}");
    assert!(n.contains(&"decode_kfp16_vfp16__kint8c64f16_vint8g32f16__kint4c64f16_vint4g32f16__kint2c64f16_vint2g32f16_d128_g4_p64_w4c1s2t".to_string()), "{n:?}");
}

#[test]
fn bf16_and_page_size_are_in_the_name() {
    let src = std::fs::read_to_string(specs_dir().join("certified.toml")).unwrap().replace("\ndtype = \"fp16\"", "\ndtype = \"bf16\"").replace("tokens = 64", "tokens = 32");
    let s = Spec::parse(&src, "certified.toml", &specs_dir()).unwrap();
    let n = names(&s);
    assert!(n.contains(&"decode_kint8c16f32_vint4g16f16_d128_g4_p32_bf16_w4c1s2t".to_string()), "{n:?}");
    assert!(n.contains(&"transcode_tail_to_kfp16_vfp16_d64_p32_bf16".to_string()), "{n:?}");
    assert!(n.contains(&"combine_d128_bf16".to_string()), "{n:?}");
}

#[test]
fn names_symbols_idents_and_files_are_unique() {
    let mut symbols = HashSet::new();
    for name in SHIPPED {
        let s = spec(name);
        let v = variants(&s);
        let mut seen = [HashSet::new(), HashSet::new(), HashSet::new()];
        for id in &v {
            assert!(seen[0].insert(id.name()), "{name}: name {} twice", id.name());
            assert!(seen[1].insert(id.rust_ident()), "{name}: ident {} twice", id.rust_ident());
            assert!(seen[2].insert(id.file()), "{name}: file {} twice", id.file());
            // Symbols are global across specs (one process may load several).
            assert!(symbols.insert(id.symbol()), "symbol {} twice", id.symbol());
            assert!(id.symbol().chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
        }
        // The order is stable.
        assert_eq!(v, variants(&s));
    }
}

#[test]
fn cache_key_covers_source_arch_and_compiler() {
    let s = spec("certified");
    let v = &variants(&s)[0];
    let k = v.cache_key("src", "sm_90", "nvrtc 13.0");
    assert!(k.starts_with(&format!("{}-", v.symbol())));
    assert_eq!(k, v.cache_key("src", "sm_90", "nvrtc 13.0"));
    assert_ne!(k, v.cache_key("src2", "sm_90", "nvrtc 13.0"));
    assert_ne!(k, v.cache_key("src", "sm_80", "nvrtc 13.0"));
    assert_ne!(k, v.cache_key("src", "sm_90", "nvrtc 12.8"));
    // Parts are separated: moving a character between them changes the key.
    assert_ne!(v.cache_key("ab", "c", "x"), v.cache_key("a", "bc", "x"));
}

/// Tier costs and every variant name of a spec, for review.
fn listing(s: &Spec) -> String {
    let mut o = String::new();
    let p = s.page.tokens;
    writeln!(o, "spec `{}`: head_dims {:?}, gqa {:?}, dtype {}, page {} tokens, alignment {}", s.name, s.geometry.head_dims, s.geometry.gqa, s.geometry.dtype.name(), p, s.page.alignment).unwrap();
    writeln!(o, "tiers (bytes per token per head, payload / page incl. header and padding):").unwrap();
    for t in &s.tiers {
        write!(o, "  {} {:<6}", t.id, t.name).unwrap();
        for &d in &s.geometry.head_dims {
            let l = s.segment(t.id, d);
            write!(o, "  d{d}: {} {} / {}", t.code(d), t.bytes_per_token(d, p), l.page_bytes as f64 / p as f64).unwrap();
        }
        writeln!(o).unwrap();
    }
    let combos: Vec<String> = s.kernels.combinations.iter().map(|c| format!("[{}]", c.iter().map(|&t| s.tiers[t as usize].name.as_str()).collect::<Vec<_>>().join(", "))).collect();
    writeln!(o, "combinations: {}", combos.join(" ")).unwrap();
    o
}

#[test]
fn shipped_variant_lists() {
    for name in SHIPPED {
        insta::assert_snapshot!(format!("variants_{name}"), listing(&spec(name)));
    }
}
