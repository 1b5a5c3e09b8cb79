//! `Spec::parse` never panics, whatever it is given, and every spec it accepts satisfies the
//! IR's invariants. Inputs: arbitrary bytes, soups of TOML-ish tokens, and the shipped specs
//! mutated line- and byte-wise (delete, duplicate, swap, change numbers and words, insert
//! garbage).

use std::collections::HashSet;
use std::panic::catch_unwind;
use std::path::{Path, PathBuf};

use kvforge_spec::{KeyScheme, Spec, SpecError, SpecErrorKind, ValueScheme, HEADER_BYTES, TAIL_TIER};
use proptest::prelude::*;

const SHIPPED: [(&str, &str); 4] = [
    ("baseline.toml", include_str!("../../../specs/baseline.toml")),
    ("certified.toml", include_str!("../../../specs/certified.toml")),
    ("rdkv.toml", include_str!("../../../specs/rdkv.toml")),
    ("spherical.toml", include_str!("../../../specs/spherical.toml")),
];

fn specs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs")
}

/// Parses without panicking and checks what comes back.
fn parse_checked(src: &str) -> Result<(), TestCaseError> {
    let dir = specs_dir();
    let r = catch_unwind(|| Spec::parse(src, "fuzz.toml", &dir));
    let r = match r {
        Ok(r) => r,
        Err(p) => {
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            return Err(TestCaseError::fail(format!("Spec::parse panicked: {msg:?}\ninput:\n{src}")));
        }
    };
    match r {
        Ok(spec) => invariants(&spec, src),
        Err(e) => error_invariants(&e, src),
    }
}

fn error_invariants(e: &SpecError, src: &str) -> Result<(), TestCaseError> {
    let shown = catch_unwind(|| e.to_string()).map_err(|_| TestCaseError::fail(format!("Display panicked for {e:?}")))?;
    prop_assert!(shown.starts_with("fuzz.toml:"), "{shown}");
    prop_assert!(!e.message.is_empty(), "empty message: {e:?}");
    prop_assert!(e.kind != SpecErrorKind::Io, "parse never does I/O on the spec: {e:?}");
    // A located error points inside the text (one past the last line at most).
    let lines = src.split('\n').count();
    prop_assert!(e.line >= 1 && e.line <= lines, "line {} of {lines}: {e}", e.line);
    prop_assert!(e.column >= 1, "{e}");
    Ok(())
}

fn invariants(s: &Spec, src: &str) -> Result<(), TestCaseError> {
    let ctx = || format!("\ninput:\n{src}");
    prop_assert!(s.tiers.len() >= 2, "tail + at least one tier{}", ctx());
    prop_assert_eq!(s.tiers[0].id, TAIL_TIER);
    let mut names = HashSet::new();
    for (i, t) in s.tiers.iter().enumerate() {
        prop_assert_eq!(t.id as usize, i);
        prop_assert!(names.insert(t.name.clone()), "tier name `{}` twice{}", t.name, ctx());
        prop_assert_eq!(t.key.is_drop(), matches!(t.value, ValueScheme::Drop));
    }
    prop_assert!(s.ladder().iter().any(|t| !t.is_drop()), "a live tier{}", ctx());
    prop_assert!(!s.geometry.head_dims.is_empty() && !s.geometry.gqa.is_empty());
    prop_assert!(s.page.alignment.is_power_of_two() && s.page.alignment >= 16);
    for c in &s.kernels.combinations {
        prop_assert_eq!(c.first(), Some(&TAIL_TIER));
        for &t in c {
            prop_assert!((t as usize) < s.tiers.len() && !s.tiers[t as usize].is_drop());
        }
    }
    for &d in &s.geometry.head_dims {
        let mut prev: Option<f64> = None;
        for t in s.ladder() {
            let b = t.bytes_per_token(d, s.page.tokens);
            if let Some(p) = prev {
                prop_assert!(b <= p, "ladder order at d {d}{}", ctx());
            }
            prev = Some(b);
        }
        for t in &s.tiers {
            let seg = s.segment(t.id, d);
            if t.is_drop() {
                prop_assert_eq!(seg.page_bytes, 0);
                continue;
            }
            prop_assert!(seg.page_bytes >= seg.payload_bytes + HEADER_BYTES, "tier {} d {d}: {seg:?}{}", t.name, ctx());
            prop_assert_eq!(seg.page_bytes % s.page.alignment, 0);
            prop_assert!(seg.bytes >= seg.payload_bytes && seg.bytes.is_multiple_of(16));
            let mut end = 0;
            for a in &seg.arrays {
                prop_assert!(a.offset % 16 == 0 && a.offset >= end, "{seg:?}");
                prop_assert_eq!(a.bytes, a.rows * a.row_bytes);
                end = a.offset + a.bytes;
            }
            prop_assert!(end <= seg.bytes);
            prop_assert_eq!(seg.arrays.iter().map(|a| a.bytes).sum::<usize>(), seg.payload_bytes);
            if let KeyScheme::Spherical { group, angle_bits, codebook } = &t.key {
                prop_assert_eq!(d % group, 0);
                prop_assert_eq!(codebook.entries, 1usize << angle_bits);
                prop_assert_eq!(codebook.group, *group);
            }
        }
    }
    let v = s.variants_with(&|_: &Spec, _: &[kvforge_spec::TierId], _: usize, _: usize| kvforge_spec::Schedule { warps: 4, ctas_per_sm: 1, stages: 2, tc_values: true });
    prop_assert!(!v.is_empty(), "variants{}", ctx());
    let mut seen = HashSet::new();
    for id in &v {
        prop_assert!(seen.insert(id.name()), "variant `{}` twice{}", id.name(), ctx());
        let sym = id.symbol();
        prop_assert!(sym.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "symbol `{sym}`");
    }
    Ok(())
}

