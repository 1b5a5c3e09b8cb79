//! Schedules: the default schedule of every decode variant of every shipped spec is pinned (a
//! change in the chooser's rules shows up here, with the launch facts it implies), and the
//! chooser's table and overrides are checked on small specs.

use std::fmt::Write;
use std::path::Path;

use kvforge_gen::schedule::{self, ScheduleError};
use kvforge_spec::{Family, Schedule, Spec};

fn specs_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs")
}

fn specs() -> Vec<Spec> {
    let mut files: Vec<_> = std::fs::read_dir(specs_dir()).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "toml")).collect();
    files.sort();
    files.iter().map(|f| Spec::load(f).unwrap()).collect()
}

/// Every variant of `s` with the launch facts its schedule implies.
fn listing(s: &Spec) -> String {
    let mut o = String::new();
    for v in kvforge_gen::variants(s) {
        let sh = kvforge_gen::launch_shape(s, &v);
        write!(o, "{}  threads {} smem {}", v.name(), sh.threads, sh.smem_bytes).unwrap();
        if let Family::Decode { tiers, gqa, schedule: sc, .. } = &v.family {
            let pw = schedule::per_warp(s, tiers, v.head_dim, *gqa, sc);
            write!(o, " {}", if pw { "per-warp" } else { "block" }).unwrap();
            if sh.warp_lse_per_page > 0 {
                write!(o, " warp_lse {}", sh.warp_lse_per_page).unwrap();
            }
            if s.kernels.certified {
                write!(o, " certified {} smem {}", schedule::certified(s, tiers, v.head_dim, *gqa, sc), sh.certified_smem_bytes).unwrap();
            }
        }
        if sh.ctas_per_page > 1 {
            write!(o, " split {}", sh.ctas_per_page).unwrap();
        }
        writeln!(o).unwrap();
    }
    o
}

#[test]
fn default_schedules_of_every_shipped_variant() {
    for s in specs() {
        insta::assert_snapshot!(format!("schedules_{}", s.name), listing(&s));
    }
}

#[test]
fn every_default_schedule_is_valid_and_in_its_formats_table() {
    for s in specs() {
        for v in kvforge_gen::variants(&s) {
            let Family::Decode { tiers, gqa, schedule: sc, .. } = &v.family else { continue };
            let d = v.head_dim;
            assert_eq!(*sc, schedule::choose(&s, tiers, d, *gqa), "{v}");
            assert_eq!(schedule::check(&s, tiers, d, *gqa, sc), Ok(()), "{v}");
            let alts = schedule::alternatives(&s, tiers, d, *gqa);
            assert_eq!(alts.first(), Some(sc), "{v}: the default comes first");
            for (i, a) in alts.iter().enumerate() {
                assert_eq!(schedule::check(&s, tiers, d, *gqa, a), Ok(()), "{v}: {a}");
                assert!(!alts[..i].contains(a), "{v}: {a} twice");
                // Same format, another name.
                let w = v.with_schedule(*a);
                assert_eq!(w.with_schedule(*sc), v);
                assert_eq!(w.name() == v.name(), a == sc);
            }
            if s.kernels.certified {
                let c = schedule::certified(&s, tiers, d, *gqa, sc);
                assert!(!c.tc_values && !schedule::per_warp(&s, tiers, d, *gqa, &c) && c.warps == sc.warps, "{v}: {c}");
                assert_eq!(schedule::check(&s, tiers, d, *gqa, &c), Ok(()), "{v}: certified {c}");
            }
        }
    }
}

fn parse(kernels: &str) -> Spec {
    Spec::parse(&source(kernels), "t.toml", &specs_dir()).unwrap()
}

/// A ladder of fp16 and int4 pages (int4 keys in page-wide blocks: per-warp eligible) with
/// these `[kernels]` keys.
fn source(kernels: &str) -> String {
    format!(
        r#"
[spec]
name = "t"
[geometry]
head_dims = [128]
gqa = [4]
dtype = "fp16"
[page]
tokens = 64
[[tier]]
name = "b16"
key = {{ scheme = "fp16" }}
value = {{ scheme = "fp16" }}
[[tier]]
name = "b4"
key = {{ scheme = "int", bits = 4, block = 64, scale_dtype = "fp16" }}
value = {{ scheme = "int", bits = 4, group = 32, scale_dtype = "fp16" }}
[kernels]
combinations = [["b16"], ["b4"]]
{kernels}
"#
    )
}

/// (fp16 format, int4 format) default schedules of a spec with these `[kernels]` keys.
fn chosen(kernels: &str) -> (Schedule, Schedule) {
    let s = parse(kernels);
    let b16 = s.tier("b16").unwrap().id;
    let b4 = s.tier("b4").unwrap().id;
    (schedule::choose(&s, &[0, b16], 128, 4), schedule::choose(&s, &[0, b4], 128, 4))
}

