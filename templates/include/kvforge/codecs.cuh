// Coding schemes of keys and values: decode-time scoring / loading and encode-time packing.
// The byte layout (array offsets) comes from kvforge-spec's SegmentLayout through the
// generated TierDef; numerics follow kvforge-ref exactly (see crates/kvforge-ref).
#pragma once
#include "common.cuh"

namespace kvforge {

// Small unsigned integer (< 2^23) to float without the quarter-rate I2F unit: or it into the
// mantissa of 2^23 and subtract 2^23 (exact).
__device__ __forceinline__ float u2f(u32 x) { return __int_as_float(0x4B000000u | x) - 8388608.0f; }

// The part of a page one transcode CTA codes: rows [t0, t0 + ROWS) × columns [c0, c0 + COLS)
// of the page's [P][D] keys or values, held in shared memory as x[ROWS][COLS]. A page's work is
// split over several CTAs (transcode.cuh), so each codec codes a slice along an axis its
// numbers are independent on: whole tokens for per-token codes (values, dense and spherical
// keys), whole channels for per-channel ones (integer and mixed keys, `SLICE_CHANNELS`; mixed
// keys' columns are stored positions).
template <int ROWS_, int COLS_>
struct PageSlice {
  static constexpr int ROWS = ROWS_, COLS = COLS_;
  int t0, c0;
};

// Lanes that share each of `items` independent reductions (a min/max over a block's tokens, an
// argmax over a codebook) so that a CTA of `nt` threads is busy: a slice has too few items to
// give every thread one, and each item is a serial chain otherwise. The largest power of two
// ≤ min(32, cap, nt / items), at least 1; lanes of one item are consecutive threads of a warp.
__host__ __device__ constexpr int lanes_for(int nt, int items, int cap) {
  int l = 1;
  while (2 * l <= 32 && 2 * l <= cap && 2 * l * items <= nt) l *= 2;
  return l;
}

// Min and max over the L lanes of an item (xor shuffles inside an aligned group of L lanes;
// every lane of the warp must call it). fminf/fmaxf ignore NaN, so the result does not depend
// on which lane saw which value: the serial scan's.
template <int L>
__device__ __forceinline__ void lanes_minmax(float& mn, float& mx) {
#pragma unroll
  for (int o = L / 2; o > 0; o /= 2) {
    mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  }
}

// Runs body(i, on, lane) for items 0..items-1 with L consecutive lanes per item (lanes_for).
// The trip count is the same for every thread of the CTA, so every lane reaches the body's
// shuffles; lanes past the last item get on == false with an item index they must not
// write through.
template <int NTHREADS, int L, class Body>
__device__ __forceinline__ void for_lane_items(int items, Body body) {
  const int lane = threadIdx.x % L;
  for (int base = 0; base < items; base += NTHREADS / L) {
    const int i = base + int(threadIdx.x) / L;
    body(i, i < items, lane);
  }
}

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
  static constexpr bool WARP = false;  // not on the per-warp decode path
  static constexpr int LUT_FLOATS_PER_HEAD = 0;
  static constexpr bool MMA = false;
  template <int GQA, int NWARPS> __host__ __device__ static constexpr int bfrag_bytes() { return 0; }
  static constexpr bool SPHERICAL = false;
  static constexpr KeyError ERROR = KeyError::Exact;
  static constexpr bool CHANNEL_PARALLEL = true, OUTLINE_SCORER = false;
  static constexpr bool SLICE_CHANNELS = false;
  template <int GQA> struct Scorer {
    __device__ Scorer(const float*, int) {}
    __device__ void score(const u8*, int, float (&)[GQA]) {}
  };
  template <int GQA, int TPT>
  __device__ static void score_lut(const u8*, int, int, const float*, float (&)[GQA]) {}
};