// ---- mutations of shipped specs -----------------------------------------------------------

#[derive(Clone, Debug)]
enum Mutation {
    DeleteLine(usize),
    DuplicateLine(usize),
    SwapLines(usize, usize),
    /// Replace the n-th integer literal.
    ChangeNumber(usize, String),
    /// Replace the n-th quoted string's content.
    ChangeString(usize, String),
    InsertLine(usize, String),
    InsertBytes(usize, String),
    DeleteBytes(usize, usize),
    TruncateAt(usize),
}

const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "4",
    "6",
    "7",
    "8",
    "9",
    "12",
    "15",
    "16",
    "17",
    "24",
    "32",
    "48",
    "63",
    "64",
    "96",
    "128",
    "129",
    "255",
    "256",
    "257",
    "512",
    "4096",
    "65536",
    "-1",
    "-8",
    "-64",
    "9223372036854775807",
    "-9223372036854775808",
    "99999999999999999999",
    "1.5",
    "0x40",
    "1e3",
    "true",
    "\"8\"",
    "[]",
    "{}",
    "nan",
    "inf",
];

const WORDS: &[&str] = &[
    "",
    "fp16",
    "bf16",
    "fp32",
    "fp8",
    "int",
    "spherical",
    "drop",
    "tail",
    "high",
    "mid",
    "low",
    "b16",
    "b8",
    "b4",
    "b2",
    "b0",
    "fp16 ",
    "q8k4v",
    "channel",
    "token",
    "x",
    "é",
    "名",
    "a-b",
    "../codebooks/sph_g16_b6.safetensors",
    "../codebooks/sph_g16_b4.safetensors",
    "../codebooks/sph_g32_b3.safetensors",
    "../codebooks/missing.safetensors",
    "../specs/baseline.toml",
    "/",
    ".",
    "\\u0000",
    "\\n",
];

const LINES: &[&str] = &[
    "[[tier]]",
    "[tier]",
    "[spec]",
    "[geometry]",
    "[page]",
    "[kernels]",
    "name = \"extra\"",
    "name = \"drop\"",
    "key = { scheme = \"drop\" }",
    "value = { scheme = \"drop\" }",
    "key = { scheme = \"fp16\" }",
    "value = { scheme = \"fp16\" }",
    "key = { scheme = \"int\", bits = 2, block = 64 }",
    "value = { scheme = \"int\", bits = 2, group = 32 }",
    "key = { scheme = \"spherical\", group = 32, angle_bits = 3, codebook = \"../codebooks/sph_g32_b3.safetensors\" }",
    "key = { scheme = \"spherical\", group = 16, angle_bits = 8, codebook = \"../codebooks/sph_g16_b4.safetensors\" }",
    "combinations = [[\"high\", \"mid\", \"low\", \"b2\"]]",
    "combinations = []",
    "combinations = [[]]",
    "split_k = false",
    "warps = 8",
    "tokens = 16",
    "tokens = 128",
    "alignment = 16",
    "alignment = 4096",
    "head_dims = [256]",
    "gqa = [8]",
    "dtype = \"bf16\"",
    "key.scheme = \"fp16\"",
    "bogus = 1",
    "= 1",
    "[[",
    "]]",
    "{",
    "\"",
    "'''",
    "#",
    "tier = []",
    "a.b.c = 1",
];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        1 => any::<usize>().prop_map(Mutation::DeleteLine),
        1 => any::<usize>().prop_map(Mutation::DuplicateLine),
        1 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Mutation::SwapLines(a, b)),
        3 => (any::<usize>(), prop::sample::select(NUMBERS)).prop_map(|(i, n)| Mutation::ChangeNumber(i, n.to_string())),
        2 => (any::<usize>(), prop::sample::select(WORDS)).prop_map(|(i, w)| Mutation::ChangeString(i, w.to_string())),
        2 => (any::<usize>(), prop::sample::select(LINES)).prop_map(|(i, l)| Mutation::InsertLine(i, l.to_string())),
        1 => (any::<usize>(), "[ -~\n\t\u{e9}\u{540d}]{1,8}").prop_map(|(i, g)| Mutation::InsertBytes(i, g)),
        1 => (any::<usize>(), 1usize..16).prop_map(|(i, n)| Mutation::DeleteBytes(i, n)),
        1 => any::<usize>().prop_map(Mutation::TruncateAt),
    ]
}

