//! The `.kvtc` container: a cache compressed with one calibration, written and read as a
//! stream of checksummed chunks. Little-endian throughout.
//!
//! Header (84 bytes):
//!
//! | offset | bytes | field |
//! |---:|---:|---|
//! | 0 | 8 | magic `KVTC\0\r\n\x1a` |
//! | 8 | 2 | version (2; version 1 files, which never store a chunk raw, are read too) |
//! | 10 | 1 | entropy coder: 0 none, 1 DEFLATE, 2 zstd |
//! | 11 | 1 | reserved, 0 |
//! | 12 | 32 | calibration id (blake3, [`crate::Calibration::id`]) |
//! | 44 | 4×9 | layers, kv_heads, head_dim, tokens, sinks, window, chunk_tokens, key budget bits, value budget bits |
//! | 80 | 4 | CRC-32 of bytes 0..80 |
//!
//! Then chunks, each a 28-byte header followed by `stored_len` payload bytes:
//!
//! | offset | bytes | field |
//! |---:|---:|---|
//! | 0 | 1 | tag: 1 positions, 2 kept tokens, 3 coded keys, 4 coded values, 0xEE end |
//! | 1 | 1 | flags: bit 0 set = payload stored raw (coding it saved less than [`crate::entropy::MIN_GAIN`]) |
//! | 2 | 2 | reserved, 0 |
//! | 4 | 4 | chunk index (0, 1, 2, … in stream order) |
//! | 8 | 4 | first token |
//! | 12 | 4 | token count |
//! | 16 | 4 | raw_len: payload bytes after entropy decoding |
//! | 20 | 4 | stored_len |
//! | 24 | 4 | CRC-32 of header bytes 0..24 and the stored payload |
//!
//! Chunk order is fixed, so a reader knows what each chunk must be before reading it:
//! positions (`tokens` × i64); kept tokens (the first `sinks` and last `window`, fp16, keys
//! `[layer][head][kept][channel]` then values); then for each run of `chunk_tokens` compressed
//! tokens a keys chunk and a values chunk ([`crate::pack`] layout); then the end chunk (its
//! index is the number of chunks before it, count 0, no payload). Every payload, the kept
//! tokens included, goes through the entropy coder.

use std::io::{Read, Write};

use crate::error::{KvtcError, Result};

pub const MAGIC: [u8; 8] = *b"KVTC\0\r\n\x1a";
pub const VERSION: u16 = 2;
/// Oldest version read.
pub const OLDEST_VERSION: u16 = 1;
pub const HEADER_LEN: usize = 84;
pub const CHUNK_HEADER_LEN: usize = 28;

/// Chunk kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tag {
    Positions = 1,
    Kept = 2,
    Keys = 3,
    Values = 4,
    End = 0xEE,
}

impl Tag {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Tag::Positions,
            2 => Tag::Kept,
            3 => Tag::Keys,
            4 => Tag::Values,
            0xEE => Tag::End,
            _ => return None,
        })
    }
}

/// The container header's fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u16,
    pub entropy: u8,
    pub calibration: [u8; 32],
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub tokens: u32,
    pub sinks: u32,
    pub window: u32,
    pub chunk_tokens: u32,
    pub k_budget_bits: u32,
    pub v_budget_bits: u32,
}

impl Header {
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10] = self.entropy;
        b[12..44].copy_from_slice(&self.calibration);
        let f = [self.layers, self.kv_heads, self.head_dim, self.tokens, self.sinks, self.window, self.chunk_tokens, self.k_budget_bits, self.v_budget_bits];
        for (i, x) in f.iter().enumerate() {
            b[44 + 4 * i..48 + 4 * i].copy_from_slice(&x.to_le_bytes());
        }
        let crc = crc32fast::hash(&b[..80]);
        b[80..84].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Reads and checks the header (magic, version, checksum).
    pub fn read(r: &mut impl Read) -> Result<Self> {
        let mut b = [0u8; HEADER_LEN];
        let got = read_full(r, &mut b)?;
        if got < 8 || b[..8] != MAGIC {
            return Err(KvtcError::BadMagic { found: b[..got.min(8)].to_vec() });
        }
        if got < HEADER_LEN {
            return Err(KvtcError::Truncated { chunk: 0, what: "the container header" });
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(KvtcError::UnsupportedVersion { found: version, supported: VERSION });
        }
        if crc32fast::hash(&b[..80]) != u32::from_le_bytes(b[80..84].try_into().unwrap()) {
            return Err(KvtcError::CorruptHeader);
        }
        let u = |i: usize| u32::from_le_bytes(b[44 + 4 * i..48 + 4 * i].try_into().unwrap());
        Ok(Self {
            version,
            entropy: b[10],
            calibration: b[12..44].try_into().unwrap(),
            layers: u(0),
            kv_heads: u(1),
            head_dim: u(2),
            tokens: u(3),
            sinks: u(4),
            window: u(5),
            chunk_tokens: u(6),
            k_budget_bits: u(7),
            v_budget_bits: u(8),
        })
    }
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(n)
}

