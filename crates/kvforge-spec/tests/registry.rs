//! Every registered codec, through the registry: each example tier parses, its codecs'
//! declared arrays add up to their cost and to the segment layout, its codes and C++ types
//! are well formed, and its f64 reference decodes what it encodes.

use std::path::Path;

use kvforge_spec::codecs::{Codec, SideElem, SideInit};
use kvforge_spec::{SegmentLayout, Spec, REGISTRY};

fn spec_for(key: &str, value: &str) -> Spec {
    // A drop tier cannot be the whole ladder: keep one int8 tier before it.
    let keep = if key.contains("drop") { "[[tier]]\nname = \"keep\"\nkey = { scheme = \"int\", bits = 8, block = 64 }\nvalue = { scheme = \"int\", bits = 8, group = 64 }\n" } else { "" };
    let text = format!("[spec]\nname = \"registry\"\n[geometry]\nhead_dims = [64, 128]\ngqa = [4]\ndtype = \"fp16\"\n[page]\ntokens = 64\n{keep}[[tier]]\nname = \"t\"\nkey = {key}\nvalue = {value}\n");
    let specs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs");
    Spec::parse(&text, "registry.toml", &specs).unwrap_or_else(|e| panic!("example key = {key}, value = {value}: {e}"))
}

/// Deterministic inputs in about [-2, 2].
fn inputs(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

fn check_codec(c: &dyn Codec, d: usize, tokens: usize, seed: u64) {
    let what = format!("{} codec `{c}` at head_dim {d}", c.scheme());
    let arrays = c.arrays(d, tokens);
    let declared: usize = arrays.iter().map(|a| a.rows * a.row_bytes).sum();
    assert_eq!(declared, c.page_bytes(d, tokens), "{what}: arrays vs cost");
    let prefix = c.side().prefix();
    for a in &arrays {
        assert!(a.name.starts_with(prefix), "{what}: array `{}` is not named for its side", a.name);
    }
    assert!(c.transcode_scratch(d, tokens, 1) > 0, "{what}: transcode scratch");
    if let Some(w) = c.bit_widths() {
        let total: f64 = w.iter().map(|(_, s)| s).sum();
        assert!((total - 1.0).abs() < 1e-12 && w.iter().all(|&(b, s)| b <= 16 && s > 0.0), "{what}: bit widths {w:?}");
    }
    let code = c.code(d);
    assert!(!code.is_empty() && code.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '_'), "{what}: code `{code}`");
    let cpp = c.cpp_type(d, tokens, &|_| 0);
    assert!(cpp.chars().next().is_some_and(|ch| ch.is_ascii_uppercase()), "{what}: C++ type `{cpp}`");
    let tables = c.side_tables(d);
    for t in &tables {
        assert!(t.len > 0, "{what}: empty side table `{}`", t.name);
        if let SideInit::Spec(data) = &t.init {
            assert_eq!(data.len(), t.len, "{what}: side table `{}`", t.name);
            assert_eq!(t.elem, SideElem::F32);
        }
    }
    // The caller-set f32 table (radius scales): a scale that codes these inputs' norms.
    let aux: Vec<f32> = tables.iter().find(|t| t.init == SideInit::Required && t.elem == SideElem::F32).map_or(Vec::new(), |t| vec![0.05; t.len]);
    c.check(d, tokens, &aux).unwrap_or_else(|e| panic!("{what}: {e}"));
    let x = inputs(tokens * d, seed);
    let mut bufs: Vec<(String, Vec<u8>)> = Vec::new();
    c.encode(d, tokens, &x, &aux, &mut |name, bytes| bufs.push((name.to_string(), bytes.to_vec())));
    let names: Vec<&str> = bufs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, arrays.iter().map(|a| a.name).collect::<Vec<_>>(), "{what}: encode writes the declared arrays in order");
    for ((_, b), a) in bufs.iter().zip(&arrays) {
        assert_eq!(b.len(), a.rows * a.row_bytes, "{what}: array `{}`", a.name);
    }
    let get = |name: &str| -> &[u8] { &bufs.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{what}: no array `{name}`")).1 };
    let y = c.decode(d, tokens, &get, &aux);
    if c.is_drop() {
        assert!(y.is_empty(), "{what}: a dropped token decodes to nothing");
        return;
    }
    assert_eq!(y.len(), x.len(), "{what}");
    let err: f64 = x.iter().zip(&y).map(|(&a, &b)| (f64::from(a) - b).powi(2)).sum();
    let energy: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
    assert!(y.iter().all(|v| v.is_finite()), "{what}: non-finite decode");
    // The measured error agrees with the codec's distortion proxy (which assumes Gaussian
    // data; these inputs are uniform, so the proxy is an upper estimate up to sampling).
    let (measured, proxy) = (err / energy, c.nmse());
    assert!(measured <= 1.5 * proxy + 1e-9, "{what}: relative error {measured}, proxy {proxy}");
}

#[test]
fn every_registered_codec_is_consistent() {
    let mut seen = 0;
    for (r, reg) in REGISTRY.iter().enumerate() {
        assert!(!reg.examples.is_empty(), "registration {:?} has no example", reg.names);
        for (e, (key, value)) in reg.examples.iter().enumerate() {
            let spec = spec_for(key, value);
            let tier = spec.tier("t").unwrap();
            assert!(reg.names.contains(&tier.key.codec().scheme()) || reg.names.contains(&tier.value.codec().scheme()), "example {key} / {value} of {:?}", reg.names);
            for &d in &spec.geometry.head_dims {
                let seg = SegmentLayout::new(tier, d, spec.page.tokens, spec.page.alignment);
                assert_eq!(seg.payload_bytes, seg.arrays.iter().map(|a| a.bytes).sum::<usize>(), "tier {key} / {value} at {d}");
                let seed = (r * 100 + e * 10) as u64 + d as u64;
                check_codec(&*tier.key.codec(), d, spec.page.tokens, seed);
                check_codec(&*tier.value.codec(), d, spec.page.tokens, seed + 1);
                seen += 1;
            }
        }
    }
    assert!(seen >= REGISTRY.len());
}

#[test]
fn registry_names_are_unique_and_parse_some_side() {
    let mut names: Vec<&str> = REGISTRY.iter().flat_map(|r| r.names.iter().copied()).collect();
    assert!(REGISTRY.iter().all(|r| r.key.is_some() || r.value.is_some()));
    let n = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), n, "a scheme name is registered twice");
}
