// Coding schemes of keys and values: decode-time scoring / loading and encode-time packing.
// The byte layout (array offsets) comes from kvforge-spec's SegmentLayout through the
// generated TierDef; numerics follow kvforge-ref exactly (see crates/kvforge-ref).
#pragma once
#include "common.cuh"

namespace kvforge {

// Small unsigned integer (< 2^23) to float without the quarter-rate I2F unit: or it into the
// mantissa of 2^23 and subtract 2^23 (exact).
__device__ __forceinline__ float u2f(u32 x) { return __int_as_float(0x4B000000u | x) - 8388608.0f; }

// Storage type of quantisation scales.
template <class S> __device__ __forceinline__ float load_scale(const u8* p, int i) { return to_float(reinterpret_cast<const S*>(p)[i]); }
template <class S> __device__ __forceinline__ float round_scale(float x) { return to_float(from_float<S>(x)); }

// ---------------------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------------------

// What a key scheme can state about its logit error, for certified decode: exact keys, a
// per-channel quantisation step per block (|q·(k − k̂)| ≤ ½ Σ_c |q_c| σ_c), or no bound.
enum class KeyError { Exact, Step, Unbounded };

// Evicted tokens: no bytes, never scored. Only used in transcode bookkeeping.
struct DropKey {
  static constexpr int LUT_FLOATS_PER_HEAD = 0;
  static constexpr bool SPHERICAL = false;
  static constexpr KeyError ERROR = KeyError::Exact;
  static constexpr bool CHANNEL_PARALLEL = true;
  template <int GQA> struct Scorer {
    __device__ Scorer(const float*, int) {}
    __device__ void score(const u8*, int, float (&)[GQA]) {}
  };
  template <int GQA, int TPT>
  __device__ static void score_lut(const u8*, int, int, const float*, float (&)[GQA]) {}
};

// Dense keys (fp16/bf16) [P][D]. Scored in 16-byte chunks (8 channels); consecutive threads
// take consecutive chunks so shared-memory reads are conflict-free.
template <class T, int D, int P, int OFF>
struct DenseKey {
  static constexpr int LUT_FLOATS_PER_HEAD = 0;
  static constexpr bool SPHERICAL = false;
  static constexpr KeyError ERROR = KeyError::Exact;
  static constexpr int NCH = D / 8;

  // Channel-parallel scoring: the thread owns channels [8·c8, 8·c8 + 8) of every token it
  // visits and keeps that slice of every GQA query in registers; the caller sums the D/8
  // lanes of a token with shuffles.
  static constexpr bool CHANNEL_PARALLEL = true;
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

  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c, const float*, const float*) {
    return to_float(reinterpret_cast<const T*>(seg + OFF)[t * D + c]);
  }

  template <int NTHREADS>
  __device__ static void encode(u8* seg, const float* x, int*, const float*, const float*) {
    T* out = reinterpret_cast<T*>(seg + OFF);
    for (int i = threadIdx.x; i < P * D; i += NTHREADS) out[i] = from_float<T>(x[i]);
  }
};

// Unpacks element `c` of a row of BITS-bit codes.
template <int BITS>
__device__ __forceinline__ int code_at(const u8* row, int c) {
  if constexpr (BITS == 8) return row[c];
  else if constexpr (BITS == 4) return (row[c >> 1] >> ((c & 1) * 4)) & 0xf;
  else return (row[c >> 2] >> ((c & 3) * 2)) & 0x3;
}

// Packs the codes of channels [byte*PER, byte*PER + PER) of one row into one byte.
template <int BITS, class F>
__device__ __forceinline__ u8 pack_byte(int byte, F code_of) {
  constexpr int PER = 8 / BITS;
  u32 b = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) b |= u32(code_of(byte * PER + i)) << (i * BITS);
  return u8(b);
}

// Asymmetric quantisation of one value with stored (rounded) scale and zero.
template <int BITS>
__device__ __forceinline__ int quantize(float x, float scale, float zero) {
  constexpr int QMAX = (1 << BITS) - 1;
  if (scale == 0.f) return 0;
  const float c = round_half_up((x - zero) / scale);
  return int(fminf(fmaxf(c, 0.f), float(QMAX)));
}

