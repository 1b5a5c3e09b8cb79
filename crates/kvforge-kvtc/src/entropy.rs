//! Lossless stage: DEFLATE (as the paper; `flate2`) or zstd over each chunk's packed bytes, or
//! `rans`: each code range-coded against its group's model ([`crate::model`]; coded
//! allocations only).

use std::io::{Read, Write};

/// Least fraction of a chunk's bytes its entropy coding must save to be kept: below it the
/// chunk is stored raw ([`Entropy::code`]).
pub const MIN_GAIN: f64 = 0.05;

/// What `rans` says without the allocation its models come from.
const NO_ALLOCATION: &str = "entropy `rans` needs the allocation the chunk was packed with (its calibration)";

/// The lossless coder of a container's chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entropy {
    /// Packed bytes stored as they are.
    None,
    /// DEFLATE (raw, no zlib header), level 6.
    Deflate,
    /// zstd, level 3.
    Zstd,
    /// Codes range-coded against the allocation's per-group models ([`crate::model`]); the
    /// chunks without codes (positions, fp16 tokens) are zstd-coded.
    Rans,
}

impl Entropy {
    pub fn id(self) -> u8 {
        match self {
            Entropy::None => 0,
            Entropy::Deflate => 1,
            Entropy::Zstd => 2,
            Entropy::Rans => 3,
        }
    }