// Tensor-core scores of one m16n8k16 tile (tokens t0 and t0 + 8 of the page × query heads
// 2qd and 2qd + 1) into the [GQA][P] score array of channel part `first_part` (0) or the
// second part: tokens past `len` score -inf in part 0 and add nothing in part 1.
template <int GQA, int P>
__device__ __forceinline__ void store_mma_scores(const float (&c)[4], int t0, int len, int qd, float* dst, bool first_part) {
  const float pad = first_part ? NEG_INF : 0.f;
  const int h0 = 2 * qd;
  if (h0 < GQA) {
    dst[h0 * P + t0] = t0 < len ? c[0] : pad;
    dst[h0 * P + t0 + 8] = t0 + 8 < len ? c[2] : pad;
  }
  if (h0 + 1 < GQA) {
    dst[(h0 + 1) * P + t0] = t0 < len ? c[1] : pad;
    dst[(h0 + 1) * P + t0 + 8] = t0 + 8 < len ? c[3] : pad;
  }
}

// Dense keys (fp16/bf16) [P][D]. Scored in 16-byte chunks (8 channels); consecutive threads
// take consecutive chunks so shared-memory reads are conflict-free.
template <class T, int D, int P, int OFF>
struct DenseKey {
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

// N channels of integer codes with a scale and zero per channel per block of BLOCK tokens:
// codes [P][N·BITS/8], scale and zero [P/BLOCK][N]. The storage of IntKey (N = D) and of each
// integer segment of MixedKey.
template <int BITS, int BLOCK, class S, int N, int P, int OFF_CODES, int OFF_SCALE, int OFF_ZERO>
struct ChannelCodes {
  static constexpr int NBLK = P / BLOCK, ROW = N * BITS / 8;
  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c) {
    const int b = t / BLOCK;
    return float(code_at<BITS>(seg + OFF_CODES + t * ROW, c)) * load_scale<S>(seg + OFF_SCALE, b * N + c) + load_scale<S>(seg + OFF_ZERO, b * N + c);
  }
  // Codes channels [n0, n0 + nc) of the N (whole bytes of codes: n0 and nc multiples of 8)
  // from columns [xc0, xc0 + nc) of x ([P][ldx] floats in shared memory), all P tokens;
  // scratch: 2·NBLK·nc floats. L lanes share each (block, channel) min/max (see lanes_for).
  template <int NTHREADS, int L>
  __device__ static void encode(u8* seg, const float* x, int ldx, int xc0, int n0, int nc, float* scratch) {
    static_assert(L <= BLOCK && 32 % L == 0, "every lane of an item reads at least one token");
    float* sc = scratch;
    float* zr = sc + NBLK * nc;
    for_lane_items<NTHREADS, L>(NBLK * nc, [&](int i, bool on, int lane) {
      const int b = on ? i / nc : 0, c = on ? i % nc : 0;
      const float* col = x + b * BLOCK * ldx + xc0 + c;
      float mn = col[lane * ldx], mx = mn;
      for (int t = lane + L; t < BLOCK; t += L) {
        const float v = col[t * ldx];
        mn = fminf(mn, v);
        mx = fmaxf(mx, v);
      }
      lanes_minmax<L>(mn, mx);
      if (on && lane == 0) {
        const S s_st = from_float<S>((mx - mn) / float((1 << BITS) - 1));
        const S z_st = from_float<S>(mn);
        reinterpret_cast<S*>(seg + OFF_SCALE)[b * N + n0 + c] = s_st;
        reinterpret_cast<S*>(seg + OFF_ZERO)[b * N + n0 + c] = z_st;
        sc[i] = to_float(s_st);
        zr[i] = to_float(z_st);
      }
    });
    __syncthreads();
    const int bytes = nc * BITS / 8;
    u8* codes = seg + OFF_CODES + n0 * BITS / 8;
    for (int i = threadIdx.x; i < P * bytes; i += NTHREADS) {
      const int t = i / bytes, byte = i % bytes, b = t / BLOCK;
      codes[t * ROW + byte] = pack_byte<BITS>(byte, [&](int c) { return quantize<BITS>(x[t * ldx + xc0 + c], sc[b * nc + c], zr[b * nc + c]); });
    }
    __syncthreads();
  }
  // Channel-parallel scoring of the 8 channels [c, c + 8) of token t: the scale folds into the
  // query slice once per block (qs = q · scale), the zero term Σ q · zero starts the sum.
  template <int GQA>
  __device__ __forceinline__ static void fold(const u8* seg, int b, int c, const float (&q)[GQA][8], float (&qs)[GQA][8], float (&zq)[GQA]) {
    float sc[8], zr[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      sc[i] = load_scale<S>(seg + OFF_SCALE, b * N + c + i);
      zr[i] = load_scale<S>(seg + OFF_ZERO, b * N + c + i);
    }
#pragma unroll
    for (int h = 0; h < GQA; ++h) {
      float z = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float qv = q[h][i];  // q may alias qs
        z = fmaf(qv, zr[i], z);
        qs[h][i] = qv * sc[i];
      }
      zq[h] = z;
    }
  }
  template <int GQA>
  __device__ __forceinline__ static void score8(const u8* seg, int t, int c, const float (&qs)[GQA][8], const float (&zq)[GQA], float (&s)[GQA]) {
    const u8* row = seg + OFF_CODES + t * ROW + c * BITS / 8;  // 8 codes = BITS bytes
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

// Integer keys with a scale and zero per channel per block of BLOCK tokens (KIVI / seed 004).
// Decode scores them on tensor cores (mma_scores): the per-channel scale folds into the query
// once per block (q_c · scale_{b,c}) and the zero term Σ_c q_c zero_{b,c} is added once per
// block and head.
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

  // Tensor-core scoring (mma m16n8k16: 16 tokens × 8 query heads × 16 channels). The codes are
  // the A operand, exact in fp16; the per-channel scale of the token block folds into the
  // query (B = q · scale, split into an fp16 high part and an fp16 low part, two mmas, so the
  // product keeps ~22 bits); the zero term Σ_c q_c zero_c (fp32) initialises the accumulator.
  // Warp w scores tokens [16·mt, 16·mt + 16) of channel part kp (mt = w % MT, kp = w / MT);
  // with KP = 2 parts the second part's partial scores go to `sc1` and the softmax adds them.
  // The channel order inside a thread's slice is free (A and B use the same one): pair e of a
  // thread's CPT codes holds the codes of channels pair_lo(e) and pair_lo(e) + CC, which is what
  // one shift and one LOP3 pull out of a 32-bit word.
  static constexpr bool CHANNEL_PARALLEL = false, OUTLINE_SCORER = false;
  static constexpr bool MMA = true;
  template <int NWARPS> struct Mma {
    static constexpr int MT = P / 16;
    static constexpr int KP = NWARPS >= 2 * MT ? 2 : 1;
    static constexpr int CH = D / KP, CPT = CH / 4, KS = CH / 16, NPAIR = CPT / 2;
    static constexpr int BYTES = CPT * BITS / 8;
    static constexpr int CC = BYTES == 2 ? 4 : 16 / BITS;  // codes per half of a pair word
    static constexpr int NWORD = BYTES >= 4 ? BYTES / 4 : 1;
    __device__ static constexpr int pair_lo(int e) { return (e / CC) * 2 * CC + e % CC; }
    static_assert(P % 16 == 0 && BLOCK % 16 == 0 && CH % 16 == 0, "mma tiles");
    // When a key block spans several m-tiles (BLOCK ≥ 32) the warps that score it would fold
    // the same B; all threads fold it once per page into shared memory instead (COOP).
    static constexpr bool COOP = BLOCK >= 32;
    static constexpr int NBLK = P / BLOCK > 0 ? P / BLOCK : 1;
    static constexpr int CPP = CH / 32 > 2 ? CH / 32 : 2;  // channels per thread in the fold
    static constexpr int LANES = CH / CPP;                 // fold lanes per channel part
  };
  // Shared memory of the cooperative fold: per block and head D/2 u32 of B high parts, as
  // many of low parts (fragment order), then per block, part and head the zero term.
  template <int GQA, int NWARPS> __host__ __device__ static constexpr int bfrag_bytes() {
    return Mma<NWARPS>::COOP ? 4 * GQA * Mma<NWARPS>::NBLK * (D + Mma<NWARPS>::KP) : 0;
  }
  // All threads: B = q · scale (high and low fp16 parts) and the zero terms of every block of
  // the page, into `bf` (see bfrag_bytes). One barrier after it.
  // Index math is unsigned with power-of-two divisors (shifts and masks): in signed ints the
  // compiler rounds every division toward zero, and that made this fold 29% of the page's
  // instructions (ncu, rdkv b4).
  template <int GQA, int NWARPS, int NT>
  __device__ static void fold_page(const u8* seg, const float* q_s, u8* bf) {
    using M = Mma<NWARPS>;
    constexpr unsigned CPP = M::CPP, DC = D / CPP, ITEMS = M::NBLK * GQA * DC;
    constexpr unsigned CPT = M::CPT, CC = M::CC;
    static_assert(ITEMS % 32 == 0 && M::LANES <= 32, "whole warps per fold pass");
    static_assert(M::CPT % M::CPP == 0, "a fold item stays inside one thread's channel slice");
    u16* hi16 = reinterpret_cast<u16*>(bf);
    u16* lo16 = hi16 + M::NBLK * GQA * D;
    float* zs = reinterpret_cast<float*>(bf + 4 * M::NBLK * GQA * D);
    const S* scale = reinterpret_cast<const S*>(seg + OFF_SCALE);
    const S* zero = reinterpret_cast<const S*>(seg + OFF_ZERO);
#pragma unroll 1
    for (unsigned i = threadIdx.x; i < ITEMS; i += NT) {
      const unsigned c = (i % DC) * CPP, hb = i / DC, h = hb % GQA, blk = hb / GQA;
      const unsigned kp = c / M::CH, cq = c % M::CH, qd = cq / CPT, o0 = cq % CPT;
      const unsigned base = 2 * ((((blk * GQA + h) * M::KP + kp) * (4 * M::NPAIR)) + qd * M::NPAIR);  // u16 index
      float z = 0.f;
#pragma unroll
      for (unsigned k = 0; k < CPP; k += 2) {
        const float2 qv = *reinterpret_cast<const float2*>(q_s + h * D + c + k);
        const float2 sv = make_float2(to_float(scale[blk * D + c + k]), to_float(scale[blk * D + c + k + 1]));
        const float2 zv = make_float2(to_float(zero[blk * D + c + k]), to_float(zero[blk * D + c + k + 1]));
        z = fmaf(qv.x, zv.x, z);
        z = fmaf(qv.y, zv.y, z);
        const float x[2] = {qv.x * sv.x, qv.y * sv.y};
#pragma unroll
        for (unsigned j = 0; j < 2; ++j) {
          const __half xh = __float2half_rn(x[j]);
          const __half xl = __float2half_rn(x[j] - __half2float(xh));
          // Position of channel o in the thread's pair_lo order: pair e, half `half`.
          const unsigned o = o0 + k + j, r = o % (2 * CC);
          const unsigned e = (o / (2 * CC)) * CC + r % CC, half = r / CC;
          hi16[base + 2 * e + half] = __half_as_ushort(xh);
          lo16[base + 2 * e + half] = __half_as_ushort(xl);
        }
      }
      z = group_sum<M::LANES>(z);
      if (i % M::LANES == 0) zs[(blk * M::KP + kp) * GQA + h] = z;
    }
    __syncthreads();
  }

  template <int GQA, int NWARPS, int NT>
  __device__ static void mma_scores(const u8* seg, int len, const float* q_s, float* sc0, float* sc1, u8* bf) {
    using M = Mma<NWARPS>;
    constexpr int CPT = M::CPT, NPAIR = M::NPAIR, CC = M::CC;
    constexpr u32 MASK = ((1u << BITS) - 1) * 0x00010001u;
    static_assert(GQA <= 8, "one mma column per query head");
    if constexpr (M::COOP) fold_page<GQA, NWARPS, NT>(seg, q_s, bf);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, qd = lane & 3;
#pragma unroll 1
    for (int u = warp; u < M::MT * M::KP; u += NWARPS) {
      const int mt = u % M::MT, kp = u / M::MT;
      const int c0 = kp * M::CH + qd * CPT;  // the thread's channel slice [c0, c0 + CPT)
      const int blk = mt * 16 / BLOCK;
      u32 bhi[NPAIR], blo[NPAIR];
      float z0, z1;
      if constexpr (M::COOP) {
        const u32* hi32 = reinterpret_cast<const u32*>(bf);
        const u32* lo32 = hi32 + M::NBLK * GQA * D / 2;
        const float* zs = reinterpret_cast<const float*>(bf + 4 * M::NBLK * GQA * D) + (blk * M::KP + kp) * GQA;
        if (g < GQA) {
          const int base = ((blk * GQA + g) * M::KP + kp) * (4 * NPAIR) + qd * NPAIR;
#pragma unroll
          for (int e = 0; e < NPAIR; e += 4) {
            const uint4 h = *reinterpret_cast<const uint4*>(hi32 + base + e);
            const uint4 l = *reinterpret_cast<const uint4*>(lo32 + base + e);
            bhi[e] = h.x; bhi[e + 1] = h.y; bhi[e + 2] = h.z; bhi[e + 3] = h.w;
            blo[e] = l.x; blo[e + 1] = l.y; blo[e + 2] = l.z; blo[e + 3] = l.w;
          }
        } else {
#pragma unroll
          for (int e = 0; e < NPAIR; ++e) { bhi[e] = 0; blo[e] = 0; }
        }
        z0 = 2 * qd < GQA ? zs[2 * qd] : 0.f;
        z1 = 2 * qd + 1 < GQA ? zs[2 * qd + 1] : 0.f;
      } else {
      float z = 0.f;
      if (g < GQA) {
        float qv[CPT], sv[CPT], zv[CPT];
        const float* qh = q_s + g * D + c0;
#pragma unroll
        for (int i = 0; i < CPT; i += 4) {
          const float4 v = *reinterpret_cast<const float4*>(qh + i);
          qv[i] = v.x; qv[i + 1] = v.y; qv[i + 2] = v.z; qv[i + 3] = v.w;
        }
        load_floats<S, CPT>(seg + OFF_SCALE + (blk * D + c0) * int(sizeof(S)), sv);
        load_floats<S, CPT>(seg + OFF_ZERO + (blk * D + c0) * int(sizeof(S)), zv);
#pragma unroll
        for (int i = 0; i < CPT; ++i) z = fmaf(qv[i], zv[i], z);
#pragma unroll
        for (int e = 0; e < NPAIR; ++e) {
          const int ca = M::pair_lo(e), cb = ca + CC;
          split_h2(qv[ca] * sv[ca], qv[cb] * sv[cb], bhi[e], blo[e]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < NPAIR; ++e) { bhi[e] = 0; blo[e] = 0; }
      }
      z += __shfl_xor_sync(0xffffffffu, z, 1);
      z += __shfl_xor_sync(0xffffffffu, z, 2);
      z0 = __shfl_sync(0xffffffffu, z, 8 * qd);
      z1 = __shfl_sync(0xffffffffu, z, 8 * qd + 4);
      }
      float c[4] = {z0, z1, z0, z1};
      const int t0 = mt * 16 + g;
      u32 a0[NPAIR], a1[NPAIR];
      row_pairs(seg + OFF_CODES + t0 * ROW + c0 * BITS / 8, a0, MASK);
      row_pairs(seg + OFF_CODES + (t0 + 8) * ROW + c0 * BITS / 8, a1, MASK);
#pragma unroll
      for (int j = 0; j < M::KS; ++j) {
        const u32 a[4] = {a0[2 * j], a1[2 * j], a0[2 * j + 1], a1[2 * j + 1]};
        const u32 bh[2] = {bhi[2 * j], bhi[2 * j + 1]}, bl[2] = {blo[2 * j], blo[2 * j + 1]};
        mma16816<false>(c, a, bh);
        mma16816<false>(c, a, bl);
      }
      store_mma_scores<GQA, P>(c, t0, len, qd, kp == 0 ? sc0 : sc1, kp == 0);
    }
  }
  // Per-warp decode (DecodeCta::compute_warp): the B fragments of token t's keys dequantised
  // to fp16 (code · scale + zero, one rounding: far below the code step), the thread's channel
  // slice [qd·D/4, (qd + 1)·D/4) with pair e = channels 2e, 2e + 1 (the fp16 keys' order, so
  // every tier of a variant shares one set of query fragments). A pair's codes lie in one code
  // byte (two for 8 bits): one PRMT puts them into the two halves' mantissas (adjacent_pairs),
  // and the pair's (scale, zero) are the u32s as they lie in memory. The order with codes 4
  // (16 / bits) channels apart took a shift per pair and a PRMT per scale pair and per zero
  // pair: 92 → 64 instructions per octet and lane for int4 keys. Dequantising the 8 tokens a
  // warp scores costs fewer instructions than folding the block's scales into its query (the
  // fold is per block, and every warp would repeat it).
  // The layout takes keys whose scale block spans the page: the thread's scale and zero pairs
  // are then loaded once per page (they were 8 of the octet's 10 key LDS.128, each 4
  // shared-memory wavefronts, and shared memory is as busy as the issue slots here). With
  // smaller blocks they are reloaded per octet, and fp32 scales are rounded to fp16 pairs:
  // seed 004's int8 keys (16-token blocks, fp32 scales) ran 12% slower per-warp than in the
  // block layout with tensor-core values (H100, 128K × 64: 13.9 vs 10.3 ms) and missed the
  // selftest tolerance (max abs 1.3e-3 vs 9.8e-4) (benches/NOTES.md, 2026-11-26 fourth session).
  static constexpr bool WARP = BLOCK >= P && D * BITS >= 128;
  // A warp's key reader for one page (constructed per page, called per octet).
  template <int NPAIR> struct WarpKeys {
    u32 s[NPAIR], z[NPAIR];
    __device__ __forceinline__ WarpKeys(const u8* seg, int qd) {
      const int c0 = qd * 2 * NPAIR;
      scale_pairs<NPAIR>(seg + OFF_SCALE + c0 * int(sizeof(S)), s);
      scale_pairs<NPAIR>(seg + OFF_ZERO + c0 * int(sizeof(S)), z);
    }
    __device__ __forceinline__ void operator()(const u8* seg, int t, int qd, u32 (&b)[NPAIR]) {
      static_assert(WARP && 2 * NPAIR * BITS / 8 >= 4, "whole code words per slice");
      adjacent_pairs<NPAIR>(seg + OFF_CODES + t * ROW + qd * 2 * NPAIR * BITS / 8, b);
#pragma unroll
      for (int e = 0; e < NPAIR; ++e) b[e] = h2_fma(b[e], s[e], z[e]);
    }
  };
  // The codes of channels 2e, 2e + 1 of a row slice as exact fp16 pairs. 8 bits: the two code
  // bytes beside the exponent byte 0x64 (1024 + c). 4 bits: the code byte in both halves, the
  // low code at mantissa bits 0-3 (1024 + c), the high one at 4-7 of the upper half (64 + c).
  // 2 bits: one byte holds two pairs; its four codes sit at bits 8-9 (4 + c) and 2-3 (256 + c)
  // for pair 2j, at 4-5 (64 + c) and 6-7 (16 + c) for pair 2j + 1. HSUB2 of the magic leaves
  // the codes.
  template <int N>
  __device__ __forceinline__ static void adjacent_pairs(const u8* p, u32 (&out)[N]) {
    constexpr int BYTES = N * 2 * BITS / 8;
    u32 w[BYTES / 4];
    load_words<BYTES>(p, w);
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if constexpr (BITS == 8) {
        out[e] = h2_unbias(__byte_perm(w[e / 2], 0x64646464u, (e & 1) ? 0x4342 : 0x4140), 0x64006400u);
      } else if constexpr (BITS == 4) {
        out[e] = h2_codes(__byte_perm(w[e / 4], 0u, (e % 4) * 0x1111), 0x00f0000fu, 0x54006400u);
      } else {
        const u32 x = __byte_perm(w[e / 8], 0u, ((e / 2) % 4) * 0x1111);
        out[e] = (e & 1) ? h2_codes(x, 0x00c00030u, 0x4c005400u) : h2_codes(x, 0x000c0300u, 0x5c004400u);
      }
    }
  }
  // NPAIR (scale or zero) pairs of adjacent channels.
  template <int NPAIR>
  __device__ __forceinline__ static void scale_pairs(const u8* p, u32 (&out)[NPAIR]) {
    if constexpr (sizeof(S) == 2) {
      load_words<4 * NPAIR>(p, out);
    } else {
      float f[2 * NPAIR];
      load_floats<S, 2 * NPAIR>(p, f);
#pragma unroll
      for (int e = 0; e < NPAIR; ++e) out[e] = pack2<false>(f[2 * e], f[2 * e + 1]);
    }
  }

  // The codes of one thread's row slice as exact fp16 pairs in pair_lo order.
  template <int N>
  __device__ __forceinline__ static void row_pairs(const u8* p, u32 (&out)[N], u32 mask) {
    constexpr int BYTES = N * 2 * BITS / 8;
    constexpr int CC = BYTES == 2 ? 4 : 16 / BITS;
    u32 w[BYTES >= 4 ? BYTES / 4 : 1];
    load_words<BYTES>(p, w);
    if constexpr (BYTES == 2) w[0] = __byte_perm(w[0], 0u, 0x4140);  // codes 0-3 | codes 4-7 << 16
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = h2_codes(w[e / CC] >> ((e % CC) * BITS), mask);
  }

  __device__ __forceinline__ static float dequant(const u8* seg, int t, int c, const float*, const float*, const u16*) {
    return ChannelCodes<BITS, BLOCK, S, D, P, OFF_CODES, OFF_SCALE, OFF_ZERO>::dequant(seg, t, c);
  }

  // Transcode slices are whole channels (a scale and zero per channel per block of tokens):
  // x [P][COLS] holds channels [c0, c0 + COLS); scratch: 2 * NBLK * COLS floats.
  static constexpr bool SLICE_CHANNELS = true;
  template <int NTHREADS, class Slice>
  __device__ static void encode(u8* seg, const float* x, int* scratch, Slice s, const float*, const float*, const u16*) {
    static_assert(Slice::ROWS == P && Slice::COLS % 8 == 0, "integer key slices are whole 8-channel chunks of every token");
    constexpr int L = lanes_for(NTHREADS, NBLK * Slice::COLS, BLOCK);
    ChannelCodes<BITS, BLOCK, S, D, P, OFF_CODES, OFF_SCALE, OFF_ZERO>::template encode<NTHREADS, L>(seg, x, Slice::COLS, 0, s.c0, Slice::COLS,
                                                                                                     reinterpret_cast<float*>(scratch));
  }
};

