//! Exit codes of every kvforge command, documented once (also in `kvforge --help`):
//!
//! | code | meaning |
//! |------|---------|
//! | 0 | success |
//! | 1 | failure: a check found stale kernels, a kernel did not compile, a GPU test failed, an I/O or CUDA error |
//! | 2 | bad input: a spec, a codebook, a command-line argument or a path, named in the message |
//! | 3 | no GPU: a command that needs one found none (`selftest`/`bench`: `--allow-no-gpu` exits 0) |
//!
//! Commands return [`anyhow::Error`]s; [`code_of`] maps them: [`kvforge_spec::SpecError`],
//! [`kvforge_rt::RtError::BadInput`] and [`CliError::BadInput`] to 2, [`CliError::NoGpu`],
//! `RtError::NoDriver` and `RtError::NoDevice` (`kvforge probe`) to 3, everything else to 1.
//! Argument errors that clap finds are 2 as well (clap's own code).

use std::path::Path;
use std::process::ExitCode;

pub const OK: u8 = 0;
pub const FAILURE: u8 = 1;
pub const BAD_INPUT: u8 = 2;
pub const NO_GPU: u8 = 3;

/// The table above, for `kvforge --help`.
pub const HELP: &str = "Exit codes: 0 success; 1 failure (stale kernels, a kernel that does not compile, a failed GPU test, an I/O or CUDA error); 2 bad input (a spec, codebook, argument or path, named in the message); 3 no GPU (selftest and bench: --allow-no-gpu exits 0 instead).";

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A command-line argument or input path that cannot work; the message names it.
    #[error("{0}")]
    BadInput(String),
    /// The command needs a CUDA device and there is none.
    #[error("no GPU: {0}")]
    NoGpu(String),
}

/// A [`CliError::BadInput`] as an [`anyhow::Error`].
pub fn bad_input(msg: impl Into<String>) -> anyhow::Error {
    CliError::BadInput(msg.into()).into()
}

/// Fails with a bad-input error unless `ok`.
pub fn ensure(ok: bool, msg: impl FnOnce() -> String) -> anyhow::Result<()> {
    if ok {
        Ok(())
    } else {
        Err(bad_input(msg()))
    }
}

/// Checks, before any work, that an output file can be created where `path` says: its
/// directory exists and is a directory. Names the argument and the path.
pub fn output_path(arg: &str, path: &Path) -> anyhow::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    ensure(dir.is_dir(), || format!("{arg} {}: directory {} does not exist", path.display(), dir.display()))?;
    ensure(!path.is_dir(), || format!("{arg} {}: is a directory, expected a file path", path.display()))
}

/// The exit code of a command's error.
pub fn code_of(e: &anyhow::Error) -> u8 {
    if e.downcast_ref::<kvforge_spec::SpecError>().is_some() {
        return BAD_INPUT;
    }
    match e.downcast_ref::<CliError>() {
        Some(CliError::BadInput(_)) => return BAD_INPUT,
        Some(CliError::NoGpu(_)) => return NO_GPU,
        None => {}
    }
    match e.downcast_ref::<kvforge_rt::RtError>() {
        Some(kvforge_rt::RtError::NoDriver(_) | kvforge_rt::RtError::NoDevice(_)) => NO_GPU,
        Some(e) if e.is_input_error() => BAD_INPUT,
        _ => FAILURE,
    }
}

/// `code` as an [`ExitCode`].
pub fn exit(code: u8) -> ExitCode {
    ExitCode::from(code)
}
