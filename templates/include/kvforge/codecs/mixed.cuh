// Mixed per-channel key codec (crates/kvforge-spec/src/codecs/mixed/); its integer segments
// are int.cuh's ChannelCodes.
#pragma once
#include "kvforge/codecs/base.cuh"
#include "kvforge/codecs/int.cuh"

namespace kvforge {

// Per-channel mixed-bit keys (seed 002 TriZone zone A, K side): in the stored channel order
// (order[j] = natural channel of stored position j, set per tier and kv head by the
// controller; null = identity) the first N16 channels are fp16, the next N8 int8, N4 int4 and
// N2 int2 codes, each integer segment with a scale and zero per channel per block of BLOCK
// tokens (ChannelCodes); channels past the last segment are dropped and score nothing.
// Segments are whole 8-channel chunks, so a scoring lane (8 channels) sits in exactly one
// segment and runs that segment's one dequantisation path; the query slice is gathered
// through the order once per page. The order array of a kv head holds the order then its
// inverse ([2][D]): decode and encode gather through the first (a transcode slice of stored
// positions reads its natural channels), a mixed source's dequantisation through the second.
template <int BLOCK, class S, int D, int P, int N16, int N8, int N4, int N2, int O16, int O8C, int O8S, int O8Z,
          int O4C, int O4S, int O4Z, int O2C, int O2S, int O2Z>
struct MixedKey {
  // Side-table slot (kvforge-spec `MixedKey::side_tables`): [2][D] order and inverse per kv head.
  static constexpr int SLOT_CODEBOOK = -1, SLOT_RADIUS = -1, SLOT_ORDER = 0;
  static constexpr bool WARP = false;  // not on the per-warp decode path
  static constexpr int LUT_FLOATS_PER_HEAD = 0;
  static constexpr bool MMA = false;
  template <int GQA, int NWARPS> __host__ __device__ static constexpr int bfrag_bytes() { return 0; }
  static constexpr bool SPHERICAL = false;
  // Dropped channels have no stored bound on |q_c k_c|.
  static constexpr KeyError ERROR = KeyError::Unbounded;
  static constexpr bool CHANNEL_PARALLEL = true, OUTLINE_SCORER = true;
  static constexpr int E16 = N16, E8 = E16 + N8, E4 = E8 + N4, E2 = E4 + N2;  // segment ends
  // Whether 8-channel chunk c8 is stored (not in the dropped tail).
  __device__ __forceinline__ static constexpr bool chunk_stored(int c8) { return c8 * 8 < E2; }
  static_assert(N16 % 8 == 0 && N8 % 8 == 0 && N4 % 8 == 0 && N2 % 8 == 0 && E2 <= D, "whole 8-channel chunks within head_dim");
  using C8 = ChannelCodes<8, BLOCK, S, (N8 > 0 ? N8 : 8), P, O8C, O8S, O8Z>;
  using C4 = ChannelCodes<4, BLOCK, S, (N4 > 0 ? N4 : 8), P, O4C, O4S, O4Z>;
  using C2 = ChannelCodes<2, BLOCK, S, (N2 > 0 ? N2 : 8), P, O2C, O2S, O2Z>;

