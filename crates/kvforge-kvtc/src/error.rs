//! Typed errors of the codec: every decoding failure names the chunk it happened in.

use std::path::PathBuf;

/// What went wrong reading, calibrating, packing or unpacking.
#[derive(Debug, thiserror::Error)]
pub enum KvtcError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("i/o: {0}")]
    Stream(#[from] std::io::Error),
    #[error("{path}: not a valid tensor file: {message}")]
    BadTensorFile { path: PathBuf, message: String },
    #[error("{path}: not a kvtc calibration file: {message}")]
    BadCalibration { path: PathBuf, message: String },
    #[error("bad input: {0}")]
    BadInput(String),
    #[error("not a kvtc container (magic bytes {found:02x?})")]
    BadMagic { found: Vec<u8> },
    #[error("kvtc container version {found} is not supported (this build reads version {supported})")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("container header is corrupted (checksum mismatch)")]
    CorruptHeader,
    #[error("container was packed with calibration {found}, but calibration {expected} was given")]
    CalibrationMismatch { expected: String, found: String },
    #[error("calibration {calibration} has no allocation with budget {budget_bits} bits for the {side}")]
    UnknownAllocation { calibration: String, side: &'static str, budget_bits: u32 },
    #[error("stream ends inside chunk {chunk} ({what})")]
    Truncated { chunk: u32, what: &'static str },
    #[error("chunk {chunk}: checksum mismatch (stored {stored:08x}, computed {computed:08x})")]
    ChunkChecksum { chunk: u32, stored: u32, computed: u32 },
    #[error("chunk {chunk}: {message}")]
    BadChunk { chunk: u32, message: String },
    #[error("chunk {chunk}: entropy decoding failed: {message}")]
    Entropy { chunk: u32, message: String },
    #[error("linear algebra: {0}")]
    Linalg(String),
}

pub type Result<T, E = KvtcError> = std::result::Result<T, E>;
