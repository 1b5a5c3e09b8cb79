//! Byte-exact page layouts. A page holds `tokens` tokens of one (sequence, kv head) in one
//! tier: a 16-byte [`PageHeader`], then the tier's *segment*: structure-of-arrays payload,
//! each array 16-byte aligned so the decode kernel stages it with 16-byte `cp.async`.
//! The page is padded to the spec's alignment. `docs/LAYOUT.md` is checked against this code.

use crate::spec::Tier;

/// Bytes of the fixed page header.
pub const HEADER_BYTES: usize = 16;
/// `"KVF4"` read as a little-endian u32. The digit is the layout version: 4 puts the levels of
/// 2- and 3-bit rotated codes on an int8 grid (`codecs::rotated::levels::LevelTable::grid_log2`;
/// 3 had the f32 Lloyd–Max levels); 3 stores 3-bit rotated
/// codes in groups of 4 chunks (`codecs::rotated::group3_pack`) and 2-bit rotated codes two
/// chunks per word (2 had chunks of 3 and 2 bytes); 2
/// stores 4-bit integer key codes in the key order (`codecs::bits::key_code_slot`) and the zeros
/// of 4-bit integer codes and fp16-scaled 8-bit value codes biased (`codecs::int::reference::key_bias`,
/// `value_bias`); 1 had both plain.
pub const PAGE_MAGIC: u32 = u32::from_le_bytes(*b"KVF4");

/// The fixed page header: `magic u32 | tier u8 | flags u8 | reserved u16 | length u32 |
/// checksum u32`, little endian. `checksum` is FNV-1a over bytes 0..12, so a torn or stale
/// header (wrong tier, impossible length) is caught when the runtime maps the page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageHeader {
    pub tier: u8,
    pub flags: u8,
    pub length: u32,
}

impl PageHeader {
    pub fn to_bytes(self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&PAGE_MAGIC.to_le_bytes());
        b[4] = self.tier;
        b[5] = self.flags;
        b[8..12].copy_from_slice(&self.length.to_le_bytes());
        let c = fnv1a(&b[0..12]);
        b[12..16].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Parses and verifies a header; `Err` says what is wrong.
    pub fn from_bytes(b: &[u8]) -> Result<PageHeader, String> {
        if b.len() < HEADER_BYTES {
            return Err(format!("header is {} bytes, expected {HEADER_BYTES}", b.len()));
        }
        let magic = u32::from_le_bytes(b[0..4].try_into().unwrap());
        if magic != PAGE_MAGIC {
            return Err(format!("bad magic {magic:#010x}"));
        }
        let stored = u32::from_le_bytes(b[12..16].try_into().unwrap());
        let actual = fnv1a(&b[0..12]);
        if stored != actual {
            return Err(format!("checksum {stored:#010x} does not match {actual:#010x}"));
        }
        Ok(PageHeader { tier: b[4], flags: b[5], length: u32::from_le_bytes(b[8..12].try_into().unwrap()) })
    }
}

/// FNV-1a, 32 bit. The CUDA header `kvforge/page.cuh` implements the same function.
pub fn fnv1a(bytes: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for &b in bytes {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// One array inside a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArrayLayout {
    /// Name in the domain: `k`, `k_codes`, `k_scale`, `k_zero`, `k_radius`, `k_index`, `v`, ...
    pub name: &'static str,
    /// Offset from the start of the segment (the page offset adds [`HEADER_BYTES`]).
    pub offset: usize,
    pub bytes: usize,
    /// Rows × row bytes, for documentation.
    pub rows: usize,
    pub row_bytes: usize,
}

/// Layout of one tier's segment for one head dim and page size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentLayout {
    pub arrays: Vec<ArrayLayout>,
    /// Segment bytes, 16-byte aligned.
    pub bytes: usize,
    /// Bytes of the tier's payload and metadata alone (the spec's cost × tokens).
    pub payload_bytes: usize,
    /// Whole page: header + segment, padded to the spec's alignment.
    pub page_bytes: usize,
}

