// Rotated scalar-codebook codec (crates/kvforge-spec/src/codecs/rotated/): per token an fp16
// scale γ and one BITS-bit Lloyd–Max level index per channel of the row in the spec's rotated
// basis (docs/LAYOUT.md; the basis itself is hadamard.cuh's, applied once per decode step to
// the query and the output, never to a stored row).
#pragma once
#include "kvforge/codecs/base.cuh"
#include "kvforge/codecs/rotated_lut.cuh"

namespace kvforge {

// Lowest set bit of x > 0: the alignment a multiple of x keeps.
__host__ __device__ constexpr int rotated_lowbit(int x) { return x & -x; }

// BYTES bytes of a code stream at p, whose address is a multiple of A (a power of two), as
// little-endian u32 words (bytes past BYTES in the last word: zero).
template <int BYTES, int A>
__device__ __forceinline__ void rotated_stream(const u8* p, u32 (&w)[(BYTES + 3) / 4]) {
  constexpr int NW = (BYTES + 3) / 4;
  if constexpr (A >= 4 && BYTES % 4 == 0) {
    constexpr int V0 = A < 16 ? A : 16;
    constexpr int V = BYTES % V0 == 0 ? V0 : (BYTES % 8 == 0 && V0 >= 8 ? 8 : 4);
    if constexpr (V == 16) {
#pragma unroll
      for (int i = 0; i < NW / 4; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(p)[i];
        w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
      }
    } else if constexpr (V == 8) {
#pragma unroll
      for (int i = 0; i < NW / 2; ++i) {
        const uint2 v = reinterpret_cast<const uint2*>(p)[i];
        w[2 * i] = v.x; w[2 * i + 1] = v.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < NW; ++i) w[i] = reinterpret_cast<const u32*>(p)[i];
    }
  } else if constexpr (A >= 2 && BYTES % 2 == 0) {
    const u16* h = reinterpret_cast<const u16*>(p);
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = 2 * i + 1 < BYTES / 2 ? __byte_perm(h[2 * i], h[2 * i + 1], 0x5410) : u32(h[2 * i]);
  } else {
#pragma unroll
    for (int i = 0; i < NW; ++i) {
      u32 x = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (4 * i + b < BYTES) x |= u32(p[4 * i + b]) << (8 * b);
      w[i] = x;
    }
  }
}

// The E = 2^BITS levels of a rotated codec, ascending, as the bit patterns of their f32 values
// (kvforge-spec renders them into the codec's C++ type). A global table read through the
// read-only path: every lane looks up its own index, which L1 serves without the replays a
// divergent __constant__ read costs.
template <u32... L>
__device__ const u32 rotated_levels[sizeof...(L)] = {L...};

template <int BITS, int D, int P, u32... L>
struct RotatedRows {
  static constexpr int E = 1 << BITS;
  static_assert(BITS >= 2 && BITS <= 4 && sizeof...(L) == E, "2-4 bit codes with one level each");
  static_assert(D % 8 == 0, "rows code whole 8-channel chunks");
  static_assert(BITS != 3 || D % 32 == 0, "3-bit rows are whole groups of 4 chunks");
  static_assert(BITS != 2 || D % 16 == 0, "2-bit rows are whole words of 2 chunks");
  static constexpr int ROW = D * BITS / 8;  // code bytes of a token
  // Bits per code in `chunk`'s word: one code per nibble.
  static constexpr int SLOT = 4;
  __device__ __forceinline__ static float level(u32 i) { return __uint_as_float(__ldg(&rotated_levels<L...>[i])); }
  // The 8 codes of chunk c8 of token t, code i in nibble i (docs/LAYOUT.md): 4 bits, the
  // chunk's word; 2 bits, bits 0-1 or 2-3 of the nibbles of its pair's word; 3 bits, read from
  // its group (rotated_group3_pack).
  __device__ __forceinline__ static u32 chunk(const u8* codes, int t, int c8) {
    if constexpr (BITS == 3) {
      const u32* g = reinterpret_cast<const u32*>(codes + t * ROW + (c8 / 4) * 12);
      const int j = c8 % 4;
      const u32 l = g[j / 2];
      return j & 1 ? ((l >> 1) ^ (g[2] >> (j & 2))) & ROTATED_NIB3 : l & ROTATED_NIB3;
    } else if constexpr (BITS == 2) {
      return (reinterpret_cast<const u32*>(codes + t * ROW)[c8 / 2] >> (2 * (c8 & 1))) & ROTATED_NIB2;
    } else {
      return reinterpret_cast<const u32*>(codes + t * ROW)[c8];
    }
  }
  // A slice of NCH chunks from chunk c8 of token t (c8 a multiple of NCH) as the code stream
  // RotatedLut::adjacent / transposed read: NCH·BITS bytes, whose offset in the row is a
  // multiple of the row's and the slice's common alignment (up to 16); 3-bit slices of one or
  // two chunks and 2-bit slices of one as RotatedLut::form of their group's words.
  template <int NCH> static constexpr int SLICE_WORDS = BITS == 3 && NCH < 4 ? 2 : (NCH * BITS + 3) / 4;
  template <int NCH>
  __device__ __forceinline__ static void slice(const u8* codes, int t, int c8, u32 (&w)[SLICE_WORDS<NCH>]) {
    constexpr int BYTES = NCH * BITS;
    constexpr int A0 = rotated_lowbit(ROW) < rotated_lowbit(BYTES) ? rotated_lowbit(ROW) : rotated_lowbit(BYTES);
    constexpr int A = A0 < 16 ? A0 : 16;
    if constexpr (BITS == 2 && NCH == 1) {
      u32 f[1];
      RotatedLut<BITS, L...>::template form<1>(reinterpret_cast<const u32*>(codes + t * ROW)[c8 / 2], 0u, c8 & 1, f);
      w[0] = f[0];
    } else if constexpr (BITS == 3 && NCH < 4) {
      const int pos = (c8 % 4) / NCH;
      const u32* g = reinterpret_cast<const u32*>(codes + t * ROW + (c8 / 4) * 12);
      u32 f[2];
      RotatedLut<BITS, L...>::template form<NCH>(g[(c8 % 4) / 2], g[2], pos, f);
      w[0] = f[0];
      w[1] = f[1];
    } else {
      rotated_stream<BYTES, A>(codes + t * ROW + c8 * BITS, w);
    }
  }
  __device__ __forceinline__ static float scale(const u8* norms, int t) { return __half2float(reinterpret_cast<const __half*>(norms)[t]); }
  __device__ __forceinline__ static void load8(const u8* norms, const u8* codes, int t, int c8, float (&v)[8]) {
    const u32 w = chunk(codes, t, c8);
    const float g = scale(norms, t);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = g * level((w >> (SLOT * i)) & (E - 1));
  }
  __device__ __forceinline__ static float dequant(const u8* norms, const u8* codes, int t, int c) {
    return scale(norms, t) * level((chunk(codes, t, c / 8) >> (SLOT * (c % 8))) & (E - 1));
  }