/// A chunk as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub tag: Tag,
    pub index: u32,
    pub first: u32,
    pub count: u32,
    pub raw_len: u32,
    /// The payload is the raw bytes, not the container's entropy coder's output.
    pub stored_raw: bool,
    pub payload: Vec<u8>,
}

fn chunk_header(tag: Tag, index: u32, first: u32, count: u32, raw_len: u32, stored_len: u32, stored_raw: bool) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[0] = tag as u8;
    h[1] = u8::from(stored_raw);
    for (i, x) in [index, first, count, raw_len, stored_len].iter().enumerate() {
        h[4 + 4 * i..8 + 4 * i].copy_from_slice(&x.to_le_bytes());
    }
    h
}

/// Writes one chunk.
pub fn write_chunk(w: &mut impl Write, c: &Chunk) -> Result<()> {
    let h = chunk_header(c.tag, c.index, c.first, c.count, c.raw_len, c.payload.len() as u32, c.stored_raw);
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h);
    crc.update(&c.payload);
    w.write_all(&h)?;
    w.write_all(&crc.finalize().to_le_bytes())?;
    w.write_all(&c.payload)?;
    Ok(())
}

/// What the reader expects the next chunk to be.
#[derive(Clone, Copy, Debug)]
pub struct Expect {
    pub tag: Tag,
    pub index: u32,
    pub first: u32,
    pub count: u32,
    pub raw_len: u32,
    /// Largest stored payload accepted (guards allocations against corrupt lengths).
    pub max_stored: u32,
}

/// Reads the next chunk and checks it is the expected one, intact.
pub fn read_chunk(r: &mut impl Read, e: &Expect) -> Result<Chunk> {
    let chunk = e.index;
    let mut h = [0u8; CHUNK_HEADER_LEN];
    if read_full(r, &mut h)? < CHUNK_HEADER_LEN {
        return Err(KvtcError::Truncated { chunk, what: "its header" });
    }
    let u = |i: usize| u32::from_le_bytes(h[4 + 4 * i..8 + 4 * i].try_into().unwrap());
    let (index, first, count, raw_len, stored_len) = (u(0), u(1), u(2), u(3), u(4));
    let stored_crc = u32::from_le_bytes(h[24..28].try_into().unwrap());
    let bad = |message: String| KvtcError::BadChunk { chunk, message };
    if stored_len > e.max_stored {
        // refused before allocating: a corrupt length must not make us reserve gigabytes
        return Err(bad(format!("stored length {stored_len} exceeds the largest possible {}", e.max_stored)));
    }
    let mut payload = vec![0u8; stored_len as usize];
    if read_full(r, &mut payload)? < payload.len() {
        return Err(KvtcError::Truncated { chunk, what: "its payload" });
    }
    let mut crc = crc32fast::Hasher::new();
    crc.update(&h[..24]);
    crc.update(&payload);
    let computed = crc.finalize();
    if computed != stored_crc {
        return Err(KvtcError::ChunkChecksum { chunk, stored: stored_crc, computed });
    }
    let tag = Tag::from_u8(h[0]).ok_or_else(|| bad(format!("unknown tag {:#04x}", h[0])))?;
    if h[1] > 1 || h[2..4] != [0, 0] {
        return Err(bad(format!("unknown flags {:#04x} {:#04x} {:#04x}", h[1], h[2], h[3])));
    }
    let stored_raw = h[1] == 1;
    if stored_raw && stored_len != raw_len {
        return Err(bad(format!("stored raw, yet {stored_len} stored bytes for {raw_len} raw")));
    }
    if tag != e.tag || index != e.index || first != e.first || count != e.count || raw_len != e.raw_len {
        return Err(bad(format!("is {tag:?} #{index} tokens {first}+{count} raw {raw_len}, expected {:?} #{} tokens {}+{} raw {}", e.tag, e.index, e.first, e.count, e.raw_len)));
    }
    Ok(Chunk { tag, index, first, count, raw_len, stored_raw, payload })
}