// Integer keys with a scale and zero per channel per block of BLOCK tokens (KIVI / seed 004).
// The per-channel scale folds into the query once per block (q_c · scale_{b,c}) and the
// zero term Σ_c q_c zero_{b,c} is added once per token: one FMA per element in the hot loop.
template <int BITS, int BLOCK, class S, int D, int P, int OFF_CODES, int OFF_SCALE, int OFF_ZERO>
struct IntKey {
  static constexpr int LUT_FLOATS_PER_HEAD = 0;
  static constexpr int NBLK = P / BLOCK;
  static constexpr bool SPHERICAL = false;
  static constexpr int ROW = D * BITS / 8;
  static constexpr int PER = 32 / BITS;  // codes per 32-bit word
  static constexpr int NCH = ROW / 4;
  static constexpr int BLOCK_TOKENS = BLOCK;
  static constexpr KeyError ERROR = KeyError::Step;
  // Quantisation step σ of channel c in block b: a code is rounded to nearest, so a stored key
  // is within σ/2 of its original (the certified decode's per-block logit bound).
  __device__ __forceinline__ static float step(const u8* seg, int b, int c) { return load_scale<S>(seg + OFF_SCALE, b * D + c); }

  // Channel-parallel scoring with the per-channel scale folded into the query slice once per
  // block (qs = q · scale) and the zero term Σ q · zero added as a per-lane partial: one FMA
  // per code per head in the hot loop, no shared-memory traffic but the codes.
  static constexpr bool CHANNEL_PARALLEL = true;
  template <int GQA>
  struct Scorer {
    const float* q_s;
    int c8;
    int blk = -1;
    float qs[GQA][8];
    float zq[GQA];
    __device__ Scorer(const float* q_s_, int c8_) : q_s(q_s_), c8(c8_) {}
    __device__ __forceinline__ void fold(const u8* seg, int b) {
      float sc[8], zr[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        sc[i] = load_scale<S>(seg + OFF_SCALE, b * D + c8 * 8 + i);
        zr[i] = load_scale<S>(seg + OFF_ZERO, b * D + c8 * 8 + i);
      }
#pragma unroll
      for (int h = 0; h < GQA; ++h) {
        float z = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float qv = q_s[h * D + c8 * 8 + i];
          qs[h][i] = qv * sc[i];
          z = fmaf(qv, zr[i], z);
        }
        zq[h] = z;
      }
      blk = b;
    }
    __device__ __forceinline__ void score(const u8* seg, int t, float (&s)[GQA]) {
      const int b = t / BLOCK;
      if (b != blk) fold(seg, b);
      const u8* row = seg + OFF_CODES + t * ROW + c8 * BITS;  // 8 codes = BITS bytes
      u32 lo, hi = 0;
      if constexpr (BITS == 8) { const uint2 w = *reinterpret_cast<const uint2*>(row); lo = w.x; hi = w.y; }
      else if constexpr (BITS == 4) lo = *reinterpret_cast<const u32*>(row);
      else lo = *reinterpret_cast<const u16*>(row);
      float k[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if constexpr (BITS == 8) k[i] = u2f(((i < 4 ? lo : hi) >> (8 * (i & 3))) & 0xff);
        else k[i] = u2f((lo >> (BITS * i)) & ((1u << BITS) - 1));
      }
#pragma unroll
      for (int h = 0; h < GQA; ++h) {
        float a = zq[h];
#pragma unroll
        for (int i = 0; i < 8; ++i) a = fmaf(qs[h][i], k[i], a);
        s[h] = a;
      }
    }
  };

  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c, const float*, const float*) {
    const int b = t / BLOCK;
    return float(code_at<BITS>(seg + OFF_CODES + t * ROW, c)) * load_scale<S>(seg + OFF_SCALE, b * D + c) + load_scale<S>(seg + OFF_ZERO, b * D + c);
  }

  // x: [P][D] floats in shared memory; scratch: 2 * NBLK * D floats.
  template <int NTHREADS>
  __device__ static void encode(u8* seg, const float* x, int* scratch, const float*, const float*) {
    float* sc = reinterpret_cast<float*>(scratch);
    float* zr = sc + NBLK * D;
    for (int i = threadIdx.x; i < NBLK * D; i += NTHREADS) {
      const int b = i / D, c = i % D;
      float mn = x[b * BLOCK * D + c], mx = mn;
      for (int t = 1; t < BLOCK; ++t) {
        const float v = x[(b * BLOCK + t) * D + c];
        mn = fminf(mn, v);
        mx = fmaxf(mx, v);
      }
      const S s_st = from_float<S>((mx - mn) / float((1 << BITS) - 1));
      const S z_st = from_float<S>(mn);
      reinterpret_cast<S*>(seg + OFF_SCALE)[i] = s_st;
      reinterpret_cast<S*>(seg + OFF_ZERO)[i] = z_st;
      sc[i] = to_float(s_st);
      zr[i] = to_float(z_st);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < P * ROW; i += NTHREADS) {
      const int t = i / ROW, byte = i % ROW, b = t / BLOCK;
      seg[OFF_CODES + i] = pack_byte<BITS>(byte, [&](int c) { return quantize<BITS>(x[t * D + c], sc[b * D + c], zr[b * D + c]); });
    }
  }
};