// Spherical keys (seed 000 App. B): per group an 8-bit radius code and a BITS-bit codeword
// index. Decode reads them and looks up LUT[h][j][i] = rscale_j · <q_j, c_i> with the
// unnormalised group query q_j (the paper's normalised q̃ with w_j = 1 does not approximate
// q·k): G lookups and G radius multiplies per token, no dense key is ever rebuilt.
template <int GROUP, int ABITS, int D, int P, int OFF_RADIUS, int OFF_INDEX>
struct SphericalKey {
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

// ---------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------

struct DropValue { static constexpr bool WARP = false; };

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

// Integer values with a scale and zero per token per group of GROUP channels.
template <int BITS, int GROUP, class S, int D, int P, int OFF_CODES, int OFF_SCALE, int OFF_ZERO>
struct IntValue {
  static constexpr int ROW = D * BITS / 8;
  static constexpr int NGRP = D / GROUP;
  static constexpr bool BF16 = false;

  // Transposed fp16 pairs for tensor-core value accumulation (see DenseValue::token_pairs):
  // out[k] = (v̂[ta][c0 + k], v̂[tb][c0 + k]), the N channels inside one value group. The codes
  // of the two tokens are interleaved by one PRMT per 16-bit chunk, each pair is pulled out by
  // one LOP3 as (1024 + c, 1024 + c'), and one HSUB2 + one HFMA2 with the two tokens' (scale,
  // zero) pairs give code · scale + zero rounded once to fp16. (Folding the code's bias into
  // the zero, zero − bias · scale in fp16, saves the HSUB2 but rounds that term: rdkv int2 then
  // missed the 2^-10 reference tolerance, 1.07e-3, on the H100.) The per-warp layout needs the
  // channels of a lane (head_dim / 8) inside one group.
  static constexpr bool WARP = GROUP % (D / 8) == 0;
  template <int N>
  __device__ __forceinline__ static void token_pairs(const u8* seg, int ta, int tb, int c0, u32 (&out)[N]) {
    constexpr int TB = N * BITS / 8;                       // code bytes per token
    constexpr int CCV = 16 / BITS < N ? 16 / BITS : N;     // codes per 16-bit chunk
    constexpr u32 MASK = ((1u << BITS) - 1) * 0x00010001u;
    static_assert(GROUP % N == 0, "a thread's channels share one value group");
    const int grp = c0 / GROUP;
    u32 wa[TB >= 4 ? TB / 4 : 1], wb[TB >= 4 ? TB / 4 : 1];
    load_words<TB>(seg + OFF_CODES + ta * ROW + c0 * BITS / 8, wa);
    load_words<TB>(seg + OFF_CODES + tb * ROW + c0 * BITS / 8, wb);
    u32 s2, z2;
    if constexpr (sizeof(S) == 2) {
      const u16* sp = reinterpret_cast<const u16*>(seg + OFF_SCALE);
      const u16* zp = reinterpret_cast<const u16*>(seg + OFF_ZERO);
      s2 = __byte_perm(sp[ta * NGRP + grp], sp[tb * NGRP + grp], 0x5410);
      z2 = __byte_perm(zp[ta * NGRP + grp], zp[tb * NGRP + grp], 0x5410);
    } else {
      const S* sp = reinterpret_cast<const S*>(seg + OFF_SCALE);
      const S* zp = reinterpret_cast<const S*>(seg + OFF_ZERO);
      s2 = pack2<false>(to_float(sp[ta * NGRP + grp]), to_float(sp[tb * NGRP + grp]));
      z2 = pack2<false>(to_float(zp[ta * NGRP + grp]), to_float(zp[tb * NGRP + grp]));
    }
#pragma unroll
    for (int ci = 0; ci < N / CCV; ++ci) {
      const u32 x = __byte_perm(wa[ci / 2], wb[ci / 2], (ci & 1) ? 0x7632 : 0x5410);
#pragma unroll
      for (int k = 0; k < CCV; ++k) out[ci * CCV + k] = h2_fma(h2_codes(x >> (k * BITS), MASK), s2, z2);
    }
  }
  // lo[k] = (v̂[t][c0+k], v̂[t+1][c0+k]), hi[k] = (v̂[t+2][c0+k], v̂[t+3][c0+k]).
  template <int N>
  __device__ __forceinline__ static void pairs(const u8* seg, int t, int c0, u32 (&lo)[N], u32 (&hi)[N]) {
    token_pairs<N>(seg, t, t + 1, c0, lo);
    token_pairs<N>(seg, t + 2, t + 3, c0, hi);
  }

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

