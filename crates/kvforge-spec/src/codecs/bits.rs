//! Bit packing of integer codes and codeword indices, as the CUDA kernels read them.
//!
//! * Integer codes ([`pack_codes`]): `8 / bits` codes per byte, channel `c` in byte
//!   `c * bits / 8` at bit `bits * (c % (8 / bits))` (4-bit: even channels in the low nibble).
//!   A row is `d * bits / 8` bytes; `bits` is 8, 4 or 2.
//! * Integer *key* codes ([`pack_key_codes`]): as integer codes, but 4-bit rows keep the even
//!   channels of each 8-channel (32-bit) word in its low half and the odd ones in its high half:
//!   channel `c` at code slot [`key_code_slot`] (`8·(c / 8) + 4·(c mod 2) + (c mod 8) / 2`). Channels
//!   2e, 2e + 1 then sit at the same bit of the word's two 16-bit halves, where one LOP3 makes
//!   them an fp16 pair (`templates/include/kvforge/codecs/int.cuh`, `key_slot`). 8- and 2-bit
//!   key rows are plain.
//! * Codeword indices ([`pack_indices`]): one little-endian bit stream per token row, index `j`
//!   in bits `j * bits .. j * bits + bits - 1`, LSB first; indices may straddle bytes. A row is
//!   `ceil(G * bits / 8)` bytes, the unused high bits of the last byte are zero.

/// Bytes of a row of `n` integer codes of `bits` bits.
pub fn code_row_bytes(n: usize, bits: u32) -> usize {
    n * bits as usize / 8
}

/// Packs `codes` (each `< 2^bits`) into `row` (`code_row_bytes(codes.len(), bits)` bytes).
pub fn pack_codes(bits: u32, codes: &[u8], row: &mut [u8]) {
    assert!(matches!(bits, 2 | 4 | 8), "integer codes are 8, 4 or 2 bits, not {bits}");
    let per = 8 / bits as usize;
    assert_eq!(row.len() * per, codes.len(), "a row of {} {bits}-bit codes is {} bytes", codes.len(), codes.len() / per);
    for (byte, chunk) in row.iter_mut().zip(codes.chunks_exact(per)) {
        *byte = chunk.iter().enumerate().fold(0u8, |b, (i, &c)| {
            debug_assert!(u32::from(c) < (1 << bits));
            b | (c << (i * bits as usize))
        });
    }
}

/// Code of channel `c` in a packed row.
pub fn unpack_code(bits: u32, row: &[u8], c: usize) -> u8 {
    let per = 8 / bits as usize;
    let mask = ((1u32 << bits) - 1) as u8;
    (row[c / per] >> ((c % per) * bits as usize)) & mask
}

/// Code slot of key channel `c` in a row of `bits`-bit key codes (see the module doc).
pub fn key_code_slot(bits: u32, c: usize) -> usize {
    if bits == 4 {
        (c & !7) | ((c & 1) << 2) | ((c & 7) >> 1)
    } else {
        c
    }
}

/// Packs the key codes of one token row (`codes` per channel) in the key order: channel `c` at
/// slot [`key_code_slot`]. 4-bit rows hold whole 8-channel words.
pub fn pack_key_codes(bits: u32, codes: &[u8], row: &mut [u8]) {
    if bits != 4 {
        return pack_codes(bits, codes, row);
    }
    assert!(codes.len().is_multiple_of(8), "4-bit key rows are whole 8-channel words, not {} channels", codes.len());
    let mut slots = vec![0u8; codes.len()];
    for (c, &code) in codes.iter().enumerate() {
        slots[key_code_slot(bits, c)] = code;
    }
    pack_codes(bits, &slots, row);
}

/// Code of key channel `c` in a row packed by [`pack_key_codes`].
pub fn unpack_key_code(bits: u32, row: &[u8], c: usize) -> u8 {
    unpack_code(bits, row, key_code_slot(bits, c))
}

/// Bytes of a row of `n` indices of `bits` bits, bit-packed.
pub fn index_row_bytes(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(8)
}

/// Packs `indices` (each `< 2^bits`, `bits` in 1..=8) LSB-first into `row`
/// (`index_row_bytes(indices.len(), bits)` bytes, overwritten).
pub fn pack_indices(bits: u32, indices: &[u32], row: &mut [u8]) {
    assert!((1..=8).contains(&bits), "codeword indices are 1 to 8 bits, not {bits}");
    assert_eq!(row.len(), index_row_bytes(indices.len(), bits));
    row.fill(0);
    for (j, &idx) in indices.iter().enumerate() {
        debug_assert!(idx < (1 << bits));
        for b in 0..bits as usize {
            if (idx >> b) & 1 == 1 {
                let bit = j * bits as usize + b;
                row[bit / 8] |= 1 << (bit % 8);
            }
        }
    }
}

/// Index `j` of a packed row.
pub fn unpack_index(bits: u32, row: &[u8], j: usize) -> u32 {
    (0..bits as usize).fold(0u32, |idx, b| {
        let bit = j * bits as usize + b;
        idx | (u32::from((row[bit / 8] >> (bit % 8)) & 1) << b)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_bit_even_channel_in_low_nibble() {
        let mut row = [0u8; 2];
        pack_codes(4, &[0x1, 0x2, 0x3, 0x4], &mut row);
        assert_eq!(row, [0x21, 0x43]);
    }

    #[test]
    fn two_bit_channel_at_bits_2c() {
        let mut row = [0u8; 1];
        pack_codes(2, &[1, 2, 3, 0], &mut row);
        assert_eq!(row, [0b00_11_10_01]);
    }

    #[test]
    fn indices_straddle_bytes_lsb_first() {
        // 3 indices of 6 bits: 0b000001, 0b111111, 0b100000 -> bit stream 18 bits.
        let mut row = [0u8; 3];
        pack_indices(6, &[0b000001, 0b111111, 0b100000], &mut row);
        assert_eq!(row, [0b1100_0001, 0b0000_1111, 0b0000_0010]);
        assert_eq!(unpack_index(6, &row, 0), 1);
        assert_eq!(unpack_index(6, &row, 1), 63);
        assert_eq!(unpack_index(6, &row, 2), 32);
    }
}