  // Codes tokens [t0, t0 + ROWS) of a transcode slice x [ROWS][D] (rows in the rotated basis):
  // one warp per token, lane j < D/8 owning chunk j. u = x / ‖x‖; code = #{thresholds below u}
  // (τ_i = (ℓ_i + ℓ_{i+1}) / 2, u on a threshold takes the lower level); γ = ⟨x, ℓ̂⟩ / ⟨ℓ̂, ℓ̂⟩,
  // the least-squares scale of the coded direction, rounded to fp16.
  template <int NTHREADS, int ROWS>
  __device__ static void encode(u8* norms, u8* codes, const float* x, int t0) {
    static_assert(D / 8 <= 32, "one lane per 8-channel chunk");
    constexpr int NW = NTHREADS / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int tt = warp; tt < ROWS; tt += NW) {
      const float* xs = x + tt * D + lane * 8;
      const bool on = lane < D / 8;
      float xv[8], r2 = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xv[i] = on ? xs[i] : 0.f;
        r2 = fmaf(xv[i], xv[i], r2);
      }
      r2 = warp_sum(r2);
      const float inv = r2 > 0.f ? 1.f / sqrtf(r2) : 0.f;
      u32 w = 0;
      float xl = 0.f, ll = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float u = xv[i] * inv;
        u32 code = 0;
#pragma unroll
        for (int e = 0; e + 1 < E; ++e) code += u > 0.5f * (level(e) + level(e + 1)) ? 1u : 0u;
        if (r2 == 0.f) code = E / 2;
        // Lanes past the row's chunks add nothing (their zeros would still pick a level).
        const float l = on ? level(code) : 0.f;
        xl = fmaf(xv[i], l, xl);
        ll = fmaf(l, l, ll);
        w |= code << (SLOT * i);
      }
      xl = warp_sum(xl);
      ll = warp_sum(ll);
      const int t = t0 + tt;
      if constexpr (BITS == 3) {
        // Lanes 4q..4q + 3 hold group q's chunks; lane 4q + i < 4q + 3 stores its word i.
        u32 n[4], g[3];
#pragma unroll
        for (int i = 0; i < 4; ++i) n[i] = __shfl_sync(0xffffffffu, w, (lane & ~3) + i);
        rotated_group3_pack(n, g);
        const int i = lane & 3;
        if (on && i < 3) reinterpret_cast<u32*>(codes + t * ROW + (lane / 4) * 12)[i] = i == 0 ? g[0] : i == 1 ? g[1] : g[2];
      } else if constexpr (BITS == 2) {
        // Lane 2q stores the word of chunks 2q (bits 0-1 of each nibble) and 2q + 1 (bits 2-3).
        const u32 odd = __shfl_down_sync(0xffffffffu, w, 1);
        if (on && !(lane & 1)) reinterpret_cast<u32*>(codes + t * ROW)[lane / 2] = w | (odd << 2);
      } else if (on) {
        u8* b = codes + t * ROW + lane * BITS;
#pragma unroll
        for (int k = 0; k < BITS; ++k) b[k] = u8(w >> (8 * k));
      }
      if (lane == 0) reinterpret_cast<__half*>(norms)[t] = __float2half_rn(r2 > 0.f ? xl / ll : 0.f);
    }
  }
};

