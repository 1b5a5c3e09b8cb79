//! Lists the hand-written device headers under `templates/include/` into
//! `$OUT_DIR/headers.rs` (`HEADERS`, sorted by path, each embedded with `include_str!`), so a
//! new header, a coding scheme's `codecs/<scheme>.cuh` among them, is picked up without a
//! hand-kept list. `codecs.cuh`, which includes every codec header, is rendered from the
//! same list (`kvforge_gen::render_codecs_cuh`).

use std::path::{Path, PathBuf};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../templates/include");
    // A directory is scanned recursively: a header added, removed or edited reruns this.
    println!("cargo:rerun-if-changed={}", root.display());
    let mut headers = Vec::new();
    walk(&root, &root, &mut headers);
    headers.sort();
    let mut out = String::from(
        "/// Hand-written device headers (path under the include dir, contents), sorted by path: every\n/// `.cuh` under `templates/include/`, listed by build.rs.\npub const HEADERS: &[(&str, &str)] = &[\n",
    );
    for (rel, abs) in &headers {
        out.push_str(&format!("    ({rel:?}, include_str!({:?})),\n", abs.display().to_string()));
    }
    out.push_str("];\n");
    let dst = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("headers.rs");
    std::fs::write(&dst, out).unwrap_or_else(|e| panic!("writing {}: {e}", dst.display()));
}

/// Every `.cuh` under `dir`, as (path relative to `root` with `/` separators, absolute path).
fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for e in entries {
        let path = e.unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())).path();
        if path.is_dir() {
            walk(root, &path, out);
        } else if path.extension().is_some_and(|x| x == "cuh") {
            let rel: Vec<String> = path.strip_prefix(root).expect("under root").components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
            let abs = path.canonicalize().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.push((rel.join("/"), abs));
        }
    }
}