// Spherical keys (seed 000 App. B): per group an 8-bit radius code and a BITS-bit codeword
// index. Decode reads them and looks up LUT[h][j][i] = rscale_j · <q_j, c_i> with the
// unnormalised group query q_j (the paper's normalised q̃ with w_j = 1 does not approximate
// q·k): G lookups and G radius multiplies per token, no dense key is ever rebuilt.
template <int GROUP, int ABITS, int D, int P, int OFF_RADIUS, int OFF_INDEX>
struct SphericalKey {
  static constexpr int NG = D / GROUP;
  static constexpr int E = 1 << ABITS;
  static constexpr int LUT_FLOATS_PER_HEAD = NG * E;
  static constexpr bool SPHERICAL = true;
  // No per-token bound on ‖k − k̂‖ is stored (codebook angle error is data dependent).
  static constexpr KeyError ERROR = KeyError::Unbounded;
  static constexpr int IB = (NG * ABITS + 7) / 8;
  // Token-parallel scoring through the LUT (G lookups per token).
  static constexpr bool CHANNEL_PARALLEL = false;
  template <int GQA> struct Scorer {
    __device__ Scorer(const float*, int) {}
    __device__ void score(const u8*, int, float (&)[GQA]) {}
  };

  // codebook: [NG][E][GROUP] for this kv head; rscale: [NG].
  template <int GQA, int NTHREADS>
  __device__ static void build_lut(float* lut, const float* q, const float* codebook, const float* rscale) {
    for (int i = threadIdx.x; i < GQA * NG * E; i += NTHREADS) {
      const int e = i % E, j = (i / E) % NG, h = i / (E * NG);
      const float* cw = codebook + (j * E + e) * GROUP;
      const float* qj = q + h * D + j * GROUP;
      float acc = 0.f;
#pragma unroll 8
      for (int c = 0; c < GROUP; ++c) acc += qj[c] * cw[c];
      lut[i] = acc * rscale[j];
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

  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c, const float* codebook, const float* rscale) {
    const int j = c / GROUP;
    const int idx = index_at(seg + OFF_INDEX + t * IB, j);
    return float(seg[OFF_RADIUS + t * NG + j]) * rscale[j] * codebook[(j * E + idx) * GROUP + c % GROUP];
  }

  // scratch: P * NG ints (chosen indices).
  template <int NTHREADS>
  __device__ static void encode(u8* seg, const float* x, int* scratch, const float* codebook, const float* rscale) {
    for (int i = threadIdx.x; i < P * NG; i += NTHREADS) {
      const int t = i / NG, j = i % NG;
      const float* k = x + t * D + j * GROUP;
      float r2 = 0.f;
      for (int c = 0; c < GROUP; ++c) r2 += k[c] * k[c];
      const float r = sqrtf(r2);
      const float inv = 1.f / (r + 1e-6f);
      int best = 0;
      float best_dot = -3.402823466e38f;
      for (int e = 0; e < E; ++e) {
        const float* cw = codebook + (j * E + e) * GROUP;
        float dot = 0.f;
        for (int c = 0; c < GROUP; ++c) dot += k[c] * inv * cw[c];
        if (dot > best_dot) { best_dot = dot; best = e; }
      }
      scratch[i] = best;
      const float rs = rscale[j];
      const float code = rs > 0.f ? fminf(fmaxf(round_half_up(r / rs), 0.f), 255.f) : 0.f;
      seg[OFF_RADIUS + i] = u8(code);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < P * IB; i += NTHREADS) {
      const int t = i / IB, byte = i % IB;
      u32 b = 0;
      for (int bit = 0; bit < 8; ++bit) {
        const int gbit = byte * 8 + bit, j = gbit / ABITS;
        if (j < NG) b |= u32((scratch[t * NG + j] >> (gbit % ABITS)) & 1) << bit;
      }
      seg[OFF_INDEX + i] = u8(b);
    }
  }
};

// ---------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------

struct DropValue {};

template <class T, int D, int P, int OFF>
struct DenseValue {
  __device__ __forceinline__ static void load8(const u8* seg, int t, int c8, float (&v)[8]) {
    const uint4 raw = reinterpret_cast<const uint4*>(seg + OFF + t * D * 2)[c8];
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_float(e[i]);
  }
  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c) {
    return to_float(reinterpret_cast<const T*>(seg + OFF)[t * D + c]);
  }
  template <int NTHREADS>
  __device__ static void encode(u8* seg, const float* x) {
    T* out = reinterpret_cast<T*>(seg + OFF);
    for (int i = threadIdx.x; i < P * D; i += NTHREADS) out[i] = from_float<T>(x[i]);
  }
};

