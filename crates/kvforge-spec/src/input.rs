//! Reading input files: only regular files under a size limit. A device (`/dev/urandom`,
//! `/dev/zero`, a FIFO) would never finish reading, or would read until memory runs out.

use std::io::Read;
use std::path::Path;

/// Largest spec file read (bytes): the shipped specs are a few KiB.
pub const MAX_SPEC_BYTES: u64 = 1 << 20;
/// Largest codebook file read (bytes): 2^8 entries × 256 channels of f32 is 256 KiB.
pub const MAX_CODEBOOK_BYTES: u64 = 16 << 20;

/// Reads `path` if it is a regular file of at most `limit` bytes.
pub fn read_limited(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind};
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    if meta.len() > limit {
        return Err(Error::new(ErrorKind::InvalidInput, format!("{} bytes, more than the limit of {limit}", meta.len())));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // `take`: a file that grows while it is read still stops at the limit.
    std::fs::File::open(path)?.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(Error::new(ErrorKind::InvalidInput, format!("more than the limit of {limit} bytes")));
    }
    Ok(bytes)
}

/// [`read_limited`] as UTF-8 text.
pub fn read_text(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read_limited(path, limit)?).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("not UTF-8 text ({e})")))
}