/// Byte ranges of integer literals (digits, optionally signed) outside comments.
fn number_spans(s: &str) -> Vec<std::ops::Range<usize>> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) {
            let start = if i > 0 && b[i - 1] == b'-' { i - 1 } else { i };
            let mut j = i;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            if j == b.len() || !(b[j].is_ascii_alphabetic() || b[j] == b'_') {
                out.push(start..j);
            }
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// Byte ranges of the contents of `"..."` strings (no escapes in the shipped specs).
fn string_spans(s: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut open = None;
    for (i, c) in s.char_indices() {
        if c == '\n' {
            open = None;
        } else if c == '"' {
            match open.take() {
                None => open = Some(i + 1),
                Some(start) => out.push(start..i),
            }
        }
    }
    out
}

fn floor_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn apply(src: &str, m: &Mutation) -> String {
    let mut lines: Vec<String> = src.lines().map(str::to_string).collect();
    let n = lines.len().max(1);
    match m {
        Mutation::DeleteLine(i) => {
            if !lines.is_empty() {
                lines.remove(i % n);
            }
        }
        Mutation::DuplicateLine(i) => {
            if !lines.is_empty() {
                let l = lines[i % n].clone();
                lines.insert(i % n, l);
            }
        }
        Mutation::SwapLines(a, b) => {
            if !lines.is_empty() {
                lines.swap(a % n, b % n);
            }
        }
        Mutation::InsertLine(i, l) => lines.insert(i % (lines.len() + 1), l.clone()),
        Mutation::ChangeNumber(i, v) => {
            let spans = number_spans(src);
            if spans.is_empty() {
                return src.to_string();
            }
            let r = spans[i % spans.len()].clone();
            return format!("{}{v}{}", &src[..r.start], &src[r.end..]);
        }
        Mutation::ChangeString(i, v) => {
            let spans = string_spans(src);
            if spans.is_empty() {
                return src.to_string();
            }
            let r = spans[i % spans.len()].clone();
            return format!("{}{v}{}", &src[..r.start], &src[r.end..]);
        }
        Mutation::InsertBytes(i, g) => {
            let at = floor_boundary(src, i % (src.len() + 1));
            return format!("{}{g}{}", &src[..at], &src[at..]);
        }
        Mutation::DeleteBytes(i, len) => {
            let a = floor_boundary(src, i % (src.len() + 1));
            let b = floor_boundary(src, a + len);
            return format!("{}{}", &src[..a], &src[b..]);
        }
        Mutation::TruncateAt(i) => {
            let at = floor_boundary(src, i % (src.len() + 1));
            return src[..at].to_string();
        }
    }
    lines.join("\n") + "\n"
}

/// Spec text without its comments, so that number and string mutations hit TOML values.
fn strip_comments(s: &str) -> String {
    s.lines().filter(|l| !l.trim_start().starts_with('#')).map(|l| l.split(" #").next().unwrap_or(l)).collect::<Vec<_>>().join("\n") + "\n"
}

// ---- token soup ---------------------------------------------------------------------------

const TOKENS: &[&str] = &[
    "[spec]\n",
    "[geometry]\n",
    "[page]\n",
    "[[tier]]\n",
    "[kernels]\n",
    "name = ",
    "description = ",
    "head_dims = ",
    "gqa = ",
    "dtype = ",
    "tokens = ",
    "alignment = ",
    "key = ",
    "value = ",
    "combinations = ",
    "split_k = ",
    "warps = ",
    "{ ",
    " }",
    "scheme = ",
    "bits = ",
    "block = ",
    "group = ",
    "scale_dtype = ",
    "granularity = ",
    "angle_bits = ",
    "radius_bits = ",
    "codebook = ",
    ", ",
    "[",
    "]",
    "\n",
    "\"t\"",
    "\"fp16\"",
    "\"int\"",
    "\"drop\"",
    "\"spherical\"",
    "\"a\"",
    "\"b\"",
    "\"channel\"",
    "\"token\"",
    "\"fp32\"",
    "\"../codebooks/sph_g16_b4.safetensors\"",
    "0",
    "2",
    "4",
    "8",
    "16",
    "32",
    "64",
    "128",
    "256",
    "-1",
    "true",
    "false",
    "[128]",
    "[64, 128, 256]",
    "[1, 4, 8]",
    "=",
    ".",
];

/// A mostly well-formed spec: the prefix every valid spec needs, then a token soup.
fn soup() -> impl Strategy<Value = String> {
    (any::<bool>(), prop::collection::vec(prop::sample::select(TOKENS), 0..80)).prop_map(|(prefix, toks)| {
        let mut s = if prefix { "[spec]\nname = \"t\"\n[geometry]\nhead_dims = [128]\ngqa = [4]\n".to_string() } else { String::new() };
        for t in toks {
            s.push_str(t);
        }
        s
    })
}

/// `cases` per test, or `PROPTEST_CASES` when set (for longer runs: `PROPTEST_CASES=200000
/// cargo test --release -p kvforge-spec --test fuzz`).
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(cases);
    ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config(6000))]

    #[test]
    fn mutated_shipped_specs(which in 0..SHIPPED.len(), comments in any::<bool>(), ms in prop::collection::vec(mutation(), 1..5)) {
        let (_, text) = SHIPPED[which];
        let mut src = if comments { text.to_string() } else { strip_comments(text) };
        for m in &ms {
            src = apply(&src, m);
        }
        parse_checked(&src)?;
    }
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn token_soup(src in soup()) {
        parse_checked(&src)?;
    }

    #[test]
    fn arbitrary_strings(src in "\\PC{0,200}") {
        parse_checked(&src)?;
    }

    #[test]
    fn arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        parse_checked(&String::from_utf8_lossy(&bytes))?;
    }
}

