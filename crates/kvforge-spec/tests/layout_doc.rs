//! `docs/LAYOUT.md` documents every shipped tier's page byte by byte. This test regenerates
//! those tables from [`SegmentLayout`] and the header example from [`PageHeader`], and fails
//! when the doc does not contain them verbatim: a layout change needs a doc update.
//!
//! To refresh the doc after a deliberate layout change, run
//! `KVFORGE_PRINT_LAYOUT=1 cargo test -p kvforge-spec --test layout_doc -- --nocapture`
//! and paste the printed blocks over the old ones.

use std::fmt::Write;
use std::path::Path;

use kvforge_spec::{PageHeader, SegmentLayout, Spec, HEADER_BYTES, PAGE_MAGIC};

/// Head dim and page tokens the doc's tables are given at.
const D: usize = 128;
const P: usize = 64;

const SHIPPED: [&str; 6] = ["baseline", "certified", "rdkv", "rotated", "spherical", "trizone"];

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn doc() -> String {
    std::fs::read_to_string(root().join("docs/LAYOUT.md")).expect("docs/LAYOUT.md")
}

fn spec(name: &str) -> Spec {
    Spec::load(&root().join("specs").join(format!("{name}.toml"))).unwrap()
}

/// `270`, or `270.25` when not whole.
fn num(x: f64) -> String {
    if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// The doc block of one spec: a summary table, then one array table per tier.
fn spec_block(s: &Spec) -> String {
    let mut o = String::new();
    let seg = |id| SegmentLayout::new(&s.tiers[id as usize], D, P, s.page.alignment);
    writeln!(o, "<!-- layout:{} d={D} p={P} -->", s.name).unwrap();
    writeln!(o, "| tier | id | code | payload B | page B | B/token/head (payload) | B/token/head (page) |").unwrap();
    writeln!(o, "|:--|--:|:--|--:|--:|--:|--:|").unwrap();
    for t in &s.tiers {
        let l = seg(t.id);
        writeln!(o, "| `{}` | {} | `{}` | {} | {} | {} | {} |", t.name, t.id, t.code(D), l.payload_bytes, l.page_bytes, num(l.payload_bytes as f64 / P as f64), num(l.page_bytes as f64 / P as f64)).unwrap();
    }
    for t in &s.tiers {
        let l = seg(t.id);
        writeln!(o).unwrap();
        writeln!(o, "**`{}` / `{}`** (tier {}, `{}`)", s.name, t.name, t.id, t.code(D)).unwrap();
        writeln!(o).unwrap();
        if l.arrays.is_empty() {
            writeln!(o, "No page: its tokens are evicted, never stored nor attended (0 B/token/head).").unwrap();
            continue;
        }
        writeln!(o, "| array | segment offset | page offset | bytes | rows | row bytes |").unwrap();
        writeln!(o, "|:--|--:|--:|--:|--:|--:|").unwrap();
        for a in &l.arrays {
            writeln!(o, "| `{}` | {} | {} | {} | {} | {} |", a.name, a.offset, HEADER_BYTES + a.offset, a.bytes, a.rows, a.row_bytes).unwrap();
        }
        writeln!(o).unwrap();
        let pad = l.page_bytes - HEADER_BYTES - l.bytes;
        writeln!(
            o,
            "Segment {} B (payload {} B), page {} B = {HEADER_BYTES} header + {} segment + {pad} padding to {}; {} B/token/head payload, {} with header and padding.",
            l.bytes,
            l.payload_bytes,
            l.page_bytes,
            l.bytes,
            s.page.alignment,
            num(l.payload_bytes as f64 / P as f64),
            num(l.page_bytes as f64 / P as f64)
        )
        .unwrap();
    }
    writeln!(o, "<!-- /layout:{} -->", s.name).unwrap();
    o
}

/// The doc's worked header example.
fn header_block() -> String {
    let h = PageHeader { tier: 1, flags: 0, length: 64 };
    let b = h.to_bytes();
    let hex: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    let checksum = u32::from_le_bytes(b[12..16].try_into().unwrap());
    format!("```text\nPageHeader {{ tier: 1, flags: 0, length: 64 }}\n{}\nmagic {PAGE_MAGIC:#010x} (\"KVF4\"), checksum {checksum:#010x}\n```\n", hex.join(" "))
}

fn blocks() -> Vec<(String, String)> {
    let mut out = vec![("header example".to_string(), header_block())];
    for n in SHIPPED {
        out.push((format!("spec `{n}`"), spec_block(&spec(n))));
    }
    out
}

#[test]
fn doc_contains_generated_tables() {
    let doc = doc();
    let print = std::env::var("KVFORGE_PRINT_LAYOUT").is_ok();
    let mut missing = Vec::new();
    for (what, block) in blocks() {
        if print {
            println!("{block}");
        }
        if !doc.contains(&block) {
            missing.push(format!("--- {what}: expected in docs/LAYOUT.md verbatim:\n{block}"));
        }
    }
    assert!(missing.is_empty(), "docs/LAYOUT.md is out of date with SegmentLayout/PageHeader:\n{}", missing.join("\n"));
}

#[test]
fn doc_covers_every_shipped_spec() {
    // A new spec under specs/ needs its tables in the doc (and in SHIPPED above).
    let mut found: Vec<String> = std::fs::read_dir(root().join("specs")).unwrap().filter_map(|e| e.ok()?.path().file_stem()?.to_str().map(str::to_string)).collect();
    found.sort();
    assert_eq!(found, SHIPPED.to_vec());
    let doc = doc();
    for n in SHIPPED {
        assert_eq!(doc.matches(&format!("<!-- layout:{n} ")).count(), 1, "one table block for `{n}`");
    }
}

#[test]
fn doc_states_the_constants() {
    let doc = doc();
    assert_eq!(HEADER_BYTES, 16);
    assert!(doc.contains("| 0 | 4 | `magic` | u32 |"), "magic row");
    assert!(doc.contains("| 4 | 1 | `tier` | u8 |"));
    assert!(doc.contains("| 5 | 1 | `flags` | u8 |"));
    assert!(doc.contains("| 6 | 2 | `reserved` | u16 |"));
    assert!(doc.contains("| 8 | 4 | `length` | u32 |"));
    assert!(doc.contains("| 12 | 4 | `checksum` | u32 |"));
    assert!(doc.contains(&format!("{PAGE_MAGIC:#010x}")));
}

/// The header example in the doc decodes back to what it says.
#[test]
fn header_example_round_trips() {
    let h = PageHeader { tier: 1, flags: 0, length: 64 };
    assert_eq!(PageHeader::from_bytes(&h.to_bytes()), Ok(h));
}