// Rotated keys. Per-warp layout (DecodeCta::compute_warp): the B fragments are the bare fp16
// levels ℓ[code] of the thread's channel slice (RotatedLut, registers only), and the token's
// scale γ multiplies its scores after the mma (TOKEN_SCALE, token_scale). Block layout (the
// spec's tensor-core values off): scored channel-parallel on CUDA cores (the thread's 8
// channels of q for every GQA head in registers; s_h = γ Σ_i q_hi ℓ[code_i]).
template <int BITS, int D, int P, int OFF_NORM, int OFF_CODES, u32... L>
struct RotatedKey {
  using Rows = RotatedRows<BITS, D, P, L...>;
  using Lut = RotatedLut<BITS, L...>;
  static constexpr int SLOT_CODEBOOK = -1, SLOT_RADIUS = -1, SLOT_ORDER = -1;
  // A lane's slice (D/4 channels) is whole 8-channel chunks.
  static constexpr bool WARP = D % 32 == 0;
  // Lanes past the heads read a real head's query fragments (DecodeCta::compute_warp).
  static constexpr bool WARP_SHARED_Q = true;
  static constexpr bool TOKEN_SCALE = true;
  __device__ __forceinline__ static float token_scale(const u8* seg, int t) { return Rows::scale(seg + OFF_NORM, t); }
  // Up to 3 bits the levels are int8 multiples of 2^−GRID (RotatedLut::INT8): the per-warp
  // layout scores them on integer tensor cores (mma m16n8k32 s8) against the query quantised to
  // int8 high and low parts (DecodeCta::build_qfrag), exactly, and multiplies by 2^−GRID with
  // the token's scale. Four codes per PRMT instead of one fp16 pair per two lookups.
  static constexpr bool IMMA = Lut::INT8;
  static constexpr float GRID_INV = 1.f / float(1 << Lut::GRID);
  template <int NPAIR> struct WarpKeys {
    static constexpr int NCH = NPAIR / 4;
    // Registers of a lane's slice: fp16 pairs, or int8 quads (IMMA).
    static constexpr int NB = IMMA ? NPAIR / 2 : NPAIR;
    // The int8 table's register word (IMMA; RotatedLut::adjacent_int8).
    u32 i0;
    __device__ __forceinline__ WarpKeys(const u8*, int) : i0(IMMA ? Lut::template opaque<Lut::WORD_I0>() : 0u) {}
    // The slice [qd·2·NPAIR, (qd + 1)·2·NPAIR) of token t: pair e = channels 2e, 2e + 1, or
    // (IMMA) quad 2j = channels 8j..8j + 3, quad 2j + 1 = 8j + 4..8j + 7.
    __device__ __forceinline__ void operator()(const u8* seg, int t, int qd, u32 (&b)[NB]) const {
      static_assert(NPAIR % 4 == 0 && 8 * NPAIR == D, "whole chunks per slice");
      u32 w[Rows::template SLICE_WORDS<NCH>];
      Rows::template slice<NCH>(seg + OFF_CODES, t, qd * NCH, w);
      if constexpr (IMMA) Lut::template adjacent_int8<NCH>(i0, w, b);
      else Lut::template adjacent<NCH>(w, b);
    }
  };
  static constexpr int LUT_FLOATS_PER_HEAD = 0;
  static constexpr bool MMA = false;
  template <int GQA, int NWARPS> __host__ __device__ static constexpr int bfrag_bytes() { return 0; }
  static constexpr bool SPHERICAL = false;
  // Lloyd–Max cells are unbounded at the ends: no per-token bound on ‖k − k̂‖ is stored.
  static constexpr KeyError ERROR = KeyError::Unbounded;
  static constexpr bool CHANNEL_PARALLEL = true, OUTLINE_SCORER = false;
  template <int GQA>
  struct Scorer {
    float q[GQA][8];
    int c8;
    __device__ Scorer(const float* q_s, int c8_) : c8(c8_) {
#pragma unroll
      for (int h = 0; h < GQA; ++h)
#pragma unroll
        for (int i = 0; i < 8; ++i) q[h][i] = q_s[h * D + c8 * 8 + i];
    }
    __device__ __forceinline__ void score(const u8* seg, int t, float (&s)[GQA]) {
      float k[8];
      Rows::load8(seg + OFF_NORM, seg + OFF_CODES, t, c8, k);
#pragma unroll
      for (int h = 0; h < GQA; ++h) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) a = fmaf(q[h][i], k[i], a);
        s[h] = a;
      }
    }
  };
  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c, const float*, const float*, const u16*) {
    return Rows::dequant(seg + OFF_NORM, seg + OFF_CODES, t, c);
  }
  // Transcode slices are whole tokens (one scale per token).
  static constexpr bool SLICE_CHANNELS = false;
  template <int NTHREADS, class Slice>
  __device__ static void encode(u8* seg, const float* x, int*, Slice s, const float*, const float*, const u16*) {
    static_assert(Slice::COLS == D, "rotated key slices are whole tokens");
    Rows::template encode<NTHREADS, Slice::ROWS>(seg + OFF_NORM, seg + OFF_CODES, x, s.t0);
  }
};