  // Codes tokens [t0, t0 + ROWS) of a transcode slice from x [ROWS][D]. L lanes share each
  // (token, group): its min/max, then its code bytes (see lanes_for).
  template <int NTHREADS, class Slice>
  __device__ static void encode(u8* seg, const float* x, Slice s) {
    static_assert(Slice::COLS == D, "value slices are whole tokens");
    constexpr int GBYTES = GROUP * BITS / 8, ITEMS = Slice::ROWS * NGRP;
    constexpr int L = lanes_for(NTHREADS, ITEMS, GROUP);
    for_lane_items<NTHREADS, L>(ITEMS, [&](int i, bool on, int lane) {
      const int tt = on ? i / NGRP : 0, grp = on ? i % NGRP : 0;
      const float* xs = x + tt * D + grp * GROUP;
      float mn = xs[lane], mx = mn;
      for (int c = lane + L; c < GROUP; c += L) { mn = fminf(mn, xs[c]); mx = fmaxf(mx, xs[c]); }
      lanes_minmax<L>(mn, mx);
      if (!on) return;
      const S s_st = from_float<S>((mx - mn) / float((1 << BITS) - 1));
      const S z_st = from_float<S>(mn);
      const int t = s.t0 + tt;
      if (lane == 0) {
        reinterpret_cast<S*>(seg + OFF_SCALE)[t * NGRP + grp] = s_st;
        reinterpret_cast<S*>(seg + OFF_ZERO)[t * NGRP + grp] = z_st;
      }
      const float sc = to_float(s_st), zr = to_float(z_st);
      u8* out = seg + OFF_CODES + t * ROW + grp * GBYTES;
      for (int byte = lane; byte < GBYTES; byte += L)
        out[byte] = pack_byte<BITS>(byte, [&](int c) { return quantize<BITS>(xs[c], sc, zr); });
    });
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