fn align(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl SegmentLayout {
    pub fn new(tier: &Tier, d: usize, tokens: usize, alignment: usize) -> SegmentLayout {
        let mut arrays = Vec::new();
        let mut at = 0usize;
        let mut push = |name: &'static str, rows: usize, row_bytes: usize| {
            at = align(at, 16);
            arrays.push(ArrayLayout { name, offset: at, bytes: rows * row_bytes, rows, row_bytes });
            at += rows * row_bytes;
        };
        // Keys' arrays, then values', each as its codec declares them.
        for a in tier.key.codec().arrays(d, tokens).into_iter().chain(tier.value.codec().arrays(d, tokens)) {
            push(a.name, a.rows, a.row_bytes);
        }
        let bytes = align(at, 16);
        let payload_bytes = tier.key.page_bytes(d, tokens) + tier.value.page_bytes(d, tokens);
        let page_bytes = if bytes == 0 { 0 } else { align(HEADER_BYTES + bytes, alignment) };
        SegmentLayout { arrays, bytes, payload_bytes, page_bytes }
    }

    pub fn array(&self, name: &str) -> Option<&ArrayLayout> {
        self.arrays.iter().find(|a| a.name == name)
    }

    /// Offset of `name` from the start of the segment, or 0 when the tier has no such array.
    pub fn offset(&self, name: &str) -> usize {
        self.array(name).map_or(0, |a| a.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header() -> impl Strategy<Value = PageHeader> {
        (any::<u8>(), any::<u8>(), any::<u32>()).prop_map(|(tier, flags, length)| PageHeader { tier, flags, length })
    }

    #[test]
    fn fnv1a_known_vectors() {
        // The published FNV-1a 32-bit test vectors.
        assert_eq!(fnv1a(b""), 0x811c_9dc5);
        assert_eq!(fnv1a(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a(b"foobar"), 0xbf9c_f968);
    }

    #[test]
    fn header_bytes_are_as_documented() {
        let b = PageHeader { tier: 3, flags: 0x81, length: 0x0102_0304 }.to_bytes();
        assert_eq!(&b[0..4], b"KVF4");
        assert_eq!(PAGE_MAGIC, 0x3446_564b);
        assert_eq!((b[4], b[5]), (3, 0x81));
        assert_eq!(&b[6..8], &[0, 0], "reserved is zero");
        assert_eq!(&b[8..12], &[4, 3, 2, 1], "length is little endian");
        assert_eq!(u32::from_le_bytes(b[12..16].try_into().unwrap()), fnv1a(&b[0..12]));
    }

    #[test]
    fn short_and_empty_headers_are_errors() {
        let b = PageHeader { tier: 1, flags: 0, length: 64 }.to_bytes();
        for n in 0..HEADER_BYTES {
            let e = PageHeader::from_bytes(&b[..n]).unwrap_err();
            assert!(e.contains(&format!("header is {n} bytes, expected 16")), "{e}");
        }
    }

    proptest! {
        #[test]
        fn round_trip(h in header()) {
            prop_assert_eq!(PageHeader::from_bytes(&h.to_bytes()), Ok(h));
        }

        /// A header is read from the front of a whole page: bytes after it are not its business.
        #[test]
        fn round_trip_at_the_front_of_a_page(h in header(), tail in prop::collection::vec(any::<u8>(), 0..64)) {
            let mut page = h.to_bytes().to_vec();
            page.extend(tail);
            prop_assert_eq!(PageHeader::from_bytes(&page), Ok(h));
        }

        /// Any change to any one byte (magic, tier, flags, reserved, length or checksum) is
        /// caught: FNV-1a's per-byte step is a bijection, so one changed byte always changes
        /// the hash.
        #[test]
        fn one_corrupted_byte_is_detected(h in header(), at in 0..HEADER_BYTES, mask in 1u8..=255) {
            let mut b = h.to_bytes();
            b[at] ^= mask;
            let e = PageHeader::from_bytes(&b);
            prop_assert!(e.is_err(), "byte {at} ^ {mask:#04x} not detected: {e:?}");
            let e = e.unwrap_err();
            if at < 4 {
                prop_assert!(e.contains("bad magic"), "{e}");
            } else {
                prop_assert!(e.contains("checksum"), "{e}");
            }
        }

        /// A flipped bit anywhere (the common torn-write / bit-rot case) is caught.
        #[test]
        fn one_flipped_bit_is_detected(h in header(), bit in 0..HEADER_BYTES * 8) {
            let mut b = h.to_bytes();
            b[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(PageHeader::from_bytes(&b).is_err());
        }

        /// Several corrupted bytes are caught too (an FNV collision has probability 2^-32 per
        /// case, so this holds with overwhelming probability, not by construction).
        #[test]
        fn multi_byte_corruption_is_detected(h in header(), edits in prop::collection::vec((0..12usize, 1u8..=255), 1..6)) {
            let good = h.to_bytes();
            let mut b = good;
            for (at, mask) in edits {
                b[at] ^= mask;
            }
            prop_assume!(b != good);
            prop_assert!(PageHeader::from_bytes(&b).is_err());
        }

        /// A stale checksum (another header's) does not vouch for this header.
        #[test]
        fn checksum_of_other_header_is_rejected(a in header(), b in header()) {
            prop_assume!(a != b);
            let mut x = a.to_bytes();
            x[12..16].copy_from_slice(&b.to_bytes()[12..16]);
            // Equal checksums for different headers would be an FNV collision on 12 bytes.
            if fnv1a(&a.to_bytes()[0..12]) != fnv1a(&b.to_bytes()[0..12]) {
                prop_assert!(PageHeader::from_bytes(&x).is_err());
            }
        }
    }
}
