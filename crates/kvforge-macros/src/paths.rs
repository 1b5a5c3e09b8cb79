//! Path resolution shared by both macros: relative to the invoking crate, then its ancestors.

use std::path::{Path, PathBuf};

/// `CARGO_MANIFEST_DIR` of the crate being compiled (cargo sets it for every rustc run, and a
/// proc macro runs inside rustc), else the current directory.
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from).or_else(|| std::env::current_dir().ok()).unwrap_or_default()
}

/// Resolves `rel` against `CARGO_MANIFEST_DIR`, then each of its parent directories in turn,
/// and returns the first existing file together with the directory it was found under. An
/// absolute path is taken as is. `what` names the file in the error ("spec file").
pub fn resolve(rel: &str, what: &str) -> Result<(PathBuf, PathBuf), String> {
    let p = Path::new(rel);
    if p.is_absolute() {
        return if p.is_file() { Ok((p.to_path_buf(), p.parent().map(Path::to_path_buf).unwrap_or_default())) } else { Err(format!("cannot find {what} `{rel}`")) };
    }
    let start = manifest_dir();
    for dir in start.ancestors() {
        let c = dir.join(p);
        if c.is_file() {
            return Ok((c, dir.to_path_buf()));
        }
    }
    Err(format!(
        "cannot find {what} `{rel}` in this crate's directory (CARGO_MANIFEST_DIR) or any directory above it; \
         relative paths resolve against the crate first, then its parents (e.g. the workspace root)"
    ))
}

/// The path as a string for `include_bytes!`.
pub fn lit(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}