// Rotated values: dequantised to fp32 (CUDA-core values, load8), or, for the tensor-core value
// paths, to the bare fp16 levels of two tokens (token_pairs, pairs: RotatedLut, registers
// only), the tokens' scales γ folded into their probabilities (TOKEN_SCALE, token_scale).
template <int BITS, int D, int P, int OFF_NORM, int OFF_CODES, u32... L>
struct RotatedValue {
  using Rows = RotatedRows<BITS, D, P, L...>;
  using Lut = RotatedLut<BITS, L...>;
  static constexpr bool BF16 = false;
  // A lane's D/8 channels are whole 8-channel chunks.
  static constexpr bool WARP = D % 64 == 0;
  static constexpr bool TOKEN_SCALE = true;
  __device__ __forceinline__ static float token_scale(const u8* seg, int t) { return Rows::scale(seg + OFF_NORM, t); }
  // out[k] = (ℓ[code of token ta, channel c0 + k], ℓ[code of token tb, channel c0 + k]), c0 a
  // multiple of N.
  template <int N>
  __device__ __forceinline__ static void token_pairs(const u8* seg, int ta, int tb, int c0, u32 (&out)[N]) {
    if constexpr (N % 8 == 0) {
      constexpr int NCH = N / 8;
      u32 wa[Rows::template SLICE_WORDS<NCH>], wb[Rows::template SLICE_WORDS<NCH>];
      Rows::template slice<NCH>(seg + OFF_CODES, ta, c0 / 8, wa);
      Rows::template slice<NCH>(seg + OFF_CODES, tb, c0 / 8, wb);
      Lut::template transposed<NCH>(wa, wb, out);
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) out[k] = pack2<false>(level(seg, ta, c0 + k), level(seg, tb, c0 + k));
    }
  }
  // Up to 3 bits (Lut::INT8) the per-warp decode reads value pairs biased by Lut::VBIAS
  // (token_pairs_biased: 1.5 PRMT per pair instead of 2) and takes the bias off with one more
  // mma per octet against VBIAS_H2 (DecodeCta::compute_warp, BiasedValues).
  static constexpr bool BIASED_PAIRS = Lut::INT8;
  static constexpr u32 VBIAS_H2 = Lut::VBIAS_H2;
  // out[k] = (ℓ_a + VBIAS, ℓ_b + VBIAS) at channel c0 + k of tokens ta, tb (RotatedLut::transposed_int8).
  template <int N>
  __device__ __forceinline__ static void token_pairs_biased(const u8* seg, int ta, int tb, int c0, u32 (&out)[N]) {
    static_assert(BIASED_PAIRS && N % 8 == 0, "int8-grid levels, whole chunks");
    constexpr int NCH = N / 8;
    u32 wa[Rows::template SLICE_WORDS<NCH>], wb[Rows::template SLICE_WORDS<NCH>];
    Rows::template slice<NCH>(seg + OFF_CODES, ta, c0 / 8, wa);
    Rows::template slice<NCH>(seg + OFF_CODES, tb, c0 / 8, wb);
    Lut::template transposed_int8<NCH>(wa, wb, out);
  }
  // The level of token t, channel c (no scale).
  __device__ __forceinline__ static float level(const u8* seg, int t, int c) {
    return Rows::level((Rows::chunk(seg + OFF_CODES, t, c / 8) >> (Rows::SLOT * (c % 8))) & (Rows::E - 1));
  }
  template <int N>
  __device__ __forceinline__ static void pairs(const u8* seg, int t, int c0, u32 (&lo)[N], u32 (&hi)[N]) {
    token_pairs<N>(seg, t, t + 1, c0, lo);
    token_pairs<N>(seg, t + 2, t + 3, c0, hi);
  }
  __device__ __forceinline__ static void load8(const u8* seg, int t, int c8, float (&v)[8]) { Rows::load8(seg + OFF_NORM, seg + OFF_CODES, t, c8, v); }
  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c) { return Rows::dequant(seg + OFF_NORM, seg + OFF_CODES, t, c); }
  template <int NTHREADS, class Slice>
  __device__ static void encode(u8* seg, const float* x, Slice s) {
    static_assert(Slice::COLS == D, "value slices are whole tokens");
    Rows::template encode<NTHREADS, Slice::ROWS>(seg + OFF_NORM, seg + OFF_CODES, x, s.t0);
  }
};

}  // namespace kvforge
