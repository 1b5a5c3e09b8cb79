// Dense codecs (crates/kvforge-spec/src/codecs/dense/): fp16/bf16 keys and values [P][D].
#pragma once
#include "kvforge/codecs/base.cuh"

namespace kvforge {

// Dense keys (fp16/bf16) [P][D]. Scored in 16-byte chunks (8 channels); consecutive threads
// take consecutive chunks so shared-memory reads are conflict-free.
template <class T, int D, int P, int OFF>
struct DenseKey {
  // Side-table slots (kvforge-spec `Codec::side_tables`; -1: none).
  static constexpr int SLOT_CODEBOOK = -1, SLOT_RADIUS = -1, SLOT_ORDER = -1;
  static constexpr int LUT_FLOATS_PER_HEAD = 0;
  // fp16 keys score on tensor cores (mma_scores); bf16 keys channel-parallel on CUDA cores.
  static constexpr bool MMA = same_type<T, __half>::value;
  template <int GQA, int NWARPS> __host__ __device__ static constexpr int bfrag_bytes() { return 0; }
  static constexpr bool SPHERICAL = false;
  static constexpr KeyError ERROR = KeyError::Exact;
  static constexpr int NCH = D / 8;

  // Channel-parallel scoring: the thread owns channels [8·c8, 8·c8 + 8) of every token it
  // visits and keeps that slice of every GQA query in registers; the caller sums the D/8
  // lanes of a token with shuffles.
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
      const uint4 raw = reinterpret_cast<const uint4*>(seg + OFF + t * D * 2)[c8];
      const T* e = reinterpret_cast<const T*>(&raw);
      float k[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) k[i] = to_float(e[i]);
#pragma unroll
      for (int h = 0; h < GQA; ++h) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) a = fmaf(q[h][i], k[i], a);
        s[h] = a;
      }
    }
  };

  // Tensor-core scoring (mma m16n8k16: 16 tokens × 8 query heads × 16 channels), laid out as
  // IntKey's: warp w scores tokens [16·mt, 16·mt + 16) of channel part kp, lane (g, qd) owns
  // channels [c0, c0 + CPT) of its part, pair e of them being channels c0 + 2e and c0 + 2e + 1.
  // A = the stored fp16 keys as they are; B = q split into an fp16 high and low part (two mmas:
  // ~22 bits, the fp32-grade logits the channel-parallel path gave). On CUDA cores the fp16
  // path spent ~2000 of its ~7500 warp-instructions per page on the dot products and their
  // 16-lane shuffle trees (ncu, baseline fp16, 64 × 32K).
  template <int NWARPS> struct Mma {
    static constexpr int MT = P / 16;
    static constexpr int KP = NWARPS >= 2 * MT ? 2 : 1;
    static constexpr int CH = D / KP, CPT = CH / 4, KS = CH / 16;
    static constexpr bool COOP = false;
    static_assert(P % 16 == 0 && CH % 16 == 0, "mma tiles");
  };
  template <int GQA, int NWARPS, int NT>
  __device__ static void mma_scores(const u8* seg, int len, const float* q_s, float* sc0, float* sc1, u8*) {
    using M = Mma<NWARPS>;
    static_assert(GQA <= 8, "one mma column per query head");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, qd = lane & 3;
    const T* keys = reinterpret_cast<const T*>(seg + OFF);
#pragma unroll 1
    for (int u = warp; u < M::MT * M::KP; u += NWARPS) {
      const int mt = u % M::MT, kp = u / M::MT;
      const int c0 = kp * M::CH + qd * M::CPT;
      const int t0 = mt * 16 + g;
      const T* r0 = keys + t0 * D + c0;
      const T* r1 = r0 + 8 * D;
      const float* qh = q_s + (g < GQA ? g : 0) * D + c0;
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < M::KS; ++j) {
        // Channels c0 + 4j .. c0 + 4j + 3: pairs 2j (k slots 2qd, 2qd + 1) and 2j + 1 (2qd + 8, 2qd + 9).
        const uint2 k0 = *reinterpret_cast<const uint2*>(r0 + 4 * j);
        const uint2 k1 = *reinterpret_cast<const uint2*>(r1 + 4 * j);
        u32 bh[2] = {0u, 0u}, bl[2] = {0u, 0u};
        if (g < GQA) {
          const float4 qv = *reinterpret_cast<const float4*>(qh + 4 * j);
          split_h2(qv.x, qv.y, bh[0], bl[0]);
          split_h2(qv.z, qv.w, bh[1], bl[1]);
        }
        const u32 a[4] = {k0.x, k1.x, k0.y, k1.y};
        mma16816<false>(c, a, bh);
        mma16816<false>(c, a, bl);
      }
      store_mma_scores<GQA, P>(c, t0, len, qd, kp == 0 ? sc0 : sc1, kp == 0);
    }
  }

  // Per-warp decode (DecodeCta::compute_warp): the B fragments of token t's keys, the
  // thread's channel slice [qd·D/4, (qd + 1)·D/4) as stored, pair e = channels 2e, 2e + 1.
  static constexpr bool WARP = MMA;
  // Lanes past the heads read a real head's query fragments (DecodeCta::compute_warp).
  static constexpr bool WARP_SHARED_Q = true;
  template <int NPAIR> struct WarpKeys {
    __device__ __forceinline__ WarpKeys(const u8*, int) {}
    __device__ __forceinline__ void operator()(const u8* seg, int t, int qd, u32 (&b)[NPAIR]) const {
      load_words<4 * NPAIR>(seg + OFF + (t * D + qd * 2 * NPAIR) * 2, b);
    }
  };

  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c, const float*, const float*, const u16*) {
    return to_float(reinterpret_cast<const T*>(seg + OFF)[t * D + c]);
  }

  // Transcode slices are whole tokens (any split of a page's rows is independent).
  static constexpr bool SLICE_CHANNELS = false;
  template <int NTHREADS, class Slice>
  __device__ static void encode(u8* seg, const float* x, int*, Slice s, const float*, const float*, const u16*) {
    static_assert(Slice::COLS == D, "dense key slices are whole tokens");
    T* out = reinterpret_cast<T*>(seg + OFF) + s.t0 * D;
    for (int i = threadIdx.x; i < Slice::ROWS * D; i += NTHREADS) out[i] = from_float<T>(x[i]);
  }
};

