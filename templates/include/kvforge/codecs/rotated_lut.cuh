// Register-only level lookup of the rotated codec (codecs/rotated.cuh): BITS-bit Lloyd–Max codes
// to the fp16 levels ℓ[code] as fp16 pairs, for the tensor-core operands of the per-warp decode
// layout (keys: channels 2e, 2e + 1 of one token; values: one channel of two tokens). Pure
// integer arithmetic on u32 (PRMT, LOP3, IMAD, shifts): no memory, no scale, so that the host
// test (crates/kvforge-gen/tests/rotated_lut.rs compiles this file with a C++ compiler and an
// emulated __byte_perm) checks the very code the kernels run.
//
// A chunk's 8 codes are first brought to one code per nibble (nibble k = code of channel k):
// 4-bit chunks are that already, a 2-bit word holds two chunks at bits 0-1 and 2-3 of its
// nibbles (one shift and one mask), and 3-bit groups (4 chunks in 3 words, docs/LAYOUT.md) give
// each chunk's nibbles in one to three instructions (rotated_group3_pack).
// The table (at most 8 entries) is held as two PRMT pools of 8 bytes: the low bytes of the
// entries' fp16 bits and their high bytes. One PRMT per pool gives the low (high) bytes of 4
// channels from 4 nibble selectors; one more PRMT per pair interleaves a low and a high byte
// pair into an fp16 pair. 2- and 3-bit codes index the table of all 4 or 8 levels directly.
// 4-bit codes use the symmetry ℓ_i = −ℓ_{15−i}: the table holds the 8 positive levels ℓ_8..ℓ_15,
// the index is m = code − 8 (code ≥ 8) or 7 − code (code < 8), one XOR with 7 or 8 per nibble,
// and the sign (code < 8) is or-ed into the high bytes. A PRMT selector nibble's bit 3 switches
// PRMT to sign replication, so every selector here keeps it clear.
#pragma once