#[test]
fn the_spec_knobs_override_the_table() {
    let (dense, int) = chosen("");
    // Defaults: 4 warps, 512 threads per SM, tensor-core values, stages by the SM share.
    assert_eq!((dense.warps, dense.ctas_per_sm, dense.tc_values), (4, 4, true));
    assert_eq!((int.warps, int.ctas_per_sm, int.tc_values), (4, 4, true));
    assert!(dense.stages >= 2 && int.stages > dense.stages, "{dense} {int}: int4 pages are smaller");
    let (dense8, int8) = chosen("warps = 8\nctas_per_sm = 2");
    assert_eq!((dense8.warps, dense8.ctas_per_sm, int8.warps, int8.ctas_per_sm), (8, 2, 8, 2));
    // A stage budget: as many pages as fit in it.
    let s = parse("stage_kib = 64");
    let seg = s.segment(s.tier("b4").unwrap().id, 128).bytes;
    assert_eq!(chosen("stage_kib = 64").1.stages, (64 * 1024 / (16 + seg.div_ceil(16) * 16)).clamp(2, 16));
    // fp32 values: no per-warp layout.
    let (_, f) = chosen("tensor_core_values = false");
    assert!(!f.tc_values);
    // The dense launches' own shape.
    let (d, i) = chosen("warps = 4\nctas_per_sm = 4\ndense = { warps = 8, ctas_per_sm = 2 }");
    assert_eq!((d.warps, d.ctas_per_sm, i.warps, i.ctas_per_sm), (8, 2, 4, 4));
    // A ladder's own shape: one-tier launches at five CTAs per SM, the two-tier one at four
    // (the dense one keeps `dense`).
    let s = parse("ctas_per_sm = 5\nladder = { warps = 4, ctas_per_sm = 4 }\ndense = { warps = 8, ctas_per_sm = 2 }");
    let (b16, b4) = (s.tier("b16").unwrap().id, s.tier("b4").unwrap().id);
    let ctas = |tiers: &[u8]| schedule::decode_shape(&s, tiers).ctas_per_sm;
    assert_eq!((ctas(&[0, b4]), ctas(&[0, b16, b4]), ctas(&[0, b16])), (5, 4, 2));
    // A ladder shape the spec cannot give is an error that names it.
    let err = Spec::parse(&source("ladder = { warps = 6 }"), "t.toml", &specs_dir()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("kernels.ladder.warps"), "{err}");
}

#[test]
fn schedules_a_format_cannot_run_are_refused() {
    let s = parse("");
    let b16 = s.tier("b16").unwrap().id;
    let tiers = [0, b16];
    let ok = schedule::choose(&s, &tiers, 128, 4);
    assert_eq!(schedule::check(&s, &tiers, 128, 4, &Schedule { warps: 6, ..ok }), Err(ScheduleError::Warps { warps: 6 }));
    assert_eq!(schedule::check(&s, &tiers, 128, 4, &Schedule { ctas_per_sm: 17, ..ok }), Err(ScheduleError::Ctas { ctas: 17, threads: 128 }));
    assert_eq!(schedule::check(&s, &tiers, 128, 4, &Schedule { stages: 1, ..ok }), Err(ScheduleError::Stages { stages: 1 }));
    // 16 fp16 pages of 32 KiB do not fit in one CTA's shared memory.
    assert!(matches!(schedule::check(&s, &tiers, 128, 4, &Schedule { stages: 16, ..ok }), Err(ScheduleError::Smem { .. })));
}

#[test]
fn the_schedule_decides_the_layout_and_the_shared_memory() {
    let s = parse("");
    let b4 = s.tier("b4").unwrap().id;
    let tiers = [0, b4];
    let def = schedule::choose(&s, &tiers, 128, 4);
    assert!(schedule::per_warp(&s, &tiers, 128, 4, &def), "int4 keys with page-wide blocks take the per-warp layout");
    let fp32 = Schedule { tc_values: false, ..def };
    assert!(!schedule::per_warp(&s, &tiers, 128, 4, &fp32));
    assert_eq!(schedule::warp_lse_per_page(&s, &tiers, 128, 4, &def), 4 * 4);
    assert_eq!(schedule::warp_lse_per_page(&s, &tiers, 128, 4, &fp32), 0);
    let m = schedule::decode_smem(&s, &tiers, 128, 4, &def);
    let deeper = schedule::decode_smem(&s, &tiers, 128, 4, &Schedule { stages: def.stages + 1, ..def });
    assert_eq!(deeper.total - m.total, m.stage_bytes);
    assert!(m.q < m.lut && m.lut <= m.scores && m.scores < m.stats && m.stats < m.out && m.out < m.bfrag && m.bfrag < m.stage && m.stage < m.total);
    assert!([m.lut, m.scores, m.stats, m.out, m.bfrag, m.stage, m.stage_bytes].iter().all(|x| x % 16 == 0));
}