// Integer values with a scale and zero per token per group of GROUP channels.
template <int BITS, int GROUP, class S, int D, int P, int OFF_CODES, int OFF_SCALE, int OFF_ZERO>
struct IntValue {
  static constexpr int ROW = D * BITS / 8;
  static constexpr int NGRP = D / GROUP;

  __device__ __forceinline__ static void load8(const u8* seg, int t, int c8, float (&v)[8]) {
    const int grp = (c8 * 8) / GROUP;
    const float sc = load_scale<S>(seg + OFF_SCALE, t * NGRP + grp);
    const float zr = load_scale<S>(seg + OFF_ZERO, t * NGRP + grp);
    const u8* row = seg + OFF_CODES + t * ROW;
    if constexpr (BITS == 8) {
      const uint2 w = reinterpret_cast<const uint2*>(row)[c8];
#pragma unroll
      for (int i = 0; i < 4; ++i) { v[i] = fmaf(u2f((w.x >> (8 * i)) & 0xff), sc, zr); v[4 + i] = fmaf(u2f((w.y >> (8 * i)) & 0xff), sc, zr); }
    } else if constexpr (BITS == 4) {
      const u32 w = reinterpret_cast<const u32*>(row)[c8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = fmaf(u2f((w >> (4 * i)) & 0xf), sc, zr);
    } else {
      const u32 w = reinterpret_cast<const u16*>(row)[c8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = fmaf(u2f((w >> (2 * i)) & 0x3), sc, zr);
    }
  }

  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c) {
    const int grp = c / GROUP;
    return float(code_at<BITS>(seg + OFF_CODES + t * ROW, c)) * load_scale<S>(seg + OFF_SCALE, t * NGRP + grp) + load_scale<S>(seg + OFF_ZERO, t * NGRP + grp);
  }

  template <int NTHREADS>
  __device__ static void encode(u8* seg, const float* x) {
    constexpr int GBYTES = GROUP * BITS / 8;
    for (int i = threadIdx.x; i < P * NGRP; i += NTHREADS) {
      const int t = i / NGRP, grp = i % NGRP;
      const float* xs = x + t * D + grp * GROUP;
      float mn = xs[0], mx = xs[0];
      for (int c = 1; c < GROUP; ++c) { mn = fminf(mn, xs[c]); mx = fmaxf(mx, xs[c]); }
      const S s_st = from_float<S>((mx - mn) / float((1 << BITS) - 1));
      const S z_st = from_float<S>(mn);
      reinterpret_cast<S*>(seg + OFF_SCALE)[i] = s_st;
      reinterpret_cast<S*>(seg + OFF_ZERO)[i] = z_st;
      const float sc = to_float(s_st), zr = to_float(z_st);
      u8* out = seg + OFF_CODES + t * ROW + grp * GBYTES;
      for (int byte = 0; byte < GBYTES; ++byte)
        out[byte] = pack_byte<BITS>(byte, [&](int c) { return quantize<BITS>(xs[c], sc, zr); });
    }
  }
};

// A tier: its id (the page header's tier byte), segment bytes and codecs.
template <int ID, int SEG_BYTES_, class K, class V>
struct TierDef {
  static constexpr int id = ID;
  static constexpr int SEG_BYTES = SEG_BYTES_;
  using Key = K;
  using Value = V;
};

}  // namespace kvforge
