//! Lossless stage: DEFLATE (as the paper; `flate2`) or zstd over each chunk's packed bytes.

use std::io::{Read, Write};

/// The lossless coder of a container's chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entropy {
    /// Packed bytes stored as they are.
    None,
    /// DEFLATE (raw, no zlib header), level 6.
    Deflate,
    /// zstd, level 3.
    Zstd,
}

impl Entropy {
    pub fn id(self) -> u8 {
        match self {
            Entropy::None => 0,
            Entropy::Deflate => 1,
            Entropy::Zstd => 2,
        }
    }

    pub fn from_id(id: u8) -> Option<Self> {
        Some(match id {
            0 => Entropy::None,
            1 => Entropy::Deflate,
            2 => Entropy::Zstd,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Entropy::None => "none",
            Entropy::Deflate => "deflate",
            Entropy::Zstd => "zstd",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Entropy::None, Entropy::Deflate, Entropy::Zstd].into_iter().find(|e| e.name() == s)
    }

    pub fn compress(self, raw: &[u8]) -> Vec<u8> {
        match self {
            Entropy::None => raw.to_vec(),
            Entropy::Deflate => {
                let mut e = flate2::write::DeflateEncoder::new(Vec::with_capacity(raw.len() / 2), flate2::Compression::new(6));
                e.write_all(raw).expect("writing to a Vec");
                e.finish().expect("writing to a Vec")
            }
            Entropy::Zstd => zstd::bulk::compress(raw, 3).expect("zstd compress into a Vec"),
        }
    }

    /// Decompresses to exactly `raw_len` bytes; anything else (corrupt data, a stream that is
    /// shorter or would be longer) is an error message.
    pub fn decompress(self, stored: &[u8], raw_len: usize) -> Result<Vec<u8>, String> {
        let out = match self {
            Entropy::None => stored.to_vec(),
            Entropy::Deflate => {
                let mut out = Vec::with_capacity(raw_len);
                let mut d = flate2::read::DeflateDecoder::new(stored).take(raw_len as u64 + 1);
                d.read_to_end(&mut out).map_err(|e| e.to_string())?;
                out
            }
            Entropy::Zstd => zstd::bulk::decompress(stored, raw_len).map_err(|e| e.to_string())?,
        };
        if out.len() != raw_len {
            return Err(format!("decodes to {} bytes, the chunk header says {raw_len}", out.len()));
        }
        Ok(out)
    }
}
