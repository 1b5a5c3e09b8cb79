// Rotated scalar-codebook codec (crates/kvforge-spec/src/codecs/rotated/): per token an fp16
// scale γ and one BITS-bit Lloyd–Max level index per channel of the row in the spec's rotated
// basis (docs/LAYOUT.md; the basis itself is hadamard.cuh's, applied once per decode step to
// the query and the output, never to a stored row).
#pragma once
#include "kvforge/codecs/base.cuh"

namespace kvforge {

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
  static constexpr int ROW = D * BITS / 8;  // code bytes of a token
  __device__ __forceinline__ static float level(u32 i) { return __uint_as_float(__ldg(&rotated_levels<L...>[i])); }
  // The 8 codes of chunk c8 of token t: BITS bytes, little-endian, code i at bits [BITS·i, BITS·i + BITS).
  __device__ __forceinline__ static u32 chunk(const u8* codes, int t, int c8) {
    const u8* b = codes + t * ROW + c8 * BITS;
    if constexpr (BITS == 4) return *reinterpret_cast<const u32*>(b);
    else if constexpr (BITS == 2) return *reinterpret_cast<const u16*>(b);
    else return u32(b[0]) | u32(b[1]) << 8 | u32(b[2]) << 16;
  }
  __device__ __forceinline__ static float scale(const u8* norms, int t) { return __half2float(reinterpret_cast<const __half*>(norms)[t]); }
  __device__ __forceinline__ static void load8(const u8* norms, const u8* codes, int t, int c8, float (&v)[8]) {
    const u32 w = chunk(codes, t, c8);
    const float g = scale(norms, t);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = g * level((w >> (BITS * i)) & (E - 1));
  }
  __device__ __forceinline__ static float dequant(const u8* norms, const u8* codes, int t, int c) {
    return scale(norms, t) * level((chunk(codes, t, c / 8) >> (BITS * (c % 8))) & (E - 1));
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
        w |= code << (BITS * i);
      }
      xl = warp_sum(xl);
      ll = warp_sum(ll);
      const int t = t0 + tt;
      if (on) {
        u8* b = codes + t * ROW + lane * BITS;
#pragma unroll
        for (int k = 0; k < BITS; ++k) b[k] = u8(w >> (8 * k));
      }
      if (lane == 0) reinterpret_cast<__half*>(norms)[t] = __float2half_rn(r2 > 0.f ? xl / ll : 0.f);
    }
  }
};

// Rotated keys: scored channel-parallel on CUDA cores (the thread's 8 channels of q for every
// GQA head in registers; s_h = γ Σ_i q_hi ℓ[code_i]).
template <int BITS, int D, int P, int OFF_NORM, int OFF_CODES, u32... L>
struct RotatedKey {
  using Rows = RotatedRows<BITS, D, P, L...>;
  static constexpr int SLOT_CODEBOOK = -1, SLOT_RADIUS = -1, SLOT_ORDER = -1;
  static constexpr bool WARP = false;
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

// Rotated values: dequantised to fp32 (CUDA-core values, load8) or to fp16 pairs for the
// tensor-core value path of variants that also hold integer-key tiers (token_pairs).
template <int BITS, int D, int P, int OFF_NORM, int OFF_CODES, u32... L>
struct RotatedValue {
  using Rows = RotatedRows<BITS, D, P, L...>;
  static constexpr bool BF16 = false;
  static constexpr bool WARP = false;
  template <int N>
  __device__ __forceinline__ static void token_pairs(const u8* seg, int ta, int tb, int c0, u32 (&out)[N]) {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = pack2<false>(dequant(seg, ta, c0 + k), dequant(seg, tb, c0 + k));
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
