// Spherical key codec (crates/kvforge-spec/src/codecs/spherical/).
#pragma once
#include "kvforge/codecs/base.cuh"

namespace kvforge {

// Spherical keys (seed 000 App. B): per group an 8-bit radius code and a BITS-bit codeword
// index. Decode reads them and looks up LUT[h][j][i] = rscale_j · <q_j, c_i> with the
// unnormalised group query q_j (the paper's normalised q̃ with w_j = 1 does not approximate
// q·k): G lookups and G radius multiplies per token, no dense key is ever rebuilt.
template <int GROUP, int ABITS, int D, int P, int OFF_RADIUS, int OFF_INDEX>
struct SphericalKey {
  // Side-table slots (kvforge-spec `SphericalKey::side_tables`): [NG][E][GROUP] codebook words
  // and [NG] radius scales per kv head.
  static constexpr int SLOT_CODEBOOK = 0, SLOT_RADIUS = 1, SLOT_ORDER = -1;
  static constexpr bool WARP = false;  // not on the per-warp decode path
  static constexpr int NG = D / GROUP;
  static constexpr int E = 1 << ABITS;
  static constexpr int LUT_FLOATS_PER_HEAD = NG * E;
  static constexpr bool MMA = false;
  template <int GQA, int NWARPS> __host__ __device__ static constexpr int bfrag_bytes() { return 0; }
  static constexpr bool SPHERICAL = true;
  // No per-token bound on ‖k − k̂‖ is stored (codebook angle error is data dependent).
  static constexpr KeyError ERROR = KeyError::Unbounded;
  static constexpr int IB = (NG * ABITS + 7) / 8;
  // Token-parallel scoring through the LUT (G lookups per token).
  static constexpr bool CHANNEL_PARALLEL = false, OUTLINE_SCORER = false;
  template <int GQA> struct Scorer {
    __device__ Scorer(const float*, int) {}
    __device__ void score(const u8*, int, float (&)[GQA]) {}
  };

  // codebook: [NG][E][GROUP] for this kv head (global memory); rscale: [NG]; q in shared memory.
  // Entry i = (h, j, e) is rscale_j <q_hj, c_je>. Every split CTA builds the whole table, so at
  // batch 1 (a few pages per split) the build is on the critical path: a thread issues all
  // codeword loads of B entries (float4s) before it uses any, one round trip per B entries
  // rather than one per 8 floats (ncu, spherical high 1 × 32K: long-scoreboard stalls 7.8 per
  // issued instruction). The sum runs over c in order, as before.
  template <int GQA, int NTHREADS>
  __device__ static void build_lut(float* lut, const float* q, const float* codebook, const float* rscale) {
    static_assert(GROUP % 4 == 0, "codewords load as float4s");
    constexpr int N = GQA * NG * E, V4 = GROUP / 4, B = cmax(1, 16 / V4);
    for (int i0 = threadIdx.x; i0 < N; i0 += B * NTHREADS) {
      float4 cw[B][V4];
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const int i = i0 + b * NTHREADS, e = i % E, j = (i / E) % NG;
        const float4* src = reinterpret_cast<const float4*>(codebook + (j * E + e) * GROUP);
#pragma unroll
        for (int v = 0; v < V4; ++v) cw[b][v] = i < N ? __ldg(src + v) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const int i = i0 + b * NTHREADS, j = (i / E) % NG, h = i / (E * NG);
        if (i < N) {
          const float* qj = q + h * D + j * GROUP;
          float acc = 0.f;
#pragma unroll
          for (int v = 0; v < V4; ++v) {
            acc += qj[4 * v] * cw[b][v].x;
            acc += qj[4 * v + 1] * cw[b][v].y;
            acc += qj[4 * v + 2] * cw[b][v].z;
            acc += qj[4 * v + 3] * cw[b][v].w;
          }
          lut[i] = acc * rscale[j];
        }
      }
    }
  }