namespace kvforge {

// PTX prmt.b32: byte n of the result is byte (s >> 4n) & 7 of {b, a} (a: bytes 0-3), or with
// bit 3 of that nibble set that byte's sign replicated; bits 16-31 of s are ignored.
// (__byte_perm masks each nibble to 3 bits and s to 16 bits first, one LOP3 per register
// selector; every selector here has bit 3 clear, so the masks are dead.) On the host: the
// caller's __byte_perm, which the host test defines with prmt's semantics.
__host__ __device__ __forceinline__ u32 rotated_prmt(u32 a, u32 b, u32 s) {
#ifdef __CUDA_ARCH__
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
#else
  return __byte_perm(a, b, s);
#endif
}

// fp16 bits (round to nearest even) of the f32 with bits `f`, a normal fp16 number or zero
// (the levels: |ℓ| in [2^-14, 1)).
__host__ __device__ constexpr u32 rotated_half_bits(u32 f) {
  const u32 sign = (f >> 16) & 0x8000u;
  const u32 mag = f & 0x7fffffffu;
  if (mag == 0) return sign;
  const int e = int(mag >> 23) - 127 + 15;
  u32 m = (mag & 0x7fffffu) >> 13;
  const u32 rem = mag & 0x1fffu;
  u32 h = (u32(e) << 10) + m;
  if (rem > 0x1000u || (rem == 0x1000u && (m & 1u))) h += 1;  // a mantissa carry bumps the exponent
  return sign | h;
}

// The integer n of a level with f32 bits `f` on the grid n·2^−k (exact: the stored levels of up
// to 3 bits are such integers, kvforge-spec `LevelTable::grid_log2`; 0 if `f` is off the grid,
// which the callers' static_asserts then reject).
__host__ __device__ constexpr int rotated_grid_int(u32 f, int k) {
  const u32 mag = f & 0x7fffffffu;
  if (mag == 0) return 0;
  const long long m = (mag & 0x7fffffu) | 0x800000u;
  const int e = int(mag >> 23) - 127 - 23 + k;
  long long n = 0;
  if (e >= 0) n = e > 8 ? 0 : m << e;
  else if (e > -40 && (m & ((1ll << -e) - 1)) == 0) n = m >> -e;
  return (f >> 31) ? -int(n) : int(n);
}

// The PRMT selector bits of a 3-bit (2-bit) chunk's nibble word; bit 3 stays clear.
constexpr u32 ROTATED_NIB3 = 0x77777777u, ROTATED_NIB2 = 0x33333333u;

// PTX shr.b32 with a register amount: amounts from 32 give 0 (C++ >> would be undefined).
__host__ __device__ __forceinline__ u32 rotated_shr(u32 x, u32 s) {
#ifdef __CUDA_ARCH__
  u32 r;
  asm("shr.b32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(s));
  return r;
#else
  return s >= 32 ? 0u : x >> s;
#endif
}

// The 3 words of a 3-bit group (4 chunks of 8 codes; kvforge-spec `group3_pack` defines the
// format) from its chunks as nibble words n[j] (code k of chunk j at bits 4k..4k + 2, bit
// 4k + 3 clear). The decode reads them back as
//   n0 = w0 & 0x77777777,                   n2 = w1 & 0x77777777,
//   n1 = ((w0 >> 1) ^ w2) & 0x77777777,     n3 = ((w1 >> 1) ^ (w2 >> 2)) & 0x77777777.
__host__ __device__ __forceinline__ void rotated_group3_pack(const u32 (&n)[4], u32 (&w)[3]) {
  w[2] = ((n[1] ^ (n[0] >> 1)) & 0x33333333u) | (((n[3] ^ (n[2] >> 1)) << 2) & 0xccccccccu);
  w[0] = n[0] | (((n[1] ^ w[2]) << 1) & 0x88888888u);
  w[1] = n[2] | (((n[3] ^ (w[2] >> 2)) << 1) & 0x88888888u);
}

#ifdef __CUDA_ARCH__
// Table words of RotatedLut kept in global memory, so that a load gives them (RotatedLut::opaque).
template <u32... W>
__device__ const u32 rotated_words[sizeof...(W)] = {W...};
#endif

template <int BITS, u32... L>
struct RotatedLut {
  static constexpr int E = 1 << BITS;
  static_assert(BITS >= 2 && BITS <= 4 && sizeof...(L) == E, "2-4 bit codes with one level each");
  // 4-bit codes: sign and magnitude (the levels are symmetric, the table their positive half).
  static constexpr bool SIGNED = BITS == 4;
  static constexpr int N = SIGNED ? E / 2 : E;  // table entries
  __host__ __device__ static constexpr u32 entry(int i) {
    const u32 lv[E] = {L...};
    return i < N ? rotated_half_bits(lv[SIGNED ? E / 2 + i : i]) : 0u;
  }
  // Byte `b` (0-3) of pool word `w` (0: entries 0-3, 1: entries 4-7) of the low (HIGH false) or
  // high bytes.
  __host__ __device__ static constexpr u32 pool(bool high, int w) {
    u32 x = 0;
    for (int b = 0; b < 4; ++b) x |= ((entry(4 * w + b) >> (high ? 8 : 0)) & 0xffu) << (8 * b);
    return x;
  }
  static constexpr u32 LO0 = pool(false, 0), LO1 = pool(false, 1), HI0 = pool(true, 0), HI1 = pool(true, 1);

  // Integer keys (DecodeCta::compute_warp's IMMA scores): up to 3 bits the levels are integers
  // n_i within ±127 times 2^−GRID (kvforge-spec `LevelTable::grid_log2`; GRID from the
  // outermost level, whose n lies in [64, 127]), held as two PRMT pools of int8 bytes, so one
  // PRMT gives the int8 levels of 4 codes.
  static constexpr bool INT8 = BITS <= 3;
  __host__ __device__ static constexpr int top_exponent() {
    const u32 lv[E] = {L...};
    return int((lv[E - 1] >> 23) & 0xffu) - 127;
  }
  static constexpr int GRID = 6 - top_exponent();
  __host__ __device__ static constexpr int grid_int(int i) {
    const u32 lv[E] = {L...};
    return rotated_grid_int(lv[i], GRID);
  }
  __host__ __device__ static constexpr bool on_grid() {
    const u32 lv[E] = {L...};
    for (int i = 0; i < E; ++i) {
      const int n = grid_int(i);
      if (n < -127 || n > 127 || (n == 0) != ((lv[i] & 0x7fffffffu) == 0)) return false;
    }
    return true;
  }
  static_assert(!INT8 || on_grid(), "levels of up to 3 bits are int8 multiples of 2^-GRID (kvforge-spec grid_log2)");
  __host__ __device__ static constexpr u32 int8_pool(int w) {
    u32 x = 0;
    for (int b = 0; b < 4; ++b) x |= (4 * w + b < E ? u32(grid_int(4 * w + b)) & 0xffu : 0u) << (8 * b);
    return x;
  }
  static constexpr u32 I0 = INT8 ? int8_pool(0) : 0u, I1 = INT8 ? int8_pool(1) : 0u;
  // The int8 levels of NCH chunks of one token's code stream `w`: out[2j] = channels 8j..8j + 3
  // of the slice, out[2j + 1] = 8j + 4..8j + 7 (byte k: channel + k), the B fragment of k-step
  // j of mma m16n8k32 s8 (rows 4qd..4qd + 3 and 16 + 4qd..16 + 4qd + 3 of the lane).
  // `i0` is I0: SASS PRMT takes one table word as an immediate and the other from a register,
  // which the caller keeps in one (opaque<WORD_I0>).
  template <int NCH, int NW>
  __host__ __device__ static void adjacent_int8(u32 i0, const u32 (&w)[NW], u32 (&out)[2 * NCH]) {
    static_assert(INT8, "int8 levels up to 3 bits");
#pragma unroll
    for (int j = 0; j < NCH; ++j) {
      const u32 x = chunk_at<NCH, NW>(w, j);
      out[2 * j] = rotated_prmt(i0, I1, x);
      out[2 * j + 1] = rotated_prmt(i0, I1, x >> 16);
    }
  }
  // Integer values (the per-warp decode's fp16 PV operands; INT8): one channel of two tokens
  // as the fp16 pair (1152 + n)·2^−GRID = ℓ + VBIAS, exact (|n| ≤ 127). A PRMT of the pool of
  // biased bytes n + 128 (V0, V1) gives four of them, and one PRMT per pair sets each byte
  // beside the exponent byte VEXP (fp16 exponent 25 − GRID: (1024 + byte)·2^−GRID), so a pair
  // costs 1.5 PRMT instead of the fp16 pools' 2 (DecodeCta::compute_warp takes VBIAS off with
  // one more mma per octet, VBIAS_H2).
  static constexpr u32 V0 = I0 ^ 0x80808080u, V1 = I1 ^ 0x80808080u;
  static_assert(!INT8 || (GRID >= 1 && GRID <= 24), "the value pairs' exponent 25 − GRID is a normal fp16 exponent");
  static constexpr u32 VEXP = INT8 ? u32((25 - GRID) << 2) * 0x01010101u : 0u;
  static constexpr float VBIAS = INT8 ? 1152.f / float(1 << GRID) : 0.f;
  // −VBIAS in both halves (exact in fp16: 1152 = 9·2^7).
  static constexpr u32 VBIAS_H2 = INT8 ? (0x8000u | ((u32(25 - GRID) << 10) + 0x80u)) * 0x10001u : 0u;
  // The table words the loops keep in registers, by index into `opaque`'s array.
  enum Word : int { WORD_LO0, WORD_HI0, WORD_I0, WORD_V0, WORD_VEXP };
  // Table word W as a value ptxas cannot see through, read back from global memory (the
  // read-only path; an empty asm would leave no trace in the PTX): it then stays in one
  // register across a loop instead of being re-materialised from a uniform register before
  // every PRMT (one IMAD per lookup).
  template <Word W>
  __host__ __device__ static u32 opaque() {
#ifdef __CUDA_ARCH__
    return __ldg(&rotated_words<LO0, HI0, I0, V0, VEXP>[W]);
#else
    return W == WORD_LO0 ? LO0 : W == WORD_HI0 ? HI0 : W == WORD_I0 ? I0 : W == WORD_V0 ? V0 : VEXP;
#endif
  }

  // Four fp16 pairs from a nibble word `x` of 8 codes (its nibble k the code of item k):
  // out[0], out[1] from items 0-3 by interleave selector S01 (bytes of the low / high lookups:
  // 0-3 / 4-7), out[2], out[3] likewise from items 4-7 (S01 for out[2], S23 for out[3]).
  // Keys (items = channels 0-7): S0 = 0x5140 (items 0, 1), S1 = 0x7362 (items 2, 3). Values
  // (items a0 a1 b0 b1 of two tokens a, b): S0 = 0x6240 (a0, b0), S1 = 0x7351 (a1, b1).
  // `lo`, `hi`: LO0, HI0 (the pools' register words; PRMT takes LO1, HI1 as immediates).
  template <u32 S0, u32 S1>
  __host__ __device__ static void quad(u32 x, u32 (&out)[4], u32 lo = LO0, u32 hi = HI0) {
    u32 m = x, z0 = 0, z1 = 0;
    if constexpr (SIGNED) {
      // Index: code ^ 7 below 8 (7 − code), code ^ 8 from 8 (code − 8): per nibble x ^ (7 + s),
      // s = bit 3. Sign bits (s = 0: negative) moved to bit 7 of byte k for item k: the even
      // items' from x << 4, the odd items' where they are.
      m = x ^ (0x77777777u + ((x >> 3) & 0x11111111u));
      const u32 x4 = x << 4;
      z0 = rotated_prmt(x4, x, 0x5140);
      z1 = rotated_prmt(x4, x, 0x7362);
    }
    const u32 mh = m >> 16;
    const u32 lo0 = rotated_prmt(lo, LO1, m), hi0 = rotated_prmt(hi, HI1, m);
    const u32 lo1 = rotated_prmt(lo, LO1, mh), hi1 = rotated_prmt(hi, HI1, mh);
    u32 h0 = hi0, h1 = hi1;
    if constexpr (SIGNED) {
      h0 = hi0 | (~z0 & 0x80808080u);
      h1 = hi1 | (~z1 & 0x80808080u);
    }
    out[0] = rotated_prmt(lo0, h0, S0);
    out[1] = rotated_prmt(lo0, h0, S1);
    out[2] = rotated_prmt(lo1, h1, S0);
    out[3] = rotated_prmt(lo1, h1, S1);
  }

  // A slice of NCH chunks that is part of a 3-bit group (NCH < 4) or of a 2-bit word (NCH = 1),
  // as the words `f` the lookup reads (the loaders build them from the group words the slice
  // needs). 3 bits, NCH = 2, chunks 2p, 2p + 1 of the group: f = {w_p, w2 >> 2p}; NCH = 1,
  // chunk j: f = {w_(j/2) >> (j & 1), j odd ? w2 >> (j & 2) : 0}; `l` is the group word
  // w_(pos·NCH/2), `w2` its third word, `pos` p or j. 2 bits, chunk j of word `l`:
  // f = {l >> 2j} (`w2` unused).
  template <int NCH>
  __host__ __device__ static void form(u32 l, u32 w2, int pos, u32 (&f)[BITS == 3 ? 2 : 1]) {
    static_assert((BITS == 3 && (NCH == 1 || NCH == 2)) || (BITS == 2 && NCH == 1), "a part of a 3-bit group or 2-bit word");
    if constexpr (BITS == 2) {
      f[0] = l >> (2 * pos);
    } else if constexpr (NCH == 2) {
      f[0] = l;
      f[1] = w2 >> (2 * pos);
    } else {
      f[0] = l >> (pos & 1);
      f[1] = rotated_shr(w2, (pos & 1) ? u32(pos & 2) : 32u);
    }
  }

  // Chunk j of a code stream `w` of NCH chunks as a nibble word: 4 bits, chunk j is word j;
  // 2 bits, bits 0-1 (j even) or 2-3 (j odd) of word j / 2's nibbles, or for NCH = 1 the word
  // of `form`; 3 bits, NCH / 4 whole groups of 3 words (chunk j: group j / 4, see
  // rotated_group3_pack), or for NCH < 4 the two words of `form`.
  template <int J, int NCH, int NW>
  __host__ __device__ static u32 chunk(const u32 (&w)[NW]) {
    if constexpr (BITS == 4) {
      return w[J];
    } else if constexpr (BITS == 2) {
      if constexpr (NCH == 1) return w[0] & ROTATED_NIB2;
      else if constexpr (J % 2 == 0) return w[J / 2] & ROTATED_NIB2;
      else return (w[J / 2] >> 2) & ROTATED_NIB2;
    } else if constexpr (NCH == 1) {
      return (w[0] ^ w[1]) & ROTATED_NIB3;
    } else if constexpr (NCH == 2) {
      if constexpr (J == 0) return w[0] & ROTATED_NIB3;
      else return ((w[0] >> 1) ^ w[1]) & ROTATED_NIB3;
    } else {
      constexpr int G = 3 * (J / 4), K = J % 4;
      if constexpr (K == 0) return w[G] & ROTATED_NIB3;
      else if constexpr (K == 2) return w[G + 1] & ROTATED_NIB3;
      else if constexpr (K == 1) return ((w[G] >> 1) ^ w[G + 2]) & ROTATED_NIB3;
      else return ((w[G + 1] >> 1) ^ (w[G + 2] >> 2)) & ROTATED_NIB3;
    }
  }

  // Keys: the fp16 levels of NCH chunks (8·NCH channels) of one token's code stream `w`, pair
  // e = channels 2e, 2e + 1.
  template <int NCH, int NW>
  __host__ __device__ static void adjacent(const u32 (&w)[NW], u32 (&out)[4 * NCH]) {
#pragma unroll
    for (int j = 0; j < NCH; ++j) {
      u32 q[4];
      quad<0x5140u, 0x7362u>(chunk_at<NCH, NW>(w, j), q);
#pragma unroll
      for (int k = 0; k < 4; ++k) out[4 * j + k] = q[k];
    }
  }
  // Values: out[k] = (ℓ[a's code of channel k], ℓ[b's code of channel k]) for the 8·NCH channels
  // of two tokens' code streams `wa`, `wb`.
  template <int NCH, int NW>
  __host__ __device__ static void transposed(const u32 (&wa)[NW], const u32 (&wb)[NW], u32 (&out)[8 * NCH]) {
    // The pools' register words, loaded (ptxas cannot fold a load), so that they stay in
    // registers instead of being re-materialised before every lookup. 4-bit codes keep the
    // constants: their keys' lookup (fp16 pairs) shares them.
    const u32 lo = INT8 ? opaque<WORD_LO0>() : LO0, hi = INT8 ? opaque<WORD_HI0>() : HI0;
#pragma unroll
    for (int j = 0; j < NCH; ++j) {
      const u32 na = chunk_at<NCH, NW>(wa, j), nb = chunk_at<NCH, NW>(wb, j);
      u32 q0[4], q1[4];
      // Nibbles a0 a1 b0 b1 a2 a3 b2 b3, then a4 a5 b4 b5 a6 a7 b6 b7.
      quad<0x6240u, 0x7351u>(rotated_prmt(na, nb, 0x5140), q0, lo, hi);
      quad<0x6240u, 0x7351u>(rotated_prmt(na, nb, 0x7362), q1, lo, hi);
      out[8 * j + 0] = q0[0];
      out[8 * j + 1] = q0[1];
      out[8 * j + 2] = q0[2];
      out[8 * j + 3] = q0[3];
      out[8 * j + 4] = q1[0];
      out[8 * j + 5] = q1[1];
      out[8 * j + 6] = q1[2];
      out[8 * j + 7] = q1[3];
    }
  }
  // Values on the int8 grid (INT8): out[k] = (ℓ_a + VBIAS, ℓ_b + VBIAS) of channel k, as
  // `transposed`: per 8 codes of the two tokens two lookups, a shift and four pair PRMTs.
  template <int NCH, int NW>
  __host__ __device__ static void transposed_int8(const u32 (&wa)[NW], const u32 (&wb)[NW], u32 (&out)[8 * NCH]) {
    static_assert(INT8, "int8 levels up to 3 bits");
    // Register words, loaded once per call (see opaque).
    const u32 v0 = opaque<WORD_V0>(), ve = opaque<WORD_VEXP>();
#pragma unroll
    for (int j = 0; j < NCH; ++j) {
      const u32 na = chunk_at<NCH, NW>(wa, j), nb = chunk_at<NCH, NW>(wb, j);
      // Nibbles a0 a1 b0 b1 a2 a3 b2 b3, then a4 a5 b4 b5 a6 a7 b6 b7.
      const u32 x[2] = {rotated_prmt(na, nb, 0x5140), rotated_prmt(na, nb, 0x7362)};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Bytes a(4h) a(4h + 1) b(4h) b(4h + 1), then a(4h + 2) a(4h + 3) b(4h + 2) b(4h + 3).
        const u32 l0 = rotated_prmt(v0, V1, x[h]), l1 = rotated_prmt(v0, V1, x[h] >> 16);
        out[8 * j + 4 * h + 0] = rotated_prmt(l0, ve, 0x4240);
        out[8 * j + 4 * h + 1] = rotated_prmt(l0, ve, 0x4341);
        out[8 * j + 4 * h + 2] = rotated_prmt(l1, ve, 0x4240);
        out[8 * j + 4 * h + 3] = rotated_prmt(l1, ve, 0x4341);
      }
    }
  }
  // chunk<J> for a loop index the unroller makes constant.
  template <int NCH, int NW>
  __host__ __device__ static u32 chunk_at(const u32 (&w)[NW], int j) {
    u32 r = 0;
    at<0, NCH, NW>(w, j, r);
    return r;
  }
  template <int J, int NCH, int NW>
  __host__ __device__ static void at(const u32 (&w)[NW], int j, u32& r) {
    if constexpr (J < NCH) {
      if (j == J) r = chunk<J, NCH, NW>(w);
      at<J + 1, NCH, NW>(w, j, r);
    }
  }
};

}  // namespace kvforge
