//! Helpers shared by the GPU tests of this workspace (and usable by downstream tests): where
//! the repository is, and the device (a test without one fails).

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

/// Device 0 for a GPU test; panics with "needs a CUDA device: <why>" where there is none, so
/// a GPU test forced to run (`-- --ignored`) on a machine without a GPU fails instead of
/// passing. GPU tests are `#[ignore = "needs a CUDA device"]`, so a plain CPU run lists them
/// as ignored.
pub fn device() -> Arc<Device> {
    match Device::open(0) {
        Ok(d) => Arc::new(d),
        Err(e) => panic!("needs a CUDA device: {e}"),
    }
}