  __device__ __forceinline__ static int index_at(const u8* row, int j) {
    const int bit = j * ABITS, byte = bit >> 3, shift = bit & 7;
    u32 w = row[byte];
    if (byte + 1 < IB) w |= u32(row[byte + 1]) << 8;
    return (w >> shift) & (E - 1);
  }

  template <int GQA, int TPT>
  __device__ __forceinline__ static void score_lut(const u8* seg, int t, int part, const float* lut, float (&s)[GQA]) {
    const u8* radius = seg + OFF_RADIUS + t * NG;
    const u8* index = seg + OFF_INDEX + t * IB;
    for (int j = part; j < NG; j += TPT) {
      const float r = float(radius[j]);
      const int idx = index_at(index, j);
#pragma unroll
      for (int h = 0; h < GQA; ++h) s[h] += r * lut[(h * NG + j) * E + idx];
    }
  }

  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c, const float* codebook, const float* rscale, const u16*) {
    const int j = c / GROUP;
    const int idx = index_at(seg + OFF_INDEX + t * IB, j);
    return float(seg[OFF_RADIUS + t * NG + j]) * rscale[j] * codebook[(j * E + idx) * GROUP + c % GROUP];
  }

  // Transcode slices are whole tokens (a radius and codeword per token per group): x
  // [ROWS][D] holds tokens [t0, t0 + ROWS); scratch: ROWS * NG ints (chosen indices). L lanes
  // share each (token, group) argmax over the codebook, lane l scoring codewords l, l + L, ...;
  // the lanes' winners meet by (larger dot, then smaller index): the serial scan's first
  // strict maximum.
  static constexpr bool SLICE_CHANNELS = false;
  template <int NTHREADS, class Slice>
  __device__ static void encode(u8* seg, const float* x, int* scratch, Slice s, const float* codebook, const float* rscale, const u16*) {
    static_assert(Slice::COLS == D, "spherical key slices are whole tokens");
    constexpr int ITEMS = Slice::ROWS * NG;
    constexpr int L = lanes_for(NTHREADS, ITEMS, E);
    for_lane_items<NTHREADS, L>(ITEMS, [&](int i, bool on, int lane) {
      const int tt = on ? i / NG : 0, j = on ? i % NG : 0;
      const float* k = x + tt * D + j * GROUP;
      float r2 = 0.f;
      for (int c = 0; c < GROUP; ++c) r2 += k[c] * k[c];
      const float r = sqrtf(r2);
      const float inv = 1.f / (r + 1e-6f);
      int best = 0;
      float best_dot = -3.402823466e38f;
      for (int e = lane; e < E; e += L) {
        const float* cw = codebook + (j * E + e) * GROUP;
        float dot = 0.f;
        for (int c = 0; c < GROUP; ++c) dot += k[c] * inv * cw[c];
        if (dot > best_dot) { best_dot = dot; best = e; }
      }
#pragma unroll
      for (int o = L / 2; o > 0; o /= 2) {
        const float od = __shfl_xor_sync(0xffffffffu, best_dot, o);
        const int oe = __shfl_xor_sync(0xffffffffu, best, o);
        if (od > best_dot || (od == best_dot && oe < best)) { best_dot = od; best = oe; }
      }
      if (on && lane == 0) {
        scratch[i] = best;
        const float rs = rscale[j];
        const float code = rs > 0.f ? fminf(fmaxf(round_half_up(r / rs), 0.f), 255.f) : 0.f;
        seg[OFF_RADIUS + (s.t0 + tt) * NG + j] = u8(code);
      }
    });
    __syncthreads();
    for (int i = threadIdx.x; i < Slice::ROWS * IB; i += NTHREADS) {
      const int tt = i / IB, byte = i % IB;
      u32 b = 0;
      for (int bit = 0; bit < 8; ++bit) {
        const int gbit = byte * 8 + bit, j = gbit / ABITS;
        if (j < NG) b |= u32((scratch[tt * NG + j] >> (gbit % ABITS)) & 1) << bit;
      }
      seg[OFF_INDEX + (s.t0 + tt) * IB + byte] = u8(b);
    }
  }
};

}  // namespace kvforge
