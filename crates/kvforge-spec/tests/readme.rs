//! The README's spec examples work when copied verbatim (issue 24: its example named tiers
//! it did not define). Every ```toml block of README.md that is a whole spec (it has a
//! `[spec]` table) must validate as if it were a file under specs/.

use std::path::Path;

use kvforge_spec::Spec;

/// The ```toml blocks of `md`, with the line each starts on.
fn toml_blocks(md: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, String)> = None;
    for (i, line) in md.lines().enumerate() {
        match &mut cur {
            None if line.trim_start().starts_with("```toml") => cur = Some((i + 2, String::new())),
            Some(_) if line.trim_start().starts_with("```") => out.push(cur.take().unwrap()),
            Some((_, text)) => {
                text.push_str(line);
                text.push('\n');
            }
            None => {}
        }
    }
    out
}

#[test]
fn readme_spec_examples_validate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let md = std::fs::read_to_string(root.join("README.md")).unwrap();
    let specs: Vec<_> = toml_blocks(&md).into_iter().filter(|(_, t)| t.lines().any(|l| l.trim() == "[spec]")).collect();
    assert!(!specs.is_empty(), "README.md has a whole spec example");
    for (line, text) in specs {
        if let Err(e) = Spec::parse(&text, &format!("README.md block at line {line}"), &root.join("specs")) {
            panic!("the README's spec example at line {line} does not validate:\n{e}");
        }
    }
}
