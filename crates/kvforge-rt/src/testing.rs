//! Helpers shared by the GPU tests of this workspace (and usable by downstream tests): where
//! the repository is, and the device or a visible skip on machines without one.

use std::path::PathBuf;
use std::sync::Arc;

use crate::device::Device;

/// The repository root holding `specs/`: `KVFORGE_ROOT`, else the nearest ancestor of the
/// working directory with a `specs/` folder, else this crate's workspace.
pub fn repo_root() -> PathBuf {
    if let Ok(r) = std::env::var("KVFORGE_ROOT") {
        return r.into();
    }
    let mut d = std::env::current_dir().unwrap_or_default();
    loop {
        if d.join("specs").is_dir() {
            return d;
        }
        if !d.pop() {
            return PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        }
    }
}

/// A shipped spec by file name (`"certified.toml"`); panics with the spec error (tests only).
pub fn shipped_spec(file: &str) -> kvforge_spec::Spec {
    kvforge_spec::Spec::load(&repo_root().join("specs").join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// Device 0, or `None` after printing "skipped: no GPU (why)" so that a forced run of an
/// ignored GPU test on a CPU machine says so instead of passing silently.
pub fn device_or_skip() -> Option<Arc<Device>> {
    match Device::open(0) {
        Ok(d) => Some(Arc::new(d)),
        Err(e) => {
            println!("skipped: no GPU ({e})");
            None
        }
    }
}