  // A lane keeps only the folded slice (q · scale and Σ q · zero of the current block, or the
  // plain gathered query in the fp16 segment) and re-gathers q through the order when the
  // block changes (once or twice per page): registers as IntKey's scorer, none for the order.
  template <int GQA>
  struct Scorer {
    float qs[GQA][8];
    float zq[GQA];
    const float* q_s;
    const u16* order;
    int c8, blk = -1;
    __device__ Scorer(const float* q_s_, int c8_, const u16* order_) : q_s(q_s_), order(order_), c8(c8_) {
      if (c8 * 8 < E16) {
        gather(qs);
#pragma unroll
        for (int h = 0; h < GQA; ++h) zq[h] = 0.f;
      }
    }
    __device__ __forceinline__ void gather(float (&q)[GQA][8]) const {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int nat = order ? int(order[c8 * 8 + i]) : c8 * 8 + i;
#pragma unroll
        for (int h = 0; h < GQA; ++h) q[h][i] = q_s[h * D + nat];
      }
    }
    template <class C>
    __device__ __forceinline__ void int_score(const u8* seg, int t, int c, float (&s)[GQA]) {
      const int b = t / BLOCK;
      if (b != blk) {
        gather(qs);  // fold scales qs in place
        C::template fold<GQA>(seg, b, c, qs, qs, zq);
        blk = b;
      }
      C::template score8<GQA>(seg, t, c, qs, zq, s);
    }
    __device__ __forceinline__ void score(const u8* seg, int t, float (&s)[GQA]) {
      const int c = c8 * 8;
      if (c < E16) {
        const uint4 raw = *reinterpret_cast<const uint4*>(seg + O16 + (t * N16 + c) * 2);
        const __half* e = reinterpret_cast<const __half*>(&raw);
#pragma unroll
        for (int h = 0; h < GQA; ++h) {
          float a = 0.f;
#pragma unroll
          for (int i = 0; i < 8; ++i) a = fmaf(qs[h][i], __half2float(e[i]), a);
          s[h] = a;
        }
      } else if (c < E8) {
        if constexpr (N8 > 0) int_score<C8>(seg, t, c - E16, s);
      } else if (c < E4) {
        if constexpr (N4 > 0) int_score<C4>(seg, t, c - E8, s);
      } else if (c < E2) {
        if constexpr (N2 > 0) int_score<C2>(seg, t, c - E4, s);
      }
      // Dropped chunks leave s at 0.
    }
  };

  // Stored position j's value.
  __device__ __forceinline__ static float stored(const u8* seg, int t, int j) {
    if (j < E16) return __half2float(reinterpret_cast<const __half*>(seg + O16)[t * N16 + j]);
    if (j < E8) return C8::dequant(seg, t, j - E16);
    if (j < E4) return C4::dequant(seg, t, j - E8);
    if (j < E2) return C2::dequant(seg, t, j - E4);
    return 0.f;
  }
  // Natural channel c's value (0 when dropped).
  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c, const float*, const float*, const u16* order) {
    return stored(seg, t, order ? int(order[D + c]) : c);
  }

  // Transcode slices are whole stored positions: x [P][COLS] holds stored positions
  // [c0, c0 + COLS) (natural channels order[c0..], gathered by the caller), whole 8-channel
  // chunks, so a slice meets each segment in whole chunks; scratch: 2 * NBLK * COLS floats.
  static constexpr bool SLICE_CHANNELS = true;
  template <int NTHREADS, class Slice>
  __device__ static void encode(u8* seg, const float* x, int* scratch, Slice s, const float*, const float*, const u16*) {
    static_assert(Slice::ROWS == P && Slice::COLS % 8 == 0, "mixed key slices are whole 8-channel chunks of every token");
    constexpr int W = Slice::COLS;
    if constexpr (N16 > 0) {
      const int a = s.c0, b = min(s.c0 + W, E16), n = b - a;
      __half* out = reinterpret_cast<__half*>(seg + O16);
      if (n > 0)
        for (int i = threadIdx.x; i < P * n; i += NTHREADS) {
          const int t = i / n, j = i % n;
          out[t * N16 + a + j] = __float2half_rn(x[t * W + j]);
        }
    }
    float* sc = reinterpret_cast<float*>(scratch);
    if constexpr (N8 > 0) encode_segment<C8, NTHREADS, W>(seg, x, s.c0, E16, E8, sc);
    if constexpr (N4 > 0) encode_segment<C4, NTHREADS, W>(seg, x, s.c0, E8, E4, sc);
    if constexpr (N2 > 0) encode_segment<C2, NTHREADS, W>(seg, x, s.c0, E4, E2, sc);
  }
  // Codes the stored positions of segment [lo, hi) (codec C) among the slice's [j0, j0 + W).
  template <class C, int NTHREADS, int W>
  __device__ static void encode_segment(u8* seg, const float* x, int j0, int lo, int hi, float* scratch) {
    const int a = max(j0, lo), b = min(j0 + W, hi);
    if (a < b) C::template encode<NTHREADS, lanes_for(NTHREADS, C::NBLK * W, BLOCK)>(seg, x, W, a - j0, a - lo, b - a, scratch);
  }
};

}  // namespace kvforge