template <class T, int D, int P, int OFF>
struct DenseValue {
  static constexpr bool BF16 = same_type<T, __nv_bfloat16>::value;
  // Tensor-core value accumulation reads V transposed: out[k] = (v[ta][c0 + k], v[tb][c0 + k])
  // as an fp16 (bf16) pair, one PRMT per pair (the per-warp layout's A fragment, and half of
  // the block layout's `pairs`).
  static constexpr bool WARP = !BF16;
  template <int N>
  __device__ __forceinline__ static void token_pairs(const u8* seg, int ta, int tb, int c0, u32 (&out)[N]) {
    u32 wa[N / 2], wb[N / 2];
    load_words<2 * N>(seg + OFF + (ta * D + c0) * 2, wa);
    load_words<2 * N>(seg + OFF + (tb * D + c0) * 2, wb);
#pragma unroll
    for (int m = 0; m < N / 2; ++m) {
      out[2 * m] = __byte_perm(wa[m], wb[m], 0x5410);
      out[2 * m + 1] = __byte_perm(wa[m], wb[m], 0x7632);
    }
  }
  // lo[k] = (v[t][c0+k], v[t+1][c0+k]), hi[k] = (v[t+2][c0+k], v[t+3][c0+k]).
  template <int N>
  __device__ __forceinline__ static void pairs(const u8* seg, int t, int c0, u32 (&lo)[N], u32 (&hi)[N]) {
    token_pairs<N>(seg, t, t + 1, c0, lo);
    token_pairs<N>(seg, t + 2, t + 3, c0, hi);
  }
  __device__ __forceinline__ static void load8(const u8* seg, int t, int c8, float (&v)[8]) {
    const uint4 raw = reinterpret_cast<const uint4*>(seg + OFF + t * D * 2)[c8];
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_float(e[i]);
  }
  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c) {
    return to_float(reinterpret_cast<const T*>(seg + OFF)[t * D + c]);
  }
  // Codes tokens [t0, t0 + ROWS) of a transcode slice from x [ROWS][D].
  template <int NTHREADS, class Slice>
  __device__ static void encode(u8* seg, const float* x, Slice s) {
    static_assert(Slice::COLS == D, "value slices are whole tokens");
    T* out = reinterpret_cast<T*>(seg + OFF) + s.t0 * D;
    for (int i = threadIdx.x; i < Slice::ROWS * D; i += NTHREADS) out[i] = from_float<T>(x[i]);
  }
};

}  // namespace kvforge
