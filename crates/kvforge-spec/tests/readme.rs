//! The README's examples work as written: every ```` ```toml ```` block is a valid spec, every
//! ```` ```python ```` block is valid Python, and every relative link in the README and in
//! `docs/` names a file that exists. The Rust quick start is compiled as a doctest of
//! kvforge-rt (`cargo test -p kvforge-rt --doc`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kvforge_spec::Spec;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).expect("README.md")
}

/// The fenced blocks whose info string starts with `lang`, with the 1-based line of their
/// opening fence.
fn blocks(md: &str, lang: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut open: Option<(usize, bool, String)> = None;
    for (i, line) in md.lines().enumerate() {
        let t = line.trim_start();
        match &mut open {
            None if t.starts_with("```") => {
                let info = t.trim_start_matches('`').trim();
                let first = info.split([',', ' ']).next().unwrap_or("");
                open = Some((i + 1, first == lang, String::new()));
            }
            None => {}
            Some((start, wanted, body)) => {
                if t.starts_with("```") {
                    if *wanted {
                        out.push((*start, std::mem::take(body)));
                    }
                    open = None;
                } else {
                    body.push_str(line);
                    body.push('\n');
                }
            }
        }
    }
    assert!(open.is_none(), "README.md: a code fence is not closed");
    out
}

#[test]
fn readme_spec_examples_validate() {
    let md = readme();
    let specs = blocks(&md, "toml");
    assert!(!specs.is_empty(), "README.md has no ```toml spec example");
    // Codebook paths resolve as they would for a spec saved under specs/.
    let dir = root().join("specs");
    for (line, src) in specs {
        let shown = format!("README.md (block at line {line})");
        if let Err(e) = Spec::parse(&src, &shown, &dir) {
            panic!("the README's spec example does not validate when copied verbatim:\n{e}");
        }
    }
}

#[test]
fn readme_python_examples_parse() {
    let md = readme();
    let py = blocks(&md, "python");
    assert!(!py.is_empty(), "README.md has no ```python quick start");
    for (line, src) in py {
        let mut child = Command::new("python3")
            .args(["-c", "import ast, sys; ast.parse(sys.stdin.read(), sys.argv[1])", &format!("README.md:{line}")])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("python3 runs (a prerequisite in the README)");
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), src.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "README.md:{line}: the Python block does not parse:\n{}", String::from_utf8_lossy(&out.stderr));
    }
}

/// Relative link targets of `[text](target)` and `![alt](target)` in a markdown file.
fn links(md: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(end) = after.find(')') else { break };
            let target = &after[..end];
            if !target.contains("://") && !target.starts_with('#') && !target.starts_with("mailto:") {
                out.push(target.split('#').next().unwrap().to_string());
            }
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn readme_and_docs_links_resolve() {
    let mut files: Vec<PathBuf> = vec![root().join("README.md"), root().join("benches/results/README.md")];
    let mut dirs = vec![root().join("docs")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                files.push(p);
            }
        }
    }
    let mut broken = Vec::new();
    for f in &files {
        let Ok(md) = std::fs::read_to_string(f) else { continue };
        for target in links(&md) {
            let p = f.parent().unwrap().join(&target);
            if !p.exists() {
                broken.push(format!("{}: {target}", f.strip_prefix(root()).unwrap_or(f).display()));
            }
        }
    }
    assert!(broken.is_empty(), "links to missing files:\n{}", broken.join("\n"));
}