proptest! {
    #![proptest_config(config(300))]

    /// Codebook files are read by `Spec::parse` too: corrupt ones are errors, not panics.
    #[test]
    fn corrupt_codebook_files(edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..6), cut in any::<Option<usize>>()) {
        let good = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../codebooks/sph_g16_b4.safetensors")).unwrap();
        let mut bytes = good.clone();
        for (i, b) in &edits {
            let n = bytes.len();
            bytes[i % n] = *b;
        }
        if let Some(c) = cut {
            bytes.truncate(c % (good.len() + 1));
        }
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("kvforge-spec-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("cb.safetensors");
        std::fs::write(&file, &bytes).unwrap();
        let r = catch_unwind(|| kvforge_spec::Codebook::load(&file, "cb.safetensors", 16, 16));
        prop_assert!(r.is_ok(), "Codebook::load panicked on {edits:?} cut {cut:?}");
        if bytes == good {
            prop_assert!(r.unwrap().is_ok());
        }
    }
}

#[test]
fn codebook_must_be_a_regular_file() {
    let src = SHIPPED[3].1.replace("../codebooks/sph_g16_b4.safetensors", "/dev/zero");
    let e = Spec::parse(&src, "spherical.toml", &specs_dir()).unwrap_err();
    assert_eq!(e.kind, SpecErrorKind::Codebook);
    assert!(e.message.contains("not a regular file"), "{e}");
    let src = SHIPPED[3].1.replace("../codebooks/sph_g16_b4.safetensors", ".");
    let e = Spec::parse(&src, "spherical.toml", &specs_dir()).unwrap_err();
    assert!(e.message.contains("not a regular file"), "{e}");
}

#[test]
fn shipped_specs_satisfy_invariants() {
    for (name, text) in SHIPPED {
        let src = strip_comments(text);
        parse_checked(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let spec = Spec::parse(&src, name, &specs_dir()).unwrap();
        // Comments do not change the IR (only the hash).
        let with = Spec::parse(text, name, &specs_dir()).unwrap();
        assert_eq!(spec.tiers, with.tiers, "{name}");
    }
}

#[test]
fn mutations_change_the_text() {
    let src = strip_comments(SHIPPED[3].1);
    assert!(number_spans(&src).len() > 10);
    assert!(string_spans(&src).len() > 20);
    assert_ne!(apply(&src, &Mutation::ChangeNumber(0, "7".into())), src);
    assert_ne!(apply(&src, &Mutation::ChangeString(3, "x".into())), src);
    // Every mutation yields text; none of them panics on an empty input.
    for m in [Mutation::DeleteLine(3), Mutation::DuplicateLine(1), Mutation::SwapLines(0, 5), Mutation::TruncateAt(9), Mutation::DeleteBytes(4, 3), Mutation::InsertBytes(2, "é".into())] {
        let _ = apply("", &m);
        let _ = apply(&src, &m);
    }
}
