//! # kvforge-gen: spec → CUDA kernels and Rust bindings
//!
//! Renders every variant of a [`kvforge_spec::Spec`] from the tera templates in `templates/`
//! into `kernels-generated/<spec>/<variant>.cu`, the Rust bindings into
//! `kernels-generated/<spec>/bindings.rs`, and the parameter structs (one field list, two
//! languages) into `kernels-generated/include/kvforge/params.cuh` and
//! `kernels-generated/params.rs`. Output is deterministic: sorted, no timestamps, no absolute
//! paths. [`check`] renders in memory and reports stale files.
//!
//! ```no_run
//! let spec = kvforge_spec::Spec::load("specs/spherical.toml".as_ref()).unwrap();
//! for f in kvforge_gen::render_spec(&spec).unwrap() {
//!     println!("{} ({} lines)", f.path, f.contents.lines().count());
//! }
//! ```

pub mod bindings;
pub mod limits;
pub mod params;
pub mod render;
pub mod schedule;
pub mod tiers;

use std::path::{Path, PathBuf};

pub mod kvtc;
pub mod paris;
pub use kvtc::{render_kvtc, KVTC_DEQUANT_THREADS, KVTC_ENTRIES, KVTC_FILE, KVTC_SYMBOL};
pub use paris::{paris_symbol, render_paris, PARIS_ENTRIES};
pub use render::{launch_shape, render, render_codecs_cuh, LaunchShape, RenderError, CERT_MAX_BLOCKS, CERT_SELECT_THREADS, CODECS_DIR, HEADERS};

use kvforge_spec::{Spec, TierId, VariantId};

/// Every kernel the generator renders for `spec` ([`Spec::variants_with`]), each decode format
/// under its default schedule ([`schedule::choose`]), in a stable order.
pub fn variants(spec: &Spec) -> Vec<VariantId> {
    spec.variants_with(&schedule::choose)
}

/// The decode kernel of one format (tiers, head dim, gqa) under its default schedule: the one
/// [`variants`] lists and the runtime launches. [`VariantId::with_schedule`] gives the same
/// format under another.
pub fn decode_variant(spec: &Spec, tiers: &[TierId], head_dim: usize, gqa: usize) -> VariantId {
    VariantId::decode(spec, tiers, head_dim, gqa, schedule::choose(spec, tiers, head_dim, gqa))
}

/// A file the generator owns, relative to `kernels-generated/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GeneratedFile {
    pub path: String,
    pub contents: String,
}

/// Every device header a kernel includes: the hand-written ones ([`HEADERS`]) and the
/// generated `kvforge/codecs.cuh` and `kvforge/params.cuh`. The runtime hands these to NVRTC.
pub fn all_headers() -> Vec<(String, String)> {
    let mut h: Vec<(String, String)> = HEADERS.iter().map(|(p, s)| (p.to_string(), s.to_string())).collect();
    h.push(("kvforge/codecs.cuh".into(), render_codecs_cuh()));
    h.push(("kvforge/params.cuh".into(), params::render_cuda()));
    h
}

/// Files shared by all specs: the generated headers (checked in so the include dir can be
/// read whole) and the Rust mirror of the params.
pub fn render_common() -> Vec<GeneratedFile> {
    vec![
        GeneratedFile { path: "include/kvforge/codecs.cuh".into(), contents: render_codecs_cuh() },
        GeneratedFile { path: "include/kvforge/params.cuh".into(), contents: params::render_cuda() },
        GeneratedFile { path: "params.rs".into(), contents: params::render_rust() },
        GeneratedFile { path: KVTC_FILE.into(), contents: render_kvtc().expect("the kvtc template renders (tested)") },
    ]
}

/// Every file of one spec: kernels and bindings.
pub fn render_spec(spec: &kvforge_spec::Spec) -> Result<Vec<GeneratedFile>, RenderError> {
    let mut out = Vec::new();
    for v in variants(spec).into_iter().chain(spec.certify_variants()) {
        out.push(GeneratedFile { path: v.file(), contents: render(spec, &v)? });
    }
    out.push(GeneratedFile { path: format!("{}/bindings.rs", spec.name), contents: bindings::render_file(spec)? });
    Ok(out)
}

/// Renders every spec plus the common files, sorted by path.
pub fn render_all(specs: &[kvforge_spec::Spec]) -> Result<Vec<GeneratedFile>, RenderError> {
    let mut files = render_common();
    for s in specs {
        files.extend(render_spec(s)?);
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(files)
}

/// What `check` found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Staleness {
    pub missing: Vec<String>,
    pub changed: Vec<String>,
    /// Files under the output dir that no spec renders any more.
    pub orphaned: Vec<String>,
}

impl Staleness {
    pub fn is_fresh(&self) -> bool {
        self.missing.is_empty() && self.changed.is_empty() && self.orphaned.is_empty()
    }
}

fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, root, out);
        } else if let Ok(rel) = p.strip_prefix(root) {
            out.push(rel.to_string_lossy().replace('\\', "/"));
        }
    }
}

/// Compares `files` with the contents of `out_dir`.
pub fn check(files: &[GeneratedFile], out_dir: &Path) -> Staleness {
    let mut s = Staleness::default();
    for f in files {
        match std::fs::read_to_string(out_dir.join(&f.path)) {
            Ok(c) if c == f.contents => {}
            Ok(_) => s.changed.push(f.path.clone()),
            Err(_) => s.missing.push(f.path.clone()),
        }
    }
    let mut present = Vec::new();
    walk(out_dir, out_dir, &mut present);
    for p in present {
        if !files.iter().any(|f| f.path == p) && p != "README.md" {
            s.orphaned.push(p);
        }
    }
    s
}

/// Writes `files` under `out_dir` (only files whose contents changed) and removes orphans.
/// Returns the number of files written.
pub fn write(files: &[GeneratedFile], out_dir: &Path) -> std::io::Result<usize> {
    let stale = check(files, out_dir);
    let mut n = 0;
    for f in files {
        if stale.missing.contains(&f.path) || stale.changed.contains(&f.path) {
            let p = out_dir.join(&f.path);
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(p, &f.contents)?;
            n += 1;
        }
    }
    for o in &stale.orphaned {
        std::fs::remove_file(out_dir.join(o))?;
    }
    Ok(n)
}