    pub fn from_id(id: u8) -> Option<Self> {
        Some(match id {
            0 => Entropy::None,
            1 => Entropy::Deflate,
            2 => Entropy::Zstd,
            3 => Entropy::Rans,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Entropy::None => "none",
            Entropy::Deflate => "deflate",
            Entropy::Zstd => "zstd",
            Entropy::Rans => "rans",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Entropy::None, Entropy::Deflate, Entropy::Zstd, Entropy::Rans].into_iter().find(|e| e.name() == s)
    }

    /// A chunk's payload: the coder's output, or the raw bytes (`true`) where coding saves less
    /// than [`MIN_GAIN`] of them. kvtc's packed codes are near-uniform bytes (coding saves 1–4%
    /// on real caches), and decoding them costs more host time than the GPU's restore of the
    /// same chunk: a chunk stored raw decodes at memory speed.
    pub fn code(self, raw: &[u8]) -> (Vec<u8>, bool) {
        if self == Entropy::None {
            return (raw.to_vec(), false);
        }
        Self::keep_if_gain(raw, self.compress(raw))
    }

    fn keep_if_gain(raw: &[u8], coded: Vec<u8>) -> (Vec<u8>, bool) {
        if (coded.len() as f64) > raw.len() as f64 * (1.0 - MIN_GAIN) {
            (raw.to_vec(), true)
        } else {
            (coded, false)
        }
    }

    /// [`Entropy::code`] for a chunk of codes: `raw` is `n` tokens packed with `alloc`, which
    /// `rans` needs (with models: a coded calibration); the byte coders ignore it.
    pub fn code_chunk(self, raw: &[u8], n: usize, alloc: Option<&crate::Allocation>) -> Result<(Vec<u8>, bool), String> {
        match (self, alloc) {
            (Entropy::Rans, Some(a)) => Ok(Self::keep_if_gain(raw, crate::model::encode(raw, n, a)?)),
            (Entropy::Rans, None) => Err(NO_ALLOCATION.into()),
            _ => Ok(self.code(raw)),
        }
    }

    /// [`Entropy::decompress_into`] for a chunk of codes of `n` tokens packed with `alloc`.
    pub fn decompress_chunk_into(self, stored: &[u8], n: usize, alloc: Option<&crate::Allocation>, out: &mut [u8]) -> Result<(), String> {
        match (self, alloc) {
            (Entropy::Rans, Some(a)) => crate::model::decode_into(stored, n, a, out),
            (Entropy::Rans, None) => Err(NO_ALLOCATION.into()),
            _ => self.decompress_into(stored, out),
        }
    }

    /// The byte coder of chunks without codes.
    fn bytes(self) -> Self {
        if self == Entropy::Rans {
            Entropy::Zstd
        } else {
            self
        }
    }

    pub fn compress(self, raw: &[u8]) -> Vec<u8> {
        match self.bytes() {
            Entropy::None => raw.to_vec(),
            Entropy::Deflate => {
                let mut e = flate2::write::DeflateEncoder::new(Vec::with_capacity(raw.len() / 2), flate2::Compression::new(6));
                e.write_all(raw).expect("writing to a Vec");
                e.finish().expect("writing to a Vec")
            }
            Entropy::Zstd | Entropy::Rans => zstd::bulk::compress(raw, 3).expect("zstd compress into a Vec"),
        }
    }

    /// Decompresses into `out`, which must come out exactly full: the restore's path, straight
    /// into pinned staging with no intermediate buffer. Anything else (corrupt data, a stream
    /// that is shorter or would be longer) is an error message.
    pub fn decompress_into(self, stored: &[u8], out: &mut [u8]) -> Result<(), String> {
        let n = match self.bytes() {
            Entropy::None => {
                if stored.len() != out.len() {
                    return Err(format!("stores {} bytes, the chunk header says {}", stored.len(), out.len()));
                }
                out.copy_from_slice(stored);
                stored.len()
            }
            Entropy::Deflate => {
                let mut d = flate2::read::DeflateDecoder::new(stored);
                d.read_exact(out).map_err(|e| e.to_string())?;
                // the stream must end here
                let mut extra = [0u8; 1];
                if d.read(&mut extra).map_err(|e| e.to_string())? != 0 {
                    return Err(format!("decodes to more than the {} bytes the chunk header says", out.len()));
                }
                out.len()
            }
            Entropy::Zstd | Entropy::Rans => zstd::bulk::decompress_to_buffer(stored, out).map_err(|e| e.to_string())?,
        };
        if n != out.len() {
            return Err(format!("decodes to {n} bytes, the chunk header says {}", out.len()));
        }
        Ok(())
    }

    /// Decompresses to exactly `raw_len` bytes ([`Entropy::decompress_into`] a new buffer).
    pub fn decompress(self, stored: &[u8], raw_len: usize) -> Result<Vec<u8>, String> {
        let mut out = vec![0u8; raw_len];
        self.decompress_into(stored, &mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        (0..5000u32).map(|i| (i.wrapping_mul(2654435761) >> 27) as u8 ^ (i % 7) as u8).collect()
    }

    #[test]
    fn decompress_into_matches_decompress_for_every_coder() {
        let raw = sample();
        for e in [Entropy::None, Entropy::Deflate, Entropy::Zstd] {
            let stored = e.compress(&raw);
            let mut out = vec![0u8; raw.len()];
            e.decompress_into(&stored, &mut out).unwrap();
            assert_eq!(out, raw, "{}", e.name());
            assert_eq!(e.decompress(&stored, raw.len()).unwrap(), raw, "{}", e.name());
        }
    }

    #[test]
    fn code_stores_raw_unless_coding_saves_min_gain() {
        // xorshift bytes: incompressible, stored raw by both coders
        let mut x = 0x9e3779b97f4a7c15u64;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let zeros = vec![0u8; 4096];
        for e in [Entropy::Deflate, Entropy::Zstd] {
            assert_eq!(e.code(&noise), (noise.clone(), true), "{}", e.name());
            let (coded, raw) = e.code(&zeros);
            assert!(!raw && coded.len() < 200, "{}: {} bytes", e.name(), coded.len());
        }
        assert_eq!(Entropy::None.code(&noise), (noise, false));
    }

    #[test]
    fn decompress_into_rejects_short_long_and_corrupt_streams() {
        let raw = sample();
        for e in [Entropy::None, Entropy::Deflate, Entropy::Zstd] {
            let stored = e.compress(&raw);
            // the header promises one byte more, or one byte less, than the stream holds
            assert!(e.decompress_into(&stored, &mut vec![0u8; raw.len() + 1]).is_err(), "{} long", e.name());
            assert!(e.decompress_into(&stored, &mut vec![0u8; raw.len() - 1]).is_err(), "{} short", e.name());
            // truncated
            assert!(e.decompress_into(&stored[..stored.len() / 2], &mut vec![0u8; raw.len()]).is_err(), "{} truncated", e.name());
        }
        // flipped bytes in a coded stream: an error, never a panic (the checksum catches the rest)
        for e in [Entropy::Deflate, Entropy::Zstd] {
            let mut stored = e.compress(&raw);
            for i in (0..stored.len()).step_by(7) {
                stored[i] ^= 0x5a;
            }
            let _ = e.decompress_into(&stored, &mut vec![0u8; raw.len()]);
        }
    }
}
